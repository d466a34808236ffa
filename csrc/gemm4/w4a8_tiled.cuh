// W4A8 GEMM for 9-64 rows of x (decode at batch 9-64) on sm_90, on the packed 4-bit weight
// (gemm4.h's format) with no int8 copy: a block streams a tile of weight rows and x's rows over its
// K range through a cp.async pipeline in shared memory, expands the codes in registers and
// multiplies them on mma.sync m16n8k32; K is split over the blocks of a thread-block cluster, which
// add their int32 partial sums through distributed shared memory (as gemm/gemm_skinny.cu does).
//
// Roles as in the skinny GEMM: weight rows are the MMA's M dimension (m16), x's rows its N
// dimension (n8). A round covers 128 codes of K (one group: group_size % 128 == 0). In a round,
// lane (g, t) reads the 16 bytes at byte 16 t of the round's part of weight rows g and g + 8 of each
// of its m16 tiles: 32 codes, four words of 8. Word j becomes two int8 registers of 4 codes each in
// memory order, 16 x the code ((w << 4) & 0xF0F0F0F0 holds the even codes, w & 0xF0F0F0F0 the odd,
// two byte permutes interleave them): the A operand of MMA j at k 4t..4t+3 and 16+4t..16+4t+3. The
// lane reads x row g at the same 32 codes, 8 bytes for each MMA, so each MMA sums over k in an
// order that differs from memory order identically in both operands. The round's int32 sum is
// divided by 16 (exactly) and multiplied by the group's multiplier: exact for any int8 multiplier,
// as in the W4A8 GEMV.
//
// Against the skinny GEMM on the same packed weight, which holds a warp's weight loads in
// registers and stages all of a block's x before its first MMA, this pipeline keeps both operands
// in flight in shared memory and folds each round's sums right after its MMAs, which leaves
// registers for 64 rows of x in one block: Mamba-2.8B in_proj at 64 rows 29.4 -> 14.6 us on an
// H100, out_proj 18.0 -> 10.9; at 16 rows 14.4 -> 10.0 and 8.7 -> 7.3 (benchmarks/RESULTS.md).
#pragma once

#include <cooperative_groups.h>

#include <algorithm>
#include <cstdint>

#include "gemm/cluster_reduce.cuh"
#include "gemm/epilogue.cuh"
#include "gemm/mma.cuh"
#include "pdl.cuh"

namespace quamba::gemm4::tiled {

constexpr int kSubCodes = 128;  // K of one round of a warp's MMAs: four m16n8k32, one group
// x rows in a stage start 16 bytes past a multiple of 128: the two rows an 8-lane phase of a
// 16-byte read touches then fall on different banks.
constexpr int kXRowPad = 16;
constexpr int kMaxSplits = gemm::kMaxClusterSplits;
// Partial sums are stored [x row][weight row], rows kRows + 4 ints apart, so that the 32 lanes'
// stores of one accumulator register hit 32 different banks.
constexpr int kPartialPad = 4;

constexpr int kWarps = 4;  // 8 a block measured slower (benchmarks/RESULTS.md)
constexpr int kThreads = 32 * kWarps;

// kWarps warps of WR m16 tiles of weight rows each, NT n8 tiles of x rows, kStages stages of
// kSub rounds of 128 codes.
template <int WR, int NT, int kSub, int kStages>
struct Tile {
  static constexpr int kRows = 16 * WR * kWarps;
  static constexpr int kXRows = 8 * NT;
  static constexpr int kStageCodes = kSub * kSubCodes;
  static constexpr int kWeightRowBytes = kStageCodes / 2;  // of a stage
  static constexpr int kXRowBytes = kStageCodes + kXRowPad;
  static constexpr int kWeightStageBytes = kRows * kWeightRowBytes;
  static constexpr int kStageBytes = kWeightStageBytes + kXRows * kXRowBytes;
  static constexpr int kPartialStride = kRows + kPartialPad;
  static constexpr int kMainBytes = std::max(kStages * kStageBytes, kXRows * kPartialStride * 4);
  // 16-byte chunks of a stage's row (4 kSub of weight, 8 kSub of x) and a thread's share of them.
  static constexpr int kWeightRowChunks = 4 * kSub, kXRowChunks = 8 * kSub;
  static constexpr int kWeightChunks = kRows * kWeightRowChunks / kThreads;
  static constexpr int kXChunks = kXRows * kXRowChunks / kThreads;
  static_assert(kThreads % kXRowChunks == 0 && kRows % (kThreads / kWeightRowChunks) == 0 &&
                    kXRows % (kThreads / kXRowChunks) == 0,
                "a thread copies the same chunk of evenly spaced rows");

  // Shared memory of a block: the stages (then the partial sums) and the multipliers of its K range.
  static int smem_bytes(int split_groups) { return kMainBytes + (kRows * split_groups + 15) / 16 * 16; }

  // Byte of 16-byte chunk c of weight row `row` in a stage. With two rounds a stage (128-byte
  // rows), odd rows swap their halves, so that the rows an 8-lane phase reads, two apart by 128
  // bytes, fall on different banks.
  static __device__ __forceinline__ uint32_t weight_offset(int row, int c) {
    return row * kWeightRowBytes + 16 * (kSub == 2 ? c ^ ((row & 1) << 2) : c);
  }
};

// 16 bytes global -> shared, zero-filled when !valid: the weight through L2 only (.cg, read once),
// x through L1 too (.ca): blocks of one SM that take the same K range share it (in_proj at 64
// rows on the H100: 13.7 against 14.3 us).
__device__ __forceinline__ void cp_async_weight(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_x(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending) : "memory");
}

// The 8 codes of packed word w as two int8 words, 16 x codes 0-3 and 16 x codes 4-7.
__device__ __forceinline__ void expand_word(uint32_t w, uint32_t& lo, uint32_t& hi) {
  const uint32_t even = (w << 4) & 0xF0F0F0F0u, odd = w & 0xF0F0F0F0u;
  lo = __byte_perm(even, odd, 0x5140);
  hi = __byte_perm(even, odd, 0x7362);
}

struct Problem {
  const int8_t* x;  // [M, K], rows x_stride bytes apart
  int x_stride;
  const uint8_t* w;                // [N, K / 2]
  const int8_t* group_multiplier;  // [N, K / group_size]
  int group_size;
  int M, N, K, k_per_split;
};

// A thread's share of a stage's copies: one 16-byte chunk of every kThreads / chunks-th row, the
// same chunk of each, for the weight and for x.
template <typename T>
struct StageCopies {
  const uint8_t* weight_src[T::kWeightChunks];  // at the split's first code
  const int8_t* x_src[T::kXChunks];
  int weight_row, weight_chunk, x_row, x_chunk;  // the first row and the chunk
  uint32_t x_rows_valid;                         // bit i: x chunk i lies in a row below M

  __device__ __forceinline__ StageCopies(const Problem& p, int row0, int k_begin)
      : weight_row(threadIdx.x / T::kWeightRowChunks), weight_chunk(threadIdx.x % T::kWeightRowChunks),
        x_row(threadIdx.x / T::kXRowChunks), x_chunk(threadIdx.x % T::kXRowChunks), x_rows_valid(0) {
#pragma unroll
    for (int i = 0; i < T::kWeightChunks; ++i) {
      const int64_t n = min(row0 + weight_row + i * (kThreads / T::kWeightRowChunks), p.N - 1);  // never stored
      weight_src[i] = p.w + n * (p.K / 2) + k_begin / 2 + 16 * weight_chunk;
    }
#pragma unroll
    for (int i = 0; i < T::kXChunks; ++i) {
      const int row = x_row + i * (kThreads / T::kXRowChunks);
      x_src[i] = p.x + static_cast<int64_t>(min(row, p.M - 1)) * p.x_stride + k_begin + 16 * x_chunk;
      x_rows_valid |= static_cast<uint32_t>(row < p.M) << i;
    }
  }

  // Stage `step` of the split into `stage`; chunks at or past the split's `codes` are zero-filled,
  // and so are x rows past M.
  __device__ __forceinline__ void weight(uint32_t stage, int step, int codes) const {
    const bool valid = step * T::kStageCodes + 32 * weight_chunk < codes;
#pragma unroll
    for (int i = 0; i < T::kWeightChunks; ++i)
      cp_async_weight(stage + T::weight_offset(weight_row + i * (kThreads / T::kWeightRowChunks), weight_chunk),
                      weight_src[i] + (valid ? step * T::kWeightRowBytes : 0), valid);
  }
  __device__ __forceinline__ void x(uint32_t stage, int step, int codes) const {
    const bool in_k = step * T::kStageCodes + 16 * x_chunk < codes;
#pragma unroll
    for (int i = 0; i < T::kXChunks; ++i) {
      const bool valid = in_k && (x_rows_valid >> i & 1u);
      const int row = x_row + i * (kThreads / T::kXRowChunks);
      cp_async_x(stage + T::kWeightStageBytes + row * T::kXRowBytes + 16 * x_chunk,
                 x_src[i] + (valid ? step * T::kStageCodes : 0), valid);
    }
  }
};

// One round (128 codes, one group) of a warp's MMAs: its WR m16 tiles of weight rows against all
// NT n8 tiles of x, each tile's int32 sum, divided by 16, times its row's group multiplier added
// to acc. Pairs of x tiles keep 2 WR independent MMA chains in flight.
template <typename T, int WR, int NT>
__device__ __forceinline__ void round_mma(int (&acc)[WR][NT][4], const uint8_t* weights, int warp_row, int round,
                                          const uint8_t* x_lane, const int (&multiplier)[WR][2], int g, int t) {
  uint32_t a[WR][4][4];
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = warp_row + 16 * r + g + 8 * h;
      const uint4 v = *reinterpret_cast<const uint4*>(weights + T::weight_offset(row, 4 * round + t));
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) expand_word(words[j], a[r][j][h], a[r][j][2 + h]);
    }
#pragma unroll
  for (int nt = 0; nt < NT; nt += 2) {
    uint32_t xw[2][8];
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const uint8_t* row = x_lane + (nt + q) * 8 * T::kXRowBytes;
      const uint4 x0 = *reinterpret_cast<const uint4*>(row), x1 = *reinterpret_cast<const uint4*>(row + 16);
      xw[q][0] = x0.x, xw[q][1] = x0.y, xw[q][2] = x0.z, xw[q][3] = x0.w;
      xw[q][4] = x1.x, xw[q][5] = x1.y, xw[q][6] = x1.z, xw[q][7] = x1.w;
    }
    int sums[WR][2][4] = {};
#pragma unroll
    for (int j = 0; j < 4; ++j)
#pragma unroll
      for (int r = 0; r < WR; ++r)
#pragma unroll
        for (int q = 0; q < 2; ++q) gemm::mma_s8(sums[r][q], a[r][j], xw[q][2 * j], xw[q][2 * j + 1]);
#pragma unroll
    for (int r = 0; r < WR; ++r)
#pragma unroll
      for (int q = 0; q < 2; ++q)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[r][nt + q][v] += (sums[r][q][v] >> 4) * multiplier[r][v / 2];
  }
}

// Stores 4 outputs of one row at n..n+3 (in one store where they are all below N and aligned).
template <typename OutT>
__device__ __forceinline__ void store4(OutT* at, int n, int N, const OutT (&v)[4]) {
  struct alignas(4 * sizeof(OutT)) Four {
    OutT v[4];
  };
  if (n + 3 < N && reinterpret_cast<uintptr_t>(at) % sizeof(Four) == 0) {
    *reinterpret_cast<Four*>(at) = Four{{v[0], v[1], v[2], v[3]}};
    return;
  }
#pragma unroll
  for (int j = 0; j < 4; ++j)
    if (n + j < N) at[j] = v[j];
}

// grid (ceil(N / kRows), splits), cluster (1, splits): block (i, s) sums weight rows [i kRows,
// (i+1) kRows) over K range s against all of x's rows (M <= kXRows); the blocks of a cluster then
// each finish a share of the tile. Launched with programmatic dependence: the weight, its
// multipliers and the epilogue's vectors are constants and load before the wait, x after it.
template <int WR, int NT, int kSub, int kStages, typename OutT>
__global__ void __launch_bounds__(kThreads)
w4a8_tiled_kernel(Problem p, OutT* __restrict__ out, gemm::Epilogue epilogue) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using T = Tile<WR, NT, kSub, kStages>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int row0 = blockIdx.x * T::kRows;
  const int k_begin = blockIdx.y * p.k_per_split;
  const int codes = min(p.K - k_begin, p.k_per_split);  // of this split
  const int steps = (codes + T::kStageCodes - 1) / T::kStageCodes;
  const int groups_per_row = p.K / p.group_size;
  const int first_group = k_begin / p.group_size;
  const int split_groups = (k_begin + codes - 1) / p.group_size - first_group + 1;
  const uint32_t smem_base = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  int8_t* multipliers = reinterpret_cast<int8_t*>(smem + T::kMainBytes);  // [kRows][split_groups]
  const StageCopies<T> copies(p, row0, k_begin);

#pragma unroll
  for (int s = 0; s < kStages - 1; ++s)
    if (s < steps) copies.weight(smem_base + s * T::kStageBytes, s, codes);
  for (int i = threadIdx.x; i < T::kRows * split_groups; i += kThreads) {
    const int row = i / split_groups, group = i % split_groups;
    multipliers[i] = p.group_multiplier[static_cast<int64_t>(min(row0 + row, p.N - 1)) * groups_per_row +
                                        first_group + group];
  }
  // The outputs this thread finishes (below) are 4 channels from n_first, the same in every row.
  const int splits = gridDim.y;
  const int n_first = row0 + 4 * (blockIdx.y * kThreads + threadIdx.x) % T::kRows;
  gemm::Epilogue::Channel channels[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) channels[j] = epilogue.channel<OutT>(min(n_first + j, p.N - 1));
  pdl_wait();
  // Commit group s holds stage s's x (and group 0 every prologue weight), so that waiting for
  // group s finds stage s whole.
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) copies.x(smem_base + s * T::kStageBytes, s, codes);
    cp_async_commit();
  }

  int acc[WR][NT][4] = {};
  const int warp_row = warp * 16 * WR;
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage `step` is in for every thread, and every warp is done with step - 1
    const int next = step + kStages - 1;
    if (next < steps) {
      const uint32_t stage = smem_base + (next % kStages) * T::kStageBytes;
      copies.weight(stage, next, codes);
      copies.x(stage, next, codes);
    }
    cp_async_commit();

    const uint8_t* stage = smem + (step % kStages) * T::kStageBytes;
#pragma unroll 1
    for (int round = 0; round < kSub; ++round) {
      const int k = k_begin + step * T::kStageCodes + round * kSubCodes;
      if (kSub > 1 && k - k_begin >= codes) break;  // the same for the whole block
      const int split_group = k / p.group_size - first_group;
      int multiplier[WR][2];
#pragma unroll
      for (int r = 0; r < WR; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          multiplier[r][h] = multipliers[(warp_row + 16 * r + g + 8 * h) * split_groups + split_group];
      round_mma<T>(acc, stage, warp_row, round,
                   stage + T::kWeightStageBytes + g * T::kXRowBytes + round * kSubCodes + 32 * t, multiplier, g, t);
    }
  }
  cp_async_wait<0>();
  pdl_launch_dependents();

  __syncthreads();  // every warp is done with the stages: their space takes the partial sums
  int* partial = reinterpret_cast<int*>(smem);
  gemm::store_partials(partial, T::kPartialStride, acc, warp_row, g, t);
  namespace cg = cooperative_groups;
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();

  // Block s of the cluster finishes every splits-th group of 4 outputs of the tile's M x kRows;
  // 4 kThreads is a multiple of kRows, so a thread's channels stay n_first..n_first + 3.
  const int quads = p.M * T::kRows / 4;
  for (int i = blockIdx.y * kThreads + threadIdx.x; i < quads; i += splits * kThreads) {
    const int m = 4 * i / T::kRows;
    const int at = m * T::kPartialStride + (n_first - row0);
    const int4 sum = gemm::cluster_sum4(cluster, partial, at, splits);
    const int sums[4] = {sum.x, sum.y, sum.z, sum.w};
    OutT values[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) values[j] = epilogue.apply<OutT>(sums[j], channels[j]);
    store4(out + static_cast<int64_t>(m) * p.N + n_first, n_first, p.N, values);
  }
  cluster.sync();  // no block may leave while others still read its shared memory
#else
  __trap();  // never launched: the host requires compute capability 9.0 (thread-block clusters)
#endif
}

}  // namespace quamba::gemm4::tiled
