"""Random inputs of one W4A16 decode step's SSM side (quamba.ops.fused_decode.w4a16_step) at
Mamba-like magnitudes, fp64 evaluations of the step and of a whole block's step without the chain's
roundings to the activation dtype, and a model's decode-step logits on given tokens, shared by
the CPU tests and the GPU kernel tests."""
import math

import torch
import torch.nn.functional as F

from quamba.ops.fused_decode.w4a16_step import FloatSSMWeights, W4A16Weight
from quamba.ops.quant4 import dequantize_int4, quantize_weight_w4a16


def step_case(batch, d_inner, d_state, dt_rank, width, group_size, dtype=torch.float16,
              device="cpu", seed=0, gated=True, conv_bias=True):
    """dict(x, z, conv_state, ssm_state, x_proj, weights) of one step; x and z are halves of one
    in_proj output (strided views, as the mixer passes them)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape, std=1.0):
        return torch.randn(*shape, generator=gen) * std

    xz = randn(batch, 2 * d_inner).to(dtype)
    x, z = xz.to(device).chunk(2, dim=-1)
    packed, scales, size = quantize_weight_w4a16(randn(dt_rank + 2 * d_state, d_inner,
                                                       std=d_inner ** -0.5), group_size)
    dt = torch.exp(torch.rand(d_inner, generator=gen) * (math.log(0.1) - math.log(1e-3))
                   + math.log(1e-3))
    weights = FloatSSMWeights(
        conv_weight=randn(d_inner, width, std=width ** -0.5).to(dtype).to(device),
        conv_bias=randn(d_inner, std=0.1).to(dtype).to(device) if conv_bias else None,
        dt_weight=randn(d_inner, dt_rank, std=dt_rank ** -0.5).to(dtype).to(device),
        dt_bias=(dt + torch.log(-torch.expm1(-dt))).to(dtype).to(device),  # softplus⁻¹(dt)
        A=-torch.arange(1, d_state + 1, dtype=torch.float32).repeat(d_inner, 1).to(device),
        D=torch.ones(d_inner, device=device))
    return dict(x=x, z=z if gated else None,
                conv_state=randn(batch, d_inner, width - 1).to(dtype).to(device),
                ssm_state=randn(batch, d_inner, d_state).to(device),
                x_proj=W4A16Weight(packed.to(device), scales.to(device), size), weights=weights)


def cloned(case):
    """The case with its own copies of the states the step writes."""
    return {**case, "conv_state": case["conv_state"].clone(),
            "ssm_state": case["ssm_state"].clone()}


def fp64_step(x, z, conv_state, ssm_state, x_proj, weights):
    """(y, new conv state, new SSM state) in fp64, nothing rounded to the activation dtype."""
    w = weights
    window = torch.cat([conv_state.double(), x.double()[..., None]], dim=-1)
    u = (window * w.conv_weight.double()).sum(-1)
    if w.conv_bias is not None:
        u = u + w.conv_bias.double()
    u = F.silu(u)
    x_dbl = u @ dequantize_int4(x_proj.packed.cpu(), x_proj.scales.cpu(),
                                x_proj.group_size).double().to(u.device).t()
    d_state = ssm_state.shape[2]
    dt_low, B, C = torch.split(x_dbl, [w.dt_weight.shape[1], d_state, d_state], dim=-1)
    delta = F.softplus(dt_low @ w.dt_weight.double().t() + w.dt_bias.double())
    A = w.A.double()
    state = (torch.exp(delta[..., None] * A) * ssm_state.double()
             + (delta * u)[..., None] * B[:, None, :])
    y = (state * C[:, None, :]).sum(-1) + u * w.D.double()
    if z is not None:
        y = y * F.silu(z.double())
    return y, window[..., 1:], state


def fp64_layer_step(hidden, residual, layer, conv_state, ssm_state):
    """(out, residual out, new conv state, new SSM state) of a block's step (a W4A16LayerWeights
    ``layer``) in fp64, nothing rounded to the activation dtype."""
    residual_out = hidden.double() if residual is None else hidden.double() + residual.double()
    rms = torch.rsqrt(residual_out.pow(2).mean(-1, keepdim=True) + layer.norm_eps)
    normed = residual_out * rms * layer.norm_weight.double()
    x, z = (normed[:, 0] @ _fp64_weight(layer.in_proj).t()).chunk(2, dim=-1)
    y, conv_state, ssm_state = fp64_step(x, z, conv_state, ssm_state, layer.x_proj, layer.ssm)
    return (y @ _fp64_weight(layer.out_proj).t())[:, None], residual_out, conv_state, ssm_state


def _fp64_weight(weight):
    """A W4A16Weight's dequantized weight in fp64 (code · fp16 scale: exact)."""
    return dequantize_int4(weight.packed.cpu(), weight.scales.cpu(),
                           weight.group_size).double().to(weight.packed.device)


def relative_error(got, expected):
    """The largest absolute difference over the largest magnitude of ``expected`` (fp64)."""
    return ((got.double() - expected).abs().max() / expected.abs().max()).item()


def teacher_forced_logits(model, tokens, prompt_len):
    """The decode step's logits [batch, new tokens, vocab] for each of ``tokens``' new tokens."""
    cache = model.allocate_cache(tokens.shape[0])
    with torch.no_grad():
        logits = [model(tokens[:, :prompt_len], cache=cache)[:, -1]]
        logits += [model(tokens[:, t:t + 1], cache=cache)[:, -1]
                   for t in range(prompt_len, tokens.shape[1] - 1)]
    return torch.stack(logits, dim=1).float()
