// What the int8 (gemm/gemv.cu) and 4-bit (gemm4/gemv4.cu) decode GEMVs share: the block shape,
// streaming weight loads, a warp's share of the work and the meeting of the K splits.
// A block has kWarps warps (or `Warps`, for the 4-bit tensor-core GEMV's wider splits); each warp
// takes a group of weight rows and one of `splits` equal shares of the reduction dimension
// (counted in the kernel's own units: 16-byte chunks, steps).
#pragma once

#include <cuda_runtime.h>

namespace quamba::gemm {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kLoadsPerLane = 8;  // 16-byte weight chunks in flight per lane: R rows x (8 / R) steps

// Weights are read once: streaming loads (ld.global.cs, evict-first) leave the caches to the
// activations.
__device__ __forceinline__ int4 load_streaming(const int4* p) { return __ldcs(p); }

template <typename T>
__device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The warp's sums acc[r][m] reduced over the warp; lane r * M + m returns the one for (r, m).
template <int M, int R, typename T>
__device__ __forceinline__ T lane_sum(const T (&acc)[R][M], int lane) {
  T mine = 0;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int m = 0; m < M; ++m) {
      const T total = warp_sum(acc[r][m]);
      if (lane == r * M + m) mine = total;
    }
  return mine;
}

// A warp's work: weight rows row0 ... row0 + rows - 1 and units [begin, end) of K (empty past N).
struct WarpShare {
  int warp, lane, split, row0, begin, end;
};

template <int Warps = kWarps>
__device__ __forceinline__ WarpShare warp_share(int rows, int N, int units, int splits) {
  WarpShare s;
  s.warp = threadIdx.x / 32;
  s.lane = threadIdx.x % 32;
  s.split = s.warp % splits;
  s.row0 = (blockIdx.x * (Warps / splits) + s.warp / splits) * rows;
  const int per_split = (units + splits - 1) / splits;
  s.begin = s.split * per_split;
  s.end = s.row0 < N ? min(units, s.begin + per_split) : s.begin;
  return s;
}

// The first split of each row group adds the other splits' V values per lane, in split order.
// Every thread of the block calls it; false for the warps that hold no result afterwards.
template <int V, typename T, int Warps>
__device__ __forceinline__ bool combine_splits(T (&partial)[Warps][V][32], T* values, const WarpShare& s,
                                               int splits) {
  if (splits == 1) return true;
#pragma unroll
  for (int v = 0; v < V; ++v) partial[s.warp][v][s.lane] = values[v];
  __syncthreads();
  if (s.split != 0) return false;
  for (int k = 1; k < splits; ++k)
#pragma unroll
    for (int v = 0; v < V; ++v) values[v] += partial[s.warp + k][v][s.lane];
  return true;
}

}  // namespace quamba::gemm
