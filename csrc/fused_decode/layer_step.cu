// A whole W8A8 or W4A8 Mamba1 block's decode step at batch 1 in one persistent kernel (qmamba_layer_step;
// specification: quamba/ops/fused_decode/layer_step.py, the chain rmsnorm_quant → in_proj → qconv1d_update →
// x_proj → dt_proj folded into qsscan_update → hadamard_quant → out_proj). Mamba-2.8B's sizes:
// d_model 2560, d_inner 5120 = 20 · 256, d_state 16, dt_rank 160, conv width 4.
//
// At batch 1 a block's seven kernels cost more in their launches, waits and tails than in their
// bytes (benchmarks/RESULTS.md: 23.5 µs a layer on an H200 for 8.5 MB of weights). Here 128
// blocks, one an SM, run the block between three synchronizations: the launch's own wait for the
// layer before, and two grid barriers. Block b owns 40 channels of d_inner (their x and z rows of
// in_proj, their conv, x_proj columns, dt_proj rows and scan) and 20 rows of out_proj. A producer
// warp streams every weight byte the block reads, from the kernel's start (weights are written by
// no kernel, so before the wait), into a ring of 20 KB shared-memory slots with bulk copies
// (cp.async.bulk, completion on an mbarrier), at most kInFlight chunks ahead of the consumers:
// deeper queues of bulk copies delay the step's small reads. The 8 consumer warps: residual add +
// RMSNorm of the whole row in every block, in_proj rows, conv + SiLU, x_proj's partial sums added
// across blocks with int32 atomics (8 copies; integers, so exact), grid barrier, dt_proj, the scan
// and the gate, grid barrier, the Hadamard of all of y in every block, out_proj rows.
//
// W4A8 (kW4): in_proj and out_proj stream their packed 4-bit rows (even k in the low nibble), with
// their int8 multipliers of groups of 128 copied into shared memory before the wait, and take the
// activation codes as the even codes then the odd ones, so that 16 bytes of each meet 16 packed
// bytes (gemv4.cu's nibble trick: a chunk's int32 sum is exact); x_proj comes as int8 products
// code · multiplier (exact; the host checks that they fit), so its sums are W8A8's. The epilogues
// then take per-channel multipliers, as the W4A8 GEMV's do.
//
// Every rounding is the chain's, so the outputs equal the chain of CUDA kernels bit for bit: the
// row norm's sum of squares in rmsnorm_quant_row_kernel's order (its 320 threads of 8 values and
// block_sum's tree, emulated by 8 warps), the GEMVs' epilogue (gemm/epilogue.cuh; their integer
// sums are exact in any order), the conv epilogue and the scan step (conv_epilogue.cuh,
// scan_step.cuh; a channel's 16 terms of y in state_readout's tree over 4 lanes), and the
// Hadamard's butterflies and its signed sums of 20 columns in hadamard_quant's decode order.
#include <torch/library.h>

#include <cstdint>
#include <string>
#include <utility>

#include "../conv1d/conv_epilogue.cuh"
#include "../qsscan/scan_step.cuh"
#include "gemm/epilogue.cuh"
#include "gemm/gemv_common.cuh"
#include "gemm/mma.cuh"
#include "layer_ring.cuh"
#include "pdl.cuh"

namespace quamba_ssm {
namespace {

using namespace layer_ring;  // Mamba-2.8B's sizes, the split over 128 blocks, the weight ring

constexpr int kSmallBytes = kOuts * kChannels + kChannels * kRank;  // x_proj columns, dt_proj rows
constexpr int kSumCopies = 8;  // copies of x_proj's sums: blocks b and b + 8 share one
// The Hadamard: 5120 = 20 · 256, Paley S_20 (hadamard_quant.cu's base_column<20>).
constexpr int kSegment = 256, kBase = kInner / kSegment;
// W4A8: the int8 multipliers of the groups of 128 of the block's in_proj rows, then out_proj rows.
constexpr int kInMetaBytes = 2 * kChannels * (kModel / kGroup);
constexpr int kMetaBytes = kInMetaBytes + kOutRows * (kInner / kGroup);
static_assert(kMetaBytes % 16 == 0 && kOuts <= kThreads);
static_assert(4 * kChannels <= kThreads && kSegment == kThreads);
static_assert(kRowWarps <= 2 * kWarps && kOuts * kSumCopies <= 8 * kThreads && kMetaBytes <= 16 * kThreads);

// The workspace's int32 words: the barrier counter (alone in its 128 bytes), x_proj's sums, y.
constexpr int kCounterWords = 32, kSumWords = kSumCopies * kOuts, kYWords = kInner / 2;
constexpr int kWorkspaceWords = kCounterWords + kSumWords + kYWords;

struct LayerStepArgs {
  const __half* hidden;    // [d_model]: the block before's output (or the embedding)
  const float* residual;   // [d_model] or nullptr (the first block)
  float* residual_out;     // [d_model]: hidden + residual
  __half* out;             // [d_model]: out_proj's output
  const int8_t* in_proj;   // [2 d_inner, d_model] (W4A8: packed, [2 d_inner, d_model / 2])
  const int8_t* small;     // [blocks, kSmallBytes]: x_proj's columns [kOuts, 40], dt_proj's rows [40, kRank]
  const int8_t* out_proj;  // [d_model, d_inner] (W4A8: packed, [d_model, d_inner / 2])
  const int8_t* group_multipliers;  // W4A8: [blocks, kMetaBytes]
  // per-channel epilogue multipliers (W4A8), or nullptr for the scalar ones below
  const float *in_multipliers, *xdbl_multipliers, *out_multipliers;
  const int8_t* conv_weight;  // [d_inner, width]
  int8_t* conv_state;      // [d_inner, width - 1], in place
  ConvEpilogue conv;       // u codes: out_inv_scale = 1 / u_scale, silu
  StepArgs step;           // the scan step: params, the int8 state and scales (u, dt, B / C)
  float z_scale;
  float eps, h_inv_scale;  // the norm's, and 1 / its output scale
  float in_multiplier, xdbl_multiplier, dt_multiplier, out_multiplier;
  float y_norm, y_inv_scale;  // the Hadamard's 1 / sqrt(d_inner), and 1 / y_scale
  unsigned* counter;       // the grid barrier's
  int* sums;               // [kSumCopies, kOuts]: x_proj's sums, zero between launches
  __half* y;               // [d_inner]: the gated scan output
};

struct __align__(128) Smem {
  int8_t ring[kSlots][kChunkBytes];
  float hadamard[kInner];
  alignas(16) int8_t act[kInner];  // h codes (d_model) for in_proj, y codes for out_proj (act_at)
  alignas(16) int8_t group_multipliers[kMetaBytes];  // W4A8
  alignas(16) float in_multipliers[2 * kChannels];  // the epilogue's of the block's x rows, then z rows
  unsigned long long full[kSlots], empty[kSlots];
  unsigned long long meta_full;  // W4A8's group multipliers and per-channel in_multipliers copied
  alignas(16) int8_t x_codes[kChannels];
  alignas(16) int8_t z_codes[kChannels];
  alignas(16) int8_t u_codes[kChannels];
  alignas(16) int8_t xdbl[kOuts];
  float B[kStates], C[kStates];
  float warp_sums[32];
  int half_rows[2 * kOutRows];
};

using quamba::gemm::dot16;
using quamba::gemm::warp_sum;  // the xor tree of block_sum's warps

// 32 packed 4-bit codes against the activations' even and odd codes of the same 32 positions:
// each nibble taken as code · 16 in place in its byte, so every product is a multiple of 16 and
// the sum divides exactly.
__device__ __forceinline__ int dot_w4(int4 w, int4 even, int4 odd) {
  constexpr int kHigh = static_cast<int>(0xF0F0F0F0u);
  int s = 0;
  s = __dp4a((w.x << 4) & kHigh, even.x, s);
  s = __dp4a(w.x & kHigh, odd.x, s);
  s = __dp4a((w.y << 4) & kHigh, even.y, s);
  s = __dp4a(w.y & kHigh, odd.y, s);
  s = __dp4a((w.z << 4) & kHigh, even.z, s);
  s = __dp4a(w.z & kHigh, odd.z, s);
  s = __dp4a((w.w << 4) & kHigh, even.w, s);
  s = __dp4a(w.w & kHigh, odd.w, s);
  return s >> 4;
}

// Where code i of an activation vector of n codes lives in sm.act: in order (W8A8), or (W4A8) the
// even codes then the odd ones.
template <bool kW4>
__device__ __forceinline__ int act_at(int i, int n) {
  return kW4 ? (i & 1) * (n / 2) + (i >> 1) : i;
}

// The weight row's 16-byte pieces a lane takes (lane, lane + 32, ...) and its int32 sum against the
// activation pieces in registers (W4A8: times each piece's group multiplier; 4 pieces a group).
template <bool kW4, int kPieces, int kLoads>
__device__ __forceinline__ int row_sum(const int8_t* row, const int4 (&even)[kLoads], const int4 (&odd)[kLoads],
                                       const int8_t* multipliers, int first_piece) {
  const int lane = threadIdx.x % 32;
  int acc = 0;
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int j = lane + 32 * i;
    if (kPieces % 32 == 0 || j < kPieces) {
      const int4 w = reinterpret_cast<const int4*>(row)[first_piece + j];
      if constexpr (kW4) {
        acc += dot_w4(w, even[i], odd[i]) * multipliers[(first_piece + j) / 4];
      } else {
        acc = dot16(w, even[i], acc);
      }
    }
  }
  return acc;
}

// A lane's activation pieces for row_sum: pieces first_piece + lane + 32 i of the codes (W4A8: of
// the even codes, and of the odd ones n / 2 further), n the vector's length.
template <bool kW4, int kPieces, int kLoads>
__device__ __forceinline__ void load_pieces(const int8_t* act, int n, int first_piece, int4 (&even)[kLoads],
                                            int4 (&odd)[kLoads]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < kLoads; ++i) {
    const int j = first_piece + min(lane + 32 * i, kPieces - 1);
    even[i] = reinterpret_cast<const int4*>(act)[j];
    if constexpr (kW4) odd[i] = reinterpret_cast<const int4*>(act + n / 2)[j];
  }
}

// Residual add + RMSNorm → h codes in sm.act, in every block (residual_rstd: the row kernel's
// order), each block writing its share of the residual.
template <bool kW4>
__device__ void rmsnorm(const LayerStepArgs& a, Smem& sm) {
  float r[2][kRowValues];
  const float rstd = residual_rstd(a.hidden, a.residual, a.residual_out, a.eps, sm.warp_sums, r);
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!has_row(i)) break;
    const int first = row_first(i);
#pragma unroll
    for (int j = 0; j < kRowValues; ++j)
      sm.act[act_at<kW4>(first + j, kModel)] = quantize_rn(__fmul_rn(r[i][j], rstd), a.h_inv_scale);
  }
  consumer_sync();
}

// The bulk copies of the block's W4A8 group multipliers and per-channel in_multipliers (its x rows',
// then its z rows').
template <bool kW4>
__device__ __forceinline__ int meta_copies(const LayerStepArgs& a) {
  return (kW4 ? 1 : 0) + (a.in_multipliers != nullptr ? 2 : 0);
}

template <bool kW4>
__device__ __forceinline__ void copy_meta(const LayerStepArgs& a, Smem& sm) {
  const int b = blockIdx.x;
  if (kW4) bulk_copy(sm.group_multipliers, a.group_multipliers + static_cast<int64_t>(b) * kMetaBytes, kMetaBytes, &sm.meta_full);
  if (a.in_multipliers != nullptr) {
    constexpr int kBytes = kChannels * sizeof(float);
    bulk_copy(sm.in_multipliers, a.in_multipliers + b * kChannels, kBytes, &sm.meta_full);
    bulk_copy(sm.in_multipliers + kChannels, a.in_multipliers + kInner + b * kChannels, kBytes, &sm.meta_full);
  }
}

// in_proj's x and z codes of the block's channels: warp w takes row w of each chunk.
template <bool kW4>
__device__ void in_proj(const LayerStepArgs& a, Smem& sm, int& k) {
  using L = Layout<kW4>;
  constexpr int kPieces = L::kInRowBytes / 16, kLoads = (kPieces + 31) / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  int4 even[kLoads], odd[kLoads];
  load_pieces<kW4, kPieces, kLoads>(sm.act, kModel, 0, even, odd);
  if (meta_copies<kW4>(a) > 0) mbar_wait(&sm.meta_full, 0);
  const quamba::gemm::Epilogue epilogue{};  // no bias; each output's multiplier comes with its sum
  for (int c = 0; c < kInChunks; c += 2, k += 2) {
    int sums[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int row = (c + i) / (kInChunks / 2) * kChannels + (c + i) % (kInChunks / 2) * kInRows + warp;
      sums[i] = row_sum<kW4, kPieces, kLoads>(wait_chunk(sm, k + i) + warp * L::kInRowBytes, even, odd,
                                              sm.group_multipliers + row * (kModel / kGroup), 0);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const int total = warp_sum(sums[i]);
      const int cc = c + i, half = cc / (kInChunks / 2), channel = (cc % (kInChunks / 2)) * kInRows + warp;
      if (lane == 0) {
        const float multiplier = sm.in_multipliers[half * kChannels + channel];
        (half == 0 ? sm.x_codes : sm.z_codes)[channel] = epilogue.apply<int8_t>(total, {multiplier, 0.f});
      }
    }
    release(sm, k, 2);
  }
  consumer_sync();
}

// The Hadamard of y (all of d_inner, in every block) → y codes in sm.act. Thread j holds
// position j of the 20 segments of 256: the butterflies of halves 1 ... 16 through shuffles, of
// 32 ... 128 through shared memory (the reference's pairs and order of stages), then the signed
// sums of the 20 columns in order, as hadamard_quant's decode kernel (signed_sums) adds them.
template <bool kW4, int A>
__device__ __forceinline__ void signed_sums(const float (&column)[kBase], float norm, float inv_scale, int j,
                                            int8_t* codes) {
  if constexpr (A < kBase) {
    constexpr uint32_t kColumns[kBase] = {0xffffe, 0x615e4, 0xc2bc8, 0x85792, 0xaf26,  0x15e4c, 0x2bc98,
                                          0x57930, 0xaf260, 0x5e4c2, 0xbc984, 0x7930a, 0xf2614, 0xe4c2a,
                                          0xc9856, 0x930ae, 0x2615e, 0x4c2bc, 0x98578, 0x30af2};
    constexpr uint32_t kSigns = kColumns[A];  // bit c set where S[c, A] = -1
    float sum = (kSigns & 1) ? -column[0] : column[0];
#pragma unroll
    for (int c = 1; c < kBase; ++c) sum = (kSigns >> c & 1) ? __fsub_rn(sum, column[c]) : __fadd_rn(sum, column[c]);
    codes[act_at<kW4>(A * kSegment + j, kInner)] = quantize_rn(__fmul_rn(sum, norm), inv_scale);
    signed_sums<kW4, A + 1>(column, norm, inv_scale, j, codes);
  }
}

template <bool kW4>
__device__ void hadamard(const LayerStepArgs& a, Smem& sm) {
  const int j = threadIdx.x, lane = j % 32;
  float column[kBase];
#pragma unroll
  for (int c = 0; c < kBase; ++c) column[c] = __half2float(__ldcg(a.y + c * kSegment + j));
#pragma unroll
  for (int half = 1; half < 32; half *= 2) {
    const bool second = lane & half;
#pragma unroll
    for (int c = 0; c < kBase; ++c) {
      const float other = __shfl_xor_sync(0xffffffffu, column[c], half);
      column[c] = second ? __fsub_rn(other, column[c]) : __fadd_rn(column[c], other);
    }
  }
#pragma unroll
  for (int half = 32; half < kSegment; half *= 2) {
    const bool second = j & half;
#pragma unroll
    for (int c = 0; c < kBase; ++c) sm.hadamard[c * kSegment + j] = column[c];
    consumer_sync();
#pragma unroll
    for (int c = 0; c < kBase; ++c) {
      const float other = sm.hadamard[c * kSegment + (j ^ half)];
      column[c] = second ? __fsub_rn(other, column[c]) : __fadd_rn(column[c], other);
    }
    consumer_sync();
  }
  signed_sums<kW4, 0>(column, a.y_norm, a.y_inv_scale, j, sm.act);
  consumer_sync();
}

// out_proj's rows of the block (its chunks waited for): warp w takes half w % 2 of d_inner for
// rows w / 2, w / 2 + 4, ...; the two halves' sums go to sm.half_rows.
template <bool kW4>
__device__ void out_proj(Smem& sm, int k) {
  using L = Layout<kW4>;
  constexpr int kHalfRows = 2 * kOutRows / kWarps, kPieces = L::kOutRowBytes / 16 / 2;
  constexpr int kLoads = (kPieces + 31) / 32;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, first_piece = (warp % 2) * kPieces;
  int4 even[kLoads], odd[kLoads];
  load_pieces<kW4, kPieces, kLoads>(sm.act, kInner, first_piece, even, odd);
  int acc[kHalfRows];
#pragma unroll
  for (int h = 0; h < kHalfRows; ++h) {
    const int row = (warp + h * kWarps) / 2;
    const int8_t* src = sm.ring[(k + row / L::kOutRowsPerChunk) % kSlots] + (row % L::kOutRowsPerChunk) * L::kOutRowBytes;
    acc[h] = row_sum<kW4, kPieces, kLoads>(src, even, odd,
                                           sm.group_multipliers + kInMetaBytes + row * (kInner / kGroup), first_piece);
  }
#pragma unroll
  for (int h = 0; h < kHalfRows; ++h) {
    const int total = warp_sum(acc[h]);
    if (lane == 0) sm.half_rows[warp + h * kWarps] = total;
  }
}

// Output n's epilogue multiplier: its own (W4A8) or the tensor's.
__device__ __forceinline__ float multiplier_of(const float* per_channel, float multiplier, int n) {
  return per_channel != nullptr ? __ldg(per_channel + n) : multiplier;
}

template <bool kW4>
__global__ void __launch_bounds__(kBlockThreads, 1) layer_step_kernel(const LayerStepArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(128) unsigned char smem_raw[];
  Smem& sm = *reinterpret_cast<Smem*>(smem_raw);
  const int t = threadIdx.x, b = blockIdx.x;
  if (t == 0) {
    if (meta_copies<kW4>(a) > 0) mbar_init(&sm.meta_full, meta_copies<kW4>(a));
    init_ring(sm);
  }
  __syncthreads();
  quamba::pdl_launch_dependents();  // the next block's kernel may start streaming its weights
  if (t >= kThreads) {
    if (t == kThreads) {
      copy_meta<kW4>(a, sm);
      produce<kW4, kSmallBytes>(a.in_proj, a.small, a.out_proj, sm);
    }
    return;
  }
  const StepArgs& s = a.step;
  // Parameters, which no kernel writes, before the wait: read after it, they would queue behind
  // the weights' copies on the step's critical path. Into registers (or copied by the producer):
  // a load stored to shared memory here would hold its thread until it arrives.
  if (a.in_multipliers == nullptr && t < 2 * kChannels) sm.in_multipliers[t] = a.in_multiplier;
  const float xdbl_multiplier = t < kOuts ? multiplier_of(a.xdbl_multipliers, a.xdbl_multiplier, t) : 0.f;
  const float out_multiplier =
      t < kOutRows ? multiplier_of(a.out_multipliers, a.out_multiplier, b * kOutRows + t) : 0.f;
  const int d_conv = b * kChannels + t;  // t < kChannels: the conv's channel
  int conv_weight[kWidth] = {};
  float conv_bias = 0.f;
  if (t < kChannels) {
#pragma unroll
    for (int i = 0; i < kWidth; ++i) conv_weight[i] = a.conv_weight[d_conv * kWidth + i];
    conv_bias = a.conv.bias_of(d_conv);
  }
  const int ch = t / 4, q = t % 4, d = b * kChannels + ch;  // t < 4 · 40: states 4q ... 4q + 3 of d
  const bool scans = t < 4 * kChannels;
  float A[4] = {}, skip = 0.f, dt_bias = 0.f;
  if (scans) {
    load_A<4>(s, d, 4 * q, 4, A);
    skip = s.params.skip(d);
    dt_bias = s.params.bias(d);
  }
  quamba::pdl_wait();  // hidden, residual and the states come from earlier kernels

  int window[kWidth] = {};
  int8_t* conv_state = a.conv_state + d_conv * (kWidth - 1);
  if (t < kChannels) {
#pragma unroll
    for (int i = 0; i < kWidth - 1; ++i) window[i] = conv_state[i];
  }
  int8_t state[4] = {};
  const int64_t state_offset = static_cast<int64_t>(d) * kStates + 4 * q;
  if (scans) load_lane_states<4>(s, 4, state_offset, state);

  rmsnorm<kW4>(a, sm);  // (its barriers also publish the multipliers in shared memory)
  int k = 0;  // the next chunk
  in_proj<kW4>(a, sm, k);

  // conv + SiLU of the block's channels → u codes; the conv state shifts.
  if (t < kChannels) {
    window[kWidth - 1] = sm.x_codes[t];
    int acc = 0;
#pragma unroll
    for (int i = 0; i < kWidth; ++i) acc += conv_weight[i] * window[i];
#pragma unroll
    for (int i = 0; i < kWidth - 1; ++i) conv_state[i] = static_cast<int8_t>(window[i + 1]);
    sm.u_codes[t] = quantize_rn(a.conv.apply(acc, conv_bias, a.conv.multiplier), a.conv.out_inv_scale);
  }
  consumer_sync();

  // x_proj's sums over the block's channels, added across the blocks.
  const int8_t* small = wait_chunk(sm, k);
  if (t < kOuts) {
    int acc = 0;
#pragma unroll
    for (int i = 0; i < kChannels / 4; ++i)
      acc = __dp4a(*reinterpret_cast<const int*>(small + t * kChannels + 4 * i),
                   *reinterpret_cast<const int*>(sm.u_codes + 4 * i), acc);
    atomicAdd(a.sums + (b % kSumCopies) * kOuts + t, acc);
  }
  grid_barrier(a.counter);
  if (t < kOuts) {
    int sum = 0;
#pragma unroll
    for (int i = 0; i < kSumCopies; ++i) sum += __ldcg(a.sums + i * kOuts + t);
    const int8_t code = quamba::gemm::Epilogue{}.apply<int8_t>(sum, {xdbl_multiplier, 0.f});
    sm.xdbl[t] = code;
    if (t >= kRank && t < kRank + kStates) sm.B[t - kRank] = dequantize(code, s.B.scale);
    if (t >= kRank + kStates) sm.C[t - kRank - kStates] = dequantize(code, s.C.scale);
  }
  consumer_sync();

  // dt_proj (4 lanes a channel), Δ, the scan step of 4 states a lane, D skip and the gate.
  if (scans) {
    const int8_t* dt_row = small + kOuts * kChannels + ch * kRank + q * (kRank / 4);
    int acc = 0;
#pragma unroll
    for (int i = 0; i < kRank / 16; ++i)
      acc = __dp4a(*reinterpret_cast<const int*>(dt_row + 4 * i),
                   *reinterpret_cast<const int*>(sm.xdbl + q * (kRank / 4) + 4 * i), acc);
    acc += __shfl_xor_sync(0xffffffffu, acc, 1);
    acc += __shfl_xor_sync(0xffffffffu, acc, 2);
    const float delta = biased_delta(dequantize(projected_dt_code(acc, a.dt_multiplier), s.dt.scale), dt_bias);
    const float u = dequantize(sm.u_codes[ch], s.u.scale);
    int8_t next[4];
    float y = step_states<Discretization::kZoh, 4>(s, 4, state_offset, u, delta, A, sm.B + 4 * q, sm.C + 4 * q,
                                                   state, next);
    store_lane_states<4>(s, 4, state_offset, next);
    y = __fadd_rn(y, __shfl_xor_sync(0xffffffffu, y, 1));  // state_readout's tree over the 4 lanes
    y = __fadd_rn(y, __shfl_xor_sync(0xffffffffu, y, 2));
    if (q == 0) {
      const float z = dequantize(sm.z_codes[ch], a.z_scale);
      a.y[d] = __float2half_rn(gated_y(y, u, skip, true, z));
    }
  }
  release(sm, k++);
  grid_barrier(a.counter);
  if (b == 0) {  // every block has read x_proj's sums: zero them for the next launch
    for (int i = t; i < kSumWords; i += kThreads) a.sums[i] = 0;
  }

  hadamard<kW4>(a, sm);
  using L = Layout<kW4>;
  for (int c = 0; c < L::kOutChunks; ++c) wait_chunk(sm, k + c);
  out_proj<kW4>(sm, k);
  consumer_sync();
  if (t < kOutRows) {
    const int sum = sm.half_rows[2 * t] + sm.half_rows[2 * t + 1];
    a.out[b * kOutRows + t] = quamba::gemm::Epilogue{}.apply<__half>(sum, {out_multiplier, 0.f});
  }
  release(sm, k, L::kOutChunks);
#else
  __trap();  // never launched: the host requires compute capability 9.0
#endif
}

// An optional fp32 [n] tensor of per-channel multipliers: its data, or nullptr.
const float* multipliers_or_null(const c10::optional<at::Tensor>& t, const at::Tensor& ref, int64_t n,
                                 const char* name) {
  if (!t.has_value()) return nullptr;
  check_tensor(*t, ref, at::kFloat, {n}, name);
  return t->data_ptr<float>();
}

// hidden: fp16 [d_model]; residual: fp32 [d_model] or None; in_proj [2 d_inner, d_model] int8, or
// uint8 packed 4-bit codes [2 d_inner, d_model / 2] (W4A8); small: [128, 14080] int8, each block's
// x_proj columns [192, 40] (W4A8: code · group multiplier) and dt_proj rows [40, 160]; out_proj
// [d_model, d_inner] int8 or packed [d_model, d_inner / 2]; group_multipliers (W4A8 only): int8
// [128, 2400], each block's in_proj rows' then out_proj rows' multipliers of groups of 128;
// in_multipliers [2 d_inner], xdbl_multipliers [192], out_multipliers [d_model]: fp32 per-channel
// epilogue multipliers replacing the scalars (in and out required with W4A8); conv_weight int8
// [d_inner, 4], conv_bias int8 [d_inner] or None; conv_state int8 [d_inner, 3] and ssm_state int8
// [d_inner, 16], stepped in place; workspace: int32 [qmamba_layer_workspace_words()], zero when
// first used. Scales and multipliers are fp32 values as the chain's ops compute them
// (quamba/ops/fused_decode/layer_step_cuda.py). Returns (out fp16 [d_model], residual_out fp32 [d_model]).
std::tuple<at::Tensor, at::Tensor> qmamba_layer_step(
    const at::Tensor& hidden, const c10::optional<at::Tensor>& residual, const at::Tensor& in_proj,
    double in_multiplier, const at::Tensor& small, const at::Tensor& out_proj, double out_multiplier,
    const at::Tensor& conv_weight, const c10::optional<at::Tensor>& conv_bias, double conv_multiplier,
    double conv_bias_scale, double u_inv_scale, at::Tensor& conv_state, at::Tensor& ssm_state,
    double state_scale, double xdbl_multiplier, double dt_multiplier, double u_scale, double xdbl_scale,
    double dt_scale, double z_scale, const at::Tensor& A_log, double A_log_scale, const at::Tensor& D,
    double D_scale, const at::Tensor& dt_bias, double dt_bias_scale, double eps, double h_inv_scale,
    double y_norm, double y_inv_scale, const c10::optional<at::Tensor>& group_multipliers,
    const c10::optional<at::Tensor>& in_multipliers, const c10::optional<at::Tensor>& xdbl_multipliers,
    const c10::optional<at::Tensor>& out_multipliers, at::Tensor& workspace) {
  check_cuda(hidden, "hidden");
  check_tensor(hidden, hidden, at::kHalf, {kModel}, "hidden");
  if (residual.has_value()) check_tensor(*residual, hidden, at::kFloat, {kModel}, "residual");
  const bool w4 = in_proj.scalar_type() == at::kByte;
  const int packing = w4 ? 2 : 1;
  const auto weight_type = w4 ? at::kByte : at::kChar;
  check_tensor(in_proj, hidden, weight_type, {2 * kInner, kModel / packing}, "in_proj");
  check_tensor(small, hidden, at::kChar, {kBlocks, kSmallBytes}, "small");
  check_tensor(out_proj, hidden, weight_type, {kModel, kInner / packing}, "out_proj");
  TORCH_CHECK(w4 == group_multipliers.has_value(), "group_multipliers go with 4-bit (uint8) in_proj and out_proj");
  TORCH_CHECK(!w4 || (in_multipliers.has_value() && out_multipliers.has_value()),
              "4-bit in_proj and out_proj need in_multipliers and out_multipliers");
  if (w4) check_tensor(*group_multipliers, hidden, at::kChar, {kBlocks, kMetaBytes}, "group_multipliers");
  check_tensor(conv_weight, hidden, at::kChar, {kInner, kWidth}, "conv_weight");
  if (conv_bias.has_value()) check_tensor(*conv_bias, hidden, at::kChar, {kInner}, "conv_bias");
  check_tensor(conv_state, hidden, at::kChar, {kInner, kWidth - 1}, "conv_state");
  check_tensor(ssm_state, hidden, at::kChar, {kInner, kStates}, "ssm_state");
  check_ssm_params(hidden, A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale, kInner, kStates);
  TORCH_CHECK(reinterpret_cast<uintptr_t>(A_log.data_ptr()) % 16 == 0, "A_log must be 16-byte aligned");
  check_tensor(workspace, hidden, at::kInt, {kWorkspaceWords}, "workspace");
  const std::pair<double, const char*> scales[] = {
      {state_scale, "state_scale"}, {u_scale, "u_scale"}, {xdbl_scale, "xdbl_scale"}, {dt_scale, "dt_scale"},
      {z_scale, "z_scale"}};
  for (const auto& [value, name] : scales) check_positive_scale(value, name);
  const c10::cuda::CUDAGuard guard(hidden.device());

  at::Tensor out = at::empty({kModel}, hidden.options());
  at::Tensor residual_out = at::empty({kModel}, hidden.options().dtype(at::kFloat));
  LayerStepArgs args{};
  args.hidden = static_cast<const __half*>(hidden.data_ptr());
  args.residual = residual.has_value() ? residual->data_ptr<float>() : nullptr;
  args.residual_out = residual_out.data_ptr<float>();
  args.out = static_cast<__half*>(out.data_ptr());
  args.in_proj = static_cast<const int8_t*>(in_proj.data_ptr());
  args.small = small.data_ptr<int8_t>();
  args.out_proj = static_cast<const int8_t*>(out_proj.data_ptr());
  args.group_multipliers = w4 ? group_multipliers->data_ptr<int8_t>() : nullptr;
  args.in_multipliers = multipliers_or_null(in_multipliers, hidden, 2 * kInner, "in_multipliers");
  args.xdbl_multipliers = multipliers_or_null(xdbl_multipliers, hidden, kOuts, "xdbl_multipliers");
  args.out_multipliers = multipliers_or_null(out_multipliers, hidden, kModel, "out_multipliers");
  args.conv_weight = conv_weight.data_ptr<int8_t>();
  args.conv_state = conv_state.data_ptr<int8_t>();
  args.conv = ConvEpilogue{to_fp32(conv_multiplier), conv_bias.has_value() ? conv_bias->data_ptr<int8_t>() : nullptr,
                           to_fp32(conv_bias_scale), to_fp32(u_inv_scale), true, nullptr, nullptr};
  args.step = int8_input_step(u_scale, dt_scale, xdbl_scale,
                              ssm_params(A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale),
                              ssm_state.data_ptr(), true, state_scale);
  StepArgs& step = args.step;
  step.batch = 1;
  step.dim = kInner;
  step.dstate = kStates;
  step.rows_aligned = true;
  args.z_scale = to_fp32(z_scale);
  args.eps = to_fp32(eps);
  args.h_inv_scale = to_fp32(h_inv_scale);
  args.in_multiplier = to_fp32(in_multiplier);
  args.xdbl_multiplier = to_fp32(xdbl_multiplier);
  args.dt_multiplier = to_fp32(dt_multiplier);
  args.out_multiplier = to_fp32(out_multiplier);
  args.y_norm = to_fp32(y_norm);
  args.y_inv_scale = to_fp32(y_inv_scale);
  int* words = workspace.data_ptr<int>();
  args.counter = reinterpret_cast<unsigned*>(words);
  args.sums = words + kCounterWords;
  args.y = reinterpret_cast<__half*>(words + kCounterWords + kSumWords);

  const auto kernel = w4 ? layer_step_kernel<true> : layer_step_kernel<false>;
  launch("qmamba_layer_step", kernel, sizeof(Smem), args);
  return {out, residual_out};
}

std::string qmamba_layer_step_lacks(int64_t d_model, int64_t d_inner, int64_t d_state, int64_t dt_rank,
                                    int64_t width, int64_t device) {
  return kernel_lacks(d_model, d_inner, d_state, dt_rank, width, device, sizeof(Smem));
}

int64_t qmamba_layer_workspace_words() { return kWorkspaceWords; }

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "qmamba_layer_step(Tensor hidden, Tensor? residual, Tensor in_proj, float in_multiplier, "
      "Tensor small, Tensor out_proj, float out_multiplier, Tensor conv_weight, Tensor? conv_bias, "
      "float conv_multiplier, float conv_bias_scale, float u_inv_scale, Tensor(a!) conv_state, "
      "Tensor(b!) ssm_state, float state_scale, float xdbl_multiplier, float dt_multiplier, "
      "float u_scale, float xdbl_scale, float dt_scale, float z_scale, Tensor A_log, "
      "float A_log_scale, Tensor D, float D_scale, Tensor dt_bias, float dt_bias_scale, float eps, "
      "float h_inv_scale, float y_norm, float y_inv_scale, Tensor? group_multipliers, "
      "Tensor? in_multipliers, Tensor? xdbl_multipliers, Tensor? out_multipliers, Tensor(c!) workspace) "
      "-> (Tensor, Tensor)");
  m.def("qmamba_layer_step_lacks(int d_model, int d_inner, int d_state, int dt_rank, int width, "
        "int device) -> str",
        &quamba_ssm::qmamba_layer_step_lacks);
  m.def("qmamba_layer_workspace_words() -> int", &quamba_ssm::qmamba_layer_workspace_words);
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) { m.impl("qmamba_layer_step", &quamba_ssm::qmamba_layer_step); }
