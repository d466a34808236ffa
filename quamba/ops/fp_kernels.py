"""The FP16 baseline kernels as the ``cuda`` backend of quamba's floating-point ops: mamba-ssm's
selective scan (CUDA), selective state update and fused add + RMSNorm (Triton), and
causal-conv1d's conv and conv update (CUDA). With them quamba's FP model runs the kernels that
mamba-ssm's own model runs, so its FP16 timings are the real baseline; without them (a CPU
machine, or the packages not installed) the torch references run.

The packages are imported on first use only: importing quamba never needs them.
"""
from __future__ import annotations

import functools

from quamba.ops import backend


@functools.lru_cache(maxsize=1)
def missing() -> str | None:
    """None when mamba-ssm and causal-conv1d's kernels import, else why not (one line)."""
    try:
        import causal_conv1d  # noqa: F401
        import mamba_ssm.ops.selective_scan_interface  # noqa: F401
        import mamba_ssm.ops.triton.layer_norm  # noqa: F401
        import mamba_ssm.ops.triton.selective_state_update  # noqa: F401
    except ImportError as exc:
        return f"mamba-ssm / causal-conv1d kernels are not installed ({exc})"
    return None


@backend.register("selective_scan", "cuda", requires=missing)
def _selective_scan(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    if initial_state is not None:
        raise backend.BackendError("mamba-ssm's selective_scan_fn takes no initial state; "
                                   "use the torch backend")
    return selective_scan_fn(u, delta, A, B, C, None if D is None else D.float(), z=z,
                             delta_bias=None if delta_bias is None else delta_bias.float(),
                             delta_softplus=delta_softplus, return_last_state=True)


@backend.register("selective_state_update", "cuda", requires=missing)
def _selective_state_update(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    return selective_state_update(state, u, delta, A, B, C, D, z=z, dt_bias=delta_bias,
                                  dt_softplus=delta_softplus)


@backend.register("causal_conv1d", "cuda", requires=missing)
def _causal_conv1d(x, weight, bias, activation):
    from causal_conv1d import causal_conv1d_fn
    return causal_conv1d_fn(conv_layout(x), weight, bias, activation=activation)


def conv_layout(x):
    """``x`` [batch, channels, length] as causal-conv1d takes it: channel-last (Mamba2's xBC,
    transposed) only with batch and length strides that are multiples of 8, else a
    channel-first copy (a model of odd widths; its kernel refuses the view)."""
    channel_last = x.stride(1) == 1 and x.stride(2) != 1
    if channel_last and (x.stride(0) % 8 or x.stride(2) % 8):
        return x.contiguous()
    return x


@backend.register("causal_conv1d_update", "cuda", requires=missing)
def _causal_conv1d_update(x, conv_state, weight, bias, activation):
    from causal_conv1d import causal_conv1d_update
    return causal_conv1d_update(x, conv_state, weight, bias, activation=activation)


@backend.register("rms_norm", "cuda", requires=missing)
def _rms_norm(hidden, residual, weight, eps, residual_in_fp32):
    from mamba_ssm.ops.triton.layer_norm import rms_norm_fn
    return rms_norm_fn(hidden, weight, None, residual=residual, eps=eps, prenorm=True,
                       residual_in_fp32=residual_in_fp32)
