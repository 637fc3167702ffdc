// SiTU-GLU's elementwise math (model/ffn.h, MODEL.md), fp32, shared by the MoE kernels that
// apply it: the standalone passes (moe.cu) and the fused routed experts (moe_experts.cu), so that
// every kernel computes h, dg and du with the same operations. Internal (anonymous namespace).
#pragma once

namespace odyssey::kernels {
namespace {

// The caps and their reciprocals (a product instead of a division an element).
struct SituCaps {
  float beta1, beta2, inv_beta1, inv_beta2;
};

// tanh(x) and its slope 1 - tanh(x)^2 from one exponential e = e^{-2|x|} (ex2.approx): tanh =
// sign(x) (1 - e) / (1 + e), 1 - tanh^2 = 4 e / (1 + e)^2. The slope has no cancellation where a
// cap saturates (1 - tanhf(x)^2 is all rounding error there) and reaches exactly 0 with e; below
// |x| = 1/16, where 1 - e would lose bits, tanh is its odd series to x^5 (relative error below
// 4e-9). Each within a few fp32 ulps of tanhf and 1 - tanhf^2 where those are accurate.
__device__ __forceinline__ void tanh_and_slope(float x, float& t, float& slope) {
  const float ax = fabsf(x);
  const float e = __expf(-2.f * ax);
  const float r = __fdividef(1.f, 1.f + e);
  slope = 4.f * e * r * r;
  const float x2 = x * x;
  const float series = ax * fmaf(x2, fmaf(x2, 2.f / 15.f, -1.f / 3.f), 1.f);
  t = copysignf(ax < 0.0625f ? series : (1.f - e) * r, x);
}

// The terms of one element, fp32: the caps' tanh and slopes, the capped gate and up, sigma(g) and
// its slope sigma(g) (1 - sigma(g)) = e / (1 + e)^2 with e = e^{-|g|} (no cancellation either).
// Three exponentials and three approximate reciprocals an element: with tanhf, tanhf, expf and
// three IEEE divisions (~100 instructions an element) the backward's 16-byte pass was bound by
// its arithmetic as much as by its memory.
struct SituTerms {
  float t1, t2, c1, c2, sg;
  float dt1, dt2, sg_slope;  // 1 - t1^2, 1 - t2^2, sigma(g) (1 - sigma(g))
};

__device__ __forceinline__ SituTerms situ_terms(float g, float u, const SituCaps& caps) {
  SituTerms s;
  tanh_and_slope(g * caps.inv_beta1, s.t1, s.dt1);
  tanh_and_slope(u * caps.inv_beta2, s.t2, s.dt2);
  s.c1 = caps.beta1 * s.t1;
  s.c2 = caps.beta2 * s.t2;
  const float e = __expf(-fabsf(g));
  const float r = __fdividef(1.f, 1.f + e);
  s.sg = g >= 0.f ? r : e * r;
  s.sg_slope = e * r * r;
  return s;
}

// h = [beta1 tanh(g / beta1) sigma(g)] [beta2 tanh(u / beta2)]. The fp32 forward and the backward's
// recomputation of an fp32 h both take it from here, so they agree bit for bit.
__device__ __forceinline__ float situ_h(const SituTerms& s) { return s.c1 * s.sg * s.c2; }

// The gradients' sums of products are written as the fmaf they are, so that no kernel's compiler
// contracts them its own way: the same terms give the same bits in every kernel that inlines
// these (the 16-byte and the element-by-element passes differed in dg's last bit before).
// dh -> dg = dh c2 ((1 - tanh^2(g / beta1)) sigma(g) + c1 sigma(g) (1 - sigma(g))).
__device__ __forceinline__ float situ_d_gate(const SituTerms& s, float dh) {
  return dh * s.c2 * fmaf(s.dt1, s.sg, s.c1 * s.sg_slope);
}
// dh -> du = dh c1 sigma(g) (1 - tanh^2(u / beta2)).
__device__ __forceinline__ float situ_d_up(const SituTerms& s, float dh) { return dh * s.c1 * s.sg * s.dt2; }

// The forward on the special-function unit, for every bf16 h of the MoE kernels (the fused
// experts' epilogue, moe_experts.cu and moe_experts_sm90.cu; the standalone forward and the h the
// backward recomputes for dW_down, moe.cu: the h a fused forward multiplied by W_down is the one
// the backward recomputes, bit for bit), where h is rounded to bf16 right after: tanh.approx.f32 (relative error below 2^-11, against
// bf16's half ulp of 2^-9) for both caps and for sigma(g) = (1 + tanh(g / 2)) / 2, and products
// with the caps' reciprocals instead of divisions: 3 MUFU operations and 7 FMA / FMUL an element,
// which a CTA of 8 warps hides behind its tensor-core work. Not bit for bit situ_h: h differs from
// it in the last bf16 bit for some elements. The gradients keep situ_terms: 1 - tanh^2 and
// 1 - sigma from tanh.approx would cancel where the caps saturate (its absolute error ~2^-11 near
// 1 would be all of them there); situ_terms computes the slopes without a subtraction.
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
