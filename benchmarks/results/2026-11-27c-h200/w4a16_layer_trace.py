"""Per-phase trace of the W4A16 layer kernel built from trace_patch.py's instrumented copy: 8
distinct layers cycled in a CUDA graph (weights from HBM), each block's %globaltimer stamps."""
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
