// Standalone bench of csrc/gemm4/w4a8_tiled.cuh (as built for the runs of this folder, beside a copy of
// the kernel's earlier version, v1, and a stand-in pdl.cuh; nvcc -O3 -arch=sm_90a -Xcompiler -fopenmp): exactness against a CPU reference, then graph
// replays on cold copies (PDL launches back to back), per variant. argv: shapes as name:M:N:K ...
#include <cuda_runtime.h>
#include <omp.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <random>
#include <string>
#include <vector>
#include "gemm4/w4a8_tiled.cuh"
#include "../.dev/w4a8_tiled_v1.cuh"

using namespace quamba;
namespace tl = quamba::gemm4::tiled;
namespace t1 = quamba::gemm4::tiled_v1;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d: %s\n", #x, __LINE__, cudaGetErrorString(e)); exit(1);} } while (0)
constexpr int G = 128;

struct Buffers { int8_t* x; uint8_t* w; int8_t* gm; float* pc; void* out; };

template <typename KernelT>
void launch_kernel(KernelT kernel, int rows, int threads, int smem, const Buffers& b, int M, int N, int K, int per,
                   int used, cudaStream_t st, void* out) {
  CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  if (used > 8) CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  cudaLaunchAttribute at[2];
  at[0].id = cudaLaunchAttributeClusterDimension; at[0].val.clusterDim.x = 1; at[0].val.clusterDim.y = used; at[0].val.clusterDim.z = 1;
  at[1].id = cudaLaunchAttributeProgrammaticStreamSerialization; at[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t c = {};
  c.gridDim = dim3((N + rows - 1) / rows, used, 1); c.blockDim = dim3(threads); c.dynamicSmemBytes = smem;
  c.stream = st; c.attrs = at; c.numAttrs = 2;
  tl::Problem p{b.x, K, b.w, b.gm, G, M, N, K, per};
  quamba::gemm::Epilogue e{1.0f, b.pc, nullptr};
  void* args[] = {&p, &out, &e};
  CK(cudaLaunchKernelExC(&c, reinterpret_cast<const void*>(kernel), args));
}
int per_split(int K, int splits, int align) { return ((K + splits - 1) / splits + align - 1) / align * align; }

template <int WR, int NT, int S, int W, typename OutT>
void launch1(const Buffers& b, int M, int N, int K, int splits, cudaStream_t st) {
  using T = t1::Tile<WR, NT, S, W>;
  const int per = per_split(K, splits, 128), used = (K + per - 1) / per;
  launch_kernel(t1::w4a8_tiled_kernel<WR, NT, S, W, OutT>, T::kRows, T::kThreads, T::smem_bytes((per + G - 1) / G + 1),
                b, M, N, K, per, used, st, b.out);
}
template <int WR, int NT, int SUB, int S, int W, typename OutT>
void launch2(const Buffers& b, int M, int N, int K, int splits, cudaStream_t st) {
  using T = tl::Tile<WR, NT, SUB, S, W>;
  const int per = per_split(K, splits, T::kStageCodes), used = (K + per - 1) / per;
  launch_kernel(tl::w4a8_tiled_kernel<WR, NT, SUB, S, W, OutT>, T::kRows, T::kThreads, T::smem_bytes((per + G - 1) / G + 1),
                b, M, N, K, per, used, st, b.out);
}

using Fn = void (*)(const Buffers&, int, int, int, int, cudaStream_t);
struct Variant { const char* name; int nt; Fn f32, i8; };
#define V1(WR, NT, S, W) {"v1_" #WR "x" #NT "s" #S "w" #W, NT, launch1<WR, NT, S, W, float>, launch1<WR, NT, S, W, int8_t>}
#define V2(WR, NT, SUB, S, W) {"v2_" #WR "x" #NT "k" #SUB "s" #S "w" #W, NT, launch2<WR, NT, SUB, S, W, float>, launch2<WR, NT, SUB, S, W, int8_t>}
Variant variants[] = {V2(2, 8, 1, 3, 4), V2(2, 8, 1, 4, 4), V2(2, 8, 1, 3, 8), V2(2, 8, 1, 4, 8), V2(1, 8, 1, 4, 8),
                      V2(1, 8, 2, 3, 4), V2(2, 4, 1, 4, 4), V2(2, 4, 1, 4, 8), V2(2, 4, 1, 6, 8)};

int main(int argc, char** argv) {
  cudaStream_t st; CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cudaEvent_t e0, e1; CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
  {  // copy bandwidth
    size_t bytes = 512ull << 20; void *a, *b2; CK(cudaMalloc(&a, bytes)); CK(cudaMalloc(&b2, bytes));
    for (int i = 0; i < 3; ++i) CK(cudaMemcpyAsync(b2, a, bytes, cudaMemcpyDeviceToDevice, st));
    CK(cudaEventRecord(e0, st)); for (int i = 0; i < 10; ++i) CK(cudaMemcpyAsync(b2, a, bytes, cudaMemcpyDeviceToDevice, st));
    CK(cudaEventRecord(e1, st)); CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1));
    printf("copy_bw_GBps %.0f\n", 2.0 * bytes * 10 / (ms * 1e-3) / 1e9); CK(cudaFree(a)); CK(cudaFree(b2));
  }
  std::mt19937 rng(7);
  for (int ai = 1; ai < argc; ++ai) {
    char name[64]; int M, N, K; sscanf(argv[ai], "%[^:]:%d:%d:%d", name, &M, &N, &K);
    const size_t wbytes = size_t(N) * K / 2, gbytes = size_t(N) * (K / G);
    std::vector<int8_t> x(size_t(M) * K), gm(gbytes); std::vector<uint8_t> w(wbytes); std::vector<float> pc(N);
    for (auto& v : x) v = int8_t(int(rng() % 255) - 127);
    for (auto& v : w) v = uint8_t(rng() & 255);
    for (auto& v : gm) v = int8_t(int(rng() % 255) - 127);  // any int8 multiplier
    std::vector<int64_t> ref(size_t(M) * N);
#pragma omp parallel for
    for (int n = 0; n < N; ++n)
      for (int m = 0; m < M; ++m) {
        int64_t acc = 0;
        for (int gi = 0; gi < K / G; ++gi) {
          int64_t s = 0;
          for (int k = gi * G; k < gi * G + G; ++k) {
            int nib = (w[size_t(n) * (K / 2) + k / 2] >> (4 * (k & 1))) & 15; if (nib >= 8) nib -= 16;
            s += int64_t(nib) * x[size_t(m) * K + k];
          }
          acc += s * gm[size_t(n) * (K / G) + gi];
        }
        ref[size_t(m) * N + n] = acc;
      }
    for (int n = 0; n < N; ++n) pc[n] = 1.0f;
    const int copies = std::max<size_t>(2, std::min<size_t>(48, (160ull << 20) / wbytes + 1));
    Buffers b; std::vector<uint8_t*> wc(copies); std::vector<int8_t*> gc(copies);
    CK(cudaMalloc(&b.x, x.size())); CK(cudaMemcpy(b.x, x.data(), x.size(), cudaMemcpyHostToDevice));
    CK(cudaMalloc(&b.pc, 4 * N)); CK(cudaMemcpy(b.pc, pc.data(), 4 * N, cudaMemcpyHostToDevice));
    CK(cudaMalloc(&b.out, size_t(M) * N * 4));
    for (int c = 0; c < copies; ++c) {
      CK(cudaMalloc(&wc[c], wbytes)); CK(cudaMemcpy(wc[c], w.data(), wbytes, cudaMemcpyHostToDevice));
      CK(cudaMalloc(&gc[c], gbytes)); CK(cudaMemcpy(gc[c], gm.data(), gbytes, cudaMemcpyHostToDevice));
    }
    for (auto& v : variants) {
      if (M > 8 * v.nt) continue;
      if (getenv("W4_ONLY") && !strstr(v.name, getenv("W4_ONLY"))) continue;
      for (int splits : {1, 2, 4, 8, 16}) {
        if (splits > K / 128) continue;
        if (getenv("W4_SPLITS") && splits != atoi(getenv("W4_SPLITS"))) continue;
        b.w = wc[0]; b.gm = gc[0];
        CK(cudaMemset(b.out, 0, size_t(M) * N * 4));
        v.f32(b, M, N, K, splits, st); CK(cudaStreamSynchronize(st));
        std::vector<float> got(size_t(M) * N); CK(cudaMemcpy(got.data(), b.out, got.size() * 4, cudaMemcpyDeviceToHost));
        long bad = 0;
        for (size_t i = 0; i < got.size(); ++i) if (got[i] != float(ref[i])) ++bad;
        // timing: a graph of `reps` launches over the cold copies
        const int reps = 4 * copies;
        cudaGraph_t graph; cudaGraphExec_t exec;
        CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
        for (int r = 0; r < reps; ++r) { b.w = wc[r % copies]; b.gm = gc[r % copies]; v.i8(b, M, N, K, splits, st); }
        CK(cudaStreamEndCapture(st, &graph)); CK(cudaGraphInstantiate(&exec, graph, 0));
        CK(cudaGraphLaunch(exec, st)); CK(cudaStreamSynchronize(st));
        std::vector<float> times;
        for (int round = 0; round < 9; ++round) {
          CK(cudaEventRecord(e0, st)); CK(cudaGraphLaunch(exec, st)); CK(cudaEventRecord(e1, st));
          CK(cudaEventSynchronize(e1)); float ms; CK(cudaEventElapsedTime(&ms, e0, e1)); times.push_back(ms);
        }
        std::sort(times.begin(), times.end());
        const double us = 1e3 * times[times.size() / 2] / reps;  // median
        printf("%s M=%d N=%d K=%d %s splits=%d us=%.2f GBps=%.0f mismatches=%ld\n", name, M, N, K, v.name, splits, us,
               (wbytes + gbytes) / (us * 1e-6) / 1e9, bad);
        fflush(stdout);
        CK(cudaGraphExecDestroy(exec)); CK(cudaGraphDestroy(graph));
      }
    }
    for (int c = 0; c < copies; ++c) { CK(cudaFree(wc[c])); CK(cudaFree(gc[c])); }
    CK(cudaFree(b.x)); CK(cudaFree(b.pc)); CK(cudaFree(b.out));
  }
  return 0;
}
