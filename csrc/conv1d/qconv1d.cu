// Quantized depthwise causal conv1d (+ bias, SiLU): int8 codes in, int8 codes or fp32 out.
// Specification: quamba/ops/qconv1d.py. The int32 accumulation is exact; the fp32 epilogue
// rounds every operation on its own, in the reference's order.
#include <torch/library.h>

#include "../ssm_common/ssm_common.cuh"

namespace quamba_ssm {
namespace {

constexpr int kThreads = 128;
constexpr int kRun = 16;           // time steps of one thread in the channel-fast layout
constexpr int kTimeRun = 4;        // time steps of one thread in the time-fast layout
constexpr int kTimeFastRows = 8;   // channels of one block in the time-fast layout

struct Epilogue {
  float multiplier;     // x_scale · weight_scale, fp32
  const int8_t* bias;   // [dim] or nullptr
  float bias_scale;
  float out_inv_scale;  // used when the output is int8
  bool silu;

  // The dequantized bias of channel d, or -0.0f (adding it leaves every y unchanged).
  __device__ __forceinline__ float bias_of(int d) const {
    return bias != nullptr ? __fmul_rn(static_cast<float>(bias[d]), bias_scale) : -0.f;
  }

  __device__ __forceinline__ float apply(int acc, float bias_value) const {
    const float y = __fadd_rn(__fmul_rn(static_cast<float>(acc), multiplier), bias_value);
    return silu ? silu_rn(y) : y;
  }
};

template <typename Out>
__device__ __forceinline__ void store(Out* out, int64_t offset, float y, const Epilogue& ep);
template <>
__device__ __forceinline__ void store<int8_t>(int8_t* out, int64_t offset, float y,
                                              const Epilogue& ep) {
  out[offset] = quantize_rn(y, ep.out_inv_scale);
}
template <>
__device__ __forceinline__ void store<float>(float* out, int64_t offset, float y,
                                             const Epilogue&) {
  out[offset] = y;
}

// Channel-fast layout (stride(1) == 1, the transposed GEMM output): consecutive threads take
// consecutive channels, so every load and store of a warp is one contiguous 32-byte piece. Each
// thread covers kRun time steps and issues all their loads (and the W - 1 before them) at once.
template <int W, typename Out>
__global__ void __launch_bounds__(kThreads)
qconv1d_channel_fast_kernel(const int8_t* __restrict__ x, Strides3 xs, Out* __restrict__ out,
                            Strides3 os, const int8_t* __restrict__ weight, Epilogue ep, int dim,
                            int seqlen) {
  const int d = blockIdx.x * kThreads + threadIdx.x;
  if (d >= dim) return;
  const int t0 = blockIdx.y * kRun;
  const int b = blockIdx.z;
  const int8_t* x_row = x + b * xs.batch + d * xs.dim;
  Out* out_row = out + b * os.batch + d * os.dim;

  const float bias_value = ep.bias_of(d);
  int w[W];
  int window[kRun + W - 1];  // inputs t0 - (W - 1) ... t0 + kRun - 1, zero outside the sequence
#pragma unroll
  for (int k = 0; k < W; ++k) w[k] = weight[d * W + k];
#pragma unroll
  for (int k = 0; k < kRun + W - 1; ++k) {
    const int t = t0 - (W - 1) + k;
    window[k] = t >= 0 && t < seqlen ? x_row[t * xs.time] : 0;
  }
#pragma unroll
  for (int k = 0; k < kRun; ++k) {
    if (t0 + k < seqlen) {
      int acc = 0;
#pragma unroll
      for (int j = 0; j < W; ++j) acc += w[j] * window[k + j];
      store(out_row, (t0 + k) * os.time, ep.apply(acc, bias_value), ep);
    }
  }
}

// Time-fast layout (stride(2) == 1, or any other strides): consecutive threads take consecutive
// runs of kTimeRun time steps of one channel and load their kTimeRun + W - 1 inputs together. A
// block covers kTimeFastRows channels, so that blocks are not too small to be worth their launch.
template <int W, typename Out>
__global__ void __launch_bounds__(kThreads)
qconv1d_time_fast_kernel(const int8_t* __restrict__ x, Strides3 xs, Out* __restrict__ out,
                         Strides3 os, const int8_t* __restrict__ weight, Epilogue ep, int dim,
                         int seqlen) {
  const int t0 = (blockIdx.x * kThreads + threadIdx.x) * kTimeRun;
  if (t0 >= seqlen) return;
  const int b = blockIdx.z;
#pragma unroll 1
  for (int c = 0; c < kTimeFastRows; ++c) {
    const int d = blockIdx.y * kTimeFastRows + c;
    if (d >= dim) break;
    const int8_t* x_row = x + b * xs.batch + d * xs.dim;
    Out* out_row = out + b * os.batch + d * os.dim;
    int window[kTimeRun + W - 1];
#pragma unroll
    for (int k = 0; k < kTimeRun + W - 1; ++k) {
      const int t = t0 - (W - 1) + k;
      window[k] = t >= 0 && t < seqlen ? x_row[t * xs.time] : 0;
    }
    const float bias_value = ep.bias_of(d);
#pragma unroll
    for (int k = 0; k < kTimeRun; ++k) {
      if (t0 + k < seqlen) {
        int acc = 0;
#pragma unroll
        for (int j = 0; j < W; ++j) acc += static_cast<int>(weight[d * W + j]) * window[k + j];
        store(out_row, (t0 + k) * os.time, ep.apply(acc, bias_value), ep);
      }
    }
  }
}

template <int W, typename Out>
void launch_qconv1d(const at::Tensor& x, const at::Tensor& weight, Epilogue ep, at::Tensor& out,
                    bool channel_fast) {
  const int batch = x.size(0), dim = x.size(1), seqlen = x.size(2);
  const Strides3 xs{x.stride(0), x.stride(1), x.stride(2)};
  const Strides3 os{out.stride(0), out.stride(1), out.stride(2)};
  const cudaStream_t stream = current_stream();
  if (channel_fast) {
    auto kernel = qconv1d_channel_fast_kernel<W, Out>;
    check_kernel_image(kernel, "qconv1d");
    const dim3 grid(ceil_div(dim, kThreads), ceil_div(seqlen, kRun), batch);
    kernel<<<grid, kThreads, 0, stream>>>(x.data_ptr<int8_t>(), xs, out.data_ptr<Out>(), os,
                                          weight.data_ptr<int8_t>(), ep, dim, seqlen);
  } else {
    auto kernel = qconv1d_time_fast_kernel<W, Out>;
    check_kernel_image(kernel, "qconv1d");
    const dim3 grid(ceil_div(seqlen, kThreads * kTimeRun), ceil_div(dim, kTimeFastRows), batch);
    kernel<<<grid, kThreads, 0, stream>>>(x.data_ptr<int8_t>(), xs, out.data_ptr<Out>(), os,
                                          weight.data_ptr<int8_t>(), ep, dim, seqlen);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Out>
void dispatch_width(int width, const at::Tensor& x, const at::Tensor& weight, Epilogue ep,
                    at::Tensor& out, bool channel_fast) {
  switch (width) {
    case 2: return launch_qconv1d<2, Out>(x, weight, ep, out, channel_fast);
    case 3: return launch_qconv1d<3, Out>(x, weight, ep, out, channel_fast);
    default: return launch_qconv1d<4, Out>(x, weight, ep, out, channel_fast);
  }
}

void check_conv_params(const at::Tensor& x, const at::Tensor& weight,
                       const c10::optional<at::Tensor>& bias, int64_t dim, double multiplier,
                       double bias_scale, c10::optional<double> out_inv_scale) {
  check_same_device(weight, x, "weight");
  check_dtype(weight, at::kChar, "weight");
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == dim,
              "weight must have shape [dim, width] with dim = ", text(dim), ", got ",
              text(weight.sizes()));
  TORCH_CHECK(weight.size(1) >= 2 && weight.size(1) <= 4, "weight width must be 2, 3 or 4, got ",
              text(weight.size(1)));
  TORCH_CHECK(weight.is_contiguous(), "weight must be contiguous");
  if (bias.has_value()) {
    check_same_device(*bias, x, "bias");
    check_dtype(*bias, at::kChar, "bias");
    check_shape(*bias, {dim}, "bias");
    TORCH_CHECK(bias->is_contiguous(), "bias must be contiguous");
    check_positive_scale(bias_scale, "bias_scale");
  }
  check_positive_scale(multiplier, "multiplier");
  if (out_inv_scale.has_value()) check_positive_scale(*out_inv_scale, "out_inv_scale");
}

Epilogue make_epilogue(const c10::optional<at::Tensor>& bias, double multiplier,
                       double bias_scale, c10::optional<double> out_inv_scale, bool silu) {
  return Epilogue{to_fp32(multiplier),
                  bias.has_value() ? bias->data_ptr<int8_t>() : nullptr,
                  to_fp32(bias_scale),
                  out_inv_scale.has_value() ? to_fp32(*out_inv_scale) : 0.f,
                  silu};
}

// x: int8 [batch, dim, seqlen] with any strides. The output keeps x's layout family: channel-fast
// (a transposed [batch, seqlen, dim] tensor, what x_proj reads next) when x.stride(1) == 1,
// else contiguous [batch, dim, seqlen].
at::Tensor qconv1d(const at::Tensor& x, const at::Tensor& weight,
                   const c10::optional<at::Tensor>& bias, double multiplier, double bias_scale,
                   c10::optional<double> out_inv_scale, bool silu) {
  check_cuda(x, "x");
  check_dtype(x, at::kChar, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [batch, dim, seqlen], got ", text(x.sizes()));
  const int64_t batch = x.size(0), dim = x.size(1), seqlen = x.size(2);
  TORCH_CHECK(batch <= 65535, "x batch must be at most 65535, got ", text(batch));
  TORCH_CHECK(x.numel() < (int64_t{1} << 31), "x must have fewer than 2^31 elements");
  check_conv_params(x, weight, bias, dim, multiplier, bias_scale, out_inv_scale);
  const c10::cuda::CUDAGuard guard(x.device());

  const bool channel_fast = x.stride(1) == 1 && x.stride(2) != 1;
  const auto out_type = out_inv_scale.has_value() ? at::kChar : at::kFloat;
  at::Tensor out =
      channel_fast
          ? at::empty({batch, seqlen, dim}, x.options().dtype(out_type)).transpose(1, 2)
          : at::empty({batch, dim, seqlen}, x.options().dtype(out_type));
  if (x.numel() == 0) return out;
  TORCH_CHECK(seqlen <= int64_t{65535} * kRun, "x seqlen must be at most ", text(65535 * kRun));
  const Epilogue ep = make_epilogue(bias, multiplier, bias_scale, out_inv_scale, silu);
  if (out_type == at::kChar) {
    dispatch_width<int8_t>(weight.size(1), x, weight, ep, out, channel_fast);
  } else {
    dispatch_width<float>(weight.size(1), x, weight, ep, out, channel_fast);
  }
  return out;
}

// ---- decode step ---------------------------------------------------------------------------

template <int W, typename Out>
__global__ void __launch_bounds__(kThreads)
qconv1d_update_kernel(const int8_t* __restrict__ x, int64_t x_batch_stride, int64_t x_dim_stride,
                      int8_t* __restrict__ state, Out* __restrict__ out,
                      const int8_t* __restrict__ weight, Epilogue ep, int dim, int batch) {
  const int index = blockIdx.x * kThreads + threadIdx.x;
  if (index >= batch * dim) return;
  const int b = index / dim, d = index % dim;
  int8_t* s = state + static_cast<int64_t>(index) * (W - 1);  // contiguous [batch, dim, W - 1]
  int window[W];
#pragma unroll
  for (int k = 0; k < W - 1; ++k) window[k] = s[k];
  window[W - 1] = x[b * x_batch_stride + d * x_dim_stride];
  int acc = 0;
#pragma unroll
  for (int k = 0; k < W; ++k) acc += static_cast<int>(weight[d * W + k]) * window[k];
#pragma unroll
  for (int k = 0; k < W - 1; ++k) s[k] = static_cast<int8_t>(window[k + 1]);
  store(out, index, ep.apply(acc, ep.bias_of(d)), ep);
}

template <int W, typename Out>
void launch_update(const at::Tensor& x, at::Tensor& state, const at::Tensor& weight, Epilogue ep,
                   at::Tensor& out) {
  const int batch = x.size(0), dim = x.size(1);
  auto kernel = qconv1d_update_kernel<W, Out>;
  check_kernel_image(kernel, "qconv1d_update");
  kernel<<<ceil_div(int64_t{batch} * dim, kThreads), kThreads, 0,
           current_stream()>>>(
      x.data_ptr<int8_t>(), x.stride(0), x.stride(1), state.data_ptr<int8_t>(),
      out.data_ptr<Out>(), weight.data_ptr<int8_t>(), ep, dim, batch);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Out>
void dispatch_update(int width, const at::Tensor& x, at::Tensor& state, const at::Tensor& weight,
                     Epilogue ep, at::Tensor& out) {
  switch (width) {
    case 2: return launch_update<2, Out>(x, state, weight, ep, out);
    case 3: return launch_update<3, Out>(x, state, weight, ep, out);
    default: return launch_update<4, Out>(x, state, weight, ep, out);
  }
}

// x: int8 [batch, dim] (any strides); conv_state: contiguous int8 [batch, dim, width - 1],
// oldest input first, rolled in place. Returns contiguous [batch, dim].
at::Tensor qconv1d_update(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias, double multiplier,
                          double bias_scale, c10::optional<double> out_inv_scale, bool silu) {
  check_cuda(x, "x");
  check_dtype(x, at::kChar, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [batch, dim], got ", text(x.sizes()));
  const int64_t batch = x.size(0), dim = x.size(1);
  TORCH_CHECK(batch * dim < (int64_t{1} << 31), "x must have fewer than 2^31 elements");
  check_conv_params(x, weight, bias, dim, multiplier, bias_scale, out_inv_scale);
  const int64_t width = weight.size(1);
  check_same_device(conv_state, x, "conv_state");
  check_dtype(conv_state, at::kChar, "conv_state");
  check_shape(conv_state, {batch, dim, width - 1}, "conv_state");
  TORCH_CHECK(conv_state.is_contiguous(), "conv_state must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());

  const auto out_type = out_inv_scale.has_value() ? at::kChar : at::kFloat;
  at::Tensor out = at::empty({batch, dim}, x.options().dtype(out_type));
  if (x.numel() == 0) return out;
  const Epilogue ep = make_epilogue(bias, multiplier, bias_scale, out_inv_scale, silu);
  if (out_type == at::kChar) {
    dispatch_update<int8_t>(width, x, conv_state, weight, ep, out);
  } else {
    dispatch_update<float>(width, x, conv_state, weight, ep, out);
  }
  return out;
}

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "qconv1d(Tensor x, Tensor weight, Tensor? bias, float multiplier, float bias_scale, "
      "float? out_inv_scale, bool silu) -> Tensor");
  m.def(
      "qconv1d_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, "
      "float multiplier, float bias_scale, float? out_inv_scale, bool silu) -> Tensor");
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) {
  m.impl("qconv1d", &quamba_ssm::qconv1d);
  m.impl("qconv1d_update", &quamba_ssm::qconv1d_update);
}
