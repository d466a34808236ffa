// Entry to the CUTLASS sm_90a W4A8 GEMM with the codes expanded in registers (gemm4_sm90.cuh).
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/util/Exception.h>

#include "gemm4/gemm4.h"

namespace quamba::gemm4 {

#ifdef QUAMBA_HAS_SM90A
namespace sm90 {
void run_int8(const W4A8Args& args, const int8_t* multipliers_n_major, int config);
void run_fp16(const W4A8Args& args, const int8_t* multipliers_n_major, int config);
void run_bf16(const W4A8Args& args, const int8_t* multipliers_n_major, int config);
}  // namespace sm90

bool w4a8_gemm_sm90_compiled() { return true; }

void launch_w4a8_gemm_sm90(const W4A8Args& a, const int8_t* multipliers_n_major, int config) {
  switch (a.out_type) {
    case OutType::kInt8: sm90::run_int8(a, multipliers_n_major, config); break;
    case OutType::kFloat16: sm90::run_fp16(a, multipliers_n_major, config); break;
    case OutType::kBFloat16: sm90::run_bf16(a, multipliers_n_major, config); break;
    case OutType::kFloat32: TORCH_CHECK(false, "w4a8 GEMM (CUTLASS sm90): out must be int8, float16 or bfloat16");
  }
}

#else

bool w4a8_gemm_sm90_compiled() { return false; }

void launch_w4a8_gemm_sm90(const W4A8Args&, const int8_t*, int) {
  TORCH_CHECK(false, "w4a8 GEMM (CUTLASS sm90): quamba._C was built without sm_90a; rebuild with "
              "TORCH_CUDA_ARCH_LIST including 9.0a");
}

#endif

}  // namespace quamba::gemm4
