// SiTU-GLU's elementwise math (model/ffn.h, MODEL.md), fp32, shared by the MoE kernels that
// apply it: the standalone passes (moe.cu) and the fused routed experts (moe_experts.cu), so that
// every kernel computes h, dg and du with the same operations. Internal (anonymous namespace).
#pragma once

namespace odyssey::kernels {
namespace {

__device__ __forceinline__ float sigmoid_f32(float x) { return 1.f / (1.f + expf(-x)); }

// The terms of one element, fp32: the caps' tanh, the capped gate and up, sigma(g).
struct SituTerms {
  float t1, t2, c1, c2, sg;
};

__device__ __forceinline__ SituTerms situ_terms(float g, float u, float beta1, float beta2) {
  SituTerms s;
  s.t1 = tanhf(g / beta1);
  s.t2 = tanhf(u / beta2);
  s.c1 = beta1 * s.t1;
  s.c2 = beta2 * s.t2;
  s.sg = sigmoid_f32(g);
  return s;
}

// h = [beta1 tanh(g / beta1) sigma(g)] [beta2 tanh(u / beta2)]. The forward and the backward's
// recomputation of h both take it from here, so they agree bit for bit.
__device__ __forceinline__ float situ_h(const SituTerms& s) { return s.c1 * s.sg * s.c2; }

// The gradients' sums of products are written as the fmaf they are, so that no kernel's compiler
// contracts them its own way: the same terms give the same bits in every kernel that inlines
// these (the 16-byte and the element-by-element passes differed in dg's last bit before).
// dh -> dg = dh c2 ((1 - tanh^2(g / beta1)) sigma(g) + c1 sigma(g) (1 - sigma(g))).
__device__ __forceinline__ float situ_d_gate(const SituTerms& s, float dh) {
  const float dc1 = fmaf(-s.t1, s.t1, 1.f);  // d(beta1 tanh(g / beta1)) / dg
  const float sigma_term = s.c1 * s.sg * (1.f - s.sg);
  return dh * s.c2 * fmaf(dc1, s.sg, sigma_term);
}
// dh -> du = dh c1 sigma(g) (1 - tanh^2(u / beta2)).
__device__ __forceinline__ float situ_d_up(const SituTerms& s, float dh) {
  const float dc2 = fmaf(-s.t2, s.t2, 1.f);
  return dh * s.c1 * s.sg * dc2;
}

// The forward on the special-function unit, for every bf16 h of the MoE kernels (the fused
// experts' epilogue, moe_experts.cu and moe_experts_sm90.cu; the standalone forward and the h the
// backward recomputes for dW_down, moe.cu: the h a fused forward multiplied by W_down is the one
// the backward recomputes, bit for bit), where h is rounded to bf16 right after: tanh.approx.f32 (relative error below 2^-11, against
// bf16's half ulp of 2^-9) for both caps and for sigma(g) = (1 + tanh(g / 2)) / 2, and products
// with the caps' reciprocals instead of divisions: 3 MUFU operations and 7 FMA / FMUL an element
// instead of ~80 instructions (the accurate tanhf, expf and IEEE divisions above), which a CTA of
// 8 warps could not hide behind its tensor-core work. Not bit for bit situ_h: h differs from it
// in the last bf16 bit for some elements. The gradients keep the accurate terms: 1 - tanh^2 and
// 1 - sigma cancel where the caps saturate, and tanh.approx's error (absolute ~2^-11 near 1) would
// be all of them there.
struct SituCaps {
  float beta1, beta2, inv_beta1, inv_beta2;
};
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float situ_h_fast(float g, float u, const SituCaps& c) {
  const float sg = fmaf(0.5f, tanh_approx(0.5f * g), 0.5f);
  return c.beta1 * tanh_approx(g * c.inv_beta1) * sg * (c.beta2 * tanh_approx(u * c.inv_beta2));
}

}  // namespace
}  // namespace odyssey::kernels
