#include "kernels/torch_bindings.h"

#include <vector>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>

#include "kernels/kda.h"

namespace odyssey::kernels {
namespace {

bool is_kernel_dtype(at::ScalarType t) { return t == at::kBFloat16 || t == at::kFloat; }

KdaDtype kernel_dtype(at::ScalarType t) {
  return t == at::kBFloat16 ? KdaDtype::kBFloat16 : KdaDtype::kFloat32;
}

void check_launch(cudaError_t error, const char* where) {
  TORCH_CHECK(error == cudaSuccess, where, ": CUDA error ", cudaGetErrorName(error), " (",
              cudaGetErrorString(error), ")");
}

void check_cuda(const char* where, const char* name, const at::Tensor& t,
                const at::Device& device) {
  TORCH_CHECK(t.is_cuda() && t.device() == device, where, ": ", name,
              " must be a CUDA tensor on ", device, ", got ", t.device());
}

}  // namespace

bool kda_chunked_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           const at::Tensor& g, const at::Tensor& beta,
                           const at::Tensor& initial_state, int64_t chunk) {
  if (chunk != 16 || !q.defined() || !q.is_cuda() || q.dim() != 4 || v.dim() != 4) return false;
  if (!is_kernel_dtype(q.scalar_type()) || k.scalar_type() != q.scalar_type() ||
      v.scalar_type() != q.scalar_type()) {
    return false;
  }
  const int64_t key = q.size(3), value = v.size(3);
  if ((key != 64 && key != 128) || (value != 64 && value != 128)) return false;
  for (const at::Tensor* t : {&k, &v, &g, &beta}) {
    if (!t->is_cuda() || t->device() != q.device()) return false;
  }
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
                             bool prefetch) {
  constexpr const char* where = "kernels::kda_chunked";
  TORCH_CHECK(q.dim() == 4, where, ": q must be [B, T, H, K], got ", q.sizes());
  const at::Device device = q.device();
  check_cuda(where, "q", q, device);
  check_cuda(where, "k", k, device);
  check_cuda(where, "v", v, device);
  check_cuda(where, "g", g, device);
  check_cuda(where, "beta", beta, device);
  TORCH_CHECK(is_kernel_dtype(q.scalar_type()), where, ": q must be bf16 or fp32, got ",
              q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), where,
              ": q, k, v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes(), where,
              ": k and g must match q ", q.sizes(), ", got ", k.sizes(), " and ", g.sizes());
  const int64_t batch = q.size(0), length = q.size(1), heads = q.size(2), key = q.size(3);
  TORCH_CHECK(v.dim() == 4 && v.size(0) == batch && v.size(1) == length && v.size(2) == heads,
              where, ": v must be [B, T, H, V] with B, T, H of q ", q.sizes(), ", got ",
              v.sizes());
  const int64_t value = v.size(3);
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == batch && beta.size(1) == length &&
                  beta.size(2) == heads,
              where, ": beta must be [B, T, H] of q ", q.sizes(), ", got ", beta.sizes());
  TORCH_CHECK((key == 64 || key == 128) && (value == 64 || value == 128), where,
              ": K and V must be 64 or 128, got K = ", key, ", V = ", value,
              " (use kda::chunked_reference)");

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
  at::Tensor state_in;
  if (initial_state.defined()) {
    TORCH_CHECK(initial_state.sizes() == at::IntArrayRef(state_shape), where,
                ": initial_state must be [N, H, K, V] = ", at::IntArrayRef(state_shape), ", got ",
                initial_state.sizes());
    check_cuda(where, "initial_state", initial_state, device);
    state_in = initial_state.to(at::kFloat).contiguous();
  }

  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor gc = g.to(at::kFloat).contiguous();
  const at::Tensor bc = beta.to(q.scalar_type()).contiguous();
  at::Tensor o = at::empty({batch, length, heads, value}, q.options());
  at::Tensor final_state = at::empty(state_shape, q.options().dtype(at::kFloat));
  TORCH_CHECK(segment_length <= 0 || segment_length % 16 == 0, where,
              ": segment_length must be a multiple of 16 (the chunk), got ", segment_length);
  KdaChunkedOptions options;
  options.segment_length = segment_length;
  options.prefetch = prefetch;
  // The context-parallel path's scratch (none for the serial walk), from the caching allocator.
  const size_t workspace_bytes = kda_chunked_forward_workspace_bytes(
      offsets.defined(), sequences, length, heads, key, value, options);
  at::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, q.options().dtype(at::kByte));
    options.workspace = workspace.data_ptr();
    options.workspace_bytes = workspace_bytes;
  }
  check_launch(
      kda_chunked_forward(kernel_dtype(q.scalar_type()), qc.data_ptr(), kc.data_ptr(),
                          vc.data_ptr(), gc.data_ptr<float>(), bc.data_ptr(),
                          state_in.defined() ? state_in.data_ptr<float>() : nullptr,
                          o.data_ptr(), final_state.data_ptr<float>(),
                          offsets.defined() ? offsets.data_ptr<int32_t>() : nullptr, sequences,
                          length, heads, key, value, static_cast<float>(scale), options,
                          at::cuda::getCurrentCUDAStream(device.index()).stream()),
      where);
  return {o, final_state};
}

KdaChunkedGradients kda_chunked_backward(const at::Tensor& q, const at::Tensor& k,
                                         const at::Tensor& v, const at::Tensor& g,
                                         const at::Tensor& beta, const at::Tensor& initial_state,
                                         const at::Tensor& d_o, const at::Tensor& d_final_state,
                                         double scale) {
  constexpr const char* where = "kernels::kda_chunked_backward";
  TORCH_CHECK(q.dim() == 4, where, ": q must be [B, T, H, K], got ", q.sizes());
  const at::Device device = q.device();
  check_cuda(where, "q", q, device);
  check_cuda(where, "k", k, device);
  check_cuda(where, "v", v, device);
  check_cuda(where, "g", g, device);
  check_cuda(where, "beta", beta, device);
  check_cuda(where, "d_o", d_o, device);
  TORCH_CHECK(is_kernel_dtype(q.scalar_type()), where, ": q must be bf16 or fp32, got ",
              q.scalar_type());
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), where,
              ": q, k, v must have one dtype, got ", q.scalar_type(), ", ", k.scalar_type(), ", ",
              v.scalar_type());
  TORCH_CHECK(k.sizes() == q.sizes() && g.sizes() == q.sizes(), where,
              ": k and g must match q ", q.sizes(), ", got ", k.sizes(), " and ", g.sizes());
  const int64_t batch = q.size(0), length = q.size(1), heads = q.size(2), key = q.size(3);
  TORCH_CHECK(v.dim() == 4 && v.size(0) == batch && v.size(1) == length && v.size(2) == heads,
              where, ": v must be [B, T, H, V] with B, T, H of q ", q.sizes(), ", got ",
              v.sizes());
  const int64_t value = v.size(3);
  TORCH_CHECK(d_o.sizes() == v.sizes(), where, ": d_o must match o = v's shape ", v.sizes(),
              ", got ", d_o.sizes());
  TORCH_CHECK(beta.dim() == 3 && beta.size(0) == batch && beta.size(1) == length &&
                  beta.size(2) == heads,
              where, ": beta must be [B, T, H] of q ", q.sizes(), ", got ", beta.sizes());
  TORCH_CHECK((key == 64 || key == 128) && (value == 64 || value == 128), where,
              ": K and V must be 64 or 128, got K = ", key, ", V = ", value,
              " (use kda::chunked_reference)");
  const std::vector<int64_t> state_shape = {batch, heads, key, value};
  at::Tensor state_in, d_state_out;
  if (initial_state.defined()) {
    TORCH_CHECK(initial_state.sizes() == at::IntArrayRef(state_shape), where,
                ": initial_state must be [B, H, K, V] = ", at::IntArrayRef(state_shape), ", got ",
                initial_state.sizes());
    check_cuda(where, "initial_state", initial_state, device);
    state_in = initial_state.to(at::kFloat).contiguous();
  }
  if (d_final_state.defined()) {
    TORCH_CHECK(d_final_state.sizes() == at::IntArrayRef(state_shape), where,
                ": d_final_state must be [B, H, K, V] = ", at::IntArrayRef(state_shape),
                ", got ", d_final_state.sizes());
    check_cuda(where, "d_final_state", d_final_state, device);
    d_state_out = d_final_state.to(at::kFloat).contiguous();
  }

  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor gc = g.to(at::kFloat).contiguous();
  const at::Tensor bc = beta.to(q.scalar_type()).contiguous();
  const at::Tensor doc = d_o.to(q.scalar_type()).contiguous();
  const auto f32 = q.options().dtype(at::kFloat);
  at::Tensor dq = at::empty(q.sizes(), f32), dk = at::empty(q.sizes(), f32);
  at::Tensor dg = at::empty(q.sizes(), f32), dv = at::empty(v.sizes(), f32);
  at::Tensor dbeta = at::empty(beta.sizes(), f32);
  at::Tensor d_initial = at::empty(state_shape, f32);
  const size_t workspace_bytes =
      kernels::kda_chunked_backward_workspace_bytes(batch, length, heads, key, value);
  at::Tensor workspace;
  if (workspace_bytes > 0) {
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)}, q.options().dtype(at::kByte));
  }
  check_launch(
      kernels::kda_chunked_backward(
          kernel_dtype(q.scalar_type()), qc.data_ptr(), kc.data_ptr(), vc.data_ptr(),
          gc.data_ptr<float>(), bc.data_ptr(),
          state_in.defined() ? state_in.data_ptr<float>() : nullptr, doc.data_ptr(),
          d_state_out.defined() ? d_state_out.data_ptr<float>() : nullptr, dq.data_ptr<float>(),
          dk.data_ptr<float>(), dv.data_ptr<float>(), dg.data_ptr<float>(),
          dbeta.data_ptr<float>(), d_initial.data_ptr<float>(), batch, length, heads, key, value,
          static_cast<float>(scale), workspace.defined() ? workspace.data_ptr() : nullptr,
          workspace_bytes, at::cuda::getCurrentCUDAStream(device.index()).stream()),
      where);
  KdaChunkedGradients out;
  out.dq = dq.to(q.scalar_type());
  out.dk = dk.to(k.scalar_type());
  out.dv = dv.to(v.scalar_type());
  out.dg = dg.to(g.scalar_type());
  out.dbeta = dbeta.to(beta.scalar_type());
  out.d_initial_state =
      initial_state.defined() ? d_initial.to(initial_state.scalar_type()) : d_initial;
  return out;
}

bool kda_step_supported(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor& g, const at::Tensor& beta, const at::Tensor& state) {
  if (!q.defined() || !q.is_cuda() || state.dim() != 4 || v.dim() != 3) return false;
  if (!is_kernel_dtype(q.scalar_type()) || k.scalar_type() != q.scalar_type() ||
      v.scalar_type() != q.scalar_type()) {
    return false;
  }
  if (state.scalar_type() != at::kFloat || !state.is_contiguous()) return false;
  for (const at::Tensor* t : {&k, &v, &g, &beta, &state}) {
    if (!t->is_cuda() || t->device() != q.device()) return false;
  }
  const int64_t key = state.size(2), value = state.size(3);
  return (key == 64 || key == 128) && value % 32 == 0 && value >= 32 && value <= 256 &&
         state.size(0) <= 65535 && state.size(1) <= 65535;
}

at::Tensor kda_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                    double scale) {
  constexpr const char* where = "kernels::kda_step";
  TORCH_CHECK(state.dim() == 4, where, ": state must be [B, H, K, V], got ", state.sizes());
  const at::Device device = state.device();
  check_cuda(where, "state", state, device);
  check_cuda(where, "q", q, device);
  check_cuda(where, "k", k, device);
  check_cuda(where, "v", v, device);
  check_cuda(where, "g", g, device);
  check_cuda(where, "beta", beta, device);
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
  TORCH_CHECK(is_kernel_dtype(q.scalar_type()) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(),
              where, ": q, k, v must be one dtype of bf16 / fp32, got ", q.scalar_type(), ", ",
              k.scalar_type(), ", ", v.scalar_type());
  TORCH_CHECK((key == 64 || key == 128) && value % 32 == 0 && value >= 32 && value <= 256, where,
              ": K must be 64 or 128 and V a multiple of 32 up to 256, got K = ", key,
              ", V = ", value, " (use kda::step_reference)");

  const c10::cuda::CUDAGuard guard(device);
  const at::Tensor qc = q.contiguous(), kc = k.contiguous(), vc = v.contiguous();
  const at::Tensor gc = g.to(at::kFloat).contiguous();
  const at::Tensor bc = beta.to(q.scalar_type()).contiguous();
  at::Tensor o = at::empty({batch, heads, value}, q.options());
  check_launch(kda_decode_step(kernel_dtype(q.scalar_type()), qc.data_ptr(), kc.data_ptr(),
                               vc.data_ptr(), gc.data_ptr<float>(), bc.data_ptr(),
                               state.data_ptr<float>(), o.data_ptr(), batch, heads, key, value,
                               static_cast<float>(scale),
                               at::cuda::getCurrentCUDAStream(device.index()).stream()),
               where);
  return o;
}

}  // namespace odyssey::kernels
