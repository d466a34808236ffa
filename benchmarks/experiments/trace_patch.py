"""Instrument csrc/fused_decode/w4a16_layer.cu with per-phase %globaltimer stamps of every block's
thread 0, written past the workspace's used words (the workspace grows by 128 * 16 int64), for
w4a16_layer_trace.py. Dev only: patch a scratch copy of the tree, never commit the result.

What it showed: see w4a16_layer_trace.py (the phase trace behind benchmarks/RESULTS.md's "Decode at
batch 1"). The patch matches w4a16_layer.cu's text as of b5c804a and 6789cb4; it asserts each
anchor, so a changed kernel fails loudly. Run from the repository root of the scratch copy:

    python benchmarks/experiments/trace_patch.py csrc/fused_decode/w4a16_layer.cu

Moved from benchmarks/results/2026-11-27c-h200/, where commit a294b7c added it.
"""
import sys

p = sys.argv[1] if len(sys.argv) > 1 else "csrc/fused_decode/w4a16_layer.cu"
s = open(p).read()
s = s.replace("constexpr int kWorkspaceWords = kCounterWords + kSumWords + kYWords;",
              "constexpr int kUsedWords = kCounterWords + kSumWords + kYWords;\n"
              "constexpr int kWorkspaceWords = kUsedWords + 2 * 128 * 16;")
s = s.replace("  __half* y;                     // [d_inner]: the gated scan output\n};",
              "  __half* y;                     // [d_inner]: the gated scan output\n  long long* trace;\n};")
s = s.replace("  args.y = reinterpret_cast<__half*>(words + kCounterWords + kSumWords);",
              "  args.y = reinterpret_cast<__half*>(words + kCounterWords + kSumWords);\n"
              "  args.trace = reinterpret_cast<long long*>(words + kUsedWords);")
STAMP = "if (threadIdx.x == 0) {{ long long g; asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(g)); a.trace[blockIdx.x * 16 + {i}] = g; }}\n"
marks = [
    ("  if (t == 0) {\n    mbar_init(&sm.scales_full, 1);", 0, True),
    ("  quamba::pdl_wait();  // hidden, residual and the states come from earlier kernels", 1, False),
    ("  rmsnorm(a, sm, norm_weight);", 2, False),
    ("  in_proj(sm, k);", 3, False),
    ("  x_proj_partial(a, sm, small);", 4, False),
    ("  grid_barrier(a.counter);\n  if (t < kOuts) {", 5, "barrier1"),
    ("  release(sm, k++);", 6, True),
    ("  for (int i = t; i < kInner / 8; i += kThreads) {  // y of every block", 7, True),
    ("  out_proj(a, sm, k);", 8, False),
]
for text, i, before in marks:
    assert text in s, text
    if before == "barrier1":
        s = s.replace("  grid_barrier(a.counter);\n  if (t < kOuts) {",
                      "  grid_barrier(a.counter);\n  " + STAMP.format(i=i) + "  if (t < kOuts) {")
    elif before:
        s = s.replace(text, "  " + STAMP.format(i=i) + text, 1)
    else:
        s = s.replace(text, text + "\n  " + STAMP.format(i=i), 1)
open(p, "w").write(s)
print("patched")
