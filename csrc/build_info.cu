// What this build of quamba._C can run, for the Python backend selection and `python -m quamba.env`:
//
//   cuda_archs() -> str                  the virtual architectures nvcc compiled (e.g. "900")
//   kernel_image_error(int device) -> str  "" when this build holds machine code (or PTX) the
//                                          device can run, else the CUDA runtime's reason
//
// Every .cu file of the extension is compiled with the same -gencode flags (setup.py), so the
// probe kernel here stands for all of them: where it has no image for a device, no kernel has.
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <string>

namespace quamba {
namespace {

__global__ void probe_kernel() {}

#define QUAMBA_STRINGIFY_(x) #x
#define QUAMBA_STRINGIFY(x) QUAMBA_STRINGIFY_(x)

std::string cuda_archs() {
#ifdef __CUDA_ARCH_LIST__
  return QUAMBA_STRINGIFY(__CUDA_ARCH_LIST__);
#else
  return "";
#endif
}

std::string kernel_image_error(int64_t device) {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess || device < 0 || device >= count) {
    (void)cudaGetLastError();
    return "no CUDA device " + std::to_string(device);
  }
  c10::cuda::CUDAGuard guard(static_cast<c10::DeviceIndex>(device));
  cudaFuncAttributes attributes;
  const cudaError_t error = cudaFuncGetAttributes(&attributes, probe_kernel);
  if (error == cudaSuccess) return "";
  (void)cudaGetLastError();  // clear it, so that later launch checks don't report it again
  return cudaGetErrorString(error);
}

}  // namespace
}  // namespace quamba

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def("cuda_archs() -> str", &quamba::cuda_archs);
  m.def("kernel_image_error(int device) -> str", &quamba::kernel_image_error);
}
