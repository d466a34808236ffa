// fp32 to a kernel's output type, rounded to nearest even: shared by the SSM-side kernels
// (ssm_common/ssm_common.cuh) and the 4-bit GEMVs (gemm4/gemv4.cu). No ATen, so that including it
// costs a kernel file nothing.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace quamba {

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }

}  // namespace quamba
