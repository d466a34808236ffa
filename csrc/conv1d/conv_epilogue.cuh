// The int8 conv's fp32 epilogue on one channel's int32 sum (qconv1d.cu and the fused mixer step,
// csrc/fused_decode/): (acc · multiplier + bias), then SiLU, each operation rounded on its own in
// the reference's order (quamba/ops/conv/qconv1d.py).
#pragma once

#include "../ssm_common/ssm_common.cuh"

namespace quamba_ssm {

struct ConvEpilogue {
  float multiplier;     // x_scale · weight_scale, fp32
  const int8_t* bias;   // [dim] or nullptr
  float bias_scale;
  float out_inv_scale;  // used when the output is int8
  bool silu;
  // Per-channel scales (Quamba2's xBC conv, qconv1d_channelwise): [dim] fp32 replacing
  // multiplier and out_inv_scale where not null.
  const float* multipliers;
  const float* out_inv_scales;

  // The dequantized bias of channel d, or -0.0f (adding it leaves every y unchanged).
  __device__ __forceinline__ float bias_of(int d) const {
    return bias != nullptr ? __fmul_rn(static_cast<float>(bias[d]), bias_scale) : -0.f;
  }
  __device__ __forceinline__ float multiplier_of(int d) const {
    return multipliers != nullptr ? multipliers[d] : multiplier;
  }
  __device__ __forceinline__ float out_inv_of(int d) const {
    return out_inv_scales != nullptr ? out_inv_scales[d] : out_inv_scale;
  }
  bool per_channel() const { return multipliers != nullptr; }

  __device__ __forceinline__ float apply(int acc, float bias_value, float channel_multiplier) const {
    const float y = __fadd_rn(__fmul_rn(static_cast<float>(acc), channel_multiplier), bias_value);
    return silu ? silu_rn(y) : y;
  }
};

}  // namespace quamba_ssm
