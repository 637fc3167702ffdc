// The precision fp32 training may trade for speed, process-wide: PyTorch's
// torch.set_float32_matmul_precision, extended to the KDA core.
//
//   highest  every fp32 matmul in fp32 (cuBLAS without TF32); the KDA kernels take fp32 q, k, v,
//            beta (their tensor-core products still round operands to bf16: kernels/kda.h);
//            blockwise_attention (MLA) runs LibTorch's memory-efficient kernel on the fp32 operands,
//            whose products are 3xTF32 (a TF32 value plus a TF32 remainder an operand, three
//            products): within ~1e-6 of fp32, what PyTorch's scaled_dot_product_attention gives fp32
//            at every precision (model/attention.h)
//   high     cuBLAS may use TF32 for fp32 matmuls (10-bit mantissas, fp32 accumulation): the
//            layers' projections on tensor cores
//   medium   high, and the layers' CUDA kernels that are fast in bf16 only run on bf16 copies of
//            their fp32 operands, the casts recorded for autograd (so the gradients reach the fp32
//            parameters and inputs, each rounded to bf16 once on its way):
//            - kda::chunked: q, k, v and beta (o and the state come back in fp32): the kernels'
//              bf16 paths (the whole-head walk, the backward's pass 3 by 32-token blocks);
//            - the MoE layer's routed experts: their rows and the three expert weights (the fused
//              wgmma kernels), the weights' copies kept until the weights change (Bf16Shadow,
//              below); the weights' gradients come back as the weight-gradient kernel's fp32
//              sums, not rounded to bf16 (kernels::MoeExpertWeightCopies). The router stays fp32;
//            - blockwise_attention (MLA): q, k, v where LibTorch's fused attention applies to
//              them in bf16 (model/attention.h: self-attention, decode rows and chunks continuing
//              a cache); the output back in fp32.
//
// The learner sets it from learner.float32_matmul_precision when it starts (default highest).
// It acts on CUDA only: CPU matmuls and the reference paths are unchanged at every setting.
// Thread-safety: set it before the threads that compute start; reading is safe from any thread
// (autograd's backward threads included).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>

#include <ATen/core/Tensor.h>

#include "core/status.h"

namespace odyssey::model {

enum class Float32MatmulPrecision { kHighest, kHigh, kMedium };

// "highest", "high" or "medium"; anything else is kInvalidArgument naming the accepted values.
Result<Float32MatmulPrecision> parse_float32_matmul_precision(const std::string& name);
const char* float32_matmul_precision_name(Float32MatmulPrecision precision);

// Sets the process-wide precision, cuBLAS's TF32 switch with it (at::globalContext()).
void set_float32_matmul_precision(Float32MatmulPrecision precision);
// The same by name (what the learner reads from learner.float32_matmul_precision); an unknown
// name is kInvalidArgument prefixed with `key` and changes nothing.
Status set_float32_matmul_precision(const std::string& name, const std::string& key);
Float32MatmulPrecision float32_matmul_precision();

// Sets a precision within a scope and restores the previous one on exit (tests, benchmarks).
class Float32MatmulPrecisionScope {
 public:
  explicit Float32MatmulPrecisionScope(Float32MatmulPrecision precision);
  ~Float32MatmulPrecisionScope();
  Float32MatmulPrecisionScope(const Float32MatmulPrecisionScope&) = delete;
  Float32MatmulPrecisionScope& operator=(const Float32MatmulPrecisionScope&) = delete;

 private:
  Float32MatmulPrecision previous_;
};

// A bf16 copy of an fp32 tensor (a parameter), kept across calls while the tensor is unchanged:
// the same TensorImpl, storage and version counter. Any in-place write through LibTorch (an
// optimizer step, copy_, a checkpoint load) bumps the version and the next get() casts again.
// For the medium precision's casts of parameters that several forwards of one learner step read:
// the MoE layer's expert weights are cast once a step instead of once a forward and once a
// recomputation (their bf16 copies stay resident: 2 bytes a parameter).
//
// get(source): the bf16 copy. With grad mode on and `source` requiring grad, it is recorded as
// source.to(kBFloat16) is: the gradient reaches `source` in its dtype, the same values. A copy
// (a cloned module) starts empty. Thread-safety: get() and clear() may be called from any thread.
class Bf16Shadow {
 public:
  Bf16Shadow() = default;
  Bf16Shadow(const Bf16Shadow&) {}
  Bf16Shadow& operator=(const Bf16Shadow&);
  at::Tensor get(const at::Tensor& source);
  // The same copy, never recorded for autograd: for a Function that reads the copy and sends the
  // gradient to `source` itself (kernels::moe_experts_autograd's weight copies).
  at::Tensor value(const at::Tensor& source);
  void clear();  // drops the copy (its memory)
  int64_t casts() const;  // how many times get() has cast (tests, benchmarks)

 private:
  mutable std::mutex mu_;
  at::Tensor copy_;
  const void* impl_ = nullptr;
  const void* data_ = nullptr;
  int64_t version_ = -1;
  int64_t casts_ = 0;
};

}  // namespace odyssey::model
