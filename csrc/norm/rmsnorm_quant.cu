// Fused residual add + RMSNorm → int8. Specification: quamba/ops/norm/qnorm.py.
#include <torch/library.h>

#include <algorithm>
#include <initializer_list>
#include <type_traits>

#include "../ssm_common/ssm_common.cuh"
#include "pdl.cuh"

namespace quamba_ssm {
namespace {

constexpr int kNormThreads = 256;
constexpr int kRowValues = 8;          // values a thread of rmsnorm_quant_row_kernel holds
constexpr int kMaxRowThreads = 1024;   // so rows of up to 8192 values

// 1 / RMS of a row from a thread's part of its sum of squares (the block's threads add theirs).
__device__ __forceinline__ float row_rstd(float sum_sq, int dim, float eps) {
  const float mean_sq = __fdiv_rn(block_sum(sum_sq), static_cast<float>(dim));
  return __frsqrt_rn(__fadd_rn(mean_sq, eps));
}

// The int8 code of one normalized value r · rstd (· its weight where there is one).
__device__ __forceinline__ int8_t normalized_code(float r, float rstd, bool weighted, float w,
                                                  float out_inv_scale) {
  float v = __fmul_rn(r, rstd);
  if (weighted) v = __fmul_rn(v, w);
  return quantize_rn(v, out_inv_scale);
}

// One block per row, for any dim and alignment. r = x + residual is formed twice (for the sum of
// squares, then for the output) instead of being kept: the second read hits the cache.
template <typename In, typename Res, typename ResOut, typename W>
__global__ void __launch_bounds__(kNormThreads)
rmsnorm_quant_kernel(const In* __restrict__ x, const Res* __restrict__ residual,
                     const W* __restrict__ weight, float eps, float out_inv_scale,
                     int8_t* __restrict__ q, ResOut* __restrict__ residual_out, int dim) {
  quamba::pdl_launch_dependents();  // the next GEMV may start loading its weights (pdl.cuh)
  quamba::pdl_wait();                // x comes from the kernel before
  const int64_t row = static_cast<int64_t>(blockIdx.x) * dim;
  auto sum_at = [&](int i) {
    const float v = to_float(x[row + i]);
    return residual != nullptr ? __fadd_rn(v, to_float(residual[row + i])) : v;
  };
  float sum_sq = 0.f;
  for (int i = threadIdx.x; i < dim; i += kNormThreads) {
    const float r = sum_at(i);
    residual_out[row + i] = from_float<ResOut>(r);
    sum_sq = fmaf(r, r, sum_sq);
  }
  const float rstd = row_rstd(sum_sq, dim, eps);
  for (int i = threadIdx.x; i < dim; i += kNormThreads) {
    const float w = weight != nullptr ? to_float(weight[i]) : 1.f;
    q[row + i] = normalized_code(sum_at(i), rstd, weight != nullptr, w, out_inv_scale);
  }
}

// One block per row held in registers: thread t takes values 8 t ... 8 t + 7 in one wide load of
// each input and one wide store of each output, so the row is read once and a decode step's
// norm costs one round trip to memory after its wait (dim a multiple of 8, at most 8192; rows
// aligned to the wide accesses). The weight is loaded before the wait: no kernel writes it. Each
// value is computed as rmsnorm_quant_kernel computes it; only the sum of squares adds in another
// order (codes agree to one step, as with the reference).
template <typename In, typename Res, typename ResOut, typename W>
__global__ void __launch_bounds__(kMaxRowThreads)
rmsnorm_quant_row_kernel(const In* __restrict__ x, const Res* __restrict__ residual,
                         const W* __restrict__ weight, float eps, float out_inv_scale,
                         int8_t* __restrict__ q, ResOut* __restrict__ residual_out, int dim) {
  quamba::pdl_launch_dependents();  // the next GEMV may start loading its weights (pdl.cuh)
  const int first = threadIdx.x * kRowValues;
  const bool holds = first < dim;  // the last warp may reach past the row
  float w[kRowValues] = {};
  if (weight != nullptr && holds) load_values<kRowValues>(weight + first, true, w);
  quamba::pdl_wait();  // x comes from the kernel before
  const int64_t at = static_cast<int64_t>(blockIdx.x) * dim + first;
  float r[kRowValues];
  float sum_sq = 0.f;
  if (holds) {
    load_values<kRowValues>(x + at, true, r);
    if (residual != nullptr) {
      float res[kRowValues];
      load_values<kRowValues>(residual + at, true, res);
#pragma unroll
      for (int i = 0; i < kRowValues; ++i) r[i] = __fadd_rn(r[i], res[i]);
    }
    ResOut sums[kRowValues];
#pragma unroll
    for (int i = 0; i < kRowValues; ++i) {
      sums[i] = from_float<ResOut>(r[i]);
      sum_sq = fmaf(r[i], r[i], sum_sq);
    }
    store_row<kRowValues>(residual_out + at, sums);
  }
  const float rstd = row_rstd(sum_sq, dim, eps);
  if (!holds) return;
  int8_t codes[kRowValues];
#pragma unroll
  for (int i = 0; i < kRowValues; ++i) {
    codes[i] = normalized_code(r[i], rstd, weight != nullptr, w[i], out_inv_scale);
  }
  store_row<kRowValues>(q + at, codes);
}

int round_up_to_warp(int64_t threads) { return static_cast<int>((threads + 31) / 32 * 32); }

// Whether rmsnorm_quant_row_kernel takes rows of dim values of these tensors.
bool row_fits(int64_t dim, std::initializer_list<const at::Tensor*> tensors) {
  if (dim % kRowValues != 0 || dim > kRowValues * kMaxRowThreads) return false;
  for (const at::Tensor* t : tensors) {
    const int64_t chunk = kRowValues * t->element_size();
    if (reinterpret_cast<uintptr_t>(t->data_ptr()) % std::min<int64_t>(chunk, 16) != 0) return false;
  }
  return true;
}

template <typename T>
const T* data_or_null(const c10::optional<at::Tensor>& t) {
  return t.has_value() ? static_cast<const T*>(t->data_ptr()) : nullptr;
}

// Float element types as CUDA types, for the dispatch below.
template <typename F>
void visit_float_type(at::ScalarType type, F&& f) {
  switch (type) {
    case at::kHalf: return f(__half{});
    case at::kBFloat16: return f(__nv_bfloat16{});
    default: return f(float{});
  }
}

void check_float_tensor(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_same_device(t, ref, name);
  TORCH_CHECK(t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16 ||
                  t.scalar_type() == at::kFloat,
              name, " must be float16, bfloat16 or float32, got ", t.scalar_type());
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// x: contiguous [..., dim] float; residual: same shape (any float dtype) or None; weight: [dim]
// or None. Returns (q int8 [..., dim], residual_out fp32 or x's dtype).
std::tuple<at::Tensor, at::Tensor> rmsnorm_quant(const at::Tensor& x,
                                                 const c10::optional<at::Tensor>& residual,
                                                 const c10::optional<at::Tensor>& weight,
                                                 double eps, double out_inv_scale,
                                                 bool residual_in_fp32) {
  check_float_tensor(x, x, "x");
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x must be [..., dim] with dim > 0, got ",
              text(x.sizes()));
  const int64_t dim = x.size(-1), rows = x.numel() / dim;
  TORCH_CHECK(rows < (int64_t{1} << 31), "x has too many rows");
  if (residual.has_value()) {
    check_float_tensor(*residual, x, "residual");
    check_shape(*residual, x.sizes(), "residual");
  }
  if (weight.has_value()) {
    check_float_tensor(*weight, x, "weight");
    check_shape(*weight, {dim}, "weight");
  }
  TORCH_CHECK(eps >= 0.0 && std::isfinite(eps), "eps must be finite and non-negative, got ",
              text(eps));
  check_positive_scale(out_inv_scale, "out_inv_scale");
  const c10::cuda::CUDAGuard guard(x.device());

  at::Tensor q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  at::Tensor residual_out =
      at::empty(x.sizes(), x.options().dtype(residual_in_fp32 ? at::kFloat : x.scalar_type()));
  if (rows == 0) return {q, residual_out};
  const bool in_registers = row_fits(dim, {&x, &q, &residual_out}) &&
                            (!residual || row_fits(dim, {&*residual})) &&
                            (!weight || row_fits(dim, {&*weight}));
  const auto res_type = residual.has_value() ? residual->scalar_type() : at::kFloat;
  const auto weight_type = weight.has_value() ? weight->scalar_type() : at::kFloat;
  visit_float_type(x.scalar_type(), [&](auto in_tag) {
    using In = decltype(in_tag);
    visit_float_type(res_type, [&](auto res_tag) {
      using Res = decltype(res_tag);
      visit_float_type(weight_type, [&](auto weight_tag) {
        using W = decltype(weight_tag);
        auto launch = [&](auto* res_out) {
          using ResOut = std::remove_pointer_t<decltype(res_out)>;
          auto kernel = in_registers ? rmsnorm_quant_row_kernel<In, Res, ResOut, W>
                                     : rmsnorm_quant_kernel<In, Res, ResOut, W>;
          check_kernel_image(kernel, "rmsnorm_quant");
          const int threads = in_registers ? round_up_to_warp(dim / kRowValues) : kNormThreads;
          quamba::launch_with_pdl(kernel, rows, threads, 0, current_stream(),
                                  static_cast<const In*>(x.data_ptr()), data_or_null<Res>(residual),
                                  data_or_null<W>(weight), to_fp32(eps), to_fp32(out_inv_scale),
                                  q.data_ptr<int8_t>(), res_out, dim);
        };
        if (residual_in_fp32) {
          launch(residual_out.data_ptr<float>());
        } else {
          launch(static_cast<In*>(residual_out.data_ptr()));
        }
      });
    });
  });
  return {q, residual_out};
}

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "rmsnorm_quant(Tensor x, Tensor? residual, Tensor? weight, float eps, float out_inv_scale, "
      "bool residual_in_fp32) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) { m.impl("rmsnorm_quant", &quamba_ssm::rmsnorm_quant); }
