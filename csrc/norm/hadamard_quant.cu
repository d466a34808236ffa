// Online Hadamard transform fused with int8 quantization. Specification:
// quamba/ops/qhadamard.py, with the factor order of quamba/ops/hadamard.py: n = m · p,
// (x @ H_n).view(m, p) = S_mᵀ @ (x.view(m, p) @ W_p) / sqrt(n). The Walsh–Hadamard butterflies
// run in the reference's order (bit-identical); the m × m signed sums then run in order of the
// block index, which BLAS may not: int8 outputs agree to one step.
// One row is one block's work; at decode (one row per step) the block's latency is the kernel's
// time, so the butterflies below 256 run in registers and warp shuffles, without a barrier per
// stage (2.8B decode: 14.3 µs per call with every stage in shared memory and 256 threads), and
// the row's signed sums are spread over up to 8 blocks. Many rows (prefill) are bound by issue: the
// signed sums are unrolled so that no sign needs a per-thread indexed load, and a shuffle stage is
// one fmaf per value. Torch profiler on an H100, Mamba-2.8B (5120 = 20 · 256, fp16): 4.8 → 3.9 µs
// per decode call, 21.9 → 17.2 µs for 1024 rows and 146.6 → 117.0 µs for 8192 (the bytes' floor
// is 42 µs) before and after these changes.
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "../ssm_common/ssm_common.cuh"
#include "pdl.cuh"

namespace quamba_ssm {
namespace {

constexpr int kMaxBaseOrder = 28;
constexpr int kSegmentValues = 8;  // values per lane in the register stages: segments of 256

// S_m as ±1.0f, entry [a][c] = S_m[c, a] (the transpose the product applies). Passed by value and
// read at unrolled indices, so the signs come from the kernel's constant bank through uniform
// registers, shared by the warp.
struct SignColumns {
  float sign[kMaxBaseOrder][kMaxBaseOrder];
};

// The widest load (16, 8, 4 or 2 bytes) that divides V values of In: load_values' unit.
template <int V, typename In, int kBytes = V * static_cast<int>(sizeof(In))>
using LoadChunk = std::conditional_t<
    kBytes % 16 == 0, uint4,
    std::conditional_t<kBytes % 8 == 0, uint2, std::conditional_t<kBytes % 4 == 0, uint32_t, uint16_t>>>;

// V consecutive values from src as fp32: in LoadChunk loads when src is aligned to them
// (`aligned`: the whole tensor is), else one element at a time.
template <int V, typename In>
__device__ __forceinline__ void load_values(const In* __restrict__ src, bool aligned, float (&v)[V]) {
  using Chunk = LoadChunk<V, In>;
  constexpr int kChunks = V * sizeof(In) / sizeof(Chunk);
  if (aligned) {
    Chunk chunks[kChunks];
#pragma unroll
    for (int i = 0; i < kChunks; ++i) chunks[i] = __ldg(reinterpret_cast<const Chunk*>(src) + i);
    In values[V];
    memcpy(values, chunks, sizeof(values));
#pragma unroll
    for (int r = 0; r < V; ++r) v[r] = to_float(values[r]);
  } else {
#pragma unroll
    for (int r = 0; r < V; ++r) v[r] = to_float(src[r]);
  }
}

// Whether every load_values<V> of x can use its wide loads (the segments start at multiples of V).
template <int V, typename In>
__device__ __forceinline__ bool wide_loads_fit(const In* x) {
  return reinterpret_cast<uintptr_t>(x) % sizeof(LoadChunk<V, In>) == 0;
}

// The Walsh–Hadamard butterflies of the reference (_walsh_hadamard): stage `half` maps each pair
// (first, second) = (v[i], v[i + half]) to (first + second, first - second), for half = 1, 2, ...,
// p / 2. Stages below 32 · V run in registers, a warp holding segments of 32 · V values (V per
// lane, contiguous): in-lane pairs for half < V, then lane pairs through shuffles. The pairing
// and each addition are the reference's, so the result is bit-identical however it is spread.
template <int V, typename In>
__device__ void walsh_hadamard_segments(const In* __restrict__ x, bool aligned, float* buf, int n) {
  constexpr int kSegment = 32 * V;
  const int lane = threadIdx.x % 32;
  for (int segment = threadIdx.x / 32; segment < n / kSegment; segment += blockDim.x / 32) {
    const int base = segment * kSegment + lane * V;
    float v[V];
    load_values<V>(x + base, aligned, v);
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

// The M outputs of position b of a block whose butterflies are in buf, out[a·p + b] =
// Σ_c S[c, a] · buf[c·p + b] scaled by 1/sqrt(n) to int8, for the outputs a = group,
// group + groups, ... of this thread. a and c are unrolled, so no sign is an indexed load (one
// per two FFMAs with a runtime a); fmaf(±1, v, sum) rounds exactly as sum ± v.
template <int M>
__device__ __forceinline__ void signed_sums(const float* buf, int8_t* __restrict__ out, int p, int b,
                                            int group, int groups, const SignColumns& signs,
                                            float norm, float out_inv_scale) {
  float v[M];
#pragma unroll
  for (int c = 0; c < M; ++c) v[c] = buf[c * p + b];
  int next = group;
#pragma unroll
  for (int a = 0; a < M; ++a) {
    if (a != next) continue;
    next += groups;
    float sum = signs.sign[a][0] * v[0];
#pragma unroll
    for (int c = 1; c < M; ++c) sum = fmaf(signs.sign[a][c], v[c], sum);
    out[a * p + b] = quantize_rn(__fmul_rn(sum, norm), out_inv_scale);
  }
}

// One block per row and slice of positions: the butterflies of the whole row (registers, then
// shared memory), then the signed sums of each position b of the slice, the M outputs of a position
// shared out among up to blockDim / (p / slices) threads. At decode a row is split into slices
// (gridDim.y) so that more SMs issue its signed sums; each repeats the row's butterflies, which
// cost less. V = 0: p < 32, every stage in shared memory.
template <int M, int V, typename In>
__global__ void __launch_bounds__(1024)
hadamard_quant_kernel(const In* __restrict__ x, int8_t* __restrict__ q, int n, int p,
                      SignColumns signs, float norm, float out_inv_scale) {
  quamba::pdl_launch_dependents();  // the next GEMV may start loading its weights (pdl.cuh)
  quamba::pdl_wait();                // x comes from the kernel before
  extern __shared__ float buf[];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * n;
  int first_half = 1;
  if constexpr (V > 0) {
    walsh_hadamard_segments<V>(x + row, wide_loads_fit<V>(x), buf, n);
    first_half = 32 * V;
  } else {
    for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = to_float(x[row + i]);
  }
  walsh_hadamard_shared(buf, n, p, first_half);
  const int positions = p / gridDim.y, first_position = blockIdx.y * positions;
  const int groups = max(1, min(M, static_cast<int>(blockDim.x) / positions));
  // Whole warps where a slice has 32 positions or more: a warp's threads share one group.
  const int threads_per_group = min(positions, static_cast<int>(blockDim.x) / groups);
  const int group = threadIdx.x / threads_per_group;
  if (group >= groups) return;
  for (int b = threadIdx.x % threads_per_group; b < positions; b += threads_per_group)
    signed_sums<M>(buf, q + row, p, first_position + b, group, groups, signs, norm, out_inv_scale);
}

// Registers hold segments of 32 · V values: V = p / 32 up to kSegmentValues (0 below p = 32).
int segment_values(int p) { return p < 32 ? 0 : std::min(p / 32, kSegmentValues); }

// Big blocks for few rows (decode: one row is all the work there is), small ones for many.
int threads_for(int64_t rows) {
  return rows < 2 * at::cuda::getCurrentDeviceProperties()->multiProcessorCount ? 1024 : 256;
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
void launch_hadamard(const at::Tensor& x, at::Tensor& q, int64_t rows, int n, int p,
                     const SignColumns& signs, float norm, float out_inv_scale) {
  auto kernel = hadamard_quant_kernel<M, V, In>;
  check_kernel_image(kernel, "hadamard_quant");
  const int smem = n * sizeof(float);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(static_cast<unsigned>(rows), slices_for(rows, p));
  quamba::launch_with_pdl(kernel, grid, threads_for(rows), smem, current_stream(),
                          static_cast<const In*>(x.data_ptr()), q.data_ptr<int8_t>(), n, p, signs,
                          norm, out_inv_scale);
}

template <int M, typename In>
void dispatch_segment(const at::Tensor& x, at::Tensor& q, int64_t rows, int n, int p,
                      const SignColumns& signs, float norm, float out_inv_scale) {
  switch (segment_values(p)) {
    case 0: return launch_hadamard<M, 0, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    case 1: return launch_hadamard<M, 1, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    case 2: return launch_hadamard<M, 2, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    case 4: return launch_hadamard<M, 4, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    default: return launch_hadamard<M, kSegmentValues, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
  }
}

template <typename In>
void dispatch_base_order(int m, const at::Tensor& x, at::Tensor& q, int64_t rows, int n, int p,
                         const SignColumns& signs, float norm, float out_inv_scale) {
  switch (m) {
    case 1: return dispatch_segment<1, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    case 12: return dispatch_segment<12, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    case 20: return dispatch_segment<20, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    default: return dispatch_segment<28, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
  }
}

int max_shared_floats(const at::Tensor& x) {
  int optin = 0;
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, x.get_device()));
  return optin / static_cast<int>(sizeof(float));
}

// x: contiguous [..., n] float with n = m · p (quamba.ops.hadamard.hadamard_factors);
// sign_columns: the m column masks of S_m (bit c of entry a set where S_m[c, a] = -1);
// norm: fp32(1 / sqrt(n)). Returns int8 [..., n].
at::Tensor hadamard_quant(const at::Tensor& x, int64_t m, int64_t p, at::IntArrayRef sign_columns,
                          double norm, double out_inv_scale) {
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
  check_positive_scale(norm, "norm");
  check_positive_scale(out_inv_scale, "out_inv_scale");
  const int64_t rows = x.numel() / std::max<int64_t>(n, 1);
  TORCH_CHECK(rows < (int64_t{1} << 31), "x has too many rows");
  const c10::cuda::CUDAGuard guard(x.device());

  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  if (rows == 0 || n == 0) return q;
  SignColumns signs{};
  for (int64_t a = 0; a < m; ++a) {
    TORCH_CHECK(sign_columns[a] >= 0 && sign_columns[a] < (int64_t{1} << m),
                "sign_columns entries must be masks of m bits");
    for (int64_t c = 0; c < m; ++c) signs.sign[a][c] = (sign_columns[a] >> c & 1) ? -1.f : 1.f;
  }
  const float norm32 = to_fp32(norm), inv32 = to_fp32(out_inv_scale);
  switch (x.scalar_type()) {
    case at::kHalf:
      dispatch_base_order<__half>(m, x, q, rows, n, p, signs, norm32, inv32);
      break;
    case at::kBFloat16:
      dispatch_base_order<__nv_bfloat16>(m, x, q, rows, n, p, signs, norm32, inv32);
      break;
    default:
      dispatch_base_order<float>(m, x, q, rows, n, p, signs, norm32, inv32);
      break;
  }
  return q;
}

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "hadamard_quant(Tensor x, int m, int p, int[] sign_columns, float norm, "
      "float out_inv_scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) { m.impl("hadamard_quant", &quamba_ssm::hadamard_quant); }
