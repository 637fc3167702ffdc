#include "replay/selectors/fifo.h"

namespace odyssey::replay {

Status FifoSelector::insert(const SampleItem& item) {
  if (ready_seq_of_.count(item.key)) {
    return make_status(StatusCode::kAlreadyExists, "sampler already holds trajectory {:016x}",
                       item.key);
  }
  ODY_RETURN_IF_ERROR(check_priority(item.key, item.priority));
  ready_seq_of_[item.key] = item.ready_seq;
  order_.emplace(item.ready_seq, item.key);
  return Status::Ok();
}

bool FifoSelector::remove(uint64_t key) {
  auto it = ready_seq_of_.find(key);
  if (it == ready_seq_of_.end()) return false;
  order_.erase({it->second, key});
  ready_seq_of_.erase(it);
  return true;
}

Status FifoSelector::update_priority(uint64_t key, double priority) {
  if (!ready_seq_of_.count(key)) {
    return make_status(StatusCode::kNotFound, "sampler does not hold trajectory {:016x}", key);
  }
  return check_priority(key, priority);
}

std::vector<SampledUnit> FifoSelector::sample(uint32_t count, Rng&) {
  std::vector<SampledUnit> units;
  while (units.size() < count && !order_.empty()) {
    const uint64_t key = order_.begin()->second;
    units.push_back({key});
    order_.erase(order_.begin());
    ready_seq_of_.erase(key);
  }
  return units;
}

}  // namespace odyssey::replay
