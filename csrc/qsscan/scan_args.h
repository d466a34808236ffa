// The arguments of the QSScan kernels (qsscan.cu, qsscan_chunked.cu; the SSM parameters also the
// fused mixer step's): the op's tensors, strides and scales as qsscan() checked them.
#pragma once

#include "../ssm_common/ssm_common.cuh"

namespace quamba_ssm {

// The int8 SSM parameters of a channel's scan or step, with their scales.
struct SsmParams {
  const int8_t* A_log;  // [dim, dstate]
  float A_log_scale;
  const int8_t* D;  // [dim]
  float D_scale;
  const int8_t* dt_bias;  // [dim]
  float dt_bias_scale;

  __device__ __forceinline__ float skip(int d) const { return dequantize(D[d], D_scale); }
  __device__ __forceinline__ float bias(int d) const { return dequantize(dt_bias[d], dt_bias_scale); }
};

// A_log [dim, dstate], D and dt_bias [dim]: contiguous int8 codes with positive scales.
inline void check_ssm_params(const at::Tensor& ref, const at::Tensor& A_log, double A_log_scale,
                             const at::Tensor& D, double D_scale, const at::Tensor& dt_bias,
                             double dt_bias_scale, int64_t dim, int64_t dstate) {
  const std::pair<const at::Tensor*, const char*> params[] = {
      {&A_log, "A_log"}, {&D, "D"}, {&dt_bias, "dt_bias"}};
  for (const auto& [t, name] : params) {
    check_same_device(*t, ref, name);
    check_dtype(*t, at::kChar, name);
    TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
  }
  check_shape(A_log, {dim, dstate}, "A_log");
  check_shape(D, {dim}, "D");
  check_shape(dt_bias, {dim}, "dt_bias");
  check_positive_scale(A_log_scale, "A_log_scale");
  check_positive_scale(D_scale, "D_scale");
  check_positive_scale(dt_bias_scale, "dt_bias_scale");
}

// The int8 SSM parameters and their fp32 scales, for the arguments of either kernel.
inline SsmParams ssm_params(const at::Tensor& A_log, double A_log_scale, const at::Tensor& D,
                            double D_scale, const at::Tensor& dt_bias, double dt_bias_scale) {
  return {A_log.data_ptr<int8_t>(), to_fp32(A_log_scale), D.data_ptr<int8_t>(), to_fp32(D_scale),
          dt_bias.data_ptr<int8_t>(), to_fp32(dt_bias_scale)};
}

inline void check_out_dtype(at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kHalf || out_dtype == at::kBFloat16 || out_dtype == at::kFloat,
              "out_dtype must be float16, bfloat16 or float32, got ", out_dtype);
}

struct ScanArgs {
  FloatSource u, dt, z, B, C;  // z.data == nullptr: no gate
  Strides3 u_st, dt_st, z_st, B_st, C_st;
  float* bc;  // the prepared B, C tiles: [batch, chunks, 2, dstate, chunk length]
  SsmParams params;
  void* y;  // out dtype, [batch, dim, seqlen] with strides y_st
  Strides3 y_st;
  void* state;           // contiguous [batch, dim, dstate]: int8 when state_int8, else fp32
  bool state_int8;
  float state_inv_scale;
  int dim, dstate, seqlen, chunks;
  int staging;  // Staging: how the block moves u, dt, z in and y out
};

// kChannelVec / kTimeVec: u, dt, z are int8 codes and u, dt, z, y all have 16-byte aligned runs
// of 16 codes (16 bytes of y) along the stride-1 dimension (channels / time steps), so the block
// moves them with 16-byte loads and stores; kGeneric: element by element, any dtype and strides.
enum Staging : int { kGeneric = 0, kChannelVec = 1, kTimeVec = 2 };

}  // namespace quamba_ssm
