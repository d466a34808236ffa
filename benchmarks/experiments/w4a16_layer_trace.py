"""Per-phase trace of the W4A16 layer kernel: 8 distinct layers cycled in a CUDA graph (weights from
HBM), each block's %globaltimer stamps at the end of each phase, medians over the blocks.

What it showed (fresh H200, 2026-11-27, b5c804a; benchmarks/RESULTS.md, "Decode at batch 1"): 15.8
us a layer = launch wait 1.54, residual + RMSNorm 1.79, in_proj 4.35, x_proj's partial sums 0.51,
grid barrier 1.28, dt_proj + scan 1.02, grid barrier 1.02, y + out_proj 3.84
(benchmarks/results/2026-11-27c-h200/trace_in_flight_3.log): 7.2 us that no weight byte sets, which
is why #26's W4A8 and W4A16 batch-1 targets are missed. More chunks in flight (5, 7) were slower
(trace_in_flight_5.log, trace_in_flight_7.log); the group scales copied by stores before the wait
put 2.82 us before it, 16.9 a layer (trace_stores_before_wait.log).

It needs the instrumented kernel: trace_patch.py writes the stamps past the workspace's used words.
Patch and build a scratch copy of the tree, never commit the patch. From that copy's root:

    python benchmarks/experiments/trace_patch.py csrc/fused_decode/w4a16_layer.cu

    QUAMBA_CUDA_FAMILIES=fused_decode python setup.py build_ext --inplace

    cd benchmarks/experiments && PYTHONPATH=../.. python w4a16_layer_trace.py

It imports w4a16_layer_check.py from its own folder. It ran at 6789cb4; its imports follow
quamba.ops as regrouped in 8236d4c. Moved from benchmarks/results/2026-11-27c-h200/ (a294b7c added
it, e3a68d2 last changed it).
"""
import time

import torch

from w4a16_layer_check import DI, DM, NS, W, dev, eps, group_scales, linears, norm_w, small, ssm

words = torch.ops.quamba.w4a16_layer_workspace_words()
LAYERS = 8
layers = []
for i in range(LAYERS):
    in_proj, x_proj, out_proj = linears()
    layers.append(dict(in_proj=in_proj, x_proj=x_proj, out_proj=out_proj, small=small(x_proj),
                       gs=group_scales(in_proj, out_proj),
                       ws=torch.zeros(words, dtype=torch.int32, device=dev),
                       conv=torch.randn(1, DI, W - 1, device=dev).half(), state=torch.randn(1, DI, NS, device=dev)))


def run_layers(hidden):
    residual = None
    for L_ in layers:
        hidden, residual = torch.ops.quamba.w4a16_layer_step(
            hidden, residual, norm_w, eps, L_["in_proj"].packed, L_["small"], L_["out_proj"].packed, L_["gs"],
            ssm.conv_weight, ssm.conv_bias, L_["conv"][0], L_["state"][0], ssm.dt_bias, ssm.A, ssm.D, L_["ws"])
    return hidden


hidden = torch.randn(DM, device=dev).half()
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    for _ in range(8):
        run_layers(hidden)
for _ in range(3):
    g.replay()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(20):
    g.replay()
torch.cuda.synchronize()
print(f"{(time.perf_counter() - t0) / 20 / 64 * 1e6:.2f} us a layer ({LAYERS} distinct layers cycled, weights from HBM)")
used = words - 2 * 128 * 16
stamps = [L_["ws"][used:].view(torch.int64).view(128, 16)[:, :9].cpu().double() for L_ in layers]
names = ["wait", "norm", "in_proj", "x_proj", "barrier1", "dt+scan", "barrier2", "y+out_proj"]
for i, st in enumerate(stamps[1:-1], 1):
    steps = (st[:, 1:] - st[:, :-1]) / 1e3
    med = steps.median(dim=0).values
    gap = (st[:, 0].min() - stamps[i - 1][:, 8].max()) / 1e3
    print(f"layer {i}: start spread {(st[:, 0].max() - st[:, 0].min()) / 1e3:.2f} us, gap from last end {gap:.2f} us; "
          + ", ".join(f"{n} {m:.2f}" for n, m in zip(names, med.tolist()))
          + f"; total {(st[:, 8].max() - st[:, 0].min()) / 1e3:.2f}")
