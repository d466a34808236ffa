// What it showed (fresh H200s, 2026-11-27; benchmarks/RESULTS.md, "Decode at batch 8-64"): at 8 rows
// of x the bulk-copy ring GEMV took in_proj in 7.84 us against 10.06 for the dp4a replica and out_proj
// in 5.48 against 7.36 (plain read of the bytes: 5.88 and 3.00); at 1 row it was slower (in_proj 7.78
// against 7.59, out_proj 5.47 against 4.41). About 4.1 us a layer saved at batch 8: W8A8 batch-8 TPOT
// near 1.85 ms, 1.85x mamba-ssm, an estimate short of #26's 2x; not built into the library. Logs:
// benchmarks/results/2026-11-27e-h200/ring_gemv.log, ring_gemv_meet_own.log, ring_gemv_blocks.log.
// It is the lead for a batch-8 decode GEMV. Run from the repository root (no arguments; prints each
// variant's time and whether its sums are exact):
//   nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o /tmp/ring_gemv benchmarks/experiments/ring_gemv.cu
//   /tmp/ring_gemv
// (Moved from benchmarks/results/2026-11-27e-h200/; last there at commit 6789cb4.)
//
// Experiment: an int8 GEMV for 1-8 rows of x whose weights stream through a shared-memory ring of
// bulk copies (a producer warp starts before the programmatic wait), multiplied on mma.sync
// m16n8k32 with x's rows as A (rows 8..15 zero) and 8 weight rows as B, against a replica of
// gemm/gemv.cu's dp4a kernel (4 rows a warp, x staged at splits 1, as its dispatcher picks) and a
// plain streaming read of the same bytes. A piece is 8 weight rows over K / splits; block b takes
// pieces b, b + grid, ... Modes: "meet" (the consumer warps split a piece's K and add their sums in
// shared memory), "own" (each warp takes whole pieces), "single" (a piece's rows in one bulk copy,
// unpadded, instead of a copy a row into rows padded by 64 bytes); 1 or 2 blocks an SM.
// Exactness: int32 sums against the host's. Timing: CUDA graphs of 40 launches with programmatic
// dependence, each on another weight copy (past the L2), median of 5 graph replays.
// Build (repository root): nvcc -O3 -std=c++17 -arch=sm_90a -Icsrc -o ring_gemv ring_gemv.cu
// This file is the last run's (ring_gemv_blocks.log); ring_gemv_meet_own.log and ring_gemv.log
// ran earlier lists of modes, slots and warps of the same kernel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "gemm/gemv_common.cuh"
#include "gemm/mma.cuh"

using namespace quamba::gemm;

#define CK(x)                                                                            \
  do {                                                                                   \
    cudaError_t e = (x);                                                                 \
    if (e != cudaSuccess) {                                                              \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));      \
      std::exit(1);                                                                      \
    }                                                                                    \
  } while (0)

__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_launch() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ unsigned sa(const void* p) { return static_cast<unsigned>(__cvta_generic_to_shared(p)); }
__device__ __forceinline__ void mbar_init(unsigned long long* b, unsigned n) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(b)), "r"(n) : "memory");
}
__device__ __forceinline__ void mbar_arrive(unsigned long long* b) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(sa(b)) : "memory");
}
__device__ __forceinline__ void mbar_wait(unsigned long long* b, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n W_%=:\n mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n @!p bra W_%=;\n}\n" ::"r"(
          sa(b)),
      "r"(parity)
      : "memory");
}

// ---------------------------------------------------------------- the ring GEMV
constexpr int kPad = 64;  // rows kp + 64 bytes apart: an 8-lane phase's two rows on other banks
constexpr int kMaxSlots = 16;

struct RingArgs {
  const int8_t* x;
  const int8_t* w;
  int* out;
  int N, K, splits, slots;
  bool single;  // splits 1: a piece's 8 rows in one bulk copy, unpadded
};

// CW consumer warps and one producer warp. Piece p: weight rows 8 (p / splits) ... + 7 over K
// range (p % splits) of kp = K / splits bytes; block b takes pieces b, b + grid, ...
template <int M, int CW, bool kOwn>
__global__ void __launch_bounds__(32 * (CW + 1), 1) ring_gemv(const RingArgs a) {
  extern __shared__ __align__(128) unsigned char smem[];
  const int kp = a.K / a.splits, row_bytes = a.single ? kp : kp + kPad, slot_bytes = 8 * row_bytes;
  const int x_row_bytes = a.K + kPad;
  unsigned long long* full = reinterpret_cast<unsigned long long*>(smem);
  unsigned long long* empty = full + kMaxSlots;
  int* partial = reinterpret_cast<int*>(empty + kMaxSlots);  // [2][CW][32][2]
  int8_t* xs = reinterpret_cast<int8_t*>(partial + 2 * CW * 64);
  int8_t* ring = xs + ((M * x_row_bytes + 127) / 128) * 128;
  const int t = threadIdx.x, warp = t / 32, lane = t % 32;
  const int pieces = a.N / 8 * a.splits;
  if (t == 0) {
    for (int i = 0; i < a.slots; ++i) mbar_init(&full[i], 1), mbar_init(&empty[i], kOwn ? 1 : CW);
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  pdl_launch();
  if (warp == CW) {  // the producer: weights are written by no kernel, so before the wait
    if (lane == 0) {
      int j = 0;
      for (int p = blockIdx.x; p < pieces; p += gridDim.x, ++j) {
        const int slot = j % a.slots;
        if (j >= a.slots) {
          mbar_wait(&empty[slot], (j / a.slots - 1) & 1);
          asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
        }
        const unsigned bar = sa(&full[slot]);
        asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(8 * kp) : "memory");
        const int8_t* src = a.w + static_cast<int64_t>(p / a.splits) * 8 * a.K + (p % a.splits) * kp;
        for (int r = 0; r < (a.single ? 1 : 8); ++r)
          asm volatile(
              "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                  sa(ring + slot * slot_bytes + r * row_bytes)),
              "l"(src + static_cast<int64_t>(r) * a.K), "r"(a.single ? 8 * kp : kp), "r"(bar)
              : "memory");
      }
    }
    return;
  }
  pdl_wait();
  for (int i = t; i < M * a.K / 16; i += 32 * CW) {
    const int m = i / (a.K / 16), c = i % (a.K / 16);
    *reinterpret_cast<int4*>(xs + m * x_row_bytes + 16 * c) = __ldcg(reinterpret_cast<const int4*>(a.x) + i);
  }
  asm volatile("bar.sync 1, %0;" ::"n"(32 * CW) : "memory");
  const int g = lane / 4, q = lane % 4;
  const int steps = kp / 64, per_warp = (steps + CW - 1) / CW;
  const int s_begin = warp * per_warp, s_end = min(steps, s_begin + per_warp);
  const int4 zero = make_int4(0, 0, 0, 0);
  if constexpr (kOwn) {  // warp w takes the block's pieces w, w + CW, ...: all steps, no meeting
    int j = warp;
    for (int p = blockIdx.x + warp * gridDim.x; p < pieces; p += CW * gridDim.x, j += CW) {
      const int slot = j % a.slots, split = p % a.splits;
      mbar_wait(&full[slot], (j / a.slots) & 1);
      const int8_t* wrow = ring + slot * slot_bytes + g * row_bytes + 16 * q;
      const int8_t* xrow = xs + min(g, M - 1) * x_row_bytes + split * kp + 16 * q;
      int d[2][4] = {};
#pragma unroll 4
      for (int s = 0; s < steps; ++s) {
        const int4 wv = *reinterpret_cast<const int4*>(wrow + 64 * s);
        int4 xv = *reinterpret_cast<const int4*>(xrow + 64 * s);
        if (g >= M) xv = zero;
        const uint32_t a_lo[4] = {uint32_t(xv.x), 0u, uint32_t(xv.y), 0u};
        const uint32_t a_hi[4] = {uint32_t(xv.z), 0u, uint32_t(xv.w), 0u};
        mma_s8(d[0], a_lo, wv.x, wv.y);
        mma_s8(d[1], a_hi, wv.z, wv.w);
      }
      __syncwarp();
      if (lane == 0) mbar_arrive(&empty[slot]);
      if (g < M) {
        const int n = (p / a.splits) * 8 + 2 * q;
        int* o = a.out + static_cast<int64_t>(g) * a.N + n;
        const int s0 = d[0][0] + d[1][0], s1 = d[0][1] + d[1][1];
        if (a.splits == 1) {
          o[0] = s0, o[1] = s1;
        } else {
          atomicAdd(o, s0), atomicAdd(o + 1, s1);
        }
      }
    }
    return;
  }
  int j = 0;
  for (int p = blockIdx.x; p < pieces; p += gridDim.x, ++j) {
    const int slot = j % a.slots, split = p % a.splits;
    mbar_wait(&full[slot], (j / a.slots) & 1);
    const int8_t* wrow = ring + slot * slot_bytes + g * row_bytes + 16 * q;
    const int8_t* xrow = xs + min(g, M - 1) * x_row_bytes + split * kp + 16 * q;
    int d[4] = {};
#pragma unroll 4
    for (int s = s_begin; s < s_end; ++s) {
      const int4 wv = *reinterpret_cast<const int4*>(wrow + 64 * s);
      int4 xv = *reinterpret_cast<const int4*>(xrow + 64 * s);
      if (g >= M) xv = zero;
      const uint32_t a_lo[4] = {uint32_t(xv.x), 0u, uint32_t(xv.y), 0u};
      const uint32_t a_hi[4] = {uint32_t(xv.z), 0u, uint32_t(xv.w), 0u};
      mma_s8(d, a_lo, wv.x, wv.y);
      mma_s8(d, a_hi, wv.z, wv.w);
    }
    __syncwarp();
    if (lane == 0) mbar_arrive(&empty[slot]);
    int* part = partial + (j & 1) * CW * 64;
    part[(warp * 32 + lane) * 2] = d[0];
    part[(warp * 32 + lane) * 2 + 1] = d[1];
    asm volatile("bar.sync 1, %0;" ::"n"(32 * CW) : "memory");
    if (warp == 0 && g < M) {
      int s0 = 0, s1 = 0;
      for (int w = 0; w < CW; ++w) s0 += part[(w * 32 + lane) * 2], s1 += part[(w * 32 + lane) * 2 + 1];
      const int n = (p / a.splits) * 8 + 2 * q;
      int* o = a.out + static_cast<int64_t>(g) * a.N + n;
      if (a.splits == 1) {
        o[0] = s0, o[1] = s1;
      } else {
        atomicAdd(o, s0), atomicAdd(o + 1, s1);
      }
    }
  }
}

// ---------------------------------------------------------------- replica of gemv.cu's dp4a GEMV
template <int M, int R, bool Staged>
__global__ void __launch_bounds__(kThreads) dp4a_gemv(const int8_t* x, const int8_t* w, int* out, int N, int K,
                                                      int splits) {
  extern __shared__ int4 staged_x[];
  __shared__ int partial[kWarps][1][32];
  pdl_launch();
  const int chunks = K / 16;
  const WarpShare s = warp_share(R, N, chunks, splits);
  const int lane = s.lane;
  constexpr int kSteps = kLoadsPerLane / R;
  const int4* xv4 = reinterpret_cast<const int4*>(x);
  const int4* w_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r)
    w_rows[r] = reinterpret_cast<const int4*>(w + static_cast<int64_t>(min(s.row0 + r, N - 1)) * chunks * 16);
  if constexpr (Staged) {
    pdl_wait();
    for (int i = threadIdx.x; i < M * chunks; i += kThreads) staged_x[i] = __ldcg(xv4 + i);
    __syncthreads();
  }
  int acc[R][M] = {};
  bool waited = Staged;
  for (int c = s.begin + lane; c < s.end; c += 32 * kSteps) {
    int4 wv[kSteps][R];
#pragma unroll
    for (int st = 0; st < kSteps; ++st)
      if (c + 32 * st < s.end)
#pragma unroll
        for (int r = 0; r < R; ++r) wv[st][r] = load_streaming(w_rows[r] + c + 32 * st);
    if (!waited) {
      pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int st = 0; st < kSteps; ++st) {
      if (c + 32 * st >= s.end) continue;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int4 xm = Staged ? staged_x[m * chunks + c + 32 * st] : __ldcg(xv4 + m * chunks + c + 32 * st);
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] = dot16(wv[st][r], xm, acc[r][m]);
      }
    }
  }
  int sum = lane_sum(acc, lane);
  pdl_wait();
  if (!combine_splits<1>(partial, &sum, s, splits)) return;
  const int n = s.row0 + lane / M;
  if (lane < R * M && n < N) out[static_cast<int64_t>(lane % M) * N + n] = sum;
}

// ---------------------------------------------------------------- a plain read of the weight
__global__ void read_all(const int4* w, int64_t n16, int* out) {
  pdl_launch();
  int acc = 0;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n16; i += int64_t(gridDim.x) * blockDim.x) {
    const int4 v = __ldcs(w + i);
    acc ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  pdl_wait();
  if (acc == 0x12345678) out[0] = acc;
}

// ---------------------------------------------------------------- host
template <typename Kernel, typename... Args>
void launch(Kernel k, int grid, int block, int smem, cudaStream_t st, Args... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(block);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = st;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  CK(cudaLaunchKernelEx(&cfg, k, args...));
}

template <typename F>
float time_graph(F&& body, int reps, cudaStream_t st) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < reps; ++i) body(i);
  CK(cudaStreamEndCapture(st, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));
  CK(cudaGraphLaunch(exec, st));
  CK(cudaStreamSynchronize(st));
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  std::vector<float> ts;
  for (int r = 0; r < 5; ++r) {
    CK(cudaEventRecord(e0, st));
    CK(cudaGraphLaunch(exec, st));
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    ts.push_back(ms * 1000.f / reps);
  }
  std::sort(ts.begin(), ts.end());
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  return ts[2];
}

template <int M>
void run_shape(const char* name, int N, int K, int copies, int sms) {
  std::vector<int8_t> hw(static_cast<size_t>(N) * K), hx(static_cast<size_t>(M) * K);
  uint32_t seed = 12345u + N + K;
  auto rnd = [&] { seed = seed * 1664525u + 1013904223u; return static_cast<int8_t>((seed >> 24) & 0xFF); };
  for (auto& v : hw) v = rnd();
  for (auto& v : hx) v = rnd();
  std::vector<int> ref(static_cast<size_t>(M) * N);
  for (int m = 0; m < M; ++m)
    for (int n = 0; n < N; ++n) {
      int s = 0;
      for (int k = 0; k < K; ++k) s += int(hx[size_t(m) * K + k]) * int(hw[size_t(n) * K + k]);
      ref[size_t(m) * N + n] = s;
    }
  const size_t wbytes = size_t(N) * K;
  int8_t *w, *x;
  int* out;
  CK(cudaMalloc(&w, wbytes * copies));
  CK(cudaMalloc(&x, hx.size()));
  CK(cudaMalloc(&out, ref.size() * sizeof(int)));
  for (int c = 0; c < copies; ++c) CK(cudaMemcpy(w + c * wbytes, hw.data(), wbytes, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(x, hx.data(), hx.size(), cudaMemcpyHostToDevice));
  cudaStream_t st;
  CK(cudaStreamCreate(&st));
  std::vector<int> got(ref.size());
  auto check = [&](const char* what) {
    CK(cudaStreamSynchronize(st));
    CK(cudaMemcpy(got.data(), out, got.size() * sizeof(int), cudaMemcpyDeviceToHost));
    return got == ref ? "exact" : "DIFFERENT";
  };
  const int reps = 40;
  // dp4a replica, as gemv.cu chooses for this shape
  const int groups = (N + 3) / 4, chunks = K / 16;
  int splits = 1;
  while (splits < kWarps && groups * splits < 8 * sms && chunks >= 64 * (2 * splits)) splits *= 2;
  const bool staged = M >= 5 && splits == 1 && M * K <= 40 * 1024;
  const int blocks = (groups + kWarps / splits - 1) / (kWarps / splits);
  auto dp4a = staged ? dp4a_gemv<M, 4, true> : dp4a_gemv<M, 4, false>;
  const int dsmem = staged ? M * K : 0;
  CK(cudaFuncSetAttribute(dp4a, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 * 1024));
  CK(cudaMemset(out, 0, got.size() * sizeof(int)));
  launch(dp4a, blocks, kThreads, dsmem, st, (const int8_t*)x, (const int8_t*)w, out, N, K, splits);
  const char* dp4a_ok = check("dp4a");
  const float dp4a_us = time_graph([&](int i) {
    launch(dp4a, blocks, kThreads, dsmem, st, (const int8_t*)x, (const int8_t*)(w + (i % copies) * wbytes), out, N, K,
           splits);
  }, reps, st);
  const float read_us = time_graph([&](int i) {
    launch(read_all, 4 * sms, 256, 0, st, reinterpret_cast<const int4*>(w + (i % copies) * wbytes),
           int64_t(wbytes / 16), out);
  }, reps, st);
  std::printf("%-9s M %d N %5d K %5d  dp4a (splits %d%s) %6.2f us %s | read %6.2f us (%4.0f GB/s)\n", name, M, N, K,
              splits, staged ? ", staged" : "", dp4a_us, dp4a_ok, read_us, wbytes / read_us / 1e3);
  for (int rsplits : {1, 2}) {
    if (K % (64 * rsplits) != 0) continue;
    const int kp = K / rsplits;
    for (int blocks_per_sm : {1, 2}) {
    for (int slots : {3, 4, 8, 10}) {
     for (bool single : {false, true}) {
      if (single && rsplits != 1) continue;
      const int xbytes = ((M * (K + kPad) + 127) / 128) * 128;
      auto body = [&](auto cw_tag, auto own_tag) {
        constexpr int CW = decltype(cw_tag)::value;
        constexpr bool kOwn = decltype(own_tag)::value;
        const int smem = 16 * kMaxSlots + 2 * CW * 64 * 4 + xbytes + slots * 8 * (single ? kp : kp + kPad);
        const int grid_blocks = blocks_per_sm * sms;
        const int per_block = (N / 8 * rsplits + grid_blocks - 1) / grid_blocks;
        if (blocks_per_sm * (smem + 1024) > 228 * 1024) return;
        // kOwn: a slot's pieces must be one warp's, or each slot used once
        if (smem > 227 * 1024 || (kOwn && slots % CW != 0 && slots < per_block)) return;
        auto kernel = ring_gemv<M, CW, kOwn>;
        CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
        RingArgs a{x, w, out, N, K, rsplits, slots, single};
        const int pieces = N / 8 * rsplits, grid = std::min(pieces, grid_blocks);
        CK(cudaMemset(out, 0, got.size() * sizeof(int)));
        launch(kernel, grid, 32 * (CW + 1), smem, st, a);
        const char* ok = check("ring");
        const float us = time_graph([&](int i) {
          RingArgs ai = a;
          ai.w = w + (i % copies) * wbytes;
          launch(kernel, grid, 32 * (CW + 1), smem, st, ai);
        }, reps, st);
        std::printf("          ring %s%s splits %d blocks/SM %d slots %2d warps %2d: %6.2f us (%4.0f GB/s) %s\n",
                    kOwn ? "own " : "meet", single ? " single" : "       ", rsplits, blocks_per_sm, slots, CW, us,
                    wbytes / us / 1e3, ok);
      };
      body(std::integral_constant<int, 4>{}, std::true_type{});
      body(std::integral_constant<int, 8>{}, std::true_type{});
     }
    }
    }
  }
  CK(cudaFree(w));
  CK(cudaFree(x));
  CK(cudaFree(out));
}

int main() {
  int sms;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  cudaDeviceProp p;
  CK(cudaGetDeviceProperties(&p, 0));
  std::printf("%s, %d SMs\n", p.name, sms);
  run_shape<8>("in_proj", 10240, 2560, 4, sms);
  run_shape<8>("out_proj", 2560, 5120, 6, sms);

  return 0;
}
