"""Floating-point depthwise causal conv1d (+ bias, optional SiLU): the reference op. On CUDA
tensors the ``auto`` backend runs causal-conv1d's kernels when installed (quamba.ops.fp_kernels)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quamba.ops import backend, fp_kernels  # noqa: F401  fp_kernels registers the cuda kernels


def causal_conv1d(x, weight, bias=None, activation: str | None = "silu", backend_name=None):
    """x: [batch, dim, seqlen]; weight: [dim, width]; bias: [dim]. Same shape as x.

    out[b, d, t] = bias[d] + sum_k weight[d, k] * x[b, d, t - width + 1 + k] (zeros before t=0),
    computed in fp32 and returned in x's dtype.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    impl = backend.select("causal_conv1d", x.device, backend_name)
    return impl(x, weight, bias, activation)


@backend.register("causal_conv1d", "torch")
def _causal_conv1d_torch(x, weight, bias, activation):
    dim, width = weight.shape
    seqlen = x.shape[-1]
    out = F.conv1d(x.float(), weight.float().unsqueeze(1),
                   None if bias is None else bias.float(), padding=width - 1, groups=dim)
    out = out[..., :seqlen]
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


def causal_conv1d_update(x, conv_state, weight, bias=None, activation: str | None = "silu",
                         backend_name=None):
    """One decode step. x: [batch, dim]; conv_state: [batch, dim, width - 1] holding the previous
    inputs, oldest first, rolled in place. Returns [batch, dim] in x's dtype."""
    impl = backend.select("causal_conv1d_update", x.device, backend_name)
    return impl(x, conv_state, weight, bias, activation)


@backend.register("causal_conv1d_update", "torch")
def _causal_conv1d_update_torch(x, conv_state, weight, bias, activation):
    window = torch.cat([conv_state, x.unsqueeze(-1).to(conv_state.dtype)], dim=-1)
    conv_state.copy_(window[..., 1:])
    out = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        out = out + bias.float()
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


def conv_state_from_prefill(x, width: int):
    """The last ``width - 1`` inputs of a prefill (zero-padded on the left): [batch, dim, width-1]."""
    keep = width - 1
    seqlen = x.shape[-1]
    if seqlen >= keep:
        return x[..., seqlen - keep:].contiguous()
    return F.pad(x, (keep - seqlen, 0))
