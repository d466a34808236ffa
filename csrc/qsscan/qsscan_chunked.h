// The chunked QSScan prefill (qsscan_chunked.cu): launch configuration 2 of torch.ops.quamba.qsscan.
#pragma once

#include "scan_args.h"

namespace quamba_ssm {

// How the chunked scan splits the work of one call, beside its ScanArgs (of which it reads the
// tensors, strides, scales and sizes; not chunks, bc or staging, which are configs 0 and 1's).
struct ChunkPlan {
  int batch;
  // u, dt and z (when given) are int8 codes whose channels are contiguous, in 16-byte aligned
  // runs of 16 (channel-last views of the GEMM outputs, as the mixer passes them).
  bool channel_vec;
  // B and C are int8 codes whose dstate values of a step are contiguous, 16-byte aligned.
  bool state_vec;
  // Filled by the launcher: the chunk length (a multiple of the staging window), the chunk count,
  // the groups of 32 channels, and per (sequence, group, chunk) the chunk's end state from zero
  // and its decay (local pass), then its start state, and the local pass's arrival counters.
  int chunk_len, chunks, groups;
  float* chunk_states;
  float* chunk_decays;
  int* arrivals;
};

// Runs the chunked scan (chunk_len 0: chosen for the GPU's size, else rounded up to the staging
// window). method: a Discretization; out_dtype: the type of y.
void launch_chunked_scan(const ScanArgs& args, ChunkPlan plan, const at::Tensor& u,
                         int64_t chunk_len, Discretization method, at::ScalarType out_dtype);

}  // namespace quamba_ssm
