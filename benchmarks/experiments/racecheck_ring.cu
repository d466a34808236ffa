// What it showed (fresh H200, 2026-11-27; benchmarks/RESULTS.md, "compute-sanitizer"): racecheck does
// not follow mbarrier ordering. The `bulk` and `generic` modes report 4 hazards each, `barrier` 0,
// and every mode's sums equal the host's (benchmarks/results/2026-11-27e-h200/racecheck_ring_*.log).
// So racecheck's reports on the layer kernels (a ring slot's refill against the reads of the chunk
// it held one ring turn earlier, csrc/fused_decode/layer_ring.cuh) are the tool's blind spot, not
// races; scripts/gpu_check.sh --sanitizer leaves racecheck off the layer kernels for this reason.
// Rerun it when a new compute-sanitizer may follow mbarriers, from the repository root:
//   nvcc -O2 -arch=sm_90a -o /tmp/racecheck_ring benchmarks/experiments/racecheck_ring.cu
//   for m in bulk generic barrier; do compute-sanitizer --tool racecheck /tmp/racecheck_ring $m; done
// (Moved from benchmarks/results/2026-11-27e-h200/, where commit e906cc5 added it.)
//
// Control for compute-sanitizer racecheck: does it follow an mbarrier ring's ordering when a slot
// is refilled? One block: 8 consumer warps read each chunk from shared memory and arrive on the
// slot's empty barrier (lane 0 after __syncwarp, as layer_ring.cuh's release); a producer warp
// refills a slot once all 8 arrived. Two slots, six chunks, so every slot is refilled twice.
//   ./racecheck_ring bulk     the producer's lane 0 refills with cp.async.bulk (+ proxy fence), as
//                             layer_ring.cuh's produce does; completion on the full barrier
//   ./racecheck_ring generic  the producer warp refills with ld.global / st.shared, then lane 0
//                             arrives on the full barrier after __syncwarp
//   ./racecheck_ring barrier  the same generic refills and reads, ordered by __syncthreads instead
//                             of the mbarriers (a round: refill, barrier, read, barrier)
// Build: nvcc -O2 -arch=sm_90a -o racecheck_ring racecheck_ring.cu
// Run:   compute-sanitizer --tool racecheck ./racecheck_ring bulk   (and generic, barrier)
// Each prints whether the consumers' sums equal the host's.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <vector>

constexpr int kSlots = 2, kChunks = 6, kChunkInts = 1024, kWarps = 8, kThreads = 32 * (kWarps + 1);

struct Smem {
  alignas(128) int ring[kSlots][kChunkInts];
  unsigned long long full[kSlots], empty[kSlots];
};

__device__ unsigned smem(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }

__device__ void wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W_%=;\n}\n" ::"r"(
          smem(bar)),
      "r"(parity)
      : "memory");
}

__device__ void arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem(bar)) : "memory");
}

template <bool kBulk>
__global__ void ring_kernel(const int* src, long long* sums) {
  __shared__ Smem sm;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  if (t == 0) {
    for (int i = 0; i < kSlots; ++i) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(&sm.full[i])), "r"(1) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem(&sm.empty[i])), "r"(kWarps) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  if (warp == kWarps) {  // the producer
    for (int k = 0; k < kChunks; ++k) {
      const int slot = k % kSlots;
      if (k >= kSlots) wait(&sm.empty[slot], (k / kSlots - 1) & 1);
      const int* chunk = src + k * kChunkInts;
      if constexpr (kBulk) {
        if (lane == 0) {
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
          const unsigned bar = smem(&sm.full[slot]), bytes = kChunkInts * sizeof(int);
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                  smem(sm.ring[slot])),
              "l"(chunk), "r"(bytes), "r"(bar)
              : "memory");
        }
      } else {
        for (int i = lane; i < kChunkInts; i += 32) sm.ring[slot][i] = chunk[i];
        __syncwarp();
        if (lane == 0) arrive(&sm.full[slot]);
      }
    }
    return;
  }
  long long sum = 0;
  for (int k = 0; k < kChunks; ++k) {
    const int slot = k % kSlots;
    wait(&sm.full[slot], (k / kSlots) & 1);
    for (int i = t; i < kChunkInts; i += 32 * kWarps) sum += sm.ring[slot][i] * (k + 1);
    __syncwarp();
    if (lane == 0) arrive(&sm.empty[slot]);
  }
  atomicAdd(reinterpret_cast<unsigned long long*>(sums), static_cast<unsigned long long>(sum));
}

__global__ void barrier_kernel(const int* src, long long* sums) {
  __shared__ int ring[kSlots][kChunkInts];
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  long long sum = 0;
  for (int k = 0; k < kChunks; ++k) {
    const int slot = k % kSlots;
    if (warp == kWarps) {
      for (int i = lane; i < kChunkInts; i += 32) ring[slot][i] = src[k * kChunkInts + i];
    }
    __syncthreads();
    if (warp < kWarps) {
      for (int i = t; i < kChunkInts; i += 32 * kWarps) sum += ring[slot][i] * (k + 1);
    }
    __syncthreads();
  }
  if (warp < kWarps) atomicAdd(reinterpret_cast<unsigned long long*>(sums), static_cast<unsigned long long>(sum));
}

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "generic";
  std::vector<int> host(kChunks * kChunkInts);
  long long expected = 0;
  for (int i = 0; i < static_cast<int>(host.size()); ++i) {
    host[i] = (i * 2654435761u) % 1000 - 500;
    expected += static_cast<long long>(host[i]) * (i / kChunkInts + 1);
  }
  int* src;
  long long* sums;
  cudaMalloc(&src, host.size() * sizeof(int));
  cudaMalloc(&sums, sizeof(long long));
  cudaMemcpy(src, host.data(), host.size() * sizeof(int), cudaMemcpyHostToDevice);
  cudaMemset(sums, 0, sizeof(long long));
  if (std::strcmp(mode, "bulk") == 0) {
    ring_kernel<true><<<1, kThreads>>>(src, sums);
  } else if (std::strcmp(mode, "barrier") == 0) {
    barrier_kernel<<<1, kThreads>>>(src, sums);
  } else {
    ring_kernel<false><<<1, kThreads>>>(src, sums);
  }
  long long got = 0;
  cudaMemcpy(&got, sums, sizeof(long long), cudaMemcpyDeviceToHost);
  const cudaError_t status = cudaGetLastError();
  std::printf("%s: %s, sum %s (%lld against %lld)\n", mode, cudaGetErrorString(status),
              got == expected ? "equal" : "DIFFERENT", got, expected);
  return got == expected && status == cudaSuccess ? 0 : 1;
}
