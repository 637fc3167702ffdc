// Expert load balancing without an auxiliary loss (MODEL.md "Quantile balancing").
//
// Every MoE layer routes with T = top-k of (s + b): s the unbiased router scores (m tokens × n
// experts), b a per-expert bias that changes selection only, never the mixing weights. A
// balancer watches each step's scores and moves b so that every expert gets its share of tokens.
// Two policies sit behind ExpertBalancer:
//
// QuantileBalancer (ours). With α_i the (k+1)-th largest of (s_i + b), token i picks expert j
// iff b_j > r_ij = α_i − s_ij (but see below for the pairs not chosen). With target load
// q = m·k/n, b_j is set to the q-quantile of {r_ij}_i, so that exactly q tokens fall below it,
// then b ← b − mean(b) (selection is invariant under a shift of b).
//   r_ij for a pair not chosen: MODEL.md writes r_ij = α_i − s_ij for every pair. That is right
// for the chosen pairs and says correctly that the others are not chosen, but it is not where
// they would flip: raising b_j alone, token i takes j once s_ij + b_j passes the k-th largest
// of (s_i + b), not the (k+1)-th. With the literal form, every token that ranks j (k+1)-th puts
// r_ij exactly at b_j, a point mass right where an under-loaded expert's quantile sits: its
// bias cannot rise past it, the correction stalls (64 experts, top-4, 10× skew: ≤ 1.05 after
// 5–8 steps instead of 2) and the histogram form, which spreads the mass across its bin, is off
// by 2–3 % of q instead of < 1 %. So by default a pair not chosen uses
//     r_ij = (k-th largest of s_i + b) − s_ij,
// the exact flip point for every pair, which keeps "j chosen iff b_j > r_ij" at the current b.
// literal_alpha = true restores MODEL.md's form.
//   Where the spec reads "the (q+1)-th smallest r_ij", we take the midpoint of the q-th and
// (q+1)-th smallest (linear interpolation of the sorted r at 0-based position
// q − ½): any value in between gives load q against this batch's α, and the midpoint keeps
// every token off the boundary, where rounding and top-k tie breaking would decide. A fractional
// q interpolates the same way. α moves with b, so balance is a fixed point reached in a few
// steps, not one. Optional EMA: b ← decay·b + (1 − decay)·b_target (decay 0 = off).
//   Two forms of the target:
//   * exact: sort r per expert (update(scores)); the scores of the whole batch must be local.
//   * distributed: local_histogram(scores) counts r per expert into histogram_bins bins over a
//     fixed range, [min b − 1, max b + 1] (r always lies there since s ∈ (0, 1); it depends only
//     on b, which every rank shares, so no communication fixes it). Sum the int64 [n, bins]
//     histograms over ranks (one integer all-reduce per layer), then update_from_histogram():
//     the q-crossing is found by linear interpolation inside the bin where the cumulative count
//     passes q. m is recovered from the histogram (each row sums to it).
//
// SignRuleBalancer (DeepSeek-V3, the comparison): b_j += γ·sign(mean_load − load_j).
//
// State: bias [n] fp32 and the number of updates taken. The EMA keeps no state beyond the bias
// (the bias is the running average). state()/restore() round-trip it exactly; a frozen balancer
// (inference) ignores updates. Options are configuration, not state.
//
// Tensors: scores [m, n] floating (fp32 from the router), unbiased and detached (no gradient
// flows through any of this); selected [m, k] int64 expert ids. The bias lives on the device of
// the last scores seen.
// Thread-safety: none; one balancer belongs to one MoE layer, updated by the learner step.
#pragma once

#include <cstdint>
#include <utility>

#include <torch/types.h>

#include "core/status.h"

namespace odyssey::model {

// T = top-k of (scores + bias) per row: int64 [m, k], in no particular order within a row. The
// rule MoE forward routes with.
torch::Tensor select_experts(const torch::Tensor& scores, const torch::Tensor& bias, int64_t top_k);

// Tokens routed to each expert: int64 [n] from selected [m, k].
torch::Tensor expert_load(const torch::Tensor& selected, int64_t num_experts);

struct BalanceStats {
  double mean_load = 0;      // m·k/n
  int64_t max_load = 0;
  int64_t min_load = 0;
  double max_over_mean = 0;  // 1 is perfect balance
  int64_t dead_experts = 0;  // experts with load 0
};
BalanceStats balance_stats(const torch::Tensor& selected, int64_t num_experts);

struct BalancerState {
  torch::Tensor bias;  // [n] fp32
  int64_t step = 0;    // updates taken
};

class ExpertBalancer {
 public:
  ExpertBalancer(int64_t num_experts, int64_t top_k);
  virtual ~ExpertBalancer() = default;

  // Observes one step's unbiased scores [m, n] and moves the bias; returns the bias to route with
  // from the next step on (copy it into the layer: MoeImpl::set_expert_bias). While frozen,
  // returns the bias unchanged.
  virtual torch::Tensor update(const torch::Tensor& scores) = 0;

  const torch::Tensor& bias() const { return bias_; }
  int64_t step() const { return step_; }
  int64_t num_experts() const { return num_experts_; }
  int64_t top_k() const { return top_k_; }
  void set_frozen(bool frozen) { frozen_ = frozen; }
  bool frozen() const { return frozen_; }

  // A deep copy on the CPU.
  BalancerState state() const;
  // kInvalidArgument (and no change) when the bias is not a floating [n] tensor or step < 0.
  Status restore(const BalancerState& state);

 protected:
  // Checks scores [m, n] and moves the bias to their device.
  void check_scores(const torch::Tensor& scores, const char* where);

  int64_t num_experts_;
  int64_t top_k_;
  torch::Tensor bias_;
  int64_t step_ = 0;
  bool frozen_ = false;
};

struct QuantileBalancerOptions {
  int64_t num_experts = 0;
  int64_t top_k = 0;            // < num_experts
  double ema_decay = 0.0;       // in [0, 1); 0 takes the quantile target as is
  int64_t histogram_bins = 1000;
  bool literal_alpha = false;   // r_ij = α_i − s_ij for pairs not chosen too (see above)
};

class QuantileBalancer : public ExpertBalancer {
 public:
  explicit QuantileBalancer(const QuantileBalancerOptions& options);

  // The exact form.
  torch::Tensor update(const torch::Tensor& scores) override;

  // The distributed form: this rank's int64 [n, histogram_bins] counts of r; sum over ranks,
  // then update_from_histogram(). The bias must not change in between (the range follows it).
  // In the GPU build, CUDA scores (not fp64) are counted by a kernel with the same result bit
  // for bit (kernels::moe_quantile_histogram).
  torch::Tensor local_histogram(const torch::Tensor& scores) const;
  torch::Tensor update_from_histogram(const torch::Tensor& histogram);
  // [lo, hi] of the histogram: [min b − 1, max b + 1].
  std::pair<double, double> histogram_range() const;

  // The centred quantile targets, before the EMA, without moving the state: fp32 [n].
  torch::Tensor exact_target(const torch::Tensor& scores) const;
  torch::Tensor histogram_target(const torch::Tensor& histogram) const;

  const QuantileBalancerOptions& options() const { return options_; }

 private:
  torch::Tensor apply_target(const torch::Tensor& target);
  torch::Tensor residuals(const torch::Tensor& scores) const;  // r [m, n]

  QuantileBalancerOptions options_;
};

struct SignRuleOptions {
  int64_t num_experts = 0;
  int64_t top_k = 0;
  double gamma = 1e-3;  // DeepSeek-V3's bias update speed
};

class SignRuleBalancer : public ExpertBalancer {
 public:
  explicit SignRuleBalancer(const SignRuleOptions& options);

  torch::Tensor update(const torch::Tensor& scores) override;

  const SignRuleOptions& options() const { return options_; }

 private:
  SignRuleOptions options_;
};

}  // namespace odyssey::model
