// W8A8 and W4A8 GEMM for a few rows of x (decode at batch 9 to 64) on sm_90: the weight is
// streamed once, straight from global memory into tensor-core fragments, and the K dimension is
// split over the blocks of a thread-block cluster, which add their int32 partial sums through
// distributed shared memory. w8a8_linear takes it for narrow N (x_proj) at 9-64 rows; for wider N
// the wgmma GEMM computed swapped (gemm_sm90.cuh, 64 weight rows by 32 rows of x a tile) is
// faster (gemm.h's swapped_sm90_preferred, benchmarks/RESULTS.md). W4A8 reads its packed 4-bit
// codes and group multipliers itself, with no int8 copy of the weight.
//
// Each warp waits for one iteration's weight loads (16 per lane, in registers) before it issues
// the next: a cp.async ring of 4 stages per warp, tried instead (benchmarks/RESULTS.md), was faster
// at M <= 16 but slower at 32 and 64, where its shared memory left two blocks per SM.
//
// Roles are swapped against gemm_mma.cu: weight rows are the MMA's M dimension (m16) and x's rows
// its N dimension (n8), so a warp's 16 * WR weight rows meet all of x's 8 * NT rows at once.
// Permuted K: in a step, lane (g, t) loads 16 contiguous bytes at byte 16 t of weight rows g and
// g + 8 and reads the same codes of x row g, and feeds them to m16n8k32 MMAs in an order of k that
// differs from memory order, but identically in both operands, so each sum is still over every k
// once: no shared memory or ldmatrix for the weight, 16-byte loads for both operands (the weight
// formats below say how). x (a block's K range of all its rows) is staged in shared memory once and
// read by the block's 4 warps.
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <cooperative_groups.h>

#include <algorithm>

#include "gemm/cluster_reduce.cuh"
#include "gemm/epilogue.cuh"
#include "gemm/gemm.h"
#include "gemm/mma.cuh"
#include "pdl.cuh"

namespace quamba::gemm {
namespace {

namespace cg = cooperative_groups;

constexpr int kBlockWarps = 4;
constexpr int kBlockThreads = 32 * kBlockWarps;
constexpr int kSplitAlign = 128;        // a split's K range is a multiple of this many codes
constexpr int kWeightLoadsPerLane = 16; // 16-byte weight loads in flight per lane
constexpr int kMaxSplits = kMaxClusterSplits;
constexpr int kMaxStagedBytes = 96 * 1024;
// Partial sums are stored [x row][weight row], rows kRows + 4 ints apart: the 32 lanes' stores of
// one accumulator register then hit 32 different banks.
constexpr int kPartialPad = 4;

// ---------------------------------------------------------------------------------------------
// Weight formats: what W8A8 and W4A8 differ in. A warp's step covers kStepCodes of K: lane (g, t)
// loads the 16 bytes at byte 16 t of the step's part of weight rows g and g + 8 of each m16 tile,
// and reads the same codes of x rows g + 8 nt from shared memory.

// int8 weight [N, K]: a step is 64 codes, a lane's bytes 0-7 and 8-15 two m16n8k32.
struct Int8Codes {
  static constexpr int kStepCodes = 64;
  static constexpr int kCodesPerByte = 1;
  static constexpr int kMaxWarpTiles = 2;
  static constexpr int kMaxXRows = 64;
  // Staged x rows start k_per_split + 64 bytes apart (k_per_split % 128 == 0): the two rows an
  // 8-lane phase of a lane's 16-byte load reads fall in opposite halves of the 32 banks.
  static constexpr int kXRowPad = 64;

  template <int NT, int WR>
  __device__ __forceinline__ static void step(int (&acc)[WR][NT][4], const int4 (&w)[WR][2], const int8_t* x_lane,
                                              int x_row_bytes, const int8_t* const (&)[WR][2], int) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int4 xv = *reinterpret_cast<const int4*>(x_lane + nt * 8 * x_row_bytes);
#pragma unroll
      for (int r = 0; r < WR; ++r) {
        const int4 lo = w[r][0], hi = w[r][1];
        mma_s8(acc[r][nt], {uint32_t(lo.x), uint32_t(hi.x), uint32_t(lo.y), uint32_t(hi.y)}, xv.x, xv.y);
        mma_s8(acc[r][nt], {uint32_t(lo.z), uint32_t(hi.z), uint32_t(lo.w), uint32_t(hi.w)}, xv.z, xv.w);
      }
    }
  }
};

// 4-bit weight (the format of gemm4/gemm4.h: uint8 [N, K / 2], the even k in the low nibble; int8
// group multipliers [N, K / G]) with G % 128 == 0 or G == K <= 128, so that a step, 128 codes, lies
// in one group. Packed word j of a lane's 16 bytes holds codes 8 j ... 8 j + 7: (w << 4) &
// 0xF0F0F0F0 is 16 x its even codes and w & 0xF0F0F0F0 16 x its odd codes, as int8, against the
// even and odd bytes of the same 8 activations (x is staged so permuted: per 8 bytes the even ones
// first, then the odd). The step's int32 sum is exact; divided by 16 exactly and multiplied by the
// group's multiplier it is exact for any int8 multiplier, with no expanded weight.
struct Int4Codes {
  static constexpr int kStepCodes = 128;
  static constexpr int kCodesPerByte = 2;
  // Its per-step sums double the accumulators: two m16 tiles a warp spill at 64 rows of x, and one
  // takes 174 registers there (in_proj at 64 rows on the H200: 34.5 against 14.8 us at 32), so a
  // block takes at most 32 rows of x.
  static constexpr int kMaxWarpTiles = 1;
  static constexpr int kMaxXRows = 32;
  // A lane reads 32 bytes at byte 32 t of x row g: rows k_per_split + 16 bytes apart put the two
  // rows of an 8-lane phase on different banks.
  static constexpr int kXRowPad = 16;

  template <int NT, int WR>
  __device__ __forceinline__ static void step(int (&acc)[WR][NT][4], const int4 (&w)[WR][2], const int8_t* x_lane,
                                              int x_row_bytes, const int8_t* const (&multipliers)[WR][2],
                                              int group) {
    int sums[WR][NT][4] = {};
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const uint4* xv = reinterpret_cast<const uint4*>(x_lane + nt * 8 * x_row_bytes);
      const uint4 x0 = xv[0], x1 = xv[1];
      const uint32_t x_words[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};  // even, odd of word j
#pragma unroll
      for (int r = 0; r < WR; ++r) {
        const uint32_t lo[4] = {uint32_t(w[r][0].x), uint32_t(w[r][0].y), uint32_t(w[r][0].z), uint32_t(w[r][0].w)};
        const uint32_t hi[4] = {uint32_t(w[r][1].x), uint32_t(w[r][1].y), uint32_t(w[r][1].z), uint32_t(w[r][1].w)};
#pragma unroll
        for (int j = 0; j < 4; ++j)
          mma_s8(sums[r][nt],
                 {(lo[j] << 4) & 0xF0F0F0F0u, (hi[j] << 4) & 0xF0F0F0F0u, lo[j] & 0xF0F0F0F0u, hi[j] & 0xF0F0F0F0u},
                 x_words[2 * j], x_words[2 * j + 1]);
      }
    }
#pragma unroll
    for (int r = 0; r < WR; ++r) {
      const int row_g = __ldg(multipliers[r][0] + group), row_g8 = __ldg(multipliers[r][1] + group);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
#pragma unroll
        for (int v = 0; v < 4; ++v) acc[r][nt][v] += (sums[r][nt][v] >> 4) * (v < 2 ? row_g : row_g8);
    }
  }
};

// The group multipliers of a W4A8 weight (null for W8A8).
struct Groups {
  const int8_t* multipliers;  // [N, K / group_size]
  int group_size;
};

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(valid ? 16 : 0));
}

template <typename Codes, int NT, int WR>
struct Tile {
  static constexpr int kRows = 16 * WR * kBlockWarps;  // weight rows of a block
  static constexpr int kXRows = 8 * NT;                // x rows of a block (past M: zeros)
  static constexpr int kSteps = kWeightLoadsPerLane / (2 * WR);  // steps per loop iteration
  static constexpr int kIterationCodes = kSteps * Codes::kStepCodes;
  static constexpr int kPartialStride = kRows + kPartialPad;

  static int smem_bytes(int k_per_split) {
    return std::max(kXRows * (k_per_split + Codes::kXRowPad), kXRows * kPartialStride * 4);
  }
};

// Copies x[0:M, k_begin:k_end] to shared memory, rows x_row_bytes apart; rows past M and chunks
// past k_end are zero-filled. W4A8 then permutes every 8 bytes to their even bytes, then odd.
template <typename Codes, int kXRows>
__device__ __forceinline__ void stage_x(uint8_t* staged, const int8_t* x, int x_stride, int M, int k_begin, int k_end,
                                        int k_per_split, int x_row_bytes) {
  const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(staged));
  const int chunks = k_per_split / 16;
  for (int i = threadIdx.x; i < kXRows * chunks; i += kBlockThreads) {
    const int row = i / chunks, chunk = i % chunks;
    const int k = k_begin + 16 * chunk;
    const bool valid = row < M && k < k_end;
    cp_async_16(base + row * x_row_bytes + 16 * chunk, valid ? x + static_cast<int64_t>(row) * x_stride + k : x, valid);
  }
  asm volatile("cp.async.commit_group;\ncp.async.wait_group 0;" ::: "memory");
  if constexpr (Codes::kCodesPerByte == 2) {
    __syncthreads();
    for (int i = threadIdx.x; i < kXRows * x_row_bytes / 16; i += kBlockThreads) {
      uint4* p = reinterpret_cast<uint4*>(staged) + i;
      const uint4 v = *p;
      *p = make_uint4(__byte_perm(v.x, v.y, 0x6420), __byte_perm(v.x, v.y, 0x7531), __byte_perm(v.z, v.w, 0x6420),
                      __byte_perm(v.z, v.w, 0x7531));
    }
  }
}

// 16-byte pieces of weight rows g and g + 8 of each m16 tile, for kSteps steps from code k.
template <typename Codes, int WR, int kSteps>
__device__ __forceinline__ void load_weights(int4 (&wv)[kSteps][WR][2], const uint8_t* const (&rows)[WR][2], int k,
                                             int k_end, int t) {
#pragma unroll
  for (int s = 0; s < kSteps; ++s) {
    const int at = k + s * Codes::kStepCodes + t * (Codes::kStepCodes / 4);
#pragma unroll
    for (int r = 0; r < WR; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h)
        wv[s][r][h] = at < k_end ? __ldcs(reinterpret_cast<const int4*>(rows[r][h] + at / Codes::kCodesPerByte))
                                 : make_int4(0, 0, 0, 0);
  }
}

// grid (ceil(N / kRows), splits, x row groups), cluster (1, splits): block (i, s, z) sums rows
// [i kRows, (i+1) kRows) of the weight over K range s against x rows [z kXRows, (z+1) kXRows); the
// blocks of a cluster then each finish a share of the tile.
template <typename Codes, int NT, int WR, typename OutT>
__global__ void __launch_bounds__(kBlockThreads)
gemm_skinny_kernel(const int8_t* __restrict__ x, int x_stride, const uint8_t* __restrict__ w, OutT* __restrict__ out,
                   int M, int N, int K, int k_per_split, bool weight_is_constant, Groups groups, Epilogue epilogue) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using T = Tile<Codes, NT, WR>;
  extern __shared__ __align__(16) uint8_t smem[];
  const int first_x_row = blockIdx.z * T::kXRows;
  x += static_cast<int64_t>(first_x_row) * x_stride;
  out += static_cast<int64_t>(first_x_row) * N;
  M = min(M - first_x_row, T::kXRows);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int k_begin = blockIdx.y * k_per_split;
  const int k_end = min(K, k_begin + k_per_split);
  const int x_row_bytes = k_per_split + Codes::kXRowPad;

  const int row0 = blockIdx.x * T::kRows + warp * 16 * WR;
  const int groups_per_row = groups.multipliers ? K / groups.group_size : 0;
  const uint8_t* rows[WR][2];
  const int8_t* multipliers[WR][2];
#pragma unroll
  for (int r = 0; r < WR; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int64_t row = min(row0 + 16 * r + g + 8 * h, N - 1);
      rows[r][h] = w + row * (K / Codes::kCodesPerByte);
      multipliers[r][h] = groups.multipliers + row * groups_per_row;
    }

  // A constant weight is loaded before the wait, while the kernel before may still run; one that
  // kernel wrote (W4A8's expansion) only after it.
  int4 wv[T::kSteps][WR][2];
  if (weight_is_constant) load_weights<Codes>(wv, rows, k_begin, k_end, t);
  pdl_wait();
  if (!weight_is_constant) load_weights<Codes>(wv, rows, k_begin, k_end, t);
  stage_x<Codes, T::kXRows>(smem, x, x_stride, M, k_begin, k_end, k_per_split, x_row_bytes);
  __syncthreads();

  int acc[WR][NT][4] = {};
  const int8_t* x_lane = reinterpret_cast<const int8_t*>(smem) + g * x_row_bytes + t * (Codes::kStepCodes / 4);
  for (int k = k_begin; k < k_end; k += T::kIterationCodes) {
#pragma unroll
    for (int s = 0; s < T::kSteps; ++s) {
      const int step_k = k + s * Codes::kStepCodes;
      if (step_k >= k_end) break;  // the same for the whole warp
      Codes::step(acc, wv[s], x_lane + (step_k - k_begin), x_row_bytes, multipliers,
                  groups_per_row ? step_k / groups.group_size : 0);
    }
    if (k + T::kIterationCodes < k_end) load_weights<Codes>(wv, rows, k + T::kIterationCodes, k_end, t);
  }
  pdl_launch_dependents();

  __syncthreads();  // every warp is done with the staged x: its space takes the partial sums
  int* partial = reinterpret_cast<int*>(smem);
  store_partials(partial, T::kPartialStride, acc, warp * 16 * WR, g, t);
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();

  // Block s of the cluster finishes every splits-th group of 4 outputs of the tile's M x kRows.
  const int splits = gridDim.y, quads = M * T::kRows / 4;
  const int n_base = blockIdx.x * T::kRows;
  for (int i = blockIdx.y * kBlockThreads + threadIdx.x; i < quads; i += splits * kBlockThreads) {
    const int m = 4 * i / T::kRows, n_local = 4 * i % T::kRows;
    const int at = m * T::kPartialStride + n_local;
    const int4 sum = cluster_sum4(cluster, partial, at, splits);
    const int n = n_base + n_local;
    OutT* row = out + static_cast<int64_t>(m) * N;
    const int sums[4] = {sum.x, sum.y, sum.z, sum.w};
#pragma unroll
    for (int j = 0; j < 4; ++j)
      if (n + j < N) row[n + j] = epilogue.apply<OutT>(sums[j], n + j);
  }
  cluster.sync();  // no block may leave while others still read its shared memory
#else
  __trap();  // never launched: the host requires compute capability 9.0 (thread-block clusters)
#endif
}

// Work a launch takes: warp tiles per warp, the split of K, the rows of x a block takes (16, 32
// or 64; more rows in more blocks), and what follows from them.
struct Plan {
  int warp_tiles, splits, k_per_split, x_rows;
};

int tiles_of(int N, int warp_tiles) {
  const int rows = 16 * warp_tiles * kBlockWarps;
  return (N + rows - 1) / rows;
}

// The rows of x a block takes: M rounded up to 16, 32 or 64.
int x_rows_of(int M) { return M <= 16 ? 16 : M <= 32 ? 32 : 64; }

int x_groups_of(int M, int x_rows) { return (M + x_rows - 1) / x_rows; }

// Splits K into at most `splits` ranges of a multiple of kSplitAlign codes; returns the ranges used.
Plan split_k(int K, int warp_tiles, int splits, int x_rows) {
  const int per_split = ((K + splits - 1) / splits + kSplitAlign - 1) / kSplitAlign * kSplitAlign;
  return {warp_tiles, (K + per_split - 1) / per_split, per_split, x_rows};
}

int most_splits_of(int K) { return std::min(kMaxSplits, (K + kSplitAlign - 1) / kSplitAlign); }

// Shared memory a block stages x in (at most kXRowPad = 64 bytes of padding a row).
int staged_bytes(int x_rows, int k_per_split) { return x_rows * (k_per_split + Int8Codes::kXRowPad); }

// About two blocks per SM: two m16 tiles of weight rows per warp where the tiles alone fill 8
// splits' worth of blocks, else one; the fewest splits of K that reach 2 * sms blocks, and as many
// as it takes for x's staged range to fit in shared memory. Where every split of K still leaves
// fewer blocks (a narrow weight: x_proj's 192 rows are 3 tiles), x's rows are spread over blocks
// of 32 or 16 rows until they fill the SMs: each block's chain of staging, MMAs and cluster
// reduction is shorter (graph replays on an H100: int8 x_proj 4.85 -> 4.68 us at 32 rows, 5.47 ->
// 5.51 at 64, within noise; 4-bit x_proj 7.16 -> 6.10 at 64, in_proj 34.6 -> 29.4 with its cap).
Plan choose_plan(int M, int N, int K, int sms, int max_warp_tiles, int max_x_rows) {
  const int most_splits = most_splits_of(K);
  const int warp_tiles = max_warp_tiles == 2 && tiles_of(N, 2) * std::min(8, most_splits) >= 2 * sms ? 2 : 1;
  const int tiles = tiles_of(N, warp_tiles);
  const int x_rows = std::min(x_rows_of(M), max_x_rows);
  int splits = 1;
  while (splits < most_splits && (tiles * splits < 2 * sms ||
                                  staged_bytes(x_rows, split_k(K, warp_tiles, splits, x_rows).k_per_split) >
                                      kMaxStagedBytes))
    splits *= 2;
  Plan plan = split_k(K, warp_tiles, std::min(splits, most_splits), x_rows);
  while (plan.x_rows > 16 && tiles * plan.splits * x_groups_of(M, plan.x_rows) < sms) plan.x_rows /= 2;
  return plan;
}

template <typename Codes, int NT, int WR, typename OutT>
void launch(const GemmArgs& a, const Plan& p, bool weight_is_constant, const Groups& groups) {
  const auto kernel = gemm_skinny_kernel<Codes, NT, WR, OutT>;
  check_kernel_image(reinterpret_cast<const void*>(kernel), "skinny GEMM");
  const int smem = Tile<Codes, NT, WR>::smem_bytes(p.k_per_split);
  const int staged = staged_bytes(p.x_rows, p.k_per_split);
  TORCH_CHECK(staged <= kMaxStagedBytes, "skinny GEMM: K = ", a.K, " in ", p.splits, " splits stages ", staged,
              " bytes of x, more than ", kMaxStagedBytes);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (p.splits > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  launch_clusters_with_pdl(kernel, dim3(tiles_of(a.N, WR), p.splits, x_groups_of(a.M, p.x_rows)), dim3(1, p.splits, 1),
                           dim3(kBlockThreads), smem, a.stream, a.x, a.x_stride, reinterpret_cast<const uint8_t*>(a.w),
                           static_cast<OutT*>(a.out), a.M, a.N, a.K, p.k_per_split, weight_is_constant, groups,
                           Epilogue::from(a));
}

// The plan from the shape, or as given (warp_tiles, splits, x_rows: 0 = chosen), then the kernel
// of the weight format, x's row tiles, the warp tiles and the output type.
template <typename Codes>
void launch_planned(const GemmArgs& a, const SkinnyPlan& asked, bool weight_is_constant, const Groups& groups) {
  TORCH_CHECK(a.M >= 1 && a.M <= kSkinnyMaxM, "skinny GEMM: x must have 1 to ", kSkinnyMaxM, " rows, got ", a.M);
  TORCH_CHECK(asked.warp_tiles >= 0 && asked.warp_tiles <= Codes::kMaxWarpTiles, "skinny GEMM: warp_tiles must be 1 to ",
              Codes::kMaxWarpTiles, " (0: chosen), got ", asked.warp_tiles);
  TORCH_CHECK(asked.splits >= 0 && asked.splits <= kMaxSplits, "skinny GEMM: splits must be 1 to ", kMaxSplits,
              " (0: chosen), got ", asked.splits);
  TORCH_CHECK(asked.x_rows == 0 || ((asked.x_rows == 16 || asked.x_rows == 32 || asked.x_rows == 64) &&
                                    asked.x_rows <= Codes::kMaxXRows),
              "skinny GEMM: x_rows must be 16, 32", Codes::kMaxXRows == 64 ? " or 64" : "", " (0: chosen), got ",
              asked.x_rows);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  Plan p = choose_plan(a.M, a.N, a.K, sms, Codes::kMaxWarpTiles, Codes::kMaxXRows);
  if (asked.warp_tiles != 0 || asked.splits != 0 || asked.x_rows != 0)
    p = split_k(a.K, asked.warp_tiles != 0 ? asked.warp_tiles : p.warp_tiles,
                asked.splits != 0 ? asked.splits : p.splits, asked.x_rows != 0 ? asked.x_rows : p.x_rows);
  dispatch_out_type(a.out_type, [&](auto tag) {
    using OutT = decltype(tag);
    const auto with_tiles = [&](auto x_tiles) {
      constexpr int NT = decltype(x_tiles)::value;
      if constexpr (Codes::kMaxWarpTiles == 2)
        if (p.warp_tiles == 2) return launch<Codes, NT, 2, OutT>(a, p, weight_is_constant, groups);
      launch<Codes, NT, 1, OutT>(a, p, weight_is_constant, groups);
    };
    switch (p.x_rows) {
      case 16: return with_tiles(std::integral_constant<int, 2>{});
      case 32: return with_tiles(std::integral_constant<int, 4>{});
      default:
        if constexpr (Codes::kMaxXRows == 64) return with_tiles(std::integral_constant<int, 8>{});
    }
  });
}

// Every 128-code step of the 4-bit format lies in one group.
bool groups_hold_steps(int K, int group_size) {
  return group_size % Int4Codes::kStepCodes == 0 || (group_size == K && K <= Int4Codes::kStepCodes);
}

}  // namespace

bool gemm_skinny_can_run(int M, int K) {
  if (M < 1 || M > kSkinnyMaxM || at::cuda::getCurrentDeviceProperties()->major < 9) return false;
  return staged_bytes(x_rows_of(M), split_k(K, 1, most_splits_of(K), x_rows_of(M)).k_per_split) <= kMaxStagedBytes;
}

bool w4a8_skinny_can_run(int M, int K, int group_size) {
  return groups_hold_steps(K, group_size) && gemm_skinny_can_run(M, K);
}

void launch_gemm_skinny(const GemmArgs& a, const SkinnyPlan& plan, bool weight_is_constant) {
  launch_planned<Int8Codes>(a, plan, weight_is_constant, Groups{nullptr, 0});
}

void launch_w4a8_skinny(const GemmArgs& a, const int8_t* group_multiplier, int group_size, const SkinnyPlan& plan) {
  TORCH_CHECK(groups_hold_steps(a.K, group_size), "skinny W4A8 GEMM: needs group_size % 128 == 0 or one group of at "
              "most 128 codes, got K = ", a.K, ", group_size = ", group_size);
  launch_planned<Int4Codes>(a, plan, /*weight_is_constant=*/true, Groups{group_multiplier, group_size});
}

}  // namespace quamba::gemm
