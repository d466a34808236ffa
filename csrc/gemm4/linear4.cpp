// torch.ops.quamba W4A8 / W4A16 linear ops (4-bit weights, quamba/ops/quant4.py): input checks and
// the choice of kernel.
//
//   w4a8_linear(x, weight_packed, group_multiplier, group_size, multiplier, multiplier_per_channel,
//               out_dtype) -> out
//   w4a8_linear_out(..., out)           the same into a preallocated out
//   w4a8_gemv_out(..., out, rows, splits, x_loads) / w4a8_skinny_out(..., out, warp_tiles, splits, x_rows) /
//   w4a8_tiled_out(..., out, splits) / w4a8_gemm_out(..., out, config)
//                                       one path, for tests and benchmarks
//   w4a8_expand_out(weight_packed, group_multiplier, group_size, out, overflow)
//                                       int8 [N, K] = code * multiplier; sets overflow[0] = 1 when a
//                                       product is outside [-128, 127]
//   w4a16_linear(x, weight_packed, scales, group_size, out_dtype) -> out
//   w4a16_linear_out(..., out), w4a16_gemv_out(..., out, rows, splits, x_loads), w4a16_gemm_out(..., out)
//   w4a16_dequantize_out(weight_packed, scales, group_size, out)
//
// Shapes: x [M, K] (W4A8 int8; W4A16 float16 or bfloat16), contiguous and 16-byte aligned, K a
// positive multiple of 32; weight_packed uint8 [N, K / 2], contiguous, 16-byte aligned;
// group_size a positive multiple of 32 dividing K; group_multiplier int8 [N, K / G]; scales
// float16 [N, K / G]. W4A8 out is int8, float16, bfloat16 or float32 with the fp32 epilogue
// multiplier (quamba.ops.quant.requant_multiplier of x_scale, channel_scale, out_scale) given
// per channel (multiplier_per_channel fp32 [N]) or as one number; W4A16 out is float16, bfloat16
// or float32.
//
// Paths: M <= 8 takes the GEMV (gemv4.cu), exact for any int8 group multiplier. On compute
// capability 9.0 with group_size % 128 == 0 (or one group of K <= 128), M = 9-64 takes the tiled
// GEMM on the packed weight (w4a8_tiled.cu), except a weight of at most 256 rows at 33-64 rows,
// which takes the skinny GEMM on the packed weight (gemm/gemm_skinny.cu); both are exact for any
// multiplier. Otherwise M > 8 expands the weight to a temporary int8 [N, K] (code * multiplier,
// from the caching allocator) and runs the W8A8 GEMM (on compute capability 9.0 the skinny GEMM or,
// at 9-64 rows where N > 256, CUTLASS wgmma as w8a8_linear chooses; CUTLASS wgmma above 64 rows on
// sm_90a; mma.sync elsewhere) with the same epilogue. Where the skinny or the wgmma GEMM runs, both
// launch with programmatic dependence (pdl.cuh), the GEMM reading the weight only after its wait:
// the GEMM's blocks launch while the expansion's last blocks finish (W4A8 out_proj at M = 1024 on
// the H100: 32.5 -> 30.1 us). That expansion is exact only while every |code * multiplier| fits
// int8 (multipliers in 1..18 for codes in -7..7): this op does not check it (that needs a host
// sync); the Python cuda backend (quamba/ops/linear/cuda4.py) checks each weight once with
// w4a8_expand_out's overflow flag and refuses weights that overflow. Expanding the codes in
// registers instead, in CUTLASS's sm90 mixed-input mainloop (int4 codes, int8 group multipliers),
// was exact but 2.3x slower on the H100 (benchmarks/RESULTS.md, fb57a14): its conversion alone
// costs more than this expansion.
// W4A16 with M > 8 dequantizes to a temporary [N, K] weight of x's dtype (fp32(code) * fp32(scale),
// rounded once) and calls cuBLAS (at::mm).
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "gemm/checks.h"
#include "gemm/gemm.h"
#include "gemm4/gemm4.h"

namespace quamba::gemm4 {
namespace {

using gemm::checks::aligned16;
using gemm::checks::check_architecture;
using gemm::checks::check_on_device;
using gemm::checks::check_vector;
using gemm::checks::guard_for;
using gemm::checks::out_type_of;

struct Shape {
  int64_t M, N, K;
};

// x [M, K]: contiguous, 16-byte aligned, K a positive multiple of 32, of one of the dtypes given.
void check_x(const char* op, const at::Tensor& x, std::initializer_list<at::ScalarType> dtypes, const char* names) {
  check_on_device(op, "x", x, x.device());
  bool ok = false;
  for (auto d : dtypes) ok |= x.scalar_type() == d;
  TORCH_CHECK(ok, op, ": x must be ", names, ", got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, op, ": x must be 2-D, got shape ", x.sizes());
  TORCH_CHECK(x.size(1) > 0 && x.size(1) % kCodesPerChunk == 0, op,
              ": x must have a last dimension (K) that is a positive multiple of 32, got ", x.size(1));
  TORCH_CHECK(aligned16(x), op, ": x must start at a 16-byte aligned address");
}

// weight_packed uint8 [N, K / 2] and the group size, for a K that is a positive multiple of 32.
void check_weight(const char* op, const at::Tensor& weight, int64_t K, int64_t group_size, const at::Device& device) {
  check_on_device(op, "weight_packed", weight, device);
  TORCH_CHECK(weight.scalar_type() == at::kByte, op, ": weight_packed must be uint8 (two 4-bit codes per byte), got ",
              weight.scalar_type());
  TORCH_CHECK(weight.dim() == 2 && weight.size(1) == K / 2, op, ": weight_packed must have shape [N, ", K / 2,
              "] (K / 2 bytes per row for K = ", K, "), got ", weight.sizes());
  TORCH_CHECK(weight.size(0) > 0, op, ": weight_packed must have at least one row");
  TORCH_CHECK(aligned16(weight), op, ": weight_packed must start at a 16-byte aligned address");
  TORCH_CHECK(group_size > 0 && group_size % kCodesPerChunk == 0 && K % group_size == 0, op,
              ": group_size must be a positive multiple of 32 that divides K = ", K, ", got ", group_size);
}

// Per-group values [N, K / G] of dtype.
void check_groups(const char* op, const char* name, const at::Tensor& t, at::ScalarType dtype, int64_t N,
                  int64_t groups, const at::Device& device) {
  check_on_device(op, name, t, device);
  TORCH_CHECK(t.scalar_type() == dtype, op, ": ", name, " must be ", dtype, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2 && t.size(0) == N && t.size(1) == groups, op, ": ", name, " must have shape [", N, ", ",
              groups, "] (one per output channel and group), got ", t.sizes());
}

void check_out(const char* op, const at::Tensor& out, int64_t M, int64_t N, const at::Device& device) {
  check_on_device(op, "out", out, device);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N, op, ": out must have shape [", M, ", ", N,
              "], got ", out.sizes());
}

void check_sizes(const char* op, const Shape& s) {
  TORCH_CHECK(s.M < INT32_MAX && s.N < INT32_MAX && s.K < INT32_MAX, op, ": sizes must be below 2^31");
}

W4A8Args make_w4a8_args(const char* op, const at::Tensor& x, const at::Tensor& weight,
                        const at::Tensor& group_multiplier, int64_t group_size, double multiplier,
                        const std::optional<at::Tensor>& multiplier_per_channel, const at::Tensor& out) {
  check_x(op, x, {at::kChar}, "int8");
  const at::Device device = x.device();
  const Shape s{x.size(0), weight.dim() == 2 ? weight.size(0) : 0, x.size(1)};
  check_weight(op, weight, s.K, group_size, device);
  check_groups(op, "group_multiplier", group_multiplier, at::kChar, s.N, s.K / group_size, device);
  if (multiplier_per_channel) check_vector(op, "multiplier_per_channel", *multiplier_per_channel, s.N, device);
  check_out(op, out, s.M, s.N, device);
  const OutType out_type = out_type_of(op, out.scalar_type());
  check_sizes(op, s);
  check_architecture(op);
  return W4A8Args{x.data_ptr<int8_t>(), weight.data_ptr<uint8_t>(), group_multiplier.data_ptr<int8_t>(),
                  out.data_ptr(), static_cast<int>(s.M), static_cast<int>(s.N), static_cast<int>(s.K),
                  static_cast<int>(group_size), out_type, static_cast<float>(multiplier),
                  multiplier_per_channel ? multiplier_per_channel->data_ptr<float>() : nullptr,
                  c10::cuda::getCurrentCUDAStream()};
}

W4A16Args make_w4a16_args(const char* op, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scales,
                          int64_t group_size, const at::Tensor& out) {
  check_x(op, x, {at::kHalf, at::kBFloat16}, "float16 or bfloat16");
  const at::Device device = x.device();
  const Shape s{x.size(0), weight.dim() == 2 ? weight.size(0) : 0, x.size(1)};
  check_weight(op, weight, s.K, group_size, device);
  check_groups(op, "scales", scales, at::kHalf, s.N, s.K / group_size, device);
  check_out(op, out, s.M, s.N, device);
  const OutType out_type = out_type_of(op, out.scalar_type());
  TORCH_CHECK(out_type != OutType::kInt8, op, ": out must be float16, bfloat16 or float32, got ", out.scalar_type());
  check_sizes(op, s);
  check_architecture(op);
  return W4A16Args{x.data_ptr(), weight.data_ptr<uint8_t>(), scales.data_ptr(), out.data_ptr(),
                   static_cast<int>(s.M), static_cast<int>(s.N), static_cast<int>(s.K), static_cast<int>(group_size),
                   x.scalar_type() == at::kHalf ? ActType::kFloat16 : ActType::kBFloat16, out_type,
                   c10::cuda::getCurrentCUDAStream()};
}

// ---- W4A8 ----

// The wgmma kernel stores output rows and loads the epilogue vector with 16-byte accesses.
bool sm90_can_run(const W4A8Args& a, const at::Tensor& out, const std::optional<at::Tensor>& multiplier_per_channel) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  if (!gemm::gemm_sm90_compiled() || prop->major != 9 || prop->minor != 0) return false;
  if (a.out_type == OutType::kFloat32 || (static_cast<int64_t>(a.N) * out.element_size()) % 16 != 0) return false;
  return aligned16(out) && (!multiplier_per_channel || aligned16(*multiplier_per_channel));
}

constexpr int64_t kConfigAuto = -1, kConfigMma = -2;
// Graph replays on a fresh H100 (benchmarks/RESULTS.md), µs, Mamba-2.8B, the tiled GEMM against the
// skinny GEMM on the packed weight and against expansion + CUTLASS (the path before it at 33-64 rows
// where N > 256): in_proj 10.0 / 14.4 at 16 rows, 10.7 / 16.0 at 32, 14.6 / 29.4 / 25.5 at 64;
// out_proj 7.3 / 8.7, 7.8 / 9.8, 10.9 / 18.0 / 15.2; x_proj (192 rows) 4.8 / 5.5, 4.8 / 5.6, but at
// 48 and 64 rows 6.0 / 6.0 and 6.2 / 6.1, so a weight that narrow keeps the skinny GEMM above 32.
constexpr int kNarrowN = 256;
bool tiled_preferred(const W4A8Args& a) {
  return a.M >= kTiledMinM && a.M <= kTiledMaxM && (a.N > kNarrowN || a.M <= 32);
}
// Where the tiled GEMM is not taken, the skinny GEMM on the packed weight beats expansion + the int8
// GEMM up to 32 rows, and at 33-64 for narrow N (x_proj at 64 rows on an H100: 6.1 against 7.1).
bool packed_skinny_preferred(const W4A8Args& a) {
  return a.M <= 32 || !gemm::swapped_sm90_preferred(a.M, a.N);
}

gemm::GemmArgs gemm_args(const W4A8Args& a, const void* weight) {
  return gemm::GemmArgs{a.x, static_cast<const int8_t*>(weight), a.out, a.M, a.N, a.K, a.K, a.out_type,
                        a.multiplier, a.multiplier_per_channel, nullptr, a.stream};
}

// The skinny GEMM on the packed weight where it can take the shape, else an expansion into a
// temporary int8 [N, K] weight, then the W8A8 GEMM.
void run_w4a8_gemm(const W4A8Args& a, const at::Tensor& x, const at::Tensor& out,
                   const std::optional<at::Tensor>& multiplier_per_channel, int64_t config) {
  if (config == kConfigAuto && tiled_preferred(a) && w4a8_tiled_can_run(a.M, a.K, a.group_size))
    return launch_w4a8_tiled(a);
  if (config == kConfigAuto && packed_skinny_preferred(a) && gemm::w4a8_skinny_can_run(a.M, a.K, a.group_size))
    return gemm::launch_w4a8_skinny(gemm_args(a, a.w), a.group_multiplier, a.group_size);
  at::Tensor expanded = at::empty({a.N, a.K}, x.options().dtype(at::kChar));
  launch_w4a8_expand(a.w, a.group_multiplier, expanded.data_ptr<int8_t>(), a.N, a.K, a.group_size, nullptr, a.stream);
  const gemm::GemmArgs g = gemm_args(a, expanded.data_ptr<int8_t>());
  const bool sm90 = sm90_can_run(a, out, multiplier_per_channel);
  if (config == kConfigAuto && gemm::gemm_skinny_can_run(a.M, a.K) &&
      !(sm90 && gemm::swapped_sm90_preferred(a.M, a.N))) {
    gemm::launch_gemm_skinny(g, {}, /*weight_is_constant=*/false);  // the expansion writes it
  } else if (config == kConfigMma || (config == kConfigAuto && !sm90)) {
    gemm::launch_gemm_mma(g);
  } else {
    gemm::launch_gemm_sm90(g, static_cast<int>(config));
  }
}

void w4a8_linear_out(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& group_multiplier,
                     int64_t group_size, double multiplier, const std::optional<at::Tensor>& multiplier_per_channel,
                     at::Tensor& out) {
  const auto guard = guard_for("w4a8_linear", x);
  const W4A8Args a = make_w4a8_args("w4a8_linear", x, weight_packed, group_multiplier, group_size, multiplier,
                                    multiplier_per_channel, out);
  if (a.M == 0) return;
  if (a.M <= kGemvMaxM) launch_w4a8_gemv(a);
  else run_w4a8_gemm(a, x, out, multiplier_per_channel, kConfigAuto);
}

at::Tensor w4a8_linear(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& group_multiplier,
                       int64_t group_size, double multiplier, const std::optional<at::Tensor>& multiplier_per_channel,
                       at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && weight_packed.dim() == 2, "w4a8_linear: x and weight_packed must be 2-D, got shapes ",
              x.sizes(), " and ", weight_packed.sizes());
  at::Tensor out = at::empty({x.size(0), weight_packed.size(0)}, x.options().dtype(out_dtype));
  w4a8_linear_out(x, weight_packed, group_multiplier, group_size, multiplier, multiplier_per_channel, out);
  return out;
}

void w4a8_gemv_out(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& group_multiplier,
                   int64_t group_size, double multiplier, const std::optional<at::Tensor>& multiplier_per_channel,
                   at::Tensor& out, int64_t rows, int64_t splits, int64_t x_loads) {
  const auto guard = guard_for("w4a8_gemv", x);
  const W4A8Args a = make_w4a8_args("w4a8_gemv", x, weight_packed, group_multiplier, group_size, multiplier,
                                    multiplier_per_channel, out);
  TORCH_CHECK(a.M >= 1 && a.M <= kGemvMaxM, "w4a8_gemv: x must have 1 to ", kGemvMaxM, " rows, got ", a.M);
  launch_w4a8_gemv(a, static_cast<int>(rows), static_cast<int>(splits),
                   static_cast<XLoads>(static_cast<int>(x_loads)));
}

void w4a8_skinny_out(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& group_multiplier,
                     int64_t group_size, double multiplier, const std::optional<at::Tensor>& multiplier_per_channel,
                     at::Tensor& out, int64_t warp_tiles, int64_t splits, int64_t x_rows) {
  const auto guard = guard_for("w4a8_skinny", x);
  const W4A8Args a = make_w4a8_args("w4a8_skinny", x, weight_packed, group_multiplier, group_size, multiplier,
                                    multiplier_per_channel, out);
  TORCH_CHECK(gemm::w4a8_skinny_can_run(a.M, a.K, a.group_size), "w4a8_skinny: needs a GPU of compute capability "
              "9.0 or newer, x of 1 to ", gemm::kSkinnyMaxM, " rows, group_size % 128 == 0 or one group of at most "
              "128, and K that fits its plan; got x ", x.sizes(), ", group_size ", group_size);
  gemm::launch_w4a8_skinny(gemm_args(a, a.w), a.group_multiplier, a.group_size,
                           gemm::SkinnyPlan{static_cast<int>(warp_tiles), static_cast<int>(splits),
                                            static_cast<int>(x_rows)});
}

void w4a8_tiled_out(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& group_multiplier,
                    int64_t group_size, double multiplier, const std::optional<at::Tensor>& multiplier_per_channel,
                    at::Tensor& out, int64_t splits) {
  const auto guard = guard_for("w4a8_tiled", x);
  const W4A8Args a = make_w4a8_args("w4a8_tiled", x, weight_packed, group_multiplier, group_size, multiplier,
                                    multiplier_per_channel, out);
  launch_w4a8_tiled(a, static_cast<int>(splits));
}

void w4a8_gemm_out(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& group_multiplier,
                   int64_t group_size, double multiplier, const std::optional<at::Tensor>& multiplier_per_channel,
                   at::Tensor& out, int64_t config) {
  const auto guard = guard_for("w4a8_gemm", x);
  const W4A8Args a = make_w4a8_args("w4a8_gemm", x, weight_packed, group_multiplier, group_size, multiplier,
                                    multiplier_per_channel, out);
  TORCH_CHECK(config >= kConfigMma && config < gemm::kSm90Configs, "w4a8_gemm: config must be -2 (mma.sync), "
              "-1 (auto) or a CUTLASS sm90 configuration 0..", gemm::kSm90Configs - 1, ", got ", config);
  TORCH_CHECK(config < 0 || sm90_can_run(a, out, multiplier_per_channel),
              "w4a8_gemm: a CUTLASS sm90 configuration needs the sm_90a build on a compute capability 9.0 GPU, an "
              "int8/float16/bfloat16 out whose rows are multiples of 16 bytes, and 16-byte aligned out and "
              "multiplier_per_channel");
  if (a.M > 0) run_w4a8_gemm(a, x, out, multiplier_per_channel, config);
}

// K of a packed weight taken on its own (the expand and dequantize ops, which have no x): 2-D,
// on the current device, rows of a positive multiple of 16 bytes, and group_size dividing K.
int64_t checked_packed_k(const char* op, const at::Tensor& weight_packed, int64_t group_size) {
  TORCH_CHECK(weight_packed.dim() == 2, op, ": weight_packed must be 2-D, got shape ", weight_packed.sizes());
  const int64_t K = 2 * weight_packed.size(1);
  TORCH_CHECK(K > 0 && K % kCodesPerChunk == 0, op, ": weight_packed rows must hold a positive multiple of 16 bytes "
              "(K a multiple of 32), got ", weight_packed.size(1), " bytes");
  check_weight(op, weight_packed, K, group_size, weight_packed.device());
  return K;
}

void w4a8_expand_out(const at::Tensor& weight_packed, const at::Tensor& group_multiplier, int64_t group_size,
                     at::Tensor& out, const std::optional<at::Tensor>& overflow) {
  const char* op = "w4a8_expand";
  TORCH_CHECK(weight_packed.is_cuda(), op, ": weight_packed must be a CUDA tensor, got one on ", weight_packed.device());
  const c10::cuda::CUDAGuard guard(weight_packed.device());
  const at::Device device = weight_packed.device();
  const int64_t N = weight_packed.size(0), K = checked_packed_k(op, weight_packed, group_size);
  check_groups(op, "group_multiplier", group_multiplier, at::kChar, N, K / group_size, device);
  check_on_device(op, "out", out, device);
  TORCH_CHECK(out.scalar_type() == at::kChar && out.dim() == 2 && out.size(0) == N && out.size(1) == K, op,
              ": out must be int8 of shape [", N, ", ", K, "], got ", out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(aligned16(out), op, ": out must start at a 16-byte aligned address");
  if (overflow) {
    check_on_device(op, "overflow", *overflow, device);
    TORCH_CHECK(overflow->scalar_type() == at::kInt && overflow->numel() >= 1, op,
                ": overflow must be an int32 tensor with at least one element, got ", overflow->scalar_type(), " ",
                overflow->sizes());
  }
  check_sizes(op, Shape{0, N, K});
  check_architecture(op);
  launch_w4a8_expand(weight_packed.data_ptr<uint8_t>(), group_multiplier.data_ptr<int8_t>(), out.data_ptr<int8_t>(),
                     static_cast<int>(N), static_cast<int>(K), static_cast<int>(group_size),
                     overflow ? overflow->data_ptr<int>() : nullptr, c10::cuda::getCurrentCUDAStream());
}

// ---- W4A16 ----

void run_w4a16_gemm(const W4A16Args& a, const at::Tensor& x, at::Tensor& out) {
  at::Tensor weight = at::empty({a.N, a.K}, x.options());
  launch_w4a16_dequantize(a.w, a.scales, weight.data_ptr(), a.x_type, a.N, a.K, a.group_size, a.stream);
  if (out.scalar_type() == x.scalar_type()) {
    at::mm_out(out, x, weight.t());
  } else {
    out.copy_(at::mm(x, weight.t()));
  }
}

void w4a16_linear_out(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& scales,
                      int64_t group_size, at::Tensor& out) {
  const auto guard = guard_for("w4a16_linear", x);
  const W4A16Args a = make_w4a16_args("w4a16_linear", x, weight_packed, scales, group_size, out);
  if (a.M == 0) return;
  if (a.M <= kGemvMaxM) launch_w4a16_gemv(a);
  else run_w4a16_gemm(a, x, out);
}

at::Tensor w4a16_linear(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& scales,
                        int64_t group_size, at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && weight_packed.dim() == 2, "w4a16_linear: x and weight_packed must be 2-D, got shapes ",
              x.sizes(), " and ", weight_packed.sizes());
  at::Tensor out = at::empty({x.size(0), weight_packed.size(0)}, x.options().dtype(out_dtype));
  w4a16_linear_out(x, weight_packed, scales, group_size, out);
  return out;
}

void w4a16_gemv_out(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& scales,
                    int64_t group_size, at::Tensor& out, int64_t rows, int64_t splits, int64_t x_loads) {
  const auto guard = guard_for("w4a16_gemv", x);
  const W4A16Args a = make_w4a16_args("w4a16_gemv", x, weight_packed, scales, group_size, out);
  TORCH_CHECK(a.M >= 1 && a.M <= kGemvMaxM, "w4a16_gemv: x must have 1 to ", kGemvMaxM, " rows, got ", a.M);
  launch_w4a16_gemv(a, static_cast<int>(rows), static_cast<int>(splits),
                    static_cast<XLoads>(static_cast<int>(x_loads)));
}

void w4a16_gemm_out(const at::Tensor& x, const at::Tensor& weight_packed, const at::Tensor& scales,
                    int64_t group_size, at::Tensor& out) {
  const auto guard = guard_for("w4a16_gemm", x);
  const W4A16Args a = make_w4a16_args("w4a16_gemm", x, weight_packed, scales, group_size, out);
  if (a.M > 0) run_w4a16_gemm(a, x, out);
}

void w4a16_dequantize_out(const at::Tensor& weight_packed, const at::Tensor& scales, int64_t group_size,
                          at::Tensor& out) {
  const char* op = "w4a16_dequantize";
  TORCH_CHECK(weight_packed.is_cuda(), op, ": weight_packed must be a CUDA tensor, got one on ", weight_packed.device());
  const c10::cuda::CUDAGuard guard(weight_packed.device());
  const at::Device device = weight_packed.device();
  const int64_t N = weight_packed.size(0), K = checked_packed_k(op, weight_packed, group_size);
  check_groups(op, "scales", scales, at::kHalf, N, K / group_size, device);
  check_on_device(op, "out", out, device);
  TORCH_CHECK((out.scalar_type() == at::kHalf || out.scalar_type() == at::kBFloat16) && out.dim() == 2 &&
              out.size(0) == N && out.size(1) == K, op, ": out must be float16 or bfloat16 of shape [", N, ", ", K,
              "], got ", out.scalar_type(), " ", out.sizes());
  TORCH_CHECK(aligned16(out), op, ": out must start at a 16-byte aligned address");
  check_sizes(op, Shape{0, N, K});
  check_architecture(op);
  launch_w4a16_dequantize(weight_packed.data_ptr<uint8_t>(), scales.data_ptr(), out.data_ptr(),
                          out.scalar_type() == at::kHalf ? ActType::kFloat16 : ActType::kBFloat16,
                          static_cast<int>(N), static_cast<int>(K), static_cast<int>(group_size),
                          c10::cuda::getCurrentCUDAStream());
}

void register_impls(torch::Library& m) {
  m.impl("w4a8_linear", &w4a8_linear);
  m.impl("w4a8_linear_out", &w4a8_linear_out);
  m.impl("w4a8_gemv_out", &w4a8_gemv_out);
  m.impl("w4a8_skinny_out", &w4a8_skinny_out);
  m.impl("w4a8_tiled_out", &w4a8_tiled_out);
  m.impl("w4a8_gemm_out", &w4a8_gemm_out);
  m.impl("w4a8_expand_out", &w4a8_expand_out);
  m.impl("w4a16_linear", &w4a16_linear);
  m.impl("w4a16_linear_out", &w4a16_linear_out);
  m.impl("w4a16_gemv_out", &w4a16_gemv_out);
  m.impl("w4a16_gemm_out", &w4a16_gemm_out);
  m.impl("w4a16_dequantize_out", &w4a16_dequantize_out);
}

}  // namespace
}  // namespace quamba::gemm4

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def("w4a8_linear(Tensor x, Tensor weight_packed, Tensor group_multiplier, int group_size, float multiplier, "
        "Tensor? multiplier_per_channel, ScalarType out_dtype) -> Tensor");
  m.def("w4a8_linear_out(Tensor x, Tensor weight_packed, Tensor group_multiplier, int group_size, float multiplier, "
        "Tensor? multiplier_per_channel, Tensor(a!) out) -> ()");
  m.def("w4a8_gemv_out(Tensor x, Tensor weight_packed, Tensor group_multiplier, int group_size, float multiplier, "
        "Tensor? multiplier_per_channel, Tensor(a!) out, int rows=0, int splits=0, int x_loads=0) -> ()");
  m.def("w4a8_skinny_out(Tensor x, Tensor weight_packed, Tensor group_multiplier, int group_size, float multiplier, "
        "Tensor? multiplier_per_channel, Tensor(a!) out, int warp_tiles=0, int splits=0, int x_rows=0) -> ()");
  m.def("w4a8_tiled_out(Tensor x, Tensor weight_packed, Tensor group_multiplier, int group_size, float multiplier, "
        "Tensor? multiplier_per_channel, Tensor(a!) out, int splits=0) -> ()");
  m.def("w4a8_gemm_out(Tensor x, Tensor weight_packed, Tensor group_multiplier, int group_size, float multiplier, "
        "Tensor? multiplier_per_channel, Tensor(a!) out, int config=-1) -> ()");
  m.def("w4a8_expand_out(Tensor weight_packed, Tensor group_multiplier, int group_size, Tensor(a!) out, "
        "Tensor(b!)? overflow=None) -> ()");
  m.def("w4a16_linear(Tensor x, Tensor weight_packed, Tensor scales, int group_size, ScalarType out_dtype) -> Tensor");
  m.def("w4a16_linear_out(Tensor x, Tensor weight_packed, Tensor scales, int group_size, Tensor(a!) out) -> ()");
  m.def("w4a16_gemv_out(Tensor x, Tensor weight_packed, Tensor scales, int group_size, Tensor(a!) out, "
        "int rows=0, int splits=0, int x_loads=0) -> ()");
  m.def("w4a16_gemm_out(Tensor x, Tensor weight_packed, Tensor scales, int group_size, Tensor(a!) out) -> ()");
  m.def("w4a16_dequantize_out(Tensor weight_packed, Tensor scales, int group_size, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) { quamba::gemm4::register_impls(m); }
// On CPU tensors the same entry points fail with a message naming the argument that is not on a GPU.
TORCH_LIBRARY_IMPL(quamba, CPU, m) { quamba::gemm4::register_impls(m); }
