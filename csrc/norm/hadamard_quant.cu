// Online Hadamard transform fused with int8 quantization. Specification:
// quamba/ops/norm/qhadamard.py, with the factor order of quamba/ops/norm/hadamard.py: n = m · p,
// (x @ H_n).view(m, p) = S_mᵀ @ (x.view(m, p) @ W_p) / sqrt(n). The Walsh–Hadamard butterflies
// run in the reference's order (bit-identical); the m × m signed sums then run in an order of
// their own, as BLAS does: int8 outputs agree to one step.
// One row is one block's work; at decode (one row per step) the block's latency is the kernel's
// time, so the butterflies below 256 run in registers and warp shuffles, without a barrier per
// stage (2.8B decode: 14.3 µs per call with every stage in shared memory and 256 threads), the
// stages past 256 (p = 512 ... 8192) run in registers too, a thread per column of the row after
// one barrier, and the row's signed sums are spread over up to 8 blocks. Many rows (prefill) are
// bound by issue: a shuffle stage is one fmaf per value, the signs of S_m are compile-time
// (base_column), and a thread that makes all m outputs of a position shares sums of four columns
// between them (signed_sums_by_quads). H100, Mamba-2.8B (5120 = 20 · 256, fp16), µs per call in CUDA graphs:
// 3.6 → 2.9 for one row, 17.7 → 12.3 for 1024 rows, 117.5 → 84.9 for 8192 (the bytes' floor is
// 42 µs) with the compile-time signs and quads (benchmarks/RESULTS.md).
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "../ssm_common/ssm_common.cuh"
#include "pdl.cuh"

namespace quamba_ssm {
namespace {

constexpr int kSegmentValues = 8;  // values per lane in the register stages: segments of 256

// S_m of quamba/ops/norm/hadamard.py (Paley I for m = 12 and 20, Paley II for 28; S_1 = [[1]]) as
// column masks: bit c of entry a is set where S_m[c, a] = -1. Compile-time, so that no sign costs
// an instruction and the signed sums can share partial sums between outputs; the op checks that
// the masks it is given are these.
template <int M>
__host__ __device__ constexpr uint32_t base_column(int a) {
  if constexpr (M == 12) {
    constexpr uint32_t columns[12] = {0xffe, 0x474, 0x8e8, 0x1d2, 0x3a4, 0x748, 0xe90, 0xd22, 0xa46, 0x48e,
                                      0x91c, 0x23a};
    return columns[a];
  } else if constexpr (M == 20) {
    constexpr uint32_t columns[20] = {0xffffe, 0x615e4, 0xc2bc8, 0x85792, 0xaf26,  0x15e4c, 0x2bc98,
                                      0x57930, 0xaf260, 0x5e4c2, 0xbc984, 0x7930a, 0xf2614, 0xe4c2a,
                                      0xc9856, 0x930ae, 0x2615e, 0x4c2bc, 0x98578, 0x30af2};
    return columns[a];
  } else if constexpr (M == 28) {
    constexpr uint32_t columns[28] = {
        0x2,       0xaaaaaab, 0x30ff0c8, 0x9a55a6e, 0xc3fc320, 0x69569ba, 0xff0c8c,  0xa55a6e6, 0x3fc3230, 0x9569b9a,
        0xff0c8c0, 0x55a6e6a, 0xfc3230c, 0x569b9a6, 0xf0c8c3c, 0x5a6e696, 0xc3230fc, 0x69b9a56, 0xc8c3fc,  0xa6e6956,
        0x3230ff0, 0x9b9a55a, 0xc8c3fc0, 0x6e6956a, 0x230ff0c, 0xb9a55a6, 0x8c3fc30, 0xe69569a};
    return columns[a];
  } else {
    static_assert(M == 1, "base orders are 1, 12, 20 and 28");
    return 0;
  }
}

// Mamba2's gated RMSNorm before the transform (quamba/ops/norm/gated_norm.py, one kernel instead of two
// at every decode step): the transform's input is then weight · g / rms(g), g = x · SiLU(z ·
// z_scale), the RMS taken over each group of group_size channels.
struct Gate {
  const int8_t* z = nullptr;      // rows of n codes, z_row_stride apart
  const float* weight = nullptr;  // [n], or none (ones)
  int64_t z_row_stride = 0;
  float z_scale = 1.f, eps = 0.f;
  int group_size = 0;
};

constexpr int kMaxGateGroups = 64;

constexpr int kGateChunk = 8;  // values a thread gates per wide load (16 bytes of fp16 x, 8 of z)

// g = x · SiLU(z · z_scale), each operation rounded as the reference's. silu_codes differs from
// the reference's division only where |SiLU| < 1e-36, which leaves g's codes and RMS unchanged.
__device__ __forceinline__ float gated(float x, int8_t z, float z_scale) {
  return __fmul_rn(x, silu_codes(dequantize(z, z_scale)));
}

// 1 / sqrt(sum_sq / count + eps), each operation rounded as the reference's.
__device__ __forceinline__ float inverse_rms(float sum_sq, int count, float eps) {
  return __frsqrt_rn(__fadd_rn(__fdiv_rn(sum_sq, static_cast<float>(count)), eps));
}

// Several RMS groups: a first pass over the row writes g of every channel into buf (wide loads
// of x and z where the row allows them), then inv_rms[group] of each group, a warp's sum each, the
// groups at once: one barrier, where a block sum a group took two (16 for Mamba2-8B's 8 groups).
template <typename In>
__device__ void gate_row(const In* __restrict__ x, const int8_t* __restrict__ z, const Gate& gate,
                         float* buf, int n, float* inv_rms) {
  const bool wide = n % kGateChunk == 0 && wide_loads_fit<kGateChunk>(x) && wide_loads_fit<kGateChunk>(z);
  if (wide) {
    for (int base = threadIdx.x * kGateChunk; base < n; base += blockDim.x * kGateChunk) {
      float values[kGateChunk];
      load_values<kGateChunk>(x + base, true, values);
      int8_t codes[kGateChunk];
      load_elements<kGateChunk>(z + base, true, codes);
#pragma unroll
      for (int r = 0; r < kGateChunk; ++r) buf[base + r] = gated(values[r], codes[r], gate.z_scale);
    }
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = gated(to_float(x[i]), z[i], gate.z_scale);
  }
  __syncthreads();
  const int lane = threadIdx.x % 32;
  for (int group = threadIdx.x / 32; group < n / gate.group_size; group += blockDim.x / 32) {
    const float* values = buf + group * gate.group_size;
    float sum_sq = 0.f;
    for (int i = lane; i < gate.group_size; i += 32) sum_sq = fmaf(values[i], values[i], sum_sq);
    for (int offset = 16; offset > 0; offset /= 2) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    if (lane == 0) inv_rms[group] = inverse_rms(sum_sq, gate.group_size, gate.eps);
  }
  __syncthreads();
}

// The transform's input, as the butterflies read it: at(i) is value i of the row, load<V>(base)
// values base ... base + V - 1 (base a multiple of V). Each thread reads the values it then
// overwrites with its butterflies' results, so an input may live in buf.

// x's values.
template <typename In>
struct PlainInput {
  const In* __restrict__ x;
  bool aligned;  // load_values' wide loads fit x

  __device__ __forceinline__ float at(int i) const { return to_float(x[i]); }
  template <int V>
  __device__ __forceinline__ void load(int base, float (&v)[V]) const {
    load_values<V>(x + base, aligned, v);
  }
};

// One RMS group (the published Mamba2 models): weight · g, gated as it is loaded, and the sum of
// the g² a thread loaded kept in sum_sq. The transform is linear, so the row's inverse RMS scales
// its outputs instead (an order of roundings of its own: codes within one step, as the signed sums).
template <typename In>
struct GatedRowInput {
  const In* __restrict__ x;
  const int8_t* __restrict__ z;  // the row's codes
  const Gate& gate;
  bool aligned;  // the wide loads fit x, z and the weight
  mutable float sum_sq = 0.f;

  // weight · g, with g² added to sum_sq.
  __device__ __forceinline__ float weighted(float g, float weight) const {
    sum_sq = fmaf(g, g, sum_sq);
    return gate.weight != nullptr ? __fmul_rn(g, weight) : g;
  }
  __device__ __forceinline__ float at(int i) const {
    return weighted(gated(to_float(x[i]), z[i], gate.z_scale), gate.weight != nullptr ? gate.weight[i] : 1.f);
  }
  template <int V>
  __device__ __forceinline__ void load(int base, float (&v)[V]) const {
    load_values<V>(x + base, aligned, v);
    int8_t codes[V];
    load_elements<V>(z + base, aligned, codes);
    float weights[V];
    if (gate.weight != nullptr) {
      load_elements<V>(gate.weight + base, aligned, weights);
    } else {
#pragma unroll
      for (int r = 0; r < V; ++r) weights[r] = 1.f;
    }
#pragma unroll
    for (int r = 0; r < V; ++r) v[r] = weighted(gated(v[r], codes[r], gate.z_scale), weights[r]);
  }
};

// Several RMS groups: the g of gate_row in buf, times their group's inverse RMS and the weight.
struct NormedInput {
  const float* buf;
  const Gate& gate;
  const float* inv_rms;

  __device__ __forceinline__ float at(int i) const {
    const float normed = __fmul_rn(buf[i], inv_rms[i / gate.group_size]);
    return gate.weight != nullptr ? __fmul_rn(normed, gate.weight[i]) : normed;
  }
  template <int V>
  __device__ __forceinline__ void load(int base, float (&v)[V]) const {
#pragma unroll
    for (int r = 0; r < V; ++r) v[r] = at(base + r);
  }
};

// The Walsh–Hadamard butterflies of the reference (_walsh_hadamard): stage `half` maps each pair
// (first, second) = (v[i], v[i + half]) to (first + second, first - second), for half = 1, 2, ...,
// p / 2. Stages below 32 · V run in registers, a warp holding segments of 32 · V values (V per
// lane, contiguous): in-lane pairs for half < V, then lane pairs through shuffles. The pairing
// and each addition are the reference's, so the result is bit-identical however it is spread.
template <int V, typename Input>
__device__ void walsh_hadamard_segments(const Input& input, float* buf, int n) {
  constexpr int kSegment = 32 * V;
  const int lane = threadIdx.x % 32;
  for (int segment = threadIdx.x / 32; segment < n / kSegment; segment += blockDim.x / 32) {
    const int base = segment * kSegment + lane * V;
    float v[V];
    input.template load<V>(base, v);
#pragma unroll
    for (int half = 1; half < V; half *= 2)
#pragma unroll
      for (int r = 0; r < V; ++r)
        if ((r & half) == 0) {
          const float first = v[r], second = v[r + half];
          v[r] = __fadd_rn(first, second);
          v[r + half] = __fsub_rn(first, second);
        }
#pragma unroll
    for (int mask = 1; mask < 32; mask *= 2) {
      // The first of a pair takes v + other, the second other - v: fmaf(±1, v, other) rounds as
      // each, in one instruction (a select between an add and a subtract takes four).
      const float sign = (lane & mask) == 0 ? 1.f : -1.f;
#pragma unroll
      for (int r = 0; r < V; ++r) v[r] = fmaf(sign, v[r], __shfl_xor_sync(0xffffffffu, v[r], mask));
    }
#pragma unroll
    for (int r = 0; r < V; ++r) buf[base + r] = v[r];
  }
}

// The remaining stages, half = first_half ... p / 2, in shared memory over the whole row.
__device__ void walsh_hadamard_shared(float* buf, int n, int p, int first_half) {
  for (int half = first_half; half < p; half *= 2) {
    __syncthreads();
    for (int j = threadIdx.x; j < n / 2; j += blockDim.x) {
      const int group = j / half, k = j % half;
      const int i = group * 2 * half + k;  // blocks of p are whole groups, as p is a power of two
      const float first = buf[i], second = buf[i + half];
      buf[i] = __fadd_rn(first, second);
      buf[i + half] = __fsub_rn(first, second);
    }
  }
  __syncthreads();
}

// The same stages with a thread per column: the kCount = p / first_half values a · p + low +
// first_half · k (k < kCount) of block a, for low < first_half, loaded into registers and combined
// there, each pair and each addition as the reference's. One barrier for all stages, where
// walsh_hadamard_shared takes one a stage (p = 8192: five stages past the registers' 256).
// Consecutive threads take consecutive columns: their loads hit consecutive banks where
// first_half ≥ 32.
template <int kCount>
__device__ void walsh_hadamard_columns(float* buf, int n, int p, int first_half) {
  __syncthreads();
  for (int column = threadIdx.x; column < n / kCount; column += blockDim.x) {
    float* values = buf + column / first_half * p + column % first_half;
    float v[kCount];
#pragma unroll
    for (int k = 0; k < kCount; ++k) v[k] = values[k * first_half];
#pragma unroll
    for (int step = 1; step < kCount; step *= 2)
#pragma unroll
      for (int k = 0; k < kCount; ++k)
        if ((k & step) == 0) {
          const float first = v[k], second = v[k + step];
          v[k] = __fadd_rn(first, second);
          v[k + step] = __fsub_rn(first, second);
        }
#pragma unroll
    for (int k = 0; k < kCount; ++k) values[k * first_half] = v[k];
  }
  __syncthreads();
}

// The stages half = first_half ... p / 2 that the registers' segments leave (none where p is
// first_half: the barrier alone), in columns where p / first_half ≤ 32, else in shared memory.
__device__ void walsh_hadamard_rest(float* buf, int n, int p, int first_half) {
  switch (p / first_half) {
    case 1: __syncthreads(); return;
    case 2: return walsh_hadamard_columns<2>(buf, n, p, first_half);
    case 4: return walsh_hadamard_columns<4>(buf, n, p, first_half);
    case 8: return walsh_hadamard_columns<8>(buf, n, p, first_half);
    case 16: return walsh_hadamard_columns<16>(buf, n, p, first_half);
    case 32: return walsh_hadamard_columns<32>(buf, n, p, first_half);
    default: return walsh_hadamard_shared(buf, n, p, first_half);
  }
}

// sum ± v as the ±1 sign of S[c, a] has it (a compile-time choice, no instruction).
template <int M>
__device__ __forceinline__ float add_signed(float sum, float v, int a, int c) {
  return (base_column<M>(a) >> c & 1) ? __fsub_rn(sum, v) : __fadd_rn(sum, v);
}

__device__ __forceinline__ int8_t quantize_output(float sum, float norm, float out_inv_scale) {
  return quantize_rn(__fmul_rn(sum, norm), out_inv_scale);
}

// The outputs a = group, group + groups, ... of position b of a block whose butterflies are in
// buf: out[a·p + b] = Σ_c S[c, a] · buf[c·p + b] scaled by 1/sqrt(n) to int8, c in order (M - 1
// additions per output).
template <int M>
__device__ __forceinline__ void signed_sums(const float* buf, int8_t* __restrict__ out, int p, int b,
                                            int group, int groups, float norm, float out_inv_scale) {
  float v[M];
#pragma unroll
  for (int c = 0; c < M; ++c) v[c] = buf[c * p + b];
  int next = group;
#pragma unroll
  for (int a = 0; a < M; ++a) {
    if (a != next) continue;
    next += groups;
    float sum = (base_column<M>(a) & 1) ? -v[0] : v[0];
#pragma unroll
    for (int c = 1; c < M; ++c) sum = add_signed<M>(sum, v[c], a, c);
    out[a * p + b] = quantize_output(sum, norm, out_inv_scale);
  }
}

// All M outputs of position b (a thread per position: prefill), the columns taken four at a
// time: the 8 sums v0 ± v1 ± v2 ± v3 of a quad (12 additions) serve every output, which adds or
// subtracts one of them, M / 4 terms per output instead of M (M = 20: 140 additions instead of
// 380). This order of additions is not the reference's (BLAS has its own too): int8 outputs
// agree to one step.
template <int M>
__device__ __forceinline__ void signed_sums_by_quads(const float* buf, int8_t* __restrict__ out, int p, int b,
                                                     float norm, float out_inv_scale) {
  static_assert(M % 4 == 0, "quads of columns");
  float acc[M];
#pragma unroll
  for (int quad = 0; quad < M / 4; ++quad) {
    const float* column = buf + 4 * quad * p + b;
    const float v0 = column[0], v1 = column[p], v2 = column[2 * p], v3 = column[3 * p];
    const float head[2] = {__fadd_rn(v0, v1), __fsub_rn(v0, v1)};  // v0 ± v1
    const float tail[2] = {__fadd_rn(v2, v3), __fsub_rn(v2, v3)};  // v2 ± v3
    // sums[t] = v0 + s1·v1 + s2·v2 + s3·v3, bit i - 1 of t set where s_i = -1:
    // (v0 + s1·v1) + s2·(v2 + s2·s3·v3).
    float sums[8];
#pragma unroll
    for (int t = 0; t < 8; ++t) {
      const int s1 = t & 1, s2 = t >> 1 & 1, s3 = t >> 2 & 1;
      sums[t] = s2 ? __fsub_rn(head[s1], tail[s2 ^ s3]) : __fadd_rn(head[s1], tail[s2 ^ s3]);
    }
#pragma unroll
    for (int a = 0; a < M; ++a) {
      const uint32_t signs = base_column<M>(a) >> (4 * quad) & 0xF;  // bit i: column 4 · quad + i
      const bool negate = signs & 1;                                  // the term is ± sums[t]
      const int t = ((negate ? signs ^ 0xF : signs) >> 1) & 7;
      if (quad == 0) acc[a] = negate ? -sums[t] : sums[t];
      else acc[a] = negate ? __fsub_rn(acc[a], sums[t]) : __fadd_rn(acc[a], sums[t]);
    }
  }
#pragma unroll
  for (int a = 0; a < M; ++a) out[a * p + b] = quantize_output(acc[a], norm, out_inv_scale);
}

// The butterflies of a row's input (registers, then shared memory) into buf. V = 0: p < 32,
// every stage in shared memory.
template <int V, typename Input>
__device__ void transform_row(const Input& input, float* buf, int n, int p) {
  int first_half = 1;
  if constexpr (V > 0) {
    walsh_hadamard_segments<V>(input, buf, n);
    first_half = 32 * V;
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = input.at(i);
  }
  walsh_hadamard_rest(buf, n, p, first_half);
}

// transform_row of row x (and z), returning the factor of its outputs: norm, times the row's
// inverse RMS where one RMS group gates it (GatedRowInput).
template <int V, typename In, bool kGated>
__device__ float transform_input(const In* __restrict__ x, const int8_t* __restrict__ z,
                                 const Gate& gate, float* buf, int n, int p, float norm) {
  constexpr int kV = V > 0 ? V : 1;
  if constexpr (!kGated) {
    transform_row<V>(PlainInput<In>{x, wide_loads_fit<kV>(x)}, buf, n, p);
    return norm;
  } else if (gate.group_size >= n) {
    const bool aligned = wide_loads_fit<kV>(x) && wide_loads_fit<kV>(z) &&
                         (gate.weight == nullptr || wide_loads_fit<kV>(gate.weight));
    const GatedRowInput<In> input{x, z, gate, aligned};
    transform_row<V>(input, buf, n, p);
    return __fmul_rn(norm, inverse_rms(block_sum(input.sum_sq), n, gate.eps));
  } else {
    __shared__ float inv_rms[kMaxGateGroups];
    gate_row(x, z, gate, buf, n, inv_rms);
    transform_row<V>(NormedInput{buf, gate, inv_rms}, buf, n, p);
    return norm;
  }
}

// One block per row and slice of positions: the butterflies of the whole row, then the signed
// sums of each position b of the slice, the M outputs of a position shared out among up to
// blockDim / (p / slices) threads. At decode a row is split into slices (gridDim.y) so that more
// SMs issue its signed sums; each repeats the row's butterflies (and gate), which cost less.
template <int M, int V, typename In, bool kGated>
__global__ void __launch_bounds__(1024)
hadamard_quant_kernel(const In* __restrict__ x, const Gate gate, int8_t* __restrict__ q, int n,
                      int p, float norm, float out_inv_scale) {
  quamba::pdl_launch_dependents();  // the next GEMV may start loading its weights (pdl.cuh)
  quamba::pdl_wait();                // x comes from the kernel before
  extern __shared__ float buf[];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * n;
  const float factor = transform_input<V, In, kGated>(x + row, gate.z + blockIdx.x * gate.z_row_stride,
                                                      gate, buf, n, p, norm);
  const int positions = p / gridDim.y, first_position = blockIdx.y * positions;
  const int groups = max(1, min(M, static_cast<int>(blockDim.x) / positions));
  // Whole warps where a slice has 32 positions or more: a warp's threads share one group.
  const int threads_per_group = min(positions, static_cast<int>(blockDim.x) / groups);
  const int group = threadIdx.x / threads_per_group;
  if (group >= groups) return;
  for (int b = threadIdx.x % threads_per_group; b < positions; b += threads_per_group) {
    if constexpr (M % 4 == 0) {
      if (groups == 1) {
        signed_sums_by_quads<M>(buf, q + row, p, first_position + b, factor, out_inv_scale);
        continue;
      }
    }
    signed_sums<M>(buf, q + row, p, first_position + b, group, groups, factor, out_inv_scale);
  }
}

// Registers hold segments of 32 · V values: V = p / 32 up to kSegmentValues (0 below p = 32).
int segment_values(int p) { return p < 32 ? 0 : std::min(p / 32, kSegmentValues); }

// Big blocks for few rows (decode: one row is all the work there is), small ones for many: a
// thread per position where p is 128 or 256, so that each makes all m outputs of its position
// (signed_sums_by_quads).
int threads_for(int64_t rows, int p) {
  if (rows < 2 * at::cuda::getCurrentDeviceProperties()->multiProcessorCount) return 1024;
  return p == 128 ? 128 : 256;
}

// Slices of a row's positions, one block each: up to 8 while the blocks fit on the SMs and a slice
// keeps a warp's 32 positions. One row of 5120 = 20 · 256 (2.8B decode) in one block issued 20.9k
// warp instructions on one SM (Nsight Compute, H100).
int slices_for(int64_t rows, int p) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  int slices = 1;
  while (slices < 8 && p / (2 * slices) >= 32 && rows * 2 * slices <= sms) slices *= 2;
  return slices;
}

template <int M, int V, typename In>
void launch_hadamard(const at::Tensor& x, const Gate& gate, at::Tensor& q, int64_t rows, int n,
                     int p, float norm, float out_inv_scale) {
  auto kernel = gate.z != nullptr ? hadamard_quant_kernel<M, V, In, true>
                                  : hadamard_quant_kernel<M, V, In, false>;
  check_kernel_image(kernel, "hadamard_quant");
  const int smem = n * sizeof(float);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>(rows), slices_for(rows, p));
  quamba::launch_with_pdl(kernel, grid, threads_for(rows, p), smem, current_stream(),
                          static_cast<const In*>(x.data_ptr()), gate, q.data_ptr<int8_t>(), n, p,
                          norm, out_inv_scale);
}

template <int M, typename In>
void dispatch_segment(const at::Tensor& x, const Gate& gate, at::Tensor& q, int64_t rows, int n,
                      int p, float norm, float out_inv_scale) {
  switch (segment_values(p)) {
    case 0: return launch_hadamard<M, 0, In>(x, gate, q, rows, n, p, norm, out_inv_scale);
    case 1: return launch_hadamard<M, 1, In>(x, gate, q, rows, n, p, norm, out_inv_scale);
    case 2: return launch_hadamard<M, 2, In>(x, gate, q, rows, n, p, norm, out_inv_scale);
    case 4: return launch_hadamard<M, 4, In>(x, gate, q, rows, n, p, norm, out_inv_scale);
    default: return launch_hadamard<M, kSegmentValues, In>(x, gate, q, rows, n, p, norm, out_inv_scale);
  }
}

template <typename In>
void dispatch_base_order(int m, const at::Tensor& x, const Gate& gate, at::Tensor& q, int64_t rows,
                         int n, int p, float norm, float out_inv_scale) {
  switch (m) {
    case 1: return dispatch_segment<1, In>(x, gate, q, rows, n, p, norm, out_inv_scale);
    case 12: return dispatch_segment<12, In>(x, gate, q, rows, n, p, norm, out_inv_scale);
    case 20: return dispatch_segment<20, In>(x, gate, q, rows, n, p, norm, out_inv_scale);
    default: return dispatch_segment<28, In>(x, gate, q, rows, n, p, norm, out_inv_scale);
  }
}

// Whether the m masks are base_column<m>'s (the size is checked before).
bool are_base_columns(int64_t m, at::IntArrayRef sign_columns) {
  auto equal = [&](auto order) {
    for (int a = 0; a < decltype(order)::value; ++a)
      if (sign_columns[a] != static_cast<int64_t>(base_column<decltype(order)::value>(a))) return false;
    return true;
  };
  switch (m) {
    case 1: return equal(std::integral_constant<int, 1>{});
    case 12: return equal(std::integral_constant<int, 12>{});
    case 20: return equal(std::integral_constant<int, 20>{});
    default: return equal(std::integral_constant<int, 28>{});
  }
}

int max_shared_floats(const at::Tensor& x) {
  int optin = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, x.get_device()));
  return optin / static_cast<int>(sizeof(float));
}

// The row stride of z [..., n] taken as rows of n contiguous codes (its leading dimensions must
// collapse into one, as a slice of a wider contiguous tensor's last dimension does).
int64_t gate_row_stride(const at::Tensor& z) {
  const int64_t dims = z.dim();
  TORCH_CHECK(z.stride(dims - 1) == 1, "z: channels must be contiguous");
  for (int64_t d = 0; d + 2 < dims; ++d) {
    TORCH_CHECK(z.size(d) == 1 || z.stride(d) == z.stride(d + 1) * z.size(d + 1),
                "z: its leading dimensions must collapse into rows of one stride");
  }
  return dims >= 2 ? z.stride(dims - 2) : z.size(0);
}

// The gate of hadamard_quant (none without z), its inputs checked against x [..., n].
Gate make_gate(const at::Tensor& x, const c10::optional<at::Tensor>& z, double z_scale,
               const c10::optional<at::Tensor>& weight, int64_t group_size, double eps) {
  Gate gate;
  if (!z.has_value()) {
    TORCH_CHECK(!weight.has_value(), "a gate weight needs z");
    return gate;
  }
  const int64_t n = x.size(-1);
  check_cuda(*z, "z");
  TORCH_CHECK(z->scalar_type() == at::kChar, "z must be int8 codes, got ", z->scalar_type());
  TORCH_CHECK(z->sizes() == x.sizes(), "z must have x's shape ", x.sizes(), ", got ", z->sizes());
  TORCH_CHECK(z->get_device() == x.get_device(), "z must be on x's device");
  TORCH_CHECK(group_size > 0 && n % group_size == 0 && n / group_size <= kMaxGateGroups,
              "group_size must divide n = ", text(n), " into at most ", text(kMaxGateGroups),
              " groups, got ", text(group_size));
  check_positive_scale(z_scale, "z_scale");
  TORCH_CHECK(eps >= 0, "eps must be >= 0, got ", eps);
  if (weight.has_value()) {
    check_cuda(*weight, "weight");
    TORCH_CHECK(weight->scalar_type() == at::kFloat && weight->is_contiguous() && weight->dim() == 1 &&
                    weight->size(0) == n && weight->get_device() == x.get_device(),
                "weight must be a contiguous float32 [", text(n), "] on x's device");
    gate.weight = weight->data_ptr<float>();
  }
  gate.z = z->data_ptr<int8_t>();
  gate.z_row_stride = gate_row_stride(*z);
  gate.z_scale = to_fp32(z_scale);
  gate.eps = to_fp32(eps);
  gate.group_size = static_cast<int>(group_size);
  return gate;
}

// x: contiguous [..., n] float with n = m · p (quamba.ops.norm.hadamard.hadamard_factors);
// sign_columns: the m column masks of S_m (bit c of entry a set where S_m[c, a] = -1), which
// must be base_column<m>'s;
// norm: fp32(1 / sqrt(n)). With z (int8 [..., n], rows of contiguous codes), the transform's
// input is Mamba2's gated RMSNorm of x first (Gate). Returns int8 [..., n].
at::Tensor hadamard_quant(const at::Tensor& x, int64_t m, int64_t p, at::IntArrayRef sign_columns,
                          double norm, double out_inv_scale, const c10::optional<at::Tensor>& z,
                          double z_scale, const c10::optional<at::Tensor>& weight,
                          int64_t group_size, double eps) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16 ||
                  x.scalar_type() == at::kFloat,
              "x must be float16, bfloat16 or float32, got ", x.scalar_type());
  TORCH_CHECK(x.is_contiguous(), "x must be contiguous");
  TORCH_CHECK(x.dim() >= 1, "x must be [..., n]");
  TORCH_CHECK(m == 1 || m == 12 || m == 20 || m == 28, "m must be 1, 12, 20 or 28, got ", text(m));
  TORCH_CHECK(p >= 1 && (p & (p - 1)) == 0, "p must be a power of two, got ", text(p));
  const int64_t n = x.size(-1);
  TORCH_CHECK(n == m * p, "x: last dimension ", text(n), " is not m · p = ", text(m * p));
  TORCH_CHECK(n <= max_shared_floats(x), "x: n = ", text(n), " exceeds the ",
              text(max_shared_floats(x)), " values one block can hold in shared memory");
  TORCH_CHECK(static_cast<int64_t>(sign_columns.size()) == m, "sign_columns must have m = ",
              text(m), " entries, got ", text(sign_columns.size()));
  TORCH_CHECK(are_base_columns(m, sign_columns), "sign_columns must be the column masks of S_m, the "
              "m = ", text(m), " base matrix of quamba.ops.norm.hadamard (the kernel has them built in)");
  check_positive_scale(norm, "norm");
  check_positive_scale(out_inv_scale, "out_inv_scale");
  const Gate gate = make_gate(x, z, z_scale, weight, group_size, eps);
  const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(rows < (int64_t{1} << 31), "x has too many rows");
  const c10::cuda::CUDAGuard guard(x.device());

  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  if (rows == 0 || n == 0) return q;
  const float norm32 = to_fp32(norm), inv32 = to_fp32(out_inv_scale);
  switch (x.scalar_type()) {
    case at::kHalf:
      dispatch_base_order<__half>(m, x, gate, q, rows, n, p, norm32, inv32);
      break;
    case at::kBFloat16:
      dispatch_base_order<__nv_bfloat16>(m, x, gate, q, rows, n, p, norm32, inv32);
      break;
    default:
      dispatch_base_order<float>(m, x, gate, q, rows, n, p, norm32, inv32);
      break;
  }
  return q;
}

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "hadamard_quant(Tensor x, int m, int p, int[] sign_columns, float norm, "
      "float out_inv_scale, Tensor? z=None, float z_scale=1.0, Tensor? weight=None, "
      "int group_size=0, float eps=0.0) -> Tensor");
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) { m.impl("hadamard_quant", &quamba_ssm::hadamard_quant); }
