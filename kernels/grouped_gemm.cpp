#include "kernels/grouped_gemm.h"

#include <climits>
#include <cstring>
#include <type_traits>

#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <cublas_v2.h>

#include "kernels/grouped_sgemm.h"
#include "kernels/torch_bindings.h"

// cublasGemmGroupedBatchedEx exists from cuBLAS 12.5 on.
#if defined(CUBLAS_VERSION) && CUBLAS_VERSION >= 120500
#define ODYSSEY_HAVE_CUBLAS_GROUPED 1
#else
#define ODYSSEY_HAVE_CUBLAS_GROUPED 0
#endif

namespace odyssey::kernels {
namespace {

// Values on `device` (int32 or int64), through a pinned buffer copied asynchronously on the current
// stream (LibTorch's pinned allocator keeps the buffer until the copy has run).
template <typename T>
at::Tensor to_device_async(const std::vector<T>& values, const at::Device& device) {
  static_assert(std::is_same_v<T, int32_t> || std::is_same_v<T, int64_t>);
  const at::ScalarType dtype = std::is_same_v<T, int32_t> ? at::kInt : at::kLong;
  at::Tensor host = at::empty({static_cast<int64_t>(values.size())}, at::TensorOptions().dtype(dtype).pinned_memory(true));
  if (!values.empty()) std::memcpy(host.data_ptr<T>(), values.data(), values.size() * sizeof(T));
  return host.to(at::TensorOptions().device(device), /*non_blocking=*/true);
}

#if ODYSSEY_HAVE_CUBLAS_GROUPED
// One problem of a grouped call, in cuBLAS's column-major terms: C [m, n] = op(A) op(B).
struct Problem {
  cublasOperation_t transa, transb;
  int m, n, k, lda, ldb, ldc;
  const void* a;
  const void* b;
  void* c;
};

int as_int(int64_t v, const char* what, const char* where) {
  TORCH_CHECK(v >= 0 && v <= INT_MAX, where, ": ", what, " (", v, ") does not fit cuBLAS's 32-bit sizes");
  return static_cast<int>(v);
}

// One problem for each non-empty block: make(e, first row, rows).
template <typename Make>
std::vector<Problem> per_block(const std::vector<int64_t>& counts, Make make) {
  std::vector<Problem> problems;
  int64_t start = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    if (counts[e] == 0) continue;
    problems.push_back(make(static_cast<int64_t>(e), start, counts[e]));
    start += counts[e];
  }
  return problems;
}

// One grouped launch on the current stream: a group of one problem each (shapes differ by expert).
void run_grouped(const std::vector<Problem>& problems, at::ScalarType dtype, const at::Device& device,
                 const char* where) {
  if (problems.empty()) return;
  const size_t n = problems.size();
  std::vector<cublasOperation_t> transa(n), transb(n);
  std::vector<int> m(n), nn(n), k(n), lda(n), ldb(n), ldc(n), group_size(n, 1);
  std::vector<float> alpha(n, 1.0f), beta(n, 0.0f);
  // The pointer arrays live on the device: 3n pointers, copied on the stream.
  std::vector<int64_t> pointers(3 * n);
  for (size_t i = 0; i < n; ++i) {
    const Problem& p = problems[i];
    transa[i] = p.transa, transb[i] = p.transb;
    m[i] = p.m, nn[i] = p.n, k[i] = p.k, lda[i] = p.lda, ldb[i] = p.ldb, ldc[i] = p.ldc;
    pointers[i] = reinterpret_cast<int64_t>(p.a);
    pointers[n + i] = reinterpret_cast<int64_t>(p.b);
    pointers[2 * n + i] = reinterpret_cast<int64_t>(p.c);
  }
  const at::Tensor on_device = to_device_async(pointers, device);
  const auto* base = reinterpret_cast<void* const*>(on_device.data_ptr<int64_t>());
  const cudaDataType_t type = dtype == at::kBFloat16 ? CUDA_R_16BF : CUDA_R_32F;
  // fp32 in fp32 at every float32 matmul precision. With CUBLAS_COMPUTE_32F_FAST_TF32 where `high`
  // allows TF32, the small model's learner step at `high` took 0.75 s on an H200 against 0.34 s at
  // `highest` (the loop of at::mm had `high` the faster, 3.40 against 3.82 s): the grouped GEMM's
  // TF32 form is the one thing that differs beyond the projections' TF32, which only gain.
  const cublasComputeType_t compute = CUBLAS_COMPUTE_32F;
  cublasHandle_t handle = at::cuda::getCurrentCUDABlasHandle();
  const cublasStatus_t status = cublasGemmGroupedBatchedEx(
      handle, transa.data(), transb.data(), m.data(), nn.data(), k.data(), alpha.data(),
      reinterpret_cast<const void* const*>(base), type, lda.data(), reinterpret_cast<const void* const*>(base + n), type,
      ldb.data(), beta.data(), base + 2 * n, type, ldc.data(), static_cast<int>(n), group_size.data(), compute);
  TORCH_CHECK(status == CUBLAS_STATUS_SUCCESS, where, ": cublasGemmGroupedBatchedEx failed: ",
              cublasGetStatusString(status), " (", n, " problems, ", dtype, ")");
}
#endif

// Whether the call takes our CUDA-core kernels (kSimt8x8, kSimt4x4) or cuBLAS (kCublas), after checking the
// operands for that backend.
bool check_operands(const at::Tensor& a, const at::Tensor& b, const std::vector<int64_t>& counts,
                    GroupedGemmBackend backend, const char* where) {
  const bool fp32 = a.defined() && b.defined() && a.scalar_type() == at::kFloat && b.scalar_type() == at::kFloat;
  const bool simt_asked = backend == GroupedGemmBackend::kSimt8x8 || backend == GroupedGemmBackend::kSimt4x4;
  TORCH_CHECK(!simt_asked || fp32, where, ": the CUDA-core grouped GEMMs (kSimt8x8, kSimt4x4) take fp32 operands only; got ",
              a.defined() ? c10::str(a.scalar_type()) : std::string("none"), " and ",
              b.defined() ? c10::str(b.scalar_type()) : std::string("none"));
  const bool simt = simt_asked || (backend == GroupedGemmBackend::kAuto && fp32);
  if (simt) {
    TORCH_CHECK(a.is_cuda() && b.device() == a.device(), where, ": needs CUDA tensors of one device; got ",
                a.device(), " and ", b.device());
  } else {
    TORCH_CHECK(cublas_grouped_gemm_applies(a, b), where,
                ": needs CUDA tensors of one device and one dtype (fp32 or bf16) and cuBLAS >= 12.5 (compiled in: ",
                cublas_grouped_gemm_compiled(), "); got ", a.device(), " ", a.scalar_type(), " and ", b.device(), " ",
                b.scalar_type());
  }
  TORCH_CHECK(a.dim() == 2, where, ": the rows must be [R, K], got ", a.sizes());
  int64_t total = 0;
  for (size_t e = 0; e < counts.size(); ++e) {
    TORCH_CHECK(counts[e] >= 0, where, ": block ", e, " has a negative count (", counts[e], ")");
    total += counts[e];
  }
  TORCH_CHECK(total == a.size(0), where, ": the counts sum to ", total, ", the rows are ", a.size(0));
  if (simt) {
    TORCH_CHECK(total <= INT_MAX && static_cast<int64_t>(counts.size()) < INT_MAX, where, ": ", total, " rows of ",
                counts.size(), " experts do not fit the CUDA-core kernels' 32-bit row indices");
  }
  return simt;
}

GroupedSgemmThreads simt_threads(GroupedGemmBackend backend) {
  return backend == GroupedGemmBackend::kSimt4x4 ? GroupedSgemmThreads::k256Of4x4 : GroupedSgemmThreads::k64Of8x8;
}

}  // namespace

bool cublas_grouped_gemm_compiled() { return ODYSSEY_HAVE_CUBLAS_GROUPED != 0; }

bool cublas_grouped_gemm_applies(const at::Tensor& a, const at::Tensor& b) {
  if (!cublas_grouped_gemm_compiled()) return false;
  if (!a.defined() || !b.defined() || !a.is_cuda() || b.device() != a.device()) return false;
  if (a.scalar_type() != b.scalar_type()) return false;
  return a.scalar_type() == at::kFloat || a.scalar_type() == at::kBFloat16;
}

at::Tensor grouped_rows_times(const at::Tensor& x_in, const at::Tensor& w_in, const std::vector<int64_t>& counts,
                              GroupedGemmBackend backend) {
  constexpr const char* where = "kernels::grouped_rows_times";
  const bool simt = check_operands(x_in, w_in, counts, backend, where);
  TORCH_CHECK(w_in.dim() == 3 && w_in.size(0) == static_cast<int64_t>(counts.size()) && w_in.size(1) == x_in.size(1),
              where, ": w must be [E = ", counts.size(), ", K = ", x_in.size(1), ", N], got ", w_in.sizes());
  const c10::cuda::CUDAGuard guard(x_in.device());
  const at::Tensor x = x_in.contiguous();
  const int64_t K = x.size(1), N = w_in.size(2);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  // w[e] is row-major [K, N] (unit stride along N) or its transpose's view (unit stride along K);
  // anything else is made contiguous.
  at::Tensor w = w_in;
  const bool rows_n = w.stride(2) == 1 && w.stride(1) >= N;
  const bool rows_k = !rows_n && w.stride(1) == 1 && w.stride(2) >= K;
  if (!rows_n && !rows_k) w = w.contiguous();
  if (simt) {
    // Tiles of at most 64 rows of one expert's block: (expert, first row, rows) triples.
    std::vector<int32_t> tiles;
    int64_t start = 0;
    for (size_t e = 0; e < counts.size(); ++e) {
      for (int64_t r = 0; r < counts[e]; r += 64) {
        tiles.push_back(static_cast<int32_t>(e));
        tiles.push_back(static_cast<int32_t>(start + r));
        tiles.push_back(static_cast<int32_t>(std::min<int64_t>(64, counts[e] - r)));
      }
      start += counts[e];
    }
    const at::Tensor on_device = to_device_async(tiles, x.device());
    check_launch(grouped_sgemm_rows_times(x.data_ptr<float>(), w.data_ptr<float>(), w.stride(0), w.stride(1),
                                          w.stride(2), reinterpret_cast<const GroupedSgemmRowTile*>(on_device.data_ptr<int32_t>()),
                                          static_cast<int64_t>(tiles.size() / 3), out.data_ptr<float>(), K, N,
                                          at::cuda::getCurrentCUDAStream(x.device().index()).stream(),
                                          simt_threads(backend)),
                 where);
    return out;
  }
#if ODYSSEY_HAVE_CUBLAS_GROUPED
  // Row-major out_e [m_e, N] = x_e [m_e, K] w_e [K, N] is column-major out_e^T = w_e^T x_e^T.
  const int64_t esize = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* wp = static_cast<const char*>(w.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const std::vector<Problem> problems = per_block(counts, [&](int64_t e, int64_t start, int64_t rows) {
    Problem p;
    p.transa = rows_k ? CUBLAS_OP_T : CUBLAS_OP_N;
    p.transb = CUBLAS_OP_N;
    p.m = as_int(N, "N", where), p.n = as_int(rows, "an expert's rows", where), p.k = as_int(K, "K", where);
    p.lda = as_int(rows_k ? w.stride(2) : w.stride(1), "w's row stride", where);
    p.ldb = as_int(K, "K", where);
    p.ldc = p.m;
    p.a = wp + e * w.stride(0) * esize;
    p.b = xp + start * K * esize;
    p.c = op + start * N * esize;
    return p;
  });
  run_grouped(problems, x.scalar_type(), x.device(), where);
#endif
  return out;
}

at::Tensor grouped_weight_grad(const at::Tensor& a_in, const at::Tensor& b_in, const std::vector<int64_t>& counts,
                               GroupedGemmBackend backend) {
  constexpr const char* where = "kernels::grouped_weight_grad";
  const bool simt = check_operands(a_in, b_in, counts, backend, where);
  TORCH_CHECK(b_in.dim() == 2 && b_in.size(0) == a_in.size(0), where, ": b must be [R = ", a_in.size(0),
              ", N], got ", b_in.sizes());
  const c10::cuda::CUDAGuard guard(a_in.device());
  const at::Tensor a = a_in.contiguous(), b = b_in.contiguous();
  const int64_t M = a.size(1), N = b.size(1), experts = static_cast<int64_t>(counts.size());
  if (simt && M > 0 && N > 0) {
    // Each expert's rows [starts[e], starts[e + 1]); the kernel writes every output, zeros for
    // experts without rows.
    std::vector<int32_t> starts(counts.size() + 1, 0);
    for (size_t e = 0; e < counts.size(); ++e) starts[e + 1] = static_cast<int32_t>(starts[e] + counts[e]);
    at::Tensor out = at::empty({experts, M, N}, a.options());
    const at::Tensor on_device = to_device_async(starts, a.device());
    check_launch(grouped_sgemm_weight_grad(a.data_ptr<float>(), b.data_ptr<float>(), on_device.data_ptr<int32_t>(),
                                           experts, out.data_ptr<float>(), M, N,
                                           at::cuda::getCurrentCUDAStream(a.device().index()).stream(),
                                           simt_threads(backend)),
                 where);
    return out;
  }
  at::Tensor out = at::zeros({experts, M, N}, a.options());
  if (M == 0 || N == 0) return out;
#if ODYSSEY_HAVE_CUBLAS_GROUPED
  // Row-major out_e [M, N] = a_e^T b_e is column-major out_e^T [N, M] = b_e^T a_e, where b_e's
  // memory is column-major [N, m_e] and a_e's [M, m_e], taken transposed.
  const int64_t esize = a.element_size();
  const char* ap = static_cast<const char*>(a.data_ptr());
  const char* bp = static_cast<const char*>(b.data_ptr());
  char* op = static_cast<char*>(out.data_ptr());
  const std::vector<Problem> problems = per_block(counts, [&](int64_t e, int64_t start, int64_t rows) {
    Problem p;
    p.transa = CUBLAS_OP_N;
    p.transb = CUBLAS_OP_T;
    p.m = as_int(N, "N", where), p.n = as_int(M, "M", where), p.k = as_int(rows, "an expert's rows", where);
    p.lda = p.m;
    p.ldb = p.n;
    p.ldc = p.m;
    p.a = bp + start * N * esize;
    p.b = ap + start * M * esize;
    p.c = op + e * M * N * esize;
    return p;
  });
  run_grouped(problems, a.scalar_type(), a.device(), where);
#endif
  return out;
}

}  // namespace odyssey::kernels
