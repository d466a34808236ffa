"""The int8 quantizer of a linear's float input: per tensor with a static scale
(``quantize_per_tensor``), or per token with each row's scale measured at run time,
absmax / 127 floored as quamba.ops.quant.scale_from_range floors it (``quantize_per_token``: the
hybrids' down_proj inputs, quamba.layers.qtransformer; with an ``activation`` it quantizes relu(x)²
(Nemotron-H's MLP) or silu(x) · up (SwiGLU's), computed in x's dtype as the float layer computes
it: the activation's elementwise kernels and its output's round trip fold into the quantizer's). The
torch references are quamba.ops.quant.quantize's rule; on CUDA tensors each runs one Triton
kernel (quamba.ops.linear.input_quant_triton) instead of the reference's chain of elementwise,
reduction and copy kernels, with the same codes and scales bit for bit."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quamba.errors import QuambaError
from quamba.ops import backend
from quamba.ops.quant import quantize, scale_from_range


def quantize_per_tensor(x: torch.Tensor, scale: float, backend_name=None) -> torch.Tensor:
    """int8 codes of float ``x`` for the per-tensor ``scale`` (a Python float)."""
    _check_float("quantize_per_tensor", x)
    if not scale > 0:
        raise QuambaError(f"quantize_per_tensor: the scale must be positive, got {scale}")
    return backend.select("quantize_per_tensor", x.device, backend_name)(x, scale)


# what quantize_per_token can apply to its input first (activated)
ACTIVATIONS = (None, "relu2", "swiglu")


def quantize_per_token(x: torch.Tensor, backend_name=None, activation: str | None = None,
                       up: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 codes of float ``x``, fp32 scales [..., 1]): one scale per row of the last dimension,
    :func:`per_token_scales`. With an ``activation``, those of :func:`activated` (x, up)."""
    _check_float("quantize_per_token", x)
    if activation not in ACTIVATIONS:
        raise QuambaError(f"quantize_per_token: activation must be one of {ACTIVATIONS}, got "
                          f"{activation!r}")
    if (activation == "swiglu") != (up is not None):
        raise QuambaError("quantize_per_token: up goes with activation 'swiglu' alone")
    if up is not None and (up.shape, up.dtype) != (x.shape, x.dtype):
        raise QuambaError(f"quantize_per_token: up must be x's {x.dtype} {tuple(x.shape)}, got "
                          f"{up.dtype} {tuple(up.shape)}")
    return backend.select("quantize_per_token", x.device, backend_name)(x, activation, up)


def relu2(x: torch.Tensor) -> torch.Tensor:
    """ReLU squared (transformers' "relu2"), in x's dtype: an exact product rounded once."""
    return torch.square(F.relu(x))


def activated(x: torch.Tensor, activation: str | None, up: torch.Tensor | None = None):
    """What a quantizer with ``activation`` quantizes, as the float layers compute it: x,
    relu2(x), or silu(x) · up (SwiGLU's gate and up projections)."""
    if activation == "relu2":
        return relu2(x)
    if activation == "swiglu":
        return F.silu(x) * up
    return x


def per_token_scales(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., 1]: each row's absmax over the last dimension, floored, / 127."""
    return scale_from_range(x.detach().abs().amax(-1, keepdim=True))


def _check_float(op: str, x: torch.Tensor) -> None:
    if not x.is_floating_point() or x.dim() == 0:
        raise QuambaError(f"{op}: x must be a float tensor of at least one dimension, got "
                          f"{x.dtype} of shape {tuple(x.shape)}")


@backend.register("quantize_per_tensor", "torch")
def _quantize_per_tensor_torch(x, scale):
    return quantize(x, scale)


@backend.register("quantize_per_token", "torch")
def _quantize_per_token_torch(x, activation=None, up=None):
    x = activated(x, activation, up)
    scales = per_token_scales(x)
    return quantize(x, scales), scales
