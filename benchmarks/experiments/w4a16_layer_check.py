"""Check and time the W4A16 layer kernel (w4a16_layer_step) alone against the torch chain, with no
launcher: 4 steps from random states against the chain (out and SSM state as relative errors, the
residual and conv state for equality), then CUDA-graph replays of the kernel on one layer's weights
(L2-resident). Its random weights and repacking also serve w4a16_layer_trace.py.

What it showed (fresh H200s, 2026-11-27; benchmarks/RESULTS.md, "compute-sanitizer"): the proxy
fence that 5380c3b added before each ring-slot refill costs nothing measurable: the kernel alone
took 13.6 us with it and 13.5-13.6 us without (fused_decode-only builds alternated).

Run from the repository root with quamba._C built (the fused_decode family at least):

    PYTHONPATH=$PWD python benchmarks/experiments/w4a16_layer_check.py

It ran at 6789cb4; its imports follow quamba.ops as regrouped in 8236d4c. Moved from
benchmarks/results/2026-11-27c-h200/ (a294b7c added it, e3a68d2 last changed it).
"""
import time

import torch

import quamba._C  # noqa: F401  registers the ops
from quamba.ops.fused_decode.w4a16_step import FloatSSMWeights, W4A16Weight, chain_step
from quamba.ops.linear.qlinear4 import w4a16_linear
from quamba.ops.norm.rms_norm import rms_norm
from quamba.ops.quant4 import quantize_weight_w4a16

torch.manual_seed(0)
dev = "cuda"
DM, DI, NS, R, W, G = 2560, 5120, 16, 160, 4, 128


def w4(n, k, std):
    packed, scales, _ = quantize_weight_w4a16(torch.randn(n, k, device=dev) * std, G)
    return W4A16Weight(packed.contiguous(), scales.contiguous(), G)


def linears():
    """Random in_proj, x_proj, out_proj of one layer."""
    return w4(2 * DI, DM, 0.02), w4(R + 2 * NS, DI, 0.02), w4(DM, DI, 0.02)


ssm = FloatSSMWeights((torch.randn(DI, W, device=dev) * 0.3).half(), (torch.randn(DI, device=dev) * 0.1).half(),
                      (torch.randn(DI, R, device=dev) * 0.1).half(), (torch.randn(DI, device=dev) * 0.5 - 3).half(),
                      -torch.exp(torch.rand(DI, NS, device=dev) * 2), torch.randn(DI, device=dev))
norm_w = (1 + 0.1 * torch.randn(DM, device=dev)).half()
eps = 1e-5


def small(x_proj):
    cols = x_proj.packed.view(R + 2 * NS, 128, 20).permute(1, 0, 2).reshape(128, -1)
    c0 = torch.arange(128, device=dev) * 40
    sc = torch.stack([x_proj.scales[:, c0 // G], x_proj.scales[:, (c0 + 39) // G]], dim=-1)  # [192,128,2]
    sc = sc.permute(1, 0, 2).reshape(128, -1).view(torch.int8)
    dt = ssm.dt_weight.reshape(128, -1).view(torch.int8)
    return torch.cat([cols.view(torch.int8), sc, dt], dim=1).contiguous()


def group_scales(in_proj, out_proj):
    xs, zs = in_proj.scales.chunk(2)
    return torch.cat([xs.reshape(128, -1), zs.reshape(128, -1), out_proj.scales.reshape(128, -1)], 1).contiguous()


def chain(hidden, residual, conv_state, ssm_state, in_proj, x_proj, out_proj):
    normed, res = rms_norm(hidden, residual, norm_w, eps, True, backend_name="torch")
    x, z = w4a16_linear(normed, in_proj.packed, in_proj.scales, G, backend_name="torch").chunk(2, dim=-1)
    y = chain_step(x, z, conv_state, ssm_state, x_proj, ssm, backend_name="torch")
    return w4a16_linear(y, out_proj.packed, out_proj.scales, G, backend_name="torch"), res


def kernel(hidden, residual, conv_state, ssm_state, in_proj, sm, out_proj, gs, ws):
    return torch.ops.quamba.w4a16_layer_step(hidden.reshape(-1), None if residual is None else residual.reshape(-1),
                                             norm_w, eps, in_proj.packed, sm, out_proj.packed, gs, ssm.conv_weight,
                                             ssm.conv_bias, conv_state[0], ssm_state[0], ssm.dt_bias, ssm.A, ssm.D, ws)


def rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


if __name__ == "__main__":
    in_proj, x_proj, out_proj = linears()
    words = torch.ops.quamba.w4a16_layer_workspace_words()
    ws = torch.zeros(words, dtype=torch.int32, device=dev)
    weights = (in_proj, small(x_proj), out_proj, group_scales(in_proj, out_proj), ws)
    print("lacks:", repr(torch.ops.quamba.w4a16_layer_step_lacks(DM, DI, NS, R, W, 0)))
    for step in range(4):
        hidden = torch.randn(1, DM, device=dev).half()
        residual = None if step == 0 else torch.randn(1, DM, device=dev) * 3
        conv = (torch.randn(1, DI, W - 1, device=dev)).half()
        state = torch.randn(1, DI, NS, device=dev)
        c_conv, c_state, k_conv, k_state = conv.clone(), state.clone(), conv.clone(), state.clone()
        out_c, res_c = chain(hidden, residual, c_conv, c_state, in_proj, x_proj, out_proj)
        out_k, res_k = kernel(hidden, residual, k_conv, k_state, *weights)
        torch.cuda.synchronize()
        print(f"step {step}: out rel {rel(out_k, out_c):.2e} residual equal {torch.equal(res_k, res_c.reshape(-1))} "
              f"conv equal {torch.equal(k_conv, c_conv)} state rel {rel(k_state, c_state):.2e} "
              f"out max {out_c.float().abs().max().item():.3f}")
    hidden = torch.randn(1, DM, device=dev).half()
    conv = torch.randn(1, DI, W - 1, device=dev).half()
    state = torch.randn(1, DI, NS, device=dev)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(64):
            kernel(hidden, None, conv, state, *weights)
    g.replay(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        g.replay()
    torch.cuda.synchronize()
    print(f"layer kernel {(time.perf_counter() - t0) / 20 / 64 * 1e6:.1f} us/launch (weights L2-resident: same layer)")
