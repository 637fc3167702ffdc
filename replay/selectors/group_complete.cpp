#include "replay/selectors/group_complete.h"

#include <algorithm>

namespace odyssey::replay {

bool GroupCompleteSelector::complete(const GroupKey& key, const Group& group) const {
  if (group.members.empty()) return false;
  auto f = failed_.find(key);
  return group.members.size() + (f == failed_.end() ? 0u : f->second) >= group.size;
}

void GroupCompleteSelector::note_failed(const SampleItem& item) {
  const uint32_t size = std::max<uint32_t>(item.group_size, 1);
  if (size == 1) return;  // a group of one by itself: nothing waits for it
  const GroupKey gk{false, item.group_id};
  uint32_t& failed = failed_[gk];
  if (failed >= size) return;
  ++failed;
  auto it = groups_.find(gk);
  if (it != groups_.end() && complete(gk, it->second)) complete_.emplace(it->second.completed_at(), gk);
}

Status GroupCompleteSelector::insert(const SampleItem& item) {
  if (group_of_.count(item.key)) {
    return make_status(StatusCode::kAlreadyExists, "sampler already holds trajectory {:016x}",
                       item.key);
  }
  ODY_RETURN_IF_ERROR(check_priority(item.key, item.priority));
  const uint32_t size = std::max<uint32_t>(item.group_size, 1);
  const GroupKey gk = size == 1 ? GroupKey{true, item.key} : GroupKey{false, item.group_id};
  auto it = groups_.find(gk);
  if (it != groups_.end()) {
    const Group& group = it->second;
    if (group.size != size) {
      return invalid_argument(
          "trajectory {:016x} says group {:016x} has {} members, but its other members say {}",
          item.key, item.group_id, size, group.size);
    }
    if (complete(it->first, group)) {
      return invalid_argument(
          "group {:016x} already holds its {} members; trajectory {:016x} would be one more",
          item.group_id, size, item.key);
    }
  } else {
    it = groups_.emplace(gk, Group{size, {}}).first;
  }
  Group& group = it->second;
  group.members.emplace(item.ready_seq, item.key);
  group_of_[item.key] = gk;
  if (complete(gk, group)) complete_.emplace(group.completed_at(), gk);
  return Status::Ok();
}

bool GroupCompleteSelector::remove(uint64_t key) {
  auto held = group_of_.find(key);
  if (held == group_of_.end()) return false;
  auto it = groups_.find(held->second);
  Group& group = it->second;
  if (complete(it->first, group)) complete_.erase({group.completed_at(), it->first});
  for (auto m = group.members.begin(); m != group.members.end(); ++m) {
    if (m->second == key) {
      group.members.erase(m);
      break;
    }
  }
  if (group.members.empty()) groups_.erase(it);
  group_of_.erase(held);
  return true;
}

Status GroupCompleteSelector::update_priority(uint64_t key, double priority) {
  if (!group_of_.count(key)) {
    return make_status(StatusCode::kNotFound, "sampler does not hold trajectory {:016x}", key);
  }
  return check_priority(key, priority);
}

std::vector<SampledUnit> GroupCompleteSelector::sample(uint32_t count, Rng&) {
  std::vector<SampledUnit> units;
  while (units.size() < count && !complete_.empty()) {
    auto it = groups_.find(complete_.begin()->second);
    SampledUnit unit;
    for (const auto& [ready_seq, key] : it->second.members) {
      unit.push_back(key);
      group_of_.erase(key);
    }
    units.push_back(std::move(unit));
    groups_.erase(it);
    complete_.erase(complete_.begin());
  }
  return units;
}

}  // namespace odyssey::replay
