// One decode step of a quantized Mamba1 mixer's SSM side in one kernel (qmixer_ssm_step's cluster
// kernel; specification: quamba/ops/fused_decode/mixer_step.py, the chain of qconv1d_update, w8a8_linear
// (x_proj), w8a8_linear (dt_proj) and qsscan_update on in_proj's int8 codes x and z).
//
// The step has one reduction over all d_inner channels, x_proj (its dt_low, B and C feed every
// channel's dt_proj and scan), so one thread-block cluster per batch row does it with one exchange
// through distributed shared memory. Block r of the cluster owns a slice of
// channels: before it waits for in_proj (programmatic launch) it copies its slice's columns of
// x_proj and rows of dt_proj into shared memory and computes its channels' A. Then it steps the
// conv of its channels (u codes), sums x_proj over its slice for every output, and the cluster
// adds the slices' int32 sums (each block all of them, in rank order: integers, so exact), applies
// x_proj's epilogue, and each block finishes dt_proj, the scan step (one thread a channel, its 16
// states summed in state_readout's order) and the gate for its own channels. Every rounding is the
// separate kernels' (the shared conv epilogue and scan step, csrc/conv1d/conv_epilogue.cuh and
// csrc/qsscan/scan_step.cuh; the GEMV's int8 epilogue is quantize_rn of the fp32 sum), so its
// outputs equal the chain's bit for bit.
#include <cooperative_groups.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <utility>

#include "../conv1d/conv_epilogue.cuh"
#include "../qsscan/scan_math.cuh"
#include "../qsscan/scan_step.cuh"
#include "cluster_step.cuh"
#include "gemm/mma.cuh"
#include "pdl.cuh"

namespace quamba_ssm {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;      // a block's threads: at most this many channels a block
// A thread steps all states of its channel: d_state 9 to 16, whose terms of y the QSScan step adds
// in the same tree of 16 (fewer states: a tree of 8 there).
constexpr int kStates = 16;
constexpr int kDtLanes = 8;        // lanes that share one channel's dt_proj sum
constexpr int kMaxSmemBytes = 227 * 1024;

struct MixerStepArgs {
  const int8_t* x;  // in_proj's codes [batch, dim], any strides
  int64_t x_st[2];
  const int8_t* z;  // nullptr: no gate
  int64_t z_st[2];
  float z_scale;
  int8_t* conv_state;  // contiguous [batch, dim, width - 1]
  const int8_t* conv_weight;  // contiguous [dim, width]
  ConvEpilogue conv;  // u codes: out_inv_scale = 1 / u_scale, silu
  const int8_t* x_proj;  // contiguous [n_out, dim]
  float xdbl_multiplier;
  const int8_t* dt_proj;  // contiguous [dim, dt_rank]
  float dt_multiplier;
  StepArgs step;  // the scan step: params, state, y and the scales of u, dt and B / C
  int8_t *u_out, *xdbl_out, *dt_out;  // the integer intermediates where not null
  int dim, dt_rank, n_out, slice, pitch;  // slice: channels a block; pitch: x_proj's smem row
};

// Byte offsets of a block's shared memory: x_proj's columns of the slice [n_out][pitch],
// dt_proj's rows [slice][dt_rank], the two half sums of each output [n_out][2] (int32), the u and
// dt codes of the slice, x_proj's codes, and B and C as fp32.
struct SmemLayout {
  int dt_proj, partial, u, dt, xdbl, bc, bytes;

  __host__ __device__ SmemLayout(int n_out, int pitch, int slice, int dt_rank) {
    auto align16 = [](int v) { return (v + 15) / 16 * 16; };
    dt_proj = n_out * pitch;
    partial = align16(dt_proj + slice * dt_rank);
    u = align16(partial + n_out * 2 * 4);  // read as 16-byte chunks
    dt = align16(u + slice);
    xdbl = align16(dt + slice);
    bc = align16(xdbl + n_out);
    bytes = bc + 2 * kStates * 4;
  }
};

// This block's share of x_proj: for every output n, the sums over its slice's even and odd
// 16-byte chunks (two threads a row), into partial[2 n] and partial[2 n + 1].
__device__ __forceinline__ void x_proj_partials(const MixerStepArgs& a, const int8_t* w_x,
                                                const int8_t* u_codes, int* partial) {
  const int chunks = a.slice / 16;
  for (int task = threadIdx.x; task < 2 * a.n_out; task += kThreads) {
    const int n = task / 2, half = task % 2;
    const int8_t* row = w_x + n * a.pitch;
    int acc = 0;
    for (int q = half; q < chunks; q += 2) {
      acc = quamba::gemm::dot16(*reinterpret_cast<const int4*>(row + 16 * q),
                                *reinterpret_cast<const int4*>(u_codes + 16 * q), acc);
    }
    partial[task] = acc;
  }
}

// x_proj's int8 codes: every block adds the cluster's partial sums in rank order, then the W8A8
// epilogue (quantize_rn of the fp32 sum, as the GEMV's).
__device__ __forceinline__ void x_proj_codes(const MixerStepArgs& a, cg::cluster_group& cluster,
                                             int* partial, int8_t* xdbl, int batch_row) {
  const int ranks = static_cast<int>(cluster.num_blocks());
  for (int n = threadIdx.x; n < a.n_out; n += kThreads) {
    int2 pairs[cluster_step::kMaxRanks];  // every rank's load in flight at once
#pragma unroll
    for (int r = 0; r < cluster_step::kMaxRanks; ++r) {
      if (r < ranks) pairs[r] = *reinterpret_cast<const int2*>(cluster.map_shared_rank(partial, r) + 2 * n);
    }
    int acc = 0;
#pragma unroll
    for (int r = 0; r < cluster_step::kMaxRanks; ++r) {
      if (r < ranks) acc += pairs[r].x + pairs[r].y;
    }
    const int8_t code = quantize_rn(__int2float_rn(acc), a.xdbl_multiplier);
    xdbl[n] = code;
    if (a.xdbl_out != nullptr && cluster.block_rank() == 0) {
      a.xdbl_out[static_cast<int64_t>(batch_row) * a.n_out + n] = code;
    }
  }
}

// dt codes of the block's channels: kDtLanes lanes a channel each sum every kDtLanes-th word of
// dt_low · the channel's dt_proj row, then add their sums with shuffles (whole warps: the slice is
// a multiple of 16 channels).
__device__ __forceinline__ void dt_proj_codes(const MixerStepArgs& a, const int8_t* w_dt,
                                              const int8_t* xdbl, int count, int8_t* dt_codes,
                                              int64_t out_row) {
  const int words = a.dt_rank / 4;
  const int* dt_low = reinterpret_cast<const int*>(xdbl);
  for (int task = threadIdx.x; task < a.slice * kDtLanes; task += kThreads) {
    const int channel = task / kDtLanes, lane = task % kDtLanes;
    int acc = 0;
    if (channel < count) {
      const int* row = reinterpret_cast<const int*>(w_dt + channel * a.dt_rank);
      for (int j = lane; j < words; j += kDtLanes) acc = __dp4a(row[j], dt_low[j], acc);
    }
#pragma unroll
    for (int offset = 1; offset < kDtLanes; offset *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (lane == 0 && channel < count) {
      const int8_t code = projected_dt_code(acc, a.dt_multiplier);
      dt_codes[channel] = code;
      if (a.dt_out != nullptr) a.dt_out[out_row + channel] = code;
    }
  }
}

// grid (cluster blocks, batch), cluster (cluster blocks): block r of row b owns channels
// [r · slice, (r + 1) · slice) of row b, thread c its channel r · slice + c.
template <int kWidth, typename State, typename Out>
__global__ void __launch_bounds__(kThreads, 1) mixer_step_kernel(const MixerStepArgs a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) int8_t smem[];
  quamba::pdl_launch_dependents();  // the Hadamard kernel after it may launch (pdl.cuh)
  cg::cluster_group cluster = cg::this_cluster();
  const SmemLayout layout(a.n_out, a.pitch, a.slice, a.dt_rank);
  int8_t* w_x = smem;
  int8_t* w_dt = smem + layout.dt_proj;
  int* partial = reinterpret_cast<int*>(smem + layout.partial);
  int8_t* u_codes = smem + layout.u;
  int8_t* dt_codes = smem + layout.dt;
  int8_t* xdbl = smem + layout.xdbl;
  float* B = reinterpret_cast<float*>(smem + layout.bc);
  float* C = B + kStates;

  const int b = blockIdx.y;
  const int c0 = static_cast<int>(cluster.block_rank()) * a.slice;
  const int count = max(0, min(a.slice, a.dim - c0));  // a multiple of 16
  const int c = threadIdx.x, d = c0 + c;
  const bool owns = c < count;
  const StepArgs& s = a.step;

  // Before the wait: only weights and parameters, which no kernel of the step writes.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int n = warp; n < a.n_out; n += kThreads / 32) {  // a warp a row of x_proj's slice
    for (int q = lane; q < count / 16; q += 32) {
      cp_async16(w_x + n * a.pitch + 16 * q, a.x_proj + static_cast<int64_t>(n) * a.dim + c0 + 16 * q);
    }
  }
  for (int i = 16 * threadIdx.x; i < count * a.dt_rank; i += 16 * kThreads) {
    cp_async16(w_dt + i, a.dt_proj + static_cast<int64_t>(c0) * a.dt_rank + i);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  int conv_weight[kWidth];
  float A[kStates];
  if (owns) {
#pragma unroll
    for (int k = 0; k < kWidth; ++k) conv_weight[k] = a.conv_weight[d * kWidth + k];
    load_A<kStates>(s, d, 0, s.dstate, A);
  }

  quamba::pdl_wait();
  // Every load of the step's inputs goes out here; the states are used only after the exchange.
  const int64_t channel = static_cast<int64_t>(b) * a.dim + d;
  int window[kWidth];
  State h[kStates];
  float z = 0.f;
  int8_t* conv_state = a.conv_state + channel * (kWidth - 1);
  if (owns) {
#pragma unroll
    for (int k = 0; k < kWidth - 1; ++k) window[k] = conv_state[k];
    window[kWidth - 1] = a.x[b * a.x_st[0] + d * a.x_st[1]];
    if (a.z != nullptr) z = dequantize(a.z[b * a.z_st[0] + d * a.z_st[1]], a.z_scale);
    load_lane_states<kStates>(s, s.dstate, channel * s.dstate, h);
  }
  if (c < a.slice) {  // u codes: the conv step, zero past the channels
    int8_t u_code = 0;
    if (owns) {
      int acc = 0;
#pragma unroll
      for (int k = 0; k < kWidth; ++k) acc += conv_weight[k] * window[k];
#pragma unroll
      for (int k = 0; k < kWidth - 1; ++k) conv_state[k] = static_cast<int8_t>(window[k + 1]);
      u_code = quantize_rn(a.conv.apply(acc, a.conv.bias_of(d), a.conv.multiplier), a.conv.out_inv_scale);
      if (a.u_out != nullptr) a.u_out[channel] = u_code;
    }
    u_codes[c] = u_code;
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  x_proj_partials(a, w_x, u_codes, partial);
  cluster.sync();  // every block's partial sums are written and visible to the cluster
  x_proj_codes(a, cluster, partial, xdbl, b);
  cluster_step::arrive_release();  // this block has read the others' partial sums
  __syncthreads();
  if (threadIdx.x < s.dstate) {
    B[threadIdx.x] = dequantize(xdbl[a.dt_rank + threadIdx.x], s.B.scale);
    C[threadIdx.x] = dequantize(xdbl[a.dt_rank + s.dstate + threadIdx.x], s.C.scale);
  }
  dt_proj_codes(a, w_dt, xdbl, count, dt_codes, static_cast<int64_t>(b) * a.dim + c0);
  __syncthreads();

  if (owns) {
    const float u = dequantize(u_codes[c], s.u.scale);
    const float delta = delta_of(s, dequantize(dt_codes[c], s.dt.scale), d);
    State h_new[kStates];
    const int64_t offset = channel * s.dstate;
    const float sum = step_states<Discretization::kZoh, kStates>(s, s.dstate, offset, u, delta, A, B, C, h, h_new);
    store_lane_states<kStates>(s, s.dstate, offset, h_new);
    static_cast<Out*>(s.y)[channel] = from_float<Out>(gated_y(sum, u, s.params.skip(d), a.z != nullptr, z));
  }
  cluster_step::wait_acquire();  // no block leaves while another may still read its partial sums
#else
  __trap();  // never launched: the host requires compute capability 9.0 (thread-block clusters)
#endif
}

// Blocks of a row's cluster and channels a block: slices are whole 16-byte chunks of x_proj's rows.
std::pair<int, int> cluster_shape(int dim) { return cluster_step::shape(dim, 16); }

int smem_bytes(int64_t dim, int64_t dt_rank, int64_t dstate) {
  const int slice = cluster_shape(static_cast<int>(dim)).second;
  return SmemLayout(static_cast<int>(dt_rank + 2 * dstate), cluster_step::row_pitch(slice), slice,
                    static_cast<int>(dt_rank)).bytes;
}

// Why the kernel cannot step a mixer of these sizes ("" where it can).
std::string shape_lacks(int64_t dim, int64_t dt_rank, int64_t dstate) {
  if (dim % 16 != 0 || dim < 16 || dim > 16 * kThreads) {
    return "d_inner must be a multiple of 16 up to " + text(16 * kThreads) + ", got " + text(dim);
  }
  if (dt_rank % 4 != 0 || dt_rank < 4) return "dt_rank must be a multiple of 4, got " + text(dt_rank);
  if (dstate <= kStates / 2 || dstate > kStates) return "d_state must be 9 to 16, got " + text(dstate);
  if (dim * dt_rank > (int64_t{1} << 30)) return "dt_proj is too large";
  const int smem = smem_bytes(dim, dt_rank, dstate);
  if (smem > kMaxSmemBytes) {
    return "its x_proj and dt_proj slices need " + text(smem) + " bytes of shared memory a block, more than " +
           text(kMaxSmemBytes);
  }
  return "";
}

template <int kWidth, typename State, typename Out>
void launch(const MixerStepArgs& args, int ranks, int batch, int smem) {
  cluster_step::launch(mixer_step_kernel<kWidth, State, Out>, args, ranks, batch, kThreads, smem, "qmixer_ssm_step");
}

template <typename State, typename Out>
void dispatch_width(int width, const MixerStepArgs& args, int ranks, int batch, int smem) {
  switch (width) {
    case 2: return launch<2, State, Out>(args, ranks, batch, smem);
    case 3: return launch<3, State, Out>(args, ranks, batch, smem);
    default: return launch<4, State, Out>(args, ranks, batch, smem);
  }
}

template <typename Out>
void dispatch_state(bool int8_state, int width, const MixerStepArgs& args, int ranks, int batch, int smem) {
  if (int8_state) return dispatch_width<int8_t, Out>(width, args, ranks, batch, smem);
  dispatch_width<float, Out>(width, args, ranks, batch, smem);
}

void check_int8(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_same_device(t, ref, name);
  check_dtype(t, at::kChar, name);
}

void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be contiguous and 16-byte aligned");
}

// An optional int8 [rows, cols] output of the intermediates.
int8_t* codes_out(const c10::optional<at::Tensor>& t, const at::Tensor& ref, int64_t rows, int64_t cols,
                  const char* name) {
  if (!t.has_value()) return nullptr;
  check_int8(*t, ref, name);
  check_shape(*t, {rows, cols}, name);
  TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
  return t->data_ptr<int8_t>();
}

// x, z: int8 [batch, dim] codes of in_proj (any strides; z optional); conv_state: contiguous int8
// [batch, dim, width - 1]; ssm_state: contiguous int8 (codes of state_scale) or fp32 [batch, dim,
// dstate], both stepped in place; x_proj: int8 [dt_rank + 2 dstate, dim], dt_proj: int8
// [dim, dt_rank], both contiguous, with their fp32 epilogue multipliers. The conv's multiplier,
// bias scale and u_inv_scale and the scan's scales are those of qconv1d_update and qsscan_update.
// The sizes shape_lacks allows; compute capability 9.0. u_out, xdbl_out, dt_out: where given, the step's int8 u, x_proj and dt codes. Returns y
// [batch, dim] in out_dtype.
at::Tensor qmixer_ssm_step(const at::Tensor& x, const c10::optional<at::Tensor>& z, double z_scale,
                           at::Tensor& conv_state, at::Tensor& ssm_state, double state_scale,
                           const at::Tensor& conv_weight, const c10::optional<at::Tensor>& conv_bias,
                           double conv_multiplier, double conv_bias_scale, double u_inv_scale,
                           const at::Tensor& x_proj, double xdbl_multiplier, const at::Tensor& dt_proj,
                           double dt_multiplier, double u_scale, double xdbl_scale, double dt_scale,
                           const at::Tensor& A_log, double A_log_scale, const at::Tensor& D, double D_scale,
                           const at::Tensor& dt_bias, double dt_bias_scale, at::ScalarType out_dtype,
                           const c10::optional<at::Tensor>& u_out, const c10::optional<at::Tensor>& xdbl_out,
                           const c10::optional<at::Tensor>& dt_out) {
  check_cuda(x, "x");
  check_dtype(x, at::kChar, "x");
  TORCH_CHECK(x.dim() == 2, "x must be [batch, dim], got ", text(x.sizes()));
  const int64_t batch = x.size(0), dim = x.size(1);
  TORCH_CHECK(batch <= 65535, "x batch must be at most 65535, got ", text(batch));
  if (z.has_value()) {
    check_int8(*z, x, "z");
    check_shape(*z, {batch, dim}, "z");
  }
  check_int8(conv_weight, x, "conv_weight");
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == dim && conv_weight.size(1) >= 2 &&
                  conv_weight.size(1) <= 4 && conv_weight.is_contiguous(),
              "conv_weight must be contiguous [dim, width] with width 2 to 4, got ", text(conv_weight.sizes()));
  const int64_t width = conv_weight.size(1);
  if (conv_bias.has_value()) {
    check_int8(*conv_bias, x, "conv_bias");
    check_shape(*conv_bias, {dim}, "conv_bias");
    TORCH_CHECK(conv_bias->is_contiguous(), "conv_bias must be contiguous");
  }
  check_int8(conv_state, x, "conv_state");
  check_shape(conv_state, {batch, dim, width - 1}, "conv_state");
  TORCH_CHECK(conv_state.is_contiguous(), "conv_state must be contiguous");
  check_same_device(ssm_state, x, "ssm_state");
  TORCH_CHECK(ssm_state.dim() == 3 && ssm_state.size(0) == batch && ssm_state.size(1) == dim,
              "ssm_state must be [batch, dim, dstate], got ", text(ssm_state.sizes()));
  TORCH_CHECK(ssm_state.scalar_type() == at::kChar || ssm_state.scalar_type() == at::kFloat,
              "ssm_state must be int8 or float32, got ", ssm_state.scalar_type());
  TORCH_CHECK(ssm_state.is_contiguous(), "ssm_state must be contiguous");
  const bool int8_state = ssm_state.scalar_type() == at::kChar;
  if (int8_state) check_positive_scale(state_scale, "state_scale");
  const int64_t dstate = ssm_state.size(2);
  check_int8(x_proj, x, "x_proj");
  check_int8(dt_proj, x, "dt_proj");
  check_aligned(x_proj, "x_proj");
  check_aligned(dt_proj, "dt_proj");
  TORCH_CHECK(dt_proj.dim() == 2 && dt_proj.size(0) == dim, "dt_proj must be [dim, dt_rank], got ",
              text(dt_proj.sizes()));
  const int64_t dt_rank = dt_proj.size(1), n_out = dt_rank + 2 * dstate;
  check_shape(x_proj, {n_out, dim}, "x_proj");
  const std::string lacks = shape_lacks(dim, dt_rank, dstate);
  TORCH_CHECK(lacks.empty(), "qmixer_ssm_step's cluster kernel: ", lacks);
  check_ssm_params(x, A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale, dim, dstate);
  check_out_dtype(out_dtype);
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 9,
              "qmixer_ssm_step's cluster kernel needs compute capability 9.0 or newer");

  const auto [ranks, slice] = cluster_shape(static_cast<int>(dim));
  const int smem = smem_bytes(dim, dt_rank, dstate);

  at::Tensor y = at::empty({batch, dim}, x.options().dtype(out_dtype));
  if (batch == 0) return y;
  MixerStepArgs args{};
  args.x = x.data_ptr<int8_t>();
  args.x_st[0] = x.stride(0);
  args.x_st[1] = x.stride(1);
  args.z = z.has_value() ? z->data_ptr<int8_t>() : nullptr;
  args.z_st[0] = z.has_value() ? z->stride(0) : 0;
  args.z_st[1] = z.has_value() ? z->stride(1) : 0;
  args.z_scale = to_fp32(z_scale);
  args.conv_state = conv_state.data_ptr<int8_t>();
  args.conv_weight = conv_weight.data_ptr<int8_t>();
  args.conv = ConvEpilogue{to_fp32(conv_multiplier),
                           conv_bias.has_value() ? conv_bias->data_ptr<int8_t>() : nullptr,
                           to_fp32(conv_bias_scale), to_fp32(u_inv_scale), true, nullptr, nullptr};
  args.x_proj = x_proj.data_ptr<int8_t>();
  args.xdbl_multiplier = to_fp32(xdbl_multiplier);
  args.dt_proj = dt_proj.data_ptr<int8_t>();
  args.dt_multiplier = to_fp32(dt_multiplier);
  args.step = int8_input_step(u_scale, dt_scale, xdbl_scale,
                              ssm_params(A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale),
                              ssm_state.data_ptr(), int8_state, state_scale);
  StepArgs& step = args.step;
  step.y = y.data_ptr();
  step.batch = static_cast<int>(batch);
  step.dim = static_cast<int>(dim);
  step.dstate = static_cast<int>(dstate);
  step.rows_aligned = dstate == kStates && reinterpret_cast<uintptr_t>(step.state) % 16 == 0 &&
                      reinterpret_cast<uintptr_t>(step.params.A_log) % 16 == 0;
  args.u_out = codes_out(u_out, x, batch, dim, "u_out");
  args.xdbl_out = codes_out(xdbl_out, x, batch, n_out, "xdbl_out");
  args.dt_out = codes_out(dt_out, x, batch, dim, "dt_out");
  args.dim = static_cast<int>(dim);
  args.dt_rank = static_cast<int>(dt_rank);
  args.n_out = static_cast<int>(n_out);
  args.slice = slice;
  args.pitch = cluster_step::row_pitch(slice);
  switch (out_dtype) {
    case at::kHalf: dispatch_state<__half>(int8_state, width, args, ranks, batch, smem); break;
    case at::kBFloat16: dispatch_state<__nv_bfloat16>(int8_state, width, args, ranks, batch, smem); break;
    default: dispatch_state<float>(int8_state, width, args, ranks, batch, smem); break;
  }
  return y;
}

// qmixer_ssm_step_lacks(d_inner, dt_rank, d_state): why the kernel cannot step a mixer of these
// sizes, "" where it can (the Python backend then runs the Triton kernels instead).
std::string qmixer_ssm_step_lacks(int64_t dim, int64_t dt_rank, int64_t dstate) {
  return shape_lacks(dim, dt_rank, dstate);
}

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "qmixer_ssm_step(Tensor x, Tensor? z, float z_scale, Tensor(a!) conv_state, "
      "Tensor(b!) ssm_state, float state_scale, Tensor conv_weight, Tensor? conv_bias, "
      "float conv_multiplier, float conv_bias_scale, float u_inv_scale, Tensor x_proj, "
      "float xdbl_multiplier, Tensor dt_proj, float dt_multiplier, float u_scale, "
      "float xdbl_scale, float dt_scale, Tensor A_log, float A_log_scale, Tensor D, "
      "float D_scale, Tensor dt_bias, float dt_bias_scale, ScalarType out_dtype, "
      "Tensor(c!)? u_out=None, Tensor(d!)? xdbl_out=None, Tensor(e!)? dt_out=None) -> Tensor");
  m.def("qmixer_ssm_step_lacks(int d_inner, int dt_rank, int d_state) -> str",
        &quamba_ssm::qmixer_ssm_step_lacks);
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) { m.impl("qmixer_ssm_step", &quamba_ssm::qmixer_ssm_step); }
