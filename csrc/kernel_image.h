// Every op checks, before its first launch, that this build holds machine code (or PTX) the
// current GPU can run: a missing architecture fails loudly instead of returning unwritten memory.
// The same query also returns an error left pending by earlier work (say an illegal address in an
// earlier kernel, after which the CUDA context is unusable): that one is reported as what it is.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

namespace quamba {

inline bool missing_kernel_image(cudaError_t status) {
  return status == cudaErrorNoKernelImageForDevice || status == cudaErrorInvalidDeviceFunction ||
         status == cudaErrorInvalidPtx || status == cudaErrorUnsupportedPtxVersion;
}

inline void check_kernel_image(const void* kernel, const char* op) {
  cudaFuncAttributes attributes;
  const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();  // clear a non-sticky error, so that later calls don't report it again
  TORCH_CHECK(missing_kernel_image(status), op, ": a CUDA error is pending from earlier work: ",
              cudaGetErrorString(status),
              " (left by an earlier kernel or CUDA call; CUDA_LAUNCH_BLOCKING=1 names the kernel that failed)");
  int device = 0, major = 0, minor = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  TORCH_CHECK(false, op, ": quamba._C holds no kernel for this GPU (compute capability ", major, ".", minor, ": ",
              cudaGetErrorString(status), "); rebuild with TORCH_CUDA_ARCH_LIST including it");
}

}  // namespace quamba
