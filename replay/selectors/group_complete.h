// GroupCompleteSelector: whole groups (the trajectories of one task that GRPO-style
// learners need together), without replacement.
//
// An item belongs to group `group_id` of `group_size` members; group_size 0 or 1 makes it a
// group of one by itself (its group_id is then ignored). A group is sampleable once all its
// members are held, and sample() returns it whole, members in readySeq order, and removes
// it; a partial group is never returned. Groups are served in the order they became
// complete: by the largest readySeq among their members. Removing a member makes its group
// incomplete again; inserting it back (a released lease) restores the group at the same
// place in that order.
//
// insert() errors, besides selector.h's: kInvalidArgument when the item's group_size
// differs from that of members already held, or when its group already holds group_size
// members. A member that ended FAILED (note_failed) is no longer waited for: the group is
// complete once its other members are held, and is served without it (a group whose members
// all failed is never served). The count of failed members is kept per group for the
// selector's life, so members released back after a sample complete their group again.
// Members of a group that never completes stay held (num_items() counts them, size() does
// not) until the store removes them. Contract: selector.h.
#pragma once

#include <map>
#include <set>
#include <unordered_map>
#include <utility>

#include "replay/selectors/selector.h"

namespace odyssey::replay {

class GroupCompleteSelector final : public Selector {
 public:
  Status insert(const SampleItem& item) override;
  bool remove(uint64_t key) override;
  Status update_priority(uint64_t key, double priority) override;
  std::vector<SampledUnit> sample(uint32_t count, Rng& rng) override;
  void note_failed(const SampleItem& item) override;

  size_t size() const override { return complete_.size(); }
  size_t num_items() const override { return group_of_.size(); }
  bool with_replacement() const override { return false; }
  const char* name() const override { return "group_complete"; }

 private:
  // (a group of one, group_id or that one item's key): groups of one never share an id.
  using GroupKey = std::pair<bool, uint64_t>;
  struct Group {
    uint32_t size = 1;
    std::set<std::pair<uint64_t, uint64_t>> members;  // (ready_seq, key)
    uint64_t completed_at() const { return members.rbegin()->first; }
  };
  bool complete(const GroupKey& key, const Group& group) const;

  std::map<GroupKey, Group> groups_;
  std::unordered_map<uint64_t, GroupKey> group_of_;        // key -> its group
  std::set<std::pair<uint64_t, GroupKey>> complete_;       // (completed_at, group), serving order
  std::map<GroupKey, uint32_t> failed_;                    // members that ended FAILED, per group
};

}  // namespace odyssey::replay
