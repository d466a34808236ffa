// CUTLASS sm_90a W8A8 GEMM instances (all but stream-K) with bf16 output (one file per output type: they build in parallel).
#ifdef QUAMBA_HAS_SM90A
#define QUAMBA_SM90_EARLY_RELEASE
#include "gemm/gemm_sm90.cuh"

namespace quamba::gemm::sm90 {

void run_bf16(const GemmArgs& args, int config) { run_tiled_config<cutlass::bfloat16_t>(args, config); }

}  // namespace quamba::gemm::sm90
#endif
