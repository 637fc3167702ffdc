#include "replay/selectors/prioritized.h"

#include <cmath>

namespace odyssey::replay {

Result<double> PrioritizedSelector::weight_of(uint64_t key, double priority) const {
  ODY_RETURN_IF_ERROR(check_priority(key, priority));
  const double weight = std::pow(priority, exponent_);
  if (!std::isfinite(weight)) {
    return invalid_argument("trajectory {:016x}: priority {} to the power {} is not finite", key,
                            priority, exponent_);
  }
  return weight;
}

Status PrioritizedSelector::insert(const SampleItem& item) {
  ODY_ASSIGN_OR_RETURN(const double weight, weight_of(item.key, item.priority));
  return items_.insert(item.key, item.ready_seq, weight);
}

Status PrioritizedSelector::update_priority(uint64_t key, double priority) {
  if (!items_.contains(key)) {
    return make_status(StatusCode::kNotFound, "sampler does not hold trajectory {:016x}", key);
  }
  ODY_ASSIGN_OR_RETURN(const double weight, weight_of(key, priority));
  return items_.set_weight(key, weight);
}

std::vector<SampledUnit> PrioritizedSelector::sample(uint32_t count, Rng& rng) {
  std::vector<SampledUnit> units;
  if (items_.size() == 0) return units;
  units.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    const double total = items_.total_weight();
    const uint64_t key = total > 0.0 ? items_.find_by_weight(rng.uniform_double() * total)
                                     : items_.find_by_rank(rng.uniform_int(items_.size()));
    units.push_back({key});
  }
  return units;
}

}  // namespace odyssey::replay
