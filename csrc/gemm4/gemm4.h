// W4A8 and W4A16 linear launchers (4-bit weights, format of quamba/ops/quant4.py).
//
// The weight is uint8 [N, K/2]: two 4-bit two's-complement codes per byte along K, the even k in
// the low nibble. Groups of G consecutive input channels share a scale: G % 32 == 0, K % G == 0
// (one group of G = K when K <= 128), so a 16-byte chunk of a packed row (32 codes) never
// straddles two groups.
//
//   W4A8:  acc[m, n] = sum_g group_multiplier[n, g] * sum_{k in g} x[m, k] * code[n, k]   (int32,
//          exact for any int8 multiplier), then the W8A8 epilogue of gemm/epilogue.cuh (fp32(acc) *
//          multiplier per channel; int8 by round-half-even + saturation, or a float cast).
//   W4A16: y[m, n] = sum_g fp32(scale[n, g]) * sum_{k in g} x[m, k] * code[n, k], x fp16/bf16,
//          fp32 accumulation, cast to the output type.
//
// Inputs are checked by the ops (linear4.cpp) before any launcher runs.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "gemm/gemm.h"

namespace quamba::gemm4 {

using gemm::OutType;

constexpr int kGemvMaxM = 8;
constexpr int kCodesPerChunk = 32;  // one 16-byte load of a packed row

enum class ActType { kFloat16, kBFloat16 };

struct W4A8Args {
  const int8_t* x;                // [M, K]
  const uint8_t* w;               // [N, K / 2]
  const int8_t* group_multiplier; // [N, K / G]
  void* out;                      // [M, N] of out_type
  int M, N, K, group_size;
  OutType out_type;
  float multiplier;                     // used when multiplier_per_channel is null
  const float* multiplier_per_channel;  // [N] or null
  cudaStream_t stream;
};

struct W4A16Args {
  const void* x;         // [M, K] of x_type
  const uint8_t* w;      // [N, K / 2]
  const void* scales;    // fp16 [N, K / G]
  void* out;             // [M, N] of out_type (float16, bfloat16 or float32)
  int M, N, K, group_size;
  ActType x_type;
  OutType out_type;
  cudaStream_t stream;
};

// Decode GEMVs (M <= kGemvMaxM). `rows` weight rows per warp: 4 on CUDA cores (W4A8: dp4a;
// W4A16: fp32 fma, M = 1) or 16 on tensor cores (W4A8: mma.sync m16n8k32; W4A16: m16n8k16, 16
// or 64 rows chosen from N); `splits` (1, 2, 4; on tensor cores with G % 128 == 0 also 8 and 16, a
// block per tile) warps sharing a row group's K range; `x_loads` how the tensor-core GEMV reads x:
// each lane its own activations (kPerLane) or each warp a step's x in coalesced loads handed out
// through shared memory (kShared, G % 128 == 0); 0 / kAuto picks each from the shape.
enum class XLoads { kAuto = 0, kPerLane = 1, kShared = 2 };
void launch_w4a8_gemv(const W4A8Args& args, int rows = 0, int splits = 0, XLoads x_loads = XLoads::kAuto);
void launch_w4a16_gemv(const W4A16Args& args, int rows = 0, int splits = 0, XLoads x_loads = XLoads::kAuto);

// The tiled W4A8 GEMM on the packed weight for decode at 9-64 rows (w4a8_tiled.cu; compute
// capability 9.0, group_size % 128 == 0 or one group of K <= 128): exact for any int8 group
// multiplier. splits (1 to 16 blocks of a cluster sharing K) 0 = chosen from the shape.
constexpr int kTiledMinM = 9, kTiledMaxM = 64;
bool w4a8_tiled_can_run(int M, int K, int group_size);
void launch_w4a8_tiled(const W4A8Args& args, int splits = 0);

// Expansion for the prefill GEMMs. W4A8: out int8 [N, K] = code * group_multiplier; a product
// outside [-128, 127] is stored truncated and sets *overflow to 1 (when overflow is not null).
// W4A16: out [N, K] of out_type (float16 or bfloat16) = round(fp32(code) * fp32(scale)).
void launch_w4a8_expand(const uint8_t* w, const int8_t* group_multiplier, int8_t* out, int N, int K,
                        int group_size, int* overflow, cudaStream_t stream);
void launch_w4a16_dequantize(const uint8_t* w, const void* scales, void* out, ActType out_type, int N, int K,
                             int group_size, cudaStream_t stream);

}  // namespace quamba::gemm4
