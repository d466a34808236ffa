// QSScan prefill chunked over time: launch configuration 2 of torch.ops.quamba.qsscan (the
// specification is quamba/ops/scan/qsscan.py).
//
// A warp owns 32 channels of one sequence over one chunk of time steps, a lane one channel with
// every state of it in registers. The lane walks its chunk step by step; the dstate states of a
// step are independent chains (one fused multiply-add each on the critical path), so neither a
// shuffle nor a barrier sits inside the recurrence, and a few warps per scheduler keep it busy.
// Two kernels share the sequence's chunks out over the GPU:
//   local: each chunk but the last runs from a zero state and records its end state and its decay
//          (the product of its steps' Ā: exp(a ΣΔ) for the exponential methods); the last warp of
//          a channel group to finish folds them, in chunk order, into every chunk's start state
//          (one order whichever warp folds, so the result is deterministic);
//   final: each chunk runs again from its start state, writing y; the last chunk writes the state.
// Each warp stages its inputs through shared-memory tiles of its own, a window of kWindow steps at
// a time (int8 codes dequantized once there, B and C once for all 32 lanes; the next window's
// codes copied by cp.async meanwhile), so warps never wait for each other. The cost of splitting
// is the local pass: about (chunks - 1) / chunks of a second pass; the launcher picks as few
// chunks as fill the GPU, of at most kMaxChunkLen steps. benchmarks/notes_ssm_perf.md has the
// measurements.
#include <ATen/cuda/CUDAContext.h>

#include "qsscan_chunked.h"
#include "scan_math.cuh"

namespace quamba_ssm {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kGroup = 32;               // channels of a warp, one per lane
constexpr int kWindow = 16;              // steps a warp stages at a time
constexpr int kWarps = 4;                // warps of a block, each on its own chunk
constexpr int kTilePitch = kGroup + 4;   // floats per step of a u, dt or z tile (rows 4 banks apart)
constexpr int kTargetWarpsPerSm = 16;    // the launcher's chunk count aims at this many warps
constexpr int kMaxChunkLen = 256;        // and splits longer sequences further

template <int kState>
constexpr int bc_pitch() {  // floats per step of the B | C tile
  return 2 * kState + 4;
}

template <int kState>
constexpr int tile_floats() {  // the fp32 tiles of a warp: u, dt, z and B | C
  return 3 * kWindow * kTilePitch + kWindow * bc_pitch<kState>();
}

// A window's int8 codes as the vector paths copy them: u, dt, z (16 bytes a lane each), then B | C
// (kState bytes a lane). A warp copies the next window's into a second stage with cp.async while
// it computes on the current one.
constexpr int kRawInput = kWindow * kGroup;
template <int kState>
constexpr int raw_stage_bytes() {
  return 3 * kRawInput + 32 * kState;
}

template <int kState>
constexpr int warp_smem_bytes() {
  return tile_floats<kState>() * 4 + 2 * raw_stage_bytes<kState>();
}

template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// A's value as the state loop uses it: A · log2(e) for zoh (its decay is one ex2), A otherwise.
template <Discretization kMethod>
__device__ __forceinline__ float state_a(int8_t A_log, float A_log_scale) {
  const float A = -expf(dequantize(A_log, A_log_scale));
  return kMethod == Discretization::kZoh ? __fmul_rn(A, kLog2e) : A;
}

// 16 int8 codes (global or shared memory, 16-byte aligned) dequantized into row[0..16).
__device__ __forceinline__ void dequantize16(const int8_t* codes, float scale, float* row) {
  const uint4 v = *reinterpret_cast<const uint4*>(codes);
  const unsigned words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    *reinterpret_cast<float4*>(row + 4 * w) =
        make_float4(code_of(words[w], 0, scale), code_of(words[w], 1, scale),
                    code_of(words[w], 2, scale), code_of(words[w], 3, scale));
  }
}

// The 16 codes a lane moves of a vector-staged input window: step lane % kWindow, channels from
// 16 · (lane / kWindow).
__device__ __forceinline__ const int8_t* input_codes(const FloatSource& src, const Strides3& st,
                                                     int b, int d0, int t0, int lane) {
  return static_cast<const int8_t*>(src.data) + b * st.batch + (t0 + lane % kWindow) * st.time +
         d0 + 16 * (lane / kWindow);
}

// The kState codes a lane moves of a vector-staged B | C window: B of step lane for lanes 0-15,
// C of step lane - 16 for the others.
__device__ __forceinline__ const int8_t* bc_codes(const ScanArgs& a, int b, int t0,
                                                  int lane) {
  const bool is_c = lane >= kWindow;
  const Strides3& st = is_c ? a.C_st : a.B_st;
  return static_cast<const int8_t*>((is_c ? a.C : a.B).data) + b * st.batch +
         (t0 + lane % kWindow) * st.time;
}

// Steps [t0, t0 + steps) of one input of the warp's 32 channels into an fp32 tile [step][channel].
// vec: int8 codes with 16-byte aligned channel runs: lane l dequantizes 16 channels of step l % 16,
// from `raw` (its prefetched codes) or else from global memory. Otherwise element by element,
// consecutive lanes along the input's stride-1 dimension.
__device__ __forceinline__ void stage_tile(float* tile, const FloatSource& src, const Strides3& st,
                                           bool vec, const int8_t* raw, int b, int d0, int dim,
                                           int t0, int steps, int lane) {
  if (vec) {
    const int s = lane % kWindow;
    if (s >= steps) return;
    dequantize16(raw ? raw : input_codes(src, st, b, d0, t0, lane), src.scale,
                 tile + s * kTilePitch + 16 * (lane / kWindow));
    return;
  }
  const bool time_fast = st.time == 1;
#pragma unroll 4
  for (int e = lane; e < kWindow * kGroup; e += 32) {
    const int s = time_fast ? e % kWindow : e / kGroup;
    const int c = time_fast ? e / kWindow : e % kGroup;
    float value = 0.f;
    if (s < steps && d0 + c < dim) {
      value = src.load(b * st.batch + (d0 + c) * st.dim + (t0 + s) * st.time);
    }
    tile[s * kTilePitch + c] = value;
  }
}

// B (and C for the final pass) of steps [t0, t0 + steps) into the tile [step][B | C], zero past
// dstate. vec (int8 codes in aligned rows of kState): lanes 0-15 dequantize B of one step each,
// lanes 16-31 C, from `raw` (prefetched) or else from global memory.
template <int kState, bool kWithC>
__device__ __forceinline__ void stage_bc(float* tile, const ScanArgs& a, bool vec,
                                         const int8_t* raw, int b, int t0, int steps, int lane) {
  constexpr int kPitch = bc_pitch<kState>();
  if (vec) {
    const int s = lane % kWindow, which = lane / kWindow;
    if (s >= steps || (!kWithC && which == 1)) return;
    const int8_t* codes = raw ? raw : bc_codes(a, b, t0, lane);
#pragma unroll
    for (int q = 0; q < kState / 16; ++q) {
      dequantize16(codes + 16 * q, (which ? a.C : a.B).scale,
                   tile + s * kPitch + which * kState + 16 * q);
    }
    return;
  }
  constexpr int kMatrices = kWithC ? 2 : 1;
#pragma unroll 2
  for (int e = lane; e < kWindow * kState * kMatrices; e += 32) {
    const int s = e % kWindow, n = e / kWindow % kState, which = e / (kWindow * kState);
    const FloatSource& src = which ? a.C : a.B;
    const Strides3& st = which ? a.C_st : a.B_st;
    float value = 0.f;
    if (s < steps && n < a.dstate) value = src.load(b * st.batch + n * st.dim + (t0 + s) * st.time);
    tile[s * kPitch + which * kState + n] = value;
  }
}

// The tile's y (kept in the u tile) to a layout whose channels are not contiguous: consecutive
// lanes along y's stride-1 dimension.
template <typename Out>
__device__ __forceinline__ void store_y_tile(const float* tile, const ScanArgs& a, int b,
                                             int d0, int t0, int steps, int lane) {
  const Strides3& st = a.y_st;
  Out* y = static_cast<Out*>(a.y) + b * st.batch;
  const bool time_fast = st.time == 1;
#pragma unroll 4
  for (int e = lane; e < kWindow * kGroup; e += 32) {
    const int s = time_fast ? e % kWindow : e / kGroup;
    const int c = time_fast ? e / kWindow : e % kGroup;
    if (s < steps && d0 + c < a.dim) {
      y[(d0 + c) * st.dim + (t0 + s) * st.time] = from_float<Out>(tile[s * kTilePitch + c]);
    }
  }
}

// Lane `lane`'s slot of chunk `chunk` of channel group bg in a [groups, chunks, kState, 32] array
// of the chunk states or decays (state n at [n * kGroup]).
template <int kState>
__device__ __forceinline__ float* chunk_slot(float* base, int chunks, int bg, int chunk, int lane) {
  return base + (static_cast<int64_t>(bg) * chunks + chunk) * kState * kGroup + lane;
}

// Each chunk's start state from the local pass's end states and decays, in chunk order:
// start_0 = 0, start_{k+1} = decay_k ⊙ start_k + end_k. Overwrites the end states.
template <int kState>
__device__ __forceinline__ void fold_chunk_states(const ChunkPlan& p, int bg, int lane) {
  float running[kState];
#pragma unroll
  for (int n = 0; n < kState; ++n) running[n] = 0.f;
#pragma unroll 2
  for (int k = 0; k < p.chunks - 1; ++k) {
    float* states = chunk_slot<kState>(p.chunk_states, p.chunks, bg, k, lane);
    const float* decays = chunk_slot<kState>(p.chunk_decays, p.chunks - 1, bg, k, lane);
#pragma unroll
    for (int n = 0; n < kState; ++n) {
      const float end = __ldcg(states + n * kGroup), decay = __ldcg(decays + n * kGroup);
      states[n * kGroup] = running[n];
      running[n] = fmaf(decay, running[n], end);
    }
  }
  float* last = chunk_slot<kState>(p.chunk_states, p.chunks, bg, p.chunks - 1, lane);
#pragma unroll
  for (int n = 0; n < kState; ++n) last[n * kGroup] = running[n];
}

// The chunk's end state from zero and decay to global memory; the last warp of the channel group
// to arrive folds every chunk's into start states (threadfence reduction: each writer fences
// before counting itself, the folder after seeing the count).
template <int kState>
__device__ __forceinline__ void publish_chunk(const ChunkPlan& p, int bg, int chunk, int lane,
                                              const float (&h)[kState],
                                              const float (&decay)[kState]) {
  float* states = chunk_slot<kState>(p.chunk_states, p.chunks, bg, chunk, lane);
  float* decays = chunk_slot<kState>(p.chunk_decays, p.chunks - 1, bg, chunk, lane);
#pragma unroll
  for (int n = 0; n < kState; ++n) {
    states[n * kGroup] = h[n];
    decays[n * kGroup] = decay[n];
  }
  __threadfence();
  __syncwarp();
  int arrived = 0;
  if (lane == 0) arrived = atomicAdd(p.arrivals + bg, 1);
  arrived = __shfl_sync(kFullMask, arrived, 0);
  if (arrived != p.chunks - 2) return;
  __threadfence();
  fold_chunk_states<kState>(p, bg, lane);
}

// The last state of a sequence's channel d: int8 codes or fp32, [batch, dim, dstate].
template <int kState>
__device__ __forceinline__ void store_state(const ScanArgs& a, int b, int d,
                                            const float (&h)[kState]) {
  const int64_t offset = (static_cast<int64_t>(b) * a.dim + d) * a.dstate;
#pragma unroll
  for (int n = 0; n < kState; ++n) {
    if (n >= a.dstate) break;
    if (a.state_int8) {
      static_cast<int8_t*>(a.state)[offset + n] = quantize_rn(h[n], a.state_inv_scale);
    } else {
      static_cast<float*>(a.state)[offset + n] = h[n];
    }
  }
}

// Starts copying the vector-staged codes of steps [t0, t0 + steps) into a raw stage (cp.async, one
// commit group). Each lane copies, and later dequantizes, only its own pieces, so the stage needs
// no barrier between the two.
template <int kState, bool kFinal>
__device__ __forceinline__ void prefetch_window(int8_t* raw, const ScanArgs& a, bool channel_vec,
                                                bool bc_vec, bool has_z, int b, int d0, int t0,
                                                int steps, int lane) {
  if (lane % kWindow < steps) {
    if (channel_vec) {
      cp_async16(raw + lane * 16, input_codes(a.u, a.u_st, b, d0, t0, lane));
      cp_async16(raw + kRawInput + lane * 16, input_codes(a.dt, a.dt_st, b, d0, t0, lane));
      if (has_z) {
        cp_async16(raw + 2 * kRawInput + lane * 16, input_codes(a.z, a.z_st, b, d0, t0, lane));
      }
    }
    if (bc_vec && (kFinal || lane < kWindow)) {
      const int8_t* codes = bc_codes(a, b, t0, lane);
#pragma unroll
      for (int q = 0; q < kState / 16; ++q) {
        cp_async16(raw + 3 * kRawInput + lane * kState + 16 * q, codes + 16 * q);
      }
    }
  }
  asm volatile("cp.async.commit_group;\n" ::);
}

// kFinal false: the local pass over chunks 0 .. chunks - 2; true: the final pass over every chunk.
template <Discretization kMethod, int kState, bool kFinal, typename Out>
__global__ void __launch_bounds__(kWarps * 32, 4)
chunked_scan_kernel(const ScanArgs a, const ChunkPlan p) {
  constexpr bool kFoh = kMethod == Discretization::kFoh;
  constexpr bool kZoh = kMethod == Discretization::kZoh;
  constexpr bool kDecayProduct = !kFinal && !is_exponential(kMethod) && !kZoh;
  constexpr int kBcPitch = bc_pitch<kState>();
  extern __shared__ float4 smem_vec[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int chunks_here = kFinal ? p.chunks : p.chunks - 1;
  const int task = blockIdx.x * kWarps + warp;
  if (task >= p.batch * p.groups * chunks_here) return;
  const int bg = task / chunks_here, chunk = task % chunks_here;
  const int b = bg / p.groups, d0 = bg % p.groups * kGroup, d = d0 + lane;
  const bool valid = d < a.dim;
  char* warp_smem = reinterpret_cast<char*>(smem_vec) + warp * warp_smem_bytes<kState>();
  float* u_tile = reinterpret_cast<float*>(warp_smem);
  float* dt_tile = u_tile + kWindow * kTilePitch;
  float* z_tile = dt_tile + kWindow * kTilePitch;
  float* bc_tile = z_tile + kWindow * kTilePitch;
  int8_t* raw_stages = reinterpret_cast<int8_t*>(warp_smem + tile_floats<kState>() * 4);
  const bool has_z = kFinal && a.z.data != nullptr;
  const bool channel_vec = p.channel_vec && d0 + kGroup <= a.dim;
  const bool bc_vec = p.state_vec && a.dstate == kState;

  float A[kState], h[kState];
#pragma unroll
  for (int n = 0; n < kState; ++n) {
    A[n] = valid && n < a.dstate
               ? state_a<kMethod>(a.params.A_log[d * a.dstate + n], a.params.A_log_scale)
               : 0.f;
    h[n] = 0.f;
  }
  if (kFinal && p.chunks > 1) {
    const float* start = chunk_slot<kState>(p.chunk_states, p.chunks, bg, chunk, lane);
#pragma unroll
    for (int n = 0; n < kState; ++n) h[n] = start[n * kGroup];
  }
  const float bias = valid ? a.params.bias(d) : 0.f;
  const float skip = valid ? a.params.skip(d) : 0.f;
  const int t_begin = chunk * p.chunk_len, t_end = min(t_begin + p.chunk_len, a.seqlen);

  // foh: the drives v = u B of the step before (zero before the sequence).
  float v_previous[kFoh ? kState : 1];
  if constexpr (kFoh) {
    const bool before = t_begin > 0 && valid;
    const float u_before =
        before ? a.u.load(b * a.u_st.batch + d * a.u_st.dim + (t_begin - 1) * a.u_st.time) : 0.f;
#pragma unroll
    for (int n = 0; n < kState; ++n) {
      v_previous[n] = before && n < a.dstate
                          ? u_before * a.B.load(b * a.B_st.batch + n * a.B_st.dim +
                                                (t_begin - 1) * a.B_st.time)
                          : 0.f;
    }
  }
  float decay_product[kDecayProduct ? kState : 1];
#pragma unroll
  for (int n = 0; n < (kDecayProduct ? kState : 1); ++n) decay_product[n] = 1.f;
  float delta_sum = 0.f;
  // y of this lane's next step where y's channels are contiguous (else y goes through the tile).
  const bool y_direct = a.y_st.dim == 1;
  Out* y_next = static_cast<Out*>(a.y) + b * a.y_st.batch + d + t_begin * a.y_st.time;

  const bool prefetch = channel_vec || bc_vec;
  if (prefetch && t_begin < t_end) {
    prefetch_window<kState, kFinal>(raw_stages, a, channel_vec, bc_vec, has_z, b, d0, t_begin,
                                    min(kWindow, t_end - t_begin), lane);
  }
  for (int t0 = t_begin, stage = 0; t0 < t_end; t0 += kWindow, stage ^= 1) {
    const int steps = min(kWindow, t_end - t0);
    const int8_t* raw = nullptr;  // this window's prefetched codes
    if (prefetch) {
      raw = raw_stages + stage * raw_stage_bytes<kState>();
      const int next = t0 + kWindow;
      if (next < t_end) {
        prefetch_window<kState, kFinal>(raw_stages + (stage ^ 1) * raw_stage_bytes<kState>(), a,
                                        channel_vec, bc_vec, has_z, b, d0, next,
                                        min(kWindow, t_end - next), lane);
        cp_async_wait<1>();
      } else {
        cp_async_wait<0>();
      }
    }
    const auto piece = [&](int input) {
      return raw ? raw + input * kRawInput + lane * 16 : nullptr;
    };
    __syncwarp();  // the previous window's tiles are consumed
    stage_tile(u_tile, a.u, a.u_st, channel_vec, piece(0), b, d0, a.dim, t0, steps, lane);
    stage_tile(dt_tile, a.dt, a.dt_st, channel_vec, piece(1), b, d0, a.dim, t0, steps, lane);
    if (has_z) {
      stage_tile(z_tile, a.z, a.z_st, channel_vec, piece(2), b, d0, a.dim, t0, steps, lane);
    }
    const int8_t* bc_raw = raw ? raw + 3 * kRawInput + lane * kState : nullptr;
    stage_bc<kState, kFinal>(bc_tile, a, bc_vec, bc_raw, b, t0, steps, lane);
    __syncwarp();
    for (int s = 0; s < steps; ++s) {
      const float u = u_tile[s * kTilePitch + lane];
      const float delta = softplus_fast(__fadd_rn(dt_tile[s * kTilePitch + lane], bias));
      const float du = __fmul_rn(delta, u);  // drive base: Δ u
      const float* bc = bc_tile + s * kBcPitch;
      float acc[2] = {0.f, 0.f};
#pragma unroll
      for (int q = 0; q < kState / 4; ++q) {
        const float4 B4 = *reinterpret_cast<const float4*>(bc + 4 * q);
        const float Bq[4] = {B4.x, B4.y, B4.z, B4.w};
        float Cq[4] = {};
        if constexpr (kFinal) {
          const float4 C4 = *reinterpret_cast<const float4*>(bc + kState + 4 * q);
          Cq[0] = C4.x, Cq[1] = C4.y, Cq[2] = C4.z, Cq[3] = C4.w;
        }
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int n = 4 * q + j;
          if constexpr (kZoh) {
            h[n] = fmaf(exp2_approx(delta * A[n]), h[n], du * Bq[j]);
          } else {
            const StepCoefficients c = fast_coefficients<kMethod>(delta, A[n]);
            float drive;
            if constexpr (kFoh) {
              const float v = u * Bq[j];
              drive = delta * fmaf(c.previous_gain, v_previous[n], c.gain * v);
              v_previous[n] = v;
            } else {
              drive = c.gain * du * Bq[j];
            }
            h[n] = fmaf(c.decay, h[n], drive);
            if constexpr (kDecayProduct) decay_product[n] *= c.decay;
          }
          if constexpr (kFinal) acc[j % 2] = fmaf(Cq[j], h[n], acc[j % 2]);
        }
      }
      if constexpr (kFinal) {
        float y = __fadd_rn(acc[0] + acc[1], __fmul_rn(u, skip));
        if (has_z) y = __fmul_rn(y, silu_fast(z_tile[s * kTilePitch + lane]));
        if (y_direct) {
          if (valid) *y_next = from_float<Out>(y);
          y_next += a.y_st.time;
        } else {
          u_tile[s * kTilePitch + lane] = y;  // this step's u is consumed
        }
      } else {
        delta_sum += delta;
      }
    }
    if (kFinal && !y_direct) {
      __syncwarp();
      store_y_tile<Out>(u_tile, a, b, d0, t0, steps, lane);
    }
  }

  if constexpr (kFinal) {
    if (chunk == p.chunks - 1 && valid) store_state<kState>(a, b, d, h);
  } else {
    float decay[kState];
#pragma unroll
    for (int n = 0; n < kState; ++n) {
      if constexpr (kDecayProduct) {
        decay[n] = decay_product[n];
      } else {
        decay[n] = exp2_approx(delta_sum * (kZoh ? A[n] : A[n] * kLog2e));
      }
    }
    publish_chunk<kState>(p, bg, chunk, lane, h, decay);
  }
}

template <typename Kernel>
void launch_pass(Kernel kernel, int64_t warps, int smem, const ScanArgs& args,
                 const ChunkPlan& plan) {
  check_kernel_image(kernel, "qsscan");
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<ceil_div(warps, kWarps), kWarps * 32, smem, current_stream()>>>(args, plan);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <Discretization kMethod, int kState, typename Out>
void launch_passes(const ScanArgs& args, const ChunkPlan& plan) {
  const int smem = kWarps * warp_smem_bytes<kState>();
  const int64_t groups = static_cast<int64_t>(plan.batch) * plan.groups;
  if (plan.chunks > 1) {
    launch_pass(chunked_scan_kernel<kMethod, kState, false, Out>,
                groups * (plan.chunks - 1), smem, args, plan);
  }
  launch_pass(chunked_scan_kernel<kMethod, kState, true, Out>, groups * plan.chunks,
              smem, args, plan);
}

template <Discretization kMethod, typename Out>
void launch_states(const ScanArgs& args, const ChunkPlan& plan) {
  if (args.dstate <= 16) return launch_passes<kMethod, 16, Out>(args, plan);
  launch_passes<kMethod, 32, Out>(args, plan);
}

template <typename Out>
void launch_method(const ScanArgs& args, const ChunkPlan& plan, Discretization method) {
  with_method(method, [&](auto m) { launch_states<decltype(m)::value, Out>(args, plan); });
}


// As few chunks as give the GPU kTargetWarpsPerSm warps per multiprocessor, but none longer than
// kMaxChunkLen steps, each a whole number of staging windows long; a requested length is rounded
// up to whole windows. (H100, d_inner 5120: fewer, longer chunks were slower at 4096 and 8192
// tokens; benchmarks/RESULTS.md.)
int chunk_length(const ChunkPlan& p, int seqlen, int64_t requested) {
  if (requested > 0) return static_cast<int>(ceil_div(requested, kWindow) * kWindow);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t warps = static_cast<int64_t>(p.batch) * p.groups;
  const int64_t chunks = std::max<int64_t>(1, ceil_div(int64_t{sms} * kTargetWarpsPerSm, warps));
  const int64_t length = std::min<int64_t>(ceil_div(seqlen, chunks), kMaxChunkLen);
  return static_cast<int>(ceil_div(length, kWindow) * kWindow);
}

}  // namespace

void launch_chunked_scan(const ScanArgs& args, ChunkPlan plan, const at::Tensor& u,
                         int64_t chunk_len, Discretization method, at::ScalarType out_dtype) {
  TORCH_CHECK(chunk_len >= 0 && chunk_len < (int64_t{1} << 30),
              "chunk_len must be in 0..2^30, got ", text(chunk_len));
  plan.groups = static_cast<int>(ceil_div(args.dim, kGroup));
  plan.chunk_len = chunk_length(plan, args.seqlen, chunk_len);
  plan.chunks = static_cast<int>(ceil_div(args.seqlen, plan.chunk_len));
  const int64_t groups = static_cast<int64_t>(plan.batch) * plan.groups;
  const int state_slots = args.dstate <= 16 ? 16 : 32;
  at::Tensor states, decays, arrivals;
  if (plan.chunks > 1) {
    const auto options = u.options().dtype(at::kFloat);
    states = at::empty({groups, plan.chunks, state_slots, kGroup}, options);
    decays = at::empty({groups, plan.chunks - 1, state_slots, kGroup}, options);
    arrivals = at::zeros({groups}, u.options().dtype(at::kInt));
    plan.chunk_states = states.data_ptr<float>();
    plan.chunk_decays = decays.data_ptr<float>();
    plan.arrivals = arrivals.data_ptr<int>();
  }
  switch (out_dtype) {
    case at::kHalf: return launch_method<__half>(args, plan, method);
    case at::kBFloat16: return launch_method<__nv_bfloat16>(args, plan, method);
    default: return launch_method<float>(args, plan, method);
  }
}

}  // namespace quamba_ssm
