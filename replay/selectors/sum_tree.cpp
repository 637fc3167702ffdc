#include "replay/selectors/sum_tree.h"

#include <algorithm>
#include <tuple>

namespace odyssey::replay {
namespace {

bool comes_before(uint64_t seq_a, uint64_t key_a, uint64_t seq_b, uint64_t key_b) {
  return std::tie(seq_a, key_a) < std::tie(seq_b, key_b);
}

}  // namespace

Status SumTree::insert(uint64_t key, uint64_t ready_seq, double weight) {
  if (contains(key)) {
    return make_status(StatusCode::kAlreadyExists, "sampler already holds trajectory {:016x}", key);
  }
  const bool in_order = slots_.empty() ||
                        comes_before(slots_.back().ready_seq, slots_.back().key, ready_seq, key);
  if (!in_order || slots_.size() == capacity_) {
    rebuild(Slot{ready_seq, key}, weight);
    return Status::Ok();
  }
  slots_.push_back(Slot{ready_seq, key});
  slot_of_[key] = slots_.size() - 1;
  set_leaf(slots_.size() - 1, weight, 1);
  return Status::Ok();
}

bool SumTree::remove(uint64_t key) {
  auto it = slot_of_.find(key);
  if (it == slot_of_.end()) return false;
  set_leaf(it->second, 0.0, 0);
  slot_of_.erase(it);
  return true;
}

Status SumTree::set_weight(uint64_t key, double weight) {
  auto it = slot_of_.find(key);
  if (it == slot_of_.end()) {
    return make_status(StatusCode::kNotFound, "sampler does not hold trajectory {:016x}", key);
  }
  set_leaf(it->second, weight, 1);
  return Status::Ok();
}

uint64_t SumTree::find_by_weight(double target) const {
  size_t node = 1;
  while (node < capacity_) {
    const size_t left = 2 * node;
    // Going right only into positive weight keeps the walk off weight-0 leaves even when
    // rounding puts `target` at or past the end.
    if (target < weight_[left] || weight_[left + 1] <= 0.0) {
      node = left;
    } else {
      target -= weight_[left];
      node = left + 1;
    }
  }
  return slots_[node - capacity_].key;
}

uint64_t SumTree::find_by_rank(uint64_t rank) const {
  size_t node = 1;
  while (node < capacity_) {
    const size_t left = 2 * node;
    if (rank < count_[left]) {
      node = left;
    } else {
      rank -= count_[left];
      node = left + 1;
    }
  }
  return slots_[node - capacity_].key;
}

void SumTree::set_leaf(size_t slot, double weight, uint64_t count) {
  size_t node = capacity_ + slot;
  weight_[node] = weight;
  count_[node] = count;
  for (node /= 2; node > 0; node /= 2) {
    weight_[node] = weight_[2 * node] + weight_[2 * node + 1];
    count_[node] = count_[2 * node] + count_[2 * node + 1];
  }
}

void SumTree::rebuild(const Slot& extra, double extra_weight) {
  std::vector<std::pair<Slot, double>> held;
  held.reserve(slot_of_.size() + 1);
  for (size_t s = 0; s < slots_.size(); ++s) {
    if (count_[capacity_ + s] > 0) held.emplace_back(slots_[s], weight_[capacity_ + s]);
  }
  auto at = std::lower_bound(held.begin(), held.end(), extra, [](const auto& h, const Slot& x) {
    return comes_before(h.first.ready_seq, h.first.key, x.ready_seq, x.key);
  });
  held.insert(at, {extra, extra_weight});

  capacity_ = 16;
  while (capacity_ < 2 * held.size()) capacity_ *= 2;
  slots_.clear();
  slot_of_.clear();
  weight_.assign(2 * capacity_, 0.0);
  count_.assign(2 * capacity_, 0);
  for (const auto& [slot, weight] : held) {
    slot_of_[slot.key] = slots_.size();
    weight_[capacity_ + slots_.size()] = weight;
    count_[capacity_ + slots_.size()] = 1;
    slots_.push_back(slot);
  }
  for (size_t node = capacity_ - 1; node > 0; --node) {
    weight_[node] = weight_[2 * node] + weight_[2 * node + 1];
    count_[node] = count_[2 * node] + count_[2 * node + 1];
  }
}

}  // namespace odyssey::replay
