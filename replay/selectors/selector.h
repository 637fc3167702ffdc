// Selector: the policy that chooses which trajectories a sample returns.
//
// The store owns items (trajectory records in RocksDB); a selector holds only what it needs
// to choose among the sampleable ones, in memory. At open the store rebuilds it by inserting
// every sampleable record in readySeq order. Every selector is a deterministic function of
// its current items (not of the history that produced them) and the Rng, so a restarted
// store that restores the Rng draws exactly what the old one would have drawn.
//
// Two kinds, told apart by with_replacement():
//   - without replacement (fifo, group_complete): sample() removes what it returns. When a
//     lease is released the store inserts the items again; they go back to their place in
//     readySeq order, wherever in time the re-insert happens.
//   - with replacement (uniform, prioritized): sample() keeps items; each unit is an
//     independent draw, so one call may return a key more than once. The store removes an
//     item once it reaches its max_times_sampled.
//
// Errors: insert() of a key already held is kAlreadyExists; a priority that is negative,
// NaN or infinite is kInvalidArgument naming the key; update_priority() of a key not held
// is kNotFound. A failed call changes nothing.
//
// Not thread-safe: the service drives its selector from one thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/status.h"
#include "replay/rng.h"

namespace odyssey::replay {

struct SampleItem {
  uint64_t key = 0;          // trajectory id
  uint64_t ready_seq = 0;    // order in which it became sampleable; orders every selector
  uint64_t group_id = 0;     // group_complete only
  uint32_t group_size = 0;   // group_complete only; 0 or 1 = a group of one
  double priority = 0;       // prioritized only (others check it is valid and ignore it)
  uint32_t times_sampled = 0;  // the store's count, carried for it; selectors ignore it
};

// The keys of one sampled unit: one item, or a whole group in readySeq order.
using SampledUnit = std::vector<uint64_t>;

class Selector {
 public:
  virtual ~Selector() = default;

  virtual Status insert(const SampleItem& item) = 0;
  // Whether `key` was held (an incomplete group's member counts).
  virtual bool remove(uint64_t key) = 0;
  virtual Status update_priority(uint64_t key, double priority) = 0;
  // A trajectory that ended FAILED (`item` describes it; it is never inserted). Selectors that
  // serve whole groups stop waiting for it: its group is served with the members that finished.
  // Called once per failed trajectory, also when the store reloads; the default ignores it.
  virtual void note_failed(const SampleItem& item) { (void)item; }
  // Up to `count` units; fewer (maybe none) when fewer are sampleable.
  virtual std::vector<SampledUnit> sample(uint32_t count, Rng& rng) = 0;

  virtual size_t size() const = 0;       // sampleable units (complete groups for group_complete)
  virtual size_t num_items() const = 0;  // items held, members of incomplete groups included
  virtual bool with_replacement() const = 0;
  virtual const char* name() const = 0;  // as make_selector() takes it
};

// kInvalidArgument naming `key` unless `priority` is finite and >= 0.
Status check_priority(uint64_t key, double priority);

// name: fifo | uniform | prioritized | group_complete. priority_exponent (prioritized only):
// sampling probability is proportional to priority^exponent; finite and >= 0 (0 = uniform).
Result<std::unique_ptr<Selector>> make_selector(const std::string& name, double priority_exponent);

}  // namespace odyssey::replay
