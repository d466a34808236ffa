// The QSScan decode step's arithmetic for one channel (qsscan.cu's step kernels and the fused
// mixer step, csrc/fused_decode/): Δ, the state update of a lane's states with their terms of y
// summed in state_readout's order, and the gated output. Specification: quamba.ops.scan.qsscan.
#pragma once

#include "../ssm_common/ssm_common.cuh"
#include "scan_args.h"
#include "scan_math.cuh"

namespace quamba_ssm {

struct StepArgs {
  FloatSource u, dt, z, B, C;  // z.data == nullptr: no gate
  int64_t u_st[2], dt_st[2], z_st[2], B_st[2], C_st[2];  // (batch, element) strides
  SsmParams params;
  void* state;  // contiguous [batch, dim, dstate], int8 (with state_scale) or fp32, in place
  bool state_int8;
  float state_scale, state_inv_scale;
  void* y;  // contiguous [batch, dim]
  int batch, dim, dstate;
  float* drive;  // foh: contiguous fp32 [batch, dim, dstate], v_{t-1} in, v_t out
  // state and A_log 16-byte aligned and dstate a multiple of 16: a lane's states are whole rows
  bool rows_aligned;
  // dt_proj folded into the step where not null (contiguous int8 [dim, dt_rank]): dt then holds
  // dt_low's codes [batch, dt_rank] with dt's scale, and a channel's dt code is dt_low · its row
  // requantized by dt_multiplier, as w8a8_linear's int8 epilogue computes it.
  const int8_t* dt_proj;
  float dt_multiplier;
  int dt_rank;
  // dt_rank a multiple of 16 and 16-byte aligned rows (dt_low's elements contiguous): read in
  // 16-byte pieces
  bool dt_proj_wide, dt_low_wide;
};

// The step's arguments where u, dt, B and C are int8 codes of these scales and the state, stepped
// in place, is int8 codes of state_scale or fp32 (the fused decode kernels); the caller sets the
// rest (y, sizes, rows_aligned).
inline StepArgs int8_input_step(double u_scale, double dt_scale, double bc_scale, const SsmParams& params,
                                void* state, bool state_int8, double state_scale) {
  StepArgs step{};
  step.u = FloatSource{nullptr, InKind::kInt8, to_fp32(u_scale)};
  step.dt = FloatSource{nullptr, InKind::kInt8, to_fp32(dt_scale)};
  step.B = FloatSource{nullptr, InKind::kInt8, to_fp32(bc_scale)};
  step.C = step.B;
  step.params = params;
  step.state = state;
  step.state_int8 = state_int8;
  step.state_scale = to_fp32(state_scale);
  step.state_inv_scale = state_int8 ? reciprocal(state_scale) : 0.f;
  return step;
}

// Δ from dt and its channel's dt_bias: softplus(dt + dt_bias).
__device__ __forceinline__ float biased_delta(float dt, float bias) { return softplus(__fadd_rn(dt, bias)); }

// Δ of channel d from its dt.
__device__ __forceinline__ float delta_of(const StepArgs& a, float dt, int d) {
  return biased_delta(dt, a.params.bias(d));
}

// Δ of channel d of row b, once per lane.
__device__ __forceinline__ float step_delta(const StepArgs& a, int b, int d) {
  return delta_of(a, a.dt.load(b * a.dt_st[0] + d * a.dt_st[1]), d);
}

// dt's code from the exact int32 sum dt_low · a channel's dt_proj row, as w8a8_linear's int8
// epilogue gives it: quantize_rn of the fp32 sum times the requantization multiplier.
__device__ __forceinline__ int8_t projected_dt_code(int dt_sum, float multiplier) {
  return quantize_rn(__int2float_rn(dt_sum), multiplier);
}

// Δ of channel d where dt_proj is folded in, from its sum dt_low · its dt_proj row.
__device__ __forceinline__ float projected_delta(const StepArgs& a, int dt_sum, int d) {
  return delta_of(a, dequantize(projected_dt_code(dt_sum, a.dt_multiplier), a.dt.scale), d);
}

// What the step of one state reads besides its state: A_n, B_n, C_n (and foh's drive v_{t-1}).
struct StateInputs {
  float A, B, C, drive;
};

// The first ``count`` (at most kCount) values at p: loaded as a whole row where count is kCount
// and ``aligned`` (p aligned as load_row needs), else one by one; out past count is left as is.
template <int kCount, typename T>
__device__ __forceinline__ void load_partial_row(const T* p, int count, bool aligned,
                                                 T (&out)[kCount]) {
  if (count == kCount && aligned) {
    load_row<kCount>(p, out);
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      if (i < count) out[i] = p[i];
    }
  }
}

template <int kCount, typename T>
__device__ __forceinline__ void store_partial_row(T* p, int count, bool aligned,
                                                  const T (&values)[kCount]) {
  if (count == kCount && aligned) {
    store_row<kCount>(p, values);
  } else {
#pragma unroll
    for (int i = 0; i < kCount; ++i) {
      if (i < count) p[i] = values[i];
    }
  }
}

// The new state h_new of one state from its old state h, and its term C_n · h_new of y. The
// arithmetic follows selective_state_update operation by operation: decay · h + (Δ u) · B for
// zoh, else decay · h + (gain · v_t + previous gain · v_{t-1}), v = u · B, each operation
// rounded. zoh's decay exp(Δ A) is ex2.approx of Δ A · log2 e, as in mamba-ssm's step and the
// prefill: 3 instructions instead of expf's 9, with a relative error of ~2^-22 that grows with
// |Δ A| through the rounding of Δ A · log2 e. foh writes v_t to its drive at ``offset``.
template <Discretization kMethod>
__device__ __forceinline__ float step_state(const StepArgs& a, const StateInputs& in, float h,
                                            float u, float delta, int64_t offset, float& term) {
  const float z = __fmul_rn(delta, in.A);
  StepCoefficients c{};  // zoh uses the decay only
  if constexpr (kMethod == Discretization::kZoh) {
    c.decay = exp2_approx(__fmul_rn(z, kLog2e));  // as the prefill and mamba-ssm's step
  } else {
    c = exact_coefficients<kMethod>(delta, z);
  }
  float step_input;
  if constexpr (kMethod == Discretization::kZoh) {
    step_input = __fmul_rn(__fmul_rn(delta, u), in.B);
  } else {
    const float v = __fmul_rn(u, in.B);
    step_input = __fmul_rn(c.gain, v);
    if constexpr (kMethod == Discretization::kFoh) {
      step_input = __fadd_rn(step_input, __fmul_rn(c.previous_gain, in.drive));
      a.drive[offset] = v;
    }
  }
  const float h_new = __fadd_rn(__fmul_rn(c.decay, h), step_input);
  term = __fmul_rn(h_new, in.C);
  return h_new;
}

// A_n = −exp(A_log_n) of channel d's states first ... first + count − 1 (count at most kStates;
// read as a row where it is whole and aligned).
template <int kStates>
__device__ __forceinline__ void load_A(const StepArgs& a, int d, int first, int count,
                                       float (&A)[kStates]) {
  int8_t codes[kStates];
  load_partial_row<kStates>(a.params.A_log + d * a.dstate + first, count, a.rows_aligned, codes);
#pragma unroll
  for (int s = 0; s < kStates; ++s) {
    if (s < count) A[s] = -expf(dequantize(codes[s], a.params.A_log_scale));
  }
}

// Code s of a lane's int8 states as fp32 (dequantize's value before its multiply) without a
// conversion instruction, which runs at a quarter of the fp32 rate: the code with its sign bit
// flipped (code + 128) as the low mantissa bits of 2^23, less 2^23 + 128, exactly. A byte permute
// places a code of a whole word of codes.
template <int kStates>
__device__ __forceinline__ float state_code_value(const int8_t (&codes)[kStates], int s) {
  constexpr float kBias = 8388736.f;  // 2^23 + 128
  if constexpr (kStates % 4 == 0) {
    uint32_t word;
    memcpy(&word, codes + s / 4 * 4, sizeof(word));
    // bytes 3, 2, 1 from 0x4B000000 (0x4B, 0, 0), byte 0 the code's
    const uint32_t biased = __byte_perm(word ^ 0x80808080u, 0x4B000000u, 0x7650 + s % 4);
    return __fadd_rn(__uint_as_float(biased), -kBias);
  } else {
    const uint32_t biased = 0x4B000000u | (static_cast<uint8_t>(codes[s]) ^ 0x80u);
    return __fadd_rn(__uint_as_float(biased), -kBias);
  }
}

// Steps ``count`` (at most kStates) states of one (b, d) at ``offset`` in the state from their
// old values, given their A, B and C (B and C in registers or shared memory): their new values,
// and the sum of their terms of y as a pairwise tree, adjacent states first
// (quamba.ops.scan.selective_scan.state_readout's order), zero past count. The tree is built as the
// terms come: pending[k] holds the sum of the last whole block of 2^k terms, so that at most
// log2(kStates) + 1 partial sums are live. State is int8 codes or fp32.
template <Discretization kMethod, int kStates, typename State>
__device__ __forceinline__ float step_states(const StepArgs& a, int count, int64_t offset, float u,
                                             float delta, const float (&A)[kStates],
                                             const float* B, const float* C,
                                             const State (&old_state)[kStates],
                                             State (&new_state)[kStates]) {
  constexpr int kLevels = kStates == 1 ? 1 : kStates == 4 ? 3 : 5;
  static_assert(kStates == 1 || kStates == 4 || kStates == 16, "states a lane: 1, 4 or 16");
  float pending[kLevels];
#pragma unroll
  for (int s = 0; s < kStates; ++s) {
    float term = 0.f;
    if (s < count) {
      const StateInputs in{A[s], B[s], C[s], a.drive != nullptr ? a.drive[offset + s] : 0.f};
      float h;
      if constexpr (std::is_same_v<State, int8_t>) {
        h = __fmul_rn(state_code_value(old_state, s), a.state_scale);  // = dequantize
      } else {
        h = old_state[s];
      }
      const float h_new = step_state<kMethod>(a, in, h, u, delta, offset + s, term);
      if constexpr (std::is_same_v<State, int8_t>) {
        new_state[s] = quantize_rn(h_new, a.state_inv_scale);
      } else {
        new_state[s] = h_new;
      }
    }
    int level = 0;
#pragma unroll
    for (; (s >> level) & 1; ++level) term = __fadd_rn(pending[level], term);
    pending[level] = term;
  }
  return pending[kLevels - 1];
}

// A lane's ``count`` (at most kStates) states at ``offset`` in a.state, read and written as a row
// where they are whole and aligned, else one by one.
template <int kStates, typename State>
__device__ __forceinline__ void load_lane_states(const StepArgs& a, int count, int64_t offset,
                                                 State (&h)[kStates]) {
  load_partial_row<kStates>(static_cast<const State*>(a.state) + offset, count, a.rows_aligned, h);
}

template <int kStates, typename State>
__device__ __forceinline__ void store_lane_states(const StepArgs& a, int count, int64_t offset,
                                                  const State (&h)[kStates]) {
  store_partial_row<kStates>(static_cast<State*>(a.state) + offset, count, a.rows_aligned, h);
}

// step_states on the states at ``offset`` in a.state, updated in place.
template <Discretization kMethod, int kStates, typename State>
__device__ __forceinline__ float step_lane(const StepArgs& a, int count, int64_t offset, float u,
                                           float delta, const float (&A)[kStates], const float* B,
                                           const float* C) {
  State old_state[kStates], new_state[kStates];
  load_lane_states<kStates>(a, count, offset, old_state);
  const float sum =
      step_states<kMethod, kStates>(a, count, offset, u, delta, A, B, C, old_state, new_state);
  store_lane_states<kStates>(a, count, offset, new_state);
  return sum;
}

template <Discretization kMethod, int kStates>
__device__ __forceinline__ float step_lane(const StepArgs& a, int count, int64_t offset, float u,
                                           float delta, const float (&A)[kStates], const float* B,
                                           const float* C) {
  return a.state_int8
             ? step_lane<kMethod, kStates, int8_t>(a, count, offset, u, delta, A, B, C)
             : step_lane<kMethod, kStates, float>(a, count, offset, u, delta, A, B, C);
}

// y of a channel from its sum of C · h: + D u, times SiLU(z) where gated.
__device__ __forceinline__ float gated_y(float sum, float u, float skip, bool gated, float z) {
  const float y = __fadd_rn(sum, __fmul_rn(u, skip));
  return gated ? __fmul_rn(y, silu_rn(z)) : y;
}

// z of (b, d) where the step is gated (0 where not).
__device__ __forceinline__ float load_gate(const StepArgs& a, int b, int d) {
  return a.z.data != nullptr ? a.z.load(b * a.z_st[0] + d * a.z_st[1]) : 0.f;
}

// y of (b, d) from its sum of C · h, u, D (skip) and z.
template <typename Out>
__device__ __forceinline__ void store_y(const StepArgs& a, int b, int d, float sum, float u,
                                        float skip, float z) {
  static_cast<Out*>(a.y)[static_cast<int64_t>(b) * a.dim + d] =
      from_float<Out>(gated_y(sum, u, skip, a.z.data != nullptr, z));
}

template <typename Out>
__device__ __forceinline__ void store_y(const StepArgs& a, int b, int d, float sum, float u) {
  store_y<Out>(a, b, d, sum, u, a.params.skip(d), load_gate(a, b, d));
}

}  // namespace quamba_ssm
