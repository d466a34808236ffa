// CUTLASS 3.x W8A8 GEMM for sm_90a (wgmma, TMA, warp-specialized), templated on the output type
// and the tile configuration. The epilogue is an EVT: fp32(acc) * per-column multiplier
// (+ per-column bias) for a float output, or round-half-even and saturation to [-127, 127] for
// int8. A null multiplier/bias pointer broadcasts the scalar null_default instead of a vector.
// Included only by the gemm_sm90_*.cu files, whose code is compiled only when sm_90a is targeted.
#pragma once

// run() launches the kernels with programmatic dependence (../pdl.cuh), so their producer warps
// must wait (griddepcontrol.wait) before touching global memory: CUTLASS_GDC_ENABLED turns those
// waits on in sm_90a device code. A file that defines QUAMBA_SM90_EARLY_RELEASE before including
// this header also gets CUTLASS's early release (CUTLASS_ENABLE_GDC_FOR_SM90): a kernel lets its
// dependents launch once every CTA has finished the mainloop of its last tile, so the small kernel
// after a decode GEMM (conv step, scan step, RMSNorm) is launched and resident during the GEMM's
// epilogue instead of after its exit. The stream-K scheduler's code does not compile with it in
// CUTLASS 4.2 (is_last_tile): configurations 2 and 3 are built without it
// (gemm_sm90_stream_k.cu) and release their dependents when they exit.
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define CUTLASS_GDC_ENABLED
#endif
#ifdef QUAMBA_SM90_EARLY_RELEASE
#define CUTLASS_ENABLE_GDC_FOR_SM90
#endif

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/util/Exception.h>

#include "cute/tensor.hpp"
#include "cutlass/cutlass.h"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/sm90_callbacks_tma_warpspecialized.hpp"
#include "cutlass/gemm/collective/collective_builder.hpp"
#include "cutlass/gemm/device/gemm_universal_adapter.h"
#include "cutlass/gemm/kernel/gemm_universal.hpp"
#include "cutlass/util/packed_stride.hpp"

#include "gemm/gemm.h"

namespace quamba::gemm::sm90 {

using namespace cute;
using cutlass::epilogue::fusion::Sm90AccFetch;
using cutlass::epilogue::fusion::Sm90ColBroadcast;
using cutlass::epilogue::fusion::Sm90Compute;
using cutlass::epilogue::fusion::Sm90EVT;
using cutlass::epilogue::fusion::Sm90RowBroadcast;

// Element-wise compute functions for Sm90Compute (called on Array<float, N> fragments). The _rn
// intrinsics keep the multiply and add unfused, as in the torch reference.
template <class T>
struct ScaleBias {
  CUTLASS_HOST_DEVICE T operator()(T const& acc, T const& mul, T const& bias) const {
    T out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < int(out.size()); ++i) out[i] = __fadd_rn(__fmul_rn(acc[i], mul[i]), bias[i]);
    return out;
  }
};

template <class T>
struct ScaleRequant {
  CUTLASS_HOST_DEVICE T operator()(T const& acc, T const& mul) const {
    T out;
    CUTLASS_PRAGMA_UNROLL
    for (int i = 0; i < int(out.size()); ++i)
      out[i] = fminf(fmaxf(rintf(__fmul_rn(acc[i], mul[i])), -127.f), 127.f);
    return out;
  }
};

// One value per output channel n: a column of out [M, N], or a row of out^T [N, M] where the
// GEMM is computed swapped (kSwapAB below).
template <class TileShape, bool kSwapAB>
using ChannelVector = cute::conditional_t<kSwapAB, Sm90ColBroadcast<0, TileShape, float>,
                                          Sm90RowBroadcast<0, TileShape, float>>;

template <class ElementOut, class Channels>
using Fusion = cute::conditional_t<
    cute::is_same_v<ElementOut, int8_t>,
    Sm90EVT<Sm90Compute<ScaleRequant, int8_t, float, cutlass::FloatRoundStyle::round_to_nearest>,
            Sm90AccFetch, Channels>,
    Sm90EVT<Sm90Compute<ScaleBias, ElementOut, float, cutlass::FloatRoundStyle::round_to_nearest>,
            Sm90AccFetch, Channels, Channels>>;

// kSwapAB computes out^T = w · x^T: the weight's N rows are the MMA's M side (64 or 128 a tile)
// and x's few rows its N side (16 to 256), so a decode step's M of 9–64 rows does not fill
// 128-row tiles mostly with padding. w [N, K] and x [M, K] are then A row-major and B
// column-major, as x and w are unswapped, and out [M, N] row-major is D [N, M] column-major.
template <class ElementOut, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule,
          class TileScheduler = void, bool kSwapAB = false>
struct Config {
  static constexpr bool kSwap = kSwapAB;
  static constexpr int kAlignOut = 16 / sizeof(ElementOut);
  using LayoutOut = cute::conditional_t<kSwapAB, cutlass::layout::ColumnMajor, cutlass::layout::RowMajor>;

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, int32_t, float,
      void, LayoutOut, kAlignOut,  // no C operand
      ElementOut, LayoutOut, kAlignOut,
      EpilogueSchedule, Fusion<ElementOut, ChannelVector<TileShape, kSwapAB>>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      int8_t, cutlass::layout::RowMajor, 16,     // x [M, K] (swapped: w [N, K])
      int8_t, cutlass::layout::ColumnMajor, 16,  // w [N, K] is B [K, N] column-major (swapped: x)
      int32_t, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue, TileScheduler>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

// Children first, then the node: {acc, multiplier[, bias], compute}.
template <class C, class ElementOut>
typename C::CollectiveEpilogue::FusionCallbacks::Arguments fusion_arguments(const GemmArgs& a) {
  if constexpr (cute::is_same_v<ElementOut, int8_t>) {
    return {{}, {a.multiplier_per_channel, a.multiplier}, {}};
  } else {
    return {{}, {a.multiplier_per_channel, a.multiplier}, {a.bias, 0.f}, {}};
  }
}

inline void check_status(cutlass::Status status, const char* what) {
  TORCH_CHECK(status == cutlass::Status::kSuccess, "w8a8 GEMM (CUTLASS sm90): ", what, " failed: ",
              cutlassGetStatusString(status));
}

template <class C, class ElementOut>
void run(const GemmArgs& a) {
  using Gemm = typename C::Gemm;
  using Kernel = typename C::Kernel;
  // The GEMM's M and N sides, and its A and B operands (x and w, or w and x where swapped).
  const int gemm_m = C::kSwap ? a.N : a.M, gemm_n = C::kSwap ? a.M : a.N;
  const int8_t* operand_a = C::kSwap ? a.w : a.x;
  const int8_t* operand_b = C::kSwap ? a.x : a.w;
  auto stride_a = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(gemm_m, a.K, 1));
  auto stride_b = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(gemm_n, a.K, 1));
  const auto stride_c = cutlass::make_cute_packed_stride(typename Kernel::StrideC{}, make_shape(gemm_m, gemm_n, 1));
  const auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(gemm_m, gemm_n, 1));
  // x's rows where they are (a column slice of a wider tensor too): TMA takes their stride.
  if constexpr (C::kSwap) {
    get<0>(stride_b) = a.x_stride;
  } else {
    get<0>(stride_a) = a.x_stride;
  }

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = c10::cuda::current_device();
  hw_info.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {gemm_m, gemm_n, a.K, 1},
      {operand_a, stride_a, operand_b, stride_b},
      {fusion_arguments<C, ElementOut>(a), nullptr, stride_c, static_cast<ElementOut*>(a.out), stride_d},
      hw_info};

  Gemm gemm;
  check_status(gemm.can_implement(args), "can_implement");
  // Stream-K keeps partial accumulators of the tiles it splits along K in a workspace.
  const size_t workspace_bytes = Gemm::get_workspace_size(args);
  at::Tensor workspace;
  if (workspace_bytes > 0)
    workspace = at::empty({static_cast<int64_t>(workspace_bytes)},
                          at::TensorOptions().dtype(at::kByte).device(at::kCUDA, hw_info.device_id));
  check_status(gemm.initialize(args, workspace_bytes ? workspace.data_ptr() : nullptr, a.stream), "initialize");
  check_status(gemm.run(a.stream, /*cuda_adapter=*/nullptr, /*launch_with_pdl=*/true), "run");
}

}  // namespace quamba::gemm::sm90

namespace quamba::gemm::sm90 {

using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingpongEpilogue = cutlass::epilogue::TmaWarpSpecialized;
using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CooperativeEpilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
using StreamK = cutlass::gemm::StreamKScheduler;

// The configurations the dispatcher (gemm_sm90.cu) chooses from (kSm90Configs of them).
// 0: many tiles (method.md: 2x fp16 on the H200 at 2048x10240x2560).
// 1: narrow N (x_proj, N = 80..192): twice the CTAs of 0 along N.
// 2, 3: as 0 and 1 with stream-K, which splits K across SMs when there are too few tiles to fill
//    every SM (x_proj, or out_proj at M = 1024: 160 tiles on 132 SMs).
// 4: 128x192 tiles, fewer and larger: out_proj at M = 1024 fits one wave (112 tiles).
// 5: 256x128 tiles, cooperative: many waves of a long K (out_proj at M = 8192: 145.7 against
//    163.8 us for config 0 on the H100; at M = 2048, 2.4 waves of 128x128 tiles, it was slower).
// 6, 7: swapped (w · x^T, Config's kSwapAB) for decode's 9-64 rows of x: 64 weight rows by 64 or
//    32 rows of x, pingpong. 7 is the fastest of the W8A8 GEMMs at 9-64 rows where N > 256
//    (H200, Mamba-2.8B's in_proj at 64 rows: 11.0 µs, against 17.5 for the skinny GEMM and 14.7
//    for config 2); 128-row tiles with stream-K, a cluster of two and K tiles of 256 were slower.
// The data-parallel configurations (all but 2 and 3), built with the early release.
template <class ElementOut>
void run_tiled_config(const GemmArgs& a, int config) {
  switch (config) {
    case 0: run<Config<ElementOut, Shape<_128, _128, _128>, Shape<_2, _1, _1>, Pingpong, PingpongEpilogue>, ElementOut>(a); break;
    case 1: run<Config<ElementOut, Shape<_128, _64, _128>, Shape<_2, _1, _1>, Pingpong, PingpongEpilogue>, ElementOut>(a); break;
    case 4: run<Config<ElementOut, Shape<_128, _192, _128>, Shape<_2, _1, _1>, Cooperative, CooperativeEpilogue>, ElementOut>(a); break;
    case 5: run<Config<ElementOut, Shape<_256, _128, _128>, Shape<_2, _1, _1>, Cooperative, CooperativeEpilogue>, ElementOut>(a); break;
    case 6: run<Config<ElementOut, Shape<_64, _64, _128>, Shape<_1, _1, _1>, Pingpong, PingpongEpilogue, void, true>, ElementOut>(a); break;
    case 7: run<Config<ElementOut, Shape<_64, _32, _128>, Shape<_1, _1, _1>, Pingpong, PingpongEpilogue, void, true>, ElementOut>(a); break;
    default: TORCH_CHECK(false, "w8a8 GEMM (CUTLASS sm90): config must be in 0..", kSm90Configs - 1, ", got ", config);
  }
}

// The stream-K configurations 2 and 3, built without it.
template <class ElementOut>
void run_stream_k_config(const GemmArgs& a, int config) {
  switch (config) {
    case 2: run<Config<ElementOut, Shape<_128, _128, _128>, Shape<_1, _1, _1>, Cooperative, CooperativeEpilogue, StreamK>, ElementOut>(a); break;
    case 3: run<Config<ElementOut, Shape<_128, _64, _128>, Shape<_1, _1, _1>, Cooperative, CooperativeEpilogue, StreamK>, ElementOut>(a); break;
    default: TORCH_CHECK(false, "w8a8 GEMM (CUTLASS sm90): configuration ", config, " is not stream-K");
  }
}

}  // namespace quamba::gemm::sm90
