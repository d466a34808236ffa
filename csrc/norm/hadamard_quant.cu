// Online Hadamard transform fused with int8 quantization. Specification:
// quamba/ops/qhadamard.py, with the factor order of quamba/ops/hadamard.py: n = m · p,
// (x @ H_n).view(m, p) = S_mᵀ @ (x.view(m, p) @ W_p) / sqrt(n). The Walsh–Hadamard butterflies
// run in the reference's order (bit-identical); the m × m signed sums then run in order of the
// block index, which BLAS may not: int8 outputs agree to one step.
#include <torch/library.h>

#include <vector>

#include "../ssm_common/ssm_common.cuh"

namespace quamba_ssm {
namespace {

constexpr int kHadamardThreads = 256;
constexpr int kMaxBaseOrder = 28;

// S_m as ±1.0f, entry [a][c] = S_m[c, a] (the transpose the product applies). Passed by value, so
// the unrolled product reads its signs from the constant bank as FFMA operands.
struct SignColumns {
  float sign[kMaxBaseOrder][kMaxBaseOrder];
};

// In-place unnormalised Walsh–Hadamard transform of every block of p values of buf (n in all):
// stage `half` maps each pair (first, second) = (buf[i], buf[i + half]) to (first + second,
// first - second), half = 1, 2, ..., p / 2, exactly as the reference's _walsh_hadamard.
__device__ void walsh_hadamard_blocks(float* buf, int n, int p) {
  for (int half = 1; half < p; half *= 2) {
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

// One block per row: load into shared memory as fp32, butterflies, then for each position b of
// a block the M outputs out[a·p + b] = Σ_c S[c, a] · buf[c·p + b], scaled by 1/sqrt(n), to int8.
template <int M, typename In>
__global__ void __launch_bounds__(kHadamardThreads)
hadamard_quant_kernel(const In* __restrict__ x, int8_t* __restrict__ q, int n, int p,
                      SignColumns signs, float norm, float out_inv_scale) {
  extern __shared__ float buf[];
  const int64_t row = static_cast<int64_t>(blockIdx.x) * n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) buf[i] = to_float(x[row + i]);
  walsh_hadamard_blocks(buf, n, p);
  for (int b = threadIdx.x; b < p; b += blockDim.x) {
    float v[M];
#pragma unroll
    for (int c = 0; c < M; ++c) v[c] = buf[c * p + b];
#pragma unroll
    for (int a = 0; a < M; ++a) {
      // fmaf(±1, v, sum) rounds exactly as sum ± v.
      float sum = signs.sign[a][0] * v[0];
#pragma unroll
      for (int c = 1; c < M; ++c) sum = fmaf(signs.sign[a][c], v[c], sum);
      q[row + a * p + b] = quantize_rn(__fmul_rn(sum, norm), out_inv_scale);
    }
  }
}

template <int M, typename In>
void launch_hadamard(const at::Tensor& x, at::Tensor& q, int64_t rows, int n, int p,
                     const SignColumns& signs, float norm, float out_inv_scale) {
  auto kernel = hadamard_quant_kernel<M, In>;
  check_kernel_image(kernel, "hadamard_quant");
  const int smem = n * sizeof(float);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<rows, kHadamardThreads, smem, current_stream()>>>(
      static_cast<const In*>(x.data_ptr()), q.data_ptr<int8_t>(), n, p, signs, norm,
      out_inv_scale);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename In>
void dispatch_base_order(int m, const at::Tensor& x, at::Tensor& q, int64_t rows, int n, int p,
                         const SignColumns& signs, float norm, float out_inv_scale) {
  switch (m) {
    case 1: return launch_hadamard<1, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    case 12: return launch_hadamard<12, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    case 20: return launch_hadamard<20, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
    default: return launch_hadamard<28, In>(x, q, rows, n, p, signs, norm, out_inv_scale);
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
