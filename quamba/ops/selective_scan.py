"""Floating-point selective scan (Mamba1 SSM), the reference for every scan in quamba.

Layouts follow mamba_ssm's ``selective_scan_fn``: channels before time. On CUDA tensors the
``auto`` backend runs mamba-ssm's kernels when they are installed (quamba.ops.fp_kernels).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quamba.ops import backend, fp_kernels  # noqa: F401  fp_kernels registers the cuda kernels

# Time steps whose discretised A and B·u are materialised at once: bounds the reference's
# memory to batch * d_inner * _CHUNK * d_state floats whatever the sequence length.
_CHUNK = 256


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, backend_name=None):
    """Selective scan in fp32; returns ``(y, last_state)``.

    u, delta: [batch, d_inner, seqlen]; A: [d_inner, d_state] (real, negative);
    B, C: [batch, d_state, seqlen]; D, delta_bias: [d_inner]; z: [batch, d_inner, seqlen] or None;
    initial_state: [batch, d_inner, d_state] or None (zeros).

        Δ = softplus(delta + delta_bias)           (softplus only if delta_softplus)
        h_t = exp(Δ_t A) ⊙ h_{t-1} + Δ_t u_t B_t
        y_t = C_t · h_t + D u_t,   y_t ← y_t ⊙ SiLU(z_t)

    y has u's dtype; last_state is fp32 [batch, d_inner, d_state].
    """
    impl = backend.select("selective_scan", u.device, backend_name)
    return impl(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state)


@backend.register("selective_scan", "torch")
def _selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state):
    out_dtype = u.dtype
    u, delta, B, C = u.float(), delta.float(), B.float(), C.float()
    A = A.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()[None, :, None]
    if delta_softplus:
        delta = F.softplus(delta)
    batch, d_inner, seqlen = u.shape
    state = (torch.zeros(batch, d_inner, A.shape[1], dtype=torch.float32, device=u.device)
             if initial_state is None else initial_state.float().clone())
    ys = []
    for start in range(0, seqlen, _CHUNK):
        stop = min(start + _CHUNK, seqlen)
        dt = delta[:, :, start:stop]
        decay = torch.exp(dt.unsqueeze(-1) * A[None, :, None, :])  # [b, d, t, n]
        drive = (dt * u[:, :, start:stop]).unsqueeze(-1) * B[:, None, :, start:stop].transpose(-1, -2)
        states = torch.empty_like(decay)
        for t in range(stop - start):
            state = decay[:, :, t] * state + drive[:, :, t]
            states[:, :, t] = state
        ys.append(torch.einsum("bdtn,bnt->bdt", states, C[:, :, start:stop]))
    y = torch.cat(ys, dim=-1) if ys else u.new_zeros(batch, d_inner, 0)
    if D is not None:
        y = y + u * D.float()[None, :, None]
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(out_dtype), state


def selective_state_update(state, u, delta, A, B, C, D=None, z=None, delta_bias=None,
                           delta_softplus=False, backend_name=None):
    """One decode step of the selective scan; updates ``state`` in place and returns y.

    state: [batch, d_inner, d_state] (fp32); u, delta, z: [batch, d_inner];
    B, C: [batch, d_state]. y has u's dtype, shape [batch, d_inner].
    """
    impl = backend.select("selective_state_update", u.device, backend_name)
    return impl(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus)


@backend.register("selective_state_update", "torch")
def _selective_state_update_torch(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    out_dtype = u.dtype
    u, delta = u.float(), delta.float()
    if delta_bias is not None:
        delta = delta + delta_bias.float()
    if delta_softplus:
        delta = F.softplus(delta)
    decay = torch.exp(delta.unsqueeze(-1) * A.float())
    new_state = decay * state.float() + (delta * u).unsqueeze(-1) * B.float().unsqueeze(1)
    state.copy_(new_state)
    y = torch.einsum("bdn,bn->bd", new_state, C.float())
    if D is not None:
        y = y + u * D.float()
    if z is not None:
        y = y * F.silu(z.float())
    return y.to(out_dtype)
