#include "learner/chunked_policy.h"

#include <algorithm>
#include <array>

#include <ATen/ATen.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/types.h>

#include "model/attention.h"
#include "model/attn_res.h"

namespace odyssey::learner {

namespace {

// The four tensors of a KdaState, in a fixed order.
std::array<at::Tensor*, 4> parts(model::KdaState& s) {
  return {&s.recurrent, &s.q_conv_inputs, &s.k_conv_inputs, &s.v_conv_inputs};
}

int64_t num_chunks(int64_t length, int64_t chunk) { return (length + chunk - 1) / chunk; }

}  // namespace

CarriedState ChunkedPolicy::initial_state(int64_t batch) {
  CarriedState s;
  model::PolicyImpl& p = *policy_;
  const int64_t layers = p.config().num_layers;
  s.kda.resize(static_cast<size_t>(layers));
  s.mla.resize(static_cast<size_t>(layers));
  for (int64_t i = 0; i < layers; ++i) {
    auto& layer = p.layer(i);
    if (layer->attention_kind() == model::AttentionKind::kKda) s.kda[static_cast<size_t>(i)] = layer->kda->initial_state(batch);
  }
  return s;
}

// GatedMlaImpl::forward_chunk (model/mla.cpp) step for step, except that the history keeps its
// graph instead of being detached.
at::Tensor ChunkedPolicy::mla_chunk(model::GatedMlaImpl& m, const at::Tensor& x, at::Tensor& history) {
  const model::GatedMlaOptions& o = m.options();
  const int64_t B = x.size(0), T = x.size(1);
  const at::Tensor c_q = m.q_norm->forward(m.q_down_proj->forward(x));
  const at::Tensor q = m.q_up_proj->forward(c_q).view({B, T, o.heads, o.head_dim + o.shared_dim});
  const at::Tensor down = m.kv_down_proj->forward(x);
  const at::Tensor latent =
      at::cat({m.kv_norm->forward(down.narrow(-1, 0, o.kv_latent)), down.narrow(-1, o.kv_latent, o.shared_dim)}, -1);
  const int64_t past = history.defined() ? history.size(1) : 0;
  const at::Tensor all = past == 0 ? latent : at::cat({history, latent}, 1);
  history = all;
  const int64_t L = all.size(1);
  const at::Tensor c_kv = all.narrow(-1, 0, o.kv_latent);
  const at::Tensor k_shared =
      all.narrow(-1, o.kv_latent, o.shared_dim).unsqueeze(2).expand({B, L, o.heads, o.shared_dim});
  const at::Tensor k_nope = m.k_up_proj->forward(c_kv).view({B, L, o.heads, o.head_dim});
  const at::Tensor k = at::cat({k_nope, k_shared}, -1).transpose(1, 2).contiguous();
  const at::Tensor v = m.v_up_proj->forward(c_kv).view({B, L, o.heads, o.v_dim}).transpose(1, 2).contiguous();
  const at::Tensor attended =
      model::blockwise_attention(q.transpose(1, 2).contiguous(), k, v, m.attention_scale(), /*causal_offset=*/past,
                                 o.attention_block, /*keep_compute_dtype=*/true);
  const at::Tensor flat = attended.transpose(1, 2).reshape({B, T, -1});
  const at::Tensor gate = at::sigmoid(m.g_proj->forward(x).to(flat.scalar_type()));
  return m.o_proj->forward((gate * flat).to(x.scalar_type()));
}

// PolicyImpl::run (model/policy.cpp) in its chunk form, with mla_chunk for MLA layers and every
// MoE layer's scores collected.
ChunkOutput ChunkedPolicy::forward_chunk(const at::Tensor& tokens, CarriedState& state) {
  TORCH_CHECK(tokens.dim() == 2 && tokens.size(1) >= 1, "ChunkedPolicy: tokens must be [B, t], t >= 1, got ",
              tokens.sizes());
  model::PolicyImpl& p = *policy_;
  const model::ModelConfig& config = p.config();
  TORCH_CHECK(state.kda.size() == static_cast<size_t>(config.num_layers),
              "ChunkedPolicy: the state was not made by initial_state");
  ChunkOutput out;
  model::AttnResStream stream(p.embed_tokens(tokens), config.attn_res_block_size, config.rms_norm_eps);
  for (int64_t i = 0; i < config.num_layers; ++i) {
    model::PolicyLayerImpl& layer = *p.layer(i);
    stream.begin_layer(i);
    const at::Tensor a_in = layer.attn_norm->forward(stream.mix(layer.attn_mix));
    const at::Tensor a = layer.attention_kind() == model::AttentionKind::kKda
                             ? layer.kda->forward_chunk(a_in, state.kda[static_cast<size_t>(i)])
                             : mla_chunk(*layer.mla, a_in, state.mla[static_cast<size_t>(i)]);
    stream.add(a);
    const at::Tensor f_in = layer.ffn_norm->forward(stream.mix(layer.ffn_mix));
    if (layer.ffn_kind() == model::FfnKind::kDense) {
      stream.add(layer.ffn->forward(f_in));
    } else {
      model::MoeOutput moe = layer.moe->forward(f_in);
      out.routing.push_back(moe.routing.scores.detach());
      stream.add(moe.y);
    }
  }
  out.logits = p.lm_head->forward(p.norm->forward(stream.mix(p.out_mix)));
  state.tokens += tokens.size(1);
  return out;
}

void chunked_forward(ChunkedPolicy& runner, int64_t batch, int64_t length, int64_t chunk_tokens,
                     const std::function<at::Tensor(int64_t, int64_t)>& tokens,
                     const std::function<void(const ChunkView&)>& observe) {
  const at::NoGradGuard no_grad;
  const int64_t chunk = std::max<int64_t>(1, chunk_tokens);
  CarriedState state = runner.initial_state(batch);
  for (int64_t c = 0; c < num_chunks(length, chunk); ++c) {
    const int64_t start = c * chunk, len = std::min(chunk, length - start);
    const ChunkOutput out = runner.forward_chunk(tokens(start, len), state);
    if (observe) observe(ChunkView{c, start, len, &out});
  }
}

void chunked_backward(ChunkedPolicy& runner, int64_t batch, int64_t length, const ChunkedBackwardOptions& options,
                      const ChunkCallbacks& cb) {
  TORCH_CHECK(cb.tokens && cb.loss, "chunked_backward: tokens and loss callbacks are required");
  if (length <= 0) return;
  const int64_t chunk = std::max<int64_t>(1, options.chunk_tokens);
  const int64_t chunks = num_chunks(length, chunk);

  if (!options.recompute || chunks == 1) {
    // One graph over the whole sequence (a single chunk needs nothing else either). The KDA chunk
    // states are kept for one chunk only: over the whole sequence they would stay until its end.
    const model::kda::KeepChunkStatesGuard keep(options.keep_kda_chunk_states && options.recompute && chunks == 1);
    CarriedState state = runner.initial_state(batch);
    at::Tensor total;
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t start = c * chunk, len = std::min(chunk, length - start);
      const ChunkOutput out = runner.forward_chunk(cb.tokens(start, len), state);
      const ChunkView view{c, start, len, &out};
      if (cb.observe) cb.observe(view);
      const at::Tensor l = cb.loss(view);
      if (l.defined()) total = total.defined() ? total + l : l;
    }
    if (total.defined() && total.requires_grad()) total.backward();
    return;
  }

  // Pass 1: no graph; keep each chunk's incoming KDA states and, at the end, the MLA histories.
  // The last chunk is not run here: pass 2 starts with it and runs its forward once, with graph
  // (2C - 1 chunk forwards a step, not 2C).
  std::vector<std::vector<model::KdaState>> incoming(static_cast<size_t>(chunks));
  CarriedState state = runner.initial_state(batch);
  {
    const at::NoGradGuard no_grad;
    for (int64_t c = 0; c + 1 < chunks; ++c) {
      const int64_t start = c * chunk, len = std::min(chunk, length - start);
      incoming[static_cast<size_t>(c)] = state.kda;  // forward_chunk replaces (never edits) these tensors
      const ChunkOutput out = runner.forward_chunk(cb.tokens(start, len), state);
      if (cb.observe) cb.observe(ChunkView{c, start, len, &out});
    }
  }
  incoming[static_cast<size_t>(chunks - 1)] = state.kda;
  const std::vector<at::Tensor> history = state.mla;  // [B, start of the last chunk, W] per MLA layer
  const size_t layers = history.size();

  // Pass 2: chunks in reverse; G = gradient with respect to the state leaving the chunk.
  std::vector<std::array<at::Tensor, 4>> g_kda(layers);
  std::vector<at::Tensor> g_mla(layers);
  for (int64_t c = chunks - 1; c >= 0; --c) {
    const int64_t start = c * chunk, len = std::min(chunk, length - start);
    CarriedState in = runner.initial_state(batch);
    std::vector<std::array<at::Tensor, 4>> kda_leaves(layers);
    std::vector<at::Tensor> mla_leaves(layers);
    if (c > 0) {
      for (size_t i = 0; i < layers; ++i) {
        if (in.kda[i].recurrent.defined()) {
          in.kda[i] = incoming[static_cast<size_t>(c)][i];
          auto p = parts(in.kda[i]);
          for (size_t j = 0; j < 4; ++j) {
            *p[j] = p[j]->detach().requires_grad_(true);
            kda_leaves[i][j] = *p[j];
          }
        } else if (history[i].defined()) {
          in.mla[i] = history[i].narrow(1, 0, start).detach().requires_grad_(true);
          mla_leaves[i] = in.mla[i];
        }
      }
    }
    incoming[static_cast<size_t>(c)].clear();  // no longer needed
    // This chunk's backward follows at once: its KDA kernels may keep their chunk states for it.
    const model::kda::KeepChunkStatesGuard keep(options.keep_kda_chunk_states);
    const ChunkOutput out = runner.forward_chunk(cb.tokens(start, len), in);
    if (c == chunks - 1 && cb.observe) cb.observe(ChunkView{c, start, len, &out});  // its only forward
    const at::Tensor l = cb.loss(ChunkView{c, start, len, &out});

    std::vector<at::Tensor> roots, grads;
    if (l.defined() && l.requires_grad()) {
      roots.push_back(l);
      grads.push_back(at::ones_like(l));
    }
    for (size_t i = 0; i < layers; ++i) {
      if (in.kda[i].recurrent.defined()) {
        auto p = parts(in.kda[i]);
        for (size_t j = 0; j < 4; ++j) {
          if (g_kda[i][j].defined() && p[j]->requires_grad()) {
            roots.push_back(*p[j]);
            grads.push_back(g_kda[i][j]);
          }
        }
      } else if (g_mla[i].defined() && in.mla[i].defined() && in.mla[i].requires_grad()) {
        roots.push_back(in.mla[i]);
        grads.push_back(g_mla[i]);
      }
    }
    if (!roots.empty()) torch::autograd::backward(roots, grads);
    // The gradient with respect to this chunk's incoming state goes to the chunk before it.
    for (size_t i = 0; i < layers; ++i) {
      for (size_t j = 0; j < 4; ++j) g_kda[i][j] = kda_leaves[i][j].defined() ? kda_leaves[i][j].grad() : at::Tensor();
      g_mla[i] = mla_leaves[i].defined() ? mla_leaves[i].grad() : at::Tensor();
    }
  }
}

}  // namespace odyssey::learner
