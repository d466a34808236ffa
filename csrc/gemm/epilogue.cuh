// The W8A8 epilogue on one int32 accumulator, bit-exact with quamba/ops/quant.py and the torch
// reference of w8a8_linear: explicit _rn intrinsics keep nvcc from contracting the multiply and
// the add into an FMA, which would round differently.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "gemm/gemm.h"

namespace quamba::gemm {

struct Epilogue {
  float multiplier;
  const float* multiplier_per_channel;
  const float* bias;

  static Epilogue from(const GemmArgs& args) {
    return {args.multiplier, args.multiplier_per_channel, args.bias};
  }

  // What output channel n needs besides its accumulator (an int8 output takes no bias), loaded
  // apart from it so that a kernel may read it before its sums are ready.
  struct Channel {
    float multiplier, bias;
  };
  template <typename OutT>
  __device__ __forceinline__ Channel channel(int n) const {
    const float m = multiplier_per_channel ? __ldg(multiplier_per_channel + n) : multiplier;
    return {m, !std::is_same_v<OutT, int8_t> && bias ? __ldg(bias + n) : 0.f};
  }

  __device__ __forceinline__ float scaled(int acc, const Channel& c) const {
    return __fmul_rn(__int2float_rn(acc), c.multiplier);
  }
  __device__ __forceinline__ float with_bias(int acc, const Channel& c) const {
    const float v = scaled(acc, c);
    return bias ? __fadd_rn(v, c.bias) : v;
  }

  template <typename OutT>
  __device__ __forceinline__ OutT apply(int acc, const Channel& c) const;
  template <typename OutT>
  __device__ __forceinline__ OutT apply(int acc, int n) const {
    return apply<OutT>(acc, channel<OutT>(n));
  }
};

template <>
__device__ __forceinline__ int8_t Epilogue::apply<int8_t>(int acc, const Channel& c) const {
  const float q = fminf(fmaxf(rintf(scaled(acc, c)), -127.f), 127.f);
  return static_cast<int8_t>(__float2int_rn(q));
}

template <>
__device__ __forceinline__ float Epilogue::apply<float>(int acc, const Channel& c) const {
  return with_bias(acc, c);
}

template <>
__device__ __forceinline__ __half Epilogue::apply<__half>(int acc, const Channel& c) const {
  return __float2half_rn(with_bias(acc, c));
}

template <>
__device__ __forceinline__ __nv_bfloat16 Epilogue::apply<__nv_bfloat16>(int acc, const Channel& c) const {
  return __float2bfloat16_rn(with_bias(acc, c));
}

// Calls fn(T{}) with T the C++ type of out_type.
template <typename Fn>
void dispatch_out_type(OutType out_type, Fn&& fn) {
  switch (out_type) {
    case OutType::kInt8: fn(int8_t{}); break;
    case OutType::kFloat16: fn(__half{}); break;
    case OutType::kBFloat16: fn(__nv_bfloat16{}); break;
    case OutType::kFloat32: fn(float{}); break;
  }
}

}  // namespace quamba::gemm
