// Decode GEMVs (M = 1..8) on 4-bit weights: the packed rows are streamed once with 16-byte
// streaming loads (ld.global.cs: read once, evict first; several per lane in flight) and the few
// activation rows are read from L2. Both are launched with programmatic dependence (pdl.cuh): the
// first weight loads are issued before waiting for the kernel that writes x. A 16-byte chunk holds 32 codes of one group (G % 32 == 0).
//
// W4A8 (dp4a): a lane takes whole chunks. Nibbles are moved to the top of each byte with one shift
// and one AND ((w << 4) & 0xF0F0F0F0 holds the even k, w & 0xF0F0F0F0 the odd k, each as 16 *
// code in int8) and multiplied with the even / odd bytes of x (two byte permutes per 8 bytes of
// x, shared by the R rows); the chunk's int32 sum is exact, divided by 16 exactly, multiplied by
// the group's int8 multiplier and added. Exact for any int8 multiplier. R = 1, 2, 4 rows per warp,
// `splits` warps sharing a row group's K range (as the W8A8 GEMV, gemm/gemv.cu).
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
// Measured on an H100 (benchmarks/bench_gemm4.py timing, M = 1, 4 splits): in_proj (N 10240,
// K 2560) 7.66 us (57% of the copy bandwidth) against 14.1 for the previous kernel (B = 8 weight
// rows, A = activations with half of every mma zero) and 24.8 for fp16; out_proj (2560 x 5120)
// 6.27 against 8.60 and 14.2; x_proj (192 x 5120) 3.24 against 4.90 and 6.62. Per-warp latency
// still bounds it (the fastest split is always the most warps): tried and slower were batches of
// steps loaded together and then used (in_proj 8.3 us at best), x loaded only one step ahead of use,
// and L2 prefetches of x or of the weights further ahead.
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gemm/epilogue.cuh"
#include "gemm/gemv_common.cuh"
#include "gemm4/gemm4.h"
#include "pdl.cuh"

namespace quamba::gemm4 {
namespace {

using gemm::Epilogue;
using gemm::kLoadsPerLane;  // W4A8: R rows x (8 / R) steps of 16-byte chunks in flight per lane
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
// W4A8, dp4a

// Chunk sum of 16 * code * x over one 16-byte weight chunk (32 codes) against the even (xe) and
// odd (xo) bytes of the matching 32 activations.
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

// Sums over chunks [begin, end) of rows row0..row0+R-1 (rows past N re-read row N - 1; the caller
// drops them). Returns, in lane r * M + m, the warp's sum for (row0 + r, m).
template <int M, int R>
__device__ __forceinline__ int w4a8_row_group_sums(const int4* __restrict__ x, const uint8_t* __restrict__ w,
                                                   const int8_t* __restrict__ multipliers, int N, int chunks,
                                                   int groups, GroupOf group_of, int row0, int begin, int end,
                                                   int lane) {
  // (16 loads per lane for M <= 2, so that in_proj's rows take one pass, was slower on the H100:
  // 8.5 vs 7.4 us for in_proj at M = 1, from the registers it costs.)
  constexpr int kSteps = kLoadsPerLane / R;
  const int4* w_rows[R];
  const int8_t* m_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = min(row0 + r, N - 1);
    w_rows[r] = reinterpret_cast<const int4*>(w + row * chunks * 16);
    m_rows[r] = multipliers + row * groups;
  }
  int acc[R][M] = {};
  bool waited = false;
  for (int c = begin + lane; c < end; c += 32 * kSteps) {
    int4 wv[kSteps][R];
    int mul[kSteps][R];
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
      if (c + 32 * s < end) {
        const int group = group_of(c + 32 * s);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          wv[s][r] = load_streaming(w_rows[r] + c + 32 * s);
          mul[s][r] = __ldg(m_rows[r] + group);
        }
      }
    if (!waited) {  // the first weights are on their way: now wait for x (pdl.cuh)
      pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if (c + 32 * s >= end) continue;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int4* xc = x + static_cast<int64_t>(m) * chunks * 2 + 2 * (c + 32 * s);
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
        for (int r = 0; r < R; ++r) acc[r][m] += (chunk_dot(wv[s][r], xe, xo) >> 4) * mul[s][r];
      }
    }
  }
  return gemm::lane_sum(acc, lane);
}

template <int M, int R, typename OutT>
__global__ void __launch_bounds__(kThreads)
w4a8_gemv_kernel(const int8_t* __restrict__ x, const uint8_t* __restrict__ w, const int8_t* __restrict__ multipliers,
                 OutT* __restrict__ out, int N, int K, GroupOf group_of, Epilogue epilogue, int splits) {
  static_assert(R * M <= 32, "one output per lane");
  __shared__ int partial[kWarps][1][32];
  pdl_launch_dependents();
  const int chunks = K / kCodesPerChunk;
  const int groups = chunks / group_of.per_group;
  const gemm::WarpShare s = gemm::warp_share(R, N, chunks, splits);
  const int lane = s.lane;

  int sum = w4a8_row_group_sums<M, R>(reinterpret_cast<const int4*>(x), w, multipliers, N, chunks, groups, group_of,
                                      s.row0, s.begin, s.end, lane);
  pdl_wait();  // warps with no share of K have not waited yet
  if (!gemm::combine_splits<1>(partial, &sum, s, splits)) return;
  const int n = s.row0 + lane / M;
  if (lane < R * M && n < N) out[static_cast<int64_t>(lane % M) * N + n] = epilogue.apply<OutT>(sum, n);
}

// Chosen by measurement on the H100 (benchmarks/RESULTS.md, every variant swept): 4 rows per warp
// when that gives every SM 8 warps; otherwise 2 for two activation rows (more warps) and 4 for one
// or more than two (x's byte permutes and loads shared by more rows). With programmatic dependent
// launch, 4 rows won at M = 1 everywhere (final H100 check: out_proj 4.43 us with 4 rows and 4
// splits, 7.16 us with 2 rows); M = 2 was last swept before that change. K is split until about
// 16 (M <= 2) or 8 warps per SM, keeping at least one sweep of K per warp.
int w4a8_choose_rows(int M, int N, int sms) {
  if ((N + 3) / 4 >= 8 * sms) return 4;
  return M == 2 ? 2 : 4;
}

int choose_splits(int work_items, int sweeps, int target_warps) {
  int splits = 1;
  while (splits < kWarps && work_items * splits < target_warps && sweeps >= 2 * splits) splits *= 2;
  return splits;
}

template <int M, int R, typename OutT>
void launch_w4a8_kernel(const W4A8Args& a, int splits) {
  const auto kernel = w4a8_gemv_kernel<M, R, OutT>;
  gemm::check_kernel_image(reinterpret_cast<const void*>(kernel), "w4a8 GEMV");
  const int groups_per_block = kWarps / splits;
  const int blocks = ((a.N + R - 1) / R + groups_per_block - 1) / groups_per_block;
  const Epilogue epilogue{a.multiplier, a.multiplier_per_channel, nullptr};
  launch_with_pdl(kernel, blocks, kThreads, 0, a.stream, a.x, a.w, a.group_multiplier, static_cast<OutT*>(a.out),
                  a.N, a.K, GroupOf::make(a.group_size), epilogue, splits);
}

template <int M>
void launch_w4a8_for_m(const W4A8Args& a, int rows, int splits) {
  gemm::dispatch_out_type(a.out_type, [&](auto tag) {
    using OutT = decltype(tag);
    switch (rows) {
      case 1: launch_w4a8_kernel<M, 1, OutT>(a, splits); break;
      case 2: launch_w4a8_kernel<M, 2, OutT>(a, splits); break;
      case 4: launch_w4a8_kernel<M, 4, OutT>(a, splits); break;
    }
  });
}

// ---------------------------------------------------------------------------------------------
// W4A16, mma.sync

constexpr int kTileRows = 16;  // W4A16: weight rows of one mma tile (A)

// (a & b) ^ c in one lop3 (the compiler splits it in two when both b and c are immediates).
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

template <typename XT>
struct Act;

template <>
struct Act<__half> {
  __device__ __forceinline__ static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
  }
  // p[q] = (code q, code q + 4) of the packed word w (nibble i = code i) as exact f16. One lop3 per
  // pair flips the sign bits and ORs in 1024's exponent: 1024 + (n ^ 8), minus 1032 = the code.
  // The odd nibbles are not shifted down: 1024 + 16 (n ^ 8), times 1/16 minus 72 = the code.
  __device__ __forceinline__ static void decode(uint32_t w, uint32_t (&p)[4]) {
    const uint32_t w8 = w >> 8;
    p[0] = fma2(and_xor(w, 0x000F000Fu, 0x64086408u), 0x3C003C00u, 0xE408E408u);   // * 1 - 1032
    p[1] = fma2(and_xor(w, 0x00F000F0u, 0x64806480u), 0x2C002C00u, 0xD480D480u);   // / 16 - 72
    p[2] = fma2(and_xor(w8, 0x000F000Fu, 0x64086408u), 0x3C003C00u, 0xE408E408u);
    p[3] = fma2(and_xor(w8, 0x00F000F0u, 0x64806480u), 0x2C002C00u, 0xD480D480u);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <>
struct Act<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
  }
  // As for f16 with 128.0 (136 = 128 + 8), but bf16 has 7 mantissa bits: every nibble is shifted
  // down first.
  __device__ __forceinline__ static void decode(uint32_t w, uint32_t (&p)[4]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) p[q] = fma2(and_xor(w >> (4 * q), 0x000F000Fu, 0x43084308u), 0x3F803F80u, 0xC308C308u);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <typename OutT>
__device__ __forceinline__ OutT from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// p[q] = (x q, x q + 4) of 8 consecutive activations: the pairs of Act<>::decode.
__device__ __forceinline__ void x_pairs(uint4 v, uint32_t (&p)[4]) {
  p[0] = __byte_perm(v.x, v.z, 0x5410);
  p[1] = __byte_perm(v.x, v.z, 0x7632);
  p[2] = __byte_perm(v.y, v.w, 0x5410);
  p[3] = __byte_perm(v.y, v.w, 0x7632);
}

// What one step (128 k) needs from memory, per lane: chunk 4 * step + t of the lane's weight rows
// (rows g and g + 8 of tile r in w[2r], w[2r + 1]), their scales for the step's H groups, and the
// same 32 activations of x row g.
template <int R, int H>
struct Stage {
  int4 w[2 * R];
  __half scale[H][2 * R];
  uint4 x[4];
};

// Where a lane reads: its weight rows row0 + 8 i + g (past N: row N - 1), their scale rows and x
// row g.
template <int R>
struct LaneRows {
  const int4* w[2 * R];
  const __half* scales[2 * R];
  const uint4* x;
  bool has_x;  // g < M: the other lanes' B columns only reach outputs that are never written
  int t, chunks, groups;
  GroupOf group_of;
  // The lane's chunk of `step`. With H = 1 (G % 128 == 0, so K % 128 == 0) every step is whole;
  // otherwise the last one may pass K: clamped, its codes are zeroed by load_weights.
  template <int H>
  __device__ __forceinline__ int chunk(int step) const {
    return H == 1 ? 4 * step + t : min(4 * step + t, chunks - 1);
  }
};

template <int R, int H>
__device__ __forceinline__ void load_weights(Stage<R, H>& s, const LaneRows<R>& rows, int step) {
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
template <int R, int H>
__device__ __forceinline__ void load_x(Stage<R, H>& s, const LaneRows<R>& rows, int step) {
  const uint4* p = rows.x + 4 * rows.template chunk<H>(step);
  if (rows.has_x)
#pragma unroll
    for (int k = 0; k < 4; ++k) s.x[k] = __ldcg(p + k);
}

// Adds one step to total[r]: A = 16 weight rows of tile r, B = the activations (column m = x row
// m), shared by the R tiles; two mma chains per tile. Pass h of H takes only the lanes whose chunk
// lies in the step's h-th group and is scaled by that group's scales. total[r] = (row g, m 2t),
// (row g, m 2t + 1), (row g + 8, m 2t), (row g + 8, m 2t + 1) of tile r.
template <typename XT, int R, int H>
__device__ __forceinline__ void accumulate_step(float (&total)[R][4], const Stage<R, H>& s, int phase) {
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
#pragma unroll
  for (int h = 0; h < H; ++h)
#pragma unroll
    for (int r = 0; r < R; ++r)
#pragma unroll
      for (int e = 0; e < 4; ++e)
        total[r][e] = fmaf(d[h][r][0][e] + d[h][r][1][e], __half2float(s.scale[h][2 * r + e / 2]), total[r][e]);
}

// R tiles of 16 weight rows per warp; D steps in flight per lane, in a ring refilled as each step
// is used.
template <typename XT, typename OutT, int R, int D, int H>
__global__ void __launch_bounds__(kThreads)
w4a16_gemv_kernel(const XT* __restrict__ x, const uint8_t* __restrict__ w, const __half* __restrict__ scales,
                  OutT* __restrict__ out, int M, int N, int K, GroupOf group_of, int splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ float partial[kWarps][4 * R][32];
  pdl_launch_dependents();
  const int chunks = K / kCodesPerChunk;
  const int groups = chunks / group_of.per_group;
  const gemm::WarpShare share = gemm::warp_share(kTileRows * R, N, (chunks + 3) / 4, splits);
  const int begin = share.begin, end = share.end;
  const int g = share.lane / 4, t = share.lane % 4;
  LaneRows<R> rows;
#pragma unroll
  for (int i = 0; i < 2 * R; ++i) {
    const int64_t row = min(share.row0 + 8 * i + g, N - 1);
    rows.w[i] = reinterpret_cast<const int4*>(w) + row * chunks;
    rows.scales[i] = scales + row * groups;
  }
  rows.x = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(min(g, M - 1)) * K);
  rows.has_x = g < M;
  rows.t = t;
  rows.chunks = chunks;
  rows.groups = groups;
  rows.group_of = group_of;

  Stage<R, H> ring[D] = {};  // lanes without x keep zero activations
#pragma unroll
  for (int b = 0; b < D; ++b)
    if (begin + b < end) load_weights(ring[b], rows, begin + b);
  pdl_wait();  // the first weights are on their way: now wait for x (pdl.cuh)
#pragma unroll
  for (int b = 0; b < D; ++b)
    if (begin + b < end) load_x(ring[b], rows, begin + b);
  float total[R][4] = {};
  for (int s0 = begin; s0 < end; s0 += D) {
#pragma unroll
    for (int b = 0; b < D; ++b) {
      const int step = s0 + b;
      if (step >= end) break;  // warp-uniform
      const int phase = group_of(min(4 * step + t, chunks - 1)) - group_of(4 * step);
      accumulate_step<XT, R, H>(total, ring[b], phase);
      if (step + D < end) {
        load_weights(ring[b], rows, step + D);
        load_x(ring[b], rows, step + D);
      }
    }
  }
  if (!gemm::combine_splits<4 * R>(partial, &total[0][0], share, splits)) return;
#pragma unroll
  for (int r = 0; r < R; ++r)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int n = share.row0 + kTileRows * r + 8 * (e / 2) + g, m = 2 * t + e % 2;
      if (m < M && n < N) out[static_cast<int64_t>(m) * N + n] = from_float<OutT>(total[r][e]);
    }
#else
  __trap();  // never launched: the host requires compute capability 8.0 (mma.sync f16/bf16)
#endif
}

// Warp shapes, chosen by measurement on the H100 (Mamba-2.8B layers, M = 1..8, R = 1, 2, 4 tiles
// and D = 1..6 steps swept, benchmarks/bench_gemm4.py): per-warp latency, not bandwidth, bounds
// this GEMV, so a layer with few rows takes R = 1 and D = 6 (222 registers: the most warps and the
// deepest ring; x_proj 3.2 us, out_proj 6.3 us at M = 1, against 6.3 and 7.6 with R = 2, D = 2).
// One whose 16-row tiles, split 4 ways, would not fit one wave at 2 blocks per SM takes R = 4 and
// D = 2 (in_proj 7.7 us against 11.2 with R = 1, D = 6; x's loads and permutes shared by 64 rows).
bool w4a16_wide_warps(int N, int sms) { return (N + kTileRows - 1) / kTileRows > 2 * sms; }

template <typename XT, typename OutT, int R, int D, int H>
void launch_w4a16_kernel(const W4A16Args& a, int splits, int sms) {
  const auto kernel = w4a16_gemv_kernel<XT, OutT, R, D, H>;
  gemm::check_kernel_image(reinterpret_cast<const void*>(kernel), "w4a16 GEMV");
  const int tiles = (a.N + kTileRows * R - 1) / (kTileRows * R);
  // K is split while each warp keeps a ring's worth of steps: 4 splits were the fastest (or within
  // 2%) for every Mamba-2.8B layer and M on the H100.
  if (splits == 0) splits = choose_splits(tiles, (a.K / kCodesPerChunk + 3) / 4 / D, 8 * sms);
  const int groups_per_block = kWarps / splits;
  const int blocks = (tiles + groups_per_block - 1) / groups_per_block;
  launch_with_pdl(kernel, blocks, kThreads, 0, a.stream, static_cast<const XT*>(a.x), a.w,
                  static_cast<const __half*>(a.scales), static_cast<OutT*>(a.out), a.M, a.N, a.K,
                  GroupOf::make(a.group_size), splits);
}

// H: how many groups one 4-chunk step (128 codes) can touch.
template <typename XT, typename OutT>
void launch_w4a16_for_groups(const W4A16Args& a, int splits, int sms) {
  if (a.group_size % 128 == 0) {
    if (w4a16_wide_warps(a.N, sms)) launch_w4a16_kernel<XT, OutT, 4, 2, 1>(a, splits, sms);
    else launch_w4a16_kernel<XT, OutT, 1, 6, 1>(a, splits, sms);
  } else if (a.group_size == 32) {
    launch_w4a16_kernel<XT, OutT, 1, 2, 4>(a, splits, sms);
  } else {
    launch_w4a16_kernel<XT, OutT, 1, 2, 2>(a, splits, sms);  // 64, 96, 160, ...: at most 2 per step
  }
}

void launch_w4a16_types(const W4A16Args& a, int splits, int sms) {
  auto for_x = [&](auto x_tag) {
    using XT = decltype(x_tag);
    switch (a.out_type) {
      case OutType::kFloat16: launch_w4a16_for_groups<XT, __half>(a, splits, sms); break;
      case OutType::kBFloat16: launch_w4a16_for_groups<XT, __nv_bfloat16>(a, splits, sms); break;
      case OutType::kFloat32: launch_w4a16_for_groups<XT, float>(a, splits, sms); break;
      case OutType::kInt8: TORCH_CHECK(false, "w4a16 GEMV: out must be float16, bfloat16 or float32");
    }
  };
  if (a.x_type == ActType::kFloat16) for_x(__half{});
  else for_x(__nv_bfloat16{});
}

void check_splits(const char* op, int splits) {
  TORCH_CHECK(splits == 0 || splits == 1 || splits == 2 || splits == 4, op,
              ": splits must be 0 (auto), 1, 2 or 4, got ", splits);
}

}  // namespace

void launch_w4a8_gemv(const W4A8Args& a, int rows, int splits) {
  TORCH_CHECK(a.M >= 1 && a.M <= kGemvMaxM, "w4a8 GEMV: M must be in 1..", kGemvMaxM, ", got ", a.M);
  TORCH_CHECK(rows == 0 || rows == 1 || rows == 2 || rows == 4, "w4a8 GEMV: rows must be 0 (auto), 1, 2 or 4, got ",
              rows);
  check_splits("w4a8 GEMV", splits);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (rows == 0) rows = w4a8_choose_rows(a.M, a.N, sms);
  if (splits == 0)
    splits = choose_splits((a.N + rows - 1) / rows, a.K / kCodesPerChunk / 32, (a.M <= 2 ? 16 : 8) * sms);
  switch (a.M) {
    case 1: launch_w4a8_for_m<1>(a, rows, splits); break;
    case 2: launch_w4a8_for_m<2>(a, rows, splits); break;
    case 3: launch_w4a8_for_m<3>(a, rows, splits); break;
    case 4: launch_w4a8_for_m<4>(a, rows, splits); break;
    case 5: launch_w4a8_for_m<5>(a, rows, splits); break;
    case 6: launch_w4a8_for_m<6>(a, rows, splits); break;
    case 7: launch_w4a8_for_m<7>(a, rows, splits); break;
    case 8: launch_w4a8_for_m<8>(a, rows, splits); break;
  }
}

void launch_w4a16_gemv(const W4A16Args& a, int splits) {
  TORCH_CHECK(a.M >= 1 && a.M <= kGemvMaxM, "w4a16 GEMV: M must be in 1..", kGemvMaxM, ", got ", a.M);
  check_splits("w4a16 GEMV", splits);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  launch_w4a16_types(a, splits, sms);  // M needs no template: every M <= 8 costs the same mmas
}

}  // namespace quamba::gemm4
