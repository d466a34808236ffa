// 4-bit codes to exact f16 / bf16 pairs for mma.sync m16n8k16 with activations of 16 bits, shared
// by W4A16's GEMVs (gemv4.cu) and the W4A16 block kernel (fused_decode/w4a16_layer.cu).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace quamba::gemm4 {

// (a & b) ^ c in one lop3 (the compiler splits it in two when both b and c are immediates).
__device__ __forceinline__ uint32_t and_xor(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
  return r;
}

template <typename XT>
struct Act;

template <>
struct Act<__half> {
  __device__ __forceinline__ static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t r;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
  }
  // p[q] = (code q, code q + 4) of the packed word w (nibble i = code i) as exact f16. One lop3 per
  // pair flips the sign bits and ORs in 1024's exponent: 1024 + (n ^ 8), minus 1032 = the code.
  // The odd nibbles are not shifted down: 1024 + 16 (n ^ 8), times 1/16 minus 72 = the code.
  __device__ __forceinline__ static void decode(uint32_t w, uint32_t (&p)[4]) {
    const uint32_t w8 = w >> 8;
    p[0] = fma2(and_xor(w, 0x000F000Fu, 0x64086408u), 0x3C003C00u, 0xE408E408u);   // * 1 - 1032
    p[1] = fma2(and_xor(w, 0x00F000F0u, 0x64806480u), 0x2C002C00u, 0xD480D480u);   // / 16 - 72
    p[2] = fma2(and_xor(w8, 0x000F000Fu, 0x64086408u), 0x3C003C00u, 0xE408E408u);
    p[3] = fma2(and_xor(w8, 0x00F000F0u, 0x64806480u), 0x2C002C00u, 0xD480D480u);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

template <>
struct Act<__nv_bfloat16> {
  __device__ __forceinline__ static uint32_t fma2(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t r;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
  }
  // As for f16 with 128.0 (136 = 128 + 8), but bf16 has 7 mantissa bits: every nibble is shifted
  // down first.
  __device__ __forceinline__ static void decode(uint32_t w, uint32_t (&p)[4]) {
#pragma unroll
    for (int q = 0; q < 4; ++q) p[q] = fma2(and_xor(w >> (4 * q), 0x000F000Fu, 0x43084308u), 0x3F803F80u, 0xC308C308u);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint32_t b0, uint32_t b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
};

// p[q] = (x q, x q + 4) of 8 consecutive activations: the pairs of Act<>::decode.
__device__ __forceinline__ void x_pairs(uint4 v, uint32_t (&p)[4]) {
  p[0] = __byte_perm(v.x, v.z, 0x5410);
  p[1] = __byte_perm(v.x, v.z, 0x7632);
  p[2] = __byte_perm(v.y, v.w, 0x5410);
  p[3] = __byte_perm(v.y, v.w, 0x7632);
}

}  // namespace quamba::gemm4
