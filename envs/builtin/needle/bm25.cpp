#include "bm25.h"

#include <algorithm>
#include <cmath>

namespace odyssey::needle {
namespace {

constexpr double kK1 = 1.2;
constexpr double kB = 0.75;

bool is_word(char c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9'); }
char lower(char c) { return (c >= 'A' && c <= 'Z') ? static_cast<char>(c - 'A' + 'a') : c; }

// Calls fn(term) for every term of text; `term` is a reused buffer.
template <class Fn>
void for_each_term(std::string_view text, std::string& term, Fn&& fn) {
  size_t i = 0;
  while (i < text.size()) {
    while (i < text.size() && !is_word(text[i])) ++i;
    if (i == text.size()) break;
    term.clear();
    while (i < text.size() && is_word(text[i])) term += lower(text[i++]);
    fn(term);
  }
}

}  // namespace

void Bm25Index::build(const std::vector<Document>& docs) {
  ids_.clear();
  postings_.clear();
  length_.assign(docs.size(), 0);
  ids_.reserve(1 << 14);
  uint64_t total = 0;
  std::string term;
  for (uint32_t d = 0; d < docs.size(); ++d) {
    uint32_t length = 0;
    auto add = [&](const std::string& t) {
      ++length;
      auto [it, inserted] = ids_.try_emplace(t, static_cast<uint32_t>(postings_.size()));
      if (inserted) postings_.emplace_back();
      std::vector<Posting>& list = postings_[it->second];
      if (!list.empty() && list.back().doc == d)
        ++list.back().tf;
      else
        list.push_back({d, 1});
    };
    for_each_term(docs[d].title, term, add);
    for_each_term(docs[d].text, term, add);
    length_[d] = length;
    total += length;
  }
  average_length_ = docs.empty() ? 1.0 : std::max(1.0, static_cast<double>(total) / static_cast<double>(docs.size()));
}

std::vector<std::string> Bm25Index::terms(std::string_view text) {
  std::vector<std::string> out;
  std::string term;
  for_each_term(text, term, [&](const std::string& t) {
    if (std::find(out.begin(), out.end(), t) == out.end()) out.push_back(t);
  });
  return out;
}

std::vector<Bm25Index::Hit> Bm25Index::search(std::string_view query, size_t k, size_t* matched) const {
  const double n = static_cast<double>(length_.size());
  std::vector<double> scores(length_.size(), 0.0);
  std::vector<uint32_t> touched;
  for (const std::string& t : terms(query)) {
    const auto it = ids_.find(t);
    if (it == ids_.end()) continue;
    const std::vector<Posting>& list = postings_[it->second];
    const double df = static_cast<double>(list.size());
    const double idf = std::log(1.0 + (n - df + 0.5) / (df + 0.5));
    for (const Posting& p : list) {
      if (scores[p.doc] == 0.0) touched.push_back(p.doc);
      const double tf = p.tf;
      const double norm = kK1 * (1.0 - kB + kB * length_[p.doc] / average_length_);
      scores[p.doc] += idf * tf * (kK1 + 1.0) / (tf + norm);
    }
  }
  if (matched != nullptr) *matched = touched.size();
  std::vector<Hit> hits;
  hits.reserve(touched.size());
  for (const uint32_t d : touched) hits.push_back({d, scores[d]});
  const auto better = [](const Hit& a, const Hit& b) { return a.score != b.score ? a.score > b.score : a.doc < b.doc; };
  const size_t top = std::min(k, hits.size());
  std::partial_sort(hits.begin(), hits.begin() + static_cast<std::ptrdiff_t>(top), hits.end(), better);
  hits.resize(top);
  return hits;
}

}  // namespace odyssey::needle
