// Decode GEMVs (M = 1..8) on 4-bit weights: the packed rows are streamed once with 16-byte
// streaming loads (ld.global.cs: read once, evict first; several per lane in flight) and the few
// activation rows are read from L2. Both are launched with programmatic dependence (pdl.cuh): the
// first weight loads are issued before waiting for the kernel that writes x. A 16-byte chunk holds 32 codes of one group (G % 32 == 0).
//
// W4A8 (dp4a): a lane takes whole chunks. Nibbles are moved to the top of each byte with one shift
// and one AND ((w << 4) & 0xF0F0F0F0 holds the even k, w & 0xF0F0F0F0 the odd k, each as 16 *
// code in int8) and multiplied with the even / odd bytes of x (two byte permutes per 8 bytes of
// x, shared by the R rows); the chunk's int32 sum is exact, divided by 16 exactly, multiplied by
// the group's int8 multiplier and added. Exact for any int8 multiplier. R = 1, 2, 4 rows per warp,
// `splits` warps sharing a row group's K range (as the W8A8 GEMV, gemm/gemv.cu).
//
// W4A16 (mma.sync m16n8k16, f16 or bf16 in, f32 accumulate): a warp takes 8 weight rows. Lane
// (g, t) = (lane / 4, lane % 4) loads chunk 4 * step + t of weight row g and the same 32
// activations of x row g (zero for g >= M). Codes become exact f16/bf16 values with the
// magic-number trick (nibble | exponent bits of 1024 (f16) or 128 (bf16), minus 1032 / 136 after
// the sign bit is flipped). A dot product does not depend on the order of k, only on both operands
// using the same one, so the lane's 32 (x, code) pairs feed 8 mmas as they are (A = activations,
// rows 8..15 zero; B = the 8 weight rows), in two independent accumulator chains. Each step's mma
// output (fp32) covers one group; it is multiplied by the group's fp32 scale and added to the fp32
// total. A 4-chunk step lies in one group when G % 128 == 0; otherwise (G = 32, 64, 96, ...) each
// of the step's H groups is a pass of the mmas with the other lanes' codes masked to zero. The
// weight chunks of kMmaSteps steps are loaded before any is used. Known limit (H100): this kernel
// reaches only ~30% of the copy bandwidth on in_proj (benchmarks/RESULTS.md); a variant that also
// prefetched the group scales and the next step's activations, with 6 steps and a 128-register
// cap, was no faster at M = 1 and slower at M = 8 (in_proj 16-20 vs 14 us), and was reverted.
#include <ATen/cuda/CUDAContextLight.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gemm/epilogue.cuh"
#include "gemm/gemv_common.cuh"
#include "gemm4/gemm4.h"
#include "pdl.cuh"

namespace quamba::gemm4 {
namespace {

using gemm::Epilogue;
using gemm::kLoadsPerLane;  // W4A8: R rows x (8 / R) steps of 16-byte chunks in flight per lane
using gemm::kThreads;
using gemm::kWarps;
using gemm::load_streaming;

constexpr int kMmaRows = 8;   // W4A16: weight rows per warp
constexpr int kMmaSteps = 8;  // W4A16: 4-chunk steps of weights in flight per lane

// Group of chunk c: c >> shift when the chunks per group are a power of two, else c / per_group.
struct GroupOf {
  int per_group, shift;
  static GroupOf make(int group_size) {
    const int per_group = group_size / kCodesPerChunk;
    int shift = 0;
    while ((1 << shift) < per_group) ++shift;
    return {per_group, (1 << shift) == per_group ? shift : -1};
  }
  __device__ __forceinline__ int operator()(int c) const { return shift >= 0 ? c >> shift : c / per_group; }
};

// ---------------------------------------------------------------------------------------------
// W4A8, dp4a

// Chunk sum of 16 * code * x over one 16-byte weight chunk (32 codes) against the even (xe) and
// odd (xo) bytes of the matching 32 activations.
__device__ __forceinline__ int chunk_dot(int4 w, const int (&xe)[4], const int (&xo)[4]) {
  const int words[4] = {w.x, w.y, w.z, w.w};
  int acc = 0;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int even = static_cast<int>((static_cast<unsigned>(words[j]) << 4) & 0xF0F0F0F0u);
    const int odd = static_cast<int>(static_cast<unsigned>(words[j]) & 0xF0F0F0F0u);
    acc = __dp4a(even, xe[j], acc);
    acc = __dp4a(odd, xo[j], acc);
  }
  return acc;
}

// Sums over chunks [begin, end) of rows row0..row0+R-1 (rows past N re-read row N - 1; the caller
// drops them). Returns, in lane r * M + m, the warp's sum for (row0 + r, m).
template <int M, int R>
__device__ __forceinline__ int w4a8_row_group_sums(const int4* __restrict__ x, const uint8_t* __restrict__ w,
                                                   const int8_t* __restrict__ multipliers, int N, int chunks,
                                                   int groups, GroupOf group_of, int row0, int begin, int end,
                                                   int lane) {
  // (16 loads per lane for M <= 2, so that in_proj's rows take one pass, was slower on the H100:
  // 8.5 vs 7.4 us for in_proj at M = 1, from the registers it costs.)
  constexpr int kSteps = kLoadsPerLane / R;
  const int4* w_rows[R];
  const int8_t* m_rows[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int64_t row = min(row0 + r, N - 1);
    w_rows[r] = reinterpret_cast<const int4*>(w + row * chunks * 16);
    m_rows[r] = multipliers + row * groups;
  }
  int acc[R][M] = {};
  bool waited = false;
  for (int c = begin + lane; c < end; c += 32 * kSteps) {
    int4 wv[kSteps][R];
    int mul[kSteps][R];
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
      if (c + 32 * s < end) {
        const int group = group_of(c + 32 * s);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          wv[s][r] = load_streaming(w_rows[r] + c + 32 * s);
          mul[s][r] = __ldg(m_rows[r] + group);
        }
      }
    if (!waited) {  // the first weights are on their way: now wait for x (pdl.cuh)
      pdl_wait();
      waited = true;
    }
#pragma unroll
    for (int s = 0; s < kSteps; ++s) {
      if (c + 32 * s >= end) continue;
#pragma unroll
      for (int m = 0; m < M; ++m) {
        const int4* xc = x + static_cast<int64_t>(m) * chunks * 2 + 2 * (c + 32 * s);
        const int4 x0 = __ldcg(xc), x1 = __ldcg(xc + 1);
        const int xe[4] = {static_cast<int>(__byte_perm(x0.x, x0.y, 0x6420)),
                           static_cast<int>(__byte_perm(x0.z, x0.w, 0x6420)),
                           static_cast<int>(__byte_perm(x1.x, x1.y, 0x6420)),
                           static_cast<int>(__byte_perm(x1.z, x1.w, 0x6420))};
        const int xo[4] = {static_cast<int>(__byte_perm(x0.x, x0.y, 0x7531)),
                           static_cast<int>(__byte_perm(x0.z, x0.w, 0x7531)),
                           static_cast<int>(__byte_perm(x1.x, x1.y, 0x7531)),
                           static_cast<int>(__byte_perm(x1.z, x1.w, 0x7531))};
#pragma unroll
        for (int r = 0; r < R; ++r) acc[r][m] += (chunk_dot(wv[s][r], xe, xo) >> 4) * mul[s][r];
      }
    }
  }
  return gemm::lane_sum(acc, lane);
}

template <int M, int R, typename OutT>
__global__ void __launch_bounds__(kThreads)
w4a8_gemv_kernel(const int8_t* __restrict__ x, const uint8_t* __restrict__ w, const int8_t* __restrict__ multipliers,
                 OutT* __restrict__ out, int N, int K, GroupOf group_of, Epilogue epilogue, int splits) {
  static_assert(R * M <= 32, "one output per lane");
  __shared__ int partial[kWarps][1][32];
  pdl_launch_dependents();
  const int chunks = K / kCodesPerChunk;
  const int groups = chunks / group_of.per_group;
  const gemm::WarpShare s = gemm::warp_share(R, N, chunks, splits);
  const int lane = s.lane;

  int sum = w4a8_row_group_sums<M, R>(reinterpret_cast<const int4*>(x), w, multipliers, N, chunks, groups, group_of,
                                      s.row0, s.begin, s.end, lane);
  pdl_wait();  // warps with no share of K have not waited yet
  if (!gemm::combine_splits<1>(partial, &sum, s, splits)) return;
  const int n = s.row0 + lane / M;
  if (lane < R * M && n < N) out[static_cast<int64_t>(lane % M) * N + n] = epilogue.apply<OutT>(sum, n);
}

// Chosen by measurement on the H100 (benchmarks/RESULTS.md, every variant swept): 4 rows per warp
// when that gives every SM 8 warps; otherwise 2 for two activation rows (more warps) and 4 for one
// or more than two (x's byte permutes and loads shared by more rows). With programmatic dependent
// launch, 4 rows won at M = 1 everywhere (final H100 check: out_proj 4.43 us with 4 rows and 4
// splits, 7.16 us with 2 rows); M = 2 was last swept before that change. K is split until about
// 16 (M <= 2) or 8 warps per SM, keeping at least one sweep of K per warp.
int w4a8_choose_rows(int M, int N, int sms) {
  if ((N + 3) / 4 >= 8 * sms) return 4;
  return M == 2 ? 2 : 4;
}

int choose_splits(int work_items, int sweeps, int target_warps) {
  int splits = 1;
  while (splits < kWarps && work_items * splits < target_warps && sweeps >= 2 * splits) splits *= 2;
  return splits;
}

template <int M, int R, typename OutT>
void launch_w4a8_kernel(const W4A8Args& a, int splits) {
  const auto kernel = w4a8_gemv_kernel<M, R, OutT>;
  gemm::check_kernel_image(reinterpret_cast<const void*>(kernel), "w4a8 GEMV");
  const int groups_per_block = kWarps / splits;
  const int blocks = ((a.N + R - 1) / R + groups_per_block - 1) / groups_per_block;
  const Epilogue epilogue{a.multiplier, a.multiplier_per_channel, nullptr};
  launch_with_pdl(kernel, blocks, kThreads, 0, a.stream, a.x, a.w, a.group_multiplier, static_cast<OutT*>(a.out),
                  a.N, a.K, GroupOf::make(a.group_size), epilogue, splits);
}

template <int M>
void launch_w4a8_for_m(const W4A8Args& a, int rows, int splits) {
  gemm::dispatch_out_type(a.out_type, [&](auto tag) {
    using OutT = decltype(tag);
    switch (rows) {
      case 1: launch_w4a8_kernel<M, 1, OutT>(a, splits); break;
      case 2: launch_w4a8_kernel<M, 2, OutT>(a, splits); break;
      case 4: launch_w4a8_kernel<M, 4, OutT>(a, splits); break;
    }
  });
}

// ---------------------------------------------------------------------------------------------
// W4A16, mma.sync

template <typename XT>
struct Act;

template <>
struct Act<__half> {
  static constexpr uint32_t kMagic = 0x64006400u;  // 1024.0 in both halves
  // (1024 + (n ^ 8)) * 1 - 1032 = the signed code, exact.
  __device__ __forceinline__ static uint32_t to_codes(uint32_t v) {
    uint32_t r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3C003C00u), "r"(0xE408E408u));
    return r;
  }
  __device__ __forceinline__ static void mma(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
  }
};

template <>
struct Act<__nv_bfloat16> {
  static constexpr uint32_t kMagic = 0x43004300u;  // 128.0 in both halves
  // (128 + (n ^ 8)) * 1 - 136 = the signed code, exact.
  __device__ __forceinline__ static uint32_t to_codes(uint32_t v) {
    uint32_t r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(v), "r"(0x3F803F80u), "r"(0xC308C308u));
    return r;
  }
  __device__ __forceinline__ static void mma(float (&d)[4], uint32_t a0, uint32_t a2, uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
                 "{%8, %9}, {%0, %1, %2, %3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a0), "r"(0u), "r"(a2), "r"(0u), "r"(b0), "r"(b1));
  }
};

template <typename OutT>
__device__ __forceinline__ OutT from_float(float v);
template <>
__device__ __forceinline__ float from_float<float>(float v) { return v; }
template <>
__device__ __forceinline__ __half from_float<__half>(float v) { return __float2half_rn(v); }
template <>
__device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// b[4j + q] = (code 8j + q, code 8j + q + 4) and a[4j + q] = (x 8j + q, x 8j + q + 4) of one chunk.
template <typename XT>
__device__ __forceinline__ void decode_chunk(uint32_t (&a)[16], uint32_t (&b)[16], uint4 wv, const uint4 (&xv)[4]) {
  const uint32_t words[4] = {wv.x, wv.y, wv.z, wv.w};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t flipped = words[j] ^ 0x88888888u;
#pragma unroll
    for (int q = 0; q < 4; ++q) b[4 * j + q] = Act<XT>::to_codes(((flipped >> (4 * q)) & 0x000F000Fu) | Act<XT>::kMagic);
    a[4 * j + 0] = __byte_perm(xv[j].x, xv[j].z, 0x5410);
    a[4 * j + 1] = __byte_perm(xv[j].x, xv[j].z, 0x7632);
    a[4 * j + 2] = __byte_perm(xv[j].y, xv[j].w, 0x5410);
    a[4 * j + 3] = __byte_perm(xv[j].y, xv[j].w, 0x7632);
  }
}

template <typename XT, typename OutT, int H>
__global__ void __launch_bounds__(kThreads)
w4a16_gemv_kernel(const XT* __restrict__ x, const uint8_t* __restrict__ w, const __half* __restrict__ scales,
                  OutT* __restrict__ out, int M, int N, int K, GroupOf group_of, int splits) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  __shared__ float partial[kWarps][2][32];
  pdl_launch_dependents();
  const int chunks = K / kCodesPerChunk;
  const int groups = chunks / group_of.per_group;
  const int steps = (chunks + 3) / 4;
  const gemm::WarpShare share = gemm::warp_share(kMmaRows, N, steps, splits);
  const int row0 = share.row0, begin = share.begin, end = share.end;
  const int g = share.lane / 4, t = share.lane % 4;
  const bool has_x = g < M;
  const int4* w_row = reinterpret_cast<const int4*>(w + static_cast<int64_t>(min(row0 + g, N - 1)) * (K / 2));
  const uint4* x_row = reinterpret_cast<const uint4*>(x + static_cast<int64_t>(min(g, M - 1)) * K);
  const __half* scale0 = scales + static_cast<int64_t>(min(row0 + 2 * t, N - 1)) * groups;
  const __half* scale1 = scales + static_cast<int64_t>(min(row0 + 2 * t + 1, N - 1)) * groups;

  float total[2] = {0.f, 0.f};
  for (int s0 = begin; s0 < end; s0 += kMmaSteps) {
    uint4 wv[kMmaSteps];
#pragma unroll
    for (int s = 0; s < kMmaSteps; ++s) {  // clamped loads; chunks past the end are zeroed below
      const int4 raw = load_streaming(w_row + min(4 * (s0 + s) + t, chunks - 1));
      wv[s] = make_uint4(raw.x, raw.y, raw.z, raw.w);
    }
    if (s0 == begin) pdl_wait();  // the first weights are on their way: now wait for x (pdl.cuh)
#pragma unroll
    for (int s = 0; s < kMmaSteps; ++s) {
      const int step = s0 + s;
      if (step >= end) break;  // warp-uniform
      const int c = 4 * step + t;
      const bool valid = c < chunks;
      uint4 xv[4];  // L2 hits (not L1: see pdl.cuh): the few activation rows are shared by every warp
#pragma unroll
      for (int k = 0; k < 4; ++k) xv[k] = has_x && valid ? __ldcg(x_row + 4 * c + k) : make_uint4(0, 0, 0, 0);
      if (!valid) wv[s] = make_uint4(0, 0, 0, 0);  // code 0 and x 0: contributes nothing
      uint32_t a[16], b[16];
      decode_chunk<XT>(a, b, wv[s], xv);
      const int first = group_of(4 * step);
      const int phase = group_of(min(c, chunks - 1)) - first;
#pragma unroll
      for (int h = 0; h < H; ++h) {
        const int group = first + h;
        if (group >= groups) break;  // warp-uniform
        const bool use = H == 1 || phase == h;
        // Two independent accumulators halve the chain of dependent mmas.
        float d0[4] = {0.f, 0.f, 0.f, 0.f}, d1[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          Act<XT>::mma(d0, a[2 * i], a[2 * i + 1], use ? b[2 * i] : 0u, use ? b[2 * i + 1] : 0u);
          Act<XT>::mma(d1, a[2 * i + 8], a[2 * i + 9], use ? b[2 * i + 8] : 0u, use ? b[2 * i + 9] : 0u);
        }
        total[0] = fmaf(d0[0] + d1[0], __half2float(scale0[group]), total[0]);
        total[1] = fmaf(d0[1] + d1[1], __half2float(scale1[group]), total[1]);
      }
    }
  }
  pdl_wait();  // warps with no share of K have not waited yet
  if (!gemm::combine_splits<2>(partial, total, share, splits)) return;
  const int n = row0 + 2 * t;
  if (g >= M) return;
  if (n < N) out[static_cast<int64_t>(g) * N + n] = from_float<OutT>(total[0]);
  if (n + 1 < N) out[static_cast<int64_t>(g) * N + n + 1] = from_float<OutT>(total[1]);
#else
  __trap();  // never launched: the host requires compute capability 8.0 (mma.sync f16/bf16)
#endif
}

template <typename XT, typename OutT, int H>
void launch_w4a16_kernel(const W4A16Args& a, int splits) {
  const auto kernel = w4a16_gemv_kernel<XT, OutT, H>;
  gemm::check_kernel_image(reinterpret_cast<const void*>(kernel), "w4a16 GEMV");
  const int groups_per_block = kWarps / splits;
  const int blocks = ((a.N + kMmaRows - 1) / kMmaRows + groups_per_block - 1) / groups_per_block;
  launch_with_pdl(kernel, blocks, kThreads, 0, a.stream, static_cast<const XT*>(a.x), a.w,
                  static_cast<const __half*>(a.scales), static_cast<OutT*>(a.out), a.M, a.N, a.K,
                  GroupOf::make(a.group_size), splits);
}

// H: how many groups one 4-chunk step (128 codes) can touch.
template <typename XT, typename OutT>
void launch_w4a16_for_groups(const W4A16Args& a, int splits) {
  if (a.group_size % 128 == 0) launch_w4a16_kernel<XT, OutT, 1>(a, splits);
  else if (a.group_size == 32) launch_w4a16_kernel<XT, OutT, 4>(a, splits);
  else launch_w4a16_kernel<XT, OutT, 2>(a, splits);  // 64, 96, 160, ...: at most 2 per step
}

void launch_w4a16_types(const W4A16Args& a, int splits) {
  auto for_x = [&](auto x_tag) {
    using XT = decltype(x_tag);
    switch (a.out_type) {
      case OutType::kFloat16: launch_w4a16_for_groups<XT, __half>(a, splits); break;
      case OutType::kBFloat16: launch_w4a16_for_groups<XT, __nv_bfloat16>(a, splits); break;
      case OutType::kFloat32: launch_w4a16_for_groups<XT, float>(a, splits); break;
      case OutType::kInt8: TORCH_CHECK(false, "w4a16 GEMV: out must be float16, bfloat16 or float32");
    }
  };
  if (a.x_type == ActType::kFloat16) for_x(__half{});
  else for_x(__nv_bfloat16{});
}

void check_splits(const char* op, int splits) {
  TORCH_CHECK(splits == 0 || splits == 1 || splits == 2 || splits == 4, op,
              ": splits must be 0 (auto), 1, 2 or 4, got ", splits);
}

}  // namespace

void launch_w4a8_gemv(const W4A8Args& a, int rows, int splits) {
  TORCH_CHECK(a.M >= 1 && a.M <= kGemvMaxM, "w4a8 GEMV: M must be in 1..", kGemvMaxM, ", got ", a.M);
  TORCH_CHECK(rows == 0 || rows == 1 || rows == 2 || rows == 4, "w4a8 GEMV: rows must be 0 (auto), 1, 2 or 4, got ",
              rows);
  check_splits("w4a8 GEMV", splits);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  if (rows == 0) rows = w4a8_choose_rows(a.M, a.N, sms);
  if (splits == 0)
    splits = choose_splits((a.N + rows - 1) / rows, a.K / kCodesPerChunk / 32, (a.M <= 2 ? 16 : 8) * sms);
  switch (a.M) {
    case 1: launch_w4a8_for_m<1>(a, rows, splits); break;
    case 2: launch_w4a8_for_m<2>(a, rows, splits); break;
    case 3: launch_w4a8_for_m<3>(a, rows, splits); break;
    case 4: launch_w4a8_for_m<4>(a, rows, splits); break;
    case 5: launch_w4a8_for_m<5>(a, rows, splits); break;
    case 6: launch_w4a8_for_m<6>(a, rows, splits); break;
    case 7: launch_w4a8_for_m<7>(a, rows, splits); break;
    case 8: launch_w4a8_for_m<8>(a, rows, splits); break;
  }
}

void launch_w4a16_gemv(const W4A16Args& a, int splits) {
  TORCH_CHECK(a.M >= 1 && a.M <= kGemvMaxM, "w4a16 GEMV: M must be in 1..", kGemvMaxM, ", got ", a.M);
  check_splits("w4a16 GEMV", splits);
  const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  // A step is 4 chunks of the warp; "sweeps" counts 4 steps here. The kernel is latency-bound per
  // warp, so more and shorter warps win: 4 splits were the fastest or within 2% on the H100 for
  // every Mamba-2.8B layer and M (benchmarks/RESULTS.md), hence a target of 32 warps per SM.
  if (splits == 0) splits = choose_splits((a.N + kMmaRows - 1) / kMmaRows, a.K / kCodesPerChunk / 4 / 4, 32 * sms);
  launch_w4a16_types(a, splits);  // M needs no template: every M <= 8 costs the same mmas
}

}  // namespace quamba::gemm4
