// CUTLASS sm_90a W4A8 GEMM instances with bf16 output (one file per output type: they build in parallel).
#ifdef QUAMBA_HAS_SM90A
#include "gemm4/gemm4_sm90.cuh"

namespace quamba::gemm4::sm90 {

void run_bf16(const W4A8Args& args, const int8_t* multipliers_n_major, int config) {
  run_config<cutlass::bfloat16_t>(args, multipliers_n_major, config);
}

}  // namespace quamba::gemm4::sm90
#endif
