// W4A8 prefill GEMM for sm_90a with the 4-bit codes expanded to int8 in registers: CUTLASS's
// mixed-input wgmma mainloop (TMA loads the packed codes and the group multipliers into shared
// memory; each consumer warp converts its A fragment to int8, multiplies it by the group multiplier
// there and issues register-sourced int8 wgmma with int32 accumulation).
//
// The mixed-input mainloop passes the narrow operand through registers as A, so the product is
// computed transposed: D[n, m] = sum_k (code[n, k] * group_multiplier[n, k / G]) * x[m, k], with
// the packed weight [N, K / 2] as A (row-major int4, the even k in the low nibble: CUTLASS's own
// packing of int4b_t), x [M, K] as B (K-major) and D column-major [N, M], which is out [M, N]
// row-major. The group multipliers go in N-major ([K / G, N]); code * multiplier wraps to int8 as
// the global expansion (expand4.cu) stores it, so both paths give the same integers. The epilogue
// is gemm_sm90.cuh's, with the per-channel multiplier broadcast along D's rows.
// Included only by the gemm4_sm90_*.cu files, whose code is compiled only when sm_90a is targeted.
#pragma once

#include "gemm/gemm_sm90.cuh"
#include "gemm4/gemm4.h"

namespace quamba::gemm4::sm90 {

using namespace cute;
using gemm::sm90::ScaleBias;
using gemm::sm90::ScaleRequant;
using cutlass::epilogue::fusion::Sm90AccFetch;
using cutlass::epilogue::fusion::Sm90ColBroadcast;
using cutlass::epilogue::fusion::Sm90Compute;
using cutlass::epilogue::fusion::Sm90EVT;

template <class TileShape>
using RowVector = Sm90ColBroadcast<0, TileShape, float>;  // one value per row of D: per output channel n

template <class ElementOut, class TileShape>
using Fusion = cute::conditional_t<
    cute::is_same_v<ElementOut, int8_t>,
    Sm90EVT<Sm90Compute<ScaleRequant, int8_t, float, cutlass::FloatRoundStyle::round_to_nearest>,
            Sm90AccFetch, RowVector<TileShape>>,
    Sm90EVT<Sm90Compute<ScaleBias, ElementOut, float, cutlass::FloatRoundStyle::round_to_nearest>,
            Sm90AccFetch, RowVector<TileShape>, RowVector<TileShape>>>;

template <class ElementOut, class TileShape, class ClusterShape, class KernelSchedule, class EpilogueSchedule>
struct Config {
  static constexpr int kAlignOut = 16 / sizeof(ElementOut);

  using CollectiveEpilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp, TileShape, ClusterShape,
      cutlass::epilogue::collective::EpilogueTileAuto, int32_t, float,
      void, cutlass::layout::ColumnMajor, kAlignOut,  // no C operand
      ElementOut, cutlass::layout::ColumnMajor, kAlignOut,
      EpilogueSchedule, Fusion<ElementOut, TileShape>>::CollectiveOp;

  using CollectiveMainloop = typename cutlass::gemm::collective::CollectiveBuilder<
      cutlass::arch::Sm90, cutlass::arch::OpClassTensorOp,
      cute::tuple<cutlass::int4b_t, int8_t>, cutlass::layout::RowMajor, 32,  // codes [N, K], multipliers
      int8_t, cutlass::layout::ColumnMajor, 16,                             // x [M, K]
      int32_t, TileShape, ClusterShape,
      cutlass::gemm::collective::StageCountAutoCarveout<
          static_cast<int>(sizeof(typename CollectiveEpilogue::SharedStorage))>,
      KernelSchedule>::CollectiveOp;

  using Kernel = cutlass::gemm::kernel::GemmUniversal<Shape<int, int, int, int>, CollectiveMainloop,
                                                      CollectiveEpilogue>;
  using Gemm = cutlass::gemm::device::GemmUniversalAdapter<Kernel>;
};

template <class C, class ElementOut>
typename C::CollectiveEpilogue::FusionCallbacks::Arguments fusion_arguments(const W4A8Args& a) {
  if constexpr (cute::is_same_v<ElementOut, int8_t>) {
    return {{}, {a.multiplier_per_channel, a.multiplier}, {}};
  } else {
    return {{}, {a.multiplier_per_channel, a.multiplier}, {nullptr, 0.f}, {}};
  }
}

template <class C, class ElementOut>
void run(const W4A8Args& a, const int8_t* multipliers_n_major) {
  using Gemm = typename C::Gemm;
  using Kernel = typename C::Kernel;
  using Mainloop = typename C::CollectiveMainloop;
  const auto stride_w = cutlass::make_cute_packed_stride(typename Kernel::StrideA{}, make_shape(a.N, a.K, 1));
  const auto stride_x = cutlass::make_cute_packed_stride(typename Kernel::StrideB{}, make_shape(a.M, a.K, 1));
  const auto stride_d = cutlass::make_cute_packed_stride(typename Kernel::StrideD{}, make_shape(a.N, a.M, 1));
  const int groups = a.K / a.group_size;
  const typename Mainloop::StrideScale stride_multipliers{_1{}, int64_t{a.N}, int64_t{a.N} * groups};

  cutlass::KernelHardwareInfo hw_info;
  hw_info.device_id = c10::cuda::current_device();
  hw_info.sm_count = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;

  typename Gemm::Arguments args{
      cutlass::gemm::GemmUniversalMode::kGemm,
      {a.N, a.M, a.K, 1},
      {reinterpret_cast<const cutlass::int4b_t*>(a.w), stride_w, a.x, stride_x, multipliers_n_major,
       stride_multipliers, a.group_size},
      {fusion_arguments<C, ElementOut>(a), nullptr, stride_d, static_cast<ElementOut*>(a.out), stride_d},
      hw_info};

  Gemm gemm;
  gemm::sm90::check_status(gemm.can_implement(args), "w4a8 can_implement");
  TORCH_CHECK(Gemm::get_workspace_size(args) == 0, "w4a8 GEMM (CUTLASS sm90): unexpected workspace");
  gemm::sm90::check_status(gemm.initialize(args, nullptr, a.stream), "w4a8 initialize");
  gemm::sm90::check_status(gemm.run(a.stream), "w4a8 run");
}

using Cooperative = cutlass::gemm::KernelTmaWarpSpecializedCooperative;
using CooperativeEpilogue = cutlass::epilogue::TmaWarpSpecializedCooperative;
using Pingpong = cutlass::gemm::KernelTmaWarpSpecializedPingpong;
using PingpongEpilogue = cutlass::epilogue::TmaWarpSpecialized;

template <class ElementOut>
void run_config(const W4A8Args& a, const int8_t* multipliers_n_major, int config) {
  switch (config) {
    case 0: run<Config<ElementOut, Shape<_128, _128, _128>, Shape<_1, _1, _1>, Cooperative, CooperativeEpilogue>, ElementOut>(a, multipliers_n_major); break;
    case 1: run<Config<ElementOut, Shape<_128, _64, _128>, Shape<_1, _1, _1>, Cooperative, CooperativeEpilogue>, ElementOut>(a, multipliers_n_major); break;
    case 2: run<Config<ElementOut, Shape<_128, _64, _128>, Shape<_1, _1, _1>, Pingpong, PingpongEpilogue>, ElementOut>(a, multipliers_n_major); break;
    default: TORCH_CHECK(false, "w4a8 GEMM (CUTLASS sm90, codes expanded in registers): config must be in 0..", kW4A8Sm90Configs - 1, ", got ", config);
  }
}

}  // namespace quamba::gemm4::sm90
