"""Floating-point SSD: Mamba2's multi-head selective scan (one scalar A per head), the reference.

x: [batch, seqlen, nheads, headdim]; dt: [batch, seqlen, nheads] (before bias and softplus);
A: [nheads] (negative); B, C: [batch, seqlen, ngroups, d_state], head h reading group
h // (nheads / ngroups); D, dt_bias: [nheads]. Per head, with state h_t of [headdim, d_state]:

    Δ_t = softplus(dt_t + dt_bias)
    h_t = exp(Δ_t A) h_{t-1} + Δ_t x_t ⊗ B_t
    y_t = h_t C_t + D x_t

:func:`ssd_scan` computes a whole sequence in chunks (the SSD algorithm: inside a chunk a masked
product of C Bᵀ with the decays, between chunks the carried state), :func:`ssd_state_update` one
decode step; both in fp32. On a GPU both run quamba's Triton kernels (quamba.ops.ssd.ssd_triton)
where quamba._C loads, else these references, and say so (quamba.ops.backend).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quamba.ops import backend

# The Triton kernels' limits (quamba.ops.ssd.ssd_triton, seen on an H200): a prefill's batch ·
# nheads programs in the grid's y dimension (CUDA's 65535: past it the launch fails), and 32-bit
# element offsets into x and y, pass 0's C·B scores [batch · ngroups, chunks, CHUNK, CHUNK], pass
# 1's chunk states [batch · nheads, chunks, headdim, d_state] and a decode step's state: past 2^31
# elements a prefill reads an illegal address and a step writes where it should not.
KERNEL_CHUNK = 256  # steps per chunk of the prefill (ssd_triton.CHUNK)
KERNEL_MAX_GRID_Y = 65535
KERNEL_MAX_ELEMENTS = 2**31


def kernel_lacks(x, B) -> str | None:
    """Why the Triton prefill cannot take x [batch, seqlen, nheads, headdim] with B [batch,
    seqlen, ngroups, d_state] (None: it can)."""
    batch, seqlen, nheads, headdim = x.shape
    ngroups, d_state = B.shape[2:]
    if batch * nheads > KERNEL_MAX_GRID_Y:
        return (f"its Triton kernels take batch · nheads up to {KERNEL_MAX_GRID_Y}, "
                f"not {batch * nheads}")
    chunks = -(-seqlen // KERNEL_CHUNK)
    sizes = {"x": x.numel(), "C·B scores": batch * ngroups * chunks * KERNEL_CHUNK**2,
             "chunk states": batch * nheads * chunks * headdim * d_state}
    for name, size in sizes.items():
        if size > KERNEL_MAX_ELEMENTS:
            return _too_large(name, size)
    return None


def step_kernel_lacks(state) -> str | None:
    """Why the Triton decode step cannot step ``state`` [batch, nheads, headdim, d_state]."""
    return _too_large("state", state.numel()) if state.numel() > KERNEL_MAX_ELEMENTS else None


def _too_large(name: str, size: int) -> str:
    return f"its Triton kernels index tensors of up to 2^31 elements, not {name} of {size}"


def ssd_scan(x, dt, A, B, C, D, dt_bias, chunk_size: int = 256, initial_state=None,
             backend_name=None):
    """The scan of a prefill: ``(y, last_state)``, y [batch, seqlen, nheads, headdim] in x's dtype,
    last_state fp32 [batch, nheads, headdim, d_state]. The result does not depend on
    ``chunk_size`` beyond fp32 rounding."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    impl = backend.select("ssd_scan", x.device, backend_name, cuda_lacks=kernel_lacks(x, B))
    return impl(x, dt, A, B, C, D, dt_bias, chunk_size, initial_state)


def ssd_state_update(state, x, dt, A, B, C, D, dt_bias, backend_name=None):
    """One decode step: state fp32 [batch, nheads, headdim, d_state] updated in place; x
    [batch, nheads, headdim], dt [batch, nheads], B and C [batch, ngroups, d_state]. Returns y
    [batch, nheads, headdim] in x's dtype."""
    impl = backend.select("ssd_state_update", x.device, backend_name,
                          cuda_lacks=step_kernel_lacks(state))
    return impl(state, x, dt, A, B, C, D, dt_bias)


def _heads(t: torch.Tensor, nheads: int, dim: int) -> torch.Tensor:
    """Groups of B or C repeated for the heads that read them."""
    return t.float().repeat_interleave(nheads // t.shape[dim], dim=dim)


@backend.register("ssd_scan", "torch", fp=True)
def _ssd_scan_torch(x, dt, A, B, C, D, dt_bias, chunk_size, initial_state):
    batch, seqlen, nheads, headdim = x.shape
    out_dtype = x.dtype
    x = x.float()
    dt = F.softplus(dt.float() + dt_bias.float())
    B, C = _heads(B, nheads, 2), _heads(C, nheads, 2)
    decay = dt * A.float()  # log of each step's decay: [b, l, h]
    state = (x.new_zeros(batch, nheads, headdim, B.shape[-1]) if initial_state is None
             else initial_state.float().clone())
    ys = []
    for start in range(0, seqlen, chunk_size):
        chunk = slice(start, min(start + chunk_size, seqlen))
        y, state = _ssd_chunk(x[:, chunk], dt[:, chunk], decay[:, chunk], B[:, chunk], C[:, chunk], state)
        ys.append(y)
    y = torch.cat(ys, dim=1) if ys else x.new_zeros(x.shape)
    y = y + x * D.float()[:, None]
    return y.to(out_dtype), state


def _ssd_chunk(x, dt, decay, B, C, state):
    """One chunk: (y without the D term [b, q, h, p], the state after it)."""
    cumulative = decay.cumsum(dim=1)  # [b, q, h]
    log_decay = cumulative.transpose(1, 2)  # [b, h, q]
    between = log_decay[..., :, None] - log_decay[..., None, :]  # [b, h, t, s]: decay from s to t
    causal = torch.ones(between.shape[-2:], dtype=torch.bool, device=x.device).tril()
    weights = torch.einsum("bthn,bshn->bhts", C, B) * torch.exp(between.masked_fill(~causal, float("-inf")))
    weights = weights * dt.transpose(1, 2)[:, :, None, :]
    y = torch.einsum("bhts,bshp->bthp", weights, x)
    y = y + torch.einsum("bthn,bhpn->bthp", C, state) * torch.exp(cumulative)[..., None]
    to_end = torch.exp(cumulative[:, -1:] - cumulative) * dt  # [b, q, h]
    state = (state * torch.exp(cumulative[:, -1])[:, :, None, None]
             + torch.einsum("bsh,bshp,bshn->bhpn", to_end, x, B))
    return y, state


@backend.register("ssd_state_update", "torch", fp=True)
def _ssd_state_update_torch(state, x, dt, A, B, C, D, dt_bias):
    nheads = x.shape[1]
    out_dtype = x.dtype
    x = x.float()
    dt = F.softplus(dt.float() + dt_bias.float())
    B, C = _heads(B, nheads, 1), _heads(C, nheads, 1)
    new_state = (state.float() * torch.exp(dt * A.float())[:, :, None, None]
                 + (dt[:, :, None] * x)[..., None] * B[:, :, None, :])
    state.copy_(new_state)
    y = torch.einsum("bhpn,bhn->bhp", new_state, C) + D.float()[:, None] * x
    return y.to(out_dtype)
