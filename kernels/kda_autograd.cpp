#include "kernels/kda_autograd.h"

#include <torch/autograd.h>

#include "kernels/kda.h"

namespace odyssey::kernels {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// A custom Function's inputs must all be defined tensors (LibTorch records each input's device),
// so "no initial state" travels as an empty tensor and becomes undefined again inside.
at::Tensor state_or_undefined(const at::Tensor& state) { return state.numel() == 0 ? at::Tensor() : state; }

class KdaChunkedFunction : public torch::autograd::Function<KdaChunkedFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                               const at::Tensor& initial_state_or_empty, double scale,
                               bool keep_chunk_states) {
    const at::Tensor initial_state = state_or_undefined(initial_state_or_empty);
    // The states the backward reads: every fourth chunk's where pass 3 goes by blocks with V' (each
    // 64-token block reads the state entering it; 32-token blocks make every second block's entering
    // state from the one before).
    const int interval = kda_backward_state_interval(
        q.scalar_type() == at::kBFloat16 ? KdaDtype::kBFloat16 : KdaDtype::kFloat32, q.size(3), v.size(3));
    // With them, V' where pass 3 by blocks reads it (KdaBackwardOptions::keep_values): B T H V 2
    // bytes more, a quarter of the states' at K = 128; the backward then equals the recompute's bit
    // for bit.
    const bool values = keep_chunk_states && interval >= 2;
    KdaChunkedOutput out = kda_chunked(q, k, v, g, beta, initial_state, scale, at::Tensor(),
                                       /*segment_length=*/0, /*prefetch=*/true, /*head_walk=*/true,
                                       /*lead_length=*/0, keep_chunk_states, interval, values);
    ctx->save_for_backward({q, k, v, g, beta, initial_state_or_empty});
    ctx->saved_data["scale"] = scale;
    // Not an input or an output: held by the context until the backward (or the graph) is freed.
    if (keep_chunk_states) ctx->saved_data["chunk_states"] = out.chunk_states;
    if (values) ctx->saved_data["new_values"] = out.new_values;
    return {out.o, out.final_state};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const at::Tensor &q = saved[0], &k = saved[1], &v = saved[2], &g = saved[3],
                     &beta = saved[4];
    const at::Tensor initial_state = state_or_undefined(saved[5]);
    const double scale = ctx->saved_data["scale"].toDouble();
    const auto kept = ctx->saved_data.find("chunk_states");
    const at::Tensor chunk_states = kept != ctx->saved_data.end() ? kept->second.toTensor() : at::Tensor();
    const auto kept_values = ctx->saved_data.find("new_values");
    const at::Tensor new_values =
        kept_values != ctx->saved_data.end() ? kept_values->second.toTensor() : at::Tensor();
    // An output that did not reach the loss has an undefined gradient.
    const at::Tensor d_o = grads[0].defined() ? grads[0] : at::zeros_like(v, q.scalar_type());
    const KdaChunkedGradients d =
        kda_chunked_backward(q, k, v, g, beta, initial_state, d_o, grads[1], scale, chunk_states,
                             /*pass3_blocks=*/true, /*keep_values=*/true, new_values);
    return {d.dq, d.dk, d.dv, d.dg, d.dbeta,
            initial_state.defined() ? d.d_initial_state : at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The decay gate: saves z and the two parameters (not the LibTorch chain's two fp32
// intermediates of z's size); the backward recomputes u and the sigmoid per element.
class KdaGateFunction : public torch::autograd::Function<KdaGateFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& z, const at::Tensor& a_log,
                            const at::Tensor& dt_bias, double g_min) {
    ctx->save_for_backward({z, a_log, dt_bias});
    ctx->saved_data["g_min"] = g_min;
    return kda_gate(z, a_log, dt_bias, g_min);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const KdaGateGradients d =
        kda_gate_backward(saved[0], saved[1], saved[2], ctx->saved_data["g_min"].toDouble(), grads[0],
                          ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2));
    return {d.dz, d.d_a_log, d.d_dt_bias, at::Tensor()};
  }
};

// The short convolution with SiLU and the per-head norm: saves x, conv_inputs and the weight (the
// LibTorch chain keeps the window, each product and sum, SiLU's input and the norm's factors); the
// backward recomputes them per element.
class KdaShortConvFunction : public torch::autograd::Function<KdaShortConvFunction> {
 public:
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& conv_inputs,
                            const at::Tensor& weight, int64_t head, double eps) {
    ctx->save_for_backward({x, conv_inputs, weight});
    ctx->saved_data["head"] = head;
    ctx->saved_data["eps"] = eps;
    return kda_short_conv(x, conv_inputs, weight, head, eps);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list saved = ctx->get_saved_variables();
    const KdaShortConvGradients d = kda_short_conv_backward(
        saved[0], saved[1], saved[2], ctx->saved_data["head"].toInt(), ctx->saved_data["eps"].toDouble(), grads[0],
        ctx->needs_input_grad(0), ctx->needs_input_grad(1), ctx->needs_input_grad(2));
    return {d.dx, d.d_conv_inputs, d.d_weight, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

KdaChunkedOutput kda_chunked_autograd(const at::Tensor& q, const at::Tensor& k,
                                      const at::Tensor& v, const at::Tensor& g,
                                      const at::Tensor& beta, const at::Tensor& initial_state,
                                      double scale, bool keep_chunk_states) {
  const at::Tensor state =
      initial_state.defined() ? initial_state : at::empty({0}, q.options().dtype(at::kFloat));
  const variable_list out = KdaChunkedFunction::apply(q, k, v, g, beta, state, scale, keep_chunk_states);
  return {out[0], out[1], /*chunk_states=*/at::Tensor(), /*new_values=*/at::Tensor()};
}

at::Tensor kda_gate_autograd(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias,
                             double g_min) {
  TORCH_CHECK(kda_gate_supported(z, a_log, dt_bias), "kda_gate_autograd: needs CUDA bf16 / fp32 z [..., heads, width ",
              "(a multiple of 4)], fp32 A_log [heads] and fp32 dt_bias [heads * width] on z's device, got z ",
              z.sizes(), " ", z.scalar_type(), ", A_log ", a_log.sizes(), " ", a_log.scalar_type(), ", dt_bias ",
              dt_bias.sizes(), " ", dt_bias.scalar_type());
  return KdaGateFunction::apply(z, a_log, dt_bias, g_min);
}

at::Tensor kda_short_conv_autograd(const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight,
                                   int64_t head, double eps) {
  TORCH_CHECK(kda_short_conv_supported(x, conv_inputs, weight, head),
              "kda_short_conv_autograd: needs fp32 CUDA x [B, T, D] (D a multiple of 128), conv_inputs [B, W - 1, D], "
              "weight [D, 1, W] (W <= 4) and head 0 or a power-of-two multiple of 4 up to 128, got x ",
              x.sizes(), ", conv_inputs ", conv_inputs.sizes(), ", weight ", weight.sizes(), ", head ", head);
  return KdaShortConvFunction::apply(x, conv_inputs, weight, head, eps);
}

}  // namespace odyssey::kernels
