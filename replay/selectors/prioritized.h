// PrioritizedSelector: with replacement, each draw picks an item with probability
// priority^exponent / sum of all priority^exponent (Schaul et al.'s prioritized replay),
// through a sum tree: O(log n) insert, remove, update and draw. When every weight is 0 a
// draw is uniform among the items held. Priorities must be finite and >= 0, and so must
// priority^exponent; otherwise insert/update_priority return kInvalidArgument naming the
// key and change nothing. Contract: selector.h.
#pragma once

#include "replay/selectors/selector.h"
#include "replay/selectors/sum_tree.h"

namespace odyssey::replay {

class PrioritizedSelector final : public Selector {
 public:
  // `exponent` must be finite and >= 0 (make_selector checks); 0 samples uniformly.
  explicit PrioritizedSelector(double exponent) : exponent_(exponent) {}

  Status insert(const SampleItem& item) override;
  bool remove(uint64_t key) override { return items_.remove(key); }
  Status update_priority(uint64_t key, double priority) override;
  std::vector<SampledUnit> sample(uint32_t count, Rng& rng) override;

  size_t size() const override { return items_.size(); }
  size_t num_items() const override { return items_.size(); }
  bool with_replacement() const override { return true; }
  const char* name() const override { return "prioritized"; }

  double exponent() const { return exponent_; }

 private:
  Result<double> weight_of(uint64_t key, double priority) const;

  double exponent_;
  SumTree items_;
};

}  // namespace odyssey::replay
