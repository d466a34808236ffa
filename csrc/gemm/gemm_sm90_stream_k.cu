// CUTLASS sm_90a W8A8 GEMM instances of the stream-K configurations 2 and 3, every output type:
// built without the early release of the other instances (gemm_sm90.cuh says why).
#ifdef QUAMBA_HAS_SM90A
#include "gemm/gemm_sm90.cuh"

namespace quamba::gemm::sm90 {

void run_stream_k(const GemmArgs& args, int config) {
  switch (args.out_type) {
    case OutType::kInt8: return run_stream_k_config<int8_t>(args, config);
    case OutType::kFloat16: return run_stream_k_config<cutlass::half_t>(args, config);
    case OutType::kBFloat16: return run_stream_k_config<cutlass::bfloat16_t>(args, config);
    case OutType::kFloat32: TORCH_CHECK(false, "w8a8 GEMM (CUTLASS sm90): out must be int8, float16 or bfloat16");
  }
}

}  // namespace quamba::gemm::sm90
#endif
