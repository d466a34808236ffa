// Decode GEMV (M = 1..8): streams the int8 weight rows once with 16-byte loads and reads the few
// activation rows from L2, where they are (rows x_stride bytes apart: dt_low, sliced from x_proj's
// output at batch > 1, is read in place rather than copied first). Work comes in row groups of R
// weight rows; `splits` warps of one block share a group's K range and meet in shared memory.
// R = 1, 2, 4 multiply with dp4a; R = 8 with tensor cores (mma.sync), fewer instructions per weight
// byte as M grows, but slower on Hopper at every M (choose_rows).
// Blocks are small (4 warps, one tile each) so that the block scheduler spreads the weight bytes
// evenly over the SMs (8-warp blocks gave e.g. 320 blocks for 132 SMs: 3 on some, 2 on others;
// out_proj at M = 8 went from 8.9 to 7.4 us with 4). R and splits are chosen from the shape
// (choose_rows, choose_splits), or given for tuning. Launched with programmatic dependence
// (pdl.cuh): the first weight loads are issued before waiting for the kernel that writes x.
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>

#include "gemm/epilogue.cuh"
#include "gemm/gemm.h"
#include "gemm/gemv_common.cuh"
#include "gemm/mma.cuh"
#include "pdl.cuh"

namespace quamba::gemm {
namespace {

// Activations in shared memory: every warp reads all M rows of x over its K range, from L2 (see
// below), so at M = 8 in_proj's warps read twice as many activation bytes as weight bytes. Where
// the warps of a block share all of K (splits == 1) and M >= kStagedMinM, the block copies x to
// shared memory once (M * K <= kMaxStagedBytes, under the 48 KB a launch gets without opting in,
// beside the static `partial`), a quarter of those reads; while it waits for x its first weights
// are prefetched to L2. On the H100 (benchmarks/RESULTS.md): in_proj at M = 8 13.5 us against
// 16.1, dt_proj 3.4 against 4.8; no gain below M = 5 (dt_proj at M = 2 and 3 lost 0.3-0.6 us).
constexpr int kStagedMinM = 5;
constexpr int kMaxStagedBytes = 40 * 1024;

// Sums over chunks [begin, end) of rows row0..row0+R-1 (rows past N re-read row N - 1; the
// caller drops them); x's rows start x_chunks chunks apart, or are packed in staged_x (Staged,
// where every thread of the block calls this: the copy meets at a barrier). Returns, in lane
// r * M + m, the warp's sum for (row0 + r, m). The activations are read from L2 (ld.global.cg):
// with programmatic dependent launch the kernel that writes them may still be running when this
// one starts, so no copy of them may sit in an L1.
template <int M, int R, bool Staged>
__device__ __forceinline__ int row_group_sums(const int4* __restrict__ x, int x_chunks, int4* staged_x,
                                              const int8_t* __restrict__ w, int N, int chunks, int row0, int begin,
                                              int end, int lane) {
  constexpr int kSteps = kLoadsPerLane / R;
  const int4* w_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    w_rows[r] = reinterpret_cast<const int4*>(w + static_cast<int64_t>(min(row0 + r, N - 1)) * chunks * 16);

  if constexpr (Staged) {
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
      if (begin + lane + 32 * s < end)
#pragma unroll
        for (int r = 0; r < R; ++r) prefetch_l2(w_rows[r] + begin + lane + 32 * s);
    pdl_wait();
    for (int i = threadIdx.x; i < M * chunks; i += kThreads)
      staged_x[i] = __ldcg(x + i / chunks * x_chunks + i % chunks);
    __syncthreads();
  }
  int acc[R][M] = {};
  bool waited = Staged;
  for (int c = begin + lane; c < end; c += 32 * kSteps) {
    int4 wv[kSteps][R];
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
      if (c + 32 * s < end)
#pragma unroll
        for (int r = 0; r < R; ++r) wv[s][r] = load_streaming(w_rows[r] + c + 32 * s);
    if (!waited) {  // the first weights are on their way: now wait for x (see pdl.cuh)
      pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if (c + 32 * s >= end) continue;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int4 xv = Staged ? staged_x[m * chunks + c + 32 * s] : __ldcg(x + m * x_chunks + c + 32 * s);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] = dot16(wv[s][r], xv, acc[r][m]);
      }
    }
  }
  return lane_sum(acc, lane);
}

template <int M, int R, bool Staged, typename OutT>
__global__ void __launch_bounds__(kThreads)
gemv_kernel(const int8_t* __restrict__ x, int x_stride, const int8_t* __restrict__ w, OutT* __restrict__ out, int N,
            int K, Epilogue epilogue, int splits) {
  static_assert(R * M <= 32, "one output per lane");
  extern __shared__ int4 staged_x[];  // M * K bytes when Staged
  __shared__ int partial[kWarps][1][32];
  pdl_launch_dependents();
  const int chunks = K / 16;
  const WarpShare s = warp_share(R, N, chunks, splits);
  const int lane = s.lane;

  int sum = row_group_sums<M, R, Staged>(reinterpret_cast<const int4*>(x), x_stride / 16, staged_x, w, N, chunks,
                                         s.row0, s.begin, s.end, lane);
  pdl_wait();  // warps with no share of K have not waited yet (Staged: all have; a no-op)
  if (!combine_splits<1>(partial, &sum, s, splits)) return;
  const int n = s.row0 + lane / M;
  if (lane < R * M && n < N) out[static_cast<int64_t>(lane % M) * N + n] = epilogue.apply<OutT>(sum, n);
}

// Tensor-core row group (R = 8). Per 64-byte step of K, lane (g, t) = (lane / 4, lane % 4) loads
// 16 bytes, chunk 4 * step + t, of weight row row0 + g and of activation row g (zero for g >= M).
// A dot product does not depend on the order of k, only on both operands using the same order,
// so the 16 bytes feed two m16n8k32 mmas as they are: A = the activations (rows 8..15 zero),
// B = the 8 weight rows. Lane (g, t) ends with the sums for (row0 + 2t, g) and (row0 + 2t + 1, g).
// Known limit (SASS, H200): ptxas interleaves the loads with the mmas, about two steps in flight
// per warp, so this variant is latency-bound on long rows. Issuing all weight loads first in
// source did not change that (slower). The dispatcher no longer picks it (choose_rows).
constexpr int kMmaRows = 8;
constexpr int kMmaSteps = 8;

template <int M>
__device__ __forceinline__ void row_group_sums_mma(int (&d)[4], const int4* __restrict__ x, int x_chunks,
                                                   const int8_t* __restrict__ w, int N, int chunks, int row0,
                                                   int begin, int end, int lane) {
  const int g = lane / 4, t = lane % 4;
  const int4* w_row = reinterpret_cast<const int4*>(w + static_cast<int64_t>(min(row0 + g, N - 1)) * chunks * 16);
  const int4* x_row = x + min(g, M - 1) * x_chunks;
  const int4 zero = make_int4(0, 0, 0, 0);
  for (int c0 = begin; c0 < end; c0 += 4 * kMmaSteps) {
    int4 wv[kMmaSteps], xv[kMmaSteps];
#pragma unroll
    for (int s = 0; s < kMmaSteps; ++s)  // unconditional (clamped) loads; out-of-range ones zeroed below
      wv[s] = load_streaming(w_row + min(c0 + 4 * s + t, end - 1));
    if (c0 == begin) pdl_wait();  // the first weights are on their way: now wait for x
#pragma unroll
    for (int s = 0; s < kMmaSteps; ++s) xv[s] = __ldcg(x_row + min(c0 + 4 * s + t, end - 1));
#pragma unroll
    for (int s = 0; s < kMmaSteps; ++s) {
      if (c0 + 4 * s + t >= end) wv[s] = zero;
      if (g >= M) xv[s] = zero;
    }
#pragma unroll
    for (int s = 0; s < kMmaSteps; ++s) {
      const uint32_t a_lo[4] = {uint32_t(xv[s].x), 0u, uint32_t(xv[s].y), 0u};
      const uint32_t a_hi[4] = {uint32_t(xv[s].z), 0u, uint32_t(xv[s].w), 0u};
      mma_s8(d, a_lo, wv[s].x, wv[s].y);
      mma_s8(d, a_hi, wv[s].z, wv[s].w);
    }
  }
}

template <int M, typename OutT>
__global__ void __launch_bounds__(kThreads)
gemv_mma_kernel(const int8_t* __restrict__ x, int x_stride, const int8_t* __restrict__ w, OutT* __restrict__ out,
                int N, int K, Epilogue epilogue, int splits) {
  __shared__ int partial[kWarps][2][32];
  pdl_launch_dependents();
  const int chunks = K / 16;
  const WarpShare s = warp_share(kMmaRows, N, chunks, splits);
  const int lane = s.lane;

  int d[4] = {};
  row_group_sums_mma<M>(d, reinterpret_cast<const int4*>(x), x_stride / 16, w, N, chunks, s.row0, s.begin, s.end,
                        lane);
  pdl_wait();  // warps with no share of K have not waited yet
  if (!combine_splits<2>(partial, d, s, splits)) return;  // d[0] and d[1] hold this lane's sums
  const int m = lane / 4, n = s.row0 + 2 * (lane % 4);
  if (m >= M) return;
  if (n < N) out[static_cast<int64_t>(m) * N + n] = epilogue.apply<OutT>(d[0], n);
  if (n + 1 < N) out[static_cast<int64_t>(m) * N + n + 1] = epilogue.apply<OutT>(d[1], n + 1);
}

// Chosen by measurement on the H100 and the H200 (benchmarks/RESULTS.md, 2026-11-24: every
// variant at M = 1..8). dp4a with 4 rows per warp, or 2 when N is too small to give every SM
// warps (x_proj) and M <= 5. The tensor-core rows (R = 8, still selectable) were slower on both
// GPUs at every M: in_proj at M = 8 took 20.4 us against 14.7 for 4 dp4a rows on the H200. K is
// split until there are about 8 warps per SM, keeping at least two lane sweeps of K per warp.
int choose_rows(int M, int N, int sms) {
  const bool few_rows = (N + 3) / 4 * kWarps < 8 * sms;
  return few_rows && M <= 5 ? 2 : 4;
}

int choose_splits(int N, int K, int rows, int sms) {
  const int chunks = K / 16;
  if (rows == kMmaRows) return chunks >= 128 ? 2 : 1;
  const int groups = (N + rows - 1) / rows;
  int splits = 1;
  while (splits < kWarps && groups * splits < 8 * sms && chunks >= 64 * (2 * splits)) splits *= 2;
  return splits;
}

template <int M, int R, typename OutT>
void launch_kernel(const GemmArgs& a, int splits) {
  const bool staged = R != kMmaRows && M >= kStagedMinM && splits == 1 && M * a.K <= kMaxStagedBytes;
  const auto kernel = [staged] {
    if constexpr (R == kMmaRows) return gemv_mma_kernel<M, OutT>;
    else if constexpr (M >= kStagedMinM)
      return staged ? gemv_kernel<M, R, true, OutT> : gemv_kernel<M, R, false, OutT>;
    else return gemv_kernel<M, R, false, OutT>;
  }();
  check_kernel_image(reinterpret_cast<const void*>(kernel), "w8a8 GEMV");
  const int groups_per_block = kWarps / splits;
  const int blocks = ((a.N + R - 1) / R + groups_per_block - 1) / groups_per_block;
  launch_with_pdl(kernel, blocks, kThreads, staged ? M * a.K : 0, a.stream, a.x, a.x_stride, a.w,
                  static_cast<OutT*>(a.out), a.N, a.K, Epilogue::from(a), splits);
}

template <int M>
void launch_for_m(const GemmArgs& a, int rows, int splits) {
  dispatch_out_type(a.out_type, [&](auto tag) {
    using OutT = decltype(tag);
    switch (rows) {
      case 1: launch_kernel<M, 1, OutT>(a, splits); break;
      case 2: launch_kernel<M, 2, OutT>(a, splits); break;
      case 4: launch_kernel<M, 4, OutT>(a, splits); break;
      case kMmaRows: launch_kernel<M, kMmaRows, OutT>(a, splits); break;
    }
  });
}

}  // namespace

void launch_gemv(const GemmArgs& a, int rows, int splits) {
  TORCH_CHECK(a.M >= 1 && a.M <= kGemvMaxM, "w8a8 GEMV: M must be in 1..", kGemvMaxM, ", got ", a.M);
  TORCH_CHECK(rows == 0 || rows == 1 || rows == 2 || rows == 4 || rows == kMmaRows,
              "w8a8 GEMV: rows must be 0 (auto), 1, 2, 4 or 8 (tensor cores), got ", rows);
  TORCH_CHECK(splits == 0 || splits == 1 || splits == 2 || splits == 4,
              "w8a8 GEMV: splits must be 0 (auto), 1, 2 or 4, got ", splits);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (rows == 0) rows = choose_rows(a.M, a.N, sms);
  if (splits == 0) splits = choose_splits(a.N, a.K, rows, sms);
  switch (a.M) {
    case 1: launch_for_m<1>(a, rows, splits); break;
    case 2: launch_for_m<2>(a, rows, splits); break;
    case 3: launch_for_m<3>(a, rows, splits); break;
    case 4: launch_for_m<4>(a, rows, splits); break;
    case 5: launch_for_m<5>(a, rows, splits); break;
    case 6: launch_for_m<6>(a, rows, splits); break;
    case 7: launch_for_m<7>(a, rows, splits); break;
    case 8: launch_for_m<8>(a, rows, splits); break;
  }
}

}  // namespace quamba::gemm
