#include "replay/selectors/selector.h"

#include <cmath>

#include "replay/selectors/fifo.h"
#include "replay/selectors/group_complete.h"
#include "replay/selectors/prioritized.h"
#include "replay/selectors/uniform.h"

namespace odyssey::replay {

Status check_priority(uint64_t key, double priority) {
  if (std::isfinite(priority) && priority >= 0.0) return Status::Ok();
  return invalid_argument("trajectory {:016x}: priority must be a finite number >= 0, got {}", key,
                          priority);
}

Result<std::unique_ptr<Selector>> make_selector(const std::string& name,
                                                double priority_exponent) {
  if (name == "fifo") return std::unique_ptr<Selector>(new FifoSelector());
  if (name == "uniform") return std::unique_ptr<Selector>(new UniformSelector());
  if (name == "group_complete") return std::unique_ptr<Selector>(new GroupCompleteSelector());
  if (name == "prioritized") {
    if (!std::isfinite(priority_exponent) || priority_exponent < 0.0) {
      return invalid_argument(
          "prioritized sampler: priority_exponent must be a finite number >= 0, got {}",
          priority_exponent);
    }
    return std::unique_ptr<Selector>(new PrioritizedSelector(priority_exponent));
  }
  return invalid_argument(
      "unknown sampler '{}': must be one of fifo, uniform, prioritized, group_complete", name);
}

}  // namespace odyssey::replay
