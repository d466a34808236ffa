// Input checks shared by the linear-op families (csrc/gemm W8A8, csrc/gemm4 W4A8/W4A16): each
// failure is a TORCH_CHECK whose message names the op and the argument.
#pragma once

#include <cstdint>

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>

#include "gemm/gemm.h"

namespace quamba::gemm::checks {

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

inline void check_device(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  TORCH_CHECK(t.is_cuda(), op, ": ", name, " must be a CUDA tensor, got one on ", t.device());
  TORCH_CHECK(t.device() == device, op, ": ", name, " is on ", t.device(), " but x is on ", device);
}

inline void check_on_device(const char* op, const char* name, const at::Tensor& t, const at::Device& device) {
  check_device(op, name, t, device);
  TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
}

// fp32 [N] (one value per output channel), on x's device, contiguous.
inline void check_vector(const char* op, const char* name, const at::Tensor& t, int64_t N,
                         const at::Device& device) {
  check_on_device(op, name, t, device);
  TORCH_CHECK(t.scalar_type() == at::kFloat, op, ": ", name, " must be float32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 1 && t.size(0) == N, op, ": ", name, " must have shape [", N, "] (one per output "
              "channel), got ", t.sizes());
}

inline OutType out_type_of(const char* op, at::ScalarType dtype) {
  switch (dtype) {
    case at::kChar: return OutType::kInt8;
    case at::kHalf: return OutType::kFloat16;
    case at::kBFloat16: return OutType::kBFloat16;
    case at::kFloat: return OutType::kFloat32;
    default: TORCH_CHECK(false, op, ": out must be int8, float16, bfloat16 or float32, got ", dtype);
  }
}

inline void check_architecture(const char* op) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major >= 8, op, ": needs a GPU of compute capability 8.0 or newer, this one (", prop->name,
              ") is ", prop->major, ".", prop->minor);
}

// The device guard of every entry point: x's device, after checking that it is a CUDA one.
inline c10::cuda::CUDAGuard guard_for(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda(), op, ": x must be a CUDA tensor, got one on ", x.device());
  return c10::cuda::CUDAGuard(x.device());
}

}  // namespace quamba::gemm::checks
