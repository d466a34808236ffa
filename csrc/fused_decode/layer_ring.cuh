// What the whole-block decode kernels share (layer_step.cu for W8A8 and W4A8, w4a16_layer.cu for
// W4A16): Mamba-2.8B's sizes and the split of a block over 128 thread blocks, one an SM; the
// producer warp that streams a thread block's weights into a ring of shared-memory slots with
// bulk copies (cp.async.bulk, completion on an mbarrier) from the kernel's start; the consumers'
// waits and releases of the slots; and the grid barrier.
//
// A thread block's weight chunks, in order: its in_proj rows (its x rows, then its z rows, 8 a
// chunk), one "small" chunk (its x_proj columns and dt_proj rows, each kernel's own layout), its
// out_proj rows. Each kernel's shared memory (its Smem) holds ``ring``, ``full`` and ``empty``.
#pragma once

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "../ssm_common/ssm_common.cuh"
#include "gemm/gemv_common.cuh"
#include "pdl.cuh"

namespace quamba_ssm {
namespace layer_ring {

constexpr int kModel = 2560, kInner = 5120, kStates = 16, kRank = 160, kWidth = 4;
constexpr int kOuts = kRank + 2 * kStates;                  // x_proj's outputs: dt_low, B, C
constexpr int kBlocks = 128, kChannels = kInner / kBlocks;  // 40 channels a block
constexpr int kOutRows = kModel / kBlocks;                  // 20 out_proj rows a block
constexpr int kThreads = 256, kWarps = kThreads / 32;       // consumers; one producer warp more
constexpr int kBlockThreads = kThreads + 32;
constexpr int kSlots = 9, kChunkBytes = 20480;
constexpr int kInRows = kWarps;  // in_proj rows a chunk, one a warp
constexpr int kInChunks = 2 * kChannels / kInRows;  // x rows, then z rows
constexpr int kSmallChunk = kInChunks, kOutChunk0 = kSmallChunk + 1;
constexpr int kGroup = 128;  // 4-bit weights' groups along K
// rmsnorm_quant_row_kernel's shape for d_model: threads of 8 values, whole warps of them.
constexpr int kRowValues = 8, kRowThreads = kModel / kRowValues, kRowWarps = kRowThreads / 32;
static_assert(kChannels % kInRows == 0 && 2 * kOutRows % kWarps == 0 && kRowThreads % 32 == 0);

// The chunks of int8 (kW4 false) or packed 4-bit (kW4) in_proj and out_proj rows.
template <bool kW4>
struct Layout {
  static constexpr int kInRowBytes = kW4 ? kModel / 2 : kModel;
  static constexpr int kInChunkBytes = kInRows * kInRowBytes;
  static constexpr int kOutRowBytes = kW4 ? kInner / 2 : kInner;
  static constexpr int kOutRowsPerChunk = kChunkBytes / kOutRowBytes;
  static constexpr int kOutChunks = (kOutRows + kOutRowsPerChunk - 1) / kOutRowsPerChunk;
  static constexpr int kChunks = kOutChunk0 + kOutChunks;
  // chunks in flight at most: deeper queues of bulk copies delay the step's small reads (4-bit
  // in_proj chunks are half as large)
  static constexpr int kInFlight = kW4 ? 3 : 2;
  static_assert(kInChunkBytes <= kChunkBytes && kOutRowsPerChunk * kOutRowBytes == kChunkBytes);
};

__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void mbar_init(unsigned long long* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_address(bar)), "r"(count) : "memory");
}

__device__ __forceinline__ void mbar_arrive(unsigned long long* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_address(bar)) : "memory");
}

__device__ __forceinline__ void mbar_wait(unsigned long long* bar, unsigned parity) {
  asm volatile(
      "{\n .reg .pred p;\n WAIT_%=:\n"
      " mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      " @!p bra WAIT_%=;\n}\n" ::"r"(smem_address(bar)),
      "r"(parity)
      : "memory");
}

// The ring's barriers, by thread 0 before the block's first __syncthreads.
template <class Smem>
__device__ __forceinline__ void init_ring(Smem& sm) {
  for (int i = 0; i < kSlots; ++i) mbar_init(&sm.full[i], 1), mbar_init(&sm.empty[i], kWarps);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// The consumers' own barrier (the producer warp never joins it).
__device__ __forceinline__ void consumer_sync() { asm volatile("bar.sync 1, %0;" ::"n"(kThreads) : "memory"); }

// Chunk k of the block's weights: in_proj's x rows then z rows (8 a chunk), the small chunk of
// kSmallBytes, out_proj's rows.
template <bool kW4, int kSmallBytes>
__device__ __forceinline__ void chunk_source(const int8_t* in_proj, const int8_t* small, const int8_t* out_proj,
                                             int k, const int8_t*& src, int& bytes) {
  using L = Layout<kW4>;
  const int b = blockIdx.x;
  if (k < kSmallChunk) {
    const int half = k / (kInChunks / 2), part = k % (kInChunks / 2);
    src = in_proj + static_cast<int64_t>(half * kInner + b * kChannels + part * kInRows) * L::kInRowBytes;
    bytes = L::kInChunkBytes;
  } else if (k == kSmallChunk) {
    src = small + static_cast<int64_t>(b) * kSmallBytes;
    bytes = kSmallBytes;
  } else {
    const int first = (k - kOutChunk0) * L::kOutRowsPerChunk;
    src = out_proj + static_cast<int64_t>(b * kOutRows + first) * L::kOutRowBytes;
    bytes = min(L::kOutRowsPerChunk, kOutRows - first) * L::kOutRowBytes;
  }
}

// One bulk copy of ``bytes`` (a multiple of 16) from global src to shared dst, completing on bar.
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, int bytes, unsigned long long* bar) {
  const unsigned bar_address = smem_address(bar);
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar_address), "r"(bytes) : "memory");
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_address(dst)),
      "l"(src), "r"(bytes), "r"(bar_address)
      : "memory");
}

// The producer warp's lane 0: every chunk in order, each once its slot is free and fewer than
// kInFlight are in flight.
template <bool kW4, int kSmallBytes, class Smem, int kInFlight = Layout<kW4>::kInFlight>
__device__ void produce(const int8_t* in_proj, const int8_t* small, const int8_t* out_proj, Smem& sm) {
  using L = Layout<kW4>;
  static_assert(kSmallBytes <= kChunkBytes && kSmallBytes % 16 == 0 && kInFlight < kSlots);
  for (int k = 0; k < L::kChunks; ++k) {
    const int slot = k % kSlots;
    if (k >= kSlots) {
      mbar_wait(&sm.empty[slot], (k / kSlots - 1) & 1);
      // The consumers read the slot through the generic proxy and the bulk copy writes it through
      // the async proxy: the empty barrier orders the two threads, this fence the two proxies.
      asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    }
    if (k >= kInFlight) mbar_wait(&sm.full[(k - kInFlight) % kSlots], ((k - kInFlight) / kSlots) & 1);
    const int8_t* src;
    int bytes;
    chunk_source<kW4, kSmallBytes>(in_proj, small, out_proj, k, src, bytes);
    bulk_copy(sm.ring[slot], src, bytes, &sm.full[slot]);
  }
}

template <class Smem>
__device__ __forceinline__ const int8_t* wait_chunk(Smem& sm, int k) {
  mbar_wait(&sm.full[k % kSlots], (k / kSlots) & 1);
  return sm.ring[k % kSlots];
}

// Every consumer thread: its warp is done with chunks k ... k + n - 1.
template <class Smem>
__device__ __forceinline__ void release(Smem& sm, int k, int n = 1) {
  __syncwarp();
  if (threadIdx.x % 32 == 0)
    for (int i = 0; i < n; ++i) mbar_arrive(&sm.empty[(k + i) % kSlots]);
}

// All blocks at this point: the counter only grows, by kBlocks a barrier, so a block's ticket
// (the count before its arrival) says which barrier it is at and the count that ends it.
__device__ __forceinline__ void grid_barrier(unsigned* counter) {
  consumer_sync();
  if (threadIdx.x == 0) {
    unsigned ticket, seen;
    asm volatile("atom.add.release.gpu.global.u32 %0, [%1], 1;" : "=r"(ticket) : "l"(counter) : "memory");
    const unsigned target = (ticket / kBlocks + 1) * kBlocks;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(counter) : "memory");
    } while (static_cast<int>(seen - target) < 0);
  }
  consumer_sync();
}

// Whether warp w plays a row warp v = w + 8 i of the row kernel (rmsnorm_quant_row_kernel's shape:
// threads of 8 values, warp w playing its warps w and w + 8), and the first of the 8 values that
// lane l of v holds.
__device__ __forceinline__ bool has_row(int i) { return threadIdx.x / 32 + i * kWarps < kRowWarps; }

__device__ __forceinline__ int row_first(int i) {
  return (32 * (threadIdx.x / 32 + i * kWarps) + threadIdx.x % 32) * kRowValues;
}

// Residual add and 1 / rms of the whole row in every block: r[i] holds hidden + residual at
// row_first(i) (where has_row(i)), whose squares each lane adds with fmaf in order; the warps'
// sums and the sum of those take block_sum's trees (warp_sums: 32 floats of shared memory). Each
// block writes its share of the residual. The consumers meet once inside.
__device__ __forceinline__ float residual_rstd(const __half* hidden, const float* residual, float* residual_out,
                                               float eps, float* warp_sums, float (&r)[2][kRowValues]) {
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    if (!has_row(i)) break;
    const int first = row_first(i);
    load_values<kRowValues>(hidden + first, true, r[i]);
    if (residual != nullptr) {
      float res[kRowValues];
      load_values<kRowValues>(residual + first, true, res);
#pragma unroll
      for (int j = 0; j < kRowValues; ++j) r[i][j] = __fadd_rn(r[i][j], res[j]);
    }
    float sum_sq = 0.f;
#pragma unroll
    for (int j = 0; j < kRowValues; ++j) sum_sq = fmaf(r[i][j], r[i][j], sum_sq);
    sum_sq = quamba::gemm::warp_sum(sum_sq);
    const int row_warp = threadIdx.x / 32 + i * kWarps;
    if (lane == 0) warp_sums[row_warp] = sum_sq;
    if ((32 * row_warp + lane) % kBlocks == blockIdx.x) store_row<kRowValues>(residual_out + first, r[i]);
  }
  consumer_sync();
  const float total = quamba::gemm::warp_sum(lane < kRowWarps ? warp_sums[lane] : 0.f);
  return __frsqrt_rn(__fadd_rn(__fdiv_rn(total, static_cast<float>(kModel)), eps));
}

// Why the kernel cannot run a block of these sizes ("" where it can).
inline std::string shape_lacks(int64_t d_model, int64_t d_inner, int64_t d_state, int64_t dt_rank, int64_t width) {
  if (d_model != kModel || d_inner != kInner || d_state != kStates || dt_rank != kRank || width != kWidth) {
    return "it is built for Mamba-2.8B's blocks (d_model 2560, d_inner 5120, d_state 16, dt_rank 160, "
           "conv width 4), not d_model " + text(d_model) + ", d_inner " + text(d_inner) + ", d_state " +
           text(d_state) + ", dt_rank " + text(dt_rank) + ", width " + text(width);
  }
  return "";
}

// A tensor of this dtype and shape on ref's device, contiguous and 16-byte aligned.
inline void check_tensor(const at::Tensor& t, const at::Tensor& ref, at::ScalarType dtype, at::IntArrayRef shape,
                  const char* name) {
  check_same_device(t, ref, name);
  check_dtype(t, dtype, name);
  check_shape(t, shape, name);
  TORCH_CHECK(t.is_contiguous() && reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0, name,
              " must be contiguous and 16-byte aligned");
}

// Why this device cannot hold a grid of kBlocks blocks of smem_bytes each, one an SM ("" where it
// can).
inline std::string device_lacks(int device, size_t smem_bytes) {
  cudaDeviceProp props;
  C10_CUDA_CHECK(cudaGetDeviceProperties(&props, device));
  if (props.major < 9) return "it needs compute capability 9.0 (bulk copies), got " + text(props.major);
  if (props.multiProcessorCount < kBlocks) {
    return "its " + text(kBlocks) + " blocks need as many SMs, the device has " + text(props.multiProcessorCount);
  }
  if (props.sharedMemPerBlockOptin < smem_bytes) return "its blocks need " + text(smem_bytes) + " bytes of shared memory";
  return "";
}

// Why a kernel of smem_bytes a block cannot run a block of these sizes on this device ("" where it
// can).
inline std::string kernel_lacks(int64_t d_model, int64_t d_inner, int64_t d_state, int64_t dt_rank, int64_t width,
                                int64_t device, size_t smem_bytes) {
  const std::string shape = shape_lacks(d_model, d_inner, d_state, dt_rank, width);
  return shape.empty() ? device_lacks(static_cast<int>(device), smem_bytes) : shape;
}

// op's launch of kBlocks blocks on the current device, once it can hold them and this build has the
// kernel for it: programmatically dependent on the kernel before it and cooperative, every block
// resident at once (the grid barriers need it), or a launch error rather than a hang where the SMs
// are shared.
template <typename Args>
void launch(const char* op, void (*kernel)(Args), int smem_bytes, const Args& args) {
  const std::string lacks = device_lacks(c10::cuda::current_device(), smem_bytes);
  TORCH_CHECK(lacks.empty(), op, ": ", lacks);
  check_kernel_image(kernel, op);
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes));
  cudaLaunchAttribute attributes[2];
  attributes[0].id = cudaLaunchAttributeCooperative;
  attributes[0].val.cooperative = 1;
  attributes[1] = quamba::detail::programmatic_serialization();
  quamba::detail::launch_with_attributes(kernel, dim3(kBlocks), dim3(kBlockThreads), smem_bytes, current_stream(),
                                         attributes, 2, args);
}

}  // namespace layer_ring
}  // namespace quamba_ssm
