// AdamW over named parameters, with gradient-norm clipping and the learning-rate schedule, and
// its whole state by name so a checkpoint resumes it bit for bit.
//
// The update is torch.optim.AdamW's (decoupled weight decay, bias-corrected moments; the test
// checks it against torch::optim::AdamW step for step):
//   t += 1;  p ← p·(1 − lr·wd);  m ← β1·m + (1 − β1)·g;  v ← β2·v + (1 − β2)·g²
//   p ← p − (lr / (1 − β1^t)) · m / (sqrt(v) / sqrt(1 − β2^t) + eps)
// It is written out here rather than taken from torch::optim so that its state has one layout
// by parameter name in every LibTorch version (torch::optim keys its state by tensor address,
// and that key type changed between LibTorch 1.13 and 2.x).
// Parameters without a gradient at a step are left alone (their moments do not move).
// On a GPU the update is one fused multi-tensor kernel (AdamWOptions::fused).
//
// Learning rate at step s (0-based count of updates taken so far):
//   s < warmup:   lr · (s + 1) / warmup
//   constant:     lr
//   cosine:       lr · ½(1 + cos(π · min(1, (s − warmup) / max(1, total − warmup))))
//
// Thread-safety: none; the learner step owns it. Errors: restore() checks names, shapes and
// dtypes and changes nothing on a mismatch (kInvalidArgument naming the tensor).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>

#include "core/status.h"

namespace odyssey::learner {

struct AdamWOptions {
  double lr = 1e-4;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // Parameters on a GPU take one multi-tensor step (LibTorch's at::_fused_adamw_, LibTorch >= 2):
  // one pass over each parameter, its gradient and moments instead of eight. The same update to
  // within fp32 rounding; false keeps the per-parameter form everywhere (the CPU always takes it).
  bool fused = true;
};

enum class LrSchedule { kConstant, kCosine };

struct ScheduleOptions {
  int64_t warmup_steps = 0;
  int64_t total_steps = 1;
  LrSchedule schedule = LrSchedule::kConstant;
};

double learning_rate(double peak, const ScheduleOptions& schedule, int64_t step);

// Scales every gradient so that their global L2 norm is at most max_norm (0: no clipping).
// Returns the norm before clipping. Parameters without a gradient are skipped. The norms are one
// multi-tensor pass with a single device sync (fp32 per tensor, summed in fp64; retaken in fp64
// a tensor at a time if the fp32 squares overflow).
double clip_grad_norm(const std::vector<at::Tensor>& params, double max_norm);

class AdamW {
 public:
  // Parameters by name (e.g. Policy::named_parameters()); the tensors are updated in place.
  AdamW(std::vector<std::pair<std::string, at::Tensor>> params, const AdamWOptions& options);

  // One update with learning rate `lr` from the parameters' current .grad.
  void step(double lr);
  int64_t steps() const { return steps_; }  // updates taken
  // Switches between the fused and the per-parameter form (AdamWOptions::fused) on the same
  // moments; `odyssey bench learner` times one against the other.
  void set_fused(bool fused) { options_.fused = fused; }

  // The state: for parameter NAME, "exp_avg.NAME", "exp_avg_sq.NAME" (fp32 or the parameter's
  // dtype, CPU copies) and "step.NAME" (int64 [1], the per-parameter update count).
  std::map<std::string, at::Tensor> state() const;
  Status restore(const std::map<std::string, at::Tensor>& state, int64_t steps);

  const std::vector<std::pair<std::string, at::Tensor>>& params() const { return params_; }

 private:
  struct Moments {
    at::Tensor exp_avg, exp_avg_sq;
    int64_t step = 0;
    at::Tensor device_step;  // the fused step's copy of `step` (fp32, on the parameter's device)
  };
  bool fused_step_applies(size_t i) const;
  std::vector<std::pair<std::string, at::Tensor>> params_;
  std::vector<Moments> moments_;
  AdamWOptions options_;
  int64_t steps_ = 0;
};

}  // namespace odyssey::learner
