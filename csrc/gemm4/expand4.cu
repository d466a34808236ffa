// Expansion of packed 4-bit weights for the prefill GEMMs, grid-stride. W4A8: one thread per 16-byte
// chunk of a packed row (32 codes, one group) written out as 32 int8 values (code * group
// multiplier). W4A16: one thread per 32-bit word (8 codes) written out as 8 f16/bf16 values
// (fp32(code) * fp32(scale), rounded once) in one 16-byte store, so that a warp's stores are
// contiguous (a thread per chunk, 4 stores 64 bytes apart, took 43 us for in_proj on the H100).
// W4A8 keeps a thread per chunk: a thread per word with one 8-byte store was slower (in_proj
// 21.9 us against 17.9, out_proj 12.0 against 10.1; b595e1b).
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "gemm4/gemm4.h"
#include "pdl.cuh"

namespace quamba::gemm4 {
namespace {

constexpr int kThreads = 256;

__device__ __forceinline__ int code_at(const uint32_t (&words)[4], int k) {  // k in 0..31 of the chunk
  const int nibble = (words[k / 8] >> (4 * (k % 8))) & 0xF;
  return nibble >= 8 ? nibble - 16 : nibble;
}

__device__ __forceinline__ void load_chunk(uint32_t (&words)[4], const uint8_t* w, int chunk) {
  const int4 raw = __ldcs(reinterpret_cast<const int4*>(w) + chunk);
  words[0] = raw.x, words[1] = raw.y, words[2] = raw.z, words[3] = raw.w;
}

// Eight codes of one 32-bit word times m, as int8 bytes in k order (two words), for 0 <= m <= 127:
// each 16-bit lane of u holds one biased nibble n ^ 8 = code + 8, so u * m has no carry between
// lanes; adding 2048 - 8m per lane keeps it non-negative and leaves code * m (mod 256) in the low
// byte of each lane, which the byte permutes gather.
__device__ __forceinline__ void expand_word(uint32_t word, uint32_t m, uint32_t& lo, uint32_t& hi) {
  const uint32_t flipped = word ^ 0x88888888u;
  const uint32_t bias = (2048u - 8u * m) * 0x00010001u;
  uint32_t r[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) r[q] = ((flipped >> (4 * q)) & 0x000F000Fu) * m + bias;  // lanes: code q, q + 4
  const uint32_t r01 = __byte_perm(r[0], r[1], 0x6240), r23 = __byte_perm(r[2], r[3], 0x6240);
  lo = __byte_perm(r01, r23, 0x5410);  // codes 0..3
  hi = __byte_perm(r01, r23, 0x7632);  // codes 4..7
}

// Whether some nibble of the word is 8 (code -8): a zero nibble of word ^ 0x88888888.
__device__ __forceinline__ bool has_code_minus8(uint32_t word) {
  const uint32_t v = word ^ 0x88888888u;
  return ((v - 0x11111111u) & ~v & 0x88888888u) != 0;
}

// The 32 int8 values code * multiplier of one chunk; `bad` is set when one falls outside [-128, 127].
__device__ __forceinline__ void expand_chunk(const uint32_t (&words)[4], int multiplier, uint32_t (&packed)[8],
                                             bool& bad) {
  if (multiplier >= 0 && multiplier <= 18) {  // the quant4 rule: |code * m| <= 127 unless code -8, m >= 17
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      expand_word(words[j], static_cast<uint32_t>(multiplier), packed[2 * j], packed[2 * j + 1]);
      bad |= multiplier >= 17 && has_code_minus8(words[j]);
    }
  } else {  // any other int8 multiplier: element by element
#pragma unroll
    for (int v = 0; v < 8; ++v) {
      uint32_t word = 0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int value = code_at(words, 4 * v + b) * multiplier;
        bad |= value < -128 || value > 127;
        word |= (static_cast<uint32_t>(value) & 0xFFu) << (8 * b);
      }
      packed[v] = word;
    }
  }
}

// One thread per chunk, grid-stride. Launched with programmatic dependence (pdl.cuh): the packed
// weights and multipliers are constants, so they are loaded before the wait, which guards the
// stores. A thread releases the dependent W8A8 GEMM after its stores, so that the GEMM's blocks
// launch while the last expansion blocks finish. Released at the start instead, back-to-back
// expansions got slower (out_proj 9.4 -> 10.9 us on the H100) and so did in_proj's W4A8 prefill
// at M = 2048 (95 -> 99 us).
__global__ void __launch_bounds__(kThreads)
w4a8_expand_kernel(const uint8_t* __restrict__ w, const int8_t* __restrict__ multipliers, int8_t* __restrict__ out,
                   int total_chunks, int chunks_per_row, int chunks_per_group, int* overflow) {
  const int groups = chunks_per_row / chunks_per_group;
  bool bad = false;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total_chunks; i += gridDim.x * blockDim.x) {
    const int row = i / chunks_per_row;
    const int c = i - row * chunks_per_row;
    const int multiplier = __ldg(multipliers + static_cast<int64_t>(row) * groups + c / chunks_per_group);
    uint32_t words[4];
    load_chunk(words, w, i);
    uint32_t packed[8];
    expand_chunk(words, multiplier, packed, bad);
    pdl_wait();
    int4* dst = reinterpret_cast<int4*>(out) + 2 * static_cast<int64_t>(i);  // 32 bytes of out per chunk
    dst[0] = make_int4(packed[0], packed[1], packed[2], packed[3]);
    dst[1] = make_int4(packed[4], packed[5], packed[6], packed[7]);
  }
  pdl_wait();  // threads with no chunk have not waited yet
  pdl_launch_dependents();
  if (bad && overflow != nullptr) atomicExch(overflow, 1);
}

template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi);
template <>
__device__ __forceinline__ uint32_t pack2<__nv_bfloat16>(float lo, float hi) {
  const __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Codes of one word as exact fp16 pairs (code q, code q + 4), q = 0..3 (as in the W4A16 GEMV).
__device__ __forceinline__ void codes_f16(uint32_t word, uint32_t (&pairs)[4]) {
  const uint32_t flipped = word ^ 0x88888888u;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint32_t v = ((flipped >> (4 * q)) & 0x000F000Fu) | 0x64006400u;  // 1024 + (n ^ 8)
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(pairs[q]) : "r"(v), "r"(0x3C003C00u), "r"(0xE408E408u));
  }
}

// code * scale rounded once to T: for fp16 one f16x2 multiply (the exact product rounded to
// fp16, as the fp32 product would be); for bf16 through fp32.
template <typename T>
__device__ __forceinline__ uint32_t scale_pair(uint32_t codes, uint32_t scale2, float scale);
template <>
__device__ __forceinline__ uint32_t scale_pair<__half>(uint32_t codes, uint32_t scale2, float) {
  uint32_t r;
  asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(codes), "r"(scale2));
  return r;
}
template <>
__device__ __forceinline__ uint32_t scale_pair<__nv_bfloat16>(uint32_t codes, uint32_t, float scale) {
  const __half2 h = *reinterpret_cast<const __half2*>(&codes);
  const float2 f = __half22float2(h);
  return pack2<__nv_bfloat16>(__fmul_rn(f.x, scale), __fmul_rn(f.y, scale));
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
w4a16_dequantize_kernel(const uint32_t* __restrict__ w, const __half* __restrict__ scales, T* __restrict__ out,
                        int total_words, int words_per_row, int words_per_group) {
  const int groups = words_per_row / words_per_group;
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total_words; i += gridDim.x * blockDim.x) {
    const int row = i / words_per_row;
    const int c = i - row * words_per_row;
    const __half scale_h = __ldg(scales + static_cast<int64_t>(row) * groups + c / words_per_group);
    const __half2 scale_h2 = __halves2half2(scale_h, scale_h);
    const uint32_t scale2 = *reinterpret_cast<const uint32_t*>(&scale_h2);
    const float scale = __half2float(scale_h);
    uint32_t pairs[4];
    codes_f16(__ldcs(w + i), pairs);
#pragma unroll
    for (int q = 0; q < 4; ++q) pairs[q] = scale_pair<T>(pairs[q], scale2, scale);
    reinterpret_cast<int4*>(out)[i] = make_int4(__byte_perm(pairs[0], pairs[1], 0x5410),   // codes 0, 1
                                                __byte_perm(pairs[2], pairs[3], 0x5410),   // codes 2, 3
                                                __byte_perm(pairs[0], pairs[1], 0x7632),   // codes 4, 5
                                                __byte_perm(pairs[2], pairs[3], 0x7632));  // codes 6, 7
  }
}

// Blocks for `items` work items (below 2^30: N * K < 2^33 and at least 8 codes per item).
int grid_for(int64_t N, int K, int items_per_row) {
  TORCH_CHECK(N * K < (int64_t{1} << 33), "4-bit weight expansion: N * K must be below 2^33");
  return static_cast<int>(std::min<int64_t>((N * items_per_row + kThreads - 1) / kThreads, 65535));
}

}  // namespace

void launch_w4a8_expand(const uint8_t* w, const int8_t* group_multiplier, int8_t* out, int N, int K, int group_size,
                        int* overflow, cudaStream_t stream) {
  if (N == 0 || K == 0) return;
  const int chunks_per_row = K / kCodesPerChunk;
  gemm::check_kernel_image(reinterpret_cast<const void*>(w4a8_expand_kernel), "w4a8 weight expansion");
  const int grid = grid_for(N, K, chunks_per_row);
  launch_with_pdl(w4a8_expand_kernel, grid, kThreads, 0, stream, w, group_multiplier, out, N * chunks_per_row,
                  chunks_per_row, group_size / kCodesPerChunk, overflow);
}

void launch_w4a16_dequantize(const uint8_t* w, const void* scales, void* out, ActType out_type, int N, int K,
                             int group_size, cudaStream_t stream) {
  if (N == 0 || K == 0) return;
  constexpr int kCodesPerWord = 8;
  const int words_per_row = K / kCodesPerWord;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    const auto kernel = w4a16_dequantize_kernel<T>;
    gemm::check_kernel_image(reinterpret_cast<const void*>(kernel), "w4a16 weight dequantization");
    const int grid = grid_for(N, K, words_per_row);
    kernel<<<grid, kThreads, 0, stream>>>(reinterpret_cast<const uint32_t*>(w), static_cast<const __half*>(scales),
                                          static_cast<T*>(out), N * words_per_row, words_per_row,
                                          group_size / kCodesPerWord);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
  if (out_type == ActType::kFloat16) launch(__half{});
  else launch(__nv_bfloat16{});
}

}  // namespace quamba::gemm4
