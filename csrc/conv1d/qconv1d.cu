// Quantized depthwise causal conv1d (+ bias, SiLU): int8 codes in, int8 codes or fp32 out.
// Specification: quamba/ops/conv/qconv1d.py. The int32 accumulation is exact; the fp32 epilogue
// rounds every operation on its own, in the reference's order.
#include <torch/library.h>

#include "../ssm_common/ssm_common.cuh"
#include "conv_epilogue.cuh"
#include "pdl.cuh"

namespace quamba_ssm {
namespace {

constexpr int kThreads = 128;
constexpr int kRun = 16;           // time steps of one thread in the channel-fast layout
constexpr int kTimeRun = 4;        // time steps of one thread in the time-fast layout
constexpr int kTimeFastRows = 8;   // channels of one block in the time-fast layout

// One output value: int8 codes for out_inv (the channel's 1 / out_scale), or fp32.
template <typename Out>
__device__ __forceinline__ void store(Out* out, int64_t offset, float y, float out_inv);
template <>
__device__ __forceinline__ void store<int8_t>(int8_t* out, int64_t offset, float y, float out_inv) {
  out[offset] = quantize_rn(y, out_inv);
}
template <>
__device__ __forceinline__ void store<float>(float* out, int64_t offset, float y, float) {
  out[offset] = y;
}

// Channel-fast layout (stride(1) == 1, the transposed GEMM output): consecutive threads take
// consecutive channels, so every load and store of a warp is one contiguous 32-byte piece. Each
// thread covers kRun time steps and issues all their loads (and the W - 1 before them) at once.
template <int W, typename Out>
__global__ void __launch_bounds__(kThreads)
qconv1d_channel_fast_kernel(const int8_t* __restrict__ x, Strides3 xs, Out* __restrict__ out,
                            Strides3 os, const int8_t* __restrict__ weight, ConvEpilogue ep, int dim,
                            int seqlen) {
  const int d = blockIdx.x * kThreads + threadIdx.x;
  if (d >= dim) return;
  const int t0 = blockIdx.y * kRun;
  const int b = blockIdx.z;
  const int8_t* x_row = x + b * xs.batch + d * xs.dim;
  Out* out_row = out + b * os.batch + d * os.dim;

  const float bias_value = ep.bias_of(d);
  const float multiplier = ep.multiplier_of(d), out_inv = ep.out_inv_of(d);
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
      store(out_row, (t0 + k) * os.time, ep.apply(acc, bias_value, multiplier), out_inv);
    }
  }
}

// Time-fast layout (stride(2) == 1, or any other strides): consecutive threads take consecutive
// runs of kTimeRun time steps of one channel and load their kTimeRun + W - 1 inputs together. A
// block covers kTimeFastRows channels, so that blocks are not too small to be worth their launch.
template <int W, typename Out>
__global__ void __launch_bounds__(kThreads)
qconv1d_time_fast_kernel(const int8_t* __restrict__ x, Strides3 xs, Out* __restrict__ out,
                         Strides3 os, const int8_t* __restrict__ weight, ConvEpilogue ep, int dim,
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
    const float multiplier = ep.multiplier_of(d), out_inv = ep.out_inv_of(d);
#pragma unroll
    for (int k = 0; k < kTimeRun; ++k) {
      if (t0 + k < seqlen) {
        int acc = 0;
#pragma unroll
        for (int j = 0; j < W; ++j) acc += static_cast<int>(weight[d * W + j]) * window[k + j];
        store(out_row, (t0 + k) * os.time, ep.apply(acc, bias_value, multiplier), out_inv);
      }
    }
  }
}

// ---- vectorized int8 paths -------------------------------------------------------------------
// For int8 outputs in layouts that allow vector accesses (vector_layout), every thread moves 8 or
// 16 int8 codes per load and per store, builds each output's 4-tap window with one byte permute,
// takes the integer dot product with one dp4a, and applies the reference's epilogue with the same
// roundings (its int8 codes are the reference's, bit for bit). The scalar kernels above remain
// for fp32 outputs and other layouts.

// The weights of channel d as the 4 bytes of a dp4a operand, oldest tap in byte 4 - W, zero below
// (a width-W filter is a width-4 filter whose first 4 - W taps are zero).
template <int W>
__device__ __forceinline__ int pack_weights(const int8_t* __restrict__ weight, int d) {
  if constexpr (W == 4) {
    return *reinterpret_cast<const int*>(weight + d * 4);  // d · 4: 4-byte aligned
  } else {
    unsigned packed = 0;
#pragma unroll
    for (int k = 0; k < W; ++k) {
      packed |= static_cast<unsigned>(static_cast<uint8_t>(weight[d * W + k])) << (8 * (4 - W + k));
    }
    return static_cast<int>(packed);
  }
}

// quantize_rn's code of y (clamp(rne(y · inv), ±127)) in the low byte of the result: clamping
// before rounding gives the same codes (the bounds are integers), and adding 1.5 · 2^23 rounds a
// value of magnitude ≤ 127 to the nearest integer, ties to even, into the low mantissa bits.
__device__ __forceinline__ unsigned quantize_low_byte(float y, float inv_scale) {
  const float v = fminf(fmaxf(__fmul_rn(y, inv_scale), -kInt8Max), kInt8Max);
  return __float_as_uint(__fadd_rn(v, 12582912.f));
}

// The four codes' low bytes packed into one word, the first in byte 0.
__device__ __forceinline__ unsigned pack_codes(unsigned q0, unsigned q1, unsigned q2, unsigned q3) {
  return __byte_perm(__byte_perm(q0, q1, 0x0040), __byte_perm(q2, q3, 0x0040), 0x5410);
}

// Channel d's multiplier and output inverse scale, held in registers (the compiler otherwise
// reloads them per element).
__device__ __forceinline__ void channel_constants(const ConvEpilogue& ep, int d, float& multiplier,
                                                  float& out_inv) {
  multiplier = ep.multiplier_of(d);
  out_inv = ep.out_inv_of(d);
  asm volatile("" : "+f"(multiplier), "+f"(out_inv));
}

template <bool kSilu>
__device__ __forceinline__ unsigned conv_code(int window, int weights, float bias, float multiplier,
                                              float out_inv) {
  const int acc = __dp4a(window, weights, 0);
  float y = __fadd_rn(__fmul_rn(static_cast<float>(acc), multiplier), bias);
  if (kSilu) y = silu_codes(y);
  return quantize_low_byte(y, out_inv);
}

constexpr int kVecChannels = 8;  // channels of one thread in the channel-fast vector kernel
constexpr int kVecRun = 16;      // its time steps
constexpr int kVecRunsPerBlock = kThreads / 32;
constexpr int kTimeVecThreads = 64;  // threads of a block of the time-fast vector kernel
constexpr int kTimeVecRun = 16;      // time steps of one of its threads

// Channel-fast layout: lane l of a warp takes channels 8·l ... 8·l + 7 (one 8-byte load per time
// step, a warp reads 256 contiguous bytes) and kVecRun consecutive time steps. Channel j's window
// of its last 4 inputs, oldest in byte 0, shifts one byte in per time step. 5 blocks per SM (at
// most 102 registers) hold the Mamba shapes' whole grid at once. kPerChannel: each of the 8
// channels has its own multiplier and output scale (Quamba2's xBC conv), else they share one.
template <int W, bool kSilu, bool kPerChannel>
__global__ void __launch_bounds__(kThreads, 5)
qconv1d_channel_vec_kernel(const int8_t* __restrict__ x, Strides3 xs, int8_t* __restrict__ out,
                           Strides3 os, const int8_t* __restrict__ weight, ConvEpilogue ep, int dim,
                           int seqlen) {
  const int d0 = (blockIdx.x * 32 + threadIdx.x % 32) * kVecChannels;
  const int t0 = (blockIdx.y * kVecRunsPerBlock + threadIdx.x / 32) * kVecRun;
  const int b = blockIdx.z;
  if (d0 >= dim || t0 >= seqlen) return;
  const int8_t* x_base = x + b * xs.batch + d0;
  int8_t* out_base = out + b * os.batch + d0;
  constexpr int kChannelConstants = kPerChannel ? kVecChannels : 1;
  float multiplier[kChannelConstants], out_inv[kChannelConstants];
#pragma unroll
  for (int j = 0; j < kChannelConstants; ++j) channel_constants(ep, d0 + j, multiplier[j], out_inv[j]);

  uint2 inputs[kVecRun + 3];  // time steps t0 - 3 ... t0 + kVecRun - 1, zero outside
#pragma unroll
  for (int k = 0; k < kVecRun + 3; ++k) {
    const int t = t0 - 3 + k;
    inputs[k] = t >= 0 && t < seqlen ? *reinterpret_cast<const uint2*>(x_base + t * xs.time)
                                     : make_uint2(0, 0);
  }
  int weights[kVecChannels];
  float bias[kVecChannels];
  unsigned window[kVecChannels];
#pragma unroll
  for (int j = 0; j < kVecChannels; ++j) {
    weights[j] = pack_weights<W>(weight, d0 + j);
    bias[j] = ep.bias_of(d0 + j);
    window[j] = 0;
  }
#pragma unroll
  for (int k = 0; k < kVecRun + 3; ++k) {
#pragma unroll
    for (int j = 0; j < kVecChannels; ++j) {
      const unsigned word = j < 4 ? inputs[k].x : inputs[k].y;
      window[j] = __byte_perm(window[j], word, 0x0321 | ((4 + j % 4) << 12));
    }
    const int t = t0 - 3 + k;
    if (k >= 3 && t < seqlen) {
      unsigned codes[kVecChannels];
#pragma unroll
      for (int j = 0; j < kVecChannels; ++j) {
        const int c = kPerChannel ? j : 0;
        codes[j] = conv_code<kSilu>(static_cast<int>(window[j]), weights[j], bias[j], multiplier[c],
                                    out_inv[c]);
      }
      *reinterpret_cast<uint2*>(out_base + t * os.time) =
          make_uint2(pack_codes(codes[0], codes[1], codes[2], codes[3]),
                     pack_codes(codes[4], codes[5], codes[6], codes[7]));
    }
  }
}

// Time-fast layout: a thread takes kTimeVecRun consecutive time steps of one channel (one 16-byte
// load, and the 4 bytes before it); output t's window is 4 consecutive input bytes, one byte
// permute of two neighbouring words.
template <int W, bool kSilu>
__global__ void __launch_bounds__(kTimeVecThreads)
qconv1d_time_vec_kernel(const int8_t* __restrict__ x, Strides3 xs, int8_t* __restrict__ out,
                        Strides3 os, const int8_t* __restrict__ weight, ConvEpilogue ep, int seqlen) {
  const int d = blockIdx.x, b = blockIdx.z;
  const int t0 = (blockIdx.y * kTimeVecThreads + threadIdx.x) * kTimeVecRun;
  if (t0 >= seqlen) return;
  const int8_t* x_row = x + b * xs.batch + d * xs.dim;
  const uint4 run = *reinterpret_cast<const uint4*>(x_row + t0);
  const unsigned before = t0 > 0 ? *reinterpret_cast<const unsigned*>(x_row + t0 - 4) : 0u;
  const unsigned words[5] = {before, run.x, run.y, run.z, run.w};  // inputs t0 - 4 ...
  const int weights = pack_weights<W>(weight, d);
  const float bias = ep.bias_of(d);
  float multiplier, out_inv;
  channel_constants(ep, d, multiplier, out_inv);
  unsigned codes[kTimeVecRun];
#pragma unroll
  for (int k = 0; k < kTimeVecRun; ++k) {
    const int first = k + 1;  // byte of the window's oldest input (t0 + k - 3) in words
    const unsigned window =
        first % 4 == 0 ? words[first / 4]
                       : __byte_perm(words[first / 4], words[first / 4 + 1],
                                     (first % 4) | ((first % 4 + 1) << 4) |
                                         ((first % 4 + 2) << 8) | ((first % 4 + 3) << 12));
    codes[k] = conv_code<kSilu>(static_cast<int>(window), weights, bias, multiplier, out_inv);
  }
  uint4 packed;
  packed.x = pack_codes(codes[0], codes[1], codes[2], codes[3]);
  packed.y = pack_codes(codes[4], codes[5], codes[6], codes[7]);
  packed.z = pack_codes(codes[8], codes[9], codes[10], codes[11]);
  packed.w = pack_codes(codes[12], codes[13], codes[14], codes[15]);
  *reinterpret_cast<uint4*>(out + b * os.batch + d * os.dim + t0) = packed;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// Whether x and the int8 output allow the vector kernels: 16-byte aligned rows along the
// stride-1 dimension, of whole 8-channel groups (channel-fast) or 16-step runs (time-fast).
bool vector_layout(const at::Tensor& x, const at::Tensor& out, bool channel_fast) {
  if (!aligned16(x.data_ptr()) || !aligned16(out.data_ptr())) return false;
  const int64_t dim = x.size(1), seqlen = x.size(2);
  if (channel_fast) {
    return dim % kVecChannels == 0 && x.stride(0) % 16 == 0 && x.stride(2) % 16 == 0 &&
           out.stride(0) % 16 == 0 && out.stride(2) % 16 == 0 && out.stride(1) == 1;
  }
  return x.stride(2) == 1 && out.stride(2) == 1 && seqlen % kTimeVecRun == 0 &&
         x.stride(0) % 16 == 0 && x.stride(1) % 16 == 0 && out.stride(0) % 16 == 0 &&
         out.stride(1) % 16 == 0 && dim <= 0x7fffffff;
}

template <int W, bool kSilu>
void launch_vec(const at::Tensor& x, const at::Tensor& weight, ConvEpilogue ep, at::Tensor& out,
                bool channel_fast) {
  const int batch = x.size(0), dim = x.size(1), seqlen = x.size(2);
  const Strides3 xs{x.stride(0), x.stride(1), x.stride(2)};
  const Strides3 os{out.stride(0), out.stride(1), out.stride(2)};
  const cudaStream_t stream = current_stream();
  if (channel_fast) {
    auto kernel = ep.per_channel() ? qconv1d_channel_vec_kernel<W, kSilu, true>
                                   : qconv1d_channel_vec_kernel<W, kSilu, false>;
    check_kernel_image(kernel, "qconv1d");
    const dim3 grid(ceil_div(dim, 32 * kVecChannels), ceil_div(seqlen, kVecRun * kVecRunsPerBlock),
                    batch);
    kernel<<<grid, kThreads, 0, stream>>>(x.data_ptr<int8_t>(), xs, out.data_ptr<int8_t>(), os,
                                          weight.data_ptr<int8_t>(), ep, dim, seqlen);
  } else {
    auto kernel = qconv1d_time_vec_kernel<W, kSilu>;
    check_kernel_image(kernel, "qconv1d");
    const dim3 grid(dim, ceil_div(seqlen, kTimeVecRun * kTimeVecThreads), batch);
    kernel<<<grid, kTimeVecThreads, 0, stream>>>(x.data_ptr<int8_t>(), xs,
                                                 out.data_ptr<int8_t>(), os,
                                                 weight.data_ptr<int8_t>(), ep, seqlen);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <bool kSilu>
void dispatch_vec_width(int width, const at::Tensor& x, const at::Tensor& weight, ConvEpilogue ep,
                        at::Tensor& out, bool channel_fast) {
  switch (width) {
    case 2: return launch_vec<2, kSilu>(x, weight, ep, out, channel_fast);
    case 3: return launch_vec<3, kSilu>(x, weight, ep, out, channel_fast);
    default: return launch_vec<4, kSilu>(x, weight, ep, out, channel_fast);
  }
}

template <int W, typename Out>
void launch_qconv1d(const at::Tensor& x, const at::Tensor& weight, ConvEpilogue ep, at::Tensor& out,
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
void dispatch_width(int width, const at::Tensor& x, const at::Tensor& weight, ConvEpilogue ep,
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

ConvEpilogue make_epilogue(const c10::optional<at::Tensor>& bias, double multiplier,
                       double bias_scale, c10::optional<double> out_inv_scale, bool silu) {
  return ConvEpilogue{to_fp32(multiplier),
                  bias.has_value() ? bias->data_ptr<int8_t>() : nullptr,
                  to_fp32(bias_scale),
                  out_inv_scale.has_value() ? to_fp32(*out_inv_scale) : 0.f,
                  silu,
                  nullptr,
                  nullptr};
}

// A per-channel scale vector: contiguous fp32 [dim] on x's device.
void check_channel_scales(const at::Tensor& scales, const at::Tensor& x, int64_t dim,
                          const char* name) {
  check_same_device(scales, x, name);
  check_dtype(scales, at::kFloat, name);
  check_shape(scales, {dim}, name);
  TORCH_CHECK(scales.is_contiguous(), name, " must be contiguous");
}

// ConvEpilogue of qconv1d_channelwise: per-channel multipliers and output inverse scales.
ConvEpilogue make_channel_epilogue(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                               const at::Tensor& multipliers, double bias_scale,
                               const c10::optional<at::Tensor>& out_inv_scales, bool silu) {
  const int64_t dim = x.size(1);
  check_channel_scales(multipliers, x, dim, "multipliers");
  if (out_inv_scales.has_value()) check_channel_scales(*out_inv_scales, x, dim, "out_inv_scales");
  ConvEpilogue ep = make_epilogue(bias, 1.0, bias_scale, c10::nullopt, silu);
  ep.multipliers = multipliers.data_ptr<float>();
  ep.out_inv_scales = out_inv_scales.has_value() ? out_inv_scales->data_ptr<float>() : nullptr;
  return ep;
}

void check_conv_input(const at::Tensor& x) {
  check_cuda(x, "x");
  check_dtype(x, at::kChar, "x");
  TORCH_CHECK(x.dim() == 3, "x must be [batch, dim, seqlen], got ", text(x.sizes()));
  TORCH_CHECK(x.size(0) <= 65535, "x batch must be at most 65535, got ", text(x.size(0)));
  TORCH_CHECK(x.numel() < (int64_t{1} << 31), "x must have fewer than 2^31 elements");
}

// The conv of a checked x with the epilogue ep; int8 out if int8_out, else fp32. The output keeps
// x's layout family: channel-fast (a transposed [batch, seqlen, dim] tensor, what x_proj reads
// next) when x.stride(1) == 1, else contiguous [batch, dim, seqlen].
at::Tensor run_qconv1d(const at::Tensor& x, const at::Tensor& weight, const ConvEpilogue& ep,
                       bool int8_out) {
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t batch = x.size(0), dim = x.size(1), seqlen = x.size(2);
  const bool channel_fast = x.stride(1) == 1 && x.stride(2) != 1;
  const auto out_type = int8_out ? at::kChar : at::kFloat;
  at::Tensor out =
      channel_fast
          ? at::empty({batch, seqlen, dim}, x.options().dtype(out_type)).transpose(1, 2)
          : at::empty({batch, dim, seqlen}, x.options().dtype(out_type));
  if (x.numel() == 0) return out;
  TORCH_CHECK(seqlen <= int64_t{65535} * kRun, "x seqlen must be at most ", text(65535 * kRun));
  if (out_type == at::kChar && vector_layout(x, out, channel_fast)) {
    if (ep.silu) {
      dispatch_vec_width<true>(weight.size(1), x, weight, ep, out, channel_fast);
    } else {
      dispatch_vec_width<false>(weight.size(1), x, weight, ep, out, channel_fast);
    }
  } else if (out_type == at::kChar) {
    dispatch_width<int8_t>(weight.size(1), x, weight, ep, out, channel_fast);
  } else {
    dispatch_width<float>(weight.size(1), x, weight, ep, out, channel_fast);
  }
  return out;
}

// x: int8 [batch, dim, seqlen] with any strides (see run_qconv1d for the output's layout).
at::Tensor qconv1d(const at::Tensor& x, const at::Tensor& weight,
                   const c10::optional<at::Tensor>& bias, double multiplier, double bias_scale,
                   c10::optional<double> out_inv_scale, bool silu) {
  check_conv_input(x);
  check_conv_params(x, weight, bias, x.size(1), multiplier, bias_scale, out_inv_scale);
  return run_qconv1d(x, weight, make_epilogue(bias, multiplier, bias_scale, out_inv_scale, silu),
                     out_inv_scale.has_value());
}

// qconv1d with one multiplier and one output inverse scale per channel (fp32 [dim] each).
at::Tensor qconv1d_channelwise(const at::Tensor& x, const at::Tensor& weight,
                               const c10::optional<at::Tensor>& bias, const at::Tensor& multipliers,
                               double bias_scale, const c10::optional<at::Tensor>& out_inv_scales,
                               bool silu) {
  check_conv_input(x);
  check_conv_params(x, weight, bias, x.size(1), 1.0, bias_scale, c10::nullopt);
  return run_qconv1d(x, weight,
                     make_channel_epilogue(x, bias, multipliers, bias_scale, out_inv_scales, silu),
                     out_inv_scales.has_value());
}

// ---- decode step ---------------------------------------------------------------------------

// Launched programmatically dependent on the kernel before (in_proj's GEMM, pdl.cuh): a thread
// loads its channel's weights and epilogue constants and brings its conv state into L2 before the
// wait; it reads the state after it (the step before, on the same state, may still be running).
template <int W, typename Out>
__global__ void __launch_bounds__(kThreads)
qconv1d_update_kernel(const int8_t* __restrict__ x, int64_t x_batch_stride, int64_t x_dim_stride,
                      int8_t* __restrict__ state, Out* __restrict__ out,
                      const int8_t* __restrict__ weight, ConvEpilogue ep, int dim, int batch) {
  quamba::pdl_launch_dependents();  // x_proj's GEMV may start loading its weights (pdl.cuh)
  const int index = blockIdx.x * kThreads + threadIdx.x;
  const bool valid = index < batch * dim;
  const int b = valid ? index / dim : 0, d = valid ? index % dim : 0;
  int8_t* s = state + static_cast<int64_t>(index) * (W - 1);  // contiguous [batch, dim, W - 1]
  int window[W], taps[W];
  float bias = 0.f, multiplier = 0.f;
  if (valid) {
    quamba::prefetch_l2(s);
#pragma unroll
    for (int k = 0; k < W; ++k) taps[k] = weight[d * W + k];
    bias = ep.bias_of(d);
    multiplier = ep.multiplier_of(d);
  }
  quamba::pdl_wait();  // every thread waits: the kernel ends only after the one before
  if (!valid) return;
#pragma unroll
  for (int k = 0; k < W - 1; ++k) window[k] = s[k];
  window[W - 1] = x[b * x_batch_stride + d * x_dim_stride];
  int acc = 0;
#pragma unroll
  for (int k = 0; k < W; ++k) acc += taps[k] * window[k];
#pragma unroll
  for (int k = 0; k < W - 1; ++k) s[k] = static_cast<int8_t>(window[k + 1]);
  store(out, index, ep.apply(acc, bias, multiplier), ep.out_inv_of(d));
}

template <int W, typename Out>
void launch_update(const at::Tensor& x, at::Tensor& state, const at::Tensor& weight, ConvEpilogue ep,
                   at::Tensor& out) {
  const int batch = x.size(0), dim = x.size(1);
  auto kernel = qconv1d_update_kernel<W, Out>;
  check_kernel_image(kernel, "qconv1d_update");
  quamba::launch_with_pdl(kernel, ceil_div(int64_t{batch} * dim, kThreads), kThreads, 0,
                          current_stream(), x.data_ptr<int8_t>(), x.stride(0), x.stride(1),
                          state.data_ptr<int8_t>(), out.data_ptr<Out>(),
                          weight.data_ptr<int8_t>(), ep, dim, batch);
}

template <typename Out>
void dispatch_update(int width, const at::Tensor& x, at::Tensor& state, const at::Tensor& weight,
                     ConvEpilogue ep, at::Tensor& out) {
  switch (width) {
    case 2: return launch_update<2, Out>(x, state, weight, ep, out);
    case 3: return launch_update<3, Out>(x, state, weight, ep, out);
    default: return launch_update<4, Out>(x, state, weight, ep, out);
  }
}

void check_update_input(const at::Tensor& x) {
  check_cuda(x, "x");
  check_dtype(x, at::kChar, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [batch, dim], got ", text(x.sizes()));
  TORCH_CHECK(x.numel() < (int64_t{1} << 31), "x must have fewer than 2^31 elements");
}

// One decode step of a checked x with the epilogue ep (see qconv1d_update).
at::Tensor run_qconv1d_update(const at::Tensor& x, at::Tensor& conv_state,
                              const at::Tensor& weight, const ConvEpilogue& ep, bool int8_out) {
  const int64_t batch = x.size(0), dim = x.size(1);
  const int64_t width = weight.size(1);
  check_same_device(conv_state, x, "conv_state");
  check_dtype(conv_state, at::kChar, "conv_state");
  check_shape(conv_state, {batch, dim, width - 1}, "conv_state");
  TORCH_CHECK(conv_state.is_contiguous(), "conv_state must be contiguous");
  const c10::cuda::CUDAGuard guard(x.device());

  const auto out_type = int8_out ? at::kChar : at::kFloat;
  at::Tensor out = at::empty({batch, dim}, x.options().dtype(out_type));
  if (x.numel() == 0) return out;
  if (out_type == at::kChar) {
    dispatch_update<int8_t>(width, x, conv_state, weight, ep, out);
  } else {
    dispatch_update<float>(width, x, conv_state, weight, ep, out);
  }
  return out;
}

// x: int8 [batch, dim] (any strides); conv_state: contiguous int8 [batch, dim, width - 1],
// oldest input first, rolled in place. Returns contiguous [batch, dim].
at::Tensor qconv1d_update(const at::Tensor& x, at::Tensor& conv_state, const at::Tensor& weight,
                          const c10::optional<at::Tensor>& bias, double multiplier,
                          double bias_scale, c10::optional<double> out_inv_scale, bool silu) {
  check_update_input(x);
  check_conv_params(x, weight, bias, x.size(1), multiplier, bias_scale, out_inv_scale);
  return run_qconv1d_update(x, conv_state, weight,
                            make_epilogue(bias, multiplier, bias_scale, out_inv_scale, silu),
                            out_inv_scale.has_value());
}

// qconv1d_update with per-channel multipliers and output inverse scales (fp32 [dim] each).
at::Tensor qconv1d_channelwise_update(const at::Tensor& x, at::Tensor& conv_state,
                                      const at::Tensor& weight,
                                      const c10::optional<at::Tensor>& bias,
                                      const at::Tensor& multipliers, double bias_scale,
                                      const c10::optional<at::Tensor>& out_inv_scales, bool silu) {
  check_update_input(x);
  check_conv_params(x, weight, bias, x.size(1), 1.0, bias_scale, c10::nullopt);
  return run_qconv1d_update(
      x, conv_state, weight,
      make_channel_epilogue(x, bias, multipliers, bias_scale, out_inv_scales, silu),
      out_inv_scales.has_value());
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
  m.def(
      "qconv1d_channelwise(Tensor x, Tensor weight, Tensor? bias, Tensor multipliers, "
      "float bias_scale, Tensor? out_inv_scales, bool silu) -> Tensor");
  m.def(
      "qconv1d_channelwise_update(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, "
      "Tensor multipliers, float bias_scale, Tensor? out_inv_scales, bool silu) -> Tensor");
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) {
  m.impl("qconv1d", &quamba_ssm::qconv1d);
  m.impl("qconv1d_update", &quamba_ssm::qconv1d_update);
  m.impl("qconv1d_channelwise", &quamba_ssm::qconv1d_channelwise);
  m.impl("qconv1d_channelwise_update", &quamba_ssm::qconv1d_channelwise_update);
}
