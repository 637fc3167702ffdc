// The needle corpus: a synthetic world (people, companies, cities, projects, countries with
// made-up names and facts) written out as documents, and one multi-hop question over it.
//
// Everything is a pure function of (options, seed): the same inputs give byte-identical
// documents, question and answer on every machine (own RNG, no std distributions).
//
// Documents are of three kinds:
//   - entity pages: the authoritative facts about one entity, in varied sentences, padded with
//     harmless colour (awards, hobbies, offices opened, visits) that never restates a relation;
//   - notices: corrections and forum threads that quote near-miss facts ("an earlier edition
//     said X was mentored by Y; that was wrong"), always including one per hop of the question;
//   - reports: minutes and reviews that mention many entities in passing (the bulk, some long).
// Near-miss names are common: people share first names and differ by one vowel in the surname,
// companies share roots with different suffixes.
//
// The question chains `hops` relations from a named start entity ("What is the name of the
// company founded by the mentor of Ilsa Varkon?"). Hop k's gold document is the page of the
// k-th entity on the chain, whose page states the k-th relation.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace odyssey::needle {

struct CorpusOptions {
  uint64_t target_bytes = 1000000;  // titles + texts, within a few percent
  uint32_t documents = 1000;
  uint32_t hops = 2;
};

struct Document {
  std::string id;  // "d000042"; ids are a random permutation, so they reveal nothing
  std::string title;
  std::string text;
};

struct GoldHop {
  uint32_t doc = 0;  // index into Corpus::docs of the page that states this hop's fact
  std::string entity;  // the page's entity
  std::string fact;    // the sentence on that page
};

struct Corpus {
  std::vector<Document> docs;  // docs[i].id == "d" + 6-digit i
  std::string question;
  std::string answer;
  std::vector<GoldHop> chain;  // one per hop, in order
  uint64_t bytes = 0;          // sum of title and text sizes
};

// Throws std::invalid_argument when the options cannot make a world (too few documents for
// the hops, or too few bytes per document).
Corpus generate_corpus(const CorpusOptions& options, uint64_t seed);

// The question and answer generate_corpus(options, seed) makes, without writing documents
// (microseconds; for choosing a task's split by its content).
std::pair<std::string, std::string> generate_question(const CorpusOptions& options, uint64_t seed);

// The smallest document count generate_corpus accepts for `hops`.
uint32_t min_documents(uint32_t hops);

}  // namespace odyssey::needle
