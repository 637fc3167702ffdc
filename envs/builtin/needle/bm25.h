// A BM25 (Okapi, k1 = 1.2, b = 0.75) inverted index over documents' titles and texts.
//
// Terms are maximal runs of ASCII letters and digits, lowercased. build() makes one pass over
// the text (postings are appended in document order, so a term's frequency in the current
// document is its last posting); search() scores only the postings of the query's terms, into
// a dense per-document array, and returns the top k by score (ties: lower document first).
// Immutable after build(): search() may be called from several threads.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "corpus.h"

namespace odyssey::needle {

class Bm25Index {
 public:
  struct Hit {
    uint32_t doc;
    double score;
  };

  void build(const std::vector<Document>& docs);

  // The best `k` documents for `query`; *matched (if given) is how many documents contain at
  // least one query term.
  std::vector<Hit> search(std::string_view query, size_t k, size_t* matched = nullptr) const;

  // The distinct lowercased terms of `text`, in order of first appearance.
  static std::vector<std::string> terms(std::string_view text);

  size_t term_count() const { return postings_.size(); }

 private:
  struct Posting {
    uint32_t doc;
    uint32_t tf;
  };
  std::unordered_map<std::string, uint32_t> ids_;
  std::vector<std::vector<Posting>> postings_;
  std::vector<uint32_t> length_;
  double average_length_ = 0;
};

}  // namespace odyssey::needle
