// Launcher of the tiled W4A8 GEMM (w4a8_tiled.cuh): the tile and the split of K from the shape.
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <algorithm>

#include "gemm4/gemm4.h"
#include "gemm4/w4a8_tiled.cuh"

namespace quamba::gemm4 {
namespace {

using tiled::Tile;

// A split's K range of about 640 codes (5 rounds): measured best for Mamba-2.8B at 64 rows on the
// H100 (the standalone harness of benchmarks/RESULTS.md), in_proj in 4 splits (13.7 us against 16.6
// in 2) and out_proj in 8 (11.2 against 13.1 in 16; clusters of at most 4 made W4A8's batch-64
// step 12% slower); a weight whose tiles would leave SMs idle (x_proj's 192 rows) takes up to 16.
constexpr int kCodesPerSplit = 640;

struct Plan {
  int splits, k_per_split;
};

Plan plan_for(int tiles, int K, int stage_codes, int asked_splits) {
  int splits = asked_splits;
  if (splits == 0) {
    const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
    splits = std::clamp(K / kCodesPerSplit, 1, tiled::kMaxSplits);
    while (splits < tiled::kMaxSplits && tiles * splits < sms) splits = std::min(2 * splits, tiled::kMaxSplits);
  }
  splits = std::min(splits, (K + stage_codes - 1) / stage_codes);
  const int per_split = ((K + splits - 1) / splits + stage_codes - 1) / stage_codes * stage_codes;
  return {(K + per_split - 1) / per_split, per_split};
}

// Dynamic shared memory for a launch of `blocks` blocks: at least the tile's `smem`, and enough
// that an SM holds at most ceil(blocks / SMs) of them. Launched programmatically dependent, the
// GEMM's clusters are placed while the kernel before it still holds SMs, and the block scheduler
// then stacks up to 3 blocks on some SMs while others stay idle. On an H100 (graph replays,
// benchmarks/RESULTS.md) the Hadamard kernel and out_proj at 64 rows (160 blocks) took 19.6 us
// together, against 4.1 and 11.4 alone; with at most 2 blocks an SM 17.0, out_proj alone
// unchanged. A launch that fits one block an SM is held to 2 an SM, not 1: clusters of 16 at one
// block an SM would need 16 idle SMs of one GPC. x_proj at up to 32 rows (48 blocks) is such a
// launch: held to 2 an SM, W4A8 at batch 32 took 2.55-2.58 ms a step against 2.63-2.67 with its
// tile's own size (an H200, same machine; batch 16 and 64 within the runs' spread).
int capped_smem(int smem, int blocks) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  const int per_sm = std::max(2, (blocks + prop->multiProcessorCount - 1) / prop->multiProcessorCount);
  // One block more than per_sm would need 16 bytes beyond the SM's shared memory.
  const size_t share = prop->sharedMemPerMultiprocessor / (per_sm + 1) - prop->reservedSharedMemPerBlock;
  return std::max(smem, static_cast<int>(share) + 16);
}

template <int WR, int NT, int kSub, int kStages, typename OutT>
void launch(const W4A8Args& a, int asked_splits) {
  using T = Tile<WR, NT, kSub, kStages>;
  const auto kernel = tiled::w4a8_tiled_kernel<WR, NT, kSub, kStages, OutT>;
  gemm::check_kernel_image(reinterpret_cast<const void*>(kernel), "tiled W4A8 GEMM");
  const int tiles = (a.N + T::kRows - 1) / T::kRows;
  const Plan p = plan_for(tiles, a.K, T::kStageCodes, asked_splits);
  const int split_groups = (p.k_per_split + a.group_size - 1) / a.group_size + 1;  // a range may straddle one more
  const int smem = capped_smem(T::smem_bytes(split_groups), tiles * p.splits);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (p.splits > 8) C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  const tiled::Problem problem{a.x, a.K, a.w, a.group_multiplier, a.group_size, a.M, a.N, a.K, p.k_per_split};
  const gemm::Epilogue epilogue{a.multiplier, a.multiplier_per_channel, nullptr};
  launch_clusters_with_pdl(kernel, dim3(tiles, p.splits, 1), dim3(1, p.splits, 1), dim3(tiled::kThreads), smem,
                           a.stream, problem, static_cast<OutT*>(a.out), epilogue);
}

// Tiles (in_proj, out_proj: 2 m16 tiles a warp, one 128-code round a stage, 4 stages) or, for a
// weight of at most 256 rows, 1 m16 tile a warp and stages of two rounds, 3 of them: more blocks
// for few rows (x_proj at 64 rows: 5.9 us against 7.7 in the standalone bench).
template <int NT, typename OutT>
void launch_rows(const W4A8Args& a, int splits) {
  if (a.N <= 256) launch<1, NT, 2, 3, OutT>(a, splits);
  else launch<2, NT, 1, 4, OutT>(a, splits);
}

}  // namespace

bool w4a8_tiled_can_run(int M, int K, int group_size) {
  if (M < 1 || M > kTiledMaxM || at::cuda::getCurrentDeviceProperties()->major < 9) return false;
  return group_size % tiled::kSubCodes == 0 || (group_size == K && K <= tiled::kSubCodes);
}

void launch_w4a8_tiled(const W4A8Args& a, int splits) {
  TORCH_CHECK(w4a8_tiled_can_run(a.M, a.K, a.group_size), "tiled W4A8 GEMM: needs a GPU of compute capability 9.0 "
              "or newer, x of 1 to ", kTiledMaxM, " rows and group_size % 128 == 0 or one group of at most 128 codes; "
              "got M = ", a.M, ", K = ", a.K, ", group_size = ", a.group_size);
  TORCH_CHECK(splits >= 0 && splits <= tiled::kMaxSplits, "tiled W4A8 GEMM: splits must be 1 to ", tiled::kMaxSplits,
              " (0: chosen), got ", splits);
  gemm::dispatch_out_type(a.out_type, [&](auto tag) {
    using OutT = decltype(tag);
    if (a.M <= 32) launch_rows<4, OutT>(a, splits);
    else launch_rows<8, OutT>(a, splits);
  });
}

}  // namespace quamba::gemm4
