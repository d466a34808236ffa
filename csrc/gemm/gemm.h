// W8A8 GEMM / GEMV launchers: out[m, n] = epilogue(sum_k x[m, k] * w[n, k]).
//
// x is int8 [M, K] and w int8 [N, K], both K-contiguous (w is the column-major B operand); x's rows
// start x_stride bytes apart: K for the mma.sync GEMM, a multiple of 16 >= K for the others (which
// read a column slice such as dt_low in place). The int32 accumulator is exact. The epilogue follows
// quamba/ops/quant.py: fp32(acc) * multiplier (one number, or one per output channel n), then
// either round-half-even and saturate to [-127, 127] for an int8 output, or + bias (fp32, optional)
// and a round-to-nearest cast for a float output. Inputs are checked by the op (w8a8_linear.cpp)
// before any launcher runs.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

#include "kernel_image.h"

namespace quamba::gemm {

enum class OutType { kInt8, kFloat16, kBFloat16, kFloat32 };

struct GemmArgs {
  const int8_t* x;
  const int8_t* w;
  void* out;  // [M, N] row-major, of out_type
  int M, N, K;
  int x_stride;  // bytes from one row of x to the next
  OutType out_type;
  float multiplier;                     // used when multiplier_per_channel is null
  const float* multiplier_per_channel;  // [N] or null
  const float* bias;                    // [N] or null; float outputs only
  cudaStream_t stream;
};

// Decode GEMV: M <= kGemvMaxM. rows (1, 2 or 4 weight rows per warp with dp4a, 8 with tensor
// cores) and splits (1, 2 or 4 warps sharing one row group's K range); 0 picks them from the shape.
constexpr int kGemvMaxM = 8;
void launch_gemv(const GemmArgs& args, int rows = 0, int splits = 0);

// Tensor-core GEMM with mma.sync (sm_80 and newer): any M, N; K % 16 == 0.
void launch_gemm_mma(const GemmArgs& args);

// GEMM for a few rows of x on compute capability 9.0 and newer (M <= kSkinnyMaxM; the weight rows
// are the MMA's wide dimension, K is split over a thread-block cluster). It reads x's rows in place
// like the GEMV. The plan: warp_tiles (1 or 2 m16 tiles of weight rows per warp), splits (1 to 16)
// and x_rows (16, 32 or 64 rows of x a block; M above it takes more blocks), each chosen from the
// shape when 0. It launches with programmatic dependence and loads its first weights before
// waiting for the kernel before it, unless weight_is_constant is false (a weight that kernel
// wrote). gemm_skinny_can_run: the device has clusters and K fits the plan.
constexpr int kSkinnyMaxM = 64;
struct SkinnyPlan {
  int warp_tiles = 0, splits = 0, x_rows = 0;
};
bool gemm_skinny_can_run(int M, int K);
void launch_gemm_skinny(const GemmArgs& args, const SkinnyPlan& plan = {}, bool weight_is_constant = true);
// The same kernel on a 4-bit weight (args.w: the packed uint8 [N, K / 2] of gemm4/gemm4.h) and its
// int8 group multipliers [N, K / group_size], with no expanded weight: group_size % 128 == 0, or
// one group of K <= 128 codes (w4a8_skinny_can_run). A block takes at most 32 rows of x.
bool w4a8_skinny_can_run(int M, int K, int group_size);
void launch_w4a8_skinny(const GemmArgs& args, const int8_t* group_multiplier, int group_size,
                        const SkinnyPlan& plan = {});

// CUTLASS 3.x wgmma GEMM for sm_90a: int8/fp16/bf16 out; needs 16-byte aligned rows of out.
// config is in 0..kSm90Configs-1 (listed in gemm_sm90.cuh); -1 picks one from the shape.
constexpr int kSm90Configs = 8;
bool gemm_sm90_compiled();
int gemm_sm90_num_configs();
void launch_gemm_sm90(const GemmArgs& args, int config = -1);

// Whether the wgmma GEMM, computed swapped (gemm_sm90.cuh's configuration 7), beats the skinny
// GEMM on M rows of x: 9-64 rows and N > 256 (benchmarks/RESULTS.md; graph replays on an H100,
// Mamba-2.8B at 9 / 16 rows, µs: in_proj 13.5 / 13.7 against 14.9 / 15.3, out_proj 8.1 / 7.9
// against 8.7 / 8.9, dt_proj 3.2 / 3.3 against 3.7 / 3.9; W8A8 at batch 16 3.00 -> 2.59 ms a
// step). The skinny GEMM keeps narrow N (x_proj 4.5 against 6.6 at 16 rows). At 8 rows and fewer
// the GEMV stays: swapped at 8 out_proj alone was faster (8.1 against 9.3 µs) but the step slower
// (2.39 against 2.32 ms), as the GEMV streams its weight before the kernel before it ends.
constexpr int kSwappedMinM = 9;
inline bool swapped_sm90_preferred(int M, int N) { return M >= kSwappedMinM && M <= kSkinnyMaxM && N > 256; }

using quamba::check_kernel_image;  // kernel_image.h

}  // namespace quamba::gemm
