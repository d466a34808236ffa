// The int8 dot products shared by the GEMM, GEMV and decode-step kernels: the tensor-core MMA
// (sm_80 and newer) and 16 codes on the integer units (dp4a).
#pragma once

#include <cstdint>

namespace quamba::gemm {

// d += a (16x32, row-major fragment) * b (32x8, column-major fragment), int32 accumulators.
__device__ __forceinline__ void mma_s8(int (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
      "{%8, %9}, {%0, %1, %2, %3};"
      : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// acc + the dot product of the 16 int8 codes in a and in b (four words each).
__device__ __forceinline__ int dot16(const int4& a, const int4& b, int acc) {
  acc = __dp4a(a.x, b.x, acc);
  acc = __dp4a(a.y, b.y, acc);
  acc = __dp4a(a.z, b.z, acc);
  return __dp4a(a.w, b.w, acc);
}

}  // namespace quamba::gemm
