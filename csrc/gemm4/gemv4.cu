// Decode GEMVs (M = 1..8) on 4-bit weights: the packed rows are streamed once with 16-byte
// streaming loads (ld.global.cs: read once, evict first; several per lane in flight) and the few
// activation rows are read from L2. Both are launched with programmatic dependence (pdl.cuh): the
// first weight loads are issued before waiting for the kernel that writes x. A 16-byte chunk holds
// 32 codes of one group (G % 32 == 0).
//
// W4A8 (dp4a): a lane takes whole chunks. Nibbles are moved to the top of each byte with one shift
// and one AND ((w << 4) & 0xF0F0F0F0 holds the even k, w & 0xF0F0F0F0 the odd k, each as 16 *
// code in int8) and multiplied with the even / odd bytes of x (two byte permutes per 8 bytes of
// x, shared by the 4 rows of a warp); the chunk's int32 sum is exact, divided by 16 exactly,
// multiplied by the group's int8 multiplier and added. Exact for any int8 multiplier. `splits`
// warps share a row group's K range (as the W8A8 GEMV, gemm/gemv.cu).
//
// W4A8 (mma.sync m16n8k32, s8 in, s32 accumulate): the tensor-core GEMV below with the same
// nibble trick in A (even codes of a word against the even bytes of 8 activations, odd against
// odd) and exact int32 totals; it wins where the weight rows fill the GPU or M grows
// (use_tensor_cores).
//
// W4A16 (CUDA cores, M = 1): as the dp4a GEMV, a lane takes whole chunks of 4 rows, with fp32
// products and sums; it wins for layers with few rows (x_proj).
//
// W4A16 (mma.sync m16n8k16, f16 or bf16 in, f32 accumulate): A = 16 weight rows, B = the
// activations (column m = x row m; columns past M only reach outputs that are never written). Lane
// (g, t) = (lane / 4, lane % 4) loads chunk 4 * step + t of weight rows g and g + 8 of each of the
// warp's R tiles and the same 32 activations of x row g, so a step covers 128 k; the order of k
// inside an mma only has to be the same in A and B, so the packed rows are used as they are. A
// 32-bit word of codes gives the pairs (k, k + 4) in one lop3 each (nibble mask, sign flip and the
// exponent of 1024 (f16) or 128 (bf16)) and one fma to exact f16/bf16 codes (f16 takes the odd
// nibbles in place, 16 times larger); x is permuted to the same pairs once for the R tiles. Each
// step's fp32 mma output covers one group when G % 128 == 0 and is multiplied by the fp32 group
// scale of its weight row into fp32 totals; for G = 32, 64, 96, ... each of the H groups a step can
// touch is a pass of the mmas with the other lanes' activations masked to zero. Each lane keeps D
// steps of weights, scales and activations in flight in a ring refilled as each step is used.
// Layers with few 16-row tiles split K 8 or 16 ways in blocks of as many warps (block_splits).
// W4A16 measured on an H100 (benchmarks/bench_gemm4.py timing, M = 1, 4 splits): in_proj (N 10240,
// K 2560) 7.66 us (57% of the copy bandwidth) against 14.1 for the previous kernel (B = 8 weight
// rows, A = activations with half of every mma zero) and 24.8 for fp16; out_proj (2560 x 5120)
// 6.27 against 8.60 and 14.2 (5.47 in 8 splits); x_proj (192 x 5120) 3.24 against 4.90 and 6.62
// (2.72 in 16 splits, 1.98 on CUDA cores). Per-warp latency still bounds it (the fastest split is
// always the most warps): tried and slower were batches of steps loaded together and then used
// (in_proj 8.3 us at best), x loaded only one step ahead of use, L2 prefetches of x or of the
// weights further ahead, splitting a tile's K over the blocks of a thread block cluster (sm_90;
// x_proj 2.68 us in 32 splits, out_proj 6.19 in 8), weights copied 4-8 steps ahead into shared
// memory with cp.async (every tensor-core variant 0-18% slower), W4A16 codes left biased (no
// fma, the bias taken off by constant mmas: no faster), four mma chains per tile instead of two (no
// faster) and x staged once per block in shared memory instead of the ring (no registers freed;
// -2% to +36% at the same ring depths, deeper rings spilled). Nsight Compute on out_proj (8 splits: 160
// blocks on 132 SMs) finds the SMs active only 59-62% of the time, the blocks spread unevenly
// (benchmarks/RESULTS.md); spreading the work evenly was slower still: each tile's K split 13 ways
// over the warps of any block (16 warps on every SM), the splits' totals added by the tile's last
// warp through a global workspace (fence, atomic arrival count): out_proj 6.46 us (W4A8 6.21)
// against 5.53 (4.65) in blocks of 8 splits. The activations cost W4A16 about 1 us of that: with
// the lanes' x loads left out (zero activations, timing only) out_proj took 4.56 us in 8 splits
// against 5.55, and in_proj 7.51 against 8.32. Loaded by whole warps through shared memory (x_loads,
// below) they cost less from M = 2 or 3 on, where more lanes load x, but not at M = 1. Tried and
// slower: K segments in B's unused columns at small M (a warp's tile 16 / S rows of S segments of
// K, for finer row groups over the SMs), as every lane then loads x: out_proj 8.19 us with 2
// segments, 20.9 with 8; with x left out 5.15 and 5.25, still slower than 4.56 in 16-row tiles.
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "float_convert.cuh"
#include "gemm/epilogue.cuh"
#include "gemm/gemv_common.cuh"
#include "gemm/mma.cuh"
#include "gemm4/gemm4.h"
#include "gemm4/half_codes.cuh"
#include "pdl.cuh"

namespace quamba::gemm4 {
namespace {

using gemm::Epilogue;
using gemm::kLoadsPerLane;  // CUDA-core GEMVs: kCoreRows rows x (8 / kCoreRows) 16-byte chunks in flight per lane
using gemm::kThreads;
using gemm::kWarps;
using gemm::load_streaming;

// Group of chunk c: c >> shift when the chunks per group are a power of two, else c / per_group.
struct GroupOf {
  int per_group, shift;
  static GroupOf make(int group_size) {
    const int per_group = group_size / kCodesPerChunk;
    int shift = 0;
    while ((1 << shift) < per_group) ++shift;
    return {per_group, (1 << shift) == per_group ? shift : -1};
  }
  __device__ __forceinline__ int operator()(int c) const { return shift >= 0 ? c >> shift : c / per_group; }
};

// ---------------------------------------------------------------------------------------------
// Formats: what the W4A8 and W4A16 GEMVs differ in (activations, group scales, accumulators).

// W4A16: f16/bf16 activations, fp16 group scales, fp32 totals.
template <typename XT>
struct HalfFormat {
  using X = XT;
  using Scale = __half;
  using Total = float;
  static constexpr int kXVectors = 4;  // 16-byte vectors of x per lane and step: 32 activations
  static constexpr bool kWideWarps = true;  // 4 tiles per warp where N is large (w4a16_wide_warps)
};

// W4A8: int8 activations, int8 group multipliers, int32 totals (exact).
struct Int8Format {
  using X = int8_t;
  using Scale = int8_t;
  using Total = int;
  static constexpr int kXVectors = 2;
  static constexpr bool kWideWarps = false;  // one tile per warp was always faster (launch_w4a8_mma)
};

// A GEMV's operands, typed by its format.
template <typename F>
struct Operands {
  const typename F::X* x;
  const uint8_t* w;
  const typename F::Scale* scales;
  void* out;
  int M, N, K, group_size;
  cudaStream_t stream;
};

// W4A16's output: the fp32 total cast to the output type (W4A8's: gemm::Epilogue).
struct CastOutput {
  template <typename OutT>
  __device__ __forceinline__ OutT apply(float total, int) const { return from_float<OutT>(total); }
};

// ---------------------------------------------------------------------------------------------
// On CUDA cores: a lane takes whole 16-byte chunks (32 codes of one group) of kCoreRows weight
// rows and the matching activations of each x row; `splits` warps share a row group's K range (as
// the W8A8 GEMV, gemm/gemv.cu).

constexpr int kCoreRows = 4;  // weight rows per warp
constexpr int kW4A8CoreMaxM = 2;   // M past these take the tensor cores (use_tensor_cores)
constexpr int kW4A16CoreMaxM = 1;

// W4A8 (dp4a): chunk sum of 16 * code * x over one weight chunk against the even (xe) and odd (xo)
// bytes of the matching 32 activations.
__device__ __forceinline__ int chunk_dot(int4 w, const int (&xe)[4], const int (&xo)[4]) {
  const int words[4] = {w.x, w.y, w.z, w.w};
  int acc = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int even = static_cast<int>((static_cast<unsigned>(words[j]) << 4) & 0xF0F0F0F0u);
    const int odd = static_cast<int>(static_cast<unsigned>(words[j]) & 0xF0F0F0F0u);
    acc = __dp4a(even, xe[j], acc);
    acc = __dp4a(odd, xo[j], acc);
  }
  return acc;
}

// acc[r][m] += chunk c of weight row r (w[r], group multiplier multiplier[r]) against x row m.
// The int32 chunk sum is exact, divided by 16 exactly and multiplied by the int8 multiplier.
template <int M>
__device__ __forceinline__ void add_chunk(int (&acc)[kCoreRows][M], const int8_t* __restrict__ x, int chunks, int c,
                                          const int4 (&w)[kCoreRows], const int (&multiplier)[kCoreRows]) {
#pragma unroll
  for (int m = 0; m < M; ++m) {
    const int4* xc = reinterpret_cast<const int4*>(x) + static_cast<int64_t>(m) * chunks * 2 + 2 * c;
    const int4 x0 = __ldcg(xc), x1 = __ldcg(xc + 1);
    const int xe[4] = {static_cast<int>(__byte_perm(x0.x, x0.y, 0x6420)),
                       static_cast<int>(__byte_perm(x0.z, x0.w, 0x6420)),
                       static_cast<int>(__byte_perm(x1.x, x1.y, 0x6420)),
                       static_cast<int>(__byte_perm(x1.z, x1.w, 0x6420))};
    const int xo[4] = {static_cast<int>(__byte_perm(x0.x, x0.y, 0x7531)),
                       static_cast<int>(__byte_perm(x0.z, x0.w, 0x7531)),
                       static_cast<int>(__byte_perm(x1.x, x1.y, 0x7531)),
                       static_cast<int>(__byte_perm(x1.z, x1.w, 0x7531))};
#pragma unroll
    for (int r = 0; r < kCoreRows; ++r) acc[r][m] += (chunk_dot(w[r], xe, xo) >> 4) * multiplier[r];
  }
}

// W4A16 (fp32 fma, M = 1; more rows per warp of few-row layers than in 16-row tiles). On the H100
// (benchmarks/bench_gemm4.py): x_proj at M = 1 in 1.98 us against 2.72 on tensor cores; at M = 2
// it took 4.13 against 2.79, and out_proj 9.84 against 5.47, so it takes M = 1 and few rows only.
template <typename XT>
__device__ __forceinline__ float2 pair_to_float2(uint32_t pair);
template <>
__device__ __forceinline__ float2 pair_to_float2<__half>(uint32_t pair) {
  return __half22float2(*reinterpret_cast<const __half2*>(&pair));
}
template <>
__device__ __forceinline__ float2 pair_to_float2<__nv_bfloat16>(uint32_t pair) {
  return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&pair));
}

// The 32 codes of a 16-byte chunk as fp32, in k order: a word's exact f16/bf16 pairs (code q,
// code q + 4) of Act<>::decode, made fp32.
template <typename XT>
__device__ __forceinline__ void chunk_codes(int4 w, float (&codes)[kCodesPerChunk]) {
  const int words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t p[4];
    Act<XT>::decode(static_cast<uint32_t>(words[j]), p);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 pair = pair_to_float2<XT>(p[q]);
      codes[8 * j + q] = pair.x;
      codes[8 * j + q + 4] = pair.y;
    }
  }
}

// The 32 activations of chunk c of an x row (16-byte vectors), as fp32; L2 hits, not L1 (pdl.cuh).
template <typename XT>
__device__ __forceinline__ void chunk_activations(const uint4* row, int c, float (&xf)[kCodesPerChunk]) {
#pragma unroll
  for (int v = 0; v < 4; ++v) {
    const uint4 q = __ldcg(row + 4 * c + v);
    const uint32_t words[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = pair_to_float2<XT>(words[i]);
      xf[8 * v + 2 * i] = pair.x;
      xf[8 * v + 2 * i + 1] = pair.y;
    }
  }
}

// acc[r][0] += chunk c of weight row r against the x row: fp32 products and sums, the chunk's sum
// times the fp32 group scale.
template <int M, typename XT>
__device__ __forceinline__ void add_chunk(float (&acc)[kCoreRows][M], const XT* __restrict__ x, int, int c,
                                          const int4 (&w)[kCoreRows], const float (&scale)[kCoreRows]) {
  static_assert(M == kW4A16CoreMaxM, "the CUDA-core W4A16 GEMV takes one x row");
  float xf[kCodesPerChunk];
  chunk_activations<XT>(reinterpret_cast<const uint4*>(x), c, xf);
#pragma unroll
  for (int r = 0; r < kCoreRows; ++r) {
    float codes[kCodesPerChunk];
    chunk_codes<XT>(w[r], codes);
    float even = 0.f, odd = 0.f;  // two FMA chains
#pragma unroll
    for (int k = 0; k < kCodesPerChunk; k += 2) {
      even = fmaf(codes[k], xf[k], even);
      odd = fmaf(codes[k + 1], xf[k + 1], odd);
    }
    acc[r][0] = fmaf(even + odd, scale[r], acc[r][0]);
  }
}

__device__ __forceinline__ int widen(int8_t multiplier) { return multiplier; }
__device__ __forceinline__ float widen(__half scale) { return __half2float(scale); }

// Sums over chunks [begin, end) of rows row0..row0+R-1 (rows past N re-read row N - 1; the caller
// drops them). Returns, in lane r * M + m, the warp's sum for (row0 + r, m).
template <typename F, int M>
__device__ __forceinline__ typename F::Total core_row_group_sums(
    const typename F::X* __restrict__ x, const uint8_t* __restrict__ w, const typename F::Scale* __restrict__ scales,
    int N, int chunks, int groups, GroupOf group_of, int row0, int begin, int end, int lane) {
  // (16 loads per lane for M <= 2, so that in_proj's rows take one pass, was slower on the H100
  // for W4A8: 8.5 vs 7.4 us for in_proj at M = 1, from the registers it costs.)
  constexpr int R = kCoreRows;
  constexpr int kSteps = kLoadsPerLane / R;
  const int4* w_rows[R];
  const typename F::Scale* s_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = min(row0 + r, N - 1);
    w_rows[r] = reinterpret_cast<const int4*>(w + row * chunks * 16);
    s_rows[r] = scales + row * groups;
  }
  typename F::Total acc[R][M] = {};
  bool waited = false;
  for (int c = begin + lane; c < end; c += 32 * kSteps) {
    int4 wv[kSteps][R];
    typename F::Total scale[kSteps][R];  // as the accumulators
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
      if (c + 32 * s < end) {
        const int group = group_of(c + 32 * s);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          wv[s][r] = load_streaming(w_rows[r] + c + 32 * s);
          scale[s][r] = widen(__ldg(s_rows[r] + group));
        }
      }
    if (!waited) {  // the first weights are on their way: now wait for x (pdl.cuh)
      pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
      if (c + 32 * s < end) add_chunk<M>(acc, x, chunks, c + 32 * s, wv[s], scale[s]);
  }
  return gemm::lane_sum(acc, lane);
}

template <typename F, int M, typename OutT, typename Finish>
__global__ void __launch_bounds__(kThreads)
core_gemv_kernel(const typename F::X* __restrict__ x, const uint8_t* __restrict__ w,
                 const typename F::Scale* __restrict__ scales, OutT* __restrict__ out, int N, int K,
                 GroupOf group_of, int splits, Finish finish) {
  constexpr int R = kCoreRows;
  static_assert(R * M <= 32, "one output per lane");
  __shared__ typename F::Total partial[kWarps][1][32];
  pdl_launch_dependents();
  const int chunks = K / kCodesPerChunk;
  const int groups = chunks / group_of.per_group;
  const gemm::WarpShare s = gemm::warp_share(R, N, chunks, splits);
  typename F::Total sum =
      core_row_group_sums<F, M>(x, w, scales, N, chunks, groups, group_of, s.row0, s.begin, s.end, s.lane);
  pdl_wait();  // warps with no share of K have not waited yet
  if (!gemm::combine_splits<1>(partial, &sum, s, splits)) return;
  const int n = s.row0 + s.lane / M;
  if (s.lane < R * M && n < N)
    out[static_cast<int64_t>(s.lane % M) * N + n] = finish.template apply<OutT>(sum, n);
}

int choose_splits(int work_items, int sweeps, int target_warps) {
  int splits = 1;
  while (splits < kWarps && work_items * splits < target_warps && sweeps >= 2 * splits) splits *= 2;
  return splits;
}

template <typename F, int M, typename OutT, typename Finish>
void launch_core_kernel(const Operands<F>& a, int splits, Finish finish) {
  const auto kernel = core_gemv_kernel<F, M, OutT, Finish>;
  gemm::check_kernel_image(reinterpret_cast<const void*>(kernel), "4-bit CUDA-core GEMV");
  const int groups_per_block = kWarps / splits;
  const int blocks = ((a.N + kCoreRows - 1) / kCoreRows + groups_per_block - 1) / groups_per_block;
  launch_with_pdl(kernel, blocks, kThreads, 0, a.stream, a.x, a.w, a.scales, static_cast<OutT*>(a.out), a.N, a.K,
                  GroupOf::make(a.group_size), splits, finish);
}

// ---------------------------------------------------------------------------------------------
// On tensor cores (mma.sync; W4A16 m16n8k16, W4A8 m16n8k32)

constexpr int kTileRows = 16;  // weight rows of one mma tile (A)

// What one step (128 k) needs from memory, per lane: chunk 4 * step + t of the lane's weight rows
// (rows g and g + 8 of tile r in w[2r], w[2r + 1]), their scales for the step's H groups, and the
// same 32 activations of x row g (with shared x loads: the lane's share of the step's x until
// share_x swaps it for those).
template <typename F, int R, int H>
struct Stage {
  int4 w[2 * R];
  typename F::Scale scale[H][2 * R];
  uint4 x[F::kXVectors];
};

// Where a lane reads: its weight rows row0 + 8 i + g (past N: row N - 1), their scale rows and x
// row g.
template <typename F, int R>
struct LaneRows {
  const int4* w[2 * R];
  const typename F::Scale* scales[2 * R];
  const uint4* x;
  bool has_x;  // g < M: the other lanes' B columns only reach outputs that are never written
  const uint4* x_rows;  // x row 0 (shared loads)
  int lane, M, x_row_vectors;
  int t, chunks, groups;
  GroupOf group_of;
  // The lane's chunk of `step`. With H = 1 (G % 128 == 0, so K % 128 == 0) every step is whole;
  // otherwise the last one may pass K: clamped, its codes are zeroed by load_weights.
  template <int H>
  __device__ __forceinline__ int chunk(int step) const {
    return H == 1 ? 4 * step + t : min(4 * step + t, chunks - 1);
  }
};

template <typename F, int R, int H>
__device__ __forceinline__ void load_weights(Stage<F, R, H>& s, const LaneRows<F, R>& rows, int step) {
  const int c = rows.template chunk<H>(step);
  const int first = rows.group_of(4 * step);
#pragma unroll
  for (int i = 0; i < 2 * R; ++i) s.w[i] = load_streaming(rows.w[i] + c);
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int i = 0; i < 2 * R; ++i) s.scale[h][i] = __ldg(rows.scales[i] + min(first + h, rows.groups - 1));
  if (H > 1 && 4 * step + rows.t >= rows.chunks)
#pragma unroll
    for (int i = 0; i < 2 * R; ++i) s.w[i] = make_int4(0, 0, 0, 0);
}

// L2 hits, not L1 (pdl.cuh).
template <typename F, int R, int H>
__device__ __forceinline__ void load_x(Stage<F, R, H>& s, const LaneRows<F, R>& rows, int step) {
  const uint4* p = rows.x + F::kXVectors * rows.template chunk<H>(step);
  if (rows.has_x)
#pragma unroll
    for (int k = 0; k < F::kXVectors; ++k) s.x[k] = __ldcg(p + k);
}

// Shared loads of x (H = 1): a step's x is M rows of 4 * kXVectors 16-byte vectors; lane L loads
// vectors L, L + 32, ... of it (coalesced: each 128-byte line once per warp, where the lanes' own
// loads touch it 4 times in W4A16) into its stage, and share_x hands each lane its own vectors
// through the warp's slot in shared memory. Every tile's warps read the same x from L2.
template <typename F, int R, int H>
__device__ __forceinline__ void load_x_shared(Stage<F, R, H>& s, const LaneRows<F, R>& rows, int step) {
  constexpr int kRowVectors = 4 * F::kXVectors;
#pragma unroll
  for (int v = 0; v < F::kXVectors; ++v) {
    const int q = rows.lane + 32 * v;
    if (q < rows.M * kRowVectors)
      s.x[v] = __ldcg(rows.x_rows + static_cast<int64_t>(q / kRowVectors) * rows.x_row_vectors + kRowVectors * step +
                      q % kRowVectors);
  }
}

// Slot position of vector u of x row m: lane (g, t) reads vectors 4t + j (f16) or 2t + j (int8) in
// the order j = 0, 1, ...; rotating them by t keeps the 4 lanes of a row on different banks.
template <typename F>
__device__ __forceinline__ int slot_of(int m, int u) {
  constexpr int V = F::kXVectors;
  const int t = u / V, j = u % V;
  return m * 4 * V + t * V + (j + t) % V;
}

template <typename F, int R, int H>
__device__ __forceinline__ void share_x(Stage<F, R, H>& s, uint4* slot, const LaneRows<F, R>& rows) {
  constexpr int V = F::kXVectors, kRowVectors = 4 * V;
#pragma unroll
  for (int v = 0; v < V; ++v) {
    const int q = rows.lane + 32 * v;
    if (q < rows.M * kRowVectors) slot[slot_of<F>(q / kRowVectors, q % kRowVectors)] = s.x[v];
  }
  __syncwarp();
  const int g = rows.lane / 4;
#pragma unroll
  for (int j = 0; j < V; ++j) s.x[j] = rows.has_x ? slot[slot_of<F>(g, V * rows.t + j)] : make_uint4(0, 0, 0, 0);
  __syncwarp();
}

// total[r][e] += scaled(pass sum, scale of its row) over a step's H passes; a pass's sum is the
// step's two mma accumulators (rows g and g + 8 of tile r: e / 2).
template <typename Total, typename Acc, typename Scale, int R, int H, typename Scaled>
__device__ __forceinline__ void add_passes(Total (&total)[R][4], const Acc (&d)[H][R][2][4],
                                           const Scale (&scale)[H][2 * R], Scaled scaled) {
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < 4; ++e) total[r][e] += scaled(d[h][r][0][e] + d[h][r][1][e], scale[h][2 * r + e / 2]);
}

// Adds one step to total[r]: A = 16 weight rows of tile r, B = the activations (column m = x row
// m), shared by the R tiles; two mma chains per tile. Pass h of H takes only the lanes whose chunk
// lies in the step's h-th group and is scaled by that group's scales. total[r] = (row g, m 2t),
// (row g, m 2t + 1), (row g + 8, m 2t), (row g + 8, m 2t + 1) of tile r.
template <typename XT, int R, int H>
__device__ __forceinline__ void accumulate_step(float (&total)[R][4], const Stage<HalfFormat<XT>, R, H>& s,
                                                int phase) {
  float d[H][R][2][4] = {};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    uint32_t xp[4];
    x_pairs(s.x[j], xp);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int lo_words[4] = {s.w[2 * r].x, s.w[2 * r].y, s.w[2 * r].z, s.w[2 * r].w};
      const int hi_words[4] = {s.w[2 * r + 1].x, s.w[2 * r + 1].y, s.w[2 * r + 1].z, s.w[2 * r + 1].w};
      uint32_t lo[4], hi[4];
      Act<XT>::decode(static_cast<uint32_t>(lo_words[j]), lo);
      Act<XT>::decode(static_cast<uint32_t>(hi_words[j]), hi);
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const bool use = H == 1 || phase == h;
        Act<XT>::mma(d[h][r][0], lo[0], hi[0], lo[1], hi[1], use ? xp[0] : 0u, use ? xp[1] : 0u);
        Act<XT>::mma(d[h][r][1], lo[2], hi[2], lo[3], hi[3], use ? xp[2] : 0u, use ? xp[3] : 0u);
      }
    }
  }
  add_passes(total, d, s.scale, [](float sum, __half scale) { return sum * __half2float(scale); });
}

// W4A8's step (m16n8k32, int8 in, int32 accumulate). Word j of a weight chunk gives 16 * its even
// codes ((w << 4) & 0xF0F0F0F0) and 16 * its odd codes (w & 0xF0F0F0F0) as int8 in one or two
// operations, against the even and odd bytes of the same 8 activations: the k of an mma only
// have to pair up the same in A and B. A pass's int32 sum (one group's, exact) is divided by 16
// exactly and multiplied by the group's int8 multiplier: exact for any multiplier.
template <int R, int H>
__device__ __forceinline__ void accumulate_step(int (&total)[R][4], const Stage<Int8Format, R, H>& s, int phase) {
  const uint32_t xw[8] = {s.x[0].x, s.x[0].y, s.x[0].z, s.x[0].w, s.x[1].x, s.x[1].y, s.x[1].z, s.x[1].w};
  int d[H][R][2][4] = {};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t x_even = __byte_perm(xw[2 * j], xw[2 * j + 1], 0x6420);
    const uint32_t x_odd = __byte_perm(xw[2 * j], xw[2 * j + 1], 0x7531);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int lo_words[4] = {s.w[2 * r].x, s.w[2 * r].y, s.w[2 * r].z, s.w[2 * r].w};
      const int hi_words[4] = {s.w[2 * r + 1].x, s.w[2 * r + 1].y, s.w[2 * r + 1].z, s.w[2 * r + 1].w};
      const uint32_t lo = static_cast<uint32_t>(lo_words[j]), hi = static_cast<uint32_t>(hi_words[j]);
      const uint32_t lo_even = (lo << 4) & 0xF0F0F0F0u, lo_odd = lo & 0xF0F0F0F0u;
      const uint32_t hi_even = (hi << 4) & 0xF0F0F0F0u, hi_odd = hi & 0xF0F0F0F0u;
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const bool use = H == 1 || phase == h;
        gemm::mma_s8(d[h][r][j % 2], {lo_even, hi_even, lo_odd, hi_odd}, use ? x_even : 0u, use ? x_odd : 0u);
      }
    }
  }
  add_passes(total, d, s.scale, [](int sum, int8_t multiplier) { return (sum >> 4) * multiplier; });
}

// Blocks of `Warps` warps: kWarps, or one row group's 8 or 16 splits (block_splits), held to 128
// registers so that 16 warps fit an SM.
template <int Warps>
constexpr int kMinBlocks = Warps == kWarps ? 1 : 16 / Warps;

// R tiles of 16 weight rows per warp; D steps in flight per lane, in a ring refilled as each step
// is used; x loaded per lane or, with kSharedX, by the warp (load_x_shared). `finish` turns a row's
// total into its output (W4A8: gemm::Epilogue).
template <typename F, typename OutT, int R, int D, int H, int Warps, bool kSharedX, typename Finish>
__global__ void __launch_bounds__(Warps * 32, kMinBlocks<Warps>)
mma_gemv_kernel(const typename F::X* __restrict__ x, const uint8_t* __restrict__ w,
                const typename F::Scale* __restrict__ scales, OutT* __restrict__ out, int M, int N, int K,
                GroupOf group_of, int splits, Finish finish) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  static_assert(!kSharedX || H == 1, "shared x loads take whole steps");
  using Total = typename F::Total;
  __shared__ Total partial[Warps][4 * R][32];
  __shared__ uint4 x_slot[kSharedX ? Warps : 1][32 * F::kXVectors];
  pdl_launch_dependents();
  const int chunks = K / kCodesPerChunk;
  const int groups = chunks / group_of.per_group;
  const gemm::WarpShare share = gemm::warp_share<Warps>(kTileRows * R, N, (chunks + 3) / 4, splits);
  const int begin = share.begin, end = share.end;
  const int g = share.lane / 4, t = share.lane % 4;
  LaneRows<F, R> rows;
#pragma unroll
  for (int i = 0; i < 2 * R; ++i) {
    const int64_t row = min(share.row0 + 8 * i + g, N - 1);
    rows.w[i] = reinterpret_cast<const int4*>(w) + row * chunks;
    rows.scales[i] = scales + row * groups;
  }
  rows.x = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(min(g, M - 1)) * K);
  rows.has_x = g < M;
  rows.x_rows = reinterpret_cast<const uint4*>(x);
  rows.lane = share.lane;
  rows.M = M;
  rows.x_row_vectors = K * static_cast<int>(sizeof(typename F::X)) / 16;
  rows.t = t;
  rows.chunks = chunks;
  rows.groups = groups;
  rows.group_of = group_of;

  Stage<F, R, H> ring[D] = {};  // lanes without x keep zero activations
#pragma unroll
  for (int b = 0; b < D; ++b)
    if (begin + b < end) load_weights(ring[b], rows, begin + b);
  pdl_wait();  // the first weights are on their way: now wait for x (pdl.cuh)
#pragma unroll
  for (int b = 0; b < D; ++b)
    if (begin + b < end) {
      if constexpr (kSharedX) load_x_shared(ring[b], rows, begin + b);
      else load_x(ring[b], rows, begin + b);
    }
  Total total[R][4] = {};
  for (int s0 = begin; s0 < end; s0 += D) {
#pragma unroll
    for (int b = 0; b < D; ++b) {
      const int step = s0 + b;
      if (step >= end) break;  // warp-uniform
      const int phase = group_of(min(4 * step + t, chunks - 1)) - group_of(4 * step);
      if constexpr (kSharedX) share_x(ring[b], x_slot[share.warp], rows);
      accumulate_step(total, ring[b], phase);
      if (step + D < end) {
        load_weights(ring[b], rows, step + D);
        if constexpr (kSharedX) load_x_shared(ring[b], rows, step + D);
        else load_x(ring[b], rows, step + D);
      }
    }
  }
  if (!gemm::combine_splits<4 * R>(partial, &total[0][0], share, splits)) return;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = share.row0 + kTileRows * r + 8 * (e / 2) + g, m = 2 * t + e % 2;
      if (m < M && n < N) out[static_cast<int64_t>(m) * N + n] = finish.template apply<OutT>(total[r][e], n);
    }
#else
  __trap();  // never launched: the host requires compute capability 8.0 (mma.sync)
#endif
}

// Warp shapes, chosen by measurement on the H100 (Mamba-2.8B layers, M = 1..8, R = 1, 2, 4 tiles
// and D = 1..6 steps swept, benchmarks/bench_gemm4.py): per-warp latency, not bandwidth, bounds
// this GEMV, so a layer with few rows takes R = 1 and D = 6 (222 registers: the most warps and the
// deepest ring; x_proj 3.2 us, out_proj 6.3 us at M = 1, against 6.3 and 7.6 with R = 2, D = 2).
// One whose 16-row tiles, split 4 ways, would not fit one wave at 2 blocks per SM takes R = 4 and
// D = 2 (in_proj 7.7 us against 11.2 with R = 1, D = 6; x's loads and permutes shared by 64 rows).
bool w4a16_wide_warps(int N, int sms) { return (N + kTileRows - 1) / kTileRows > 2 * sms; }

template <typename F, typename OutT, int R, int D, int H, int Warps = kWarps, typename Finish>
void launch_mma_kernel(const Operands<F>& a, int splits, bool shared_x, int sms, Finish finish) {
  const auto kernel = shared_x && H == 1 ? mma_gemv_kernel<F, OutT, R, D, H, Warps, H == 1, Finish>
                                         : mma_gemv_kernel<F, OutT, R, D, H, Warps, false, Finish>;
  gemm::check_kernel_image(reinterpret_cast<const void*>(kernel), "4-bit tensor-core GEMV");
  const int tiles = (a.N + kTileRows * R - 1) / (kTileRows * R);
  // K is split while each warp keeps a ring's worth of steps: 4 splits were the fastest (or within
  // 2%) for every Mamba-2.8B layer and M on the H100.
  if (splits == 0) splits = choose_splits(tiles, (a.K / kCodesPerChunk + 3) / 4 / D, 8 * sms);
  const int groups_per_block = Warps / splits;
  const int blocks = (tiles + groups_per_block - 1) / groups_per_block;
  launch_with_pdl(kernel, blocks, Warps * 32, 0, a.stream, a.x, a.w, a.scales, static_cast<OutT*>(a.out), a.M,
                  a.N, a.K, GroupOf::make(a.group_size), splits, finish);
}

// Splits past kWarps take a block of as many warps per 16-row tile, with a ring of 3 steps (128
// registers). Where the tiles are few, the most splits (16 or 8) whose warps fit one wave at 16
// per SM and leave each warp 2 steps; 0 where none does (G % 128 == 0 only). Measured on the H100
// (M = 1..8, benchmarks/bench_gemm4.py): x_proj (12 tiles) takes 16, W4A16 2.74-3.93 us against
// 3.21-4.15 with 4 (W4A8 on tensor cores 2.45-2.89 against 3.21-3.59); out_proj (160 tiles) takes 8,
// W4A16 5.72-8.98 against 6.19-10.51 (W4A8 4.45-5.06 against 4.64-5.73), and 16 is slower there
// (7.11 at M = 1: 160 16-warp blocks are two waves). in_proj (640 tiles) keeps 4 warps per block.
int block_splits(int N, int K, int sms) {
  const int tiles = (N + kTileRows - 1) / kTileRows, steps = K / 128;
  for (int splits = 16; splits > kWarps; splits /= 2)
    if (tiles * splits <= 16 * sms && steps >= 2 * splits) return splits;
  return 0;
}

// W4A16 loads x through shared memory (XLoads::kShared) from M = 2 on where its warps hold 4 tiles
// (in_proj), and from M = 3 on where its 16-row tiles are at least as many as the SMs (out_proj,
// which then takes 4-warp blocks instead of block_splits). Measured on the H100 (M = 1..8,
// benchmarks/bench_gemm4.py): in_proj 7.84-8.46 us against 8.32-9.69 per lane at M = 2..8 (7.99
// against 7.81 at M = 1), out_proj 6.09-6.56 against 6.57-9.02 in 8 splits at M = 3..8 (6.00
// against 5.77 at M = 2, 5.91 against 5.39 at M = 1); x_proj (12 tiles) and W4A8 at every M were
// faster per lane (W4A8 in_proj 8.45 us at best against 7.10 at M = 1).
template <typename F>
bool auto_shared_x(const Operands<F>& a, int sms) {
  if (!F::kWideWarps || a.group_size % 128 != 0) return false;
  if (w4a16_wide_warps(a.N, sms)) return a.M >= 2;
  return a.M >= 3 && (a.N + kTileRows - 1) / kTileRows >= sms;
}

// H: how many groups one 4-chunk step (128 codes) can touch; with H = 1, 4 tiles per warp where
// the format takes them and N is large.
template <typename F, typename OutT, typename Finish>
void launch_mma_for_groups(const Operands<F>& a, int splits, XLoads x_loads, int sms, Finish finish) {
  const bool shared_x = x_loads == XLoads::kAuto ? auto_shared_x(a, sms) : x_loads == XLoads::kShared;
  if (splits == 0 && a.group_size % 128 == 0 && !(x_loads == XLoads::kAuto && shared_x))
    splits = block_splits(a.N, a.K, sms);
  if (splits > kWarps) {  // check_splits: G % 128 == 0
    if (splits == 8) launch_mma_kernel<F, OutT, 1, 3, 1, 8>(a, splits, shared_x, sms, finish);
    else launch_mma_kernel<F, OutT, 1, 3, 1, 16>(a, splits, shared_x, sms, finish);
  } else if (a.group_size % 128 == 0) {
    if constexpr (F::kWideWarps) {
      if (w4a16_wide_warps(a.N, sms)) {
        launch_mma_kernel<F, OutT, 4, 2, 1>(a, splits, shared_x, sms, finish);
        return;
      }
    }
    launch_mma_kernel<F, OutT, 1, 6, 1>(a, splits, shared_x, sms, finish);
  } else if (a.group_size == 32) {  // x_loads: per lane (check_x_loads)
    launch_mma_kernel<F, OutT, 1, 2, 4>(a, splits, false, sms, finish);
  } else {
    launch_mma_kernel<F, OutT, 1, 2, 2>(a, splits, false, sms, finish);  // 64, 96, 160, ...: at most 2 per step
  }
}

// fn(x tag, out tag) for W4A16's activation and output types.
template <typename Fn>
void dispatch_w4a16_types(const W4A16Args& a, Fn fn) {
  auto for_x = [&](auto x_tag) {
    switch (a.out_type) {
      case OutType::kFloat16: fn(x_tag, __half{}); break;
      case OutType::kBFloat16: fn(x_tag, __nv_bfloat16{}); break;
      case OutType::kFloat32: fn(x_tag, float{}); break;
      case OutType::kInt8: TORCH_CHECK(false, "w4a16 GEMV: out must be float16, bfloat16 or float32");
    }
  };
  if (a.x_type == ActType::kFloat16) for_x(__half{});
  else for_x(__nv_bfloat16{});
}

template <typename F>
Operands<F> w4a16_operands(const W4A16Args& a) {
  return {static_cast<const typename F::X*>(a.x), a.w, static_cast<const __half*>(a.scales), a.out, a.M, a.N, a.K,
          a.group_size, a.stream};
}

void launch_w4a16_mma(const W4A16Args& a, int splits, XLoads x_loads, int sms) {
  dispatch_w4a16_types(a, [&](auto x_tag, auto out_tag) {
    using F = HalfFormat<decltype(x_tag)>;
    launch_mma_for_groups<F, decltype(out_tag)>(w4a16_operands<F>(a), splits, x_loads, sms, CastOutput{});
  });
}

void launch_w4a16_core(const W4A16Args& a, int splits, int sms) {
  if (splits == 0) splits = choose_splits((a.N + kCoreRows - 1) / kCoreRows, a.K / kCodesPerChunk / 32, 16 * sms);
  dispatch_w4a16_types(a, [&](auto x_tag, auto out_tag) {
    using F = HalfFormat<decltype(x_tag)>;
    launch_core_kernel<F, kW4A16CoreMaxM, decltype(out_tag)>(w4a16_operands<F>(a), splits, CastOutput{});
  });
}

Operands<Int8Format> w4a8_operands(const W4A8Args& a) {
  return {a.x, a.w, a.group_multiplier, a.out, a.M, a.N, a.K, a.group_size, a.stream};
}

Epilogue w4a8_epilogue(const W4A8Args& a) { return {a.multiplier, a.multiplier_per_channel, nullptr}; }

// W4A8 on tensor cores: one 16-row tile per warp (more tiles per warp were slower on the H100 at
// every Mamba-2.8B layer and M = 1..8: in_proj 7.5 us with one, 8.1 and 8.8 with 2 and 4).
void launch_w4a8_mma(const W4A8Args& a, int splits, XLoads x_loads, int sms) {
  gemm::dispatch_out_type(a.out_type, [&](auto tag) {
    launch_mma_for_groups<Int8Format, decltype(tag)>(w4a8_operands(a), splits, x_loads, sms, w4a8_epilogue(a));
  });
}

template <int M>
void launch_w4a8_core(const W4A8Args& a, int splits) {
  gemm::dispatch_out_type(a.out_type, [&](auto tag) {
    launch_core_kernel<Int8Format, M, decltype(tag)>(w4a8_operands(a), splits, w4a8_epilogue(a));
  });
}

// The tensor-core GEMVs cost about the same for every M <= 8 (x's rows are the 8 columns of B), the
// CUDA-core GEMVs' work grows with M but spreads over 4 times more warps. Measured on the H100 (M =
// 1, 2, 4, 8, every rows and splits, benchmarks/bench_gemm4.py), W4A8: in_proj (640 tiles) 7.0-8.3
// us on tensor cores against 8.5-20.6 with dp4a; out_proj (160 tiles) 4.40-5.06 on tensor cores in
// 8 splits against 4.49-10.58 with dp4a; x_proj (12 tiles) 1.75-1.87 with dp4a up to M = 2
// (2.40-2.59 on tensor cores in 16 splits), 2.63-2.89 on tensor cores from M = 4 (2.75-4.14 with
// dp4a). W4A16: see the CUDA-core kernel above; `core_max_m` is the format's kW...CoreMaxM.
bool use_tensor_cores(int M, int N, int sms, int core_max_m) {
  const int tiles = (N + kTileRows - 1) / kTileRows;
  return tiles >= sms || M > core_max_m;
}

// rows = 0 (auto): the tensor cores where the shape asks for them or the splits or x loads only
// they take.
int auto_rows(int M, int N, int splits, XLoads x_loads, int sms, int core_max_m) {
  const bool tensor_only = splits > kWarps || x_loads == XLoads::kShared;
  return tensor_only || use_tensor_cores(M, N, sms, core_max_m) ? kTileRows : kCoreRows;
}

// `tensor_cores`: 8 and 16 splits are allowed too, a block per 16-row tile, for whole 128-code
// steps (G % 128 == 0).
void check_splits(const char* op, int splits, bool tensor_cores, int group_size) {
  const bool wide = tensor_cores && (splits == 8 || splits == 16);
  TORCH_CHECK(splits == 0 || splits == 1 || splits == 2 || splits == 4 || wide, op, ": splits must be 0 (auto), ",
              tensor_cores ? "1, 2, 4, 8 or 16" : "1, 2 or 4 (8 and 16: rows 16)", ", got ", splits);
  TORCH_CHECK(!wide || group_size % 128 == 0, op, ": ", splits, " splits need group_size % 128 == 0, got ",
              group_size);
}

// Shared x loads run on the tensor cores with whole 128-code steps (G % 128 == 0).
void check_x_loads(const char* op, XLoads x_loads, int rows, int group_size) {
  TORCH_CHECK(x_loads == XLoads::kAuto || x_loads == XLoads::kPerLane || x_loads == XLoads::kShared, op,
              ": x_loads must be 0 (auto), 1 (per lane) or 2 (shared), got ", static_cast<int>(x_loads));
  if (x_loads != XLoads::kShared) return;
  TORCH_CHECK(rows != kCoreRows, op, ": x_loads 2 (shared) needs the tensor cores (rows 0 or ", kTileRows, ")");
  TORCH_CHECK(group_size % 128 == 0, op, ": x_loads 2 (shared) needs group_size % 128 == 0, got ", group_size);
}

}  // namespace

void launch_w4a8_gemv(const W4A8Args& a, int rows, int splits, XLoads x_loads) {
  TORCH_CHECK(a.M >= 1 && a.M <= kGemvMaxM, "w4a8 GEMV: M must be in 1..", kGemvMaxM, ", got ", a.M);
  TORCH_CHECK(rows == 0 || rows == kCoreRows || rows == kTileRows, "w4a8 GEMV: rows must be 0 (auto), ", kCoreRows,
              " (dp4a) or ", kTileRows, " (tensor cores), got ", rows);
  check_splits("w4a8 GEMV", splits, rows != kCoreRows, a.group_size);
  check_x_loads("w4a8 GEMV", x_loads, rows, a.group_size);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (rows == 0) rows = auto_rows(a.M, a.N, splits, x_loads, sms, kW4A8CoreMaxM);
  if (rows == kTileRows) {
    launch_w4a8_mma(a, splits, x_loads, sms);
    return;
  }
  if (splits == 0)
    splits = choose_splits((a.N + kCoreRows - 1) / kCoreRows, a.K / kCodesPerChunk / 32, (a.M <= 2 ? 16 : 8) * sms);
  switch (a.M) {
    case 1: launch_w4a8_core<1>(a, splits); break;
    case 2: launch_w4a8_core<2>(a, splits); break;
    case 3: launch_w4a8_core<3>(a, splits); break;
    case 4: launch_w4a8_core<4>(a, splits); break;
    case 5: launch_w4a8_core<5>(a, splits); break;
    case 6: launch_w4a8_core<6>(a, splits); break;
    case 7: launch_w4a8_core<7>(a, splits); break;
    case 8: launch_w4a8_core<8>(a, splits); break;
  }
}

void launch_w4a16_gemv(const W4A16Args& a, int rows, int splits, XLoads x_loads) {
  TORCH_CHECK(a.M >= 1 && a.M <= kGemvMaxM, "w4a16 GEMV: M must be in 1..", kGemvMaxM, ", got ", a.M);
  TORCH_CHECK(rows == 0 || rows == kCoreRows || rows == kTileRows, "w4a16 GEMV: rows must be 0 (auto), ", kCoreRows,
              " (CUDA cores) or ", kTileRows, " (tensor cores), got ", rows);
  TORCH_CHECK(rows != kCoreRows || a.M <= kW4A16CoreMaxM, "w4a16 GEMV: rows ", kCoreRows,
              " (CUDA cores) takes M = 1, got ", a.M);
  check_splits("w4a16 GEMV", splits, rows != kCoreRows, a.group_size);
  check_x_loads("w4a16 GEMV", x_loads, rows, a.group_size);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (rows == 0) rows = auto_rows(a.M, a.N, splits, x_loads, sms, kW4A16CoreMaxM);
  if (rows == kCoreRows) launch_w4a16_core(a, splits, sms);
  else launch_w4a16_mma(a, splits, x_loads, sms);  // M needs no template: every M <= 8 costs the same mmas
}

}  // namespace quamba::gemm4
