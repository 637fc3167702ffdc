// <odyssey/env_util.hpp>: the plugin helpers the built-in environments share (input checks with
// errors that name the key, the split/index task convention, portable hashes and streams).
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "odyssey/env_util.hpp"

namespace {

using nlohmann::json;
using odyssey::env::EnvError;

// The message of the EnvError `f` throws, after checking its status.
template <class F>
std::string refusal(F&& f, ody_env_status status) {
  try {
    f();
  } catch (const EnvError& e) {
    EXPECT_EQ(e.status, status);
    return e.what();
  }
  ADD_FAILURE() << "no EnvError";
  return "";
}

TEST(EnvUtil, CheckKeysRefusesUnknownKeysAndSuggestsTheClosest) {
  const std::vector<std::string> known = {"corpus_tokens", "documents", "hops"};
  odyssey::env::check_keys(json{{"hops", 2}, {"documents", 10}}, known, "needle config", ODY_ENV_ERR_INVALID_CONFIG);
  odyssey::env::check_keys(json::object(), known, "needle config", ODY_ENV_ERR_INVALID_CONFIG);
  EXPECT_EQ(refusal([&] { odyssey::env::check_keys(json{{"corpus_token", 5}}, known, "needle config",
                                                   ODY_ENV_ERR_INVALID_CONFIG); },
                    ODY_ENV_ERR_INVALID_CONFIG),
            "needle config: unknown key 'corpus_token' (did you mean 'corpus_tokens'?); known keys: corpus_tokens, "
            "documents, hops");
  // Nothing within two edits: no suggestion, still the list.
  EXPECT_EQ(refusal([&] { odyssey::env::check_keys(json{{"zzz", 1}}, known, "t", ODY_ENV_ERR_INVALID_TASK); },
                    ODY_ENV_ERR_INVALID_TASK),
            "t: unknown key 'zzz'; known keys: corpus_tokens, documents, hops");
  EXPECT_EQ(odyssey::env::edit_distance("kitten", "sitting"), 3u);
  EXPECT_EQ(odyssey::env::edit_distance("", "abc"), 3u);
  EXPECT_EQ(odyssey::env::edit_distance("hpos", "hops"), 1u);  // a swap of neighbours is one edit
  EXPECT_EQ(odyssey::env::closest_key("docmuents", known), "documents");
  EXPECT_EQ(odyssey::env::closest_key("hop", known), "hops");
}

TEST(EnvUtil, IntegerFieldTakesTheFallbackOrAnIntegerInRangeAndNamesTheKeyOtherwise) {
  const json c = {{"hops", 3}, {"neg", -1}, {"big", 7}, {"text", "3"}, {"real", 2.5}};
  auto field = [&](const char* key) {
    return odyssey::env::integer_field(c, key, 11, 1, 6, "needle config", ODY_ENV_ERR_INVALID_CONFIG);
  };
  EXPECT_EQ(field("hops"), 3u);
  EXPECT_EQ(field("absent"), 11u);  // the fallback is not range-checked: it is the plugin's own
  EXPECT_EQ(refusal([&] { field("neg"); }, ODY_ENV_ERR_INVALID_CONFIG),
            "needle config: 'neg' must be an integer in [1, 6], got -1");
  EXPECT_EQ(refusal([&] { field("big"); }, ODY_ENV_ERR_INVALID_CONFIG),
            "needle config: 'big' must be an integer in [1, 6], got 7");
  EXPECT_EQ(refusal([&] { field("text"); }, ODY_ENV_ERR_INVALID_CONFIG),
            "needle config: 'text' must be an integer in [1, 6], got \"3\"");
  EXPECT_EQ(refusal([&] { field("real"); }, ODY_ENV_ERR_INVALID_CONFIG),
            "needle config: 'real' must be an integer in [1, 6], got 2.5");
}

TEST(EnvUtil, SplitIndexTasksFollowTheConventionAndRefuseAnythingElse) {
  using odyssey::env::split_index_task;
  EXPECT_FALSE(split_index_task(json::object(), 42).eval);
  EXPECT_EQ(split_index_task(json::object(), 42).index, 42u);
  EXPECT_EQ(split_index_task(json(), 7).index, 7u);  // no task at all: the seed's train task
  EXPECT_TRUE(split_index_task(json{{"split", "eval"}, {"index", 3}}, 42).eval);
  EXPECT_EQ(split_index_task(json{{"split", "eval"}, {"index", 3}}, 42).index, 3u);
  EXPECT_FALSE(split_index_task(json{{"split", "train"}, {"index", 0}}, 42).eval);
  auto refused = [](const json& task) {
    return refusal([&] { split_index_task(task, 0); }, ODY_ENV_ERR_INVALID_TASK);
  };
  EXPECT_EQ(refused(json{{"split", "eval"}}), "task 'index' must be a non-negative integer, got nothing");
  EXPECT_EQ(refused(json{{"index", 2}}), "task 'split' must be \"train\" or \"eval\", got nothing");
  EXPECT_EQ(refused(json{{"split", "test"}, {"index", 2}}), "task 'split' must be \"train\" or \"eval\", got \"test\"");
  EXPECT_EQ(refused(json{{"split", "eval"}, {"index", -2}}), "task 'index' must be a non-negative integer, got -2");
  EXPECT_EQ(refused(json{{"split", "eval"}, {"index", 1}, {"seed", 2}}),
            "unknown task key 'seed' (known: split, index)");
  EXPECT_EQ(refused(json::array({1, 2})), "task must be an object, got [1,2]");
}

TEST(EnvUtil, SnapshotsOfAnotherKindOrVersionAreRefusedSayingWhich) {
  using odyssey::env::parse_snapshot;
  const json s = parse_snapshot(R"({"env": "needle", "version": 1, "turn": 3})", "needle", 1);
  EXPECT_EQ(s.at("turn"), 3);
  EXPECT_EQ(parse_snapshot(R"({"kind": "arith", "version": 2})", "arith", 2, "kind").at("version"), 2);
  auto refused = [](std::string_view bytes) {
    return refusal([&] { parse_snapshot(bytes, "needle", 1); }, ODY_ENV_ERR_UNSUPPORTED);
  };
  EXPECT_EQ(refused("\x01\x02garbage").rfind("needle snapshot: not JSON: ", 0), 0u);
  EXPECT_EQ(refused(R"({"env": "files", "version": 1})"), "needle snapshot: not a snapshot of 'needle'");
  EXPECT_EQ(refused(R"([1, 2])"), "needle snapshot: not a snapshot of 'needle'");
  EXPECT_EQ(refused(R"({"env": "needle", "version": 2})"), "needle snapshot: version 2, this build reads version 1");
  EXPECT_EQ(refused(R"({"env": "needle"})"), "needle snapshot: version none, this build reads version 1");
}

TEST(EnvUtil, HashesAndStreamsAreTheReferenceAlgorithms) {
  // FNV-1a 64 test vectors.
  EXPECT_EQ(odyssey::env::fnv1a64(""), 0xcbf29ce484222325ull);
  EXPECT_EQ(odyssey::env::fnv1a64("a"), 0xaf63dc4c8601ec8cull);
  EXPECT_EQ(odyssey::env::fnv1a64("b", odyssey::env::fnv1a64("a")), odyssey::env::fnv1a64("ab"));
  // splitmix64 from seed 0: its published first outputs.
  odyssey::env::SplitMix64 stream(0);
  const uint64_t first[] = {0xe220a8397b1dcdafull, 0x6e789e6aa1b965f4ull, 0x06c45d188009454full,
                            0xf88bb8a8724c81ecull};
  for (const uint64_t x : first) EXPECT_EQ(stream.next(), x);
  EXPECT_EQ(odyssey::env::splitmix64(0), first[0]);
  // xoshiro256** seeded by those four values (its state), outputs as the reference code gives them.
  odyssey::env::Xoshiro256 x(0);
  EXPECT_EQ(x.next(), 0x99ec5f36cb75f2b4ull);
  EXPECT_EQ(x.next(), 0xbf6e1f784956452aull);
  EXPECT_EQ(x.next(), 0x1a5f849d4933e6e0ull);
}

TEST(EnvUtil, SampledValuesStayInTheirRanges) {
  odyssey::env::SplitMix64 s(7);
  odyssey::env::Xoshiro256 x(7);
  std::set<int64_t> seen;
  for (int i = 0; i < 2000; ++i) {
    const int64_t u = s.uniform(-3, 3);
    ASSERT_GE(u, -3);
    ASSERT_LE(u, 3);
    seen.insert(u);
    ASSERT_LT(x.below(5), 5u);
    const int r = x.range(2, 4);
    ASSERT_GE(r, 2);
    ASSERT_LE(r, 4);
    const double f = x.unit();
    ASSERT_GE(f, 0.0);
    ASSERT_LT(f, 1.0);
  }
  EXPECT_EQ(seen.size(), 7u);  // every value of the range turns up
  std::vector<int> v = {1, 2, 3, 4, 5, 6};
  x.shuffle(v);
  EXPECT_EQ(std::multiset<int>(v.begin(), v.end()), (std::multiset<int>{1, 2, 3, 4, 5, 6}));
  const char* const words[] = {"a", "b"};
  const std::string w = x.pick(words);
  EXPECT_TRUE(w == "a" || w == "b");
}

}  // namespace
