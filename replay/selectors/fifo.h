// FifoSelector: the oldest readySeq first, without replacement (sample() removes what it
// returns; a re-inserted item goes back to its place by readySeq). Contract: selector.h.
#pragma once

#include <set>
#include <unordered_map>
#include <utility>

#include "replay/selectors/selector.h"

namespace odyssey::replay {

class FifoSelector final : public Selector {
 public:
  Status insert(const SampleItem& item) override;
  bool remove(uint64_t key) override;
  Status update_priority(uint64_t key, double priority) override;
  std::vector<SampledUnit> sample(uint32_t count, Rng& rng) override;

  size_t size() const override { return order_.size(); }
  size_t num_items() const override { return order_.size(); }
  bool with_replacement() const override { return false; }
  const char* name() const override { return "fifo"; }

 private:
  std::set<std::pair<uint64_t, uint64_t>> order_;       // (ready_seq, key)
  std::unordered_map<uint64_t, uint64_t> ready_seq_of_;  // key -> ready_seq
};

}  // namespace odyssey::replay
