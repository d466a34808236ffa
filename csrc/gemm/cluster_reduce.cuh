// Split-K over a thread-block cluster (gemm_skinny.cu, gemm4/w4a8_tiled.cuh): each block stores its
// warps' m16n8 accumulator fragments (weight rows on the MMA's M side, x rows on its N side) to
// shared memory as int32 partial sums [x row][weight row], and the blocks of the cluster then add
// every rank's sums through distributed shared memory.
#pragma once

#include <cooperative_groups.h>

namespace quamba::gemm {

constexpr int kMaxClusterSplits = 16;  // the largest (non-portable) cluster on sm_90

// acc[r][nt]: the fragment of m16 tile r (weight rows warp_row + 16 r ...) and n8 tile nt of x rows;
// lane (g, t) holds weight row g (+8 for v >= 2) and x row 2 t + v % 2 of each.
template <int WR, int NT>
__device__ __forceinline__ void store_partials(int* partial, int stride, const int (&acc)[WR][NT][4], int warp_row,
                                               int g, int t) {
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int v = 0; v < 4; ++v)
        partial[(nt * 8 + 2 * t + v % 2) * stride + warp_row + 16 * r + g + 8 * (v / 2)] = acc[r][nt][v];
}

// The 4 partial sums at int `at` of every one of the cluster's `splits` blocks, added (every rank's
// read in flight at once).
__device__ __forceinline__ int4 cluster_sum4(cooperative_groups::cluster_group& cluster, int* partial, int at,
                                             int splits) {
  int4 sum = make_int4(0, 0, 0, 0);
#pragma unroll
  for (int s = 0; s < kMaxClusterSplits; ++s) {
    if (s < splits) {
      const int4 q = *reinterpret_cast<const int4*>(cluster.map_shared_rank(partial, s) + at);
      sum.x += q.x, sum.y += q.y, sum.z += q.z, sum.w += q.w;
    }
  }
  return sum;
}

}  // namespace quamba::gemm
