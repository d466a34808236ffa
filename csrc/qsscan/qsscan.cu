// QSScan: the selective scan of Mamba on int8 (or float) inputs, fp32 inside.
// Specification: quamba/ops/scan/qsscan.py (and quamba/ops/scan/selective_scan.py for the recurrence).
//
// Prefill layout of the work. A block owns kChannels channels of one sequence and walks the
// sequence in chunks of kLanes·kItems time steps. A small first kernel dequantizes B and C (shared
// by every channel) once into fp32 chunk tiles, already in shared-memory order; per chunk, each
// block copies those tiles with cp.async and stages u, dt, z of its channels as fp32, loading along
// whichever dimension each tensor has contiguous (the module's channel-last tensors and
// channel-first ones both read coalesced; int8 codes in aligned layouts move as 8- or 16-byte
// vectors, and so does y on the way out). Then each group of kLanes lanes scans one channel: lane
// l of the group owns kItems consecutive time steps; for each state n it forms the pairs
// (decay, drive) = (exp(Δ A_n), Δ u B_n), reduces them over its own steps, combines the kLanes
// lane aggregates with a shuffle scan (the state carried in from the previous chunk enters at the
// group's first lane), and rescans its steps from the resulting start state, accumulating C_n · h.
// No block barrier sits inside the scan; the chunk carries live in shared memory (double
// buffered), and the shuffle scan uses shfl.sync's own in-range predicate, so a scan step is
// four instructions. benchmarks/notes_ssm_perf.md has the instruction counts and timings.
#include <torch/library.h>

#include "../ssm_common/ssm_common.cuh"
#include "gemm/mma.cuh"
#include "pdl.cuh"
#include "qsscan_chunked.h"
#include "scan_args.h"
#include "scan_math.cuh"
#include "scan_step.cuh"

namespace quamba_ssm {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kMaxState = 32;

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// Shared-memory row of one chunk (kLanes lanes × kItems time steps). Time step t of a row sits at
// pos(t): lane l's kItems steps are stored as kItems / 4 groups of 4, and group q of all kLanes
// lanes is contiguous, so the lanes' 16-byte reads of one group cover contiguous bytes (no bank
// conflict).
template <int kLanes, int kItems>
struct ChunkRow {
  static_assert(kItems % 4 == 0, "kItems must be a multiple of 4");
  static constexpr int kLanesPerRow = kLanes, kItemsPerLane = kItems;
  static constexpr int kLen = kLanes * kItems;
  static constexpr int kPitch = kLen + 4;  // staged rows start 4 banks apart
  __device__ static int pos(int t) {
    return (t % kItems / 4) * (4 * kLanes) + (t / kItems) * 4 + t % 4;
  }
};

// Loads rows [row0, row0 + rows) × the chunk's time steps of one input into a tile (row pitch
// kPitch, time steps at pos(t)) as fp32, zero outside the tensor. Consecutive threads follow the
// dimension with stride 1.
template <typename Row, int kPitch, int kThreads, typename T>
__device__ __forceinline__ void stage_typed(float* tile, const T* data, float scale,
                                            const Strides3& st, int b, int row0, int rows,
                                            int row_limit, int t0, int seqlen) {
  const bool row_fast = st.dim == 1 && st.time != 1;
  const T* base = data + b * st.batch + row0 * st.dim + t0 * st.time;
  const int rows_left = row_limit - row0, steps_left = seqlen - t0;
#pragma unroll 4
  for (int e = threadIdx.x; e < rows * Row::kLen; e += kThreads) {
    const int r = row_fast ? e % rows : e / Row::kLen;
    const int t = row_fast ? e / rows : e % Row::kLen;
    float value = 0.f;
    if (r < rows_left && t < steps_left) value = dequantize(base[r * st.dim + t * st.time], scale);
    tile[r * kPitch + Row::pos(t)] = value;
  }
}

template <typename Row, int kPitch, int kThreads>
__device__ __forceinline__ void stage_rows(float* tile, const FloatSource& src,
                                           const Strides3& st, int b, int row0, int rows,
                                           int row_limit, int t0, int seqlen) {
  switch (src.kind) {
    case InKind::kInt8:
      return stage_typed<Row, kPitch, kThreads>(tile, static_cast<const int8_t*>(src.data),
                                                src.scale, st, b, row0, rows, row_limit, t0,
                                                seqlen);
    case InKind::kHalf:
      return stage_typed<Row, kPitch, kThreads>(tile, static_cast<const __half*>(src.data),
                                                src.scale, st, b, row0, rows, row_limit, t0,
                                                seqlen);
    case InKind::kBFloat16:
      return stage_typed<Row, kPitch, kThreads>(
          tile, static_cast<const __nv_bfloat16*>(src.data), src.scale, st, b, row0, rows,
          row_limit, t0, seqlen);
    default:
      return stage_typed<Row, kPitch, kThreads>(tile, static_cast<const float*>(src.data),
                                                src.scale, st, b, row0, rows, row_limit, t0,
                                                seqlen);
  }
}

// Time step of the slot-th of a chunk's kLen steps such that a warp's 32 consecutive slots land
// in 32 different shared-memory banks of a tile row: 8 lanes' worth of steps (j / 4) × 4
// consecutive steps (j % 4) of one group of 4.
template <typename Row>
__device__ __forceinline__ int conflict_free_step(int slot) {
  constexpr int kQuads = Row::kItemsPerLane / 4;
  static_assert(Row::kLanesPerRow % 8 == 0, "needs lanes in multiples of 8");
  const int w = slot / 32, j = slot % 32;
  return ((w / kQuads) * 8 + j / 4) * Row::kItemsPerLane + (w % kQuads) * 4 + j % 4;
}

// Channel-fast int8 tile: one 16-byte (8-byte) load per (time step, 16 (8) channels), then
// scalar stores.
template <typename Row, int kThreads, int kChannels>
__device__ __forceinline__ void stage_channel_vec(float* tile, const FloatSource& src,
                                                  const Strides3& st, int b, int d0, int dim,
                                                  int t0, int seqlen) {
  constexpr int kGroup = kChannels % 16 == 0 ? 16 : 8;
  static_assert(kChannels % kGroup == 0, "channel groups of 8 or 16");
  const int8_t* base = static_cast<const int8_t*>(src.data) + b * st.batch + d0;
#pragma unroll 1
  for (int item = threadIdx.x; item < kChannels / kGroup * Row::kLen; item += kThreads) {
    const int g = item / Row::kLen, t = conflict_free_step<Row>(item % Row::kLen);
    unsigned words[kGroup / 4] = {};
    if (d0 + kGroup * g < dim && t0 + t < seqlen) {
      const int8_t* codes = base + kGroup * g + (t0 + t) * st.time;
      if constexpr (kGroup == 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(codes);
        words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
      } else {
        const uint2 v = *reinterpret_cast<const uint2*>(codes);
        words[0] = v.x, words[1] = v.y;
      }
    }
    float* dst = tile + kGroup * g * Row::kPitch + Row::pos(t);
#pragma unroll
    for (int c = 0; c < kGroup; ++c) dst[c * Row::kPitch] = code_of(words[c / 4], c % 4, src.scale);
  }
}

// Time-fast int8 tile: one 16-byte load per (channel, 16 time steps), four 16-byte stores.
template <typename Row, int kThreads, int kChannels>
__device__ __forceinline__ void stage_time_vec(float* tile, const FloatSource& src,
                                               const Strides3& st, int b, int d0, int dim, int t0,
                                               int seqlen) {
  constexpr int kVecs = Row::kLen / 16;
  const int8_t* base = static_cast<const int8_t*>(src.data) + b * st.batch + d0 * st.dim + t0;
#pragma unroll 1
  for (int item = threadIdx.x; item < kChannels * kVecs; item += kThreads) {
    const int r = item / kVecs, t = item % kVecs * 16;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (d0 + r < dim && t0 + t < seqlen) {
      v = *reinterpret_cast<const uint4*>(base + r * st.dim + t);
    }
    const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int h = 0; h < 4; ++h) {
      *reinterpret_cast<float4*>(tile + r * Row::kPitch + Row::pos(t + 4 * h)) =
          make_float4(code_of(words[h], 0, src.scale), code_of(words[h], 1, src.scale),
                      code_of(words[h], 2, src.scale), code_of(words[h], 3, src.scale));
    }
  }
}

template <typename Row, int kThreads, int kChannels>
__device__ __forceinline__ void stage_vec(float* tile, const FloatSource& src, const Strides3& st,
                                          int b, int d0, int dim, int t0, int seqlen,
                                          int staging) {
  if (staging == kChannelVec) {
    return stage_channel_vec<Row, kThreads, kChannels>(tile, src, st, b, d0, dim, t0, seqlen);
  }
  stage_time_vec<Row, kThreads, kChannels>(tile, src, st, b, d0, dim, t0, seqlen);
}

constexpr int kPrepareThreads = 256;

// B and C of chunk blockIdx.x of sequence blockIdx.y as fp32 tiles in shared-memory order
// (pitch = chunk length), so every scan block copies them instead of converting them again.
template <typename Row>
__global__ void __launch_bounds__(kPrepareThreads) prepare_bc_kernel(const ScanArgs a) {
  const int chunk = blockIdx.x, b = blockIdx.y;
  float* tile = a.bc + (static_cast<int64_t>(b) * a.chunks + chunk) * 2 * a.dstate * Row::kLen;
  const int t0 = chunk * Row::kLen;
  stage_rows<Row, Row::kLen, kPrepareThreads>(tile, a.B, a.B_st, b, 0, a.dstate, a.dstate, t0,
                                              a.seqlen);
  stage_rows<Row, Row::kLen, kPrepareThreads>(tile + a.dstate * Row::kLen, a.C, a.C_st, b, 0,
                                              a.dstate, a.dstate, t0, a.seqlen);
}

// The kItems values of lane `sub` of its group from a tile row.
template <typename Row, int kItems>
__device__ __forceinline__ void load_items(const float* row, int sub, float (&v)[kItems]) {
#pragma unroll
  for (int q = 0; q < kItems / 4; ++q) {
    const float4 g = *reinterpret_cast<const float4*>(row + q * 4 * (Row::kLen / kItems) + sub * 4);
    v[4 * q] = g.x, v[4 * q + 1] = g.y, v[4 * q + 2] = g.z, v[4 * q + 3] = g.w;
  }
}

template <typename Row, int kItems>
__device__ __forceinline__ void store_items(float* row, int sub, const float (&v)[kItems]) {
#pragma unroll
  for (int q = 0; q < kItems / 4; ++q) {
    *reinterpret_cast<float4*>(row + q * 4 * (Row::kLen / kItems) + sub * 4) =
        make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
  }
}

// One step of the inclusive scan over a group of kLanes lanes of segment pairs (decay, end
// state): the lane offset lanes below (if it lies in the group) is folded in. The shuffle's own
// in-range predicate guards the update, so no lane-index compare is needed. kWithDecay: also
// combine the decays (not needed after the last step).
template <int kLanes, bool kWithDecay>
__device__ __forceinline__ void scan_step(float& decay, float& state, int offset) {
  constexpr int kSegment = (32 - kLanes) << 8;
  if (kWithDecay) {
    asm("{\n\t.reg .pred p;\n\t.reg .f32 ps, pd;\n\t"
        "shfl.sync.up.b32 ps|p, %1, %2, %3, -1;\n\t"
        "shfl.sync.up.b32 pd, %0, %2, %3, -1;\n\t"
        "@p fma.rn.f32 %1, %0, ps, %1;\n\t"
        "@p mul.rn.f32 %0, %0, pd;\n\t}"
        : "+f"(decay), "+f"(state)
        : "r"(offset), "n"(kSegment));
  } else {
    asm("{\n\t.reg .pred p;\n\t.reg .f32 ps;\n\t"
        "shfl.sync.up.b32 ps|p, %0, %2, %3, -1;\n\t"
        "@p fma.rn.f32 %0, %1, ps, %0;\n\t}"
        : "+f"(state)
        : "f"(decay), "r"(offset), "n"(kSegment));
  }
}

// The end state of the lane below in the group, or `first` in the group's first lane.
template <int kLanes>
__device__ __forceinline__ float state_before(float end_state, float first) {
  constexpr int kSegment = (32 - kLanes) << 8;
  float h;
  asm("{\n\t.reg .pred p;\n\t"
      "shfl.sync.up.b32 %0|p, %1, 1, %3, -1;\n\t"
      "@!p mov.b32 %0, %2;\n\t}"
      : "=&f"(h)
      : "f"(end_state), "f"(first), "n"(kSegment));
  return h;
}

// The (decay, drive) pairs of state n over a lane's kItems steps and the lane's end state from
// zero, for a method other than zoh: drive = (B̄ / Δ) · (Δ u) · B, or for foh
// Δ ((φ1 - φ2) v_{t-1} + φ2 v_t) with v = u B. drive_base: Δ u (u for foh); v_before: foh's v of
// the step before the lane's first. Returns the lane's decay product (exp(a ΣΔ) for the
// exponential methods, the explicit product for the others).
template <Discretization kMethod, int kItems>
__device__ __forceinline__ float discretized_pairs(const float (&delta)[kItems],
                                                   const float (&drive_base)[kItems],
                                                   const float (&B)[kItems], float a,
                                                   float delta_sum, float v_before,
                                                   float (&decay)[kItems], float (&drive)[kItems],
                                                   float& end_state) {
  float lane_decay = 1.f, v_previous = v_before;
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const StepCoefficients c = fast_coefficients<kMethod>(delta[i], a);
    decay[i] = c.decay;
    if constexpr (kMethod == Discretization::kFoh) {
      const float v = drive_base[i] * B[i];
      drive[i] = delta[i] * fmaf(c.previous_gain, v_previous, c.gain * v);
      v_previous = v;
    } else {
      drive[i] = c.gain * drive_base[i] * B[i];
    }
    end_state = fmaf(decay[i], end_state, drive[i]);
    if constexpr (!is_exponential(kMethod)) lane_decay *= decay[i];
  }
  if constexpr (is_exponential(kMethod)) lane_decay = exp2_approx(delta_sum * (a * kLog2e));
  return lane_decay;
}

// The work of one group of kLanes lanes on one chunk: tile row `row`, kItems steps per lane.
// carry_in / carry_out ([rows, dstate]) hold the states at the chunk's start and end; for foh,
// drive_in / drive_out the drives v = u B of the steps before the chunk and of its last step.
// A_tile holds A · log2(e) for zoh, A for the other methods. Leaves y = (C · h + D u) ⊙ silu(z)
// in the u tile.
template <Discretization kMethod, typename Row, int kLanes, int kItems>
__device__ __forceinline__ void scan_chunk(float* u_tile, const float* dt_tile,
                                           const float* z_tile, const float* B_tile,
                                           const float* C_tile, const float* A_tile,
                                           const float* carry_in, float* carry_out,
                                           const float* drive_in, float* drive_out,
                                           const ScanArgs& a, int row, int d0, int t0,
                                           float bias, float skip) {
  constexpr bool kZoh = kMethod == Discretization::kZoh;
  const int sub = threadIdx.x % kLanes;
  // drive_base: Δ u (u for foh, whose drive pairs Δ_t with u_{t-1}).
  float delta[kItems], drive_base[kItems], acc[kItems], delta_sum = 0.f;
  {
    float dt[kItems], u[kItems];
    load_items<Row>(dt_tile + row * Row::kPitch, sub, dt);
    load_items<Row>(u_tile + row * Row::kPitch, sub, u);
    const bool row_valid = d0 + row < a.dim;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const bool valid = row_valid && t0 + sub * kItems + i < a.seqlen;
      // Padding steps get Δ = 0: decay 1, drive 0, so the carried state passes through.
      delta[i] = valid ? softplus_fast(__fadd_rn(dt[i], bias)) : 0.f;
      drive_base[i] = kMethod == Discretization::kFoh ? u[i] : __fmul_rn(delta[i], u[i]);
      delta_sum += delta[i];
      acc[i] = 0.f;
    }
    // Opaque to the compiler, which otherwise re-adds the kItems deltas for every state.
    asm volatile("" : "+f"(delta_sum));
  }
  const float* A_row = A_tile + row * a.dstate;
  const float* carry_in_row = carry_in + row * a.dstate;
  float* carry_out_row = carry_out + row * a.dstate;
#pragma unroll 1
  for (int n = 0; n < a.dstate; ++n) {
    const float A = A_row[n];
    const float chunk_start = carry_in_row[n];
    float decay[kItems], drive[kItems];
    float end_state = 0.f, lane_decay;
    {
      float B[kItems];
      load_items<Row>(B_tile + n * Row::kLen, sub, B);
      if constexpr (kZoh) {
#pragma unroll
        for (int i = 0; i < kItems; ++i) {
          decay[i] = exp2_approx(delta[i] * A);
          drive[i] = drive_base[i] * B[i];
          end_state = fmaf(decay[i], end_state, drive[i]);
        }
        // The product of the lane's decays is exp(A Σ Δ): one exponential instead of kItems
        // products.
        lane_decay = exp2_approx(delta_sum * A);
      } else {
        float v_before = 0.f;
        if constexpr (kMethod == Discretization::kFoh) {
          // v of the step before each lane's first: the lane below's last, or the last of the
          // previous chunk (zero before the sequence) in the group's first lane.
          const float v_last = drive_base[kItems - 1] * B[kItems - 1];
          v_before = state_before<kLanes>(v_last, drive_in[row * a.dstate + n]);
          if (sub == kLanes - 1) drive_out[row * a.dstate + n] = v_last;
        }
        lane_decay = discretized_pairs<kMethod>(delta, drive_base, B, A, delta_sum, v_before,
                                                decay, drive, end_state);
      }
    }
    if (sub == 0) end_state = fmaf(lane_decay, chunk_start, end_state);
#pragma unroll
    for (int offset = 1; offset < kLanes / 2; offset *= 2) {
      scan_step<kLanes, true>(lane_decay, end_state, offset);
    }
    scan_step<kLanes, false>(lane_decay, end_state, kLanes / 2);
    float h = state_before<kLanes>(end_state, chunk_start);
    if (sub == kLanes - 1) carry_out_row[n] = end_state;
    float C[kItems];
    load_items<Row>(C_tile + n * Row::kLen, sub, C);
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      h = fmaf(decay[i], h, drive[i]);
      acc[i] = fmaf(C[i], h, acc[i]);
    }
  }
  float* u_row = u_tile + row * Row::kPitch;
  float u[kItems], gate[kItems];
  load_items<Row>(u_row, sub, u);
  if (z_tile != nullptr) {
    load_items<Row>(z_tile + row * Row::kPitch, sub, gate);
#pragma unroll
    for (int i = 0; i < kItems; ++i) gate[i] = silu_fast(gate[i]);
  }
#pragma unroll
  for (int i = 0; i < kItems; ++i) {
    const float y = __fadd_rn(acc[i], __fmul_rn(u[i], skip));
    acc[i] = z_tile != nullptr ? __fmul_rn(y, gate[i]) : y;
  }
  store_items<Row>(u_row, sub, acc);
}

// Writes the chunk's y (in the u tile) to global memory, coalesced along y's stride-1 dimension.
template <typename Row, int kThreads, typename Out>
__device__ __forceinline__ void store_y(const float* y_tile, const ScanArgs& a, int b, int d0,
                                        int rows, int t0) {
  const Strides3& st = a.y_st;
  const bool row_fast = st.dim == 1 && st.time != 1;
  Out* y = static_cast<Out*>(a.y) + b * st.batch + d0 * st.dim + t0 * st.time;
  const int rows_left = a.dim - d0, steps_left = a.seqlen - t0;
#pragma unroll 4
  for (int e = threadIdx.x; e < rows * Row::kLen; e += kThreads) {
    const int r = row_fast ? e % rows : e / Row::kLen;
    const int t = row_fast ? e / rows : e % Row::kLen;
    if (r < rows_left && t < steps_left) {
      y[r * st.dim + t * st.time] = from_float<Out>(y_tile[r * Row::kPitch + Row::pos(t)]);
    }
  }
}

// 16 bytes of y: the kVec = 16 / sizeof(Out) values in Out.
template <typename Out>
__device__ __forceinline__ uint4 pack_y(const float* v);
template <>
__device__ __forceinline__ uint4 pack_y<float>(const float* v) {
  return make_uint4(__float_as_uint(v[0]), __float_as_uint(v[1]), __float_as_uint(v[2]),
                    __float_as_uint(v[3]));
}
template <typename Half2>
__device__ __forceinline__ unsigned pack_pair(float lo, float hi);
template <>
__device__ __forceinline__ unsigned pack_pair<__half>(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <>
__device__ __forceinline__ unsigned pack_pair<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const unsigned*>(&h);
}
template <>
__device__ __forceinline__ uint4 pack_y<__half>(const float* v) {
  return make_uint4(pack_pair<__half>(v[0], v[1]), pack_pair<__half>(v[2], v[3]),
                    pack_pair<__half>(v[4], v[5]), pack_pair<__half>(v[6], v[7]));
}
template <>
__device__ __forceinline__ uint4 pack_y<__nv_bfloat16>(const float* v) {
  return make_uint4(pack_pair<__nv_bfloat16>(v[0], v[1]), pack_pair<__nv_bfloat16>(v[2], v[3]),
                    pack_pair<__nv_bfloat16>(v[4], v[5]), pack_pair<__nv_bfloat16>(v[6], v[7]));
}

// The chunk's y (in the u tile) with 16-byte stores along y's stride-1 dimension (staging modes
// kChannelVec and kTimeVec).
template <typename Row, int kThreads, int kChannels, typename Out>
__device__ __forceinline__ void store_y_vec(const float* y_tile, const ScanArgs& a, int b, int d0,
                                            int t0, int staging) {
  constexpr int kVec = 16 / sizeof(Out);
  const Strides3& st = a.y_st;
  Out* y = static_cast<Out*>(a.y) + b * st.batch + d0 * st.dim + t0 * st.time;
  float v[kVec];
  static_assert(kChannels % kVec == 0, "whole vectors of channels");
  if (staging == kChannelVec) {
#pragma unroll 1
    for (int item = threadIdx.x; item < kChannels / kVec * Row::kLen; item += kThreads) {
      const int g = item / Row::kLen, t = conflict_free_step<Row>(item % Row::kLen);
      if (d0 + kVec * g >= a.dim || t0 + t >= a.seqlen) continue;
      const float* src = y_tile + kVec * g * Row::kPitch + Row::pos(t);
#pragma unroll
      for (int c = 0; c < kVec; ++c) v[c] = src[c * Row::kPitch];
      *reinterpret_cast<uint4*>(y + kVec * g + t * st.time) = pack_y<Out>(v);
    }
  } else {
    constexpr int kVecs = Row::kLen / kVec;
#pragma unroll 1
    for (int item = threadIdx.x; item < kChannels * kVecs; item += kThreads) {
      const int r = item / kVecs, t = item % kVecs * kVec;
      if (d0 + r >= a.dim || t0 + t >= a.seqlen) continue;
#pragma unroll
      for (int h = 0; h < kVec / 4; ++h) {
        const float4 q = *reinterpret_cast<const float4*>(y_tile + r * Row::kPitch +
                                                          Row::pos(t + 4 * h));
        v[4 * h] = q.x, v[4 * h + 1] = q.y, v[4 * h + 2] = q.z, v[4 * h + 3] = q.w;
      }
      *reinterpret_cast<uint4*>(y + r * st.dim + t) = pack_y<Out>(v);
    }
  }
}

// Shared memory of a scan block, in floats: the u, dt, z tiles, the B and C tiles, A (· log2(e)
// for zoh), the two carry buffers (chunk start, chunk end; they swap every chunk), and for foh two
// drive buffers likewise.
template <Discretization kMethod, typename Row, int kChannels>
int scan_smem_floats(int dstate) {
  const int carries = kMethod == Discretization::kFoh ? 4 : 2;
  return 3 * kChannels * Row::kPitch + 2 * dstate * Row::kLen + (1 + carries) * kChannels * dstate;
}

template <Discretization kMethod, int kWarps, int kLanes, int kItems, int kMinBlocks,
          typename Out>
__global__ void __launch_bounds__(kWarps * 32, kMinBlocks)
qsscan_kernel(const ScanArgs a) {
  using Row = ChunkRow<kLanes, kItems>;
  constexpr int kChannels = kWarps * 32 / kLanes, kThreads = kWarps * 32;
  extern __shared__ float4 smem_vec[];
  float* u_tile = reinterpret_cast<float*>(smem_vec);
  float* dt_tile = u_tile + kChannels * Row::kPitch;
  float* z_tile = dt_tile + kChannels * Row::kPitch;
  float* B_tile = z_tile + kChannels * Row::kPitch;  // then the C tile: dstate rows each
  float* C_tile = B_tile + a.dstate * Row::kLen;
  float* A_tile = C_tile + a.dstate * Row::kLen;  // [kChannels, dstate]: A (· log2(e) for zoh)
  float* carry_tiles = A_tile + kChannels * a.dstate;  // 2 × [kChannels, dstate]
  float* drive_tiles = carry_tiles + 2 * kChannels * a.dstate;  // foh: 2 × [kChannels, dstate]

  const int b = blockIdx.y;
  const int d0 = blockIdx.x * kChannels;
  const int row = threadIdx.x / kLanes;
  const bool has_z = a.z.data != nullptr;
  const int tile_bc = a.dstate * Row::kLen;  // floats in the B tile, and in the C tile
  static_assert(kChannels % 8 == 0, "the channel-fast vector path moves groups of 8 or 16");
  const int staging = a.staging;
  const int carry_floats = kChannels * a.dstate;

  for (int e = threadIdx.x; e < kChannels * a.dstate; e += kThreads) {
    const int d = d0 + e / a.dstate;
    const float A_log = d < a.dim ? dequantize(a.params.A_log[d * a.dstate + e % a.dstate],
                                               a.params.A_log_scale)
                                  : 0.f;
    if constexpr (kMethod == Discretization::kZoh) {
      A_tile[e] = d < a.dim ? __fmul_rn(-expf(A_log), kLog2e) : 0.f;
    } else {
      A_tile[e] = d < a.dim ? -expf(A_log) : 0.f;
    }
    carry_tiles[e] = 0.f;  // the zero initial state
    if constexpr (kMethod == Discretization::kFoh) drive_tiles[e] = 0.f;  // v_{-1} = 0
  }
  const int d = d0 + row;
  const float bias = d < a.dim ? a.params.bias(d) : 0.f;
  const float skip = d < a.dim ? a.params.skip(d) : 0.f;

  for (int chunk = 0; chunk < a.chunks; ++chunk) {
    const int t0 = chunk * Row::kLen;
    __syncthreads();  // the previous chunk's tiles are consumed
    const float* bc = a.bc + (static_cast<int64_t>(b) * a.chunks + chunk) * 2 * tile_bc;
    for (int i = threadIdx.x; i < tile_bc / 2; i += kThreads) {
      cp_async16(B_tile + 4 * i, bc + 4 * i);
    }
    if (staging != kGeneric) {
      stage_vec<Row, kThreads, kChannels>(u_tile, a.u, a.u_st, b, d0, a.dim, t0, a.seqlen,
                                          staging);
      stage_vec<Row, kThreads, kChannels>(dt_tile, a.dt, a.dt_st, b, d0, a.dim, t0, a.seqlen,
                                          staging);
      if (has_z) {
        stage_vec<Row, kThreads, kChannels>(z_tile, a.z, a.z_st, b, d0, a.dim, t0, a.seqlen,
                                            staging);
      }
    } else {
      stage_rows<Row, Row::kPitch, kThreads>(u_tile, a.u, a.u_st, b, d0, kChannels, a.dim, t0,
                                             a.seqlen);
      stage_rows<Row, Row::kPitch, kThreads>(dt_tile, a.dt, a.dt_st, b, d0, kChannels, a.dim, t0,
                                             a.seqlen);
      if (has_z) {
        stage_rows<Row, Row::kPitch, kThreads>(z_tile, a.z, a.z_st, b, d0, kChannels, a.dim, t0,
                                               a.seqlen);
      }
    }
    cp_async_wait_all();
    __syncthreads();
    const float* carry_in = carry_tiles + (chunk % 2) * carry_floats;
    float* carry_out = carry_tiles + (1 - chunk % 2) * carry_floats;
    const float* drive_in = drive_tiles + (chunk % 2) * carry_floats;
    float* drive_out = drive_tiles + (1 - chunk % 2) * carry_floats;
    scan_chunk<kMethod, Row, kLanes, kItems>(u_tile, dt_tile, has_z ? z_tile : nullptr, B_tile,
                                             C_tile, A_tile, carry_in, carry_out, drive_in,
                                             drive_out, a, row, d0, t0, bias, skip);
    __syncthreads();
    if (staging != kGeneric) {
      store_y_vec<Row, kThreads, kChannels, Out>(u_tile, a, b, d0, t0, staging);
    } else {
      store_y<Row, kThreads, Out>(u_tile, a, b, d0, kChannels, t0);
    }
  }

  const float* last = carry_tiles + (a.chunks % 2) * carry_floats;
  for (int e = threadIdx.x; e < kChannels * a.dstate; e += kThreads) {
    if (d0 + e / a.dstate >= a.dim) continue;
    const int64_t offset = (static_cast<int64_t>(b) * a.dim + d0) * a.dstate + e;
    if (a.state_int8) {
      static_cast<int8_t*>(a.state)[offset] = quantize_rn(last[e], a.state_inv_scale);
    } else {
      static_cast<float*>(a.state)[offset] = last[e];
    }
  }
}

template <Discretization kMethod, int kWarps, int kLanes, int kItems, int kMinBlocks,
          typename Out>
void launch_scan_config(ScanArgs args, const at::Tensor& u) {
  using Row = ChunkRow<kLanes, kItems>;
  constexpr int kChannels = kWarps * 32 / kLanes;
  const int batch = u.size(0);
  args.chunks = ceil_div(args.seqlen, Row::kLen);
  const at::Tensor bc =
      at::empty({batch, args.chunks, 2, args.dstate, Row::kLen}, u.options().dtype(at::kFloat));
  args.bc = bc.data_ptr<float>();

  auto prepare = prepare_bc_kernel<Row>;
  check_kernel_image(prepare, "qsscan");
  prepare<<<dim3(args.chunks, batch), kPrepareThreads, 0, current_stream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  auto kernel = qsscan_kernel<kMethod, kWarps, kLanes, kItems, kMinBlocks, Out>;
  check_kernel_image(kernel, "qsscan");
  const int smem = scan_smem_floats<kMethod, Row, kChannels>(args.dstate) * sizeof(float);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(ceil_div(args.dim, kChannels), batch);
  kernel<<<grid, kWarps * 32, smem, current_stream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launch configurations, timed against each other by benchmarks/bench_ssm.py --configs
// (benchmarks/notes_ssm_perf.md). Configs 0 and 1 are this file's kernel, <warps, lanes per
// channel, steps per lane, blocks per SM>: config 0, 2 channels per warp, 16 channels per block,
// 2 blocks per SM (128 registers), chunks of 256 steps; config 1, 4 channels per warp, 8 per
// block, up to 8 blocks per SM, chunks of 128 steps (its grid for 5120 channels, 640 blocks, fits
// the 132 SMs in one wave). Config 2 is the chunked scan of qsscan_chunked.cu, a lane per channel
// walking a chunk of steps. The op's default, kAutoConfig, takes config 2 where u's channels are
// contiguous (the mixer's channel-last views: config 2 is 1.2x config 0 at batch 1 and equal at
// batch 8) and config 0 for channel-first inputs (config 2 reads those element by element, at
// about half config 0's speed; benchmarks/RESULTS.md).
constexpr int kScanConfigs = 3;
constexpr int kChunkedConfig = 2, kAutoConfig = -1;

template <Discretization kMethod, typename Out>
void launch_scan_method(const ScanArgs& args, const at::Tensor& u, int64_t config) {
  switch (config) {
    case 0: return launch_scan_config<kMethod, 8, 16, 16, 2, Out>(args, u);
    default: return launch_scan_config<kMethod, 2, 8, 16, 8, Out>(args, u);
  }
}

template <typename Out>
void launch_scan(const ScanArgs& args, const at::Tensor& u, int64_t config,
                 Discretization method) {
  with_method(method,
              [&](auto m) { launch_scan_method<decltype(m)::value, Out>(args, u, config); });
}

FloatSource float_source(const at::Tensor& t, double scale, const char* name,
                         const char* scale_name) {
  const InKind kind = in_kind(t, name);
  if (kind == InKind::kInt8) check_positive_scale(scale, scale_name);
  return FloatSource{t.data_ptr(), kind, to_fp32(scale)};
}

Strides3 strides3(const at::Tensor& t) { return Strides3{t.stride(0), t.stride(1), t.stride(2)}; }

bool aligned_runs(const at::Tensor& t, bool channel_fast) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  const int64_t fast = channel_fast ? 1 : 2, other = channel_fast ? 2 : 1;
  const int64_t bytes = t.element_size();
  return t.stride(fast) == 1 && t.size(fast) * bytes % 16 == 0 &&
         t.stride(0) * bytes % 16 == 0 && t.stride(other) * bytes % 16 == 0;
}

// The vector staging mode of the scan kernel for these tensors (Staging).
int staging_mode(const at::Tensor& u, const at::Tensor& dt, const c10::optional<at::Tensor>& z,
                 const at::Tensor& y, bool channel_fast) {
  const bool int8 = u.scalar_type() == at::kChar && dt.scalar_type() == at::kChar &&
                    (!z.has_value() || z->scalar_type() == at::kChar);
  if (!int8 || !aligned_runs(u, channel_fast) || !aligned_runs(dt, channel_fast) ||
      (z.has_value() && !aligned_runs(*z, channel_fast)) || !aligned_runs(y, channel_fast)) {
    return kGeneric;
  }
  return channel_fast ? kChannelVec : kTimeVec;
}

// Whether B and C are int8 codes whose dstate values of a step lie in 16-byte aligned runs.
bool state_runs_aligned(const at::Tensor& B, const at::Tensor& C) {
  for (const at::Tensor* t : {&B, &C}) {
    if (t->scalar_type() != at::kChar || t->stride(1) != 1 || t->size(1) % 16 != 0 ||
        reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 != 0 || t->stride(0) % 16 != 0 ||
        t->stride(2) % 16 != 0) {
      return false;
    }
  }
  return true;
}

// The chunked kernel's plan: what its staging can vectorize (the launcher fills the rest).
ChunkPlan chunk_plan(const ScanArgs& args, int64_t batch, const at::Tensor& B,
                     const at::Tensor& C) {
  ChunkPlan plan{};
  plan.batch = static_cast<int>(batch);
  plan.channel_vec = args.staging == kChannelVec;
  plan.state_vec = state_runs_aligned(B, C);
  return plan;
}

// u, dt, z: [batch, dim, seqlen]; B, C: [batch, dstate, seqlen]; any strides, each int8 codes
// with its scale or float16/bfloat16/float32 values. y keeps u's layout family (channel-last
// when u.stride(1) == 1, else contiguous); the last state is contiguous [batch, dim, dstate],
// int8 when state_inv_scale is given, else fp32. discretization: a method of
// quamba.ops.scan.discretization (foh starts from v_{-1} = 0, as the reference's prefill does).
std::tuple<at::Tensor, at::Tensor> qsscan(
    const at::Tensor& u, double u_scale, const at::Tensor& dt, double dt_scale,
    const at::Tensor& B, double B_scale, const at::Tensor& C, double C_scale,
    const c10::optional<at::Tensor>& z, double z_scale, const at::Tensor& A_log,
    double A_log_scale, const at::Tensor& D, double D_scale, const at::Tensor& dt_bias,
    double dt_bias_scale, c10::optional<double> state_inv_scale, at::ScalarType out_dtype,
    int64_t config, c10::string_view discretization, int64_t chunk_len) {
  check_cuda(u, "u");
  TORCH_CHECK(u.dim() == 3, "u must be [batch, dim, seqlen], got ", text(u.sizes()));
  const int64_t batch = u.size(0), dim = u.size(1), seqlen = u.size(2);
  TORCH_CHECK(A_log.dim() == 2, "A_log must be [dim, dstate], got ", text(A_log.sizes()));
  const int64_t dstate = A_log.size(1);
  TORCH_CHECK(dstate >= 1 && dstate <= kMaxState, "A_log: dstate must be in 1..", text(kMaxState),
              ", got ", text(dstate));
  TORCH_CHECK(batch <= 65535, "u batch must be at most 65535, got ", text(batch));
  TORCH_CHECK(dim < (int64_t{1} << 31) && seqlen < (int64_t{1} << 31),
              "u dim and seqlen must be below 2^31");
  check_same_device(dt, u, "dt");
  check_shape(dt, u.sizes(), "dt");
  check_same_device(B, u, "B");
  check_shape(B, {batch, dstate, seqlen}, "B");
  check_same_device(C, u, "C");
  check_shape(C, {batch, dstate, seqlen}, "C");
  if (z.has_value()) {
    check_same_device(*z, u, "z");
    check_shape(*z, u.sizes(), "z");
  }
  check_ssm_params(u, A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale, dim, dstate);
  check_out_dtype(out_dtype);
  if (state_inv_scale.has_value()) check_positive_scale(*state_inv_scale, "state_inv_scale");
  TORCH_CHECK(config >= kAutoConfig && config < kScanConfigs, "config must be in 0..",
              text(kScanConfigs - 1), " (or -1, chosen by layout), got ", text(config));
  const Discretization method = discretization_of(discretization);
  const c10::cuda::CUDAGuard guard(u.device());

  const bool channel_fast = u.stride(1) == 1 && u.stride(2) != 1;
  if (config == kAutoConfig) config = channel_fast ? kChunkedConfig : 0;
  at::Tensor y = channel_fast
                     ? at::empty({batch, seqlen, dim}, u.options().dtype(out_dtype)).transpose(1, 2)
                     : at::empty({batch, dim, seqlen}, u.options().dtype(out_dtype));
  const auto state_type = state_inv_scale.has_value() ? at::kChar : at::kFloat;
  at::Tensor state = at::empty({batch, dim, dstate}, u.options().dtype(state_type));

  ScanArgs args{};
  args.u = float_source(u, u_scale, "u", "u_scale");
  args.dt = float_source(dt, dt_scale, "dt", "dt_scale");
  args.B = float_source(B, B_scale, "B", "B_scale");
  args.C = float_source(C, C_scale, "C", "C_scale");
  args.z = z.has_value() ? float_source(*z, z_scale, "z", "z_scale")
                         : FloatSource{nullptr, InKind::kFloat, 1.f};
  args.u_st = strides3(u);
  args.dt_st = strides3(dt);
  args.B_st = strides3(B);
  args.C_st = strides3(C);
  args.z_st = z.has_value() ? strides3(*z) : Strides3{0, 0, 0};
  args.params = ssm_params(A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale);
  args.y = y.data_ptr();
  args.y_st = strides3(y);
  args.state = state.data_ptr();
  args.state_int8 = state_inv_scale.has_value();
  args.state_inv_scale = state_inv_scale.has_value() ? to_fp32(*state_inv_scale) : 0.f;
  args.dim = dim;
  args.dstate = dstate;
  args.seqlen = seqlen;
  args.staging = staging_mode(u, dt, z, y, channel_fast);

  if (batch == 0 || dim == 0) return {y, state};
  if (seqlen == 0) {
    state.zero_();  // no step taken: the state stays the zero initial state
    return {y, state};
  }
  if (config == kChunkedConfig) {
    launch_chunked_scan(args, chunk_plan(args, batch, B, C), u, chunk_len, method, out_dtype);
    return {y, state};
  }
  switch (out_dtype) {
    case at::kHalf: launch_scan<__half>(args, u, config, method); break;
    case at::kBFloat16: launch_scan<__nv_bfloat16>(args, u, config, method); break;
    default: launch_scan<float>(args, u, config, method); break;
  }
  return {y, state};
}

// ---- decode step ---------------------------------------------------------------------------

constexpr int kStepThreads = 128;

// Lane ``lane`` of kLanes's share of dt_low (row b) · channel d's dt_proj row: its 16-byte pieces
// lane, lane + kLanes, ... where both are wide (one load each at batch 1's 16 lanes and dt_rank
// up to 256, so the sum costs Δ one memory round trip, as dt's load did), else its codes.
template <int kLanes>
__device__ __forceinline__ int lane_dt_sum(const StepArgs& a, int b, int d, int lane) {
  const int8_t* dt_low = static_cast<const int8_t*>(a.dt.data) + b * a.dt_st[0];
  const int8_t* row = a.dt_proj + static_cast<int64_t>(d) * a.dt_rank;
  int sum = 0;
  if (a.dt_proj_wide && a.dt_low_wide) {
#pragma unroll 4
    for (int i = lane * 16; i < a.dt_rank; i += kLanes * 16) {
      sum = quamba::gemm::dot16(*reinterpret_cast<const int4*>(row + i),
                                *reinterpret_cast<const int4*>(dt_low + i), sum);
    }
  } else {
#pragma unroll 4
    for (int k = lane; k < a.dt_rank; k += kLanes) sum += row[k] * dt_low[k * a.dt_st[1]];
  }
  return sum;
}

// The step is launched programmatically dependent on the kernel before (x_proj's or dt_proj's
// GEMM, pdl.cuh). Before its wait a thread computes A from the parameters and brings into L2 what
// it reads after the wait without depending on that kernel: channel d's row of a folded dt_proj
// (lane ``lane`` of ``lanes`` takes every lanes-th of the row's 128-byte lines) and its states at
// ``offset`` (d, offset: -1 for none). The states are read only after the wait: a step before, on
// the same state, may still be running.
__device__ __forceinline__ void prefetch_before_wait(const StepArgs& a, int d, int lane, int lanes,
                                                     int64_t offset) {
  if (a.dt_proj != nullptr && d >= 0) {
    const int8_t* row = a.dt_proj + static_cast<int64_t>(d) * a.dt_rank;
    const uintptr_t first_line = reinterpret_cast<uintptr_t>(row) & ~uintptr_t{127};
    const uintptr_t end = reinterpret_cast<uintptr_t>(row + a.dt_rank);
    for (uintptr_t line = first_line + 128 * lane; line < end; line += 128 * lanes) {
      quamba::prefetch_l2(reinterpret_cast<const void*>(line));
    }
  }
  if (offset >= 0) {
    quamba::prefetch_l2(static_cast<const int8_t*>(a.state) + offset * (a.state_int8 ? 1 : 4));
  }
}

// One group of kLanes lanes per (batch, channel): lane l steps states l·kStates ...
// (l+1)·kStates − 1 (those below dstate) and sums its terms of C · h, and the group adds the
// lanes' sums with shuffles, nearest lanes first: together the pairwise tree of state_readout.
// Many lanes a channel suit few channels (a batch-1 step: 5120 of them, a lane a state); 4 lanes
// a channel compute Δ once for several states and read and write their states as whole rows (a
// layout kept selectable; the one-lane layout below is chosen from 16384 channels).
template <Discretization kMethod, int kLanes, int kStates, typename Out>
__global__ void __launch_bounds__(kStepThreads) qsscan_update_kernel(const StepArgs a) {
  quamba::pdl_launch_dependents();  // the Hadamard kernel after it may launch (pdl.cuh)
  const int group = (blockIdx.x * kStepThreads + threadIdx.x) / kLanes;
  const int lane = threadIdx.x % kLanes;
  // Lanes past the end stay for the shuffles below (they need the whole warp).
  const bool valid_group = group < a.batch * a.dim;
  const int b = valid_group ? group / a.dim : 0, d = valid_group ? group % a.dim : 0;
  const int first = lane * kStates;
  const int count = valid_group ? min(kStates, a.dstate - first) : 0;  // states of the lane
  const int64_t offset = static_cast<int64_t>(group) * a.dstate + first;
  float A[kStates];
  if (count > 0) load_A<kStates>(a, d, first, count, A);
  prefetch_before_wait(a, valid_group ? d : -1, lane, kLanes, count > 0 ? offset : -1);
  quamba::pdl_wait();
  // dt_proj folded in: the group's lanes split dt_low · the channel's row (integers: any order)
  int dt_sum = 0;
  if (a.dt_proj != nullptr) {
    if (valid_group) dt_sum = lane_dt_sum<kLanes>(a, b, d, lane);
#pragma unroll
    for (int offset = 1; offset < kLanes; offset *= 2) {
      dt_sum += __shfl_xor_sync(kFullMask, dt_sum, offset, kLanes);
    }
  }
  float contribution = 0.f, u = 0.f;
  if (valid_group) {
    u = a.u.load(b * a.u_st[0] + d * a.u_st[1]);
    if (count > 0) {
      const float delta = a.dt_proj != nullptr ? projected_delta(a, dt_sum, d) : step_delta(a, b, d);
      float B[kStates], C[kStates];
      a.B.load_row(b * a.B_st[0] + first * a.B_st[1], a.B_st[1], count, B);
      a.C.load_row(b * a.C_st[0] + first * a.C_st[1], a.C_st[1], count, C);
      contribution = step_lane<kMethod, kStates>(a, count, offset, u, delta, A, B, C);
    }
  }
#pragma unroll
  for (int offset = 1; offset < kLanes; offset *= 2) {
    contribution += __shfl_xor_sync(kFullMask, contribution, offset, kLanes);
  }
  if (valid_group && lane == 0) store_y<Out>(a, b, d, contribution, u);
}

constexpr int kOneLaneStates = 16;  // the one-lane layout's states a thread (dstate <= 16)
constexpr int kTileChannels = 32;   // the one-lane layout's channels a block: a warp's lanes
// and its batch rows, a warp each: 4, or 8 where dt_proj is folded in and the batch has 8 rows
// (tile_rows), so that each staged row of dt_proj serves twice as many rows.
constexpr int kTileRows = kStepThreads / kTileChannels;
constexpr int kFoldedTileRows = 2 * kTileRows;
// Floats between two channels' rows of A in shared memory: the 16-byte reads of 8 lanes (one
// shared-memory wavefront) then fall on 32 distinct banks.
constexpr int kAPitch = 20;

// Bytes between two staged rows of dt_proj or dt_low codes in shared memory (the one-lane layout
// with dt_proj folded in): dt_rank rounded up to the MMA's K of 32, zero-padded, plus 16, so that
// the 4-byte fragment reads of a warp (8 rows, 4 words each) fall on 32 distinct banks.
__host__ __device__ constexpr int dt_row_pitch(int dt_rank) {
  return (dt_rank + 31) / 32 * 32 + 16;
}

// ``count`` rows of codes (row i at src + i · row_stride, its dt_rank codes element_stride apart)
// into the first of ``rows`` shared-memory rows of ``pitch`` bytes, zero past dt_rank and in the
// rows past ``count``; ``wide``: dt_rank a multiple of 16, rows 16-byte aligned, elements
// contiguous, so copied in 16-byte pieces.
__device__ __forceinline__ void stage_codes(int8_t* tile, int rows, int pitch, const int8_t* src,
                                            int64_t row_stride, int64_t element_stride, int count,
                                            int dt_rank, bool wide) {
  if (wide) {
    const int pieces = pitch / 16;
    for (int i = threadIdx.x; i < rows * pieces; i += blockDim.x) {
      const int row = i / pieces, column = i % pieces * 16;
      uint4 piece = make_uint4(0, 0, 0, 0);
      if (row < count && column < dt_rank) {
        piece = *reinterpret_cast<const uint4*>(src + row * row_stride + column);
      }
      *reinterpret_cast<uint4*>(tile + row * pitch + column) = piece;
    }
  } else {
    for (int i = threadIdx.x; i < rows * pitch; i += blockDim.x) {
      const int row = i / pitch, column = i % pitch;
      tile[i] = row < count && column < dt_rank ? src[row * row_stride + column * element_stride]
                                                : int8_t{0};
    }
  }
}

// Dynamic shared memory of the one-lane layout with dt_proj folded in: its channels' rows of
// dt_proj and kFoldedTileRows rows of dt_low (the MMA's N; rows past the tile's are zeros).
constexpr int dt_tile_bytes(int dt_rank) {
  return (kTileChannels + kFoldedTileRows) * dt_row_pitch(dt_rank);
}
// The largest dt_rank the step folds in: its tiles stay within the 48 KB a launch may take.
constexpr int kMaxDtRank = 1024;
static_assert(dt_tile_bytes(kMaxDtRank) + 5120 <= 48 * 1024, "dt tiles exceed 48 KB");

// The one-lane layout's batch rows a block (blockDim.x / kTileChannels).
int tile_rows(const StepArgs& args) {
  return args.dt_proj != nullptr && args.batch >= kFoldedTileRows ? kFoldedTileRows : kTileRows;
}

// The staged dt_proj rows [kTileChannels] · dt_low rows [kFoldedTileRows] of a tile as int32 sums
// [channel][row] in ``sums`` (kTileChannels rows), on the tensor cores: warp w (0 or 1) takes
// channels 16w ... 16w + 15, one m16n8k32 MMA per 32 codes of dt_rank (exact: int8 products,
// int32 accumulators).
__device__ __forceinline__ void tile_dt_sums(const int8_t* w_tile, const int8_t* x_tile, int pitch,
                                             int dt_rank, int (*sums)[kFoldedTileRows]) {
  const int warp = threadIdx.x / 32, group = threadIdx.x % 32 / 4, quad = threadIdx.x % 4;
  const int8_t* w_rows = w_tile + (warp * 16 + group) * pitch + quad * 4;
  const int8_t* x_row = x_tile + group * pitch + quad * 4;
  const auto word = [](const int8_t* p) { return *reinterpret_cast<const uint32_t*>(p); };
  int acc[4] = {0, 0, 0, 0};
  for (int k = 0; k < dt_rank; k += 32) {
    const uint32_t a[4] = {word(w_rows + k), word(w_rows + 8 * pitch + k), word(w_rows + k + 16),
                           word(w_rows + 8 * pitch + k + 16)};
    quamba::gemm::mma_s8(acc, a, word(x_row + k), word(x_row + k + 16));
  }
  const int channel = warp * 16 + group, row = quad * 2;
  sums[channel][row] = acc[0];
  sums[channel][row + 1] = acc[1];
  sums[channel + 8][row] = acc[2];
  sums[channel + 8][row + 1] = acc[3];
}

// A one-lane block's shared memory and a thread's place in it (qsscan_update_lane_kernel).
struct OneLaneTile {
  const float* A_tile;  // [kTileChannels][kAPitch]
  float* B_rows;        // [rows][kOneLaneStates], as C_rows
  float* C_rows;
  const int8_t* dt_proj_tile;  // folded: [kTileChannels][dt_pitch]
  int8_t* dt_low_tile;         // folded: [kFoldedTileRows][dt_pitch]
  int (*dt_sums)[kFoldedTileRows];
  int dt_pitch, first_row, rows, r, c, b, d;
  bool valid;
  int64_t offset;  // of the thread's states
  float skip;      // D of channel d
};

// The one-lane step after the wait, on a state of type State. A thread reads its u, dt, z and
// states before the block stages its rows of B and C (and of dt_low), so that all of these reads
// are in flight at once rather than one after the other; z, read before the states are written,
// no longer waits for those stores (which it may alias) either.
template <Discretization kMethod, bool kWhole, bool kFolded, typename Out, typename State>
__device__ __forceinline__ void one_lane_after_wait(const StepArgs& a, const OneLaneTile& t) {
  const int count = kWhole ? kOneLaneStates : a.dstate;
  float u = 0.f, dt = 0.f, z = 0.f;
  State old_state[kOneLaneStates];
  if (t.valid) {
    u = a.u.load(t.b * a.u_st[0] + t.d * a.u_st[1]);
    if constexpr (!kFolded) dt = a.dt.load(t.b * a.dt_st[0] + t.d * a.dt_st[1]);
    z = load_gate(a, t.b, t.d);
    load_lane_states<kOneLaneStates>(a, count, t.offset, old_state);
  }
  if constexpr (kFolded) {
    stage_codes(t.dt_low_tile, kFoldedTileRows, t.dt_pitch,
                static_cast<const int8_t*>(a.dt.data) + t.first_row * a.dt_st[0], a.dt_st[0],
                a.dt_st[1], min(t.rows, a.batch - t.first_row), a.dt_rank, a.dt_low_wide);
  }
  if (threadIdx.x < t.rows * kOneLaneStates) {
    const int tile_row = threadIdx.x / kOneLaneStates, s = threadIdx.x % kOneLaneStates;
    const int row = t.first_row + tile_row;
    const bool present = row < a.batch && s < a.dstate;
    t.B_rows[threadIdx.x] = present ? a.B.load(row * a.B_st[0] + s * a.B_st[1]) : 0.f;
    t.C_rows[threadIdx.x] = present ? a.C.load(row * a.C_st[0] + s * a.C_st[1]) : 0.f;
  }
  __syncthreads();
  if constexpr (kFolded) {
    if (threadIdx.x < 64) tile_dt_sums(t.dt_proj_tile, t.dt_low_tile, t.dt_pitch, a.dt_rank, t.dt_sums);
    __syncthreads();
  }
  if (!t.valid) return;
  float delta;
  if constexpr (kFolded) delta = projected_delta(a, t.dt_sums[t.c][t.r], t.d);
  else delta = delta_of(a, dt, t.d);
  float A[kOneLaneStates];
  load_row<kOneLaneStates>(t.A_tile + t.c * kAPitch, A);
  State new_state[kOneLaneStates];
  const float sum = step_states<kMethod, kOneLaneStates>(a, count, t.offset, u, delta, A,
                                                          t.B_rows + t.r * kOneLaneStates,
                                                          t.C_rows + t.r * kOneLaneStates,
                                                          old_state, new_state);
  store_lane_states<kOneLaneStates>(a, count, t.offset, new_state);
  store_y<Out>(a, t.b, t.d, sum, u, t.skip, z);
}

// The one-lane layout: a block steps kTileChannels channels for tile_rows batch rows, a thread
// one (row, channel) with all its states. The block computes its channels' A = -exp(A_log) once
// for all its rows and dequantizes its rows' B and C once for all its channels, into shared
// memory, where the threads read them as broadcasts. Suits many channels (large batch), where
// the step is bound by instruction issue. kWhole: dstate is 16 and the rows are aligned, so a
// thread's states, A and B, C are whole 16-byte rows and no state needs a bounds check. Same
// arithmetic as the lanes layouts. With dt_proj folded in, the block stages its channels' rows of
// dt_proj and its rows' dt_low in dynamic shared memory (dt_row_pitch bytes a row) and two warps
// sum them on the tensor cores (tile_dt_sums). kFolded (dt_proj given) is a template parameter so
// that the plain step keeps the resources it had before the fold: 4-row tiles, no dt tiles.
template <Discretization kMethod, bool kWhole, bool kFolded, typename Out>
__global__ void __launch_bounds__((kFolded ? kFoldedTileRows : kTileRows) * kTileChannels)
    qsscan_update_lane_kernel(const StepArgs a) {
  constexpr int kMaxRows = kFolded ? kFoldedTileRows : kTileRows;
  quamba::pdl_launch_dependents();  // the Hadamard kernel after it may launch (pdl.cuh)
  __shared__ __align__(16) float A_tile[kTileChannels * kAPitch];
  __shared__ __align__(16) float B_rows[kMaxRows][kOneLaneStates];
  __shared__ __align__(16) float C_rows[kMaxRows][kOneLaneStates];
  extern __shared__ __align__(16) int8_t dt_tiles[];  // [kTileChannels + kFoldedTileRows][pitch]
  __shared__ int dt_sums[kFolded ? kTileChannels : 1][kFoldedTileRows];
  const int rows = blockDim.x / kTileChannels;
  const int channel_tiles = (a.dim + kTileChannels - 1) / kTileChannels;
  const int first_channel = (blockIdx.x % channel_tiles) * kTileChannels;
  const int first_row = (blockIdx.x / channel_tiles) * rows;
  const int dt_pitch = dt_row_pitch(a.dt_rank);
  int8_t* dt_low_tile = dt_tiles + kTileChannels * dt_pitch;
  const int c = threadIdx.x % kTileChannels, r = threadIdx.x / kTileChannels;
  const int d = first_channel + c, b = first_row + r;
  const bool valid = d < a.dim && b < a.batch;
  const int64_t offset = (static_cast<int64_t>(b) * a.dim + d) * a.dstate;
  // Before the wait (prefetch_before_wait): the channels' dt_proj rows, A, D, the states into L2.
  if constexpr (kFolded) {
    stage_codes(dt_tiles, kTileChannels, dt_pitch,
                a.dt_proj + static_cast<int64_t>(first_channel) * a.dt_rank, a.dt_rank, 1,
                min(kTileChannels, a.dim - first_channel), a.dt_rank, a.dt_proj_wide);
  }
  if constexpr (kWhole) {  // 4 consecutive states a thread of the first kStepThreads, one word
    static_assert(kTileChannels * kOneLaneStates == 4 * kStepThreads, "A: 4 states a thread");
    const int tile_channel = threadIdx.x / 4, first = threadIdx.x % 4 * 4;
    const int channel = first_channel + tile_channel;
    if (threadIdx.x < kStepThreads) {
      int8_t codes[4] = {};
      if (channel < a.dim) load_row<4>(a.params.A_log + channel * kOneLaneStates + first, codes);
      float A[4];
#pragma unroll
      for (int s = 0; s < 4; ++s) A[s] = -expf(dequantize(codes[s], a.params.A_log_scale));
      store_row<4>(A_tile + tile_channel * kAPitch + first, A);
    }
  } else {
    for (int i = threadIdx.x; i < kTileChannels * kOneLaneStates; i += blockDim.x) {
      const int tile_channel = i / kOneLaneStates, s = i % kOneLaneStates;
      const int channel = first_channel + tile_channel;
      float A = 0.f;
      if (channel < a.dim && s < a.dstate) {
        A = -expf(dequantize(a.params.A_log[channel * a.dstate + s], a.params.A_log_scale));
      }
      A_tile[tile_channel * kAPitch + s] = A;
    }
  }
  prefetch_before_wait(a, -1, 0, 1, valid ? offset : -1);
  const float skip = valid ? a.params.skip(d) : 0.f;  // a parameter: read before the wait
  quamba::pdl_wait();
  const OneLaneTile tile{A_tile, &B_rows[0][0], &C_rows[0][0], dt_tiles, dt_low_tile, dt_sums,
                         dt_pitch, first_row, rows, r, c, b, d, valid, offset, skip};
  if (a.state_int8) one_lane_after_wait<kMethod, kWhole, kFolded, Out, int8_t>(a, tile);
  else one_lane_after_wait<kMethod, kWhole, kFolded, Out, float>(a, tile);
}

template <Discretization kMethod, int kLanes, int kStates, typename Out>
void launch_step_group(const StepArgs& args) {
  auto kernel = qsscan_update_kernel<kMethod, kLanes, kStates, Out>;
  check_kernel_image(kernel, "qsscan_update");
  const int64_t threads = int64_t{args.batch} * args.dim * kLanes;
  quamba::launch_with_pdl(kernel, ceil_div(threads, kStepThreads), kStepThreads, 0,
                          current_stream(), args);
}

template <Discretization kMethod, typename Out>
void launch_step_one_lane(const StepArgs& args) {
  const bool whole = args.dstate == kOneLaneStates && args.rows_aligned;
  const bool folded = args.dt_proj != nullptr;
  auto kernel = whole ? (folded ? qsscan_update_lane_kernel<kMethod, true, true, Out>
                                : qsscan_update_lane_kernel<kMethod, true, false, Out>)
                      : (folded ? qsscan_update_lane_kernel<kMethod, false, true, Out>
                                : qsscan_update_lane_kernel<kMethod, false, false, Out>);
  check_kernel_image(kernel, "qsscan_update");
  const int rows = tile_rows(args);
  const int64_t blocks =
      ceil_div(int64_t{args.dim}, kTileChannels) * ceil_div(int64_t{args.batch}, int64_t{rows});
  const int dt_smem = args.dt_proj != nullptr ? dt_tile_bytes(args.dt_rank) : 0;
  quamba::launch_with_pdl(kernel, blocks, rows * kTileChannels, dt_smem, current_stream(), args);
}

// Channels (batch · dim) from which a step takes one lane a channel; fewer take one lane a state,
// to keep enough threads in flight. Measured on the H200 at Mamba-2.8B's 5120 channels, int8
// state (benchmarks/RESULTS.md, µs, 16 / 4 / 1 lanes): batch 2 4.27 / 4.53 / 4.63, batch 4
// 7.52 / 5.21 / 5.12, batch 8 11.1 / 6.14 / 5.42; batch 64 30.9 / 13.7 (4 / 1). Four lanes a channel
// is never the fastest by more than 2% (fp32 state at batch 4–8); it stays selectable.
constexpr int64_t kOneLaneChannels = 16384;

// The lanes per channel of a step: ``lanes`` if given (0: chosen from the shape). dstate <= 16
// takes one lane a state (8 or 16), 4 or 1; a larger dstate one lane a state (32).
int step_lanes(const StepArgs& args, int64_t lanes) {
  const int state_lanes = args.dstate <= 8 ? 8 : args.dstate <= 16 ? 16 : 32;
  const bool grouped = args.dstate <= 16;
  if (lanes == 0) {
    const int64_t channels = int64_t{args.batch} * args.dim;
    return !grouped || channels < kOneLaneChannels ? state_lanes : 1;
  }
  TORCH_CHECK(lanes == state_lanes || (grouped && (lanes == 1 || lanes == 4)),
              "qsscan_update: lanes must be 0 (chosen), ", state_lanes,
              grouped ? ", 4 or 1" : "", " for dstate ", text(args.dstate), ", got ", text(lanes));
  return static_cast<int>(lanes);
}

template <Discretization kMethod, typename Out>
void launch_step_method(const StepArgs& args, int lanes) {
  switch (lanes) {
    case 1: return launch_step_one_lane<kMethod, Out>(args);
    case 4: return launch_step_group<kMethod, 4, 4, Out>(args);
    case 8: return launch_step_group<kMethod, 8, 1, Out>(args);
    case 16: return launch_step_group<kMethod, 16, 1, Out>(args);
    default: return launch_step_group<kMethod, 32, 1, Out>(args);
  }
}

template <typename Out>
void launch_step(const StepArgs& args, Discretization method, int lanes) {
  with_method(method, [&](auto m) { launch_step_method<decltype(m)::value, Out>(args, lanes); });
}

// foh's drive: contiguous fp32 [batch, dim, dstate] beside u; the other methods take none.
void check_drive(const c10::optional<at::Tensor>& drive, Discretization method,
                 const at::Tensor& u, at::IntArrayRef shape) {
  if (method != Discretization::kFoh) {
    TORCH_CHECK(!drive.has_value(), "drive is carried by the foh discretization only");
    return;
  }
  TORCH_CHECK(drive.has_value(), "a foh decode step needs drive, the previous step's u ⊗ B");
  check_same_device(*drive, u, "drive");
  check_dtype(*drive, at::kFloat, "drive");
  check_shape(*drive, shape, "drive");
  TORCH_CHECK(drive->is_contiguous(), "drive must be contiguous");
}

// dt_proj folded into the step (contiguous int8 [dim, dt_rank]): dt must be dt_low's int8 codes
// [batch, dt_rank] (any strides) and dt_multiplier w8a8_linear's requantization multiplier.
void check_dt_projection(const at::Tensor& dt_proj, double dt_multiplier, const at::Tensor& dt,
                         int64_t batch, int64_t dim) {
  check_same_device(dt_proj, dt, "dt_proj");
  check_dtype(dt_proj, at::kChar, "dt_proj");
  TORCH_CHECK(dt_proj.dim() == 2 && dt_proj.size(0) == dim, "dt_proj must be [dim, dt_rank] = [",
              text(dim), ", dt_rank], got ", text(dt_proj.sizes()));
  TORCH_CHECK(dt_proj.is_contiguous(), "dt_proj must be contiguous");
  const int64_t dt_rank = dt_proj.size(1);
  TORCH_CHECK(dt_rank >= 1 && dt_rank <= kMaxDtRank, "dt_proj: dt_rank must be in 1..",
              text(kMaxDtRank), ", got ", text(dt_rank));
  check_dtype(dt, at::kChar, "dt (dt_low's codes, with dt_proj)");
  check_shape(dt, {batch, dt_rank}, "dt (dt_low's codes, with dt_proj)");
  check_positive_scale(dt_multiplier, "dt_multiplier");
}

void fill_dt_projection(const at::Tensor& dt_proj, double dt_multiplier, const at::Tensor& dt,
                        int64_t batch, StepArgs& args) {
  const int64_t dt_rank = dt_proj.size(1);
  args.dt_proj = dt_proj.data_ptr<int8_t>();
  args.dt_multiplier = to_fp32(dt_multiplier);
  args.dt_rank = static_cast<int>(dt_rank);
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  args.dt_proj_wide = dt_rank % 16 == 0 && aligned(args.dt_proj);
  args.dt_low_wide = dt_rank % 16 == 0 && aligned(dt.data_ptr()) && dt.stride(1) == 1 &&
                     (batch == 1 || dt.stride(0) % 16 == 0);
}

void fill_step_input(const at::Tensor& t, double scale, const char* name, const char* scale_name,
                     FloatSource& src, int64_t (&strides)[2]) {
  src = float_source(t, scale, name, scale_name);
  strides[0] = t.stride(0);
  strides[1] = t.stride(1);
}

// state: contiguous [batch, dim, dstate], int8 (stepped through state_scale) or fp32, updated in
// place; u, dt, z: [batch, dim]; B, C: [batch, dstate]; any strides. Returns contiguous y.
// discretization: a method of quamba.ops.scan.discretization; foh reads the previous step's drive
// v = u ⊗ B from ``drive`` (contiguous fp32 [batch, dim, dstate]) and overwrites it with this
// step's; the other methods take none. lanes: lanes per channel (step_lanes; 0 chooses).
// dt_proj (int8 [dim, dt_rank]), where given, is folded in: dt is then dt_low's int8 codes
// [batch, dt_rank] and each channel's dt code requantize(dt_low · its row, dt_multiplier), with
// dt_scale dt's scale (w8a8_linear followed by the step, in one kernel, bit for bit).
at::Tensor qsscan_update(at::Tensor& state, double state_scale, const at::Tensor& u,
                         double u_scale, const at::Tensor& dt, double dt_scale,
                         const at::Tensor& B, double B_scale, const at::Tensor& C,
                         double C_scale, const c10::optional<at::Tensor>& z, double z_scale,
                         const at::Tensor& A_log, double A_log_scale, const at::Tensor& D,
                         double D_scale, const at::Tensor& dt_bias, double dt_bias_scale,
                         at::ScalarType out_dtype, const c10::optional<at::Tensor>& drive,
                         c10::string_view discretization, int64_t lanes,
                         const c10::optional<at::Tensor>& dt_proj, double dt_multiplier) {
  check_cuda(u, "u");
  TORCH_CHECK(u.dim() == 2, "u must be [batch, dim], got ", text(u.sizes()));
  const int64_t batch = u.size(0), dim = u.size(1);
  check_same_device(state, u, "state");
  TORCH_CHECK(state.dim() == 3 && state.size(0) == batch && state.size(1) == dim,
              "state must be [batch, dim, dstate] = [", text(batch), ", ", text(dim),
              ", dstate], got ", text(state.sizes()));
  const int64_t dstate = state.size(2);
  TORCH_CHECK(dstate >= 1 && dstate <= kMaxState, "state: dstate must be in 1..", text(kMaxState),
              ", got ", text(dstate));
  TORCH_CHECK(state.scalar_type() == at::kChar || state.scalar_type() == at::kFloat,
              "state must be int8 or float32, got ", state.scalar_type());
  TORCH_CHECK(state.is_contiguous(), "state must be contiguous");
  TORCH_CHECK(batch * dim * 32 < (int64_t{1} << 31), "state: batch · dim too large");
  if (state.scalar_type() == at::kChar) check_positive_scale(state_scale, "state_scale");
  check_same_device(dt, u, "dt");
  if (dt_proj.has_value()) {
    check_dt_projection(*dt_proj, dt_multiplier, dt, batch, dim);
  } else {
    check_shape(dt, {batch, dim}, "dt");
  }
  check_same_device(B, u, "B");
  check_shape(B, {batch, dstate}, "B");
  check_same_device(C, u, "C");
  check_shape(C, {batch, dstate}, "C");
  if (z.has_value()) {
    check_same_device(*z, u, "z");
    check_shape(*z, {batch, dim}, "z");
  }
  check_ssm_params(u, A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale, dim, dstate);
  check_out_dtype(out_dtype);
  const Discretization method = discretization_of(discretization);
  check_drive(drive, method, u, {batch, dim, dstate});
  const c10::cuda::CUDAGuard guard(u.device());

  at::Tensor y = at::empty({batch, dim}, u.options().dtype(out_dtype));
  if (batch == 0 || dim == 0) return y;
  StepArgs args{};
  fill_step_input(u, u_scale, "u", "u_scale", args.u, args.u_st);
  fill_step_input(dt, dt_scale, "dt", "dt_scale", args.dt, args.dt_st);
  if (dt_proj.has_value()) fill_dt_projection(*dt_proj, dt_multiplier, dt, batch, args);
  fill_step_input(B, B_scale, "B", "B_scale", args.B, args.B_st);
  fill_step_input(C, C_scale, "C", "C_scale", args.C, args.C_st);
  if (z.has_value()) {
    fill_step_input(*z, z_scale, "z", "z_scale", args.z, args.z_st);
  } else {
    args.z = FloatSource{nullptr, InKind::kFloat, 1.f};
  }
  args.params = ssm_params(A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale);
  args.state = state.data_ptr();
  args.state_int8 = state.scalar_type() == at::kChar;
  args.state_scale = to_fp32(state_scale);
  args.state_inv_scale = args.state_int8 ? reciprocal(state_scale) : 0.f;
  args.drive = drive.has_value() ? drive->data_ptr<float>() : nullptr;
  args.y = y.data_ptr();
  args.batch = batch;
  args.dim = dim;
  args.dstate = dstate;
  args.rows_aligned = dstate % 16 == 0 && reinterpret_cast<uintptr_t>(args.state) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(args.params.A_log) % 16 == 0;
  const int step_lane_count = step_lanes(args, lanes);
  switch (out_dtype) {
    case at::kHalf: launch_step<__half>(args, method, step_lane_count); break;
    case at::kBFloat16: launch_step<__nv_bfloat16>(args, method, step_lane_count); break;
    default: launch_step<float>(args, method, step_lane_count); break;
  }
  return y;
}

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "qsscan(Tensor u, float u_scale, Tensor dt, float dt_scale, Tensor B, float B_scale, "
      "Tensor C, float C_scale, Tensor? z, float z_scale, Tensor A_log, float A_log_scale, "
      "Tensor D, float D_scale, Tensor dt_bias, float dt_bias_scale, float? state_inv_scale, "
      "ScalarType out_dtype, int config=-1, str discretization='zoh', int chunk_len=0) "
      "-> (Tensor, Tensor)");
  m.def(
      "qsscan_update(Tensor(a!) state, float state_scale, Tensor u, float u_scale, Tensor dt, "
      "float dt_scale, Tensor B, float B_scale, Tensor C, float C_scale, Tensor? z, "
      "float z_scale, Tensor A_log, float A_log_scale, Tensor D, float D_scale, "
      "Tensor dt_bias, float dt_bias_scale, ScalarType out_dtype, Tensor(b!)? drive=None, "
      "str discretization='zoh', int lanes=0, Tensor? dt_proj=None, float dt_multiplier=1.0) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) {
  m.impl("qsscan", &quamba_ssm::qsscan);
  m.impl("qsscan_update", &quamba_ssm::qsscan_update);
}
