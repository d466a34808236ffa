"""Dev check of the W4A16 layer kernel against the torch chain (no launcher needed)."""
import time
import torch

import quamba._C  # noqa: F401  registers the ops
from quamba.ops.quant4 import quantize_weight_w4a16
from quamba.ops.rms_norm import rms_norm
from quamba.ops.qlinear4 import w4a16_linear
from quamba.ops.w4a16_decode import FloatSSMWeights, W4A16Weight, chain_step

torch.manual_seed(0)
dev = "cuda"
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



LAYERS = 8
layers = []
for i in range(LAYERS):
    in_proj, x_proj, out_proj = w4(2 * DI, DM, 0.02), w4(R + 2 * NS, DI, 0.02), w4(DM, DI, 0.02)
    layers.append(dict(in_proj=in_proj, x_proj=x_proj, out_proj=out_proj, small=small(), gs=group_scales(),
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
    rel = st - st[:, :1]
    steps = (st[:, 1:] - st[:, :-1]) / 1e3
    med = steps.median(dim=0).values
    gap = (st[:, 0].min() - stamps[i - 1][:, 8].max()) / 1e3
    print(f"layer {i}: start spread {(st[:, 0].max() - st[:, 0].min()) / 1e3:.2f} us, gap from last end {gap:.2f} us; "
          + ", ".join(f"{n} {m:.2f}" for n, m in zip(names, med.tolist()))
          + f"; total {(st[:, 8].max() - st[:, 0].min()) / 1e3:.2f}")
