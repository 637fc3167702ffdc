// SumTree: items in readySeq order, each with a weight, drawn in O(log n) by cumulative
// weight (prioritized) or by rank (uniform).
//
// Items sit in slots ordered by (ready_seq, key), under a binary tree of partial sums of
// weights and of item counts. An insert in order appends a slot; a remove leaves an empty
// slot (weight 0, count 0). When the slots are full, or an insert comes out of order, the
// slots are rebuilt without the empty ones (O(n), amortised over the inserts that filled
// them). Answers depend only on the items held and their order, never on empty slots, so a
// tree rebuilt from the same items answers the same: exactly for ranks, and for weights up
// to the rounding of partial sums (which can move a draw only at a boundary between items).
//
// Weights must be finite and >= 0 (the caller checks). Not thread-safe.
#pragma once

#include <cstdint>
#include <unordered_map>
#include <vector>

#include "core/status.h"

namespace odyssey::replay {

class SumTree {
 public:
  Status insert(uint64_t key, uint64_t ready_seq, double weight);  // kAlreadyExists if held
  bool remove(uint64_t key);                                       // whether it was held
  Status set_weight(uint64_t key, double weight);                  // kNotFound if not held
  bool contains(uint64_t key) const { return slot_of_.count(key) > 0; }

  size_t size() const { return slot_of_.size(); }
  double total_weight() const { return capacity_ == 0 ? 0.0 : weight_[1]; }

  // The item at which the cumulative weight, in readySeq order, first exceeds `target`;
  // never an item of weight 0. Requires total_weight() > 0; targets past the end give the
  // last item of positive weight.
  uint64_t find_by_weight(double target) const;
  // The item of 0-based rank `rank` in readySeq order. Requires rank < size().
  uint64_t find_by_rank(uint64_t rank) const;

 private:
  struct Slot {
    uint64_t ready_seq;
    uint64_t key;
  };
  void set_leaf(size_t slot, double weight, uint64_t count);
  void rebuild(const Slot& extra, double extra_weight);

  std::vector<Slot> slots_;                       // (ready_seq, key) order, empty ones included
  std::unordered_map<uint64_t, size_t> slot_of_;  // key -> slot, held items only
  size_t capacity_ = 0;                           // leaves; a power of two
  std::vector<double> weight_;  // node i has children 2i and 2i+1; leaves start at capacity_
  std::vector<uint64_t> count_;  // items held under each node
};

}  // namespace odyssey::replay
