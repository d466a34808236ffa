// W8A8 GEMM on mma.sync m16n8k32 (sm_80, sm_86, sm_89; on sm_90 the fallback for shapes the
// wgmma kernel cannot take). 128x128x64 CTA tile, 4 warps of 64x64, a 4-stage cp.async pipeline;
// tiles past M, N or K are zero-filled by cp.async, so any M and N and K % 16 == 0 work.
#include <c10/cuda/CUDAException.h>

#include "gemm/epilogue.cuh"
#include "gemm/gemm.h"
#include "gemm/mma.cuh"

namespace quamba::gemm {
namespace {

constexpr int kBM = 128, kBN = 128, kBK = 64;
constexpr int kStages = 4;
constexpr int kThreads = 128;
constexpr int kChunksPerRow = kBK / 16;
constexpr int kTileBytes = kBM * kBK;  // one operand, one stage (kBM == kBN)
constexpr int kSmemBytes = 2 * kStages * kTileBytes;

// Byte offset of 16-byte chunk `chunk` of tile row `row`. The XOR spreads the 8 rows an ldmatrix
// phase reads over all 32 banks (rows are 64 bytes, so unswizzled rows 2 apart would collide).
__device__ __forceinline__ uint32_t tile_offset(int row, int chunk) {
  return row * kBK + ((chunk ^ ((row >> 1) & 3)) * 16);
}

__device__ __forceinline__ void cp_async_16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }

template <int Pending>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(Pending));
}

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// Copies rows [0, rows) x bytes [k0, k0 + kBK) of a K-contiguous operand into one smem tile.
__device__ __forceinline__ void load_tile(uint32_t tile, const int8_t* src, int rows, int K, int k0) {
#pragma unroll
  for (int i = 0; i < kBM * kChunksPerRow / kThreads; ++i) {
    const int id = threadIdx.x + i * kThreads;
    const int row = id / kChunksPerRow, chunk = id % kChunksPerRow;
    const int k = k0 + chunk * 16;
    const bool valid = row < rows && k < K;
    cp_async_16(tile + tile_offset(row, chunk), valid ? src + static_cast<int64_t>(row) * K + k : src,
                valid);
  }
}

// One warp's 64x64 block of products over one kBK slice held in shared memory.
__device__ __forceinline__ void mma_tile(int (&acc)[4][8][4], uint32_t a_tile, uint32_t b_tile,
                                         int warp_m, int warp_n, int lane) {
#pragma unroll
  for (int ks = 0; ks < kBK / 32; ++ks) {
    uint32_t a[4][4], b[8][2];
#pragma unroll
    for (int i = 0; i < 4; ++i)  // matrices: rows 0-7 / 8-15 of k 0-15, then of k 16-31
      ldmatrix_x4(a[i], a_tile + tile_offset(warp_m * 64 + i * 16 + (lane & 15), ks * 2 + (lane >> 4)));
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // matrices: k 0-15 / 16-31 of n-tile 2j, then of n-tile 2j+1
      uint32_t r[4];
      const int row = warp_n * 64 + (2 * j + (lane >> 4)) * 8 + (lane & 7);
      ldmatrix_x4(r, b_tile + tile_offset(row, ks * 2 + ((lane >> 3) & 1)));
      b[2 * j][0] = r[0], b[2 * j][1] = r[1], b[2 * j + 1][0] = r[2], b[2 * j + 1][1] = r[3];
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) mma_s8(acc[i][j], a[i], b[j][0], b[j][1]);
  }
}

template <typename OutT>
__device__ __forceinline__ void store_accumulators(const int (&acc)[4][8][4], OutT* out, int M, int N,
                                                   int row0, int col0, int lane, const Epilogue& e) {
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int j = 0; j < 8; ++j)
#pragma unroll
      for (int v = 0; v < 4; ++v) {  // fragment: rows lane/4 (+8 for v >= 2), columns 2*(lane%4) + v%2
        const int row = row0 + i * 16 + lane / 4 + (v / 2) * 8;
        const int col = col0 + j * 8 + (lane % 4) * 2 + v % 2;
        if (row < M && col < N) out[static_cast<int64_t>(row) * N + col] = e.apply<OutT>(acc[i][j][v], col);
      }
}

template <typename OutT>
__global__ void __launch_bounds__(kThreads)
gemm_mma_kernel(const int8_t* __restrict__ x, const int8_t* __restrict__ w, OutT* __restrict__ out,
                int M, int N, int K, Epilogue epilogue) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  extern __shared__ __align__(128) uint8_t smem[];
  const uint32_t a_tiles = static_cast<uint32_t>(__cvta_generic_to_shared(smem));
  const uint32_t b_tiles = a_tiles + kStages * kTileBytes;
  const int m0 = blockIdx.y * kBM, n0 = blockIdx.x * kBN;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_m = warp / 2, warp_n = warp % 2;
  const int8_t* x_rows = x + static_cast<int64_t>(m0) * K;
  const int8_t* w_rows = w + static_cast<int64_t>(n0) * K;
  const int rows_x = min(kBM, M - m0), rows_w = min(kBN, N - n0);
  const int k_tiles = (K + kBK - 1) / kBK;

  auto load_stage = [&](int k_tile) {
    const int stage = k_tile % kStages;
    load_tile(a_tiles + stage * kTileBytes, x_rows, rows_x, K, k_tile * kBK);
    load_tile(b_tiles + stage * kTileBytes, w_rows, rows_w, K, k_tile * kBK);
  };

  int acc[4][8][4] = {};
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // stage kt landed for all threads; stage kt - 1 is free to refill
    if (kt + kStages - 1 < k_tiles) load_stage(kt + kStages - 1);
    cp_async_commit();
    const int stage = kt % kStages;
    mma_tile(acc, a_tiles + stage * kTileBytes, b_tiles + stage * kTileBytes, warp_m, warp_n, lane);
  }
  store_accumulators(acc, out, M, N, m0 + warp_m * 64, n0 + warp_n * 64, lane, epilogue);
#else
  __trap();  // never launched: the host requires compute capability 8.0 (mma.sync int8, cp.async)
#endif
}

}  // namespace

void launch_gemm_mma(const GemmArgs& a) {
  TORCH_CHECK(a.x_stride == a.K, "w8a8 GEMM (mma.sync): x's rows must be packed (row stride K)");
  dispatch_out_type(a.out_type, [&](auto tag) {
    using OutT = decltype(tag);
    const auto kernel = gemm_mma_kernel<OutT>;
    check_kernel_image(reinterpret_cast<const void*>(kernel), "w8a8 GEMM (mma.sync)");
    C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
    const dim3 grid((a.N + kBN - 1) / kBN, (a.M + kBM - 1) / kBM);
    TORCH_CHECK(grid.y <= 65535, "w8a8 GEMM (mma.sync): M = ", a.M, " exceeds ", 65535 * kBM, " rows");
    kernel<<<grid, kThreads, kSmemBytes, a.stream>>>(a.x, a.w, static_cast<OutT*>(a.out), a.M, a.N, a.K,
                                                     Epilogue::from(a));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
}

}  // namespace quamba::gemm
