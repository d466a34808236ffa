"""compute-sanitizer harness for w4a16_layer_step (the W4A16 layer kernel): one layer of random
Mamba-2.8B-shaped W4A16 weights, repacked as the launcher does, and two kernel steps; no launcher
and no other custom kernel on the GPU (the weights are made on the CPU).

What it showed (fresh H200s, 2026-11-27; benchmarks/RESULTS.md, "compute-sanitizer"): racecheck
reports only the ring's slot refills, the bulk copy of in_proj's chunk k + 9 against the reads of
chunk k (benchmarks/results/2026-11-27d-h200/racecheck_w4a16_layer_818fb78.log and
racecheck_w4a16_layer_5380c3b.log), which experiments/racecheck_ring.cu shows racecheck flags in any
mbarrier ring; initcheck with every kernel instrumented: 0 errors
(benchmarks/results/2026-11-27e-h200/initcheck_w4a16_layer.log).

Run from the repository root with quamba._C built (the fused_decode family at least):

    PYTHONPATH=$PWD compute-sanitizer --tool racecheck python benchmarks/experiments/racecheck_w4a16_layer.py

    PYTHONPATH=$PWD compute-sanitizer --tool initcheck python benchmarks/experiments/racecheck_w4a16_layer.py

It ran at 6789cb4; its imports follow quamba.ops as regrouped in 8236d4c. Moved from
benchmarks/results/2026-11-27d-h200/, where commit e1bf2e6 added it.
"""
import time

import torch

import quamba._C  # noqa: F401  registers the ops
from quamba.ops.fused_decode.w4a16_step import FloatSSMWeights, W4A16Weight, chain_step
from quamba.ops.linear.qlinear4 import w4a16_linear
from quamba.ops.norm.rms_norm import rms_norm
from quamba.ops.quant4 import quantize_weight_w4a16

torch.manual_seed(0)
dev = "cpu"
DM, DI, NS, R, W, G = 2560, 5120, 16, 160, 4, 128


def w4(n, k, std):
    packed, scales, _ = quantize_weight_w4a16(torch.randn(n, k, device=dev) * std, G)
    return W4A16Weight(packed.contiguous(), scales.contiguous(), G)


in_proj, x_proj, out_proj = w4(2 * DI, DM, 0.02), w4(R + 2 * NS, DI, 0.02), w4(DM, DI, 0.02)
ssm = FloatSSMWeights((torch.randn(DI, W, device=dev) * 0.3).half(), (torch.randn(DI, device=dev) * 0.1).half(),
                      (torch.randn(DI, R, device=dev) * 0.1).half(), (torch.randn(DI, device=dev) * 0.5 - 3).half(),
                      -torch.exp(torch.rand(DI, NS, device=dev) * 2), torch.randn(DI, device=dev))
norm_w = (1 + 0.1 * torch.randn(DM, device=dev)).half()
eps = 1e-5


def small():
    cols = x_proj.packed.view(R + 2 * NS, 128, 20).permute(1, 0, 2).reshape(128, -1)
    c0 = torch.arange(128, device=dev) * 40
    sc = torch.stack([x_proj.scales[:, c0 // G], x_proj.scales[:, (c0 + 39) // G]], dim=-1)  # [192,128,2]
    sc = sc.permute(1, 0, 2).reshape(128, -1).view(torch.int8)
    dt = ssm.dt_weight.reshape(128, -1).view(torch.int8)
    return torch.cat([cols.view(torch.int8), sc, dt], dim=1).contiguous()


def group_scales():
    xs, zs = in_proj.scales.chunk(2)
    return torch.cat([xs.reshape(128, -1), zs.reshape(128, -1), out_proj.scales.reshape(128, -1)], 1).contiguous()


def chain(hidden, residual, conv_state, ssm_state):
    normed, res = rms_norm(hidden, residual, norm_w, eps, True, backend_name="torch")
    x, z = w4a16_linear(normed, in_proj.packed, in_proj.scales, G, backend_name="torch").chunk(2, dim=-1)
    y = chain_step(x, z, conv_state, ssm_state, x_proj, ssm, backend_name="torch")
    return w4a16_linear(y, out_proj.packed, out_proj.scales, G, backend_name="torch"), res


words = torch.ops.quamba.w4a16_layer_workspace_words()
ws = torch.zeros(words, dtype=torch.int32, device=dev)
sm, gs = small(), group_scales()


def kernel(hidden, residual, conv_state, ssm_state):
    return torch.ops.quamba.w4a16_layer_step(hidden.reshape(-1), None if residual is None else residual.reshape(-1),
                                             norm_w, eps, in_proj.packed, sm, out_proj.packed, gs, ssm.conv_weight,
                                             ssm.conv_bias, conv_state[0], ssm_state[0], ssm.dt_bias, ssm.A, ssm.D, ws)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()



import dataclasses


def cuda(o):
    if isinstance(o, torch.Tensor):
        return o.cuda()
    if not dataclasses.is_dataclass(o):
        return o
    return type(o)(**{f.name: cuda(getattr(o, f.name)) for f in dataclasses.fields(o)})
in_proj, out_proj, ssm = cuda(in_proj), cuda(out_proj), cuda(ssm)
norm_w, sm, gs, ws = norm_w.cuda(), sm.cuda(), gs.cuda(), ws.cuda()
hidden = torch.randn(1, DM).half().cuda()
residual = (torch.randn(1, DM) * 3).cuda()
conv = torch.randn(1, DI, W - 1).half().cuda()
state = torch.randn(1, DI, NS).cuda()
torch.cuda.synchronize()
for step in range(2):
    out, res = kernel(hidden, residual if step else None, conv, state)
torch.cuda.synchronize()
print("kernel ran twice, out finite:", bool(torch.isfinite(out.cpu()).all()))
