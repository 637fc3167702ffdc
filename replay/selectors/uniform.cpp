#include "replay/selectors/uniform.h"

namespace odyssey::replay {

Status UniformSelector::insert(const SampleItem& item) {
  ODY_RETURN_IF_ERROR(check_priority(item.key, item.priority));
  return items_.insert(item.key, item.ready_seq, /*weight=*/0.0);
}

Status UniformSelector::update_priority(uint64_t key, double priority) {
  if (!items_.contains(key)) {
    return make_status(StatusCode::kNotFound, "sampler does not hold trajectory {:016x}", key);
  }
  return check_priority(key, priority);
}

std::vector<SampledUnit> UniformSelector::sample(uint32_t count, Rng& rng) {
  std::vector<SampledUnit> units;
  if (items_.size() == 0) return units;
  units.reserve(count);
  for (uint32_t i = 0; i < count; ++i) {
    units.push_back({items_.find_by_rank(rng.uniform_int(items_.size()))});
  }
  return units;
}

}  // namespace odyssey::replay
