#include "corpus.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <stdexcept>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "odyssey/env_util.hpp"

namespace odyssey::needle {
namespace {

// The stream corpora are drawn from (<odyssey/env_util.hpp>: the same on every platform).
using Rng = env::Xoshiro256;

// ---- vocabulary --------------------------------------------------------------------------

const char* const kOnsets[] = {"b",  "c",  "d",  "f",  "g",  "h",  "k",  "l",  "m",  "n",
                               "p",  "r",  "s",  "t",  "v",  "z",  "br", "dr", "kr", "st",
                               "th", "tr", "sh", "gr", "pl", "w",  "j",  "qu", "sk", "fl"};
const char* const kVowels[] = {"a", "e", "i", "o", "u", "a", "e", "o", "ai", "ei", "ou", "ia"};
const char* const kCodas[] = {"", "", "n", "r", "s", "l", "th", "nd", "rk", "x", "m", "v", "ck", "lt"};
const char* const kCompanySuffixes[] = {"Labs",     "Works",    "Systems", "Dynamics", "Holdings", "Foundry",
                                        "Analytics", "Robotics", "Logistics", "Textiles", "Shipping", "Energy"};
const char* const kCitySuffixes[] = {"", "", "", "port", "ford", "vale", "haven", "burg", "mouth", "field"};
const char* const kCountrySuffixes[] = {"ia", "land", "ar", "estan", "ovia", "ia"};
const char* const kProfessions[] = {"engineer", "historian", "architect", "chemist", "economist", "composer",
                                    "cartographer", "linguist", "surgeon", "botanist", "pilot", "sculptor",
                                    "statistician", "geologist", "journalist", "designer"};
const char* const kTopics[] = {"tidal energy",       "medieval trade routes", "protein folding",
                               "urban rail",         "glass manufacturing",   "river ecology",
                               "cryptography",       "textile dyes",          "satellite imaging",
                               "soil chemistry",     "public archives",       "wind tunnels",
                               "coastal erosion",    "battery recycling",     "folk music",
                               "bridge design",      "weather forecasting",   "ancient coinage",
                               "water purification", "typography",            "migratory birds",
                               "ceramic glazes",     "harbour logistics",     "seed banks"};
const char* const kHobbies[] = {"sailing", "chess", "birdwatching", "pottery", "long-distance running",
                                "beekeeping", "calligraphy", "rock climbing", "baking bread", "astronomy"};
const char* const kAdjectives[] = {"patient", "meticulous", "ambitious", "generous", "curious", "stubborn",
                                   "cheerful", "quiet", "inventive", "outspoken", "careful", "restless"};
const char* const kIndustries[] = {"logistics", "pharmaceuticals", "agriculture", "software", "shipbuilding",
                                   "renewable energy", "textiles", "mining", "publishing", "aerospace"};
const char* const kFeatures[] = {"covered markets", "stone bridges", "botanical gardens", "lighthouses",
                                 "canals", "night markets", "clock towers", "public baths", "old harbours"};
const char* const kAwardKinds[] = {"Prize", "Medal", "Award", "Fellowship"};
const char* const kGroups[] = {"committee", "working group", "council", "steering board", "panel"};

// ---- the world ---------------------------------------------------------------------------

enum Kind : uint8_t { kPerson, kCompany, kCity, kProject, kCountry };
enum Rel : uint8_t {
  kMentor,        // person -> person
  kBirthplace,    // person -> city
  kEmployer,      // person -> company
  kFounded,       // person -> company (founders only)
  kHeadquarters,  // company -> city
  kFounder,       // company -> person
  kCeo,           // company -> person
  kLead,          // project -> person
  kSponsor,       // project -> company
  kMayor,         // city -> person
  kLiesIn,        // city -> country
  kCapital,       // country -> city
  kRelCount
};

struct Entity {
  Kind kind = kPerson;
  std::string name;
  std::array<int32_t, kRelCount> rel;
  int year = 0;
  uint32_t page = 0;  // doc index of its page
  int32_t twin = -1;  // an entity with a near-miss name, if any
};

// Concatenation whose parts are evaluated left to right (a braced list is sequenced; operands
// of + are not), so the RNG draws happen in the same order with every compiler.
std::string cat(std::initializer_list<std::string_view> parts) {
  size_t n = 0;
  for (std::string_view p : parts) n += p.size();
  std::string out;
  out.reserve(n);
  for (std::string_view p : parts) out += p;
  return out;
}

void add(std::string& out, std::initializer_list<std::string_view> parts) {
  for (std::string_view p : parts) out += p;
}

std::string capitalized(std::string s) {
  if (!s.empty() && s[0] >= 'a' && s[0] <= 'z') s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}

std::string word(Rng& rng, int syllables) {
  std::string w;
  for (int i = 0; i < syllables; ++i) {
    w += rng.pick(kOnsets);
    w += rng.pick(kVowels);
    if (i + 1 == syllables || rng.chance(0.2)) w += rng.pick(kCodas);
  }
  return capitalized(w);
}

// One vowel changed: "Varkon" -> "Varkan".
std::string near_miss(Rng& rng, const std::string& w) {
  static const char kPlain[] = "aeiou";
  std::vector<size_t> vowels;
  for (size_t i = 0; i < w.size(); ++i)
    if (std::strchr(kPlain, w[i] | 0x20) != nullptr) vowels.push_back(i);
  std::string out = w;
  if (vowels.empty()) return out + "e";
  const size_t at = vowels[rng.below(static_cast<uint32_t>(vowels.size()))];
  char c = out[at];
  while (c == out[at]) c = kPlain[rng.below(5)];
  out[at] = (w[at] >= 'A' && w[at] <= 'Z') ? static_cast<char>(c - 'a' + 'A') : c;
  return out;
}

std::string lowered(const std::string& s) {
  std::string out = s;
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

class WorldBuilder {
 public:
  WorldBuilder(const CorpusOptions& options, uint64_t seed) : options_(options), rng_(seed) {}

  // The world and its question (cheap: no documents yet).
  void plan() {
    make_entities(options_.documents * 6 / 10);
    link_entities();
    choose_question();
  }

  // The documents, after plan().
  Corpus write() {
    const uint32_t d = options_.documents;
    const uint32_t entity_pages = d * 6 / 10;
    const uint32_t notices = std::max<uint32_t>(options_.hops, d * 15 / 100);
    const uint32_t reports = d - entity_pages - notices;
    avg_doc_ = static_cast<double>(options_.target_bytes) / d;
    for (uint32_t i = 0; i < entities_.size(); ++i) write_page(i);
    for (uint32_t i = 0; i < notices; ++i) write_notice(i < options_.hops ? static_cast<int>(i) : -1);
    write_reports(reports);
    return finish();
  }

  const std::string& question() const { return question_; }
  const std::string& answer() const { return answer_; }

 private:
  // Names unique over the whole world (case-insensitive).
  bool claim(const std::string& name) { return used_names_.insert(lowered(name)).second; }

  std::string fresh(Kind kind, int32_t* twin_of) {
    *twin_of = -1;
    for (int attempt = 0;; ++attempt) {
      std::string name;
      const auto& same = by_kind_[kind];
      const bool twin = !same.empty() && rng_.chance(0.35) && attempt < 20;
      const int32_t base = twin ? same[rng_.below(static_cast<uint32_t>(same.size()))] : -1;
      switch (kind) {
        case kPerson:
          if (twin) {  // same first name, surname one vowel apart
            const std::string& b = entities_[base].name;
            const size_t space = b.find(' ');
            name = b.substr(0, space) + " " + near_miss(rng_, b.substr(space + 1));
          } else {
            std::string first = word(rng_, rng_.range(1, 2));
            name = first + " " + word(rng_, rng_.range(2, 3));
          }
          break;
        case kCompany:
          if (twin) {  // same root, another suffix
            const std::string& b = entities_[base].name;
            name = b.substr(0, b.find(' ')) + " " + rng_.pick(kCompanySuffixes);
          } else {
            name = cat({word(rng_, rng_.range(2, 3)), " ", rng_.pick(kCompanySuffixes)});
          }
          break;
        case kCity:
          name = twin ? near_miss(rng_, entities_[base].name) : cat({word(rng_, rng_.range(1, 2)), rng_.pick(kCitySuffixes)});
          break;
        case kProject:
          name = twin ? "Project " + near_miss(rng_, entities_[base].name.substr(8)) : "Project " + word(rng_, 2);
          break;
        case kCountry:
          name = cat({word(rng_, rng_.range(1, 2)), rng_.pick(kCountrySuffixes)});
          break;
      }
      if (claim(name)) {
        *twin_of = base;
        return name;
      }
    }
  }

  void make_entities(uint32_t pages) {
    const uint32_t countries = std::max<uint32_t>(2, pages * 5 / 100);
    const uint32_t cities = std::max<uint32_t>(3, pages * 15 / 100);
    const uint32_t companies = std::max<uint32_t>(3, pages * 20 / 100);
    const uint32_t projects = std::max<uint32_t>(2, pages * 10 / 100);
    const uint32_t persons = pages - countries - cities - companies - projects;
    const std::pair<Kind, uint32_t> plan[] = {
        {kCountry, countries}, {kCity, cities}, {kCompany, companies}, {kProject, projects}, {kPerson, persons}};
    for (const auto& [kind, count] : plan) {
      for (uint32_t i = 0; i < count; ++i) {
        Entity e;
        e.kind = kind;
        e.rel.fill(-1);
        e.name = fresh(kind, &e.twin);
        e.year = kind == kPerson ? rng_.range(1940, 1995) : rng_.range(1820, 2015);
        const int32_t id = static_cast<int32_t>(entities_.size());
        if (e.twin >= 0 && entities_[e.twin].twin < 0) entities_[e.twin].twin = id;
        entities_.push_back(std::move(e));
        by_kind_[kind].push_back(id);
      }
    }
  }

  int32_t any(Kind kind) {
    const auto& v = by_kind_[kind];
    return v[rng_.below(static_cast<uint32_t>(v.size()))];
  }

  void link_entities() {
    const auto& countries = by_kind_[kCountry];
    std::vector<int32_t> cities = by_kind_[kCity];
    rng_.shuffle(cities);
    for (size_t i = 0; i < cities.size(); ++i) {
      const int32_t country = countries[i % countries.size()];
      entities_[cities[i]].rel[kLiesIn] = country;
      if (i < countries.size()) entities_[country].rel[kCapital] = cities[i];
    }
    std::vector<int32_t> people = by_kind_[kPerson];
    rng_.shuffle(people);
    for (const int32_t p : by_kind_[kPerson]) {
      Entity& e = entities_[p];
      e.rel[kBirthplace] = any(kCity);
      e.rel[kEmployer] = any(kCompany);
      do e.rel[kMentor] = any(kPerson);
      while (e.rel[kMentor] == p);
    }
    const auto& companies = by_kind_[kCompany];
    for (size_t i = 0; i < companies.size(); ++i) {
      Entity& c = entities_[companies[i]];
      const int32_t founder = people[i % people.size()];
      const int32_t ceo = people[(companies.size() + i) % people.size()];
      c.rel[kFounder] = founder;
      entities_[founder].rel[kFounded] = companies[i];
      c.rel[kCeo] = ceo;
      entities_[ceo].rel[kEmployer] = companies[i];
      c.rel[kHeadquarters] = any(kCity);
    }
    const auto& cities_by_id = by_kind_[kCity];
    for (size_t i = 0; i < cities_by_id.size(); ++i)
      entities_[cities_by_id[i]].rel[kMayor] = people[(2 * companies.size() + i) % people.size()];
    for (const int32_t p : by_kind_[kProject]) {
      entities_[p].rel[kLead] = any(kPerson);
      entities_[p].rel[kSponsor] = any(kCompany);
    }
  }

  // ---- sentences ----

  // A clause stating relation r of s (no final period); variant picks the wording.
  std::string clause(Rel r, const std::string& s, const std::string& o, uint32_t variant) {
    switch (r) {
      case kMentor:
        return variant == 0 ? s + " was mentored by " + o
               : variant == 1 ? s + " trained under " + o
                              : "the mentor of " + s + " was " + o;
      case kBirthplace:
        return variant == 0 ? s + " was born in " + o
               : variant == 1 ? "the birthplace of " + s + " is " + o
                              : s + " is a native of " + o;
      case kEmployer:
        return variant == 0 ? s + " works for " + o
               : variant == 1 ? s + " is employed by " + o
                              : s + " holds a position at " + o;
      case kFounded:
        return variant == 0 ? s + " founded " + o
               : variant == 1 ? s + " is the founder of " + o
                              : s + " established " + o;
      case kHeadquarters:
        return variant == 0 ? s + " is headquartered in " + o
               : variant == 1 ? "the head office of " + s + " is in " + o
                              : s + " has its headquarters in " + o;
      case kFounder:
        return variant == 0 ? s + " was founded by " + o
               : variant == 1 ? s + " was established by " + o
                              : "the founder of " + s + " is " + o;
      case kCeo:
        return variant == 0 ? "the chief executive of " + s + " is " + o
               : variant == 1 ? s + " is run by chief executive " + o
                              : o + " serves as chief executive of " + s;
      case kLead:
        return variant == 0 ? s + " is led by " + o
               : variant == 1 ? "the lead engineer of " + s + " is " + o
                              : o + " leads " + s;
      case kSponsor:
        return variant == 0 ? s + " is sponsored by " + o
               : variant == 1 ? s + " receives its funding from its sponsor " + o
                              : "the sponsor of " + s + " is " + o;
      case kMayor:
        return variant == 0 ? "the mayor of " + s + " is " + o
               : variant == 1 ? s + " is governed by mayor " + o
                              : o + " serves as mayor of " + s;
      case kLiesIn:
        return variant == 0 ? s + " is a city in " + o
               : variant == 1 ? s + " lies in " + o
                              : s + " is located in the country of " + o;
      case kCapital:
        return variant == 0 ? "the capital of " + s + " is " + o
               : variant == 1 ? o + " is the capital of " + s
                              : s + " has its capital at " + o;
      case kRelCount:
        break;
    }
    return {};
  }

  static std::string question_phrase(Rel r, const std::string& x) {
    switch (r) {
      case kMentor: return "the mentor of " + x;
      case kBirthplace: return "the city where " + x + " was born";
      case kEmployer: return "the company that employs " + x;
      case kFounded: return "the company founded by " + x;
      case kHeadquarters: return "the city where " + x + " is headquartered";
      case kFounder: return "the founder of " + x;
      case kCeo: return "the chief executive of " + x;
      case kLead: return "the lead engineer of " + x;
      case kSponsor: return "the sponsor of " + x;
      case kMayor: return "the mayor of " + x;
      case kLiesIn: return "the country in which " + x + " lies";
      case kCapital: return "the capital of " + x;
      case kRelCount: break;
    }
    return x;
  }

  std::string award() {
    std::string w = word(rng_, 2);
    return cat({w, " ", rng_.pick(kAwardKinds)});
  }
  const std::string& name_of(Kind kind) { return entities_[any(kind)].name; }
  std::string year(int lo, int hi) { return std::to_string(rng_.range(lo, hi)); }
  std::string number(int lo, int hi) { return std::to_string(rng_.range(lo, hi)); }

  // A sentence of colour about entity `id`: never a relation the questions use. Attributes
  // (population, budget, start year, ...) are stated at most once per page, tracked in `used`.
  void colour(std::string& out, int32_t id, uint32_t& used) {
    const Entity& e = entities_[id];
    const std::string& s = e.name;
    static constexpr uint32_t kSentences[] = {8, 6, 5, 5, 4};  // choices per kind
    static constexpr uint32_t kOnce[] = {0, 0b000011, 0b00001, 0b00101, 0b0011};
    uint32_t choice = 0;
    for (int tries = 0; tries < 16; ++tries) {
      choice = rng_.below(kSentences[e.kind]);
      if (!(kOnce[e.kind] >> choice & 1) || !(used >> choice & 1)) break;
    }
    if (kOnce[e.kind] >> choice & 1 && used >> choice & 1) choice = kSentences[e.kind] - 1;  // a repeatable one
    used |= 1u << choice;
    switch (e.kind) {
      case kPerson:
        switch (choice) {
          case 0: add(out, {s, " is known for work on ", rng_.pick(kTopics), "."}); break;
          case 1: add(out, {"In ", year(1960, 2023), ", ", s, " received the ", award(), "."}); break;
          case 2: add(out, {s, " enjoys ", rng_.pick(kHobbies), "."}); break;
          case 3: add(out, {s, " has published ", number(3, 90), " papers on ", rng_.pick(kTopics), "."}); break;
          case 4: add(out, {"Colleagues describe ", s, " as ", rng_.pick(kAdjectives), " and ", rng_.pick(kAdjectives), "."}); break;
          case 5: add(out, {s, " spoke at a conference on ", rng_.pick(kTopics), " in ", year(1960, 2023), "."}); break;
          case 6: add(out, {s, " once collaborated with ", name_of(kPerson), " on a study of ", rng_.pick(kTopics), "."}); break;
          default: add(out, {s, " visited ", name_of(kCity), " in ", year(1960, 2023), " to study ", rng_.pick(kTopics), "."}); break;
        }
        break;
      case kCompany:
        switch (choice) {
          case 0: add(out, {s, " employs about ", number(20, 40000), " people."}); break;
          case 1: add(out, {s, " operates in ", rng_.pick(kIndustries), "."}); break;
          case 2: add(out, {"In ", year(1960, 2023), ", ", s, " opened a branch office in ", name_of(kCity), "."}); break;
          case 3: add(out, {s, " reported revenue of ", number(2, 900), " million in ", year(1960, 2023), "."}); break;
          case 4: add(out, {s, " partnered with ", name_of(kCompany), " on ", rng_.pick(kTopics), "."}); break;
          default: add(out, {s, " won the ", award(), " in ", year(1960, 2023), "."}); break;
        }
        break;
      case kCity:
        switch (choice) {
          case 0: add(out, {s, " has a population of about ", number(2000, 3000000), "."}); break;
          case 1: add(out, {"The ", word(rng_, 2), " river runs through ", s, "."}); break;
          case 2: add(out, {s, " is known for its ", rng_.pick(kFeatures), "."}); break;
          case 3: add(out, {s, " hosted a fair on ", rng_.pick(kTopics), " in ", year(1960, 2023), "."}); break;
          default: add(out, {name_of(kPerson), " gave a public lecture in ", s, " in ", year(1960, 2023), "."}); break;
        }
        break;
      case kProject:
        switch (choice) {
          case 0: add(out, {s, " began in ", std::to_string(e.year), "."}); break;
          case 1: add(out, {s, " studies ", rng_.pick(kTopics), "."}); break;
          case 2: add(out, {s, " has a budget of ", number(1, 300), " million."}); break;
          case 3: add(out, {s, " shared data with ", name_of(kCompany), " in ", year(1960, 2023), "."}); break;
          default: add(out, {name_of(kPerson), " reviewed the results of ", s, " in ", year(1960, 2023), "."}); break;
        }
        break;
      case kCountry:
        switch (choice) {
          case 0: add(out, {s, " has a population of about ", number(1, 90), " million."}); break;
          case 1: add(out, {"The official language of ", s, " is ", word(rng_, 2), "ish."}); break;
          case 2: add(out, {s, " is known for ", rng_.pick(kIndustries), "."}); break;
          default: add(out, {s, " signed a trade agreement with ", name_of(kCountry), " in ", year(1960, 2023), "."}); break;
        }
        break;
    }
  }

  // A sentence for reports: mentions entities in passing, states no relation.
  void passing(std::string& out) {
    switch (rng_.below(8)) {
      case 0: add(out, {name_of(kPerson), " presented an update on ", rng_.pick(kTopics), "."}); break;
      case 1: add(out, {"The ", rng_.pick(kGroups), " noted growing interest in ", rng_.pick(kTopics), "."}); break;
      case 2: add(out, {name_of(kPerson), " and ", name_of(kPerson), " discussed ", rng_.pick(kTopics), "."}); break;
      case 3: add(out, {"A delegation from ", name_of(kCity), " asked about ", rng_.pick(kTopics), "."}); break;
      case 4: add(out, {name_of(kCompany), " submitted a report on ", rng_.pick(kTopics), "."}); break;
      case 5: add(out, {"Members agreed to revisit ", rng_.pick(kTopics), " in ", year(1960, 2023), "."}); break;
      case 6: add(out, {name_of(kProject), " was mentioned as an example of ", rng_.pick(kTopics), "."}); break;
      default: add(out, {"Visitors from ", name_of(kCountry), " toured the ", rng_.pick(kFeatures), "."}); break;
    }
  }

  size_t target(double fraction) {
    return static_cast<size_t>(avg_doc_ * fraction * (0.6 + 0.8 * rng_.unit()));
  }

  void add_doc(std::string title, std::string text) { docs_.push_back({std::string(), std::move(title), std::move(text)}); }

  std::string intro(const Entity& e) {
    switch (e.kind) {
      case kPerson: return cat({e.name, " is ", rng_.chance(0.5) ? "a " : "an acclaimed ", rng_.pick(kProfessions), "."});
      case kCompany: return cat({e.name, " is a company founded in ", std::to_string(e.year), "."});
      case kCity: return e.name + " is a city with a long history.";
      case kProject: return cat({e.name, " is a research project on ", rng_.pick(kTopics), "."});
      case kCountry: return e.name + " is a country.";
    }
    return e.name + ".";
  }

  void write_page(uint32_t id) {
    Entity& e = entities_[id];
    e.page = static_cast<uint32_t>(docs_.size());
    std::vector<std::string> sentences;
    for (int r = 0; r < kRelCount; ++r) {
      if (e.rel[r] < 0) continue;
      std::string s = capitalized(clause(static_cast<Rel>(r), e.name, entities_[e.rel[r]].name, rng_.below(3))) + ".";
      facts_[{id, r}] = s;
      sentences.push_back(std::move(s));
    }
    const size_t want = target(0.8);
    const size_t colours = std::max<size_t>(2, want / 70);
    uint32_t used = 0;
    for (size_t i = 0; i < colours; ++i) {
      std::string s;
      colour(s, static_cast<int32_t>(id), used);
      sentences.push_back(std::move(s));
    }
    rng_.shuffle(sentences);
    std::string text = intro(e);
    for (const std::string& s : sentences) {
      text += ' ';
      text += s;
    }
    while (text.size() < want) {
      text += ' ';
      colour(text, static_cast<int32_t>(id), used);
    }
    add_doc(e.name, std::move(text));
  }

  // Hop `hop` (0-based) of the question, or -1: any relation of any entity.
  void write_notice(int hop) {
    int32_t subject;
    Rel r;
    if (hop >= 0) {
      subject = chain_[hop];
      r = chain_rels_[hop];
    } else {
      do {
        subject = static_cast<int32_t>(rng_.below(static_cast<uint32_t>(entities_.size())));
        r = static_cast<Rel>(rng_.below(kRelCount));
      } while (entities_[subject].rel[r] < 0);
    }
    const int32_t truth = entities_[subject].rel[r];
    // The near miss: usually the true object's twin, else another entity of its kind.
    int32_t wrong = entities_[truth].twin;
    if (wrong < 0 || wrong == subject || rng_.chance(0.3)) {
      wrong = -1;
      for (int i = 0; i < 100 && wrong < 0; ++i) {
        const int32_t candidate = any(entities_[truth].kind);
        if (candidate != truth && candidate != subject) wrong = candidate;
      }
    }
    const std::string& s = entities_[subject].name;
    const std::string year = std::to_string(rng_.range(1990, 2023));
    std::string title;
    std::string text;
    switch (rng_.below(3)) {
      case 0:
        title = "Correction notice " + std::to_string(rng_.range(100, 9999));
        text = "This notice corrects errors in earlier bulletins.";
        break;
      case 1:
        title = "Forum thread: a question about " + s;
        text = "A reader wrote in with questions about " + s + ".";
        break;
      default:
        title = "Bulletin errata, " + year;
        text = "The editors list the errata of the " + year + " bulletin.";
        break;
    }
    std::vector<std::string> claims;
    if (wrong >= 0) claims.push_back(retraction(r, s, entities_[wrong].name));
    // A couple more retracted claims about random entities, so the gold one does not stand out.
    for (int extra = rng_.range(1, 3); extra > 0; --extra) {
      int32_t other;
      Rel q;
      do {
        other = static_cast<int32_t>(rng_.below(static_cast<uint32_t>(entities_.size())));
        q = static_cast<Rel>(rng_.below(kRelCount));
      } while (entities_[other].rel[q] < 0);
      const int32_t t = entities_[other].rel[q];
      int32_t w = entities_[t].twin >= 0 ? entities_[t].twin : any(entities_[t].kind);
      if (w == t || w == other) continue;
      claims.push_back(retraction(q, entities_[other].name, entities_[w].name));
    }
    rng_.shuffle(claims);
    for (const std::string& c : claims) {
      text += ' ';
      text += c;
    }
    const size_t want = target(0.6);
    while (text.size() < want) {
      text += ' ';
      passing(text);
    }
    add_doc(std::move(title), std::move(text));
  }

  std::string retraction(Rel r, const std::string& s, const std::string& wrong) {
    const std::string c = clause(r, s, wrong, rng_.below(3));
    switch (rng_.below(3)) {
      case 0: return "An earlier edition of this bulletin stated that " + c + "; that statement was wrong and has been withdrawn.";
      case 1: return "A reader asked whether " + c + ". Nobody could confirm it, and the registry says otherwise.";
      default: return "Some early drafts claimed that " + c + ", but the claim was false.";
    }
  }

  void write_reports(uint32_t count) {
    uint64_t used = 0;
    for (const Document& d : docs_) used += d.title.size() + d.text.size();
    const double remaining = options_.target_bytes > used ? static_cast<double>(options_.target_bytes - used) : 0.0;
    std::vector<double> weights(count);
    double total = 0;
    for (double& w : weights) {
      w = -std::log(1.0 - rng_.unit());
      if (rng_.chance(0.04)) w *= 8.0;  // a few long ones, to page through
      total += w;
    }
    for (uint32_t i = 0; i < count; ++i) {
      const std::string year = std::to_string(rng_.range(1970, 2023));
      std::string title;
      switch (rng_.below(4)) {
        case 0: title = cat({"Minutes of the ", rng_.pick(kTopics), " ", rng_.pick(kGroups), ", ", year}); break;
        case 1: title = "Annual review: " + std::string(rng_.pick(kIndustries)) + " in " + year; break;
        case 2: title = "Field notes from " + name_of(kCity); break;
        default: title = "Conference proceedings: " + std::string(rng_.pick(kTopics)) + " (" + year + ")"; break;
      }
      const double share = total > 0 ? remaining * weights[i] / total : 0.0;
      const size_t want = std::max<size_t>(200, static_cast<size_t>(share) > title.size() ? static_cast<size_t>(share) - title.size() : 0);
      std::string text;
      text.reserve(want + 200);
      int in_paragraph = 0;
      while (text.size() < want) {
        if (!text.empty()) text += ++in_paragraph % 6 == 0 ? "\n\n" : " ";
        passing(text);
      }
      add_doc(std::move(title), std::move(text));
    }
  }

  void choose_question() {
    const uint32_t hops = options_.hops;
    for (int attempt = 0; attempt < 100000; ++attempt) {
      std::vector<int32_t> chain{static_cast<int32_t>(rng_.below(static_cast<uint32_t>(entities_.size())))};
      std::vector<Rel> rels;
      while (rels.size() < hops) {
        const Entity& at = entities_[chain.back()];
        std::vector<Rel> options;
        for (int r = 0; r < kRelCount; ++r) {
          const int32_t next = at.rel[r];
          if (next >= 0 && std::find(chain.begin(), chain.end(), next) == chain.end()) options.push_back(static_cast<Rel>(r));
        }
        if (options.empty()) break;
        const Rel r = options[rng_.below(static_cast<uint32_t>(options.size()))];
        rels.push_back(r);
        chain.push_back(at.rel[r]);
      }
      if (rels.size() < hops) continue;
      std::string phrase = entities_[chain[0]].name;
      for (const Rel r : rels) phrase = question_phrase(r, phrase);
      question_ = "What is the name of " + phrase + "?";
      answer_ = entities_[chain.back()].name;
      chain_ = std::move(chain);
      chain_rels_ = std::move(rels);
      return;
    }
    throw std::invalid_argument("could not find a question chain of " + std::to_string(hops) + " hops");
  }

  Corpus finish() {
    Corpus corpus;
    corpus.question = question_;
    corpus.answer = answer_;
    // Ids are a random permutation of positions, so the id says nothing about the kind.
    std::vector<uint32_t> order(docs_.size());
    for (uint32_t i = 0; i < order.size(); ++i) order[i] = i;
    rng_.shuffle(order);
    std::vector<uint32_t> position(docs_.size());
    corpus.docs.resize(docs_.size());
    for (uint32_t i = 0; i < order.size(); ++i) {
      position[order[i]] = i;
      Document& d = corpus.docs[i];
      d = std::move(docs_[order[i]]);
      char id[16];
      std::snprintf(id, sizeof(id), "d%06u", i);
      d.id = id;
      corpus.bytes += d.title.size() + d.text.size();
    }
    for (size_t h = 0; h < chain_rels_.size(); ++h) {
      const uint32_t subject = static_cast<uint32_t>(chain_[h]);
      GoldHop hop;
      hop.doc = position[entities_[subject].page];
      hop.entity = entities_[subject].name;
      hop.fact = facts_.at({subject, chain_rels_[h]});
      corpus.chain.push_back(std::move(hop));
    }
    return corpus;
  }

  struct PairHash {
    size_t operator()(const std::pair<uint32_t, int>& p) const { return (static_cast<size_t>(p.first) << 4) ^ static_cast<size_t>(p.second); }
  };

  CorpusOptions options_;
  Rng rng_;
  double avg_doc_ = 0;
  std::vector<Entity> entities_;
  std::array<std::vector<int32_t>, 5> by_kind_;
  std::unordered_set<std::string> used_names_;
  std::vector<Document> docs_;
  std::unordered_map<std::pair<uint32_t, int>, std::string, PairHash> facts_;
  std::vector<int32_t> chain_;
  std::vector<Rel> chain_rels_;
  std::string question_;
  std::string answer_;
};

}  // namespace

uint32_t min_documents(uint32_t hops) { return 30 + 10 * hops; }

namespace {
void check(const CorpusOptions& options) {
  if (options.hops < 1) throw std::invalid_argument("hops must be at least 1");
  if (options.documents < min_documents(options.hops))
    throw std::invalid_argument("documents must be at least " + std::to_string(min_documents(options.hops)) + " for " +
                                std::to_string(options.hops) + " hops");
}
}  // namespace

Corpus generate_corpus(const CorpusOptions& options, uint64_t seed) {
  check(options);
  WorldBuilder builder(options, seed);
  builder.plan();
  return builder.write();
}

std::pair<std::string, std::string> generate_question(const CorpusOptions& options, uint64_t seed) {
  check(options);
  WorldBuilder builder(options, seed);
  builder.plan();
  return {builder.question(), builder.answer()};
}

}  // namespace odyssey::needle
