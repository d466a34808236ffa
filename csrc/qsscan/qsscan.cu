// QSScan: the selective scan of Mamba on int8 (or float) inputs, fp32 inside.
// Specification: quamba/ops/qsscan.py (and quamba/ops/selective_scan.py for the recurrence).
//
// Prefill layout of the work. A block owns kWarps·kRows channels of one sequence and walks the
// sequence in chunks of 32·kItems time steps. A small first kernel dequantizes B and C (shared by
// every channel) once into fp32 chunk tiles, already in shared-memory order; per chunk, each block
// copies those tiles with cp.async and stages u, dt, z of its channels as fp32, loading along
// whichever dimension each tensor has contiguous (the module's channel-last tensors and
// channel-first ones both read coalesced). Then each warp scans its kRows channels: lane l owns
// kItems consecutive time steps; for each state n it forms the pairs (decay, drive) =
// (exp(Δ A_n), Δ u B_n), reduces them over its own steps, combines the 32 lane aggregates with a
// shuffle scan (the state carried in from the previous chunk enters at lane 0), and rescans its
// steps from the resulting start state, accumulating C_n · h. No block barrier sits inside the
// scan; B and C are read from shared memory once per state and reused by the kRows channels.
#include <torch/library.h>

#include "../ssm_common/ssm_common.cuh"

namespace quamba_ssm {
namespace {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kMaxState = 32;  // the chunk carry of state n lives in lane n

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// SiLU of the output gate. It only scales y (a float output compared to 1e-3), so the fast
// exponential and division do; the conv, whose int8 output is compared code by code, uses the
// exact silu_rn.
__device__ __forceinline__ float silu_fast(float z) {
  return __fdividef(z, 1.f + exp2_approx(-kLog2e * z));
}

// PyTorch's softplus with the exponential through ex2.approx (a few 1e-7 relative for |x| ≤ 20) and
// the exact log1pf: Δ stays within about 1e-6 of the reference, with fewer instructions.
__device__ __forceinline__ float softplus_fast_exp(float x) {
  return x > 20.f ? x : log1pf(exp2_approx(kLog2e * x));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(address), "l"(gmem));
}

__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;\n" ::); }

// Shared-memory row of one chunk. Time step t of a row sits at pos(t): lane l's kItems steps are
// stored as kItems / 4 groups of 4, and group q of all 32 lanes is contiguous, so a warp's
// 16-byte reads of one group cover 512 contiguous bytes (no bank conflict).
template <int kItems>
struct ChunkRow {
  static_assert(kItems % 4 == 0, "kItems must be a multiple of 4");
  static constexpr int kLen = 32 * kItems;
  static constexpr int kPitch = kLen + 4;  // staged rows start 4 banks apart
  __device__ static int pos(int t) { return (t % kItems / 4) * 128 + (t / kItems) * 4 + t % 4; }
};

struct ScanArgs {
  FloatSource u, dt, z, B, C;  // z.data == nullptr: no gate
  Strides3 u_st, dt_st, z_st, B_st, C_st;
  float* bc;  // the prepared B, C tiles: [batch, chunks, 2, dstate, chunk length]
  const int8_t* A_log;
  float A_log_scale;
  const int8_t* D;
  float D_scale;
  const int8_t* dt_bias;
  float dt_bias_scale;
  void* y;  // out dtype, [batch, dim, seqlen] with strides y_st
  Strides3 y_st;
  void* state;           // contiguous [batch, dim, dstate]: int8 when state_int8, else fp32
  bool state_int8;
  float state_inv_scale;
  int dim, dstate, seqlen, chunks;
};

// Loads rows [row0, row0 + rows) × the chunk's time steps of one input into a tile (row pitch
// kPitch, time steps at pos(t)) as fp32, zero outside the tensor. Consecutive threads follow the
// dimension with stride 1.
template <int kItems, int kPitch, int kThreads, typename T>
__device__ __forceinline__ void stage_typed(float* tile, const T* data, float scale,
                                            const Strides3& st, int b, int row0, int rows,
                                            int row_limit, int t0, int seqlen) {
  using Row = ChunkRow<kItems>;
  const bool row_fast = st.dim == 1 && st.time != 1;
  const T* base = data + b * st.batch + row0 * st.dim + t0 * st.time;
  const int rows_left = row_limit - row0, steps_left = seqlen - t0;
#pragma unroll 4
  for (int e = threadIdx.x; e < rows * Row::kLen; e += kThreads) {
    const int r = row_fast ? e % rows : e / Row::kLen;
    const int t = row_fast ? e / rows : e % Row::kLen;
    float value = 0.f;
    if (r < rows_left && t < steps_left) value = dequantize(base[r * st.dim + t * st.time], scale);
    tile[r * kPitch + Row::pos(t)] = value;
  }
}

template <int kItems, int kPitch, int kThreads>
__device__ __forceinline__ void stage_rows(float* tile, const FloatSource& src,
                                           const Strides3& st, int b, int row0, int rows,
                                           int row_limit, int t0, int seqlen) {
  switch (src.kind) {
    case InKind::kInt8:
      return stage_typed<kItems, kPitch, kThreads>(tile, static_cast<const int8_t*>(src.data),
                                                   src.scale, st, b, row0, rows, row_limit, t0,
                                                   seqlen);
    case InKind::kHalf:
      return stage_typed<kItems, kPitch, kThreads>(tile, static_cast<const __half*>(src.data),
                                                   src.scale, st, b, row0, rows, row_limit, t0,
                                                   seqlen);
    case InKind::kBFloat16:
      return stage_typed<kItems, kPitch, kThreads>(
          tile, static_cast<const __nv_bfloat16*>(src.data), src.scale, st, b, row0, rows,
          row_limit, t0, seqlen);
    default:
      return stage_typed<kItems, kPitch, kThreads>(tile, static_cast<const float*>(src.data),
                                                   src.scale, st, b, row0, rows, row_limit, t0,
                                                   seqlen);
  }
}

// Row and time step of element e of a tile, consecutive e following the tensor's stride-1
// dimension.
struct TileIndex {
  int r, t;
};

template <int kLen>
__device__ __forceinline__ TileIndex tile_index(int e, int rows, bool row_fast) {
  return row_fast ? TileIndex{e % rows, e / rows} : TileIndex{e / kLen, e % kLen};
}

// The int8 codes of a [kTileRows × chunk] tile that this thread stages (zero outside the tensor).
template <int kItems, int kThreads, int kTileRows, int kPerThread>
__device__ __forceinline__ void load_codes(int8_t (&codes)[kPerThread], const FloatSource& src,
                                           const Strides3& st, int b, int d0, int dim, int t0,
                                           int seqlen) {
  const bool row_fast = st.dim == 1 && st.time != 1;
  const int8_t* base = static_cast<const int8_t*>(src.data) + b * st.batch + d0 * st.dim +
                       t0 * st.time;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const TileIndex at =
        tile_index<ChunkRow<kItems>::kLen>(threadIdx.x + k * kThreads, kTileRows, row_fast);
    const bool inside = at.r < dim - d0 && at.t < seqlen - t0;
    codes[k] = inside ? base[at.r * st.dim + at.t * st.time] : 0;
  }
}

template <int kItems, int kThreads, int kTileRows, int kPerThread>
__device__ __forceinline__ void store_codes(float* tile, const int8_t (&codes)[kPerThread],
                                            const FloatSource& src, const Strides3& st) {
  using Row = ChunkRow<kItems>;
  const bool row_fast = st.dim == 1 && st.time != 1;
#pragma unroll
  for (int k = 0; k < kPerThread; ++k) {
    const TileIndex at = tile_index<Row::kLen>(threadIdx.x + k * kThreads, kTileRows, row_fast);
    tile[at.r * Row::kPitch + Row::pos(at.t)] = dequantize(codes[k], src.scale);
  }
}

// The u, dt (and z) tiles of a chunk when all are int8 codes, the deployed case: every load of
// the chunk is issued before the first is used, so the chunk waits for memory once.
template <int kItems, int kThreads, int kTileRows>
__device__ __forceinline__ void stage_int8_tiles(float* u_tile, float* dt_tile, float* z_tile,
                                                 const ScanArgs& a, int b, int d0, int t0) {
  constexpr int kPerThread = kTileRows * ChunkRow<kItems>::kLen / kThreads;
  static_assert(kTileRows * ChunkRow<kItems>::kLen % kThreads == 0, "uneven tile split");
  int8_t u[kPerThread], dt[kPerThread], z[kPerThread];
  load_codes<kItems, kThreads, kTileRows>(u, a.u, a.u_st, b, d0, a.dim, t0, a.seqlen);
  load_codes<kItems, kThreads, kTileRows>(dt, a.dt, a.dt_st, b, d0, a.dim, t0, a.seqlen);
  if (z_tile != nullptr) {
    load_codes<kItems, kThreads, kTileRows>(z, a.z, a.z_st, b, d0, a.dim, t0, a.seqlen);
  }
  store_codes<kItems, kThreads, kTileRows>(u_tile, u, a.u, a.u_st);
  store_codes<kItems, kThreads, kTileRows>(dt_tile, dt, a.dt, a.dt_st);
  if (z_tile != nullptr) store_codes<kItems, kThreads, kTileRows>(z_tile, z, a.z, a.z_st);
}

constexpr int kPrepareThreads = 256;

// B and C of chunk blockIdx.x of sequence blockIdx.y as fp32 tiles in shared-memory order
// (pitch = chunk length), so every scan block copies them instead of converting them again.
template <int kItems>
__global__ void __launch_bounds__(kPrepareThreads) prepare_bc_kernel(const ScanArgs a) {
  using Row = ChunkRow<kItems>;
  const int chunk = blockIdx.x, b = blockIdx.y;
  float* tile = a.bc + (static_cast<int64_t>(b) * a.chunks + chunk) * 2 * a.dstate * Row::kLen;
  const int t0 = chunk * Row::kLen;
  stage_rows<kItems, Row::kLen, kPrepareThreads>(tile, a.B, a.B_st, b, 0, a.dstate, a.dstate, t0,
                                                 a.seqlen);
  stage_rows<kItems, Row::kLen, kPrepareThreads>(tile + a.dstate * Row::kLen, a.C, a.C_st, b, 0,
                                                 a.dstate, a.dstate, t0, a.seqlen);
}

template <int kItems>
__device__ __forceinline__ void load_items(const float* row, int lane, float (&v)[kItems]) {
#pragma unroll
  for (int q = 0; q < kItems / 4; ++q) {
    const float4 g = *reinterpret_cast<const float4*>(row + q * 128 + lane * 4);
    v[4 * q] = g.x, v[4 * q + 1] = g.y, v[4 * q + 2] = g.z, v[4 * q + 3] = g.w;
  }
}

template <int kItems>
__device__ __forceinline__ void store_items(float* row, int lane, const float (&v)[kItems]) {
#pragma unroll
  for (int q = 0; q < kItems / 4; ++q) {
    *reinterpret_cast<float4*>(row + q * 128 + lane * 4) =
        make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);
  }
}

// Inclusive scan over the warp of segment pairs (decay, end state): after it, lane l holds the
// state at the end of its steps given everything before it.
__device__ __forceinline__ float warp_scan_state(float decay, float state, int lane) {
#pragma unroll
  for (int offset = 1; offset < 32; offset *= 2) {
    const float prev_decay = __shfl_up_sync(kFullMask, decay, offset);
    const float prev_state = __shfl_up_sync(kFullMask, state, offset);
    const bool has_prev = lane >= offset;  // selects, not branches: no divergence
    state = has_prev ? fmaf(decay, prev_state, state) : state;
    decay = has_prev ? decay * prev_decay : decay;
  }
  return state;
}

// One warp's work on one chunk: kRows channels (tile rows row0 ...), kItems steps per lane.
// carry[r] in lane n is the state n of row r at the chunk start, and at return its end.
// Leaves y = (C · h + D u) ⊙ silu(z) in the u tile.
template <int kRows, int kItems, int kUnrollStates>
__device__ __forceinline__ void scan_chunk(float* u_tile, const float* dt_tile,
                                           const float* z_tile, const float* B_tile,
                                           const float* C_tile, const float* A2_tile,
                                           const ScanArgs& a, int row0, int d0, int t0,
                                           const float (&bias)[kRows], const float (&skip)[kRows],
                                           float (&carry)[kRows]) {
  using Row = ChunkRow<kItems>;
  const int lane = threadIdx.x % 32;
  float delta[kRows][kItems], drive_base[kRows][kItems], acc[kRows][kItems], delta_sum[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float dt[kItems], u[kItems];
    load_items(dt_tile + (row0 + r) * Row::kPitch, lane, dt);
    load_items(u_tile + (row0 + r) * Row::kPitch, lane, u);
    const bool row_valid = d0 + row0 + r < a.dim;
    delta_sum[r] = 0.f;
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const bool valid = row_valid && t0 + lane * kItems + i < a.seqlen;
      // Padding steps get Δ = 0: decay 1, drive 0, so the carried state passes through.
      delta[r][i] = valid ? softplus_fast_exp(__fadd_rn(dt[i], bias[r])) : 0.f;
      drive_base[r][i] = __fmul_rn(delta[r][i], u[i]);
      delta_sum[r] += delta[r][i];
      acc[r][i] = 0.f;
    }
    // Opaque to the compiler, which otherwise re-adds the kItems deltas for every state.
    asm volatile("" : "+f"(delta_sum[r]));
  }
#pragma unroll kUnrollStates
  for (int n = 0; n < a.dstate; ++n) {
    float B[kItems], C[kItems];
    load_items(B_tile + n * Row::kLen, lane, B);
    load_items(C_tile + n * Row::kLen, lane, C);
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const float A2 = A2_tile[(row0 + r) * a.dstate + n];
      float decay[kItems], drive[kItems];
      float end_state = 0.f;
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        decay[i] = exp2_approx(delta[r][i] * A2);
        drive[i] = drive_base[r][i] * B[i];
        end_state = fmaf(decay[i], end_state, drive[i]);
      }
      // The product of the lane's decays is exp(A Σ Δ): one exponential instead of kItems products.
      const float lane_decay = exp2_approx(delta_sum[r] * A2);
      const float chunk_start = __shfl_sync(kFullMask, carry[r], n);
      end_state = lane == 0 ? fmaf(lane_decay, chunk_start, end_state) : end_state;
      end_state = warp_scan_state(lane_decay, end_state, lane);
      const float prev_end = __shfl_up_sync(kFullMask, end_state, 1);
      float h = lane == 0 ? chunk_start : prev_end;
      const float chunk_end = __shfl_sync(kFullMask, end_state, 31);
      carry[r] = lane == n ? chunk_end : carry[r];
#pragma unroll
      for (int i = 0; i < kItems; ++i) {
        h = fmaf(decay[i], h, drive[i]);
        acc[r][i] = fmaf(C[i], h, acc[r][i]);
      }
    }
  }
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    float* u_row = u_tile + (row0 + r) * Row::kPitch;
    float u[kItems], gate[kItems];
    load_items(u_row, lane, u);
    if (z_tile != nullptr) {
      load_items(z_tile + (row0 + r) * Row::kPitch, lane, gate);
#pragma unroll
      for (int i = 0; i < kItems; ++i) gate[i] = silu_fast(gate[i]);
    }
#pragma unroll
    for (int i = 0; i < kItems; ++i) {
      const float y = __fadd_rn(acc[r][i], __fmul_rn(u[i], skip[r]));
      acc[r][i] = z_tile != nullptr ? __fmul_rn(y, gate[i]) : y;
    }
    store_items(u_row, lane, acc[r]);
  }
}

// Writes the chunk's y (in the u tile) to global memory, coalesced along y's stride-1 dimension.
template <int kItems, int kThreads, typename Out>
__device__ __forceinline__ void store_y(const float* y_tile, const ScanArgs& a, int b, int d0,
                                        int rows, int t0) {
  using Row = ChunkRow<kItems>;
  const Strides3& st = a.y_st;
  const bool row_fast = st.dim == 1 && st.time != 1;
  Out* y = static_cast<Out*>(a.y) + b * st.batch + d0 * st.dim + t0 * st.time;
  const int rows_left = a.dim - d0, steps_left = a.seqlen - t0;
#pragma unroll 4
  for (int e = threadIdx.x; e < rows * Row::kLen; e += kThreads) {
    const int r = row_fast ? e % rows : e / Row::kLen;
    const int t = row_fast ? e / rows : e % Row::kLen;
    if (r < rows_left && t < steps_left) {
      y[r * st.dim + t * st.time] = from_float<Out>(y_tile[r * Row::kPitch + Row::pos(t)]);
    }
  }
}

// Shared memory of a scan block, in floats: the u, dt, z tiles, the B and C tiles, A · log2(e).
template <int kChannels, int kItems>
int scan_smem_floats(int dstate) {
  using Row = ChunkRow<kItems>;
  return 3 * kChannels * Row::kPitch + 2 * dstate * Row::kLen + kChannels * dstate;
}

template <int kWarps, int kRows, int kItems, bool kFusedStaging, int kUnrollStates, typename Out>
__global__ void __launch_bounds__(kWarps * 32)
qsscan_kernel(const ScanArgs a) {
  using Row = ChunkRow<kItems>;
  constexpr int kChannels = kWarps * kRows, kThreads = kWarps * 32;
  extern __shared__ float4 smem_vec[];
  float* u_tile = reinterpret_cast<float*>(smem_vec);
  float* dt_tile = u_tile + kChannels * Row::kPitch;
  float* z_tile = dt_tile + kChannels * Row::kPitch;
  float* B_tile = z_tile + kChannels * Row::kPitch;  // then the C tile: dstate rows each
  float* C_tile = B_tile + a.dstate * Row::kLen;
  float* A2_tile = C_tile + a.dstate * Row::kLen;  // [kChannels, dstate]: A · log2(e)

  const int b = blockIdx.y;
  const int d0 = blockIdx.x * kChannels;
  const int row0 = threadIdx.x / 32 * kRows;
  const bool has_z = a.z.data != nullptr;
  const bool all_int8 = a.u.kind == InKind::kInt8 && a.dt.kind == InKind::kInt8 &&
                        (!has_z || a.z.kind == InKind::kInt8);
  const int tile_bc = a.dstate * Row::kLen;  // floats in the B tile, and in the C tile

  for (int e = threadIdx.x; e < kChannels * a.dstate; e += kThreads) {
    const int d = d0 + e / a.dstate;
    const float A_log =
        d < a.dim ? dequantize(a.A_log[d * a.dstate + e % a.dstate], a.A_log_scale) : 0.f;
    A2_tile[e] = d < a.dim ? __fmul_rn(-expf(A_log), kLog2e) : 0.f;
  }
  float bias[kRows], skip[kRows], carry[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int d = d0 + row0 + r;
    bias[r] = d < a.dim ? dequantize(a.dt_bias[d], a.dt_bias_scale) : 0.f;
    skip[r] = d < a.dim ? dequantize(a.D[d], a.D_scale) : 0.f;
    carry[r] = 0.f;
  }

  for (int chunk = 0; chunk < a.chunks; ++chunk) {
    const int t0 = chunk * Row::kLen;
    __syncthreads();  // the previous chunk's tiles are consumed
    const float* bc = a.bc + (static_cast<int64_t>(b) * a.chunks + chunk) * 2 * tile_bc;
    for (int i = threadIdx.x; i < tile_bc / 2; i += kThreads) {
      cp_async16(B_tile + 4 * i, bc + 4 * i);
    }
    if (kFusedStaging && all_int8) {
      stage_int8_tiles<kItems, kThreads, kChannels>(u_tile, dt_tile, has_z ? z_tile : nullptr, a,
                                                    b, d0, t0);
    } else {
      stage_rows<kItems, Row::kPitch, kThreads>(u_tile, a.u, a.u_st, b, d0, kChannels, a.dim, t0,
                                                a.seqlen);
      stage_rows<kItems, Row::kPitch, kThreads>(dt_tile, a.dt, a.dt_st, b, d0, kChannels, a.dim,
                                                t0, a.seqlen);
      if (has_z) {
        stage_rows<kItems, Row::kPitch, kThreads>(z_tile, a.z, a.z_st, b, d0, kChannels, a.dim,
                                                  t0, a.seqlen);
      }
    }
    cp_async_wait_all();
    __syncthreads();
    scan_chunk<kRows, kItems, kUnrollStates>(u_tile, dt_tile, has_z ? z_tile : nullptr, B_tile,
                                             C_tile, A2_tile, a, row0, d0, t0, bias, skip, carry);
    __syncthreads();
    store_y<kItems, kThreads, Out>(u_tile, a, b, d0, kChannels, t0);
  }

  const int lane = threadIdx.x % 32;
  if (lane < a.dstate) {
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const int d = d0 + row0 + r;
      if (d >= a.dim) continue;
      const int64_t offset = (static_cast<int64_t>(b) * a.dim + d) * a.dstate + lane;
      if (a.state_int8) {
        static_cast<int8_t*>(a.state)[offset] = quantize_rn(carry[r], a.state_inv_scale);
      } else {
        static_cast<float*>(a.state)[offset] = carry[r];
      }
    }
  }
}

template <int kWarps, int kRows, int kItems, bool kFusedStaging, int kUnrollStates, typename Out>
void launch_scan_config(ScanArgs args, const at::Tensor& u) {
  using Row = ChunkRow<kItems>;
  const int batch = u.size(0);
  args.chunks = ceil_div(args.seqlen, Row::kLen);
  const at::Tensor bc =
      at::empty({batch, args.chunks, 2, args.dstate, Row::kLen}, u.options().dtype(at::kFloat));
  args.bc = bc.data_ptr<float>();

  auto prepare = prepare_bc_kernel<kItems>;
  check_kernel_image(prepare, "qsscan");
  prepare<<<dim3(args.chunks, batch), kPrepareThreads, 0, current_stream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  auto kernel = qsscan_kernel<kWarps, kRows, kItems, kFusedStaging, kUnrollStates, Out>;
  check_kernel_image(kernel, "qsscan");
  const int smem = scan_smem_floats<kWarps * kRows, kItems>(args.dstate) * sizeof(float);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const dim3 grid(ceil_div(args.dim, kWarps * kRows), batch);
  kernel<<<grid, kWarps * 32, smem, current_stream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Launch configurations <warps, rows per warp, steps per lane, fused int8 staging, states per
// unrolled step>, timed against each other by benchmarks/bench_ssm.py --configs. On the H200
// (batch 1, d_inner 5120, L 1024 / 2048): config 0 188 / 348 µs (71 registers, 3 blocks per SM),
// config 1 145 / 264 µs (124 registers, 2 blocks per SM), config 2 144 / 259 µs (the same with two
// states in flight, within noise of config 1). The schema's default is config 1.
constexpr int kScanConfigs = 3;

template <typename Out>
void launch_scan(const ScanArgs& args, const at::Tensor& u, int64_t config) {
  switch (config) {
    case 0: return launch_scan_config<8, 1, 8, false, 1, Out>(args, u);
    case 1: return launch_scan_config<8, 1, 8, true, 1, Out>(args, u);
    default: return launch_scan_config<8, 1, 8, true, 2, Out>(args, u);
  }
}

FloatSource float_source(const at::Tensor& t, double scale, const char* name,
                         const char* scale_name) {
  const InKind kind = in_kind(t, name);
  if (kind == InKind::kInt8) check_positive_scale(scale, scale_name);
  return FloatSource{t.data_ptr(), kind, to_fp32(scale)};
}

Strides3 strides3(const at::Tensor& t) { return Strides3{t.stride(0), t.stride(1), t.stride(2)}; }

// A_log [dim, dstate], D and dt_bias [dim]: contiguous int8 codes with positive scales.
void check_ssm_params(const at::Tensor& ref, const at::Tensor& A_log, double A_log_scale,
                      const at::Tensor& D, double D_scale, const at::Tensor& dt_bias,
                      double dt_bias_scale, int64_t dim, int64_t dstate) {
  const std::pair<const at::Tensor*, const char*> params[] = {
      {&A_log, "A_log"}, {&D, "D"}, {&dt_bias, "dt_bias"}};
  for (const auto& [t, name] : params) {
    check_same_device(*t, ref, name);
    check_dtype(*t, at::kChar, name);
    TORCH_CHECK(t->is_contiguous(), name, " must be contiguous");
  }
  check_shape(A_log, {dim, dstate}, "A_log");
  check_shape(D, {dim}, "D");
  check_shape(dt_bias, {dim}, "dt_bias");
  check_positive_scale(A_log_scale, "A_log_scale");
  check_positive_scale(D_scale, "D_scale");
  check_positive_scale(dt_bias_scale, "dt_bias_scale");
}

void check_out_dtype(at::ScalarType out_dtype) {
  TORCH_CHECK(out_dtype == at::kHalf || out_dtype == at::kBFloat16 || out_dtype == at::kFloat,
              "out_dtype must be float16, bfloat16 or float32, got ", out_dtype);
}

// u, dt, z: [batch, dim, seqlen]; B, C: [batch, dstate, seqlen]; any strides, each int8 codes
// with its scale or float16/bfloat16/float32 values. y keeps u's layout family (channel-last
// when u.stride(1) == 1, else contiguous); the last state is contiguous [batch, dim, dstate],
// int8 when state_inv_scale is given, else fp32.
std::tuple<at::Tensor, at::Tensor> qsscan(
    const at::Tensor& u, double u_scale, const at::Tensor& dt, double dt_scale,
    const at::Tensor& B, double B_scale, const at::Tensor& C, double C_scale,
    const c10::optional<at::Tensor>& z, double z_scale, const at::Tensor& A_log,
    double A_log_scale, const at::Tensor& D, double D_scale, const at::Tensor& dt_bias,
    double dt_bias_scale, c10::optional<double> state_inv_scale, at::ScalarType out_dtype,
    int64_t config) {
  check_cuda(u, "u");
  TORCH_CHECK(u.dim() == 3, "u must be [batch, dim, seqlen], got ", text(u.sizes()));
  const int64_t batch = u.size(0), dim = u.size(1), seqlen = u.size(2);
  TORCH_CHECK(A_log.dim() == 2, "A_log must be [dim, dstate], got ", text(A_log.sizes()));
  const int64_t dstate = A_log.size(1);
  TORCH_CHECK(dstate >= 1 && dstate <= kMaxState, "A_log: dstate must be in 1..", text(kMaxState),
              ", got ", text(dstate));
  TORCH_CHECK(batch <= 65535, "u batch must be at most 65535, got ", text(batch));
  TORCH_CHECK(dim < (int64_t{1} << 31) && seqlen < (int64_t{1} << 31),
              "u dim and seqlen must be below 2^31");
  check_same_device(dt, u, "dt");
  check_shape(dt, u.sizes(), "dt");
  check_same_device(B, u, "B");
  check_shape(B, {batch, dstate, seqlen}, "B");
  check_same_device(C, u, "C");
  check_shape(C, {batch, dstate, seqlen}, "C");
  if (z.has_value()) {
    check_same_device(*z, u, "z");
    check_shape(*z, u.sizes(), "z");
  }
  check_ssm_params(u, A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale, dim, dstate);
  check_out_dtype(out_dtype);
  if (state_inv_scale.has_value()) check_positive_scale(*state_inv_scale, "state_inv_scale");
  TORCH_CHECK(config >= 0 && config < kScanConfigs, "config must be in 0..",
              text(kScanConfigs - 1), ", got ", text(config));
  const c10::cuda::CUDAGuard guard(u.device());

  const bool channel_fast = u.stride(1) == 1 && u.stride(2) != 1;
  at::Tensor y = channel_fast
                     ? at::empty({batch, seqlen, dim}, u.options().dtype(out_dtype)).transpose(1, 2)
                     : at::empty({batch, dim, seqlen}, u.options().dtype(out_dtype));
  const auto state_type = state_inv_scale.has_value() ? at::kChar : at::kFloat;
  at::Tensor state = at::empty({batch, dim, dstate}, u.options().dtype(state_type));

  ScanArgs args{};
  args.u = float_source(u, u_scale, "u", "u_scale");
  args.dt = float_source(dt, dt_scale, "dt", "dt_scale");
  args.B = float_source(B, B_scale, "B", "B_scale");
  args.C = float_source(C, C_scale, "C", "C_scale");
  args.z = z.has_value() ? float_source(*z, z_scale, "z", "z_scale")
                         : FloatSource{nullptr, InKind::kFloat, 1.f};
  args.u_st = strides3(u);
  args.dt_st = strides3(dt);
  args.B_st = strides3(B);
  args.C_st = strides3(C);
  args.z_st = z.has_value() ? strides3(*z) : Strides3{0, 0, 0};
  args.A_log = A_log.data_ptr<int8_t>();
  args.A_log_scale = to_fp32(A_log_scale);
  args.D = D.data_ptr<int8_t>();
  args.D_scale = to_fp32(D_scale);
  args.dt_bias = dt_bias.data_ptr<int8_t>();
  args.dt_bias_scale = to_fp32(dt_bias_scale);
  args.y = y.data_ptr();
  args.y_st = strides3(y);
  args.state = state.data_ptr();
  args.state_int8 = state_inv_scale.has_value();
  args.state_inv_scale = state_inv_scale.has_value() ? to_fp32(*state_inv_scale) : 0.f;
  args.dim = dim;
  args.dstate = dstate;
  args.seqlen = seqlen;

  if (batch == 0 || dim == 0) return {y, state};
  if (seqlen == 0) {
    state.zero_();  // no step taken: the state stays the zero initial state
    return {y, state};
  }
  switch (out_dtype) {
    case at::kHalf: launch_scan<__half>(args, u, config); break;
    case at::kBFloat16: launch_scan<__nv_bfloat16>(args, u, config); break;
    default: launch_scan<float>(args, u, config); break;
  }
  return {y, state};
}

// ---- decode step ---------------------------------------------------------------------------

struct StepArgs {
  FloatSource u, dt, z, B, C;  // z.data == nullptr: no gate
  int64_t u_st[2], dt_st[2], z_st[2], B_st[2], C_st[2];  // (batch, element) strides
  const int8_t* A_log;
  float A_log_scale;
  const int8_t* D;
  float D_scale;
  const int8_t* dt_bias;
  float dt_bias_scale;
  void* state;  // contiguous [batch, dim, dstate], int8 (with state_scale) or fp32, in place
  bool state_int8;
  float state_scale, state_inv_scale;
  void* y;  // contiguous [batch, dim]
  int batch, dim, dstate;
};

constexpr int kStepThreads = 128;

// Steps state n of (b, d) in place and returns its term C_n · h_n of y. The arithmetic follows
// selective_state_update operation by operation (decay · h + (Δ u) · B, separately rounded).
__device__ __forceinline__ float step_state(const StepArgs& a, int b, int d, int n, int group,
                                            float u) {
  const float dt = a.dt.load(b * a.dt_st[0] + d * a.dt_st[1]);
  const float delta = softplus(__fadd_rn(dt, dequantize(a.dt_bias[d], a.dt_bias_scale)));
  const int64_t offset = static_cast<int64_t>(group) * a.dstate + n;
  const float h = a.state_int8 ? dequantize(static_cast<int8_t*>(a.state)[offset], a.state_scale)
                               : static_cast<float*>(a.state)[offset];
  const float A = -expf(dequantize(a.A_log[d * a.dstate + n], a.A_log_scale));
  const float decay = expf(__fmul_rn(delta, A));
  const float B = a.B.load(b * a.B_st[0] + n * a.B_st[1]);
  const float C = a.C.load(b * a.C_st[0] + n * a.C_st[1]);
  const float h_new = __fadd_rn(__fmul_rn(decay, h), __fmul_rn(__fmul_rn(delta, u), B));
  if (a.state_int8) {
    static_cast<int8_t*>(a.state)[offset] = quantize_rn(h_new, a.state_inv_scale);
  } else {
    static_cast<float*>(a.state)[offset] = h_new;
  }
  return __fmul_rn(h_new, C);
}

// One group of kGroup lanes per (batch, channel): lane n of the group steps state n, and the
// group sums C · h with shuffles.
template <int kGroup, typename Out>
__global__ void __launch_bounds__(kStepThreads) qsscan_update_kernel(const StepArgs a) {
  const int group = (blockIdx.x * kStepThreads + threadIdx.x) / kGroup;
  const int n = threadIdx.x % kGroup;
  // Lanes past the end stay for the shuffles below (they need the whole warp).
  const bool valid_group = group < a.batch * a.dim;
  const int b = valid_group ? group / a.dim : 0, d = valid_group ? group % a.dim : 0;
  float contribution = 0.f, u = 0.f;
  if (valid_group) {
    u = a.u.load(b * a.u_st[0] + d * a.u_st[1]);
    if (n < a.dstate) contribution = step_state(a, b, d, n, group, u);
  }
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2) {
    contribution += __shfl_xor_sync(kFullMask, contribution, offset, kGroup);
  }
  if (valid_group && n == 0) {
    float y = __fadd_rn(contribution, __fmul_rn(u, dequantize(a.D[d], a.D_scale)));
    if (a.z.data != nullptr) y = __fmul_rn(y, silu_rn(a.z.load(b * a.z_st[0] + d * a.z_st[1])));
    static_cast<Out*>(a.y)[group] = from_float<Out>(y);
  }
}

template <int kGroup, typename Out>
void launch_step_group(const StepArgs& args) {
  auto kernel = qsscan_update_kernel<kGroup, Out>;
  check_kernel_image(kernel, "qsscan_update");
  const int64_t threads = int64_t{args.batch} * args.dim * kGroup;
  kernel<<<ceil_div(threads, kStepThreads), kStepThreads, 0,
           current_stream()>>>(args);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename Out>
void launch_step(const StepArgs& args) {
  if (args.dstate <= 8) return launch_step_group<8, Out>(args);
  if (args.dstate <= 16) return launch_step_group<16, Out>(args);
  return launch_step_group<32, Out>(args);
}

void fill_step_input(const at::Tensor& t, double scale, const char* name, const char* scale_name,
                     FloatSource& src, int64_t (&strides)[2]) {
  src = float_source(t, scale, name, scale_name);
  strides[0] = t.stride(0);
  strides[1] = t.stride(1);
}

// state: contiguous [batch, dim, dstate], int8 (stepped through state_scale) or fp32, updated in
// place; u, dt, z: [batch, dim]; B, C: [batch, dstate]; any strides. Returns contiguous y.
at::Tensor qsscan_update(at::Tensor& state, double state_scale, const at::Tensor& u,
                         double u_scale, const at::Tensor& dt, double dt_scale,
                         const at::Tensor& B, double B_scale, const at::Tensor& C,
                         double C_scale, const c10::optional<at::Tensor>& z, double z_scale,
                         const at::Tensor& A_log, double A_log_scale, const at::Tensor& D,
                         double D_scale, const at::Tensor& dt_bias, double dt_bias_scale,
                         at::ScalarType out_dtype) {
  check_cuda(u, "u");
  TORCH_CHECK(u.dim() == 2, "u must be [batch, dim], got ", text(u.sizes()));
  const int64_t batch = u.size(0), dim = u.size(1);
  check_same_device(state, u, "state");
  TORCH_CHECK(state.dim() == 3 && state.size(0) == batch && state.size(1) == dim,
              "state must be [batch, dim, dstate] = [", text(batch), ", ", text(dim),
              ", dstate], got ", text(state.sizes()));
  const int64_t dstate = state.size(2);
  TORCH_CHECK(dstate >= 1 && dstate <= kMaxState, "state: dstate must be in 1..", text(kMaxState),
              ", got ", text(dstate));
  TORCH_CHECK(state.scalar_type() == at::kChar || state.scalar_type() == at::kFloat,
              "state must be int8 or float32, got ", state.scalar_type());
  TORCH_CHECK(state.is_contiguous(), "state must be contiguous");
  TORCH_CHECK(batch * dim * 32 < (int64_t{1} << 31), "state: batch · dim too large");
  if (state.scalar_type() == at::kChar) check_positive_scale(state_scale, "state_scale");
  check_same_device(dt, u, "dt");
  check_shape(dt, {batch, dim}, "dt");
  check_same_device(B, u, "B");
  check_shape(B, {batch, dstate}, "B");
  check_same_device(C, u, "C");
  check_shape(C, {batch, dstate}, "C");
  if (z.has_value()) {
    check_same_device(*z, u, "z");
    check_shape(*z, {batch, dim}, "z");
  }
  check_ssm_params(u, A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale, dim, dstate);
  check_out_dtype(out_dtype);
  const c10::cuda::CUDAGuard guard(u.device());

  at::Tensor y = at::empty({batch, dim}, u.options().dtype(out_dtype));
  if (batch == 0 || dim == 0) return y;
  StepArgs args{};
  fill_step_input(u, u_scale, "u", "u_scale", args.u, args.u_st);
  fill_step_input(dt, dt_scale, "dt", "dt_scale", args.dt, args.dt_st);
  fill_step_input(B, B_scale, "B", "B_scale", args.B, args.B_st);
  fill_step_input(C, C_scale, "C", "C_scale", args.C, args.C_st);
  if (z.has_value()) {
    fill_step_input(*z, z_scale, "z", "z_scale", args.z, args.z_st);
  } else {
    args.z = FloatSource{nullptr, InKind::kFloat, 1.f};
  }
  args.A_log = A_log.data_ptr<int8_t>();
  args.A_log_scale = to_fp32(A_log_scale);
  args.D = D.data_ptr<int8_t>();
  args.D_scale = to_fp32(D_scale);
  args.dt_bias = dt_bias.data_ptr<int8_t>();
  args.dt_bias_scale = to_fp32(dt_bias_scale);
  args.state = state.data_ptr();
  args.state_int8 = state.scalar_type() == at::kChar;
  args.state_scale = to_fp32(state_scale);
  args.state_inv_scale = args.state_int8 ? reciprocal(state_scale) : 0.f;
  args.y = y.data_ptr();
  args.batch = batch;
  args.dim = dim;
  args.dstate = dstate;
  switch (out_dtype) {
    case at::kHalf: launch_step<__half>(args); break;
    case at::kBFloat16: launch_step<__nv_bfloat16>(args); break;
    default: launch_step<float>(args); break;
  }
  return y;
}

}  // namespace
}  // namespace quamba_ssm

TORCH_LIBRARY_FRAGMENT(quamba, m) {
  m.def(
      "qsscan(Tensor u, float u_scale, Tensor dt, float dt_scale, Tensor B, float B_scale, "
      "Tensor C, float C_scale, Tensor? z, float z_scale, Tensor A_log, float A_log_scale, "
      "Tensor D, float D_scale, Tensor dt_bias, float dt_bias_scale, float? state_inv_scale, "
      "ScalarType out_dtype, int config=1) -> (Tensor, Tensor)");
  m.def(
      "qsscan_update(Tensor(a!) state, float state_scale, Tensor u, float u_scale, Tensor dt, "
      "float dt_scale, Tensor B, float B_scale, Tensor C, float C_scale, Tensor? z, "
      "float z_scale, Tensor A_log, float A_log_scale, Tensor D, float D_scale, "
      "Tensor dt_bias, float dt_bias_scale, ScalarType out_dtype) -> Tensor");
}

TORCH_LIBRARY_IMPL(quamba, CUDA, m) {
  m.impl("qsscan", &quamba_ssm::qsscan);
  m.impl("qsscan_update", &quamba_ssm::qsscan_update);
}
