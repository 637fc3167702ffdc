#include "kernels/torch_bindings.h"

#include <initializer_list>
#include <utility>
#include <vector>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/attn_res.h"
#include "kernels/kda.h"
#include "kernels/kda_conv.h"
#include "kernels/kda_gate.h"
#include "kernels/moe.h"
#include "kernels/rms_norm.h"

namespace odyssey::kernels {

void check_launch(cudaError_t error, const char* where) {
  TORCH_CHECK(error == cudaSuccess, where, ": CUDA error ", cudaGetErrorName(error), " (",
              cudaGetErrorString(error), ")");
}

namespace {

bool is_kernel_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kFloat; }

KdaDtype kernel_dtype(at::ScalarType t) {
  return t == at::kBFloat16 ? KdaDtype::kBFloat16 : KdaDtype::kFloat32;
}

void check_cuda(const char* where, const char* name, const at::Tensor& t,
                const at::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, where, ": ", name,
              " must be a CUDA tensor on ", device, ", got ", t.device());
}

// ---- KDA: what the launchers of kernels/kda.h accept.

// Key and value widths of the chunked kernels; the decode step takes any V below.
bool kda_width_supported(int64_t n) { return n == 32 || n == 64 || n == 128; }
bool kda_step_value_supported(int64_t value) {
  return value % 32 == 0 && value >= 32 && value <= 256;
}

bool kda_dtypes_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  return is_kernel_dtype(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
         v.scalar_type() == q.scalar_type();
}

bool kda_on_device(const at::Device& device, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    if (!t->is_cuda() || t->device() != device) return false;
  }
  return true;
}

// The checks every KDA binding makes of its inputs: each named tensor a CUDA tensor on `device`,
// and q, k, v in one dtype of bf16 / fp32.
using NamedTensors = std::vector<std::pair<const char*, const at::Tensor*>>;
void check_kda_inputs(const char* where, const at::Device& device, const NamedTensors& tensors,
                      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto& [name, t] : tensors) check_cuda(where, name, *t, device);
  TORCH_CHECK(is_kernel_dtype(q.scalar_type()), where, ": q must be bf16 or fp32, got ",
              q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), where,
              ": q, k, v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
}

// An optional state argument (initial_state, d_final_state): undefined, or of `shape` (spelled
// `layout` in the message) on `device`; returned as contiguous fp32.
at::Tensor kda_state_argument(const char* where, const char* name, const at::Tensor& t,
                              const char* layout, const std::vector<int64_t>& shape,
                              const at::Device& device) {
  if (!t.defined()) return t;
  TORCH_CHECK(t.sizes() == at::IntArrayRef(shape), where, ": ", name, " must be ", layout, " = ",
              at::IntArrayRef(shape), ", got ", t.sizes());
  check_cuda(where, name, t, device);
  return t.to(at::kFloat).contiguous();
}

// The token inputs as the launchers read them: contiguous, g in fp32, beta in q's dtype.
struct KdaLaunchInputs {
  at::Tensor q, k, v, g, beta;
};
// Contiguous and 16-byte aligned (kda.h; a view that starts mid-row may not be): copied if not.
at::Tensor aligned_contiguous(const at::Tensor& t) {
  at::Tensor c = t.contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

KdaLaunchInputs kda_launch_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& g, const at::Tensor& beta) {
  return {aligned_contiguous(q), aligned_contiguous(k), aligned_contiguous(v),
          aligned_contiguous(g.to(at::kFloat)), aligned_contiguous(beta.to(q.scalar_type()))};
}

struct KdaSequenceSizes {
  int64_t batch, length, heads, key, value;
};

// kda_chunked and its backward: q, k, g [B, T, H, K], v [B, T, H, V], beta [B, T, H] and, when
// defined, d_o shaped like v; the checks of check_kda_inputs; K and V widths of the kernels.
KdaSequenceSizes check_kda_sequence(const char* where, const at::Tensor& q, const at::Tensor& k,
                                    const at::Tensor& v, const at::Tensor& g,
                                    const at::Tensor& beta, const at::Tensor& d_o) {
  TORCH_CHECK(q.dim() == 4, where, ": q must be [B, T, H, K], got ", q.sizes());
  NamedTensors tensors = {{"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}};
  if (d_o.defined()) tensors.emplace_back("d_o", &d_o);
  check_kda_inputs(where, q.device(), tensors, q, k, v);
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes(), where,
              ": k and g must match q ", q.sizes(), ", got ", k.sizes(), " and ", g.sizes());
  const int64_t batch = q.size(0), length = q.size(1), heads = q.size(2), key = q.size(3);
  TORCH_CHECK(v.dim() == 4 && v.size(0) == batch && v.size(1) == length && v.size(2) == heads,
              where, ": v must be [B, T, H, V] with B, T, H of q ", q.sizes(), ", got ",
              v.sizes());
  const int64_t value = v.size(3);
  TORCH_CHECK(!d_o.defined() || d_o.sizes() == v.sizes(), where,
              ": d_o must match o = v's shape ", v.sizes(), ", got ", d_o.sizes());
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == batch && beta.size(1) == length &&
                  beta.size(2) == heads,
              where, ": beta must be [B, T, H] of q ", q.sizes(), ", got ", beta.sizes());
  TORCH_CHECK(kda_width_supported(key) && kda_width_supported(value), where,
              ": K and V must be 32, 64 or 128, got K = ", key, ", V = ", value,
              " (use kda::chunked_reference)");
  return {batch, length, heads, key, value};
}

}  // namespace

bool kda_chunked_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& g, const at::Tensor& beta,
                           const at::Tensor& initial_state, int64_t chunk) {
  if (chunk != 16 || !q.defined() || !q.is_cuda() || q.dim() != 4 || v.dim() != 4) return false;
  if (!kda_dtypes_supported(q, k, v)) return false;
  if (!kda_width_supported(q.size(3)) || !kda_width_supported(v.size(3))) return false;
  if (!kda_on_device(q.device(), {&k, &v, &g, &beta})) return false;
  if (initial_state.defined() &&
      (!initial_state.is_cuda() || initial_state.device() != q.device() ||
       !at::isFloatingType(initial_state.scalar_type()))) {
    return false;
  }
  return q.size(0) <= 65535 && q.size(2) <= 65535;
}

KdaChunkedOutput kda_chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             const at::Tensor& g, const at::Tensor& beta,
                             const at::Tensor& initial_state, double scale,
                             const at::Tensor& cu_seqlens, int64_t segment_length,
                             bool prefetch, bool head_walk, int64_t lead_length,
                             bool keep_chunk_states, int64_t chunk_state_interval, bool keep_new_values) {
  constexpr const char* where = "kernels::kda_chunked";
  const auto [batch, length, heads, key, value] =
      check_kda_sequence(where, q, k, v, g, beta, /*d_o=*/at::Tensor());
  const at::Device device = q.device();

  int64_t sequences = batch;
  at::Tensor offsets;
  if (cu_seqlens.defined()) {
    TORCH_CHECK(batch == 1, where, ": with cu_seqlens the inputs must be packed as [1, total, H, *], got B = ",
                batch);
    TORCH_CHECK(cu_seqlens.dim() == 1 && cu_seqlens.size(0) >= 2, where,
                ": cu_seqlens must be [N + 1] with N >= 1, got ", cu_seqlens.sizes());
    TORCH_CHECK(cu_seqlens.scalar_type() == at::kInt || cu_seqlens.scalar_type() == at::kLong,
                where, ": cu_seqlens must be int32 or int64, got ", cu_seqlens.scalar_type());
    const at::Tensor host = cu_seqlens.to(at::kCPU, at::kLong);
    const int64_t* p = host.data_ptr<int64_t>();
    sequences = cu_seqlens.size(0) - 1;
    TORCH_CHECK(p[0] == 0 && p[sequences] == length, where,
                ": cu_seqlens must start at 0 and end at T = ", length, ", got ", p[0], " .. ",
                p[sequences]);
    for (int64_t n = 0; n < sequences; ++n) {
      TORCH_CHECK(p[n] <= p[n + 1], where, ": cu_seqlens must be ascending (entry ", n, ")");
    }
    TORCH_CHECK(length < (int64_t{1} << 31), where, ": packed length ", length,
                " exceeds int32 offsets");
    offsets = cu_seqlens.to(device, at::kInt).contiguous();
  }
  const std::vector<int64_t> state_shape = {sequences, heads, key, value};
  const at::Tensor state_in = kda_state_argument(where, "initial_state", initial_state,
                                                 "[N, H, K, V]", state_shape, device);

  const c10::cuda::CUDAGuard guard(device);
  const KdaLaunchInputs c = kda_launch_inputs(q, k, v, g, beta);
  at::Tensor o = at::empty({batch, length, heads, value}, q.options());
  at::Tensor final_state = at::empty(state_shape, q.options().dtype(at::kFloat));
  TORCH_CHECK(segment_length <= 0 || segment_length % 16 == 0, where,
              ": segment_length must be a multiple of 16 (the chunk), got ", segment_length);
  TORCH_CHECK(lead_length <= 0 || lead_length % 16 == 0, where,
              ": lead_length must be a multiple of 16 (the chunk), got ", lead_length);
  KdaChunkedOptions options;
  options.segment_length = segment_length;
  options.lead_length = lead_length;
  options.prefetch = prefetch;
  options.head_walk = head_walk;
  at::Tensor chunk_states;
  if (keep_chunk_states) {
    TORCH_CHECK(!offsets.defined(), where, ": keep_chunk_states is not supported with cu_seqlens");
    TORCH_CHECK(chunk_state_interval == 1 || chunk_state_interval == 2 || chunk_state_interval == 4, where,
                ": chunk_state_interval must be 1, 2 or 4, got ", chunk_state_interval);
    const int64_t kept = ((length + 15) / 16 + chunk_state_interval - 1) / chunk_state_interval;
    chunk_states = at::empty({sequences, heads, kept, value, key}, q.options().dtype(at::kBFloat16));
    options.chunk_states = chunk_states.data_ptr();
    options.chunk_state_interval = static_cast<int>(chunk_state_interval);
  }
  at::Tensor new_values;
  if (keep_new_values) {
    TORCH_CHECK(keep_chunk_states, where, ": keep_new_values needs keep_chunk_states (V' is kept with the states)");
    new_values = at::empty({batch, length, heads, value}, q.options().dtype(at::kBFloat16));
    options.new_values = new_values.data_ptr();
  }
  // The context-parallel path's scratch (none for the serial walk), from the caching allocator.
  const size_t workspace_bytes = kda_chunked_forward_workspace_bytes(
      kernel_dtype(q.scalar_type()), offsets.defined(), sequences, length, heads, key, value, options);
  at::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, q.options().dtype(at::kByte));
    options.workspace = workspace.data_ptr();
    options.workspace_bytes = workspace_bytes;
  }
  check_launch(
      kda_chunked_forward(kernel_dtype(q.scalar_type()), c.q.data_ptr(), c.k.data_ptr(),
                          c.v.data_ptr(), c.g.data_ptr<float>(), c.beta.data_ptr(),
                          state_in.defined() ? state_in.data_ptr<float>() : nullptr,
                          o.data_ptr(), final_state.data_ptr<float>(),
                          offsets.defined() ? offsets.data_ptr<int32_t>() : nullptr, sequences,
                          length, heads, key, value, static_cast<float>(scale), options,
                          at::cuda::getCurrentCUDAStream(device.index()).stream()),
      where);
  return {o, final_state, chunk_states, new_values};
}

KdaChunkedGradients kda_chunked_backward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& g,
                                         const at::Tensor& beta, const at::Tensor& initial_state,
                                         const at::Tensor& d_o, const at::Tensor& d_final_state,
                                         double scale, const at::Tensor& chunk_states,
                                         bool pass3_blocks, bool keep_values, const at::Tensor& new_values,
                                         int64_t pass3_block_tokens, bool pass3_block_producer) {
  constexpr const char* where = "kernels::kda_chunked_backward";
  TORCH_CHECK(d_o.defined(), where, ": d_o must be defined (the gradient of o)");
  const auto [batch, length, heads, key, value] = check_kda_sequence(where, q, k, v, g, beta, d_o);
  const at::Device device = q.device();
  const std::vector<int64_t> state_shape = {batch, heads, key, value};
  const at::Tensor state_in = kda_state_argument(where, "initial_state", initial_state,
                                                 "[B, H, K, V]", state_shape, device);
  const at::Tensor d_state_out = kda_state_argument(where, "d_final_state", d_final_state,
                                                    "[B, H, K, V]", state_shape, device);
  kernels::KdaBackwardOptions options;
  options.pass3_blocks = pass3_blocks;
  options.keep_values = keep_values;
  TORCH_CHECK(pass3_block_tokens == 0 || pass3_block_tokens == 32 || pass3_block_tokens == 64, where,
              ": pass3_block_tokens must be 0 (64 where V' and dVb are at hand, else 32), 32 or 64"
              " (KdaBackwardOptions::pass3_block_tokens), got ",
              pass3_block_tokens);
  options.pass3_block_tokens = static_cast<int>(pass3_block_tokens);
  options.pass3_block_producer = pass3_block_producer;
  TORCH_CHECK(pass3_block_tokens != 64 ||
                  kernels::kda_backward_state_interval(kernel_dtype(q.scalar_type()), key, value, options) < 2 ||
                  (chunk_states.defined() ? new_values.defined() : keep_values),
              where, ": pass3_block_tokens = 64 reads V' and dVb: keep_values, or new_values with chunk_states");
  if (new_values.defined()) {
    TORCH_CHECK(chunk_states.defined(), where,
                ": new_values is kept with chunk_states (kda_chunked's keep_new_values); give both or neither");
    const std::vector<int64_t> shape = {batch, length, heads, value};
    TORCH_CHECK(new_values.sizes() == at::IntArrayRef(shape) && new_values.scalar_type() == at::kBFloat16, where,
                ": new_values must be bf16 [B, T, H, V] = ", at::IntArrayRef(shape),
                " (kda_chunked's, kept on these inputs), got ", new_values.scalar_type(), " ", new_values.sizes());
    check_cuda(where, "new_values", new_values, device);
    TORCH_CHECK(new_values.is_contiguous() && reinterpret_cast<uintptr_t>(new_values.data_ptr()) % 16 == 0, where,
                ": new_values must be contiguous and 16-byte aligned (as kda_chunked returns it)");
    options.new_values = new_values.data_ptr();
  }
  if (chunk_states.defined()) {
    const int64_t chunks = (length + 15) / 16;
    const std::vector<int64_t> kept_shape = {batch, heads, chunks, value, key};
    const std::vector<int64_t> every_second = {batch, heads, (chunks + 1) / 2, value, key};
    const std::vector<int64_t> every_fourth = {batch, heads, (chunks + 3) / 4, value, key};
    // Pass 3 by blocks (bf16, K = V = 128) also reads every second chunk's states, and every fourth
    // one's with V' (new_values). Up to two chunks the three shapes hold the same one state.
    const bool blocks = kernels::kda_backward_state_interval(kernel_dtype(q.scalar_type()), key, value, options) >= 2;
    const bool fourth = blocks && new_values.defined() && chunks > 2 &&
                        chunk_states.sizes() == at::IntArrayRef(every_fourth);
    const bool second = blocks && chunks > 1 && chunk_states.sizes() == at::IntArrayRef(every_second);
    TORCH_CHECK(fourth || second || chunk_states.sizes() == at::IntArrayRef(kept_shape), where,
                ": chunk_states must be [B, H, ceil(T / 16), V, K] = ", at::IntArrayRef(kept_shape),
                blocks ? " (or every second chunk's, [B, H, ceil(ceil(T / 16) / 2), V, K], or with new_values "
                         "every fourth chunk's, [B, H, ceil(ceil(T / 16) / 4), V, K])"
                       : "",
                " (kda_chunked's, kept on these inputs), got ", chunk_states.sizes());
    if (fourth) {
      options.chunk_states_interval = 4;
    } else if (second) {
      options.chunk_states_interval = 2;
    }
    TORCH_CHECK(chunk_states.scalar_type() == at::kBFloat16, where,
                ": chunk_states must be bf16 (kda_chunked's), got ", chunk_states.scalar_type());
    check_cuda(where, "chunk_states", chunk_states, device);
    TORCH_CHECK(chunk_states.is_contiguous() && reinterpret_cast<uintptr_t>(chunk_states.data_ptr()) % 16 == 0,
                where, ": chunk_states must be contiguous and 16-byte aligned (as kda_chunked returns it)");
  }

  const c10::cuda::CUDAGuard guard(device);
  const KdaLaunchInputs c = kda_launch_inputs(q, k, v, g, beta);
  const at::Tensor doc = aligned_contiguous(d_o.to(q.scalar_type()));
  // dq, dk, dv come out in q's dtype (the kernel rounds each once, as a cast would); dg, dbeta
  // and d_initial_state in fp32.
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = at::empty(q.sizes(), q.options()), dk = at::empty(q.sizes(), q.options());
  at::Tensor dg = at::empty(q.sizes(), f32), dv = at::empty(v.sizes(), q.options());
  at::Tensor dbeta = at::empty(beta.sizes(), f32);
  at::Tensor d_initial = at::empty(state_shape, f32);
  const size_t workspace_bytes = kernels::kda_chunked_backward_workspace_bytes(
      kernel_dtype(q.scalar_type()), batch, length, heads, key, value,
      /*states_given=*/chunk_states.defined(), options);
  at::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, q.options().dtype(at::kByte));
  }
  check_launch(
      kernels::kda_chunked_backward(
          kernel_dtype(q.scalar_type()), c.q.data_ptr(), c.k.data_ptr(), c.v.data_ptr(),
          c.g.data_ptr<float>(), c.beta.data_ptr(),
          state_in.defined() ? state_in.data_ptr<float>() : nullptr, doc.data_ptr(),
          d_state_out.defined() ? d_state_out.data_ptr<float>() : nullptr, dq.data_ptr(),
          dk.data_ptr(), dv.data_ptr(), dg.data_ptr<float>(),
          dbeta.data_ptr<float>(), d_initial.data_ptr<float>(), batch, length, heads, key, value,
          static_cast<float>(scale), chunk_states.defined() ? chunk_states.data_ptr() : nullptr,
          workspace.defined() ? workspace.data_ptr() : nullptr, workspace_bytes,
          at::cuda::getCurrentCUDAStream(device.index()).stream(), options),
      where);
  KdaChunkedGradients out;
  out.dq = dq;
  out.dk = dk;
  out.dv = dv;
  out.dg = dg.to(g.scalar_type());
  out.dbeta = dbeta.to(beta.scalar_type());
  out.d_initial_state =
      initial_state.defined() ? d_initial.to(initial_state.scalar_type()) : d_initial;
  return out;
}

bool kda_step_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state) {
  if (!q.defined() || !q.is_cuda() || state.dim() != 4 || v.dim() != 3) return false;
  if (!kda_dtypes_supported(q, k, v)) return false;
  if (state.scalar_type() != at::kFloat || !state.is_contiguous()) return false;
  if (!kda_on_device(q.device(), {&k, &v, &g, &beta, &state})) return false;
  return kda_width_supported(state.size(2)) && kda_step_value_supported(state.size(3)) &&
         state.size(0) <= 65535 && state.size(1) <= 65535;
}

at::Tensor kda_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                    double scale) {
  constexpr const char* where = "kernels::kda_step";
  TORCH_CHECK(state.dim() == 4, where, ": state must be [B, H, K, V], got ", state.sizes());
  const at::Device device = state.device();
  check_kda_inputs(where, device,
                   {{"state", &state}, {"q", &q}, {"k", &k}, {"v", &v}, {"g", &g}, {"beta", &beta}},
                   q, k, v);
  TORCH_CHECK(state.scalar_type() == at::kFloat && state.is_contiguous(), where,
              ": state must be contiguous fp32 (it is updated in place), got ",
              state.scalar_type(), state.is_contiguous() ? "" : " (non-contiguous)");
  const int64_t batch = state.size(0), heads = state.size(1), key = state.size(2),
                value = state.size(3);
  const std::vector<int64_t> key_shape = {batch, heads, key};
  TORCH_CHECK(q.sizes() == at::IntArrayRef(key_shape) && k.sizes() == q.sizes() &&
                  g.sizes() == q.sizes(),
              where, ": q, k, g must be [B, H, K] = ", at::IntArrayRef(key_shape), ", got ",
              q.sizes(), ", ", k.sizes(), ", ", g.sizes());
  TORCH_CHECK(v.dim() == 3 && v.size(0) == batch && v.size(1) == heads && v.size(2) == value,
              where, ": v must be [B, H, V] of state ", state.sizes(), ", got ", v.sizes());
  TORCH_CHECK(beta.dim() == 2 && beta.size(0) == batch && beta.size(1) == heads, where,
              ": beta must be [B, H], got ", beta.sizes());
  TORCH_CHECK(kda_width_supported(key) && kda_step_value_supported(value), where,
              ": K must be 32, 64 or 128 and V a multiple of 32 up to 256, got K = ", key,
              ", V = ", value, " (use kda::step_reference)");

  const c10::cuda::CUDAGuard guard(device);
  const KdaLaunchInputs c = kda_launch_inputs(q, k, v, g, beta);
  at::Tensor o = at::empty({batch, heads, value}, q.options());
  check_launch(kda_decode_step(kernel_dtype(q.scalar_type()), c.q.data_ptr(), c.k.data_ptr(),
                               c.v.data_ptr(), c.g.data_ptr<float>(), c.beta.data_ptr(),
                               state.data_ptr<float>(), o.data_ptr(), batch, heads, key, value,
                               static_cast<float>(scale),
                               at::cuda::getCurrentCUDAStream(device.index()).stream()),
               where);
  return o;
}


// ---- MoE ------------------------------------------------------------------------------------------

namespace {

MoeDtype moe_dtype(at::ScalarType t) {
  return t == at::kBFloat16 ? MoeDtype::kBFloat16 : MoeDtype::kFloat32;
}

cudaStream_t current_stream(const at::Tensor& t) {
  return at::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

}  // namespace

bool moe_router_topk_supported(const at::Tensor& scores, int64_t top_k) {
  return scores.defined() && scores.is_cuda() && scores.dim() == 2 &&
         scores.scalar_type() == at::kFloat && scores.size(1) >= 1 &&
         scores.size(1) <= kMoeTopkMaxExperts && top_k >= 1 && top_k <= kMoeTopkMaxK &&
         top_k <= scores.size(1);
}

MoeRouterTopk moe_router_topk(const at::Tensor& scores, const at::Tensor& bias, int64_t top_k) {
  constexpr const char* where = "kernels::moe_router_topk";
  TORCH_CHECK(scores.defined() && scores.dim() == 2, where, ": scores must be [tokens, experts], got ",
              scores.defined() ? scores.sizes() : at::IntArrayRef{});
  check_cuda(where, "scores", scores, scores.device());
  TORCH_CHECK(scores.scalar_type() == at::kFloat, where, ": scores must be fp32, got ",
              scores.scalar_type());
  const int64_t m = scores.size(0), n = scores.size(1);
  TORCH_CHECK(bias.defined() && bias.dim() == 1 && bias.size(0) == n, where, ": bias must be [", n,
              "], got ", bias.defined() ? bias.sizes() : at::IntArrayRef{});
  TORCH_CHECK(n >= 1 && n <= kMoeTopkMaxExperts, where, ": at most ", kMoeTopkMaxExperts,
              " experts, got ", n, " (use model::select_experts)");
  TORCH_CHECK(top_k >= 1 && top_k <= kMoeTopkMaxK && top_k <= n, where, ": top_k must be in [1, min(",
              kMoeTopkMaxK, ", experts = ", n, ")], got ", top_k);
  const c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor s = scores.detach().contiguous();
  const at::Tensor b = bias.detach().to(scores.device(), at::kFloat).contiguous();
  MoeRouterTopk out;
  out.ids = at::empty({m, top_k}, scores.options().dtype(at::kLong));
  out.weights = at::empty({m, top_k}, scores.options().dtype(at::kFloat));
  check_launch(moe_router_topk(s.data_ptr<float>(), b.data_ptr<float>(), out.ids.data_ptr<int64_t>(),
                               out.weights.data_ptr<float>(), m, n, top_k, current_stream(s)),
               where);
  return out;
}

// ---- The KDA decay gate -------------------------------------------------------------------------

bool kda_gate_supported(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias) {
  return z.defined() && a_log.defined() && dt_bias.defined() && z.is_cuda() && z.dim() >= 2 &&
         is_kernel_dtype(z.scalar_type()) && a_log.scalar_type() == at::kFloat &&
         dt_bias.scalar_type() == at::kFloat && a_log.device() == z.device() && dt_bias.device() == z.device() &&
         a_log.dim() == 1 && a_log.size(0) == z.size(-2) && dt_bias.numel() == z.size(-2) * z.size(-1) &&
         z.size(-1) >= 4 && z.size(-1) % 4 == 0;
}

namespace {

void check_kda_gate(const char* where, const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias) {
  TORCH_CHECK(z.defined() && z.dim() >= 2, where, ": z must be [..., heads, width], got ",
              z.defined() ? z.sizes() : at::IntArrayRef{});
  check_cuda(where, "z", z, z.device());
  TORCH_CHECK(is_kernel_dtype(z.scalar_type()), where, ": z must be bf16 or fp32, got ", z.scalar_type());
  const int64_t heads = z.size(-2), width = z.size(-1);
  TORCH_CHECK(width >= 4 && width % 4 == 0, where, ": z's width (its last dimension) must be a positive multiple of 4, got ",
              width, " (use model::kda::gate_reference)");
  TORCH_CHECK(a_log.defined() && a_log.dim() == 1 && a_log.size(0) == heads && a_log.scalar_type() == at::kFloat,
              where, ": A_log must be fp32 [", heads, "], got ", a_log.defined() ? a_log.sizes() : at::IntArrayRef{},
              " ", a_log.defined() ? a_log.scalar_type() : at::ScalarType::Undefined);
  TORCH_CHECK(dt_bias.defined() && dt_bias.numel() == heads * width && dt_bias.scalar_type() == at::kFloat, where,
              ": dt_bias must be fp32 with heads x width = ", heads * width, " elements, got ",
              dt_bias.defined() ? dt_bias.sizes() : at::IntArrayRef{}, " ",
              dt_bias.defined() ? dt_bias.scalar_type() : at::ScalarType::Undefined);
  check_cuda(where, "A_log", a_log, z.device());
  check_cuda(where, "dt_bias", dt_bias, z.device());
}

// Contiguous and 16-byte aligned (the launchers' vector loads): a view starting inside its
// storage is copied.
at::Tensor dense_aligned(const at::Tensor& t) {
  at::Tensor c = t.detach().contiguous();
  if (reinterpret_cast<uintptr_t>(c.data_ptr()) % 16 != 0) c = c.clone();
  return c;
}

}  // namespace

at::Tensor kda_gate(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias, double g_min) {
  constexpr const char* where = "kernels::kda_gate";
  check_kda_gate(where, z, a_log, dt_bias);
  const c10::cuda::CUDAGuard guard(z.device());
  const at::Tensor zc = dense_aligned(z), ac = a_log.detach().contiguous(), bc = dense_aligned(dt_bias);
  const int64_t heads = z.size(-2), width = z.size(-1), tokens = z.numel() / (heads * width);
  at::Tensor g = at::empty(z.sizes(), z.options().dtype(at::kFloat));
  check_launch(kda_gate_forward(kernel_dtype(z.scalar_type()), zc.data_ptr(), ac.data_ptr<float>(),
                                bc.data_ptr<float>(), static_cast<float>(g_min), g.data_ptr<float>(), tokens, heads,
                                width, current_stream(zc)),
               where);
  return g;
}

KdaGateGradients kda_gate_backward(const at::Tensor& z, const at::Tensor& a_log, const at::Tensor& dt_bias,
                                   double g_min, const at::Tensor& dg, bool want_dz, bool want_a_log,
                                   bool want_dt_bias) {
  constexpr const char* where = "kernels::kda_gate_backward";
  check_kda_gate(where, z, a_log, dt_bias);
  TORCH_CHECK(dg.defined() && dg.sizes() == z.sizes(), where, ": dg must be ", z.sizes(), ", got ",
              dg.defined() ? dg.sizes() : at::IntArrayRef{});
  check_cuda(where, "dg", dg, z.device());
  const c10::cuda::CUDAGuard guard(z.device());
  const at::Tensor zc = dense_aligned(z), ac = a_log.detach().contiguous(), bc = dense_aligned(dt_bias);
  const at::Tensor dgc = dense_aligned(dg.to(at::kFloat));
  const int64_t heads = z.size(-2), width = z.size(-1), tokens = z.numel() / (heads * width);
  KdaGateGradients out;
  if (want_dz) out.dz = at::empty(z.sizes(), z.options());
  if (want_a_log) out.d_a_log = at::empty({heads}, a_log.options());
  if (want_dt_bias) out.d_dt_bias = at::empty(dt_bias.sizes(), dt_bias.options());
  at::Tensor workspace;
  if (want_a_log || want_dt_bias) {
    workspace = at::empty({static_cast<int64_t>(kda_gate_backward_workspace_bytes(tokens, heads, width))},
                          z.options().dtype(at::kByte));
  }
  check_launch(kda_gate_backward(kernel_dtype(z.scalar_type()), zc.data_ptr(), ac.data_ptr<float>(),
                                 bc.data_ptr<float>(), static_cast<float>(g_min), dgc.data_ptr<float>(),
                                 want_dz ? out.dz.data_ptr() : nullptr,
                                 want_a_log ? out.d_a_log.data_ptr<float>() : nullptr,
                                 want_dt_bias ? out.d_dt_bias.data_ptr<float>() : nullptr,
                                 workspace.defined() ? workspace.data_ptr() : nullptr, tokens, heads, width,
                                 current_stream(zc)),
               where);
  return out;
}

// ---- The KDA layer's short convolution ----------------------------------------------------------

namespace {

bool short_conv_head_supported(int64_t head, int64_t channels) {
  if (head == 0) return true;
  const int64_t lanes = head / 4;
  return head >= 4 && head <= 128 && head % 4 == 0 && (lanes & (lanes - 1)) == 0 && channels % head == 0;
}

int64_t short_conv_width(const at::Tensor& weight) { return weight.size(-1); }

}  // namespace

bool kda_short_conv_supported(const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight,
                              int64_t head) {
  if (!x.defined() || !conv_inputs.defined() || !weight.defined() || !x.is_cuda() || x.dim() != 3) return false;
  if (x.scalar_type() != at::kFloat || conv_inputs.scalar_type() != at::kFloat || weight.scalar_type() != at::kFloat) {
    return false;
  }
  if (conv_inputs.device() != x.device() || weight.device() != x.device()) return false;
  const int64_t channels = x.size(2);
  const bool weight_shape = (weight.dim() == 3 && weight.size(1) == 1) || weight.dim() == 2;
  if (!weight_shape || weight.size(0) != channels) return false;
  const int64_t width = short_conv_width(weight);
  return width >= 1 && width <= kKdaConvMaxWidth && channels % 128 == 0 && x.size(0) >= 1 && x.size(0) <= 65535 &&
         conv_inputs.dim() == 3 && conv_inputs.size(0) == x.size(0) && conv_inputs.size(1) == width - 1 &&
         conv_inputs.size(2) == channels && short_conv_head_supported(head, channels);
}

namespace {

void check_short_conv(const char* where, const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight,
                      int64_t head) {
  TORCH_CHECK(x.defined() && x.dim() == 3, where, ": x must be [B, T, D], got ",
              x.defined() ? x.sizes() : at::IntArrayRef{});
  check_cuda(where, "x", x, x.device());
  TORCH_CHECK(kda_short_conv_supported(x, conv_inputs, weight, head), where,
              ": needs fp32 x [B, T, D] (D a multiple of 128), conv_inputs [B, W - 1, D] and weight [D, 1, W] "
              "(1 <= W <= ",
              kKdaConvMaxWidth, ") on x's device, and head 0 or a power-of-two multiple of 4 up to 128 dividing D; got x ",
              x.sizes(), " ", x.scalar_type(), ", conv_inputs ",
              conv_inputs.defined() ? conv_inputs.sizes() : at::IntArrayRef{}, ", weight ",
              weight.defined() ? weight.sizes() : at::IntArrayRef{}, ", head ", head,
              " (use the layer's LibTorch short_conv)");
}

}  // namespace

at::Tensor kda_short_conv(const at::Tensor& x, const at::Tensor& conv_inputs, const at::Tensor& weight, int64_t head,
                          double eps) {
  constexpr const char* where = "kernels::kda_short_conv";
  check_short_conv(where, x, conv_inputs, weight, head);
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = dense_aligned(x), cc = dense_aligned(conv_inputs), wc = weight.detach().contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  check_launch(kda_short_conv_forward(xc.data_ptr<float>(), cc.numel() > 0 ? cc.data_ptr<float>() : nullptr,
                                      wc.data_ptr<float>(), y.data_ptr<float>(), x.size(0), x.size(1), x.size(2),
                                      static_cast<int>(short_conv_width(weight)), static_cast<int>(head),
                                      static_cast<float>(eps), current_stream(xc)),
               where);
  return y;
}

KdaShortConvGradients kda_short_conv_backward(const at::Tensor& x, const at::Tensor& conv_inputs,
                                              const at::Tensor& weight, int64_t head, double eps,
                                              const at::Tensor& dy, bool want_dx, bool want_conv_inputs,
                                              bool want_weight) {
  constexpr const char* where = "kernels::kda_short_conv_backward";
  check_short_conv(where, x, conv_inputs, weight, head);
  TORCH_CHECK(dy.defined() && dy.sizes() == x.sizes(), where, ": dy must be ", x.sizes(), ", got ",
              dy.defined() ? dy.sizes() : at::IntArrayRef{});
  check_cuda(where, "dy", dy, x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = dense_aligned(x), cc = dense_aligned(conv_inputs), wc = weight.detach().contiguous();
  const at::Tensor gc = dense_aligned(dy.to(at::kFloat));
  const int64_t batch = x.size(0), length = x.size(1), channels = x.size(2), width = short_conv_width(weight);
  KdaShortConvGradients out;
  if (want_dx) out.dx = at::empty(x.sizes(), x.options());
  if (want_conv_inputs) out.d_conv_inputs = at::zeros(conv_inputs.sizes(), conv_inputs.options());
  if (want_weight) out.d_weight = at::empty(weight.sizes(), weight.options());
  at::Tensor workspace;
  if (want_weight) {
    workspace = at::empty(
        {static_cast<int64_t>(kda_short_conv_backward_workspace_bytes(batch, length, channels, static_cast<int>(width)))},
        x.options().dtype(at::kByte));
  }
  float* d_conv = want_conv_inputs && out.d_conv_inputs.numel() > 0 ? out.d_conv_inputs.data_ptr<float>() : nullptr;
  check_launch(kda_short_conv_backward(xc.numel() > 0 ? xc.data_ptr<float>() : nullptr,
                                       cc.numel() > 0 ? cc.data_ptr<float>() : nullptr, wc.data_ptr<float>(),
                                       gc.numel() > 0 ? gc.data_ptr<float>() : nullptr,
                                       want_dx && out.dx.numel() > 0 ? out.dx.data_ptr<float>() : nullptr, d_conv,
                                       want_weight ? out.d_weight.data_ptr<float>() : nullptr,
                                       workspace.defined() ? workspace.data_ptr() : nullptr, batch, length, channels,
                                       static_cast<int>(width), static_cast<int>(head), static_cast<float>(eps),
                                       current_stream(xc)),
               where);
  return out;
}

// ---- RMSNorm ------------------------------------------------------------------------------------

static RmsDtype rms_dtype(at::ScalarType t) { return t == at::kBFloat16 ? RmsDtype::kBFloat16 : RmsDtype::kFloat32; }

bool rms_norm_supported(const at::Tensor& x, const at::Tensor& weight) {
  return x.defined() && weight.defined() && x.is_cuda() && weight.device() == x.device() && x.dim() >= 1 &&
         weight.dim() == 1 && is_kernel_dtype(x.scalar_type()) && is_kernel_dtype(weight.scalar_type()) &&
         x.size(-1) == weight.size(0) && x.size(-1) >= 1 && x.size(-1) <= kRmsNormMaxWidth;
}

RmsNormForward rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  constexpr const char* where = "kernels::rms_norm_forward";
  TORCH_CHECK(rms_norm_supported(x, weight), where, ": needs CUDA bf16 / fp32 x [..., width <= ", kRmsNormMaxWidth,
              "] and weight [width] on its device, got x ", x.sizes(), " ", x.scalar_type(), " and weight ",
              weight.sizes(), " ", weight.scalar_type());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  const int64_t width = x.size(-1), rows = x.numel() / width;
  RmsNormForward out{at::empty_like(xc), at::empty({rows}, x.options().dtype(at::kFloat))};
  check_launch(rms_norm_forward(rms_dtype(x.scalar_type()), xc.data_ptr(), rms_dtype(weight.scalar_type()),
                                wc.data_ptr(), eps, out.y.data_ptr(), out.inv_rms.data_ptr<float>(), rows, width,
                                current_stream(xc)),
               where);
  return out;
}

RmsNormBackward rms_norm_backward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& inv_rms,
                                  const at::Tensor& dy, bool want_dw) {
  constexpr const char* where = "kernels::rms_norm_backward";
  TORCH_CHECK(rms_norm_supported(x, weight), where, ": needs CUDA bf16 / fp32 x [..., width <= ", kRmsNormMaxWidth,
              "] and weight [width] on its device, got x ", x.sizes(), " ", x.scalar_type(), " and weight ",
              weight.sizes(), " ", weight.scalar_type());
  const int64_t width = x.size(-1), rows = x.numel() / width;
  TORCH_CHECK(dy.sizes() == x.sizes(), where, ": dy must be ", x.sizes(), ", got ", dy.sizes());
  TORCH_CHECK(inv_rms.scalar_type() == at::kFloat && inv_rms.numel() == rows, where, ": inv_rms must be fp32 [",
              rows, "], got ", inv_rms.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous(), rc = inv_rms.contiguous();
  const at::Tensor g = dy.to(x.scalar_type()).contiguous();
  RmsNormBackward out{at::empty_like(xc), want_dw ? at::empty_like(wc) : at::Tensor()};
  at::Tensor workspace;
  if (want_dw && rows > 0) {
    workspace = at::empty({static_cast<int64_t>(rms_norm_backward_workspace_bytes(rows, width))},
                          x.options().dtype(at::kByte));
  }
  check_launch(rms_norm_backward(rms_dtype(x.scalar_type()), xc.data_ptr(), rms_dtype(weight.scalar_type()),
                                 wc.data_ptr(), rc.data_ptr<float>(), g.data_ptr(), out.dx.data_ptr(),
                                 want_dw ? out.dw.data_ptr() : nullptr,
                                 workspace.defined() ? workspace.data_ptr() : nullptr, rows, width,
                                 current_stream(xc)),
               where);
  return out;
}

bool attn_res_mix_supported(const std::vector<at::Tensor>& sources, const at::Tensor& w) {
  if (sources.size() < 2 || sources.size() > static_cast<size_t>(kAttnResMaxSources) || !w.defined()) return false;
  const at::Tensor& first = sources.front();
  if (!first.defined() || !first.is_cuda() || first.dim() < 1 || !is_kernel_dtype(first.scalar_type()) ||
      first.size(-1) < 1 || first.size(-1) > kAttnResMaxWidth || w.dim() != 1 || w.size(0) != first.size(-1) ||
      w.device() != first.device() || !is_kernel_dtype(w.scalar_type())) {
    return false;
  }
  for (const at::Tensor& source : sources) {
    if (!source.defined() || source.device() != first.device() || source.scalar_type() != first.scalar_type() ||
        source.sizes() != first.sizes()) {
      return false;
    }
  }
  return true;
}

namespace {

// The sources made contiguous (kept alive in `dense`) and their data pointers.
std::vector<const void*> contiguous_pointers(const std::vector<at::Tensor>& sources, std::vector<at::Tensor>& dense) {
  std::vector<const void*> pointers;
  for (const at::Tensor& source : sources) {
    dense.push_back(source.contiguous());
    pointers.push_back(dense.back().data_ptr());
  }
  return pointers;
}

void check_attn_res(const char* where, const std::vector<at::Tensor>& sources, const at::Tensor& w) {
  TORCH_CHECK(attn_res_mix_supported(sources, w), where, ": needs 2 to ", kAttnResMaxSources,
              " CUDA bf16 / fp32 sources of one shape [..., width <= ", kAttnResMaxWidth,
              "] and dtype, and w [width] bf16 / fp32 on their device; got ", sources.size(), " sources",
              sources.empty() || !sources.front().defined()
                  ? std::string()
                  : c10::str(" like ", sources.front().sizes(), " ", sources.front().scalar_type(), " on ",
                             sources.front().device()),
              " and w ", w.defined() ? c10::str(w.sizes(), " ", w.scalar_type()) : std::string("none"));
}

}  // namespace

AttnResMixForward attn_res_mix_forward(const std::vector<at::Tensor>& sources, const at::Tensor& w, double eps) {
  constexpr const char* where = "kernels::attn_res_mix_forward";
  check_attn_res(where, sources, w);
  const at::Tensor& first = sources.front();
  const c10::cuda::CUDAGuard guard(first.device());
  std::vector<at::Tensor> dense;
  const std::vector<const void*> pointers = contiguous_pointers(sources, dense);
  const at::Tensor wc = w.contiguous();
  const int64_t width = first.size(-1), rows = first.numel() / width, count = static_cast<int64_t>(sources.size());
  const at::TensorOptions fp32 = first.options().dtype(at::kFloat);
  AttnResMixForward out{at::empty(first.sizes(), first.options()), at::empty({rows, count}, fp32),
                        at::empty({rows, count}, fp32)};
  check_launch(attn_res_mix_forward(rms_dtype(first.scalar_type()), pointers.data(), static_cast<int>(count),
                                    rms_dtype(w.scalar_type()), wc.data_ptr(), eps, out.h.data_ptr(),
                                    out.weights.data_ptr<float>(), out.inv_rms.data_ptr<float>(), rows, width,
                                    current_stream(dense.front())),
               where);
  return out;
}

AttnResMixBackward attn_res_mix_backward(const std::vector<at::Tensor>& sources, const at::Tensor& w,
                                         const at::Tensor& weights, const at::Tensor& inv_rms,
                                         const at::Tensor& dh, bool want_dw) {
  constexpr const char* where = "kernels::attn_res_mix_backward";
  check_attn_res(where, sources, w);
  const at::Tensor& first = sources.front();
  const int64_t width = first.size(-1), rows = first.numel() / width, count = static_cast<int64_t>(sources.size());
  TORCH_CHECK(dh.defined() && dh.sizes() == first.sizes(), where, ": dh must be ", first.sizes(), ", got ",
              dh.defined() ? dh.sizes() : at::IntArrayRef{});
  for (const auto& [name, t] : {std::pair<const char*, const at::Tensor*>{"weights", &weights}, {"inv_rms", &inv_rms}}) {
    TORCH_CHECK(t->defined() && t->scalar_type() == at::kFloat && t->dim() == 2 && t->size(0) == rows &&
                    t->size(1) == count && t->device() == first.device(),
                where, ": ", name, " must be fp32 [", rows, ", ", count, "] on ", first.device(), ", got ",
                t->defined() ? c10::str(t->sizes(), " ", t->scalar_type()) : std::string("none"));
  }
  const c10::cuda::CUDAGuard guard(first.device());
  std::vector<at::Tensor> dense;
  const std::vector<const void*> pointers = contiguous_pointers(sources, dense);
  const at::Tensor wc = w.contiguous(), ac = weights.contiguous(), rc = inv_rms.contiguous();
  const at::Tensor g = dh.to(first.scalar_type()).contiguous();
  AttnResMixBackward out;
  std::vector<void*> d_pointers;
  for (int64_t s = 0; s < count; ++s) {
    out.d_sources.push_back(at::empty(first.sizes(), first.options()));
    d_pointers.push_back(out.d_sources.back().data_ptr());
  }
  if (want_dw) out.dw = at::empty_like(wc);
  at::Tensor workspace;
  if (want_dw && rows > 0) {
    workspace = at::empty({static_cast<int64_t>(attn_res_mix_backward_workspace_bytes(rows, width))},
                          first.options().dtype(at::kByte));
  }
  check_launch(attn_res_mix_backward(rms_dtype(first.scalar_type()), pointers.data(), static_cast<int>(count),
                                     rms_dtype(w.scalar_type()), wc.data_ptr(), ac.data_ptr<float>(),
                                     rc.data_ptr<float>(), g.data_ptr(), d_pointers.data(),
                                     want_dw ? out.dw.data_ptr() : nullptr,
                                     workspace.defined() ? workspace.data_ptr() : nullptr, rows, width,
                                     current_stream(g)),
               where);
  return out;
}

std::vector<at::Tensor> moe_split_bf16(const at::Tensor& x, int parts) {
  constexpr const char* where = "kernels::moe_split_bf16";
  TORCH_CHECK(x.defined() && x.scalar_type() == at::kFloat, where, ": x must be fp32, got ",
              x.defined() ? x.scalar_type() : at::ScalarType::Undefined);
  TORCH_CHECK(parts >= 1 && parts <= 3, where, ": parts must be 1, 2 or 3, got ", parts);
  check_cuda(where, "x", x, x.device());
  const c10::cuda::CUDAGuard guard(x.device());
  const at::Tensor xc = x.detach().contiguous();
  std::vector<at::Tensor> out;
  for (int i = 0; i < parts; ++i) out.push_back(at::empty(xc.sizes(), xc.options().dtype(at::kBFloat16)));
  check_launch(moe_split_bf16(xc.data_ptr<float>(), xc.numel(), parts, out[0].data_ptr(),
                              parts > 1 ? out[1].data_ptr() : nullptr, parts > 2 ? out[2].data_ptr() : nullptr,
                              current_stream(xc)),
               where);
  return out;
}

at::Tensor moe_router_logit_gradient(const at::Tensor& scores, const at::Tensor& ids, const at::Tensor& d_p) {
  constexpr const char* where = "kernels::moe_router_logit_gradient";
  TORCH_CHECK(scores.defined() && scores.dim() == 2 && scores.scalar_type() == at::kFloat, where,
              ": scores must be fp32 [tokens, experts], got ",
              scores.defined() ? scores.sizes() : at::IntArrayRef{});
  check_cuda(where, "scores", scores, scores.device());
  const int64_t m = scores.size(0), n = scores.size(1);
  TORCH_CHECK(ids.defined() && ids.dim() == 2 && ids.size(0) == m && ids.scalar_type() == at::kLong, where,
              ": ids must be int64 [", m, ", top_k], got ", ids.defined() ? ids.sizes() : at::IntArrayRef{});
  const int64_t k = ids.size(1);
  TORCH_CHECK(k >= 1 && k <= kMoeTopkMaxK && k <= n, where, ": top_k must be in [1, min(", kMoeTopkMaxK,
              ", experts = ", n, ")], got ", k);
  TORCH_CHECK(d_p.defined() && d_p.sizes() == ids.sizes(), where, ": d_p must be [", m, ", ", k, "], got ",
              d_p.defined() ? d_p.sizes() : at::IntArrayRef{});
  check_cuda(where, "ids", ids, scores.device());
  check_cuda(where, "d_p", d_p, scores.device());
  const c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor s = scores.detach().contiguous(), i = ids.contiguous();
  const at::Tensor g = d_p.detach().to(at::kFloat).contiguous();
  at::Tensor out = at::empty({m, k}, scores.options());
  check_launch(moe_router_logit_gradient(s.data_ptr<float>(), i.data_ptr<int64_t>(), g.data_ptr<float>(),
                                         out.data_ptr<float>(), m, n, k, current_stream(s)),
               where);
  return out;
}

bool moe_router_backward_applies(const at::Tensor& tokens, const at::Tensor& weight, int64_t top_k) {
  return tokens.defined() && weight.defined() && tokens.is_cuda() && weight.device() == tokens.device() &&
         tokens.dim() == 2 && weight.dim() == 2 && tokens.scalar_type() == at::kBFloat16 &&
         (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16) &&
         tokens.size(1) == weight.size(1) && weight.size(0) >= 1 && weight.size(0) <= kMoeRouterMaxExperts &&
         tokens.size(1) % 32 == 0 && top_k >= 1 && top_k <= kMoeTopkMaxK && top_k <= weight.size(0);
}

namespace {
// d_logits fp32 [m, k] and ids int64 [m, k] on one device (the router backward's sparse operands).
void check_router_gradient(const char* where, const at::Tensor& d_logits, const at::Tensor& ids) {
  TORCH_CHECK(d_logits.defined() && d_logits.dim() == 2 && d_logits.scalar_type() == at::kFloat, where,
              ": d_logits must be fp32 [tokens, top_k], got ",
              d_logits.defined() ? d_logits.sizes() : at::IntArrayRef{});
  TORCH_CHECK(ids.defined() && ids.sizes() == d_logits.sizes() && ids.scalar_type() == at::kLong, where,
              ": ids must be int64 ", d_logits.sizes(), ", got ", ids.defined() ? ids.sizes() : at::IntArrayRef{});
  check_cuda(where, "d_logits", d_logits, d_logits.device());
  check_cuda(where, "ids", ids, d_logits.device());
}
}  // namespace

at::Tensor moe_router_dx(const at::Tensor& d_logits, const at::Tensor& ids, const at::Tensor& weight) {
  constexpr const char* where = "kernels::moe_router_dx";
  check_router_gradient(where, d_logits, ids);
  TORCH_CHECK(weight.defined() && weight.dim() == 2 &&
                  (weight.scalar_type() == at::kFloat || weight.scalar_type() == at::kBFloat16),
              where, ": weight must be fp32 or bf16 [experts, d], got ",
              weight.defined() ? weight.sizes() : at::IntArrayRef{});
  check_cuda(where, "weight", weight, d_logits.device());
  const int64_t m = d_logits.size(0), k = d_logits.size(1), n = weight.size(0), d = weight.size(1);
  TORCH_CHECK(n >= 1 && n <= kMoeRouterMaxExperts && d % 32 == 0 && d > 0 && k >= 1 && k <= kMoeTopkMaxK, where,
              ": supports up to ", kMoeRouterMaxExperts, " experts, d a multiple of 32 and top_k <= ", kMoeTopkMaxK,
              "; got experts ", n, ", d ", d, ", top_k ", k);
  const c10::cuda::CUDAGuard guard(d_logits.device());
  const at::Tensor g = d_logits.contiguous(), i = ids.contiguous(), w = weight.detach().contiguous();
  at::Tensor dx = at::empty({m, d}, d_logits.options().dtype(at::kBFloat16));
  check_launch(moe_router_dx(g.data_ptr<float>(), i.data_ptr<int64_t>(), moe_dtype(w.scalar_type()), w.data_ptr(),
                             dx.data_ptr(), m, n, d, k, current_stream(g)),
               where);
  return dx;
}

at::Tensor moe_router_dw(const at::Tensor& d_logits, const at::Tensor& tokens, const MoePermutation& permutation,
                         at::ScalarType weight_dtype) {
  constexpr const char* where = "kernels::moe_router_dw";
  TORCH_CHECK(d_logits.defined() && d_logits.dim() == 2 && d_logits.scalar_type() == at::kFloat, where,
              ": d_logits must be fp32 [tokens, top_k], got ",
              d_logits.defined() ? d_logits.sizes() : at::IntArrayRef{});
  const int64_t m = d_logits.size(0), k = d_logits.size(1);
  TORCH_CHECK(tokens.defined() && tokens.dim() == 2 && tokens.size(0) == m && tokens.scalar_type() == at::kBFloat16,
              where, ": tokens must be bf16 [", m, ", d], got ", tokens.defined() ? tokens.sizes() : at::IntArrayRef{});
  TORCH_CHECK(weight_dtype == at::kFloat || weight_dtype == at::kBFloat16, where,
              ": the weight's dtype must be fp32 or bf16, got ", weight_dtype);
  TORCH_CHECK(permutation.offsets.defined() && permutation.source.defined() && permutation.tokens == m &&
                  permutation.top_k == k && permutation.source.numel() == m * k,
              where, ": the permutation is of ", permutation.tokens, " tokens x ", permutation.top_k,
              " slots, d_logits is [", m, ", ", k, "]");
  const int64_t n = permutation.offsets.numel() - 1, d = tokens.size(1);
  TORCH_CHECK(n >= 1 && n <= kMoeRouterMaxExperts && d % 8 == 0 && d > 0 && k >= 1 && k <= kMoeTopkMaxK, where,
              ": supports up to ", kMoeRouterMaxExperts, " experts, d a multiple of 8 and top_k <= ", kMoeTopkMaxK,
              "; got experts ", n, ", d ", d, ", top_k ", k);
  check_cuda(where, "d_logits", d_logits, d_logits.device());
  check_cuda(where, "tokens", tokens, d_logits.device());
  check_cuda(where, "permutation.source", permutation.source, d_logits.device());
  check_cuda(where, "permutation.offsets", permutation.offsets, d_logits.device());
  const c10::cuda::CUDAGuard guard(d_logits.device());
  const at::Tensor g = d_logits.contiguous(), x = tokens.detach().contiguous();
  at::Tensor dw = at::empty({n, d}, d_logits.options().dtype(weight_dtype));
  at::Tensor workspace = at::empty({static_cast<int64_t>(moe_router_dw_workspace_bytes(n, d))},
                                   d_logits.options().dtype(at::kByte));
  check_launch(moe_router_dw(g.data_ptr<float>(), x.data_ptr(), permutation.source.data_ptr<int64_t>(),
                             permutation.offsets.data_ptr<int64_t>(), moe_dtype(weight_dtype), dw.data_ptr(),
                             workspace.data_ptr(), m, n, d, k, current_stream(g)),
               where);
  return dw;
}

bool moe_quantile_histogram_supported(const at::Tensor& scores, int64_t top_k) {
  return scores.defined() && scores.is_cuda() && scores.dim() == 2 &&
         at::isFloatingType(scores.scalar_type()) && scores.scalar_type() != at::kDouble &&
         scores.size(1) <= kMoeTopkMaxExperts && top_k >= 1 && top_k + 1 <= kMoeTopkMaxK &&
         top_k + 1 <= scores.size(1);
}

at::Tensor moe_quantile_histogram(const at::Tensor& scores, const at::Tensor& bias, int64_t top_k,
                                  int64_t bins, double lo, double hi, bool literal_alpha) {
  constexpr const char* where = "kernels::moe_quantile_histogram";
  TORCH_CHECK(scores.defined() && scores.dim() == 2, where, ": scores must be [tokens, experts], got ",
              scores.defined() ? scores.sizes() : at::IntArrayRef{});
  check_cuda(where, "scores", scores, scores.device());
  TORCH_CHECK(at::isFloatingType(scores.scalar_type()) && scores.scalar_type() != at::kDouble, where,
              ": scores must be a floating dtype other than fp64 (fp64 balancing stays on the "
              "reference), got ", scores.scalar_type());
  const int64_t m = scores.size(0), n = scores.size(1);
  TORCH_CHECK(bias.defined() && bias.dim() == 1 && bias.size(0) == n, where, ": bias must be [", n,
              "], got ", bias.defined() ? bias.sizes() : at::IntArrayRef{});
  TORCH_CHECK(top_k >= 1 && top_k + 1 <= kMoeTopkMaxK && top_k + 1 <= n && n <= kMoeTopkMaxExperts,
              where, ": needs top_k + 1 <= min(", kMoeTopkMaxK, ", experts) and experts <= ",
              kMoeTopkMaxExperts, ", got top_k = ", top_k, ", experts = ", n);
  TORCH_CHECK(bins >= 1, where, ": bins must be positive, got ", bins);
  TORCH_CHECK(hi > lo, where, ": the range must have hi > lo, got [", lo, ", ", hi, "]");
  const c10::cuda::CUDAGuard guard(scores.device());
  const at::Tensor s = scores.detach().to(at::kFloat).contiguous();
  const at::Tensor b = bias.detach().to(scores.device(), at::kFloat).contiguous();
  at::Tensor counts = at::zeros({n, bins}, scores.options().dtype(at::kLong));
  // The scale exactly as the reference computes it (fp64).
  const double scale = static_cast<double>(bins) / (hi - lo);
  check_launch(moe_quantile_histogram(s.data_ptr<float>(), b.data_ptr<float>(),
                                      counts.data_ptr<int64_t>(), m, n, top_k, bins, lo, scale,
                                      literal_alpha, current_stream(s)),
               where);
  return counts;
}

MoePermutation moe_permutation(const at::Tensor& selected, int64_t num_experts) {
  constexpr const char* where = "kernels::moe_permutation";
  TORCH_CHECK(selected.defined() && selected.dim() == 2 && selected.scalar_type() == at::kLong, where,
              ": selected must be int64 [tokens, k], got ",
              selected.defined() ? c10::str(selected.scalar_type(), selected.sizes()) : "undefined");
  check_cuda(where, "selected", selected, selected.device());
  TORCH_CHECK(num_experts >= 1 && num_experts <= kMoePermutationMaxExperts, where,
              ": num_experts must be in [1, ", kMoePermutationMaxExperts, "], got ", num_experts);
  const int64_t m = selected.size(0), k = selected.size(1);
  TORCH_CHECK(k >= 1, where, ": k must be positive");
  const int64_t copies = m * k;
  TORCH_CHECK(copies < (int64_t{1} << 31), where, ": ", copies, " token copies exceed int32 rows");
  const c10::cuda::CUDAGuard guard(selected.device());
  const at::Tensor ids = selected.contiguous();
  const auto i64 = selected.options().dtype(at::kLong);
  MoePermutation p;
  p.tokens = m;
  p.top_k = k;
  p.source = at::empty({copies}, i64);
  p.token = at::empty({copies}, i64);
  p.inverse = at::empty({copies}, i64);
  p.tokens_per_expert = at::empty({num_experts}, i64);
  p.offsets = at::empty({num_experts + 1}, i64);
  p.group_ends = at::empty({num_experts}, selected.options().dtype(at::kInt));
  const size_t workspace_bytes = moe_permutation_workspace_bytes(copies, num_experts);
  const at::Tensor workspace =
      at::empty({static_cast<int64_t>(workspace_bytes)}, selected.options().dtype(at::kByte));
  check_launch(moe_permutation(ids.data_ptr<int64_t>(), copies, num_experts, k,
                               p.tokens_per_expert.data_ptr<int64_t>(), p.offsets.data_ptr<int64_t>(),
                               p.group_ends.data_ptr<int32_t>(), p.source.data_ptr<int64_t>(),
                               p.token.data_ptr<int64_t>(), p.inverse.data_ptr<int64_t>(),
                               workspace.data_ptr(), workspace_bytes, current_stream(ids)),
               where);
  return p;
}

at::Tensor moe_gather_rows(const at::Tensor& rows, const at::Tensor& index) {
  constexpr const char* where = "kernels::moe_gather_rows";
  TORCH_CHECK(rows.defined() && rows.dim() >= 1, where, ": rows must have a leading row dimension");
  check_cuda(where, "rows", rows, rows.device());
  check_cuda(where, "index", index, rows.device());
  TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong, where,
              ": index must be int64 [rows], got ", index.scalar_type(), index.sizes());
  const int64_t element = static_cast<int64_t>(rows.element_size());
  TORCH_CHECK(element == 2 || element == 4, where, ": rows must have 2- or 4-byte elements, got ",
              rows.scalar_type());
  const c10::cuda::CUDAGuard guard(rows.device());
  const at::Tensor in = rows.contiguous(), idx = index.contiguous();
  std::vector<int64_t> shape = rows.sizes().vec();
  shape[0] = index.size(0);
  at::Tensor out = at::empty(shape, rows.options());
  const int64_t width = rows.size(0) > 0 ? in.numel() / rows.size(0) : 0;
  check_launch(moe_gather_rows(in.data_ptr(), idx.data_ptr<int64_t>(), out.data_ptr(), index.size(0),
                               width, element, current_stream(in)),
               where);
  return out;
}

namespace {
// The permuted copies un-permute and its backward take: [tokens * k, width], bf16 or fp32, CUDA.
void check_copies(const char* where, const at::Tensor& copies, int64_t m, int64_t k) {
  TORCH_CHECK(copies.defined() && copies.dim() == 2 && copies.size(0) == m * k, where,
              ": copies must be [tokens * k = ", m * k, ", width], got ",
              copies.defined() ? copies.sizes() : at::IntArrayRef{});
  check_cuda(where, "copies", copies, copies.device());
  TORCH_CHECK(is_kernel_dtype(copies.scalar_type()), where, ": copies must be bf16 or fp32, got ",
              copies.scalar_type());
}
}  // namespace

at::Tensor moe_unpermute(const at::Tensor& copies, const MoePermutation& permutation,
                         const at::Tensor& weights, at::ScalarType out_dtype, bool vectors) {
  constexpr const char* where = "kernels::moe_unpermute";
  const int64_t m = permutation.tokens, k = permutation.top_k;
  check_copies(where, copies, m, k);
  TORCH_CHECK(is_kernel_dtype(out_dtype), where, ": out_dtype must be bf16 or fp32, got ", out_dtype);
  at::Tensor w;
  if (weights.defined()) {
    TORCH_CHECK(weights.dim() == 2 && weights.size(0) == m && weights.size(1) == k, where,
                ": weights must be [", m, ", ", k, "], got ", weights.sizes());
    check_cuda(where, "weights", weights, copies.device());
    w = weights.detach().to(at::kFloat).contiguous();
  }
  const c10::cuda::CUDAGuard guard(copies.device());
  const at::Tensor c = copies.contiguous();
  at::Tensor out = at::empty({m, copies.size(1)}, copies.options().dtype(out_dtype));
  check_launch(moe_unpermute(moe_dtype(c.scalar_type()), c.data_ptr(),
                             w.defined() ? w.data_ptr<float>() : nullptr,
                             permutation.inverse.data_ptr<int64_t>(), moe_dtype(out_dtype),
                             out.data_ptr(), m, k, copies.size(1), current_stream(c), vectors),
               where);
  return out;
}

MoeUnpermuteGradients moe_unpermute_backward(const at::Tensor& copies,
                                             const MoePermutation& permutation,
                                             const at::Tensor& weights, const at::Tensor& d_out,
                                             bool want_weights) {
  constexpr const char* where = "kernels::moe_unpermute_backward";
  const int64_t m = permutation.tokens, k = permutation.top_k;
  check_copies(where, copies, m, k);
  const int64_t width = copies.size(1);
  TORCH_CHECK(d_out.defined() && d_out.dim() == 2 && d_out.size(0) == m && d_out.size(1) == width,
              where, ": d_out must be [", m, ", ", width, "], got ",
              d_out.defined() ? d_out.sizes() : at::IntArrayRef{});
  check_cuda(where, "d_out", d_out, copies.device());
  TORCH_CHECK(weights.defined() && weights.dim() == 2 && weights.size(0) == m && weights.size(1) == k,
              where, ": weights must be [", m, ", ", k, "]");
  check_cuda(where, "weights", weights, copies.device());
  const c10::cuda::CUDAGuard guard(copies.device());
  const at::Tensor c = copies.contiguous();
  const at::Tensor w = weights.detach().to(at::kFloat).contiguous();
  const at::Tensor d = d_out.to(at::kFloat).contiguous();
  MoeUnpermuteGradients g;
  g.d_copies = at::empty_like(c);
  if (want_weights) g.d_weights = at::empty({m, k}, c.options().dtype(at::kFloat));
  check_launch(moe_unpermute_backward(moe_dtype(c.scalar_type()), c.data_ptr(), w.data_ptr<float>(),
                                      permutation.source.data_ptr<int64_t>(),
                                      permutation.inverse.data_ptr<int64_t>(), d.data_ptr<float>(),
                                      g.d_copies.data_ptr(),
                                      want_weights ? g.d_weights.data_ptr<float>() : nullptr, m, k,
                                      width, current_stream(c)),
               where);
  return g;
}

bool situ_glu_supported(const at::Tensor& gate, const at::Tensor& up) {
  return gate.defined() && up.defined() && gate.is_cuda() && up.device() == gate.device() &&
         is_kernel_dtype(gate.scalar_type()) && up.scalar_type() == gate.scalar_type() &&
         gate.sizes() == up.sizes();
}

namespace {

void check_situ(const char* where, const at::Tensor& gate, const at::Tensor& up, double beta1,
                double beta2) {
  TORCH_CHECK(gate.defined() && up.defined() && gate.sizes() == up.sizes(), where, ": gate ",
              gate.defined() ? gate.sizes() : at::IntArrayRef{}, " and up ",
              up.defined() ? up.sizes() : at::IntArrayRef{}, " must have one shape");
  check_cuda(where, "gate", gate, gate.device());
  check_cuda(where, "up", up, gate.device());
  TORCH_CHECK(is_kernel_dtype(gate.scalar_type()) && up.scalar_type() == gate.scalar_type(), where,
              ": gate and up must be one dtype of bf16 / fp32, got ", gate.scalar_type(), " and ",
              up.scalar_type());
  TORCH_CHECK(beta1 > 0 && beta2 > 0, where, ": caps must be positive, got ", beta1, " and ", beta2);
}

}  // namespace

at::Tensor situ_glu(const at::Tensor& gate, const at::Tensor& up, double beta1, double beta2) {
  constexpr const char* where = "kernels::situ_glu";
  check_situ(where, gate, up, beta1, beta2);
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  at::Tensor h = at::empty(g.sizes(), g.options());
  check_launch(situ_glu_forward(moe_dtype(g.scalar_type()), g.data_ptr(), u.data_ptr(), h.data_ptr(),
                                g.numel(), static_cast<float>(beta1), static_cast<float>(beta2),
                                current_stream(g)),
               where);
  return h;
}

SituGluGradients situ_glu_backward(const at::Tensor& gate, const at::Tensor& up,
                                   const at::Tensor& dh, double beta1, double beta2) {
  constexpr const char* where = "kernels::situ_glu_backward";
  check_situ(where, gate, up, beta1, beta2);
  TORCH_CHECK(dh.defined() && dh.sizes() == gate.sizes(), where, ": dh must match gate ",
              gate.sizes());
  check_cuda(where, "dh", dh, gate.device());
  const c10::cuda::CUDAGuard guard(gate.device());
  const at::Tensor g = gate.contiguous(), u = up.contiguous();
  const at::Tensor d = dh.to(g.scalar_type()).contiguous();
  SituGluGradients out{at::empty(g.sizes(), g.options()), at::empty(g.sizes(), g.options())};
  check_launch(situ_glu_backward(moe_dtype(g.scalar_type()), g.data_ptr(), u.data_ptr(), d.data_ptr(),
                                 out.d_gate.data_ptr(), out.d_up.data_ptr(), g.numel(),
                                 static_cast<float>(beta1), static_cast<float>(beta2),
                                 current_stream(g)),
               where);
  return out;
}

void moe_zero_empty_groups(at::Tensor& stacked, const at::Tensor& counts) {
  constexpr const char* where = "kernels::moe_zero_empty_groups";
  TORCH_CHECK(stacked.defined() && stacked.dim() >= 1 && stacked.is_contiguous(), where,
              ": stacked must be a contiguous [E, ...] tensor");
  check_cuda(where, "stacked", stacked, stacked.device());
  check_cuda(where, "counts", counts, stacked.device());
  TORCH_CHECK(is_kernel_dtype(stacked.scalar_type()), where, ": stacked must be bf16 or fp32, got ",
              stacked.scalar_type());
  TORCH_CHECK(counts.dim() == 1 && counts.size(0) == stacked.size(0) &&
                  counts.scalar_type() == at::kLong,
              where, ": counts must be int64 [", stacked.size(0), "], got ", counts.scalar_type(),
              counts.sizes());
  const c10::cuda::CUDAGuard guard(stacked.device());
  const at::Tensor c = counts.contiguous();
  const int64_t groups = stacked.size(0);
  check_launch(moe_zero_empty_groups(moe_dtype(stacked.scalar_type()), stacked.data_ptr(),
                                     c.data_ptr<int64_t>(), groups,
                                     groups > 0 ? stacked.numel() / groups : 0,
                                     current_stream(stacked)),
               where);
}

}  // namespace odyssey::kernels
