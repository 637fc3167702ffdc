// Helpers for environment plugins built with <odyssey/env_sdk.hpp>, shared by the built-in
// environments (envs/builtin/) and free for any plugin:
//   - checking a config or task object: unknown keys refused with the closest known one
//     suggested (check_keys), integers in a range (integer_field), the {"split", "index"} task
//     convention (split_index_task), each an EnvError whose message names the key; a JSON
//     snapshot's kind and version (parse_snapshot);
//   - hashing and random streams that are the same on every platform and compiler (the std
//     distributions are not), so that task N is the same task everywhere: mix64 / splitmix64,
//     fnv1a64, SplitMix64 (a counter-based stream) and Xoshiro256 (xoshiro256**).
// Header-only, like the SDK.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "odyssey/env_sdk.hpp"

namespace odyssey::env {

// ---- checking configs and tasks ----------------------------------------------------------

// Edit distance counting an insertion, deletion, substitution or swap of neighbours as one (the
// rule core/config.cpp uses for odyssey's own config keys, so a typo is suggested the same way in
// both; the SDK is header-only and stands alone, so it cannot share that code).
inline size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1)});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1]) d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

// The known key closest to `key` (edit distance 1 or 2), or "" when none is that close.
inline std::string closest_key(std::string_view key, const std::vector<std::string>& known) {
  std::string best;
  size_t best_distance = 3;
  for (const std::string& k : known) {
    const size_t d = edit_distance(key, k);
    if (d < best_distance) best_distance = d, best = k;
  }
  return best;
}

// Throws EnvError(status) for the first key of `object` outside `known`:
//   "<what>: unknown key 'corpus_token' (did you mean 'corpus_tokens'?); known keys: a, b, c"
inline void check_keys(const nlohmann::json& object, const std::vector<std::string>& known,
                       const std::string& what, ody_env_status status) {
  for (const auto& item : object.items()) {
    if (std::find(known.begin(), known.end(), item.key()) != known.end()) continue;
    const std::string best = closest_key(item.key(), known);
    std::string message = what + ": unknown key '" + item.key() + "'" +
                          (best.empty() ? "" : " (did you mean '" + best + "'?)") + "; known keys: ";
    for (size_t i = 0; i < known.size(); ++i) message += (i ? ", " : "") + known[i];
    throw EnvError(status, message);
  }
}

// object[key] as an integer in [lo, hi], or `fallback` when the key is absent; anything else
// (not an integer, negative, out of range) throws EnvError(status) naming the key, the range and
// the value given.
inline uint64_t integer_field(const nlohmann::json& object, const char* key, uint64_t fallback, uint64_t lo,
                              uint64_t hi, const std::string& what, ody_env_status status) {
  if (!object.contains(key)) return fallback;
  const nlohmann::json& v = object[key];
  if (!v.is_number_integer() || (!v.is_number_unsigned() && v.get<int64_t>() < 0) || v.get<uint64_t>() < lo ||
      v.get<uint64_t>() > hi) {
    throw EnvError(status, what + ": '" + key + "' must be an integer in [" + std::to_string(lo) + ", " +
                               std::to_string(hi) + "], got " + v.dump());
  }
  return v.get<uint64_t>();
}

// The task convention of environments with a train and an eval split: {} is train task number
// `seed`; {"split": "train" | "eval", "index": N} is task N of that split (both keys needed).
// Anything else throws EnvError(ODY_ENV_ERR_INVALID_TASK) naming the key.
struct SplitIndex {
  bool eval = false;
  uint64_t index = 0;
};

inline SplitIndex split_index_task(const nlohmann::json& task, uint64_t seed) {
  if (!task.is_object() && !task.is_null()) {
    throw EnvError(ODY_ENV_ERR_INVALID_TASK, "task must be an object, got " + task.dump());
  }
  for (const auto& item : task.items()) {
    if (item.key() != "split" && item.key() != "index") {
      throw EnvError(ODY_ENV_ERR_INVALID_TASK, "unknown task key '" + item.key() + "' (known: split, index)");
    }
  }
  if (!task.contains("split") && !task.contains("index")) return {false, seed};
  const nlohmann::json& s = task.contains("split") ? task["split"] : nlohmann::json();
  if (!s.is_string() || (s != "train" && s != "eval")) {
    throw EnvError(ODY_ENV_ERR_INVALID_TASK, "task 'split' must be \"train\" or \"eval\", got " +
                                                 (s.is_null() ? std::string("nothing") : s.dump()));
  }
  const nlohmann::json& i = task.contains("index") ? task["index"] : nlohmann::json();
  if (!i.is_number_integer() || (!i.is_number_unsigned() && i.get<int64_t>() < 0)) {
    throw EnvError(ODY_ENV_ERR_INVALID_TASK, "task 'index' must be a non-negative integer, got " +
                                                 (i.is_null() ? std::string("nothing") : i.dump()));
  }
  return {s == "eval", i.get<uint64_t>()};
}

// A snapshot written as a JSON object {kind_key: name, "version": version, ...}, parsed and
// checked: anything else (not JSON, another environment's, another version) throws
// EnvError(ODY_ENV_ERR_UNSUPPORTED) saying which. What the fields inside mean is the caller's
// to check.
inline nlohmann::json parse_snapshot(std::string_view bytes, const std::string& name, int version,
                                     const char* kind_key = "env") {
  nlohmann::json s;
  try {
    s = nlohmann::json::parse(bytes);
  } catch (const nlohmann::json::exception& e) {
    throw EnvError(ODY_ENV_ERR_UNSUPPORTED, name + " snapshot: not JSON: " + e.what());
  }
  if (!s.is_object() || !s.contains(kind_key) || s[kind_key] != name) {
    throw EnvError(ODY_ENV_ERR_UNSUPPORTED, name + " snapshot: not a snapshot of '" + name + "'");
  }
  if (!s.contains("version") || s["version"] != version) {
    throw EnvError(ODY_ENV_ERR_UNSUPPORTED, name + " snapshot: version " +
                                                (s.contains("version") ? s["version"].dump() : std::string("none")) +
                                                ", this build reads version " + std::to_string(version));
  }
  return s;
}

// ---- hashing and random streams that are the same everywhere -----------------------------

// The splitmix64 finalizer.
inline uint64_t mix64(uint64_t x) {
  x ^= x >> 30;
  x *= 0xbf58476d1ce4e5b9ull;
  x ^= x >> 27;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 31;
  return x;
}

// splitmix64's output for state x (its step, then the finalizer): a well-mixed hash of x.
inline uint64_t splitmix64(uint64_t x) { return mix64(x + 0x9e3779b97f4a7c15ull); }

// FNV-1a, 64 bits; `h` continues an earlier hash.
inline uint64_t fnv1a64(std::string_view text, uint64_t h = 0xcbf29ce484222325ull) {
  for (const char c : text) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ull;
  }
  return h;
}

// splitmix64 as a stream: next() is splitmix64 of the seed plus 1, 2, 3, ... times its step.
class SplitMix64 {
 public:
  explicit SplitMix64(uint64_t seed) : state_(seed) {}
  uint64_t next() {
    state_ += 0x9e3779b97f4a7c15ull;
    return mix64(state_);
  }
  // Uniform in [lo, hi] (lo <= hi), by rejection: no modulo bias.
  int64_t uniform(int64_t lo, int64_t hi) {
    const uint64_t range = static_cast<uint64_t>(hi) - static_cast<uint64_t>(lo) + 1;
    if (range == 0) return static_cast<int64_t>(next());  // the whole 64-bit range
    const uint64_t limit = UINT64_MAX - UINT64_MAX % range;
    uint64_t x;
    do {
      x = next();
    } while (x >= limit);
    return lo + static_cast<int64_t>(x % range);
  }

 private:
  uint64_t state_;
};

// xoshiro256** seeded by four splitmix64 steps of the seed: fast, and the same stream everywhere.
class Xoshiro256 {
 public:
  explicit Xoshiro256(uint64_t seed) {
    SplitMix64 seeder(seed);
    for (auto& s : s_) s = seeder.next();
  }
  uint64_t next() {
    const uint64_t result = rotl(s_[1] * 5, 7) * 9;
    const uint64_t t = s_[1] << 17;
    s_[2] ^= s_[0];
    s_[3] ^= s_[1];
    s_[1] ^= s_[2];
    s_[0] ^= s_[3];
    s_[2] ^= t;
    s_[3] = rotl(s_[3], 45);
    return result;
  }
  // In [0, n) from the top 32 bits (multiply-shift; a bias below 2^-32 n).
  uint32_t below(uint32_t n) { return static_cast<uint32_t>(((next() >> 32) * n) >> 32); }
  // In [0, 1) with 53 random bits.
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
  bool chance(double p) { return unit() < p; }
  // In [lo, hi] (lo <= hi).
  int range(int lo, int hi) { return lo + static_cast<int>(below(static_cast<uint32_t>(hi - lo + 1))); }
  template <class T>
  const T& pick(const std::vector<T>& v) {
    return v[below(static_cast<uint32_t>(v.size()))];
  }
  template <class T, size_t N>
  const T& pick(const T (&a)[N]) {
    return a[below(static_cast<uint32_t>(N))];
  }
  // Fisher-Yates.
  template <class T>
  void shuffle(std::vector<T>& v) {
    for (size_t i = v.size(); i > 1; --i) std::swap(v[i - 1], v[below(static_cast<uint32_t>(i))]);
  }

 private:
  static uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }
  uint64_t s_[4];
};

}  // namespace odyssey::env
