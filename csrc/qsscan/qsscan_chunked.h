// The chunked QSScan prefill (qsscan_chunked.cu): launch configuration 2 of torch.ops.quamba.qsscan.
#pragma once

#include "../ssm_common/ssm_common.cuh"

namespace quamba_ssm {

// What the chunked scan reads and writes; the shapes and strides of the op (qsscan.cu).
struct ChunkedScanArgs {
  FloatSource u, dt, z, B, C;  // z.data == nullptr: no gate
  Strides3 u_st, dt_st, z_st, B_st, C_st;
  const int8_t* A_log;
  float A_log_scale;
  const int8_t* D;
  float D_scale;
  const int8_t* dt_bias;
  float dt_bias_scale;
  void* y;  // out dtype, [batch, dim, seqlen] with strides y_st
  Strides3 y_st;
  void* state;  // contiguous [batch, dim, dstate]: int8 when state_int8, else fp32
  bool state_int8;
  float state_inv_scale;
  int batch, dim, dstate, seqlen;
  // u, dt and z (when given) are int8 codes whose channels are contiguous, in 16-byte aligned
  // runs of 16 (channel-last views of the GEMM outputs, as the mixer passes them).
  bool channel_vec;
  // B and C are int8 codes whose dstate values of a step are contiguous, 16-byte aligned.
  bool state_vec;
  // Filled by the launcher: the chunk length (a multiple of the staging window), the chunk count,
  // and per (sequence, group of 32 channels, chunk) the chunk's end state from zero and its
  // decay (local pass), then its start state, and the local pass's arrival counters.
  int chunk_len, chunks, groups;
  float* chunk_states;
  float* chunk_decays;
  int* arrivals;
};

// Runs the chunked scan (chunk_len 0: chosen for the GPU's size, else rounded up to the staging
// window). method: a Discretization; out_dtype: the type of y.
void launch_chunked_scan(ChunkedScanArgs args, const at::Tensor& u, int64_t chunk_len,
                         Discretization method, at::ScalarType out_dtype);

}  // namespace quamba_ssm
