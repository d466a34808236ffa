// A whole W4A16 Mamba1 block's decode step at batch 1 in one persistent kernel (w4a16_layer_step;
// specification: quamba/ops/fused_decode/w4a16_step.py, the chain rms_norm → in_proj (w4a16_linear) →
// w4a16_ssm_step's chain (conv update + SiLU, x_proj, dt_proj, the scan step) → out_proj), for
// Mamba-2.8B's sizes.
//
// The plan is qmamba_layer_step's (layer_step.cu, layer_ring.cuh) with float activations: 128
// blocks, one an SM, run the block between the launch's wait and two grid barriers. Block b owns
// 40 channels of d_inner (their x and z rows of in_proj, their conv, x_proj columns, dt_proj rows
// and scan) and 20 rows of out_proj, and its producer warp streams those weights from the
// kernel's start. Every block takes the residual add + RMSNorm of the whole row (fp16 h in shared
// memory). in_proj and out_proj run on the tensor cores as gemv4.cu's W4A16 GEMV does at one row
// (mma.sync m16n8k16, the codes made exact f16 pairs by Act<__half>::decode, the activations in
// every column of B): a tile is 16 weight rows (8 of each of two chunks) and warp w takes groups
// w, w + 8, ... of K; each group's fp32 sum times its row's fp16 scale; the 8 warps' sums of a row
// are added in warp order. x_proj's partial sums over the block's channels are added across the
// blocks as int64 fixed point (units of 2^-32) with atomics: integer sums, so the same bits
// whatever the order of arrival. Then dt_proj, the scan step (4 lanes a channel), D and the gate;
// y goes through global memory to every block for out_proj.
//
// The chain's roundings to float16 are kept: h, x and z, u, x_proj's output, dt, y and out are
// rounded where the separate ops store them; the sums are fp32 in another order (x_proj's with
// its partial sums rounded to 2^-32), so the outputs agree with the chain to float tolerances, not
// bit for bit. The residual is the chain's bit for bit, and so are the conv state's shifted
// columns (its newest is in_proj's x).
#include <torch/library.h>

#include <cstdint>
#include <string>

#include "../qsscan/scan_step.cuh"
#include "gemm/gemv_common.cuh"
#include "gemm4/half_codes.cuh"
#include "layer_ring.cuh"
#include "pdl.cuh"

namespace quamba_ssm {
namespace {

using namespace layer_ring;  // Mamba-2.8B's sizes, the split over 128 blocks, the weight ring
using L = Layout<true>;      // in_proj and out_proj as packed 4-bit rows
using quamba::gemm4::Act;

// Block b's small chunk: x_proj's packed columns of its 40 channels [kOuts, 20 bytes], the fp16
// scales of their groups [kOuts, 2] (of channel 40 b's group, of channel 40 b + 39's), dt_proj's
// fp16 rows of its channels [40, kRank].
constexpr int kXRowBytes = kChannels / 2;
constexpr int kXScaleOffset = kOuts * kXRowBytes, kDtOffset = kXScaleOffset + kOuts * 2 * 2;
constexpr int kSmallBytes = kDtOffset + kChannels * kRank * 2;
// Block b's fp16 group scales: its in_proj rows' (x rows, then z rows), its out_proj rows'.
constexpr int kInGroups = kModel / kGroup, kOutGroups = kInner / kGroup;
constexpr int kInScales = 2 * kChannels * kInGroups, kScales = kInScales + kOutRows * kOutGroups;
// 16-row tiles of in_proj (8 rows of each of two chunks) and of out_proj (rows 0-15, 16-19)
constexpr int kTileRows = 16, kInTiles = 2 * kChannels / kTileRows, kOutTiles = 2;
constexpr int kInFlight = 3;   // weight chunks in flight at most (layer_ring.cuh's produce)
constexpr int kSumCopies = 8;  // copies of x_proj's sums: blocks b and b + 8 share one
constexpr double kFixedOne = 4294967296.0;  // x_proj's partial sums in int64 units of 2^-32
static_assert(kSmallBytes <= kChunkBytes && kDtOffset % 16 == 0 && kSmallBytes % 16 == 0);
static_assert(kScales * 2 % 16 == 0 && kOuts <= kThreads && 4 * kChannels <= kThreads);
static_assert(kInChunks == 2 * kInTiles && L::kOutRowsPerChunk == kTileRows / 2 && L::kOutChunks == 3);
static_assert(kRank % (4 * 8) == 0 && kChannels * 2 <= kTileRows * kInTiles);

// The workspace's int32 words: the barrier counter (alone in its 128 bytes), x_proj's int64 sums,
// y (fp16).
constexpr int kCounterWords = 32, kSumWords = 2 * kSumCopies * kOuts, kYWords = kInner / 2;
constexpr int kWorkspaceWords = kCounterWords + kSumWords + kYWords;

struct W4A16LayerArgs {
  const __half* hidden;        // [d_model]: the block before's output (or the embedding)
  const float* residual;       // [d_model] or nullptr (the first block)
  float* residual_out;         // [d_model]: hidden + residual
  __half* out;                 // [d_model]: out_proj's output
  const __half* norm_weight;   // [d_model]
  const int8_t* in_proj;       // packed [2 d_inner, d_model / 2]
  const int8_t* small;         // [blocks, kSmallBytes]
  const int8_t* out_proj;      // packed [d_model, d_inner / 2]
  const __half* group_scales;  // [blocks, kScales]
  const __half* conv_weight;   // [d_inner, width]
  const __half* conv_bias;     // [d_inner] or nullptr
  __half* conv_state;          // [d_inner, width - 1], in place
  const __half* dt_bias;       // [d_inner]
  const float* A;              // [d_inner, d_state]: -exp(A_log)
  const float* D;              // [d_inner] or nullptr
  float* ssm_state;            // [d_inner, d_state], in place
  float eps;
  unsigned* counter;             // the grid barrier's
  unsigned long long* sums;      // [kSumCopies, kOuts]: x_proj's sums, zero between launches
  __half* y;                     // [d_inner]: the gated scan output
};

struct __align__(128) Smem {
  int8_t ring[kSlots][kChunkBytes];
  alignas(16) __half act[kInner];  // h (d_model) for in_proj, y for out_proj
  alignas(16) __half scales[kScales];
  float partial[kWarps][2 * kChannels];  // each warp's sums of the rows of in_proj (out_proj)
  unsigned long long full[kSlots], empty[kSlots], scales_full;
  float x[kChannels], z[kChannels], u[kChannels];
  float xdbl[kOuts];
  float warp_sums[32];
};

// The pairs of B of every mma of a warp's groups (warp, warp + 8, ...): lane (g, t) holds the
// activations of chunk 4 grp + t (32 of them, x_pairs' order), the same in every column.
template <int kGroups>
struct Activations {
  static constexpr int kPerWarp = (kGroups + kWarps - 1) / kWarps;
  uint32_t pairs[kPerWarp][16];

  __device__ __forceinline__ explicit Activations(const __half* act) {
    const int warp = threadIdx.x / 32, t = threadIdx.x % 4;
#pragma unroll
    for (int i = 0; i < kPerWarp; ++i) {
      const int grp = min(warp + kWarps * i, kGroups - 1);
      const uint4* x = reinterpret_cast<const uint4*>(act) + 4 * (4 * grp + t);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t p[4];
        quamba::gemm4::x_pairs(x[j], p);
#pragma unroll
        for (int q = 0; q < 4; ++q) pairs[i][4 * j + q] = p[q];
      }
    }
  }
};

// A warp's share of a 16-row tile: row g of ``lo`` and row g of ``hi`` (row pitch kRowBytes) for
// lane (g, t), over the warp's groups; each group's 8 mmas (chunk 4 grp + t of both rows) summed in
// fp32 (two chains of 4), times the rows' fp16 group scales (``scale_lo``, ``scale_hi``). Returns
// the partial sums of rows g and g + 8 of the tile (every lane of a row holds the same).
template <int kRowBytes>
__device__ __forceinline__ float2 tile_partial(const int8_t* lo, const int8_t* hi,
                                               const Activations<kRowBytes * 2 / kGroup>& x, const __half* scale_lo,
                                               const __half* scale_hi) {
  constexpr int kGroups = kRowBytes * 2 / kGroup;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
  for (int i = 0; i < Activations<kGroups>::kPerWarp; ++i) {
    const int grp = warp + kWarps * i;
    if (kGroups % kWarps == 0 || grp < kGroups) {  // (known true where the warps share K evenly)
      const int chunk = 4 * grp + t;
      const uint4 w_lo = reinterpret_cast<const uint4*>(lo + g * kRowBytes)[chunk];
      const uint4 w_hi = reinterpret_cast<const uint4*>(hi + g * kRowBytes)[chunk];
      const uint32_t words_lo[4] = {w_lo.x, w_lo.y, w_lo.z, w_lo.w};
      const uint32_t words_hi[4] = {w_hi.x, w_hi.y, w_hi.z, w_hi.w};
      float d[2][4] = {};  // two mma chains: the even and the odd words
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        uint32_t a_lo[4], a_hi[4];
        Act<__half>::decode(words_lo[j], a_lo);
        Act<__half>::decode(words_hi[j], a_hi);
        const uint32_t* b = x.pairs[i] + 4 * j;
        Act<__half>::mma(d[j % 2], a_lo[0], a_hi[0], a_lo[1], a_hi[1], b[0], b[1]);
        Act<__half>::mma(d[j % 2], a_lo[2], a_hi[2], a_lo[3], a_hi[3], b[2], b[3]);
      }
      sum_lo = fmaf(__fadd_rn(d[0][0], d[1][0]), __half2float(scale_lo[grp]), sum_lo);
      sum_hi = fmaf(__fadd_rn(d[0][2], d[1][2]), __half2float(scale_hi[grp]), sum_hi);
    }
  }
  return make_float2(sum_lo, sum_hi);
}

// Row r's sum over the warps' partial sums, in warp order.
__device__ __forceinline__ float warps_total(const Smem& sm, int r) {
  float total = sm.partial[0][r];
#pragma unroll
  for (int w = 1; w < kWarps; ++w) total = __fadd_rn(total, sm.partial[w][r]);
  return total;
}

// v as float16 stores it.
__device__ __forceinline__ float rounded(float v) { return __half2float(__float2half_rn(v)); }

// Residual add + RMSNorm → fp16 h in sm.act, in every block (residual_rstd; weight: the norm
// weights of the lane's values), each block writing its share of the residual.
__device__ void rmsnorm(const W4A16LayerArgs& a, Smem& sm, const float (&weight)[2][kRowValues]) {
  float r[2][kRowValues];
  const float rstd = residual_rstd(a.hidden, a.residual, a.residual_out, a.eps, sm.warp_sums, r);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!has_row(i)) break;
    const int first = row_first(i);
    __half h[kRowValues];
#pragma unroll
    for (int j = 0; j < kRowValues; ++j) h[j] = __float2half_rn(__fmul_rn(__fmul_rn(r[i][j], rstd), weight[i][j]));
    store_row<kRowValues>(sm.act + first, h);
  }
  consumer_sync();
}

// in_proj's x and z of the block's channels (fp16 values in sm.x, sm.z): tile p is chunks 2 p and
// 2 p + 1, the block's rows 16 p ... 16 p + 15.
__device__ void in_proj(Smem& sm, int& k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
  const Activations<kInGroups> x(sm.act);
  mbar_wait(&sm.scales_full, 0);
  for (int p = 0; p < kInTiles; ++p, k += 2) {
    const int8_t* lo = wait_chunk(sm, k);
    const int8_t* hi = wait_chunk(sm, k + 1);
    const int row = kTileRows * p + g;
    const float2 sums = tile_partial<L::kInRowBytes>(lo, hi, x, sm.scales + row * kInGroups,
                                                     sm.scales + (row + 8) * kInGroups);
    release(sm, k, 2);
    if (lane % 4 == 0) {
      sm.partial[warp][row] = sums.x;
      sm.partial[warp][row + 8] = sums.y;
    }
  }
  consumer_sync();
  const int t = threadIdx.x;
  if (t < 2 * kChannels) (t < kChannels ? sm.x[t] : sm.z[t - kChannels]) = rounded(warps_total(sm, t));
  consumer_sync();
}

// out_proj's rows of the block → a.out (its chunks k, k + 1, k + 2: rows 0-7, 8-15, 16-19).
__device__ void out_proj(const W4A16LayerArgs& a, Smem& sm, int k) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4;
  const Activations<kOutGroups> y(sm.act);
  const __half* scales = sm.scales + kInScales;
#pragma unroll
  for (int p = 0; p < kOutTiles; ++p) {
    const int8_t* lo = wait_chunk(sm, k + 2 * p);
    const int8_t* hi = p == 0 ? wait_chunk(sm, k + 1) : lo;  // rows past 20 are never written
    const int row = kTileRows * p + g, row_hi = min(row + 8, kOutRows - 1);
    const float2 sums = tile_partial<L::kOutRowBytes>(lo, hi, y, scales + min(row, kOutRows - 1) * kOutGroups,
                                                      scales + row_hi * kOutGroups);
    if (lane % 4 == 0) {
      if (row < kOutRows) sm.partial[warp][row] = sums.x;
      if (row + 8 < kOutRows) sm.partial[warp][row + 8] = sums.y;
    }
  }
  release(sm, k, L::kOutChunks);
  consumer_sync();
  const int t = threadIdx.x;
  if (t < kOutRows) a.out[blockIdx.x * kOutRows + t] = __float2half_rn(warps_total(sm, t));
}

// x_proj's partial sums over the block's channels (thread n: output n), each of its two groups'
// sum times the group's scale, added into the block's copy of the int64 sums.
__device__ void x_proj_partial(const W4A16LayerArgs& a, const Smem& sm, const int8_t* small) {
  const int n = threadIdx.x, c0 = blockIdx.x * kChannels;
  if (n >= kOuts) return;
  const int split = kGroup - c0 % kGroup;  // the block's channels from here on are in the next group
  const int8_t* row = small + n * kXRowBytes;
  float first_group = 0.f, next_group = 0.f;
#pragma unroll
  for (int m = 0; m < kXRowBytes / 4; ++m) {
    uint32_t pairs[4];
    Act<__half>::decode(*reinterpret_cast<const uint32_t*>(row + 4 * m), pairs);
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const float2 codes = __half22float2(*reinterpret_cast<const __half2*>(&pairs[q]));
      const int i = 8 * m + q;  // the pair's channels: i and i + 4
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float code = e == 0 ? codes.x : codes.y;
        const int c = i + 4 * e;
        if (c < split) {
          first_group = fmaf(code, sm.u[c], first_group);
        } else {
          next_group = fmaf(code, sm.u[c], next_group);
        }
      }
    }
  }
  const __half* scales = reinterpret_cast<const __half*>(small + kXScaleOffset) + 2 * n;
  const float sum = fmaf(next_group, __half2float(scales[1]), __fmul_rn(first_group, __half2float(scales[0])));
  const long long fixed = __double2ll_rn(static_cast<double>(sum) * kFixedOne);
  atomicAdd(a.sums + (blockIdx.x % kSumCopies) * kOuts + n, static_cast<unsigned long long>(fixed));
}

// dt of channel ch from dt_low (4 lanes a channel, 40 of its weights each), rounded to float16.
__device__ __forceinline__ float dt_of(const Smem& sm, const int8_t* small, int ch, int q) {
  constexpr int kPer = kRank / 4;
  const uint4* w = reinterpret_cast<const uint4*>(small + kDtOffset + (ch * kRank + q * kPer) * 2);
  const float* low = sm.xdbl + q * kPer;
  float acc = 0.f;
#pragma unroll
  for (int v = 0; v < kPer / 8; ++v) {
    const uint4 piece = w[v];
    const uint32_t words[4] = {piece.x, piece.y, piece.z, piece.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float2 pair = __half22float2(*reinterpret_cast<const __half2*>(&words[i]));
      acc = fmaf(pair.x, low[8 * v + 2 * i], acc);
      acc = fmaf(pair.y, low[8 * v + 2 * i + 1], acc);
    }
  }
  acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 1));
  acc = __fadd_rn(acc, __shfl_xor_sync(0xffffffffu, acc, 2));
  return rounded(acc);
}

__global__ void __launch_bounds__(kBlockThreads, 1) w4a16_layer_kernel(const W4A16LayerArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int t = threadIdx.x, b = blockIdx.x;
  if (t == 0) {
    mbar_init(&sm.scales_full, 1);
    init_ring(sm);
  }
  __syncthreads();
  quamba::pdl_launch_dependents();  // the next block's kernel may start streaming its weights
  if (t >= kThreads) {
    if (t == kThreads) {  // the group scales, then the weights' chunks
      bulk_copy(sm.scales, a.group_scales + b * kScales, kScales * 2, &sm.scales_full);
      produce<true, kSmallBytes, Smem, kInFlight>(a.in_proj, a.small, a.out_proj, sm);
    }
    return;
  }
  // Weights and parameters, which no kernel writes, into registers before the wait.
  float norm_weight[2][kRowValues] = {};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (has_row(i)) load_values<kRowValues>(a.norm_weight + row_first(i), true, norm_weight[i]);
  }
  const int d_conv = b * kChannels + t;  // t < kChannels: the conv's channel
  float conv_weight[kWidth] = {}, conv_bias = 0.f;
  if (t < kChannels) {
    load_values<kWidth>(a.conv_weight + d_conv * kWidth, false, conv_weight);
    if (a.conv_bias != nullptr) conv_bias = __half2float(a.conv_bias[d_conv]);
  }
  const int ch = t / 4, q = t % 4, d = b * kChannels + ch;  // t < 4 · 40: states 4q ... 4q + 3 of d
  const bool scans = t < 4 * kChannels;
  const int64_t state_offset = static_cast<int64_t>(d) * kStates + 4 * q;
  float A[4] = {}, skip = 0.f, dt_bias = 0.f;
  if (scans) {
    load_row<4>(a.A + state_offset, A);
    if (a.D != nullptr) skip = a.D[d];
    dt_bias = __half2float(a.dt_bias[d]);
  }
  quamba::pdl_wait();  // hidden, residual and the states come from earlier kernels

  float window[kWidth] = {};
  __half* conv_state = a.conv_state + d_conv * (kWidth - 1);
  if (t < kChannels) {
#pragma unroll
    for (int i = 0; i < kWidth - 1; ++i) window[i] = __half2float(conv_state[i]);
  }
  float state[4] = {};
  if (scans) load_row<4>(a.ssm_state + state_offset, state);

  rmsnorm(a, sm, norm_weight);
  int k = 0;  // the next chunk
  in_proj(sm, k);

  // conv + SiLU of the block's channels → u; the conv state shifts.
  if (t < kChannels) {
    window[kWidth - 1] = sm.x[t];
    float acc = conv_bias;
#pragma unroll
    for (int i = 0; i < kWidth; ++i) acc = fmaf(conv_weight[i], window[i], acc);
#pragma unroll
    for (int i = 0; i < kWidth - 1; ++i) conv_state[i] = __float2half_rn(window[i + 1]);
    sm.u[t] = rounded(silu_rn(acc));
  }
  consumer_sync();

  const int8_t* small = wait_chunk(sm, k);
  x_proj_partial(a, sm, small);
  grid_barrier(a.counter);
  if (t < kOuts) {
    long long total = 0;
#pragma unroll
    for (int i = 0; i < kSumCopies; ++i) total += static_cast<long long>(__ldcg(a.sums + i * kOuts + t));
    sm.xdbl[t] = rounded(static_cast<float>(static_cast<double>(total) / kFixedOne));
  }
  consumer_sync();

  // dt_proj, Δ, the scan step of 4 states a lane, D skip and the gate.
  if (scans) {
    const float delta = biased_delta(dt_of(sm, small, ch, q), dt_bias);
    const float u = sm.u[ch];
    StepArgs step{};  // what step_states reads of it: no foh drive
    float next[4];
    float y = step_states<Discretization::kZoh, 4>(step, 4, state_offset, u, delta, A, sm.xdbl + kRank + 4 * q,
                                                   sm.xdbl + kRank + kStates + 4 * q, state, next);
    store_row<4>(a.ssm_state + state_offset, next);
    y = __fadd_rn(y, __shfl_xor_sync(0xffffffffu, y, 1));
    y = __fadd_rn(y, __shfl_xor_sync(0xffffffffu, y, 2));
    if (q == 0) a.y[d] = __float2half_rn(gated_y(y, u, skip, true, sm.z[ch]));
  }
  release(sm, k++);
  grid_barrier(a.counter);
  if (b == 0) {  // every block has read x_proj's sums: zero them for the next launch
    for (int i = t; i < kSumCopies * kOuts; i += kThreads) a.sums[i] = 0;
  }
  for (int i = t; i < kInner / 8; i += kThreads) {  // y of every block, from L2
    reinterpret_cast<uint4*>(sm.act)[i] = __ldcg(reinterpret_cast<const uint4*>(a.y) + i);
  }
  consumer_sync();
  out_proj(a, sm, k);
#else
  __trap();  // never launched: the host requires compute capability 9.0
#endif
}

template <typename T>
const T* data_of(const at::Tensor& t) {
  return static_cast<const T*>(t.data_ptr());
}

template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? data_of<T>(*t) : nullptr;
}

// hidden: fp16 [d_model]; residual: fp32 [d_model] or None; norm_weight fp16 [d_model]; eps as
// an fp32 value; in_proj packed uint8 [2 d_inner, d_model / 2]; small int8 [128, 17408], each
// block's x_proj columns, their group scales and dt_proj rows (kSmallBytes above); out_proj packed
// uint8 [d_model, d_inner / 2]; group_scales fp16 [128, 2400], each block's in_proj rows' (x, then
// z) and out_proj rows' scales of groups of 128; conv_weight fp16 [d_inner, 4], conv_bias fp16
// [d_inner] or None; conv_state fp16 [d_inner, 3] and ssm_state fp32 [d_inner, 16], stepped in
// place; dt_bias fp16 [d_inner]; A = -exp(A_log) fp32 [d_inner, 16]; D fp32 [d_inner] or None;
// workspace: int32 [w4a16_layer_workspace_words()], zero when first used
// (quamba/ops/fused_decode/w4a16_layer_cuda.py). Returns (out fp16 [d_model], residual_out fp32
// [d_model]).
std::tuple<at::Tensor, at::Tensor> w4a16_layer_step(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& norm_weight, double eps,
    const at::Tensor& in_proj, const at::Tensor& small, const at::Tensor& out_proj, const at::Tensor& group_scales,
    const at::Tensor& conv_weight, const c10::optional<at::Tensor>& conv_bias, at::Tensor& conv_state,
    at::Tensor& ssm_state, const at::Tensor& dt_bias, const at::Tensor& A, const c10::optional<at::Tensor>& D,
    at::Tensor& workspace) {
  check_cuda(hidden, "hidden");
  check_tensor(hidden, hidden, at::kHalf, {kModel}, "hidden");
  if (residual.has_value()) check_tensor(*residual, hidden, at::kFloat, {kModel}, "residual");
  check_tensor(norm_weight, hidden, at::kHalf, {kModel}, "norm_weight");
  check_tensor(in_proj, hidden, at::kByte, {2 * kInner, kModel / 2}, "in_proj");
  check_tensor(small, hidden, at::kChar, {kBlocks, kSmallBytes}, "small");
  check_tensor(out_proj, hidden, at::kByte, {kModel, kInner / 2}, "out_proj");
  check_tensor(group_scales, hidden, at::kHalf, {kBlocks, kScales}, "group_scales");
  check_tensor(conv_weight, hidden, at::kHalf, {kInner, kWidth}, "conv_weight");
  if (conv_bias.has_value()) check_tensor(*conv_bias, hidden, at::kHalf, {kInner}, "conv_bias");
  check_tensor(conv_state, hidden, at::kHalf, {kInner, kWidth - 1}, "conv_state");
  check_tensor(ssm_state, hidden, at::kFloat, {kInner, kStates}, "ssm_state");
  check_tensor(dt_bias, hidden, at::kHalf, {kInner}, "dt_bias");
  check_tensor(A, hidden, at::kFloat, {kInner, kStates}, "A");
  if (D.has_value()) check_tensor(*D, hidden, at::kFloat, {kInner}, "D");
  check_tensor(workspace, hidden, at::kInt, {kWorkspaceWords}, "workspace");
  const c10::cuda::CUDAGuard guard(hidden.device());

  at::Tensor out = at::empty({kModel}, hidden.options());
  at::Tensor residual_out = at::empty({kModel}, hidden.options().dtype(at::kFloat));
  W4A16LayerArgs args{};
  args.hidden = data_of<__half>(hidden);
  args.residual = data_or_null<float>(residual);
  args.residual_out = residual_out.data_ptr<float>();
  args.out = static_cast<__half*>(out.data_ptr());
  args.norm_weight = data_of<__half>(norm_weight);
  args.in_proj = data_of<int8_t>(in_proj);
  args.small = small.data_ptr<int8_t>();
  args.out_proj = data_of<int8_t>(out_proj);
  args.group_scales = data_of<__half>(group_scales);
  args.conv_weight = data_of<__half>(conv_weight);
  args.conv_bias = data_or_null<__half>(conv_bias);
  args.conv_state = static_cast<__half*>(conv_state.data_ptr());
  args.dt_bias = data_of<__half>(dt_bias);
  args.A = A.data_ptr<float>();
  args.D = data_or_null<float>(D);
  args.ssm_state = ssm_state.data_ptr<float>();
  args.eps = to_fp32(eps);
  int* words = workspace.data_ptr<int>();
  args.counter = reinterpret_cast<unsigned*>(words);
  args.sums = reinterpret_cast<unsigned long long*>(words + kCounterWords);
  args.y = reinterpret_cast<__half*>(words + kCounterWords + kSumWords);
  launch("w4a16_layer_step", w4a16_layer_kernel, sizeof(Smem), args);
  return {out, residual_out};
}

std::string w4a16_layer_step_lacks(int64_t d_model, int64_t d_inner, int64_t d_state, int64_t dt_rank,
                                   int64_t width, int64_t device) {
  return kernel_lacks(d_model, d_inner, d_state, dt_rank, width, device, sizeof(Smem));
}

int64_t w4a16_layer_workspace_words() { return kWorkspaceWords; }

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "w4a16_layer_step(Tensor hidden, Tensor? residual, Tensor norm_weight, float eps, Tensor in_proj, "
      "Tensor small, Tensor out_proj, Tensor group_scales, Tensor conv_weight, Tensor? conv_bias, "
      "Tensor(a!) conv_state, Tensor(b!) ssm_state, Tensor dt_bias, Tensor A, Tensor? D, "
      "Tensor(c!) workspace) -> (Tensor, Tensor)");
  m.def("w4a16_layer_step_lacks(int d_model, int d_inner, int d_state, int dt_rank, int width, int device) -> str",
        &quamba_ssm::w4a16_layer_step_lacks);
  m.def("w4a16_layer_workspace_words() -> int", &quamba_ssm::w4a16_layer_workspace_words);
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) { m.impl("w4a16_layer_step", &quamba_ssm::w4a16_layer_step); }
