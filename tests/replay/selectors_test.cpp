#include <cmath>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "replay/rng.h"
#include "replay/selectors/fifo.h"
#include "replay/selectors/group_complete.h"
#include "replay/selectors/prioritized.h"
#include "replay/selectors/selector.h"
#include "replay/selectors/sum_tree.h"
#include "replay/selectors/uniform.h"

namespace odyssey::replay {
namespace {

constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

SampleItem item(uint64_t key, uint64_t ready_seq, double priority = 1.0) {
  SampleItem it;
  it.key = key;
  it.ready_seq = ready_seq;
  it.priority = priority;
  return it;
}

SampleItem member(uint64_t key, uint64_t ready_seq, uint64_t group_id, uint32_t group_size) {
  SampleItem it = item(key, ready_seq);
  it.group_id = group_id;
  it.group_size = group_size;
  return it;
}

std::vector<uint64_t> flat(const std::vector<SampledUnit>& units) {
  std::vector<uint64_t> keys;
  for (const auto& unit : units) keys.insert(keys.end(), unit.begin(), unit.end());
  return keys;
}

// Fraction of `draws` single-key draws that returned each key.
std::map<uint64_t, double> frequencies(Selector& selector, uint32_t draws, Rng& rng) {
  std::map<uint64_t, double> freq;
  for (const auto& unit : selector.sample(draws, rng)) freq[unit.at(0)] += 1.0 / draws;
  return freq;
}

// --- Rng ---

TEST(Rng, MatchesSplitMix64ReferenceOutputs) {
  Rng rng(/*seed=*/1234567);
  EXPECT_EQ(rng.next_u64(), 6457827717110365317ull);
  EXPECT_EQ(rng.next_u64(), 3203168211198807973ull);
  EXPECT_EQ(rng.next_u64(), 9817491932198370423ull);
  EXPECT_EQ(rng.counter(), 3u);
}

TEST(Rng, SameSeedAndCounterGiveSameStream) {
  Rng original(/*seed=*/42);
  for (int i = 0; i < 5; ++i) original.next_u64();
  Rng restored(/*seed=*/original.seed(), /*counter=*/original.counter());
  for (int i = 0; i < 100; ++i) {
    ASSERT_EQ(original.uniform_int(1000), restored.uniform_int(1000));
    ASSERT_EQ(original.uniform_double(), restored.uniform_double());
  }
  EXPECT_EQ(original.counter(), restored.counter());
  EXPECT_NE(Rng(/*seed=*/1).next_u64(), Rng(/*seed=*/2).next_u64());
}

TEST(Rng, UniformIntCoversItsRangeEvenly) {
  Rng rng(/*seed=*/7);
  std::vector<int> counts(7, 0);
  for (int i = 0; i < 70000; ++i) {
    const uint64_t v = rng.uniform_int(7);
    ASSERT_LT(v, 7u);
    ++counts[v];
  }
  for (int c : counts) EXPECT_NEAR(c, 10000, 500);
  EXPECT_EQ(rng.uniform_int(1), 0u);
  EXPECT_EQ(rng.uniform_int(0), 0u);
}

TEST(Rng, UniformIntRejectsTheBiasedLowDraws) {
  // For n = 2^63 + 1, draws below 2^64 mod n = 2^63 - 1 would be biased: about half are
  // rejected, so a draw takes two raw numbers on average.
  Rng rng(/*seed=*/3);
  const uint64_t n = (uint64_t{1} << 63) + 1;
  for (int i = 0; i < 1000; ++i) ASSERT_LT(rng.uniform_int(n), n);
  EXPECT_GT(rng.counter(), 1800u);
  EXPECT_LT(rng.counter(), 2200u);
}

TEST(Rng, UniformDoubleIsInTheUnitInterval) {
  Rng rng(/*seed=*/9);
  double sum = 0;
  for (int i = 0; i < 10000; ++i) {
    const double u = rng.uniform_double();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    sum += u;
  }
  EXPECT_NEAR(sum / 10000, 0.5, 0.02);
}

// --- SumTree ---

TEST(SumTree, FindsByCumulativeWeightInReadySeqOrder) {
  SumTree tree;
  ASSERT_TRUE(tree.insert(/*key=*/30, /*ready_seq=*/3, /*weight=*/3.0).ok());
  ASSERT_TRUE(tree.insert(/*key=*/10, /*ready_seq=*/1, /*weight=*/1.0).ok());  // out of order
  ASSERT_TRUE(tree.insert(/*key=*/20, /*ready_seq=*/2, /*weight=*/2.0).ok());
  EXPECT_DOUBLE_EQ(tree.total_weight(), 6.0);
  EXPECT_EQ(tree.find_by_weight(0.0), 10u);
  EXPECT_EQ(tree.find_by_weight(0.99), 10u);
  EXPECT_EQ(tree.find_by_weight(1.0), 20u);
  EXPECT_EQ(tree.find_by_weight(2.99), 20u);
  EXPECT_EQ(tree.find_by_weight(3.0), 30u);
  EXPECT_EQ(tree.find_by_weight(100.0), 30u);
  EXPECT_EQ(tree.find_by_rank(0), 10u);
  EXPECT_EQ(tree.find_by_rank(1), 20u);
  EXPECT_EQ(tree.find_by_rank(2), 30u);
}

TEST(SumTree, NeverFindsWeightZeroItems) {
  SumTree tree;
  ASSERT_TRUE(tree.insert(1, 1, 0.0).ok());
  ASSERT_TRUE(tree.insert(2, 2, 5.0).ok());
  ASSERT_TRUE(tree.insert(3, 3, 0.0).ok());
  for (double t : {0.0, 2.5, 4.999, 5.0, 1e9}) EXPECT_EQ(tree.find_by_weight(t), 2u) << t;
}

TEST(SumTree, RemoveAndSetWeightUpdateTheSums) {
  SumTree tree;
  for (uint64_t k = 1; k <= 40; ++k) ASSERT_TRUE(tree.insert(k, k, 1.0).ok());
  EXPECT_TRUE(tree.remove(5));
  EXPECT_FALSE(tree.remove(5));
  ASSERT_TRUE(tree.set_weight(6, 10.0).ok());
  EXPECT_EQ(tree.set_weight(5, 1.0).code(), StatusCode::kNotFound);
  EXPECT_EQ(tree.insert(6, 6, 1.0).code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(tree.size(), 39u);
  EXPECT_DOUBLE_EQ(tree.total_weight(), 48.0);
  EXPECT_EQ(tree.find_by_rank(4), 6u);
  EXPECT_EQ(tree.find_by_weight(4.0), 6u);
  EXPECT_EQ(tree.find_by_weight(13.9), 6u);
  EXPECT_EQ(tree.find_by_weight(14.0), 7u);
}

TEST(SumTree, AnswersDependOnlyOnTheItemsHeld) {
  SumTree churned, fresh;
  Rng rng(/*seed=*/11);
  std::map<uint64_t, double> held;  // key (= ready_seq) -> weight
  for (uint64_t k = 1; k <= 300; ++k) {
    const double w = static_cast<double>(rng.uniform_int(5));
    ASSERT_TRUE(churned.insert(k, k, w).ok());
    held[k] = w;
    if (rng.uniform_int(3) == 0) {
      const uint64_t victim = 1 + rng.uniform_int(k);
      churned.remove(victim);
      held.erase(victim);
    }
  }
  for (const auto& [k, w] : held) ASSERT_TRUE(fresh.insert(k, k, w).ok());
  ASSERT_EQ(churned.size(), fresh.size());
  ASSERT_EQ(churned.total_weight(), fresh.total_weight());
  for (uint64_t r = 0; r < fresh.size(); ++r) {
    ASSERT_EQ(churned.find_by_rank(r), fresh.find_by_rank(r));
  }
  for (double t = 0; t < fresh.total_weight(); t += 0.5) {
    ASSERT_EQ(churned.find_by_weight(t), fresh.find_by_weight(t)) << t;
  }
}

// --- all selectors ---

TEST(Selector, FactoryMakesEachSamplerAndNamesTheAllowedOnes) {
  for (const char* name : {"fifo", "uniform", "prioritized", "group_complete"}) {
    auto selector = make_selector(name, /*priority_exponent=*/1.0);
    ASSERT_TRUE(selector.ok()) << selector.status().to_string();
    EXPECT_STREQ((*selector)->name(), name);
  }
  auto unknown = make_selector("lifo", /*priority_exponent=*/1.0);
  ASSERT_FALSE(unknown.ok());
  EXPECT_NE(unknown.status().message().find("'lifo'"), std::string::npos);
  EXPECT_NE(unknown.status().message().find("fifo, uniform, prioritized, group_complete"),
            std::string::npos);
  for (double bad : {-1.0, kNan, kInf}) {
    auto s = make_selector("prioritized", /*priority_exponent=*/bad);
    ASSERT_FALSE(s.ok());
    EXPECT_NE(s.status().message().find("priority_exponent"), std::string::npos);
  }
}

TEST(Selector, RejectsDuplicateKeysBadPrioritiesAndUnknownKeys) {
  for (const char* name : {"fifo", "uniform", "prioritized", "group_complete"}) {
    SCOPED_TRACE(name);
    auto selector = std::move(make_selector(name, /*priority_exponent=*/1.0).value());
    ASSERT_TRUE(selector->insert(item(/*key=*/0xabc, /*ready_seq=*/1)).ok());
    EXPECT_EQ(selector->insert(item(0xabc, 2)).code(), StatusCode::kAlreadyExists);
    for (double bad : {-0.5, kNan, kInf}) {
      Status s = selector->insert(item(0xdef, 3, bad));
      EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
      EXPECT_NE(s.message().find("0000000000000def"), std::string::npos) << s.message();
      EXPECT_EQ(selector->update_priority(0xabc, bad).code(), StatusCode::kInvalidArgument);
    }
    EXPECT_EQ(selector->update_priority(0x999, 1.0).code(), StatusCode::kNotFound);
    EXPECT_TRUE(selector->update_priority(0xabc, 2.0).ok());
    EXPECT_EQ(selector->num_items(), 1u);
    EXPECT_TRUE(selector->remove(0xabc));
    EXPECT_FALSE(selector->remove(0xabc));
    EXPECT_EQ(selector->size(), 0u);
    Rng rng(/*seed=*/1);
    EXPECT_TRUE(selector->sample(/*count=*/4, rng).empty());
  }
}

TEST(Selector, OnlyFifoAndGroupCompleteRemoveWhatTheySample) {
  for (const char* name : {"fifo", "uniform", "prioritized", "group_complete"}) {
    auto selector = std::move(make_selector(name, /*priority_exponent=*/1.0).value());
    for (uint64_t k = 1; k <= 3; ++k) ASSERT_TRUE(selector->insert(item(k, k)).ok());
    Rng rng(/*seed=*/1);
    EXPECT_EQ(selector->sample(/*count=*/2, rng).size(), 2u) << name;
    EXPECT_EQ(selector->num_items(), selector->with_replacement() ? 3u : 1u) << name;
  }
}

// --- Fifo ---

TEST(Fifo, ServesOldestReadySeqFirst) {
  FifoSelector fifo;
  for (auto [key, seq] : {std::pair{7, 30}, {5, 10}, {6, 20}}) {
    ASSERT_TRUE(fifo.insert(item(key, seq)).ok());
  }
  Rng rng(/*seed=*/1);
  EXPECT_EQ(flat(fifo.sample(/*count=*/2, rng)), (std::vector<uint64_t>{5, 6}));
  EXPECT_EQ(flat(fifo.sample(/*count=*/5, rng)), (std::vector<uint64_t>{7}));
  EXPECT_EQ(fifo.size(), 0u);
}

TEST(Fifo, ReinsertedItemsKeepTheirPlace) {
  FifoSelector fifo;
  for (uint64_t k = 1; k <= 4; ++k) ASSERT_TRUE(fifo.insert(item(k, k)).ok());
  Rng rng(/*seed=*/1);
  ASSERT_EQ(flat(fifo.sample(/*count=*/3, rng)), (std::vector<uint64_t>{1, 2, 3}));
  ASSERT_TRUE(fifo.insert(item(5, 5)).ok());
  // Leases on 3 and 1 released, in that order, after 5 arrived.
  ASSERT_TRUE(fifo.insert(item(3, 3)).ok());
  ASSERT_TRUE(fifo.insert(item(1, 1)).ok());
  EXPECT_EQ(flat(fifo.sample(/*count=*/10, rng)), (std::vector<uint64_t>{1, 3, 4, 5}));
}

// --- Uniform ---

TEST(Uniform, SamplesEveryItemAboutEqually) {
  UniformSelector uniform;
  for (uint64_t k = 1; k <= 10; ++k) ASSERT_TRUE(uniform.insert(item(k, k)).ok());
  ASSERT_TRUE(uniform.insert(item(11, 11)).ok());
  uniform.remove(11);
  Rng rng(/*seed=*/5);
  auto freq = frequencies(uniform, /*draws=*/50000, rng);
  EXPECT_EQ(freq.size(), 10u);
  EXPECT_EQ(freq.count(11), 0u);
  for (const auto& [key, f] : freq) EXPECT_NEAR(f, 0.1, 0.01) << key;
  EXPECT_EQ(uniform.size(), 10u);
}

TEST(Uniform, RebuiltFromTheSameItemsDrawsTheSame) {
  // What a restarted store does: insert the held items in readySeq order, restore the Rng.
  UniformSelector live, rebuilt;
  for (uint64_t k = 1; k <= 50; ++k) ASSERT_TRUE(live.insert(item(k, k)).ok());
  for (uint64_t k = 1; k <= 50; k += 3) live.remove(k);
  for (uint64_t k = 1; k <= 50; ++k) {
    if (k % 3 == 1) continue;
    ASSERT_TRUE(rebuilt.insert(item(k, k)).ok());
  }
  Rng a(/*seed=*/8, /*counter=*/100), b(/*seed=*/8, /*counter=*/100);
  EXPECT_EQ(flat(live.sample(/*count=*/200, a)), flat(rebuilt.sample(/*count=*/200, b)));
}

// --- Prioritized ---

TEST(Prioritized, SamplesProportionallyToPriority) {
  PrioritizedSelector prioritized(/*exponent=*/1.0);
  for (uint64_t k = 1; k <= 4; ++k) {
    ASSERT_TRUE(prioritized.insert(item(k, k, /*priority=*/static_cast<double>(k))).ok());
  }
  Rng rng(/*seed=*/17);
  auto freq = frequencies(prioritized, /*draws=*/50000, rng);
  for (uint64_t k = 1; k <= 4; ++k) EXPECT_NEAR(freq[k], k / 10.0, 0.01) << k;
}

TEST(Prioritized, ExponentShapesTheDistribution) {
  PrioritizedSelector squared(/*exponent=*/2.0), even(/*exponent=*/0.0);
  for (Selector* s : {static_cast<Selector*>(&squared), static_cast<Selector*>(&even)}) {
    ASSERT_TRUE(s->insert(item(1, 1, /*priority=*/1.0)).ok());
    ASSERT_TRUE(s->insert(item(2, 2, /*priority=*/2.0)).ok());
  }
  Rng rng(/*seed=*/2);
  auto sq = frequencies(squared, /*draws=*/20000, rng);
  EXPECT_NEAR(sq[1], 0.2, 0.015);
  EXPECT_NEAR(sq[2], 0.8, 0.015);
  auto un = frequencies(even, /*draws=*/20000, rng);
  EXPECT_NEAR(un[1], 0.5, 0.015);
}

TEST(Prioritized, ZeroPriorityItemsAreNeverDrawnWhileOthersHaveWeight) {
  PrioritizedSelector prioritized(/*exponent=*/1.0);
  ASSERT_TRUE(prioritized.insert(item(1, 1, /*priority=*/0.0)).ok());
  ASSERT_TRUE(prioritized.insert(item(2, 2, /*priority=*/0.5)).ok());
  ASSERT_TRUE(prioritized.insert(item(3, 3, /*priority=*/0.0)).ok());
  Rng rng(/*seed=*/4);
  for (const auto& unit : prioritized.sample(/*count=*/2000, rng)) ASSERT_EQ(unit.at(0), 2u);
}

TEST(Prioritized, ZeroTotalFallsBackToUniform) {
  PrioritizedSelector prioritized(/*exponent=*/1.0);
  for (uint64_t k = 1; k <= 4; ++k) ASSERT_TRUE(prioritized.insert(item(k, k, 0.0)).ok());
  Rng rng(/*seed=*/6);
  auto freq = frequencies(prioritized, /*draws=*/20000, rng);
  ASSERT_EQ(freq.size(), 4u);
  for (const auto& [key, f] : freq) EXPECT_NEAR(f, 0.25, 0.015) << key;
}

TEST(Prioritized, UpdatedPrioritiesTakeEffectAndBadOnesChangeNothing) {
  PrioritizedSelector prioritized(/*exponent=*/1.0);
  ASSERT_TRUE(prioritized.insert(item(1, 1, 1.0)).ok());
  ASSERT_TRUE(prioritized.insert(item(2, 2, 1.0)).ok());
  ASSERT_TRUE(prioritized.update_priority(1, 3.0).ok());
  Status bad = prioritized.update_priority(2, -1.0);
  EXPECT_EQ(bad.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.message().find("0000000000000002"), std::string::npos) << bad.message();
  Rng rng(/*seed=*/12);
  auto freq = frequencies(prioritized, /*draws=*/20000, rng);
  EXPECT_NEAR(freq[1], 0.75, 0.015);
  EXPECT_NEAR(freq[2], 0.25, 0.015);
}

TEST(Prioritized, RejectsPrioritiesWhoseWeightOverflows) {
  PrioritizedSelector prioritized(/*exponent=*/2.0);
  Status s = prioritized.insert(item(9, 1, /*priority=*/1e200));
  EXPECT_EQ(s.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("not finite"), std::string::npos) << s.message();
  EXPECT_EQ(prioritized.size(), 0u);
}

TEST(Prioritized, RebuiltFromTheSameItemsDrawsTheSame) {
  PrioritizedSelector live(/*exponent=*/1.0), rebuilt(/*exponent=*/1.0);
  for (uint64_t k = 1; k <= 60; ++k) {
    ASSERT_TRUE(live.insert(item(k, k, static_cast<double>(k % 7))).ok());
  }
  for (uint64_t k = 2; k <= 60; k += 4) live.remove(k);
  for (uint64_t k = 1; k <= 60; ++k) {
    if (k % 4 == 2) continue;
    ASSERT_TRUE(rebuilt.insert(item(k, k, static_cast<double>(k % 7))).ok());
  }
  Rng a(/*seed=*/21), b(/*seed=*/21);
  EXPECT_EQ(flat(live.sample(/*count=*/300, a)), flat(rebuilt.sample(/*count=*/300, b)));
}

// --- GroupComplete ---

TEST(GroupComplete, NeverReturnsPartialGroups) {
  GroupCompleteSelector groups;
  ASSERT_TRUE(groups.insert(
      member(/*key=*/1, /*ready_seq=*/1, /*group_id=*/100, /*group_size=*/3)).ok());
  ASSERT_TRUE(groups.insert(member(2, 2, 100, 3)).ok());
  Rng rng(/*seed=*/1);
  EXPECT_EQ(groups.size(), 0u);
  EXPECT_EQ(groups.num_items(), 2u);
  EXPECT_TRUE(groups.sample(/*count=*/5, rng).empty());
  ASSERT_TRUE(groups.insert(member(3, 3, 100, 3)).ok());
  EXPECT_EQ(groups.size(), 1u);
  auto units = groups.sample(/*count=*/5, rng);
  ASSERT_EQ(units.size(), 1u);
  EXPECT_EQ(units[0], (SampledUnit{1, 2, 3}));
  EXPECT_EQ(groups.num_items(), 0u);
}

TEST(GroupComplete, AFailedMemberIsNotWaitedForAndTheGroupIsServedWithoutIt) {
  GroupCompleteSelector groups;
  Rng rng(/*seed=*/1);
  ASSERT_TRUE(groups.insert(member(/*key=*/1, /*ready_seq=*/1, /*group_id=*/100, /*group_size=*/3)).ok());
  groups.note_failed(member(/*key=*/2, /*ready_seq=*/0, /*group_id=*/100, /*group_size=*/3));
  EXPECT_EQ(groups.size(), 0u) << "member 3 is still running";
  ASSERT_TRUE(groups.insert(member(3, 3, 100, 3)).ok());
  EXPECT_EQ(groups.size(), 1u);
  auto units = groups.sample(/*count=*/5, rng);
  ASSERT_EQ(units.size(), 1u);
  EXPECT_EQ(units[0], (SampledUnit{1, 3}));
  // Released back after the sample (a learner restart): complete again without the failed one.
  ASSERT_TRUE(groups.insert(member(1, 1, 100, 3)).ok());
  ASSERT_TRUE(groups.insert(member(3, 3, 100, 3)).ok());
  EXPECT_EQ(groups.sample(/*count=*/5, rng), (std::vector<SampledUnit>{{1, 3}}));
  // A failure noted after the others arrived completes the group then; all failed: never served.
  ASSERT_TRUE(groups.insert(member(4, 4, 200, 2)).ok());
  EXPECT_EQ(groups.size(), 0u);
  groups.note_failed(member(5, 0, 200, 2));
  EXPECT_EQ(groups.sample(/*count=*/5, rng), (std::vector<SampledUnit>{{4}}));
  groups.note_failed(member(6, 0, 300, 2));
  groups.note_failed(member(7, 0, 300, 2));
  EXPECT_EQ(groups.size(), 0u);
  EXPECT_EQ(groups.num_items(), 0u);
  // Groups of one ignore failures of other groups of one.
  groups.note_failed(member(8, 0, 0, 1));
  ASSERT_TRUE(groups.insert(member(9, 9, 0, 1)).ok());
  EXPECT_EQ(groups.sample(/*count=*/5, rng), (std::vector<SampledUnit>{{9}}));
}

TEST(GroupComplete, ServesGroupsInTheOrderTheyCompleted) {
  GroupCompleteSelector groups;
  // Group 100 starts first but completes last (readySeq 5); group 200 completes at 4.
  ASSERT_TRUE(groups.insert(
      member(/*key=*/1, /*ready_seq=*/1, /*group_id=*/100, /*group_size=*/3)).ok());
  ASSERT_TRUE(groups.insert(member(2, 2, 100, 3)).ok());
  ASSERT_TRUE(groups.insert(member(3, 3, 200, 2)).ok());
  ASSERT_TRUE(groups.insert(member(4, 4, 200, 2)).ok());
  ASSERT_TRUE(groups.insert(member(5, 5, 100, 3)).ok());
  Rng rng(/*seed=*/1);
  auto units = groups.sample(/*count=*/1, rng);
  ASSERT_EQ(units.size(), 1u);
  EXPECT_EQ(units[0], (SampledUnit{3, 4}));
  EXPECT_EQ(groups.sample(/*count=*/1, rng), (std::vector<SampledUnit>{{1, 2, 5}}));
}

TEST(GroupComplete, GroupSizeZeroOrOneIsAGroupOfOne) {
  GroupCompleteSelector groups;
  // Ungrouped trajectories share group_id 0 but are never one group.
  ASSERT_TRUE(groups.insert(
      member(/*key=*/1, /*ready_seq=*/1, /*group_id=*/0, /*group_size=*/0)).ok());
  ASSERT_TRUE(groups.insert(member(2, 2, 0, 1)).ok());
  ASSERT_TRUE(groups.insert(member(3, 3, 0, 0)).ok());
  EXPECT_EQ(groups.size(), 3u);
  Rng rng(/*seed=*/1);
  EXPECT_EQ(groups.sample(/*count=*/3, rng), (std::vector<SampledUnit>{{1}, {2}, {3}}));
}

TEST(GroupComplete, RemovingAMemberMakesTheGroupIncompleteAgain) {
  GroupCompleteSelector groups;
  ASSERT_TRUE(groups.insert(
      member(/*key=*/1, /*ready_seq=*/1, /*group_id=*/100, /*group_size=*/2)).ok());
  ASSERT_TRUE(groups.insert(member(2, 2, 100, 2)).ok());
  EXPECT_EQ(groups.size(), 1u);
  EXPECT_TRUE(groups.remove(2));
  EXPECT_EQ(groups.size(), 0u);
  EXPECT_EQ(groups.num_items(), 1u);
  Rng rng(/*seed=*/1);
  EXPECT_TRUE(groups.sample(/*count=*/1, rng).empty());
  EXPECT_TRUE(groups.remove(1));
  EXPECT_EQ(groups.num_items(), 0u);
}

TEST(GroupComplete, ReinsertedGroupReturnsToItsPlace) {
  GroupCompleteSelector groups;
  ASSERT_TRUE(groups.insert(
      member(/*key=*/1, /*ready_seq=*/1, /*group_id=*/100, /*group_size=*/2)).ok());
  ASSERT_TRUE(groups.insert(member(2, 2, 100, 2)).ok());
  ASSERT_TRUE(groups.insert(member(3, 3, 200, 2)).ok());
  ASSERT_TRUE(groups.insert(member(4, 4, 200, 2)).ok());
  Rng rng(/*seed=*/1);
  ASSERT_EQ(groups.sample(/*count=*/1, rng), (std::vector<SampledUnit>{{1, 2}}));
  ASSERT_TRUE(groups.insert(member(5, 5, 300, 1)).ok());
  // The lease on group 100 is released, members in reverse order.
  ASSERT_TRUE(groups.insert(member(2, 2, 100, 2)).ok());
  ASSERT_TRUE(groups.insert(member(1, 1, 100, 2)).ok());
  EXPECT_EQ(groups.sample(/*count=*/3, rng), (std::vector<SampledUnit>{{1, 2}, {3, 4}, {5}}));
}

TEST(GroupComplete, RejectsConflictingGroupSizesAndSurplusMembers) {
  GroupCompleteSelector groups;
  ASSERT_TRUE(groups.insert(
      member(/*key=*/1, /*ready_seq=*/1, /*group_id=*/0x100, /*group_size=*/2)).ok());
  Status conflicting = groups.insert(member(2, 2, 0x100, 3));
  EXPECT_EQ(conflicting.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(conflicting.message().find("0000000000000100"), std::string::npos);
  ASSERT_TRUE(groups.insert(member(2, 2, 0x100, 2)).ok());
  Status surplus = groups.insert(member(3, 3, 0x100, 2));
  EXPECT_EQ(surplus.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(surplus.message().find("one more"), std::string::npos) << surplus.message();
  EXPECT_EQ(groups.num_items(), 2u);
  EXPECT_EQ(groups.size(), 1u);
}

}  // namespace
}  // namespace odyssey::replay
