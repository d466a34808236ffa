// Device helpers of the QSScan prefill kernels (qsscan.cu, qsscan_chunked.cu): fast fp32
// arithmetic (approximate exponential, logarithm and reciprocal, the fast softplus and SiLU, the
// per-method step coefficients of the discretizations other than zoh) and cp.async copies.
#pragma once

#include "../ssm_common/ssm_common.cuh"

namespace quamba_ssm {

constexpr float kLog2e = 1.4426950408889634f;

// A 16-byte copy from global to shared memory that does not hold the thread (cp.async.cg).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(gmem));
}

// Byte ``byte`` of a word of four int8 codes, dequantized.
__device__ __forceinline__ float code_of(unsigned word, int byte, float scale) {
  return dequantize(static_cast<int8_t>(word >> (8 * byte)), scale);
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// SiLU of the output gate. It only scales y (a float output compared to 1e-3), so the fast
// exponential and division do; the conv, whose int8 output is compared code by code, uses the
// exact silu_rn.
__device__ __forceinline__ float silu_fast(float z) {
  return __fdividef(z, 1.f + exp2_approx(-kLog2e * z));
}

__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// PyTorch's softplus (x if x > 20 else log1p(exp(x))) without branches: e = exp(x) through
// ex2.approx; log1p(e) by its series e - e²/2 + e³/3 - e⁴/4 below e = 2^-6 (truncation < 2^-26
// relative), else as lg2.approx(1 + e) · ln 2 (absolute error ~2^-23, under 1e-5 relative there).
// Δ stays within about 1e-5 of the reference, for 12 instructions instead of log1pf's ~40.
__device__ __forceinline__ float softplus_fast(float x) {
  constexpr float kLn2 = 0.6931471805599453f;
  const float e = exp2_approx(kLog2e * x);
  const float series = e * fmaf(e, fmaf(e, fmaf(e, -0.25f, 1.f / 3.f), -0.5f), 1.f);
  const float logarithm = log2_approx(1.f + e) * kLn2;
  const float log1p_e = e < 0.015625f ? series : logarithm;
  return x > 20.f ? x : log1p_e;
}

__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// near_zero's value where |z| < kPhi2SeriesBelow, else far's, by one selp: the asm takes both
// operands computed, so the compiler cannot turn the choice into a divergent branch around the
// series (it did, per element, with a plain ?:).
__device__ __forceinline__ float select_near_zero(float z, float near_zero, float far) {
  float chosen;
  asm("{\n\t.reg .pred p;\n\t.reg .f32 m;\n\t"
      "abs.f32 m, %1;\n\t"
      "setp.lt.f32 p, m, %4;\n\t"
      "selp.f32 %0, %2, %3, p;\n\t}"
      : "=f"(chosen)
      : "f"(z), "f"(near_zero), "f"(far), "f"(kPhi2SeriesBelow));
  return chosen;
}

// Both of φ1 and φ2 chosen as select_near_zero does, on one predicate.
__device__ __forceinline__ void select_near_zero(float z, float& phi1, float& phi2,
                                                 float phi1_near, float phi2_near,
                                                 float phi1_far, float phi2_far) {
  asm("{\n\t.reg .pred p;\n\t.reg .f32 m;\n\t"
      "abs.f32 m, %2;\n\t"
      "setp.lt.f32 p, m, %7;\n\t"
      "selp.f32 %0, %3, %5, p;\n\t"
      "selp.f32 %1, %4, %6, p;\n\t}"
      : "=f"(phi1), "=f"(phi2)
      : "f"(z), "f"(phi1_near), "f"(phi2_near), "f"(phi1_far), "f"(phi2_far),
        "f"(kPhi2SeriesBelow));
}

constexpr bool is_exponential(Discretization method) {
  return method == Discretization::kZohExact || method == Discretization::kFoh;
}

// The prefill's coefficients of kMethod (not zoh) for step Δ and A's value a, as Ā and the drive
// gains over Δ (B̄ / Δ, so that the Δ u products zoh forms serve the other methods too), for
// speed: exp through ex2.approx (as zoh's decay), divisions through rcp.approx, fused Horner
// steps, φ1 = 1 + z φ2 from φ2's series where the reference sums that series (|z| < 0.5;
// (exp(z) - 1) / z would cancel there), rk4's R(z) as 1 + z S(z) and bilinear's Ā as
// 2 / (1 - z/2) - 1. Each value is within a few fp32 ulps of exact_coefficients' (over Δ).
template <Discretization kMethod>
__device__ __forceinline__ StepCoefficients fast_coefficients(float delta, float a) {
  const float z = delta * a;
  if constexpr (kMethod == Discretization::kBilinear) {
    const float inverse = rcp_approx(fmaf(z, -0.5f, 1.f));
    return {fmaf(2.f, inverse, -1.f), inverse, 0.f};
  } else if constexpr (kMethod == Discretization::kRk4) {
    const float gain = rk4_gain<false>(z);
    return {fmaf(z, gain, 1.f), gain, 0.f};
  } else {
    const float decay = exp2_approx(z * kLog2e);
    const float expm1 = decay - 1.f, inverse = rcp_approx(z);
    const float series = phi2_series<false>(z);  // φ2 near 0
    const float phi1_near = fmaf(z, series, 1.f), phi1_far = expm1 * inverse;
    if constexpr (kMethod == Discretization::kZohExact) {
      return {decay, select_near_zero(z, phi1_near, phi1_far), 0.f};
    } else {
      float phi1, phi2;
      select_near_zero(z, phi1, phi2, phi1_near, series, phi1_far,
                       (expm1 - z) * inverse * inverse);
      return {decay, phi2, phi1 - phi2};
    }
  }
}

}  // namespace quamba_ssm
