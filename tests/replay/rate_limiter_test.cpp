#include "replay/rate_limiter.h"

#include <cmath>
#include <string>

#include <gtest/gtest.h>

#include "replay/rng.h"

namespace odyssey::replay {
namespace {

RateLimiter make(int64_t min_size, double spi, double error_buffer, int64_t lag = 0,
                 RateLimiterState state = {}) {
  RateLimiterOptions options;
  options.min_size_to_sample = min_size;
  options.samples_per_insert = spi;
  options.error_buffer = error_buffer;
  options.max_policy_lag = lag;
  auto limiter = RateLimiter::create(options, state);
  EXPECT_TRUE(limiter.ok()) << limiter.status().to_string();
  return std::move(limiter).value();
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(RateLimiter, BlocksSamplesUntilMinInsertsReached) {
  RateLimiter limiter = make(/*min_size=*/10, /*spi=*/0, /*error_buffer=*/0);
  limiter.on_insert(3);
  EXPECT_FALSE(limiter.can_sample());
  EXPECT_EQ(limiter.sample_blocked_reason(),
            "sampling blocked: 3 of min_size_to_sample=10 inserted");
  EXPECT_TRUE(limiter.can_insert(/*n=*/100));
  limiter.on_insert(7);
  EXPECT_TRUE(limiter.can_sample());
  EXPECT_EQ(limiter.sample_blocked_reason(), "");
}

TEST(RateLimiter, DeletesCountAgainstTheMinimumSize) {
  RateLimiter limiter = make(/*min_size=*/2, /*spi=*/0, /*error_buffer=*/0);
  limiter.on_insert(2);
  EXPECT_TRUE(limiter.can_sample());
  limiter.on_delete(1);
  EXPECT_FALSE(limiter.can_sample());
  EXPECT_TRUE(contains(limiter.sample_blocked_reason(), "1 of min_size_to_sample=2 present"));
  limiter.on_delete(5);  // clamped: never more deletes than inserts
  EXPECT_EQ(limiter.state().deletes, 2u);
}

TEST(RateLimiter, SamplesPerInsertZeroNeverLimitsTheRatio) {
  RateLimiter limiter = make(/*min_size=*/1, /*spi=*/0, /*error_buffer=*/0);
  limiter.on_insert(1);
  limiter.on_sample(1000000);
  EXPECT_TRUE(limiter.can_sample(/*n=*/1000));
  EXPECT_TRUE(limiter.can_insert(/*n=*/1000));
}

// samples_per_insert=2, min_size_to_sample=2, error_buffer=4: min_diff=0, max_diff=8.
TEST(RateLimiter, BlocksInsertsWhenSamplingFallsBehind) {
  RateLimiter limiter = make(/*min_size=*/2, /*spi=*/2, /*error_buffer=*/4);
  EXPECT_DOUBLE_EQ(limiter.min_diff(), 0.0);
  EXPECT_DOUBLE_EQ(limiter.max_diff(), 8.0);
  limiter.on_insert(2);         // free below min size
  EXPECT_TRUE(limiter.can_insert());   // 3*2 - 0 = 6 <= 8
  EXPECT_FALSE(limiter.can_insert(/*n=*/3));  // 5*2 = 10 > 8
  limiter.on_insert(2);         // 4*2 = 8 <= 8
  EXPECT_FALSE(limiter.can_insert());
  EXPECT_EQ(limiter.insert_blocked_reason(),
            "inserting blocked: 0 samples allow at most 4 inserts and 1 would make 5 "
            "(samples_per_insert=2, error_buffer=4); waiting for samples");
  limiter.on_sample(2);         // 5*2 - 2 = 8 <= 8
  EXPECT_TRUE(limiter.can_insert());
}

TEST(RateLimiter, BlocksSamplesWhenSamplingRunsAhead) {
  RateLimiter limiter = make(/*min_size=*/2, /*spi=*/2, /*error_buffer=*/4);
  limiter.on_insert(2);
  EXPECT_TRUE(limiter.can_sample(/*n=*/4));   // 2*2 - 4 = 0 >= 0
  EXPECT_FALSE(limiter.can_sample(/*n=*/5));  // a group of 5 does not fit
  limiter.on_sample(4);
  EXPECT_FALSE(limiter.can_sample());
  EXPECT_EQ(limiter.sample_blocked_reason(),
            "sampling blocked: 2 inserts allow at most 4 samples and 1 would make 5 "
            "(samples_per_insert=2, error_buffer=4); waiting for inserts");
  limiter.on_insert(1);
  EXPECT_TRUE(limiter.can_sample(/*n=*/2));
  EXPECT_FALSE(limiter.can_sample(/*n=*/3));
}

TEST(RateLimiter, ValidOptionsNeverBlockInsertsAndSamplesTogether) {
  struct Case { int64_t min_size; double spi, error_buffer; };
  for (Case c : {Case{1, 1, 1}, Case{3, 0.5, 1}, Case{10, 4, 4}, Case{5, 2.5, 7}}) {
    RateLimiter limiter = make(c.min_size, c.spi, c.error_buffer);
    Rng rng(/*seed=*/static_cast<uint64_t>(c.min_size));
    for (int step = 0; step < 2000; ++step) {
      const bool insert = limiter.can_insert(), sample = limiter.can_sample();
      ASSERT_TRUE(insert || sample) << limiter.describe();
      if (insert && (!sample || rng.uniform_int(2) == 0)) {
        limiter.on_insert();
      } else {
        limiter.on_sample();
      }
    }
  }
}

TEST(RateLimiter, PolicyLagMarksOnlyOlderTrajectoriesStale) {
  RateLimiter limiter = make(/*min_size=*/1, /*spi=*/0, /*error_buffer=*/0, /*lag=*/2);
  limiter.set_policy_version(10);
  EXPECT_FALSE(limiter.is_stale(/*min_policy_version=*/8));
  EXPECT_TRUE(limiter.is_stale(/*min_policy_version=*/7));
  EXPECT_FALSE(limiter.is_stale(/*min_policy_version=*/12));  // newer than the learner
  RateLimiter unbounded = make(/*min_size=*/1, /*spi=*/0, /*error_buffer=*/0, /*lag=*/0);
  unbounded.set_policy_version(1000000);
  EXPECT_FALSE(unbounded.is_stale(/*min_policy_version=*/0));
}

TEST(RateLimiter, RejectsInvalidOptionsNamingThem) {
  struct Case { RateLimiterOptions options; const char* named; };
  auto with = [](auto edit) {
    RateLimiterOptions o;
    o.samples_per_insert = 1;
    o.error_buffer = 1;
    edit(o);
    return o;
  };
  for (const Case& c : {
           Case{with([](auto& o) { o.min_size_to_sample = 0; }), "min_size_to_sample"},
           Case{with([](auto& o) { o.samples_per_insert = -1; }), "samples_per_insert"},
           Case{with([](auto& o) { o.samples_per_insert = std::nan(""); }), "samples_per_insert"},
           Case{with([](auto& o) { o.error_buffer = -1; }), "error_buffer"},
           Case{with([](auto& o) { o.error_buffer = HUGE_VAL; }), "error_buffer"},
           Case{with([](auto& o) {
                  o.samples_per_insert = 4;
                  o.error_buffer = 3;
                }),
                "error_buffer=3"},
           Case{with([](auto& o) { o.max_policy_lag = -1; }), "max_policy_lag"},
       }) {
    auto limiter = RateLimiter::create(c.options);
    ASSERT_FALSE(limiter.ok()) << c.named;
    EXPECT_EQ(limiter.status().code(), StatusCode::kInvalidArgument);
    EXPECT_TRUE(contains(limiter.status().message(), c.named)) << limiter.status().message();
  }
  EXPECT_TRUE(RateLimiter::create(with([](auto&) {})).ok());
  RateLimiterState impossible;
  impossible.deletes = 1;
  EXPECT_FALSE(RateLimiter::create(RateLimiterOptions{}, impossible).ok());
}

TEST(RateLimiter, StateRoundTripsExactly) {
  RateLimiter limiter = make(/*min_size=*/1, /*spi=*/0, /*error_buffer=*/0, /*lag=*/0,
                             RateLimiterState{/*inserts=*/UINT64_MAX,
                                              /*samples=*/0x0123456789abcdefull,
                                              /*deletes=*/UINT64_MAX - 1,
                                              /*policy_version=*/UINT32_MAX});
  auto decoded = RateLimiter::decode(limiter.encode());
  ASSERT_TRUE(decoded.ok()) << decoded.status().to_string();
  EXPECT_EQ(*decoded, limiter.state());
}

TEST(RateLimiter, EncodingIsAVersionByteThenLittleEndianCounters) {
  RateLimiter limiter = make(/*min_size=*/1, /*spi=*/0, /*error_buffer=*/0, /*lag=*/0,
                             RateLimiterState{/*inserts=*/0x0102, /*samples=*/3, /*deletes=*/1,
                                              /*policy_version=*/0x0a0b0c0d});
  const std::string expected("\x01"
                             "\x02\x01\0\0\0\0\0\0"
                             "\x03\0\0\0\0\0\0\0"
                             "\x01\0\0\0\0\0\0\0"
                             "\x0d\x0c\x0b\x0a",
                             29);
  EXPECT_EQ(limiter.encode(), expected);
}

TEST(RateLimiter, DecodeSaysWhatIsWrong) {
  const std::string good = make(1, 0, 0).encode();
  auto expect_error = [](std::string_view bytes, const std::string& says) {
    auto decoded = RateLimiter::decode(bytes);
    ASSERT_FALSE(decoded.ok());
    EXPECT_EQ(decoded.status().code(), StatusCode::kCorrupt);
    EXPECT_TRUE(contains(decoded.status().message(), says)) << decoded.status().message();
  };
  expect_error("", "empty");
  expect_error(std::string("\x02") + good.substr(1), "unknown version 2");
  expect_error(good.substr(0, 28), "is 29 bytes, got 28");
  expect_error(good + "x", "got 30");
  std::string more_deletes = good;
  more_deletes[17] = 1;  // deletes = 1, inserts = 0
  expect_error(more_deletes, "1 deletes exceed 0 inserts");
}

TEST(RateLimiter, RestoredLimiterDecidesLikeTheOriginal) {
  RateLimiter original = make(/*min_size=*/3, /*spi=*/1.5, /*error_buffer=*/2, /*lag=*/4);
  original.on_insert(9);
  original.on_sample(14);
  original.on_delete(2);
  original.set_policy_version(6);
  auto state = RateLimiter::decode(original.encode());
  ASSERT_TRUE(state.ok());
  RateLimiter restored = make(/*min_size=*/3, /*spi=*/1.5, /*error_buffer=*/2, /*lag=*/4, *state);
  EXPECT_EQ(restored.describe(), original.describe());
  for (uint64_t n = 1; n <= 4; ++n) {
    EXPECT_EQ(restored.can_insert(n), original.can_insert(n));
    EXPECT_EQ(restored.can_sample(n), original.can_sample(n));
  }
  EXPECT_EQ(restored.is_stale(/*min_policy_version=*/1), original.is_stale(1));
}

TEST(RateLimiter, DescribeSaysCountersAndWhatIsBlocked) {
  RateLimiter limiter = make(/*min_size=*/10, /*spi=*/0, /*error_buffer=*/0, /*lag=*/3);
  limiter.on_insert(3);
  limiter.set_policy_version(7);
  EXPECT_EQ(limiter.describe(),
            "inserts=3 samples=0 deletes=0 policy_version=7 max_policy_lag=3: "
            "sampling blocked: 3 of min_size_to_sample=10 inserted");
  limiter.on_insert(7);
  EXPECT_TRUE(contains(limiter.describe(), "sampling and inserting allowed"));
}

}  // namespace
}  // namespace odyssey::replay
