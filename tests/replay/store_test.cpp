// TrajectoryStore in-process: idempotent writes, sampling through every selector, the rate
// limiter, policy lag, leases, retention, and a restart that continues exactly.
#include "replay/store.h"

#include <capnp/message.h>
#include <gtest/gtest.h>

#include "replay/verify.h"
#include "test_helpers.h"

namespace odyssey::replay {
namespace {

using testing::TempDir;

struct TrajSpec {
  uint64_t id;
  uint32_t segments = 2;
  uint32_t version = 1;
  uint64_t group_id = 0;
  uint32_t group_size = 0;
  double reward = 1.0;
  bool failed = false;
};

class StoreTest : public ::testing::Test {
 protected:
  StoreOptions options(const std::string& sampler = "fifo") {
    StoreOptions o;
    o.dir = tmp_.str("store");
    o.sampler = sampler;
    o.sync = false;  // durability is the crash test's business; these test logic
    return o;
  }
  std::unique_ptr<TrajectoryStore> open(const StoreOptions& o) {
    auto s = TrajectoryStore::open(o);
    EXPECT_TRUE(s.ok()) << s.status().to_string();
    return s.ok() ? std::move(s).value() : nullptr;
  }
  static Status begin(TrajectoryStore& s, const TrajSpec& t) {
    capnp::MallocMessageBuilder m;
    auto r = m.initRoot<schema::Trajectory>();
    r.setId(t.id);
    r.setJob("job");
    r.initEnvironment().setName("env");
    r.setTask("task");
    r.setGroupId(t.group_id);
    r.setGroupSize(t.group_size);
    auto out = s.begin(r.asReader());
    return out.ok() ? Status::Ok() : out.status();
  }
  static Result<EncodedSegment> segment(uint64_t id, uint32_t seq, Hash128 prev, uint32_t version = 1) {
    return encode_segment(SegmentPosition{id, seq, uint64_t{seq} * 16, prev}, testing::make_segment(16, version));
  }
  static Status end(TrajectoryStore& s, uint64_t id, uint32_t n, Hash128 last, double reward = 1, bool failed = false) {
    capnp::MallocMessageBuilder m;
    auto e = m.initRoot<schema::End>();
    e.setTrajectoryId(id);
    e.setNumSegments(n);
    e.setLastHashLo(last.lo);
    e.setLastHashHi(last.hi);
    e.setRewardTotal(reward);
    e.setFailed(failed);
    auto out = s.end(e.asReader());
    return out.ok() ? Status::Ok() : out.status();
  }
  // A whole trajectory, committed.
  static void write(TrajectoryStore& s, const TrajSpec& t) {
    ASSERT_TRUE(begin(s, t).ok());
    Hash128 prev;
    for (uint32_t i = 0; i < t.segments; ++i) {
      auto seg = segment(t.id, i, prev, t.version);
      ASSERT_TRUE(seg.ok());
      auto out = s.append(t.id, i, seg->bytes);
      ASSERT_TRUE(out.ok()) << out.status().to_string();
      prev = seg->hash;
    }
    ASSERT_TRUE(end(s, t.id, t.segments, prev, t.reward, t.failed).ok());
    ASSERT_TRUE(s.commit().ok());
  }
  static std::vector<uint64_t> ids(const SampleResult& r) {
    std::vector<uint64_t> out;
    for (const auto& rec : r.records) {
      MessageView v(rec);
      out.push_back(v.root<schema::Trajectory>().getId());
    }
    return out;
  }
  static schema::TrajectoryStatus status_of(TrajectoryStore& s, uint64_t id) {
    auto bytes = s.read_record(id);
    EXPECT_TRUE(bytes.ok());
    auto rec = decode_trajectory(*bytes);
    EXPECT_TRUE(rec.ok());
    return (*rec)->getRoot<schema::Trajectory>().getStatus();
  }
  TempDir tmp_;
};

TEST_F(StoreTest, ResentSegmentIsANoOpAndADifferentOneIsAConflict) {
  auto s = open(options());
  ASSERT_TRUE(begin(*s, {1}).ok());
  auto seg0 = segment(1, 0, {});
  ASSERT_EQ(*s->append(1, 0, seg0->bytes), WriteOutcome::kStored);
  EXPECT_EQ(*s->append(1, 0, seg0->bytes), WriteOutcome::kDuplicate);  // same batch
  ASSERT_TRUE(s->commit().ok());
  EXPECT_EQ(*s->append(1, 0, seg0->bytes), WriteOutcome::kDuplicate);  // after commit
  auto other = encode_segment(SegmentPosition{1, 0, 0, {}}, testing::make_segment(16, 2));
  auto conflict = s->append(1, 0, other->bytes);
  ASSERT_FALSE(conflict.ok());
  EXPECT_EQ(conflict.status().code(), StatusCode::kConflict);
  EXPECT_TRUE(begin(*s, {1}).ok()) << "a resent begin is a no-op";
  EXPECT_EQ(begin(*s, {1, 2, 1, /*group_id=*/5, 2}).code(), StatusCode::kConflict) << "same id, other identity";
  EXPECT_EQ(s->counters().segments, 1u);
}

TEST_F(StoreTest, RejectsBrokenChainsGapsAndEarlyEndsStoringNothing) {
  auto s = open(options());
  ASSERT_TRUE(begin(*s, {1}).ok());
  auto seg0 = segment(1, 0, {});
  ASSERT_TRUE(s->append(1, 0, seg0->bytes).ok());
  ASSERT_TRUE(s->commit().ok());
  auto bad_prev = segment(1, 1, Hash128{1, 2});
  EXPECT_EQ(s->append(1, 1, bad_prev->bytes).status().code(), StatusCode::kConflict);
  auto gap = segment(1, 2, seg0->hash);
  EXPECT_EQ(s->append(1, 2, gap->bytes).status().code(), StatusCode::kConflict);
  EXPECT_EQ(end(*s, 1, 2, seg0->hash).code(), StatusCode::kConflict);      // claims a segment we lack
  EXPECT_EQ(end(*s, 1, 1, Hash128{9, 9}).code(), StatusCode::kConflict);   // wrong last hash
  EXPECT_EQ(s->append(2, 0, segment(2, 0, {})->bytes).status().code(), StatusCode::kNotFound);
  ASSERT_TRUE(s->commit().ok());
  EXPECT_EQ(s->counters().segments, 1u);
  VerifyReport report;
  ASSERT_TRUE(verify_trajectory(*s, 1, report).ok());
  EXPECT_TRUE(report.sound()) << report.problems.front().to_string();
  ASSERT_TRUE(end(*s, 1, 1, seg0->hash).ok());
  ASSERT_TRUE(s->commit().ok());
  EXPECT_EQ(status_of(*s, 1), schema::TrajectoryStatus::COMPLETE);
}

TEST_F(StoreTest, FifoDeliversInCompletionOrderAndCommitMarksConsumed) {
  auto s = open(options("fifo"));
  for (uint64_t id : {30, 10, 20}) write(*s, {id});
  auto first = s->sample(2);
  ASSERT_TRUE(first.ok());
  EXPECT_EQ(ids(*first), (std::vector<uint64_t>{30, 10}));
  EXPECT_GT(first->cursor, 0u);
  ASSERT_TRUE(s->commit().ok());
  auto second = s->sample(5);
  EXPECT_EQ(ids(*second), (std::vector<uint64_t>{20}));
  EXPECT_EQ(status_of(*s, 30), schema::TrajectoryStatus::COMPLETE);  // leased, not yet trained on
  ASSERT_TRUE(s->commit_deliveries(first->cursor).ok());
  ASSERT_TRUE(s->commit().ok());
  EXPECT_EQ(status_of(*s, 30), schema::TrajectoryStatus::CONSUMED);
  EXPECT_EQ(status_of(*s, 10), schema::TrajectoryStatus::CONSUMED);
  EXPECT_EQ(status_of(*s, 20), schema::TrajectoryStatus::COMPLETE);
  auto empty = s->sample(1);
  EXPECT_TRUE(empty->records.empty());
  EXPECT_FALSE(empty->blocked.empty());
}

TEST_F(StoreTest, LeasesSurviveARestartAndResumeOffersUncommittedDeliveriesAgain) {
  uint64_t cursor1, cursor2;
  {
    auto s = open(options("fifo"));
    for (uint64_t id = 1; id <= 4; ++id) write(*s, {id});
    cursor1 = s->sample(2)->cursor;  // 1, 2
    cursor2 = s->sample(2)->cursor;  // 3, 4
    ASSERT_TRUE(s->commit().ok());
  }
  {
    auto s = open(options("fifo"));
    EXPECT_TRUE(s->sample(1)->records.empty()) << "leased items must not be delivered twice after a restart";
    // The learner restarts from a checkpoint that trained on the first delivery only.
    ASSERT_TRUE(s->resume(cursor1).ok());
    ASSERT_TRUE(s->commit().ok());
    EXPECT_EQ(status_of(*s, 1), schema::TrajectoryStatus::CONSUMED);
    auto again = s->sample(4);
    EXPECT_EQ(ids(*again), (std::vector<uint64_t>{3, 4}));
    EXPECT_GT(again->cursor, cursor2);
  }
}

TEST_F(StoreTest, RestartedStoreDrawsExactlyWhatItWouldHaveDrawn) {
  auto draw = [&](TrajectoryStore& s, int n) {
    std::vector<uint64_t> out;
    for (int i = 0; i < n; ++i) {
      auto r = s.sample(1);
      for (uint64_t id : ids(*r)) out.push_back(id);
      EXPECT_TRUE(s.commit().ok());
    }
    return out;
  };
  auto o = options("uniform");
  o.max_times_sampled = 0;
  o.sampler_seed = 7;
  std::vector<uint64_t> straight, restarted;
  {
    auto s = open(o);
    for (uint64_t id = 1; id <= 20; ++id) write(*s, {id});
    straight = draw(*s, 30);
  }
  TempDir second;  // the same history again, with a restart in the middle
  o.dir = second.str("store");
  {
    auto s = open(o);
    for (uint64_t id = 1; id <= 20; ++id) write(*s, {id});
    restarted = draw(*s, 12);
  }
  {
    auto s = open(o);
    auto rest = draw(*s, 18);
    restarted.insert(restarted.end(), rest.begin(), rest.end());
    EXPECT_EQ(s->rate_limiter().state().samples, 30u);
    EXPECT_EQ(s->rate_limiter().state().inserts, 20u);
  }
  EXPECT_EQ(straight, restarted);
}

TEST_F(StoreTest, GroupCompleteServesOnlyWholeGroups) {
  auto s = open(options("group_complete"));
  write(*s, {1, 2, 1, 7, 3});
  write(*s, {2, 2, 1, 8, 2});
  write(*s, {3, 2, 1, 7, 3});
  EXPECT_TRUE(s->sample(1)->records.empty());
  write(*s, {4, 2, 1, 8, 2});  // group 8 completes first
  write(*s, {5, 2, 1, 7, 3});
  auto r = s->sample(2);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(ids(*r), (std::vector<uint64_t>{2, 4, 1, 3, 5}));
  EXPECT_EQ(r->group_starts, (std::vector<uint32_t>{0, 2}));
}

TEST_F(StoreTest, GroupCompleteServesAGroupWithoutItsFailedMemberAlsoAfterReopening) {
  auto o = options("group_complete");
  {
    auto s = open(o);
    write(*s, {1, 2, 1, 7, 3});
    TrajSpec failed{2, 2, 1, 7, 3};
    failed.failed = true;
    write(*s, failed);
    EXPECT_TRUE(s->sample(1)->records.empty()) << "member 3 has not ended";
    write(*s, {3, 2, 1, 7, 3});
    write(*s, {4, 2, 1, 9, 2});
    TrajSpec also_failed{5, 2, 1, 9, 2};
    also_failed.failed = true;
    write(*s, also_failed);
  }
  auto s = open(o);  // the failures are remembered from the stored records
  auto r = s->sample(2);
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(ids(*r), (std::vector<uint64_t>{1, 3, 4}));
  EXPECT_EQ(r->group_starts, (std::vector<uint32_t>{0, 2}));
  EXPECT_EQ(s->counters().failed, 2u);
}

TEST_F(StoreTest, PolicyLagWithholdsOldTrajectoriesButKeepsThem) {
  auto o = options("fifo");
  o.rate_limiter.max_policy_lag = 2;
  auto s = open(o);
  write(*s, {1, 2, /*version=*/1});
  write(*s, {2, 2, /*version=*/4});
  ASSERT_TRUE(s->set_policy_version(5).ok());
  auto r = s->sample(2);
  ASSERT_TRUE(s->commit().ok());
  EXPECT_EQ(ids(*r), (std::vector<uint64_t>{2}));
  EXPECT_EQ(status_of(*s, 1), schema::TrajectoryStatus::WITHHELD);
  EXPECT_TRUE(s->read_segments(1, 0, 10, 1 << 20)->size() == 2) << "withheld data is kept for audit";
  // A trajectory that is already stale when it ends is withheld at once.
  write(*s, {3, 2, /*version=*/2});
  EXPECT_EQ(status_of(*s, 3), schema::TrajectoryStatus::WITHHELD);
  EXPECT_EQ(s->counters().withheld, 2u);
}

TEST_F(StoreTest, TrajectoriesWithheldForLagCountAsSamplesSoTheRatioKeepsAdmittingInserts) {
  auto o = options("fifo");
  o.rate_limiter.samples_per_insert = 1.0;
  o.rate_limiter.error_buffer = 2.0;
  o.rate_limiter.max_policy_lag = 1;
  auto s = open(o);
  for (uint64_t id = 1; id <= 3; ++id) write(*s, {id, 2, /*version=*/1});
  ASSERT_TRUE(s->set_policy_version(5).ok());
  auto r = s->sample(3);
  ASSERT_TRUE(r.ok());
  ASSERT_TRUE(s->commit().ok());
  EXPECT_TRUE(r->records.empty());
  EXPECT_EQ(s->counters().withheld, 3u);
  EXPECT_EQ(s->rate_limiter().state().samples, 3u);
  write(*s, {4, 2, /*version=*/5});
  EXPECT_TRUE(s->can_insert()) << s->insert_blocked_reason();
}

TEST_F(StoreTest, RateLimiterHoldsSamplesUntilMinSizeAndInsertsWhenSamplesLag) {
  auto o = options("fifo");
  o.rate_limiter.min_size_to_sample = 3;
  o.rate_limiter.samples_per_insert = 1.0;
  o.rate_limiter.error_buffer = 1.0;
  auto s = open(o);
  write(*s, {1});
  write(*s, {2});
  auto r = s->sample(1);
  EXPECT_TRUE(r->records.empty());
  EXPECT_NE(r->blocked.find("min_size_to_sample"), std::string::npos) << r->blocked;
  write(*s, {3});
  write(*s, {4});
  EXPECT_FALSE(s->can_insert()) << "inserts run too far ahead of samples";
  EXPECT_FALSE(s->insert_blocked_reason().empty());
  EXPECT_EQ(s->sample(1)->records.size(), 1u);
  ASSERT_TRUE(s->commit().ok());
  EXPECT_TRUE(s->can_insert());
}

TEST_F(StoreTest, RetentionRemovesOnlyConsumedTrajectoriesOldestFirst) {
  auto o = options("fifo");
  o.retention.max_trajectories = 2;
  auto s = open(o);
  for (uint64_t id = 1; id <= 4; ++id) write(*s, {id});
  EXPECT_EQ(*s->enforce_retention(), 0u) << "nothing consumed yet: nothing may go";
  auto r = s->sample(3);
  ASSERT_TRUE(s->commit_deliveries(r->cursor).ok());
  ASSERT_TRUE(s->commit().ok());
  EXPECT_EQ(*s->enforce_retention(), 2u);
  EXPECT_EQ(s->read_record(1).status().code(), StatusCode::kNotFound);
  EXPECT_EQ(s->read_record(2).status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(s->read_record(3).ok());
  EXPECT_TRUE(s->read_record(4).ok());
  EXPECT_TRUE(s->read_segments(1, 0, 10, 1 << 20)->empty());
  auto report = verify_store(*s);
  ASSERT_TRUE(report.ok());
  EXPECT_TRUE(report->sound());
  EXPECT_EQ(report->trajectories, 2u);
}

TEST_F(StoreTest, PrioritizedSamplingFollowsUpdatedPriorities) {
  auto o = options("prioritized");
  o.max_times_sampled = 0;
  auto s = open(o);
  for (uint64_t id = 1; id <= 3; ++id) write(*s, {id});
  ASSERT_TRUE(s->update_priority(1, 0.0).ok());
  ASSERT_TRUE(s->update_priority(2, 0.0).ok());
  ASSERT_TRUE(s->update_priority(3, 5.0).ok());
  EXPECT_FALSE(s->update_priority(3, -1.0).ok());
  ASSERT_TRUE(s->commit().ok());
  for (int i = 0; i < 20; ++i) EXPECT_EQ(ids(*s->sample(1)), (std::vector<uint64_t>{3}));
}

TEST_F(StoreTest, FailedTrajectoriesAreKeptButNeverSampled) {
  auto s = open(options("fifo"));
  write(*s, {1, 2, 1, 0, 0, 0.0, /*failed=*/true});
  EXPECT_EQ(status_of(*s, 1), schema::TrajectoryStatus::FAILED);
  EXPECT_TRUE(s->sample(1)->records.empty());
}

}  // namespace
}  // namespace odyssey::replay
