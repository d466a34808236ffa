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
#include <string>
#include <type_traits>

#include "../float_convert.cuh"

namespace quamba_ssm {

constexpr float kInt8Max = 127.f;

// quantize(): clamp(rne(x · inv), -127, 127) with the multiply rounded on its own (no FMA
// contraction into a neighbouring add), exactly as quamba.ops.quant.quantize.
__device__ __forceinline__ int8_t quantize_rn(float x, float inv_scale) {
  float q = rintf(__fmul_rn(x, inv_scale));
  return static_cast<int8_t>(fminf(fmaxf(q, -kInt8Max), kInt8Max));
}

// SiLU as every quamba backend computes it: y / (1 + exp(-y)), each operation rounded.
__device__ __forceinline__ float silu_rn(float y) {
  return __fdiv_rn(y, __fadd_rn(1.f, expf(-y)));
}

// PyTorch's softplus (beta 1, threshold 20): x if x > 20 else log1p(exp(x)).
__device__ __forceinline__ float softplus(float x) {
  return x > 20.f ? x : log1pf(expf(x));
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

// Every entry point verifies that this build holds machine code the current GPU can run, so an
// architecture missing from the build fails loudly instead of returning unwritten memory.
template <typename Kernel>
void check_kernel_image(Kernel kernel, const char* op) {
  cudaFuncAttributes attributes;
  cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
  if (status != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls are unaffected
    int device = 0, major = 0, minor = 0;
    C10_CUDA_CHECK(cudaGetDevice(&device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
    TORCH_CHECK(false, op, ": the quamba extension holds no kernel for this GPU (sm_", text(major),
                text(minor), "): ", cudaGetErrorString(status),
                "; rebuild with TORCH_CUDA_ARCH_LIST naming it");
  }
}

inline cudaStream_t current_stream() { return c10::cuda::getCurrentCUDAStream(); }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace quamba_ssm
