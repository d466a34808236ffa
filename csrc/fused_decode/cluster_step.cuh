// What the SSM-side decode kernels of one thread-block cluster a batch row share (mixer_step.cu
// for int8 activations, w4a16_step.cu for float ones): block r of the cluster owns a slice of the
// channels, x_proj's sum over all channels is exchanged once through distributed shared memory,
// and the launch is a cluster launch, programmatically dependent on the kernel before it.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <utility>

#include "../ssm_common/ssm_common.cuh"

namespace quamba_ssm {
namespace cluster_step {

constexpr int kMaxRanks = 16;  // blocks of a cluster (16: non-portable, sm_90)

__device__ __forceinline__ void arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;" ::: "memory");
}
__device__ __forceinline__ void wait_acquire() {
  asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Blocks of a row's cluster and channels a block: about 64 channels a block, at most kMaxRanks
// blocks; a slice is a multiple of ``align`` channels.
inline std::pair<int, int> shape(int dim, int align) {
  const int ranks = std::clamp((dim + 63) / 64, 1, kMaxRanks);
  const int slice = ((dim + ranks - 1) / ranks + align - 1) / align * align;
  return {(dim + slice - 1) / slice, slice};
}

// The shared-memory pitch of a row of ``bytes`` (a multiple of 16): padded so that the row stride
// is 8 words modulo 16, and the 8 threads of a 16-byte shared load, two a row, hit distinct banks.
inline int row_pitch(int bytes) {
  const int words = bytes / 4;
  return 4 * (words + (8 - words % 16 + 16) % 16);
}

// Launches ``kernel(args)`` as a grid (ranks, batch) of clusters of ``ranks`` blocks of ``threads``,
// programmatically dependent on the kernel before it in the stream.
template <typename Args>
void launch(void (*kernel)(const Args), const Args& args, int ranks, int batch, int threads, int smem,
            const char* op) {
  check_kernel_image(kernel, op);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (ranks > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeClusterDimension;
  attributes[0].val.clusterDim.x = ranks;
  attributes[0].val.clusterDim.y = 1;
  attributes[0].val.clusterDim.z = 1;
  attributes[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(ranks, batch);
  config.blockDim = dim3(threads);
  config.dynamicSmemBytes = smem;
  config.stream = current_stream();
  config.attrs = attributes;
  config.numAttrs = 2;
  C10_CUDA_CHECK(cudaLaunchKernelEx(&config, kernel, args));
}

}  // namespace cluster_step
}  // namespace quamba_ssm
