// One decode step of a weight-only (W4A16) Mamba1 mixer's SSM side in one kernel (w4a16_ssm_step;
// specification: quamba/ops/fused_decode/w4a16_step.py, the chain of causal_conv1d_update + SiLU, w4a16_linear
// (x_proj), dt_proj's float linear and selective_state_update on in_proj's float x and z).
//
// The plan is qmixer_ssm_step's cluster kernel (mixer_step.cu) with float activations: one
// thread-block cluster a batch row, block r owning a slice of the channels. Before it waits for
// in_proj (programmatic launch) a block copies its slice's packed 4-bit columns of x_proj and its
// rows of dt_proj into shared memory and reads its channels' conv taps, A, D and dt_bias. Then it
// steps the conv of its channels, sums x_proj over its slice for every output (each 32-channel
// piece of a row lies in one group: its sum times the group's scale), and every block adds the
// cluster's partial sums in rank order (the same fp32 sum in every block), so x_proj needs one
// exchange through distributed shared memory. Each block then finishes dt_proj, the scan step (a
// thread a channel, its 16 states summed in state_readout's order) and the gate for its channels.
// The chain's roundings to the activation dtype are kept: u, x_proj's output and dt are rounded
// as the separate kernels store them; the sums are fp32 in another order, so the outputs agree
// with the chain to float tolerances, not bit for bit.
#include <cooperative_groups.h>
#include <torch/library.h>

#include <string>

#include "../qsscan/scan_math.cuh"
#include "../qsscan/scan_step.cuh"
#include "cluster_step.cuh"
#include "pdl.cuh"

namespace quamba_ssm {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 512;  // a block's threads: at most this many channels a block
constexpr int kStates = 16;    // a thread steps all states of its channel: d_state 9 to 16
constexpr int kPiece = 32;     // channels of a 16-byte piece of a packed x_proj row
constexpr int kMaxHalfPieces = kThreads / kPiece / 2;  // pieces of a slice a thread of x_proj sums
constexpr int kDtLanes = 8;    // lanes that share one channel's dt_proj sum
constexpr int kMaxSmemBytes = 227 * 1024;

template <typename T>
struct W4A16StepArgs {
  const T* x;  // in_proj's output [batch, dim], any strides
  int64_t x_st[2];
  const T* z;  // nullptr: no gate
  int64_t z_st[2];
  T* conv_state;  // contiguous [batch, dim, width - 1]
  const T* conv_weight;  // contiguous [dim, width]
  const T* conv_bias;  // nullptr: none
  const uint8_t* x_proj;  // packed 4-bit codes [n_out, dim / 2], two a byte, low nibble first
  const __half* x_proj_scales;  // [n_out, dim / group_size]
  int group_size;
  const T* dt_proj;  // contiguous [dim, dt_rank]
  const T* dt_bias;  // [dim]
  const float* A;  // contiguous [dim, dstate]
  const float* D;  // [dim]; nullptr: no skip
  StepArgs step;  // the fp32 SSM state stepped in place, its sizes and row alignment
  T* y;  // [batch, dim]
  int dim, dt_rank, n_out, slice, pitch;  // slice: channels a block; pitch: x_proj's smem row
};

// Byte offsets of a block's shared memory: x_proj's packed columns of the slice [n_out][pitch],
// dt_proj's rows [slice][dt_rank], the two half sums of each output [n_out][2], and as fp32 the
// slice's u and dt and x_proj's output (dt_low, B, C).
struct SmemLayout {
  int dt_proj, partial, u, dt, xdbl, bytes;

  __host__ __device__ SmemLayout(int n_out, int pitch, int slice, int dt_rank, int element_bytes) {
    auto align16 = [](int v) { return (v + 15) / 16 * 16; };
    dt_proj = n_out * pitch;
    partial = align16(dt_proj + slice * dt_rank * element_bytes);
    u = align16(partial + n_out * 2 * 4);
    dt = align16(u + slice * 4);
    xdbl = align16(dt + slice * 4);
    bytes = xdbl + n_out * 4;
  }
};

// v as the activation dtype stores it.
template <typename T>
__device__ __forceinline__ float rounded(float v) {
  return to_float(from_float<T>(v));
}

// Σ code_i u_i over one 16-byte piece of a packed row (32 codes, low nibble first). A code n is
// taken to fp32 without a conversion instruction (a quarter of the fp32 rate): with the word's
// nibbles' sign bits flipped (n ^ 8 = n + 8 modulo 16), n ^ 8 as the low mantissa bits of 2^23
// less 2^23 + 8 is n, exactly.
__device__ __forceinline__ float piece_dot(const uint4 packed, const float* u) {
  constexpr float kBias = 8388616.f;  // 2^23 + 8
  const uint32_t words[4] = {packed.x, packed.y, packed.z, packed.w};
  const float4* u4 = reinterpret_cast<const float4*>(u);
  float acc = 0.f;
#pragma unroll
  for (int w = 0; w < 4; ++w) {
    const uint32_t flipped = words[w] ^ 0x88888888u;
    const float4 lo = u4[2 * w], hi = u4[2 * w + 1];
    const float values[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      const float code = __fadd_rn(__uint_as_float(0x4B000000u | ((flipped >> (4 * k)) & 0xFu)), -kBias);
      acc = fmaf(code, values[k], acc);
    }
  }
  return acc;
}

// The group scales of the pieces a thread sums in x_proj_partials (its task, if any, is
// threadIdx.x: 2 n_out <= kThreads), read before the launch's wait.
template <typename T>
__device__ __forceinline__ void load_piece_scales(const W4A16StepArgs<T>& a, int c0, int count,
                                                  float (&scales)[kMaxHalfPieces]) {
  const int task = threadIdx.x, n = task / 2, half = task % 2;
  const __half* row = a.x_proj_scales + static_cast<int64_t>(n) * (a.dim / a.group_size);
#pragma unroll
  for (int i = 0; i < kMaxHalfPieces; ++i) {
    const int q = half + 2 * i;
    scales[i] = task < 2 * a.n_out && q < count / kPiece ? __half2float(row[(c0 + kPiece * q) / a.group_size]) : 0.f;
  }
}

// This block's share of x_proj: for every output n, the sums over its slice's even and odd pieces
// (two threads a row, thread 2 n + half), each piece's sum times its group's scale, into
// partial[2 n + half].
__device__ __forceinline__ void x_proj_partials(int n_out, int pitch, const uint8_t* w_x, const float* u,
                                                int count, const float (&scales)[kMaxHalfPieces],
                                                float* partial) {
  const int task = threadIdx.x, n = task / 2, half = task % 2;
  if (task >= 2 * n_out) return;
  const uint8_t* row = w_x + n * pitch;
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < kMaxHalfPieces; ++i) {
    const int q = half + 2 * i;
    if (q < count / kPiece) {
      acc = fmaf(scales[i], piece_dot(*reinterpret_cast<const uint4*>(row + 16 * q), u + kPiece * q), acc);
    }
  }
  partial[task] = acc;
}

// x_proj's output: every block adds the cluster's partial sums in rank order and rounds the sum
// to the activation dtype, as w4a16_linear stores it.
template <typename T>
__device__ __forceinline__ void x_proj_outputs(const W4A16StepArgs<T>& a, cg::cluster_group& cluster,
                                               float* partial, float* xdbl) {
  const int ranks = static_cast<int>(cluster.num_blocks());
  for (int n = threadIdx.x; n < a.n_out; n += kThreads) {
    float2 pairs[cluster_step::kMaxRanks];  // every rank's load in flight at once
#pragma unroll
    for (int r = 0; r < cluster_step::kMaxRanks; ++r) {
      if (r < ranks) pairs[r] = *reinterpret_cast<const float2*>(cluster.map_shared_rank(partial, r) + 2 * n);
    }
    float acc = 0.f;
#pragma unroll
    for (int r = 0; r < cluster_step::kMaxRanks; ++r) {
      if (r < ranks) acc += pairs[r].x + pairs[r].y;
    }
    xdbl[n] = rounded<T>(acc);
  }
}

// dt of the block's channels: kDtLanes lanes a channel each sum every kDtLanes-th 16-byte piece
// of the channel's dt_proj row times dt_low, then add their sums with shuffles (whole warps: the
// slice is a multiple of 32 channels); rounded to the activation dtype, as the float linear
// stores it.
template <typename T>
__device__ __forceinline__ void dt_proj_outputs(const W4A16StepArgs<T>& a, const T* w_dt,
                                                const float* dt_low, int count, float* dt) {
  constexpr int kPer = 16 / sizeof(T);  // elements of a piece
  const int pieces = a.dt_rank / kPer;
  for (int task = threadIdx.x; task < a.slice * kDtLanes; task += kThreads) {
    const int channel = task / kDtLanes, lane = task % kDtLanes;
    float acc = 0.f;
    if (channel < count) {
      const uint4* row = reinterpret_cast<const uint4*>(w_dt + channel * a.dt_rank);
      for (int j = lane; j < pieces; j += kDtLanes) {
        const uint4 piece = row[j];
        const T* weights = reinterpret_cast<const T*>(&piece);
        const float4* low = reinterpret_cast<const float4*>(dt_low + kPer * j);
#pragma unroll
        for (int v = 0; v < kPer / 4; ++v) {
          const float4 l = low[v];
          acc = fmaf(to_float(weights[4 * v]), l.x, acc);
          acc = fmaf(to_float(weights[4 * v + 1]), l.y, acc);
          acc = fmaf(to_float(weights[4 * v + 2]), l.z, acc);
          acc = fmaf(to_float(weights[4 * v + 3]), l.w, acc);
        }
      }
    }
#pragma unroll
    for (int offset = 1; offset < kDtLanes; offset *= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
    if (lane == 0 && channel < count) dt[channel] = rounded<T>(acc);
  }
}

// grid (cluster blocks, batch), cluster (cluster blocks): block r of row b owns channels
// [r · slice, (r + 1) · slice) of row b, thread c its channel r · slice + c.
template <int kWidth, typename T>
__global__ void __launch_bounds__(kThreads, 1) w4a16_step_kernel(const W4A16StepArgs<T> a) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) int8_t smem[];
  quamba::pdl_launch_dependents();  // out_proj's GEMV after it may launch (pdl.cuh)
  cg::cluster_group cluster = cg::this_cluster();
  const SmemLayout layout(a.n_out, a.pitch, a.slice, a.dt_rank, sizeof(T));
  uint8_t* w_x = reinterpret_cast<uint8_t*>(smem);
  T* w_dt = reinterpret_cast<T*>(smem + layout.dt_proj);
  float* partial = reinterpret_cast<float*>(smem + layout.partial);
  float* u_values = reinterpret_cast<float*>(smem + layout.u);
  float* dt_values = reinterpret_cast<float*>(smem + layout.dt);
  float* xdbl = reinterpret_cast<float*>(smem + layout.xdbl);

  const int b = blockIdx.y;
  const int c0 = static_cast<int>(cluster.block_rank()) * a.slice;
  const int count = max(0, min(a.slice, a.dim - c0));  // a multiple of kPiece
  const int c = threadIdx.x, d = c0 + c;
  const bool owns = c < count;
  const StepArgs& s = a.step;

  // Before the wait: only weights and parameters, which no kernel of the step writes.
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int n = warp; n < a.n_out; n += kThreads / 32) {  // a warp a row of x_proj's slice
    for (int q = lane; q < count / kPiece; q += 32) {
      cp_async16(w_x + n * a.pitch + 16 * q, a.x_proj + static_cast<int64_t>(n) * (a.dim / 2) + c0 / 2 + 16 * q);
    }
  }
  const int dt_bytes = count * a.dt_rank * static_cast<int>(sizeof(T));
  const int8_t* dt_rows = reinterpret_cast<const int8_t*>(a.dt_proj + static_cast<int64_t>(c0) * a.dt_rank);
  for (int i = 16 * threadIdx.x; i < dt_bytes; i += 16 * kThreads) {
    cp_async16(reinterpret_cast<int8_t*>(w_dt) + i, dt_rows + i);
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
  float piece_scales[kMaxHalfPieces];
  load_piece_scales(a, c0, count, piece_scales);
  float conv_weight[kWidth], A[kStates];
  float conv_bias = 0.f, skip = 0.f, dt_bias = 0.f;
  if (owns) {
#pragma unroll
    for (int k = 0; k < kWidth; ++k) conv_weight[k] = to_float(a.conv_weight[d * kWidth + k]);
    if (a.conv_bias != nullptr) conv_bias = to_float(a.conv_bias[d]);
    if (a.D != nullptr) skip = a.D[d];
    dt_bias = to_float(a.dt_bias[d]);
    load_partial_row<kStates>(a.A + static_cast<int64_t>(d) * s.dstate, s.dstate, s.rows_aligned, A);
  }

  quamba::pdl_wait();
  // Every load of the step's inputs goes out here; the states are used only after the exchange.
  const int64_t channel = static_cast<int64_t>(b) * a.dim + d;
  float window[kWidth], z = 0.f;
  float h[kStates];
  T* conv_state = a.conv_state + channel * (kWidth - 1);
  if (owns) {
#pragma unroll
    for (int k = 0; k < kWidth - 1; ++k) window[k] = to_float(conv_state[k]);
    window[kWidth - 1] = to_float(a.x[b * a.x_st[0] + d * a.x_st[1]]);
    if (a.z != nullptr) z = to_float(a.z[b * a.z_st[0] + d * a.z_st[1]]);
    load_lane_states<kStates>(s, s.dstate, channel * s.dstate, h);
  }
  if (c < a.slice) {  // u: the conv step, zero past the channels
    float u = 0.f;
    if (owns) {
      float acc = conv_bias;
#pragma unroll
      for (int k = 0; k < kWidth; ++k) acc = fmaf(conv_weight[k], window[k], acc);
#pragma unroll
      for (int k = 0; k < kWidth - 1; ++k) conv_state[k] = from_float<T>(window[k + 1]);
      u = rounded<T>(silu_rn(acc));
    }
    u_values[c] = u;
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  x_proj_partials(a.n_out, a.pitch, w_x, u_values, count, piece_scales, partial);
  cluster.sync();  // every block's partial sums are written and visible to the cluster
  x_proj_outputs(a, cluster, partial, xdbl);
  cluster_step::arrive_release();  // this block has read the others' partial sums
  __syncthreads();
  dt_proj_outputs(a, w_dt, xdbl, count, dt_values);
  __syncthreads();

  if (owns) {
    const float u = u_values[c];
    const float delta = biased_delta(dt_values[c], dt_bias);
    const float* B = xdbl + a.dt_rank;
    float h_new[kStates];
    const int64_t offset = channel * s.dstate;
    const float sum = step_states<Discretization::kZoh, kStates>(s, s.dstate, offset, u, delta, A, B,
                                                                 B + s.dstate, h, h_new);
    store_lane_states<kStates>(s, s.dstate, offset, h_new);
    a.y[channel] = from_float<T>(gated_y(sum, u, skip, a.z != nullptr, z));
  }
  cluster_step::wait_acquire();  // no block leaves while another may still read its partial sums
#else
  __trap();  // never launched: the host requires compute capability 9.0 (thread-block clusters)
#endif
}

int smem_bytes(int64_t dim, int64_t dt_rank, int64_t dstate, int element_bytes) {
  const int slice = cluster_step::shape(static_cast<int>(dim), kPiece).second;
  return SmemLayout(static_cast<int>(dt_rank + 2 * dstate), cluster_step::row_pitch(slice / 2), slice,
                    static_cast<int>(dt_rank), element_bytes)
      .bytes;
}

// Why the kernel cannot step a mixer of these sizes ("" where it can).
std::string shape_lacks(int64_t dim, int64_t dt_rank, int64_t dstate, int64_t group_size, int element_bytes) {
  if (dim % kPiece != 0 || dim < kPiece || dim > kPiece * kThreads / 2) {
    return "d_inner must be a multiple of " + text(kPiece) + " up to " + text(kPiece * kThreads / 2) +
           ", got " + text(dim);
  }
  if (group_size % kPiece != 0 || group_size <= 0 || dim % group_size != 0) {
    return "x_proj's group size must be a multiple of " + text(kPiece) + " that divides d_inner, got " +
           text(group_size);
  }
  if (dt_rank < 1 || dt_rank * element_bytes % 16 != 0) {
    return "dt_proj's rows must be whole 16-byte pieces, got dt_rank " + text(dt_rank);
  }
  if (dstate <= kStates / 2 || dstate > kStates) return "d_state must be 9 to 16, got " + text(dstate);
  if (2 * (dt_rank + 2 * dstate) > kThreads) {
    return "x_proj's outputs must be at most " + text(kThreads / 2) + ", got dt_rank + 2 d_state = " +
           text(dt_rank + 2 * dstate);
  }
  const int smem = smem_bytes(dim, dt_rank, dstate, element_bytes);
  if (smem > kMaxSmemBytes) {
    return "its x_proj and dt_proj slices need " + text(smem) + " bytes of shared memory a block, more than " +
           text(kMaxSmemBytes);
  }
  return "";
}

template <typename T>
void dispatch_width(int width, const W4A16StepArgs<T>& args, int ranks, int batch, int smem) {
  const char* op = "w4a16_ssm_step";
  switch (width) {
    case 2: return cluster_step::launch(w4a16_step_kernel<2, T>, args, ranks, batch, kThreads, smem, op);
    case 3: return cluster_step::launch(w4a16_step_kernel<3, T>, args, ranks, batch, kThreads, smem, op);
    default: return cluster_step::launch(w4a16_step_kernel<4, T>, args, ranks, batch, kThreads, smem, op);
  }
}

void check_like(const at::Tensor& t, const at::Tensor& ref, const char* name) {
  check_same_device(t, ref, name);
  check_dtype(t, ref.scalar_type(), name);
}

void check_contiguous(const at::Tensor& t, at::IntArrayRef shape, const char* name) {
  check_shape(t, shape, name);
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

void check_aligned(const at::Tensor& t, const char* name) {
  TORCH_CHECK(reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name, " must be 16-byte aligned");
}

template <typename T>
at::Tensor step(const at::Tensor& x, const c10::optional<at::Tensor>& z, at::Tensor& conv_state,
                at::Tensor& ssm_state, const at::Tensor& conv_weight, const c10::optional<at::Tensor>& conv_bias,
                const at::Tensor& x_proj, const at::Tensor& x_proj_scales, int64_t group_size,
                const at::Tensor& dt_proj, const at::Tensor& dt_bias, const at::Tensor& A,
                const c10::optional<at::Tensor>& D) {
  const int64_t batch = x.size(0), dim = x.size(1), width = conv_weight.size(1);
  const int64_t dstate = ssm_state.size(2), dt_rank = dt_proj.size(1);
  const auto [ranks, slice] = cluster_step::shape(static_cast<int>(dim), kPiece);
  const int smem = smem_bytes(dim, dt_rank, dstate, sizeof(T));
  at::Tensor y = at::empty({batch, dim}, x.options());
  if (batch == 0) return y;
  W4A16StepArgs<T> args{};
  args.x = static_cast<const T*>(x.data_ptr());
  args.x_st[0] = x.stride(0);
  args.x_st[1] = x.stride(1);
  args.z = z.has_value() ? static_cast<const T*>(z->data_ptr()) : nullptr;
  args.z_st[0] = z.has_value() ? z->stride(0) : 0;
  args.z_st[1] = z.has_value() ? z->stride(1) : 0;
  args.conv_state = static_cast<T*>(conv_state.data_ptr());
  args.conv_weight = static_cast<const T*>(conv_weight.data_ptr());
  args.conv_bias = conv_bias.has_value() ? static_cast<const T*>(conv_bias->data_ptr()) : nullptr;
  args.x_proj = x_proj.data_ptr<uint8_t>();
  args.x_proj_scales = reinterpret_cast<const __half*>(x_proj_scales.data_ptr<at::Half>());
  args.group_size = static_cast<int>(group_size);
  args.dt_proj = static_cast<const T*>(dt_proj.data_ptr());
  args.dt_bias = static_cast<const T*>(dt_bias.data_ptr());
  args.A = A.data_ptr<float>();
  args.D = D.has_value() ? D->data_ptr<float>() : nullptr;
  StepArgs& s = args.step;
  s.state = ssm_state.data_ptr<float>();
  s.batch = static_cast<int>(batch);
  s.dim = static_cast<int>(dim);
  s.dstate = static_cast<int>(dstate);
  s.rows_aligned = dstate == kStates && reinterpret_cast<uintptr_t>(s.state) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(args.A) % 16 == 0;
  args.y = static_cast<T*>(y.data_ptr());
  args.dim = static_cast<int>(dim);
  args.dt_rank = static_cast<int>(dt_rank);
  args.n_out = static_cast<int>(dt_rank + 2 * dstate);
  args.slice = slice;
  args.pitch = cluster_step::row_pitch(slice / 2);
  dispatch_width<T>(static_cast<int>(width), args, ranks, static_cast<int>(batch), smem);
  return y;
}

// x, z: float16 or bfloat16 [batch, dim], in_proj's output (any strides; z optional); conv_state:
// contiguous [batch, dim, width - 1] and conv_weight [dim, width] (width 2 to 4), conv_bias and
// dt_bias [dim], dt_proj [dim, dt_rank], all in x's dtype; ssm_state: contiguous fp32 [batch, dim,
// dstate], both states stepped in place; x_proj: packed uint8 [dt_rank + 2 dstate, dim / 2] with
// fp16 group scales [dt_rank + 2 dstate, dim / group_size] (W4A16Linear's format); A = -exp(A_log)
// and D fp32. The sizes shape_lacks allows; compute capability 9.0. Returns y [batch, dim] in x's
// dtype.
at::Tensor w4a16_ssm_step(const at::Tensor& x, const c10::optional<at::Tensor>& z, at::Tensor& conv_state,
                          at::Tensor& ssm_state, const at::Tensor& conv_weight,
                          const c10::optional<at::Tensor>& conv_bias, const at::Tensor& x_proj,
                          const at::Tensor& x_proj_scales, int64_t group_size, const at::Tensor& dt_proj,
                          const at::Tensor& dt_bias, const at::Tensor& A, const c10::optional<at::Tensor>& D) {
  check_cuda(x, "x");
  TORCH_CHECK(x.scalar_type() == at::kHalf || x.scalar_type() == at::kBFloat16,
              "x must be float16 or bfloat16, got ", x.scalar_type());
  TORCH_CHECK(x.dim() == 2, "x must be [batch, dim], got ", text(x.sizes()));
  const int64_t batch = x.size(0), dim = x.size(1);
  TORCH_CHECK(batch <= 65535, "x batch must be at most 65535, got ", text(batch));
  if (z.has_value()) {
    check_like(*z, x, "z");
    check_shape(*z, {batch, dim}, "z");
  }
  check_like(conv_weight, x, "conv_weight");
  TORCH_CHECK(conv_weight.dim() == 2 && conv_weight.size(0) == dim && conv_weight.size(1) >= 2 &&
                  conv_weight.size(1) <= 4 && conv_weight.is_contiguous(),
              "conv_weight must be contiguous [dim, width] with width 2 to 4, got ", text(conv_weight.sizes()));
  const int64_t width = conv_weight.size(1);
  if (conv_bias.has_value()) {
    check_like(*conv_bias, x, "conv_bias");
    check_contiguous(*conv_bias, {dim}, "conv_bias");
  }
  check_like(conv_state, x, "conv_state");
  check_contiguous(conv_state, {batch, dim, width - 1}, "conv_state");
  check_same_device(ssm_state, x, "ssm_state");
  check_dtype(ssm_state, at::kFloat, "ssm_state");
  TORCH_CHECK(ssm_state.dim() == 3 && ssm_state.size(0) == batch && ssm_state.size(1) == dim &&
                  ssm_state.is_contiguous(),
              "ssm_state must be contiguous [batch, dim, dstate], got ", text(ssm_state.sizes()));
  const int64_t dstate = ssm_state.size(2);
  check_like(dt_proj, x, "dt_proj");
  TORCH_CHECK(dt_proj.dim() == 2 && dt_proj.size(0) == dim, "dt_proj must be [dim, dt_rank], got ",
              text(dt_proj.sizes()));
  const int64_t dt_rank = dt_proj.size(1), n_out = dt_rank + 2 * dstate;
  check_contiguous(dt_proj, {dim, dt_rank}, "dt_proj");
  check_aligned(dt_proj, "dt_proj");
  check_like(dt_bias, x, "dt_bias");
  check_contiguous(dt_bias, {dim}, "dt_bias");
  check_same_device(x_proj, x, "x_proj");
  check_dtype(x_proj, at::kByte, "x_proj");
  check_contiguous(x_proj, {n_out, dim / 2}, "x_proj");
  check_aligned(x_proj, "x_proj");
  TORCH_CHECK(group_size > 0 && dim % group_size == 0, "group_size must divide dim ", text(dim), ", got ",
              text(group_size));
  check_same_device(x_proj_scales, x, "x_proj_scales");
  check_dtype(x_proj_scales, at::kHalf, "x_proj_scales");
  check_contiguous(x_proj_scales, {n_out, dim / group_size}, "x_proj_scales");
  check_same_device(A, x, "A");
  check_dtype(A, at::kFloat, "A");
  check_contiguous(A, {dim, dstate}, "A");
  if (D.has_value()) {
    check_same_device(*D, x, "D");
    check_dtype(*D, at::kFloat, "D");
    check_contiguous(*D, {dim}, "D");
  }
  const std::string lacks = shape_lacks(dim, dt_rank, dstate, group_size, static_cast<int>(x.element_size()));
  TORCH_CHECK(lacks.empty(), "w4a16_ssm_step's cluster kernel: ", lacks);
  const c10::cuda::CUDAGuard guard(x.device());
  TORCH_CHECK(at::cuda::getCurrentDeviceProperties()->major >= 9,
              "w4a16_ssm_step's cluster kernel needs compute capability 9.0 or newer");
  if (x.scalar_type() == at::kHalf) {
    return step<__half>(x, z, conv_state, ssm_state, conv_weight, conv_bias, x_proj, x_proj_scales, group_size,
                        dt_proj, dt_bias, A, D);
  }
  return step<__nv_bfloat16>(x, z, conv_state, ssm_state, conv_weight, conv_bias, x_proj, x_proj_scales,
                             group_size, dt_proj, dt_bias, A, D);
}

// w4a16_ssm_step_lacks(d_inner, dt_rank, d_state, group_size, element_bytes): why the kernel cannot
// step a mixer of these sizes, "" where it can (the Python backend then runs the chain of ops).
std::string w4a16_ssm_step_lacks(int64_t dim, int64_t dt_rank, int64_t dstate, int64_t group_size,
                                 int64_t element_bytes) {
  return shape_lacks(dim, dt_rank, dstate, group_size, static_cast<int>(element_bytes));
}

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "w4a16_ssm_step(Tensor x, Tensor? z, Tensor(a!) conv_state, Tensor(b!) ssm_state, "
      "Tensor conv_weight, Tensor? conv_bias, Tensor x_proj, Tensor x_proj_scales, int group_size, "
      "Tensor dt_proj, Tensor dt_bias, Tensor A, Tensor? D) -> Tensor");
  m.def("w4a16_ssm_step_lacks(int d_inner, int dt_rank, int d_state, int group_size, int element_bytes) -> str",
        &quamba_ssm::w4a16_ssm_step_lacks);
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) { m.impl("w4a16_ssm_step", &quamba_ssm::w4a16_ssm_step); }
