// Programmatic dependent launch (PDL, compute capability 9.0): a kernel launched with
// launch_with_pdl may start while the kernel before it in the stream is still running, once every
// block of that one has called pdl_launch_dependents (or exited). It must call pdl_wait before it
// reads what earlier kernels wrote and before it writes anything (its output memory may still be
// read by them); work that needs neither, e.g. loading weights, can run before. In a decode step
// the GEMVs start streaming their weights while the small kernel before them (norm, Hadamard)
// runs. CUDA graphs keep these launches as programmatic edges. Before sm_90 both calls are no-ops
// and kernels launch in plain stream order.
#pragma once

#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <utility>

namespace quamba {

__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Brings the cache line of p into L2, where a read after pdl_wait then finds it. L2 is where every
// SM's accesses to global memory meet, so this never yields a stale value, even of memory an
// earlier kernel is still writing: it suits what only the wait makes safe to read.
__device__ __forceinline__ void prefetch_l2(const void* p) {
  asm volatile("prefetch.global.L2 [%0];" ::"l"(p));
}

namespace detail {
template <typename... Params, typename... Args>
void launch_with_attributes(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                            cudaLaunchAttribute* attributes, unsigned num_attributes, Args&&... args) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  config.attrs = attributes;
  config.numAttrs = num_attributes;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...));
}

inline cudaLaunchAttribute programmatic_serialization() {
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  return attribute;
}
}  // namespace detail

// Launches kernel<<<grid, block, smem, stream>>>(args...), programmatically dependent on the
// previous kernel of the stream where the device supports it (compute capability >= 9).
template <typename... Params, typename... Args>
void launch_with_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                     Args&&... args) {
  const int major = at::cuda::getCurrentDeviceProperties()->major;  // cached by ATen: no driver call
  cudaLaunchAttribute attribute = detail::programmatic_serialization();
  detail::launch_with_attributes(kernel, grid, block, smem, stream, &attribute, major >= 9 ? 1 : 0,
                                 std::forward<Args>(args)...);
}

// The same for a kernel whose blocks form thread-block clusters of `cluster` blocks (compute
// capability 9.0; the caller allows clusters above 8 blocks on the kernel).
template <typename... Params, typename... Args>
void launch_clusters_with_pdl(void (*kernel)(Params...), dim3 grid, dim3 cluster, dim3 block, size_t smem,
                              cudaStream_t stream, Args&&... args) {
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = cluster.x;
  attributes[0].val.clusterDim.y = cluster.y;
  attributes[0].val.clusterDim.z = cluster.z;
  attributes[1] = detail::programmatic_serialization();
  detail::launch_with_attributes(kernel, grid, block, smem, stream, attributes, 2, std::forward<Args>(args)...);
}

}  // namespace quamba
