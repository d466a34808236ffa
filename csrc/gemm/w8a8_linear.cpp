// torch.ops.quamba W8A8 linear ops: input checks and the choice of kernel.
//
//   w8a8_linear(x, weight, multiplier, multiplier_per_channel, bias, out_dtype) -> out
//   w8a8_linear_out(..., out)                  the same into a preallocated out
//   w8a8_gemv_out / w8a8_gemm_skinny_out / w8a8_gemm_mma_out / w8a8_gemm_sm90_out(..., out,
//       [rows, splits | warp_tiles, splits, x_rows | config])  one kernel, for tests and benchmarks
//   w8a8_gemm_sm90_configs() -> int            CUTLASS sm90 configurations built (0: none)
//
// x int8 [M, K] and weight int8 [N, K], K % 16 == 0, 16-byte aligned, weight contiguous; x
// contiguous for the mma GEMM op, and for the others rows of contiguous values whose starts are a
// multiple of 16 bytes apart (a column slice: the GEMV, the skinny GEMM and the sm90 GEMM read it
// in place, w8a8_linear copies it to packed rows for mma.sync); multiplier is the fp32 epilogue scale
// (quamba.ops.quant.requant_multiplier), replaced by multiplier_per_channel (fp32 [N]) when given;
// bias fp32 [N] for float outputs; out [M, N] of int8, float16, bfloat16 or float32.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "gemm/checks.h"
#include "gemm/gemm.h"

namespace quamba::gemm {

namespace {

using checks::aligned16;
using checks::check_architecture;
using checks::check_device;
using checks::check_on_device;
using checks::check_vector;
using checks::guard_for;
using checks::out_type_of;

enum class Rows { kPacked, kStrided };

// Rows::kStrided also takes rows of contiguous values that start a multiple of 16 bytes apart (a
// column slice), whose stride x_stride_of gives.
void check_matrix(const char* op, const char* name, const at::Tensor& t, const at::Device& device,
                  Rows rows = Rows::kPacked) {
  check_device(op, name, t, device);
  TORCH_CHECK(t.scalar_type() == at::kChar, op, ": ", name, " must be int8, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == 2, op, ": ", name, " must be 2-D, got shape ", t.sizes());
  if (rows == Rows::kPacked) {
    TORCH_CHECK(t.is_contiguous(), op, ": ", name, " must be contiguous");
  } else {
    const bool sliced_rows = t.stride(1) == 1 && (t.stride(0) >= t.size(1) && t.stride(0) % 16 == 0);
    TORCH_CHECK(t.is_contiguous() || t.size(0) <= 1 || sliced_rows, op, ": ", name,
                " must have contiguous rows that start a multiple of 16 bytes apart, got strides ", t.strides());
  }
  TORCH_CHECK(t.size(1) > 0 && t.size(1) % 16 == 0, op, ": ", name,
              " must have a last dimension that is a positive multiple of 16, got ", t.size(1));
  TORCH_CHECK(aligned16(t), op, ": ", name, " must start at a 16-byte aligned address");
}

// Bytes between x's rows (a single row's stride can be anything: then K).
int x_stride_of(const at::Tensor& x) { return static_cast<int>(x.size(0) <= 1 ? x.size(1) : x.stride(0)); }

// Checks every argument and packs them for a launcher (the caller holds a device guard).
GemmArgs make_args(const char* op, const at::Tensor& x, const at::Tensor& weight, double multiplier,
                   const std::optional<at::Tensor>& multiplier_per_channel, const std::optional<at::Tensor>& bias,
                   const at::Tensor& out, Rows x_rows = Rows::kPacked) {
  const at::Device device = x.device();
  check_matrix(op, "x", x, device, x_rows);
  check_matrix(op, "weight", weight, device);
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.size(1) == K, op, ": weight must have shape [N, ", K, "] to match x [", M, ", ", K,
              "], got ", weight.sizes());
  TORCH_CHECK(N > 0, op, ": weight must have at least one row");
  TORCH_CHECK(M < INT32_MAX && N < INT32_MAX && K < INT32_MAX && (M <= 1 || x.stride(0) < INT32_MAX), op,
              ": sizes and x's row stride must be below 2^31");
  if (multiplier_per_channel) check_vector(op, "multiplier_per_channel", *multiplier_per_channel, N, device);
  if (bias) check_vector(op, "bias", *bias, N, device);
  check_on_device(op, "out", out, device);
  const OutType out_type = out_type_of(op, out.scalar_type());
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.size(1) == N, op, ": out must have shape [", M, ", ",
              N, "], got ", out.sizes());
  TORCH_CHECK(!(bias && out_type == OutType::kInt8), op, ": bias is only supported with a float out");
  check_architecture(op);
  return GemmArgs{x.data_ptr<int8_t>(), weight.data_ptr<int8_t>(), out.data_ptr(),
                  static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), x_stride_of(x), out_type,
                  static_cast<float>(multiplier),
                  multiplier_per_channel ? multiplier_per_channel->data_ptr<float>() : nullptr,
                  bias ? bias->data_ptr<float>() : nullptr,
                  c10::cuda::getCurrentCUDAStream()};
}

// The wgmma kernel stores output rows and loads the epilogue vectors with TMA / 16-byte accesses.
bool sm90_can_run(const GemmArgs& a, const at::Tensor& out, const std::optional<at::Tensor>& multiplier_per_channel,
                  const std::optional<at::Tensor>& bias) {
  const cudaDeviceProp* prop = at::cuda::getCurrentDeviceProperties();
  if (!gemm_sm90_compiled() || prop->major != 9 || prop->minor != 0) return false;
  if (a.out_type == OutType::kFloat32 || (static_cast<int64_t>(a.N) * out.element_size()) % 16 != 0) return false;
  return aligned16(out) && (!multiplier_per_channel || aligned16(*multiplier_per_channel)) &&
         (!bias || aligned16(*bias));
}

void w8a8_linear_out(const at::Tensor& x, const at::Tensor& weight, double multiplier,
                     const std::optional<at::Tensor>& multiplier_per_channel, const std::optional<at::Tensor>& bias,
                     at::Tensor& out) {
  const auto guard = guard_for("w8a8_linear", x);
  GemmArgs args = make_args("w8a8_linear", x, weight, multiplier, multiplier_per_channel, bias, out, Rows::kStrided);
  if (args.M == 0) return;
  if (args.M <= kGemvMaxM) return launch_gemv(args);
  const bool sm90 = sm90_can_run(args, out, multiplier_per_channel, bias);
  if (!(sm90 && swapped_sm90_preferred(args.M, args.N)) && gemm_skinny_can_run(args.M, args.K))
    return launch_gemm_skinny(args);
  if (sm90) return launch_gemm_sm90(args);  // reads x's rows where they are
  const at::Tensor x_packed = x.contiguous();  // mma.sync reads packed rows; a copy only for a slice
  args.x = x_packed.data_ptr<int8_t>();
  args.x_stride = args.K;
  launch_gemm_mma(args);
}

at::Tensor w8a8_linear(const at::Tensor& x, const at::Tensor& weight, double multiplier,
                       const std::optional<at::Tensor>& multiplier_per_channel, const std::optional<at::Tensor>& bias,
                       at::ScalarType out_dtype) {
  TORCH_CHECK(x.dim() == 2 && weight.dim() == 2, "w8a8_linear: x and weight must be 2-D, got shapes ", x.sizes(),
              " and ", weight.sizes());
  at::Tensor out = at::empty({x.size(0), weight.size(0)}, x.options().dtype(out_dtype));
  w8a8_linear_out(x, weight, multiplier, multiplier_per_channel, bias, out);
  return out;
}

void w8a8_gemv_out(const at::Tensor& x, const at::Tensor& weight, double multiplier,
                   const std::optional<at::Tensor>& multiplier_per_channel, const std::optional<at::Tensor>& bias,
                   at::Tensor& out, int64_t rows, int64_t splits) {
  const auto guard = guard_for("w8a8_gemv", x);
  const GemmArgs args =
      make_args("w8a8_gemv", x, weight, multiplier, multiplier_per_channel, bias, out, Rows::kStrided);
  TORCH_CHECK(args.M >= 1 && args.M <= kGemvMaxM, "w8a8_gemv: x must have 1 to ", kGemvMaxM, " rows, got ", args.M);
  launch_gemv(args, static_cast<int>(rows), static_cast<int>(splits));
}

void w8a8_gemm_skinny_out(const at::Tensor& x, const at::Tensor& weight, double multiplier,
                          const std::optional<at::Tensor>& multiplier_per_channel,
                          const std::optional<at::Tensor>& bias, at::Tensor& out, int64_t warp_tiles, int64_t splits,
                          int64_t x_rows) {
  const auto guard = guard_for("w8a8_gemm_skinny", x);
  const GemmArgs args =
      make_args("w8a8_gemm_skinny", x, weight, multiplier, multiplier_per_channel, bias, out, Rows::kStrided);
  TORCH_CHECK(gemm_skinny_can_run(args.M, args.K), "w8a8_gemm_skinny: needs a GPU of compute capability 9.0 or "
              "newer, x of 1 to ", kSkinnyMaxM, " rows and K that fits its plan, got x ", x.sizes());
  launch_gemm_skinny(args, SkinnyPlan{static_cast<int>(warp_tiles), static_cast<int>(splits), static_cast<int>(x_rows)});
}

void w8a8_gemm_mma_out(const at::Tensor& x, const at::Tensor& weight, double multiplier,
                       const std::optional<at::Tensor>& multiplier_per_channel,
                       const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const auto guard = guard_for("w8a8_gemm_mma", x);
  const GemmArgs args = make_args("w8a8_gemm_mma", x, weight, multiplier, multiplier_per_channel, bias, out);
  if (args.M > 0) launch_gemm_mma(args);
}

void w8a8_gemm_sm90_out(const at::Tensor& x, const at::Tensor& weight, double multiplier,
                        const std::optional<at::Tensor>& multiplier_per_channel,
                        const std::optional<at::Tensor>& bias, at::Tensor& out, int64_t config) {
  const auto guard = guard_for("w8a8_gemm_sm90", x);
  const GemmArgs args =
      make_args("w8a8_gemm_sm90", x, weight, multiplier, multiplier_per_channel, bias, out, Rows::kStrided);
  TORCH_CHECK(sm90_can_run(args, out, multiplier_per_channel, bias) || !gemm_sm90_compiled(),
              "w8a8_gemm_sm90: needs a compute capability 9.0 GPU, an int8/float16/bfloat16 out whose rows are "
              "multiples of 16 bytes, and 16-byte aligned out, multiplier_per_channel and bias");
  if (args.M > 0) launch_gemm_sm90(args, static_cast<int>(config));
}

int64_t w8a8_gemm_sm90_configs() { return gemm_sm90_compiled() ? gemm_sm90_num_configs() : 0; }

void register_impls(torch::Library& m) {
  m.impl("w8a8_linear", &w8a8_linear);
  m.impl("w8a8_linear_out", &w8a8_linear_out);
  m.impl("w8a8_gemv_out", &w8a8_gemv_out);
  m.impl("w8a8_gemm_skinny_out", &w8a8_gemm_skinny_out);
  m.impl("w8a8_gemm_mma_out", &w8a8_gemm_mma_out);
  m.impl("w8a8_gemm_sm90_out", &w8a8_gemm_sm90_out);
}

}  // namespace
}  // namespace quamba::gemm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def("w8a8_linear(Tensor x, Tensor weight, float multiplier, Tensor? multiplier_per_channel, Tensor? bias, "
        "ScalarType out_dtype) -> Tensor");
  m.def("w8a8_linear_out(Tensor x, Tensor weight, float multiplier, Tensor? multiplier_per_channel, "
        "Tensor? bias, Tensor(a!) out) -> ()");
  m.def("w8a8_gemv_out(Tensor x, Tensor weight, float multiplier, Tensor? multiplier_per_channel, "
        "Tensor? bias, Tensor(a!) out, int rows=0, int splits=0) -> ()");
  m.def("w8a8_gemm_skinny_out(Tensor x, Tensor weight, float multiplier, Tensor? multiplier_per_channel, "
        "Tensor? bias, Tensor(a!) out, int warp_tiles=0, int splits=0, int x_rows=0) -> ()");
  m.def("w8a8_gemm_mma_out(Tensor x, Tensor weight, float multiplier, Tensor? multiplier_per_channel, "
        "Tensor? bias, Tensor(a!) out) -> ()");
  m.def("w8a8_gemm_sm90_out(Tensor x, Tensor weight, float multiplier, Tensor? multiplier_per_channel, "
        "Tensor? bias, Tensor(a!) out, int config=-1) -> ()");
  m.def("w8a8_gemm_sm90_configs() -> int", &quamba::gemm::w8a8_gemm_sm90_configs);
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) { quamba::gemm::register_impls(m); }
// On CPU tensors the same entry points fail with a message naming the argument that is not on a GPU.
TORCH_LIBRARY_IMPL(quamba, CPU, m) { quamba::gemm::register_impls(m); }
