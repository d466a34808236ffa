// Entry to the CUTLASS sm_90a W8A8 GEMM: checks the device and picks a tile configuration.
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/util/Exception.h>

#include "gemm/gemm.h"

namespace quamba::gemm {

#ifdef QUAMBA_HAS_SM90A
namespace sm90 {
void run_int8(const GemmArgs& args, int config);
void run_fp16(const GemmArgs& args, int config);
void run_bf16(const GemmArgs& args, int config);
void run_stream_k(const GemmArgs& args, int config);  // configurations 2 and 3, any output type
}  // namespace sm90

namespace {

// Chosen by measurement on the H200 and H100 (benchmarks/RESULTS.md). Decode past the GEMV (M up
// to kSmallM rows): the swapped 64x32 tiles of configuration 7 (Mamba-2.8B at M = 32, H200:
// in_proj 11.2 µs against 17.3 for 128x128 stream-K, out_proj 7.3 against 17.1 for 128x128
// pingpong, x_proj 6.4 against 9.5 for 128x64). 128x64 tiles for narrow N (N <= 256). Prefill: for a long K, larger tiles
// where 128x128 ones would make fewer than two full waves (one wave of 128x192) or at least eight
// (256x128, cooperative); else 128x128 pingpong.
constexpr int kSmallM = 64;

int choose_config(int M, int N, int K) {
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t tiles = static_cast<int64_t>((M + 127) / 128) * ((N + 127) / 128);
  if (M <= kSmallM) return 7;
  if (N <= 256) return 1;
  if (K >= 1024 && tiles < 2 * sms) return 4;
  if (K >= 1024 && tiles >= 8 * sms) return 5;
  return 0;
}

}  // namespace

bool gemm_sm90_compiled() { return true; }
int gemm_sm90_num_configs() { return kSm90Configs; }

void launch_gemm_sm90(const GemmArgs& a, int config) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  TORCH_CHECK(prop->major == 9 && prop->minor == 0, "w8a8 GEMM (CUTLASS sm90) runs on compute capability 9.0 only, "
              "this GPU is ", prop->major, ".", prop->minor);
  TORCH_CHECK(a.x_stride >= a.K && a.x_stride % 16 == 0,
              "w8a8 GEMM (CUTLASS sm90): x's rows must start a multiple of 16 bytes apart, at least K");
  if (config < 0) config = choose_config(a.M, a.N, a.K);
  if (config == 2 || config == 3) return sm90::run_stream_k(a, config);
  switch (a.out_type) {
    case OutType::kInt8: sm90::run_int8(a, config); break;
    case OutType::kFloat16: sm90::run_fp16(a, config); break;
    case OutType::kBFloat16: sm90::run_bf16(a, config); break;
    case OutType::kFloat32: TORCH_CHECK(false, "w8a8 GEMM (CUTLASS sm90): out must be int8, float16 or bfloat16");
  }
}

#else

bool gemm_sm90_compiled() { return false; }
int gemm_sm90_num_configs() { return 0; }

void launch_gemm_sm90(const GemmArgs&, int) {
  TORCH_CHECK(false, "w8a8 GEMM (CUTLASS sm90): quamba._C was built without sm_90a; rebuild with "
              "TORCH_CUDA_ARCH_LIST including 9.0a");
}

#endif

}  // namespace quamba::gemm
