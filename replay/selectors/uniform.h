// UniformSelector: every held item equally likely, with replacement. O(log n) insert,
// remove and draw. A draw is the item of rank uniform_int(size) in readySeq order, so it
// depends only on the items held and the Rng. Contract: selector.h.
#pragma once

#include "replay/selectors/selector.h"
#include "replay/selectors/sum_tree.h"

namespace odyssey::replay {

class UniformSelector final : public Selector {
 public:
  Status insert(const SampleItem& item) override;
  bool remove(uint64_t key) override { return items_.remove(key); }
  Status update_priority(uint64_t key, double priority) override;
  std::vector<SampledUnit> sample(uint32_t count, Rng& rng) override;

  size_t size() const override { return items_.size(); }
  size_t num_items() const override { return items_.size(); }
  bool with_replacement() const override { return true; }
  const char* name() const override { return "uniform"; }

 private:
  SumTree items_;  // ranks only; weights unused
};

}  // namespace odyssey::replay
