#include "learner/policy_gradient.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <torch/types.h>

namespace odyssey::learner {

namespace {

// Per-position training inputs of one micro-batch ([B, T] CPU tensors).
struct MicroBatch {
  int64_t rows = 0, length = 0;
  at::Tensor tokens;      // int64, right-padded with 0
  at::Tensor targets;     // int64: token at p + 1 (0 past the end)
  at::Tensor logp_actor;  // fp32: actor log-prob of the target
  at::Tensor loss_mask;   // fp32: 1 where the target is a model-written token
  at::Tensor advantages;  // fp32: the row's advantage
  at::Tensor valid;       // bool: p < row length (routing statistics count these)
  at::Tensor logp_old;    // fp32, filled by the first (or only) forward
  at::Tensor logp_ref;    // fp32, when there is a reference
};

MicroBatch make_micro_batch(const std::vector<const TrajectoryTokens*>& rows) {
  MicroBatch mb;
  mb.rows = static_cast<int64_t>(rows.size());
  for (const auto* t : rows) mb.length = std::max(mb.length, t->length());
  const int64_t B = mb.rows, T = mb.length;
  mb.tokens = at::zeros({B, T}, at::kLong);
  mb.targets = at::zeros({B, T}, at::kLong);
  mb.logp_actor = at::zeros({B, T}, at::kFloat);
  mb.loss_mask = at::zeros({B, T}, at::kFloat);
  mb.advantages = at::zeros({B, T}, at::kFloat);
  mb.valid = at::zeros({B, T}, at::kBool);
  mb.logp_old = at::zeros({B, T}, at::kFloat);
  auto tok = mb.tokens.accessor<int64_t, 2>();
  auto tgt = mb.targets.accessor<int64_t, 2>();
  auto lpa = mb.logp_actor.accessor<float, 2>();
  auto msk = mb.loss_mask.accessor<float, 2>();
  auto adv = mb.advantages.accessor<float, 2>();
  auto val = mb.valid.accessor<bool, 2>();
  for (int64_t b = 0; b < B; ++b) {
    const TrajectoryTokens& t = *rows[static_cast<size_t>(b)];
    const int64_t n = t.length();
    for (int64_t p = 0; p < n; ++p) {
      tok[b][p] = t.tokens[static_cast<size_t>(p)];
      val[b][p] = true;
      adv[b][p] = static_cast<float>(t.advantage);
      if (p + 1 < n) {
        const size_t q = static_cast<size_t>(p + 1);
        tgt[b][p] = t.tokens[q];
        lpa[b][p] = t.logprobs[q];
        msk[b][p] = t.loss_mask[q] ? 1.0f : 0.0f;
      }
    }
  }
  return mb;
}

// log π(target) [B, n] (fp32, CPU) from logits [B, n, V].
at::Tensor target_logp(const at::Tensor& logits, const at::Tensor& targets) {
  return at::log_softmax(logits.detach().to(at::kFloat), -1)
      .gather(2, targets.to(logits.device()).unsqueeze(2))
      .squeeze(2)
      .to(at::kCPU);
}

}  // namespace

PolicyGradientResult accumulate_policy_gradient(ChunkedPolicy& runner, ChunkedPolicy* reference,
                                                const std::vector<TrajectoryTokens>& trajectories,
                                                const std::vector<model::QuantileBalancer*>& balancers,
                                                const PolicyGradientOptions& o) {
  PolicyGradientResult result;
  result.histograms.resize(balancers.size());
  double tokens_global = o.tokens_global;
  if (tokens_global <= 0)
    for (const auto& t : trajectories) tokens_global += static_cast<double>(t.trained_tokens());

  std::vector<const TrajectoryTokens*> order;
  for (const auto& t : trajectories)
    if (t.length() >= 2) order.push_back(&t);
  std::stable_sort(order.begin(), order.end(),
                   [](const TrajectoryTokens* a, const TrajectoryTokens* b) { return a->length() > b->length(); });

  for (size_t i = 0; i < order.size();) {
    const int64_t longest = order[i]->length();
    const size_t rows =
        std::clamp<size_t>(static_cast<size_t>(o.chunk_tokens / std::max<int64_t>(1, longest)), 1, order.size() - i);
    MicroBatch mb = make_micro_batch(std::vector<const TrajectoryTokens*>(order.begin() + static_cast<long>(i),
                                                                          order.begin() + static_cast<long>(i + rows)));
    i += rows;
    ++result.micro_batches;
    const int64_t B = mb.rows, T = mb.length;
    const int64_t chunk = std::max<int64_t>(16, o.chunk_tokens / B);
    auto tokens_of = [&](int64_t s, int64_t n) { return mb.tokens.narrow(1, s, n).to(o.device); };
    auto flat = [&](const at::Tensor& t, int64_t s, int64_t n) { return t.narrow(1, s, n).reshape({-1}).to(o.device); };

    if (reference) {
      mb.logp_ref = at::zeros({B, T}, at::kFloat);
      chunked_forward(*reference, B, T, chunk, tokens_of, [&](const ChunkView& v) {
        mb.logp_ref.narrow(1, v.start, v.length).copy_(target_logp(v.output->logits, mb.targets.narrow(1, v.start, v.length)));
      });
    }

    ChunkCallbacks cb;
    cb.tokens = tokens_of;
    cb.observe = [&](const ChunkView& v) {
      const at::NoGradGuard no_grad;
      ++result.chunks;
      mb.logp_old.narrow(1, v.start, v.length).copy_(target_logp(v.output->logits, mb.targets.narrow(1, v.start, v.length)));
      const at::Tensor rows_valid = mb.valid.narrow(1, v.start, v.length).reshape({-1}).nonzero().squeeze(1);
      if (rows_valid.numel() == 0 || balancers.empty()) return;
      const at::Tensor rows_on_device = rows_valid.to(o.device);  // one copy for every layer
      for (size_t j = 0; j < v.output->routing.size() && j < balancers.size(); ++j) {
        const at::Tensor scores = v.output->routing[j].to(at::kFloat).index_select(0, rows_on_device);
        // Summed where they are made (no device sync a layer and chunk); to the CPU at the end.
        const at::Tensor h = balancers[j]->local_histogram(scores);
        result.histograms[j] = result.histograms[j].defined() ? result.histograms[j] + h : h;
      }
    };
    cb.loss = [&](const ChunkView& v) -> at::Tensor {
      const int64_t s = v.start, n = v.length;
      TokenLossInputs in;
      in.logits = v.output->logits.reshape({B * n, -1}).to(at::kFloat);
      in.targets = flat(mb.targets, s, n);
      in.logp_old = flat(mb.logp_old, s, n);
      in.logp_actor = flat(mb.logp_actor, s, n);
      in.advantages = flat(mb.advantages, s, n);
      in.loss_mask = flat(mb.loss_mask, s, n);
      if (mb.logp_ref.defined()) in.logp_ref = flat(mb.logp_ref, s, n);
      LossSums piece = token_loss_sums(in, o.loss);
      const at::Tensor loss = piece.loss_sum;
      piece.loss_sum = at::Tensor();
      result.sums.add(piece);
      if (piece.tokens == 0 || tokens_global <= 0) return at::Tensor();
      return loss / tokens_global;
    };
    chunked_backward(runner, B, T, ChunkedBackwardOptions{chunk, o.recompute, o.kda_keep_chunk_states}, cb);
  }
  for (auto& h : result.histograms)
    if (h.defined()) h = h.to(at::kCPU);
  return result;
}

}  // namespace odyssey::learner
