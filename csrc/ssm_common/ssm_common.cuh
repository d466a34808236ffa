// Helpers shared by the SSM-side kernels (conv1d, qsscan, norm): the int8 rounding rule of
// quamba/ops/quant.py, float loads of any input dtype, and the host-side input checks.
#pragma once

#include <ATen/ATen.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdio>
#include <cstring>
#include <string>
#include <type_traits>

#include "../float_convert.cuh"
#include "../kernel_image.h"

namespace quamba_ssm {

constexpr float kInt8Max = 127.f;

// The widest memory access (16, 8, 4, 2 or 1 bytes) that divides kBytes: the unit in which a row
// of kBytes bytes, aligned to it, is loaded or stored whole.
template <int kBytes>
using WideChunk = std::conditional_t<
    kBytes % 16 == 0, uint4,
    std::conditional_t<kBytes % 8 == 0, uint2,
                       std::conditional_t<kBytes % 4 == 0, uint32_t,
                                          std::conditional_t<kBytes % 2 == 0, uint16_t, uint8_t>>>>;

// quantize(): clamp(rne(x · inv), -127, 127) with the multiply rounded on its own (no FMA
// contraction into a neighbouring add), exactly as quamba.ops.quant.quantize. Clamping before
// rounding gives the same codes (the bounds are integers). The rounding is an fp32 add of
// 1.5 · 2^23, which leaves no fraction bits, so the sum is rounded half to even and its low byte is
// the code in two's complement: one full-rate add where rintf and a conversion to int are two
// quarter-rate instructions (the decode step quantizes 16 states a thread with it).
__device__ __forceinline__ int8_t quantize_rn(float x, float inv_scale) {
  const float clamped = fminf(fmaxf(__fmul_rn(x, inv_scale), -kInt8Max), kInt8Max);
  return static_cast<int8_t>(__float_as_int(__fadd_rn(clamped, 12582912.f)));
}

// Sum over a block of whole warps (up to 1024 threads); every thread gets the total. Consecutive
// calls may share the shared memory: each thread reads the total before the next call's barrier.
__device__ __forceinline__ float block_sum(float v) {
  __shared__ float warp_sums[32];
  __shared__ float total;
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0.f;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
    if (lane == 0) total = v;
  }
  __syncthreads();
  return total;
}

// SiLU as every quamba backend computes it: y / (1 + exp(-y)), each operation rounded.
__device__ __forceinline__ float silu_rn(float y) {
  return __fdiv_rn(y, __fadd_rn(1.f, expf(-y)));
}

// silu_rn(y) = y / (1 + expf(-y)), with the division as div.rn's own fast path (reciprocal, one
// Newton step, one residual correction: the correctly rounded quotient for operands in the normal
// range) without the range check (FCHK) that sends other operands to a slow path. The divisor
// is in [1, inf]; the only operands outside that range are a divisor of 2^126 or more (y below
// about -87, where the reciprocal flushes to zero) or a subnormal y: there the exact quotient
// has magnitude below 1e-36, and it and the zero (or subnormal) this returns both quantize to
// code 0. Clamping the divisor to FLT_MAX keeps inf · 0 out of the Newton step. So the int8
// codes equal the reference's (checked on ~630 M codes, benchmarks/notes_ssm_perf.md).
__device__ __forceinline__ float silu_codes(float y) {
  const float d = fminf(__fadd_rn(1.f, expf(-y)), 3.40282347e38f);
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(d));
  r = fmaf(r, fmaf(-d, r, 1.f), r);
  const float q = __fmul_rn(y, r);
  return fmaf(fmaf(-d, q, y), r, q);
}

// PyTorch's softplus (beta 1, threshold 20): x if x > 20 else log1p(exp(x)).
__device__ __forceinline__ float softplus(float x) {
  return x > 20.f ? x : log1pf(expf(x));
}

// ---- discretizations (quamba/ops/scan/discretization.py) ----------------------------------------

// How the scan discretizes h' = a h + v over a step Δ (z = Δ a); a kernel template parameter, so
// zoh's code is the kernel it always was.
enum class Discretization : int { kZoh = 0, kZohExact = 1, kBilinear = 2, kFoh = 3, kRk4 = 4 };

// Calls launch(std::integral_constant<Discretization, method>{}): a launcher templated on the
// method, picked at run time.
template <typename Launch>
void with_method(Discretization method, Launch&& launch) {
  using D = Discretization;
  switch (method) {
    case D::kZoh: return launch(std::integral_constant<D, D::kZoh>{});
    case D::kZohExact: return launch(std::integral_constant<D, D::kZohExact>{});
    case D::kBilinear: return launch(std::integral_constant<D, D::kBilinear>{});
    case D::kFoh: return launch(std::integral_constant<D, D::kFoh>{});
    default: return launch(std::integral_constant<D, D::kRk4>{});
  }
}

// One step's Ā and the gains B̄ applies to this step's drive v_t = u_t B_t and (foh) the previous
// step's v_{t-1}; methods other than zoh only (zoh's kernels keep their own arithmetic).
struct StepCoefficients {
  float decay, gain, previous_gain;
};

// φ2(z) = Σ_k z^k / (k + 2)! for |z| below this (the reference's 7 terms), else its closed form.
constexpr float kPhi2SeriesBelow = 0.5f;

// Σ_k c_k z^k by Horner's rule, lowest coefficient first. kRounded: each product and sum rounded
// on its own, as the torch reference evaluates it; else fused multiply-adds.
template <bool kRounded>
__device__ __forceinline__ float horner(float, float c) {
  return c;
}
template <bool kRounded, typename... Rest>
__device__ __forceinline__ float horner(float z, float c, Rest... rest) {
  const float tail = horner<kRounded>(z, rest...);
  return kRounded ? __fadd_rn(__fmul_rn(tail, z), c) : fmaf(tail, z, c);
}

// The reference's fp32 constants: 1 / k! rounded once from double.
constexpr float inverse_factorial(int k) {
  double f = 1.0;
  for (int i = 2; i <= k; ++i) f *= i;
  return static_cast<float>(1.0 / f);
}

template <bool kRounded>
__device__ __forceinline__ float phi2_series(float z) {
  return horner<kRounded>(z, inverse_factorial(2), inverse_factorial(3), inverse_factorial(4),
                          inverse_factorial(5), inverse_factorial(6), inverse_factorial(7),
                          inverse_factorial(8));
}

// RK4's R(z) = 1 + z + z²/2 + z³/6 + z⁴/24 (Ā) and S(z) = 1 + z/2 + z²/6 + z³/24 (B̄ = Δ S).
template <bool kRounded>
__device__ __forceinline__ float rk4_decay(float z) {
  return horner<kRounded>(z, 1.f, 1.f, inverse_factorial(2), inverse_factorial(3),
                          inverse_factorial(4));
}
template <bool kRounded>
__device__ __forceinline__ float rk4_gain(float z) {
  return horner<kRounded>(z, 1.f, inverse_factorial(2), inverse_factorial(3),
                          inverse_factorial(4));
}

// The coefficients of ``kMethod`` (not zoh) for step Δ and z = Δ a, operation by operation as
// quamba.ops.scan.discretization computes them: φ1 = expm1(z) / z (1 at 0), φ2 by its series below
// |z| = 0.5 and (expm1(z) - z) / z² above, IEEE divisions. The decode step's arithmetic.
template <Discretization kMethod>
__device__ __forceinline__ StepCoefficients exact_coefficients(float delta, float z) {
  static_assert(kMethod != Discretization::kZoh, "zoh keeps its own arithmetic");
  if constexpr (kMethod == Discretization::kBilinear) {
    const float half = __fmul_rn(z, 0.5f);
    const float denominator = __fsub_rn(1.f, half);
    return {__fdiv_rn(__fadd_rn(1.f, half), denominator), __fdiv_rn(delta, denominator), 0.f};
  } else if constexpr (kMethod == Discretization::kRk4) {
    return {rk4_decay<true>(z), __fmul_rn(delta, rk4_gain<true>(z)), 0.f};
  } else {
    const float phi1 = z == 0.f ? 1.f : __fdiv_rn(expm1f(z), z);
    if constexpr (kMethod == Discretization::kZohExact) {
      return {expf(z), __fmul_rn(delta, phi1), 0.f};
    } else {
      const float phi2 = fabsf(z) < kPhi2SeriesBelow
                             ? phi2_series<true>(z)
                             : __fdiv_rn(__fsub_rn(expm1f(z), z), __fmul_rn(z, z));
      return {expf(z), __fmul_rn(delta, phi2), __fmul_rn(delta, __fsub_rn(phi1, phi2))};
    }
  }
}

// Strides of a [batch, rows, seqlen] view (rows: channels or states).
struct Strides3 {
  int64_t batch, dim, time;
};

// Element types an op input may have; the kernel reads any of them as fp32.
enum class InKind : int { kInt8 = 0, kHalf = 1, kBFloat16 = 2, kFloat = 3 };

// fp32 value of a float element (torch builds without the implicit half conversions).
__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// load_elements' unit for V values of T.
template <int V, typename T>
using LoadChunk = WideChunk<V * static_cast<int>(sizeof(T))>;

// V consecutive elements of src: in LoadChunk loads when src is aligned to them (`aligned`), else
// one element at a time.
template <int V, typename T>
__device__ __forceinline__ void load_elements(const T* __restrict__ src, bool aligned, T (&values)[V]) {
  using Chunk = LoadChunk<V, T>;
  constexpr int kChunks = V * sizeof(T) / sizeof(Chunk);
  if (aligned) {
    Chunk chunks[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) chunks[i] = __ldg(reinterpret_cast<const Chunk*>(src) + i);
    memcpy(values, chunks, sizeof(values));
  } else {
#pragma unroll
    for (int r = 0; r < V; ++r) values[r] = src[r];
  }
}

// V consecutive values from src as fp32.
template <int V, typename In>
__device__ __forceinline__ void load_values(const In* __restrict__ src, bool aligned, float (&v)[V]) {
  In values[V];
  load_elements<V>(src, aligned, values);
#pragma unroll
  for (int r = 0; r < V; ++r) v[r] = to_float(values[r]);
}

// kCount consecutive values at p (aligned to 16 bytes or to the row's size) in WideChunk pieces.
template <int kCount, typename T>
__device__ __forceinline__ void load_row(const T* p, T (&out)[kCount]) {
  using Chunk = WideChunk<kCount * sizeof(T)>;
#pragma unroll
  for (int i = 0; i < static_cast<int>(kCount * sizeof(T) / sizeof(Chunk)); ++i) {
    const Chunk chunk = reinterpret_cast<const Chunk*>(p)[i];
    memcpy(reinterpret_cast<char*>(out) + sizeof(Chunk) * i, &chunk, sizeof(Chunk));
  }
}

template <int kCount, typename T>
__device__ __forceinline__ void store_row(T* p, const T (&values)[kCount]) {
  using Chunk = WideChunk<kCount * sizeof(T)>;
#pragma unroll
  for (int i = 0; i < static_cast<int>(kCount * sizeof(T) / sizeof(Chunk)); ++i) {
    Chunk chunk;
    memcpy(&chunk, reinterpret_cast<const char*>(values) + sizeof(Chunk) * i, sizeof(Chunk));
    reinterpret_cast<Chunk*>(p)[i] = chunk;
  }
}

// Whether every load_elements<V> of p can use its wide loads (the segments start at multiples of V).
template <int V, typename T>
__device__ __forceinline__ bool wide_loads_fit(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % sizeof(LoadChunk<V, T>) == 0;
}

// fp32 value of an op input element: int8 codes times their scale, float values as they are.
__device__ __forceinline__ float dequantize(int8_t v, float scale) {
  return __fmul_rn(static_cast<float>(v), scale);
}
template <typename T>
__device__ __forceinline__ float dequantize(T v, float) {
  return to_float(v);
}

// One input tensor of a kernel: its data, element kind and the scale of int8 codes.
struct FloatSource {
  const void* data;
  InKind kind;
  float scale;  // int8 codes only; float inputs are taken as they are

  __device__ __forceinline__ float load(int64_t offset) const {
    switch (kind) {
      case InKind::kInt8: return dequantize(static_cast<const int8_t*>(data)[offset], scale);
      case InKind::kHalf: return dequantize(static_cast<const __half*>(data)[offset], scale);
      case InKind::kBFloat16:
        return dequantize(static_cast<const __nv_bfloat16*>(data)[offset], scale);
      default: return dequantize(static_cast<const float*>(data)[offset], scale);
    }
  }

  // The values at offset, offset + stride, ... (the first ``count`` of kCount): one switch on the
  // kind for the whole row, so that its loads issue together.
  template <int kCount>
  __device__ __forceinline__ void load_row(int64_t offset, int64_t stride, int count,
                                           float (&out)[kCount]) const {
    switch (kind) {
      case InKind::kInt8: return load_row_of<int8_t>(offset, stride, count, out);
      case InKind::kHalf: return load_row_of<__half>(offset, stride, count, out);
      case InKind::kBFloat16: return load_row_of<__nv_bfloat16>(offset, stride, count, out);
      default: return load_row_of<float>(offset, stride, count, out);
    }
  }

 private:
  template <typename T, int kCount>
  __device__ __forceinline__ void load_row_of(int64_t offset, int64_t stride, int count,
                                              float (&out)[kCount]) const {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      if (i < count) out[i] = dequantize(static_cast<const T*>(data)[offset + i * stride], scale);
    }
  }
};

using quamba::from_float;

// ---- host side -----------------------------------------------------------------------------

// fp32 value of a Python float, rounded once on the host (as quamba.ops.quant.to_fp32).
inline float to_fp32(double value) { return static_cast<float>(value); }

// fp32(1 / fp32(scale)), the multiplier quantize() applies (quamba.ops.quant.reciprocal).
inline float reciprocal(double scale) {
  return static_cast<float>(1.0 / static_cast<double>(static_cast<float>(scale)));
}

// Text of numbers, shapes and devices for error messages. Only strings are streamed into
// TORCH_CHECK messages: on the GPU machine the extension's host compiler brings its own
// libstdc++, and formatting a number inside the message stream crashed (std::ostream::_M_insert
// reaching a facet of the other library).
template <typename T, std::enable_if_t<std::is_integral_v<T>, int> = 0>
std::string text(T value) {
  return std::to_string(value);
}

inline std::string text(double value) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", value);
  return buffer;
}

inline std::string text(at::IntArrayRef shape) {
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

inline std::string text(const c10::Device& device) { return device.str(); }

inline void check_cuda(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got one on ", text(t.device()));
}

inline void check_same_device(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_cuda(t, name);
  TORCH_CHECK(t.device() == ref.device(), name, " is on ", text(t.device()),
              " but the inputs are on ", text(ref.device()));
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must be ", dtype, ", got ", t.scalar_type());
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", text(shape), ", got ",
              text(t.sizes()));
}

inline void check_positive_scale(double scale, const char* name) {
  TORCH_CHECK(scale > 0.0 && std::isfinite(scale), name, " must be a positive finite scale, got ",
              text(scale));
}

inline InKind in_kind(const at::Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kChar: return InKind::kInt8;
    case at::kHalf: return InKind::kHalf;
    case at::kBFloat16: return InKind::kBFloat16;
    case at::kFloat: return InKind::kFloat;
    default:
      TORCH_CHECK(false, name, " must be int8, float16, bfloat16 or float32, got ",
                  t.scalar_type());
  }
}

// The method a kernel's ``discretization`` argument names (quamba.ops.scan.discretization.METHODS).
inline Discretization discretization_of(c10::string_view name) {
  if (name == "zoh") return Discretization::kZoh;
  if (name == "zoh-exact") return Discretization::kZohExact;
  if (name == "bilinear") return Discretization::kBilinear;
  if (name == "foh") return Discretization::kFoh;
  if (name == "rk4") return Discretization::kRk4;
  TORCH_CHECK(false, "discretization must be one of zoh, zoh-exact, bilinear, foh, rk4, got '",
              std::string(name.data(), name.size()), "'");
}

// quamba::check_kernel_image (kernel_image.h) for a kernel function.
template <typename Kernel>
void check_kernel_image(Kernel kernel, const char* op) {
  quamba::check_kernel_image(reinterpret_cast<const void*>(kernel), op);
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace quamba_ssm
