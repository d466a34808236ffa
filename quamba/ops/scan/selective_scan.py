"""Floating-point selective scan (Mamba1 SSM), the reference for every scan in quamba.

Layouts follow mamba_ssm's ``selective_scan_fn``: channels before time. On CUDA tensors the
``auto`` backend runs mamba-ssm's kernels when they are installed (quamba.ops.fp_kernels); they
implement the default zoh discretization only (the others: quamba.ops.scan.discretization). quamba's
QSScan kernel runs every method but cannot stand in for them: it takes int8 A_log, D and dt_bias
with scales, always applies softplus and starts from a zero state.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from quamba.ops import backend, fp_kernels  # noqa: F401  fp_kernels registers the cuda kernels
from quamba.ops.scan.discretization import (
    DEFAULT,
    compute_dtype,
    discretize,
    input_drive,
    require_drive,
    select_scan,
)

# Time steps whose discretised A and B·u are materialised at once: bounds the reference's
# memory to batch * d_inner * _CHUNK * d_state floats whatever the sequence length.
_CHUNK = 256


def selective_scan(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                   initial_state=None, backend_name=None, discretization=DEFAULT,
                   initial_drive=None):
    """Selective scan in fp32; returns ``(y, last_state)``.

    u, delta: [batch, d_inner, seqlen]; A: [d_inner, d_state] (real, negative);
    B, C: [batch, d_state, seqlen]; D, delta_bias: [d_inner]; z: [batch, d_inner, seqlen] or None;
    initial_state: [batch, d_inner, d_state] or None (zeros).

        Δ = softplus(delta + delta_bias)           (softplus only if delta_softplus)
        h_t = Ā_t ⊙ h_{t-1} + B̄u_t
        y_t = C_t · h_t + D u_t,   y_t ← y_t ⊙ SiLU(z_t)

    with, per channel d and state n (a = A[d, n], Δ = Δ_t[d], z = Δa, v_t = u_t B_t):

        zoh (default)  Ā = exp(z)                  B̄u_t = Δ u_t B_t
        zoh-exact      Ā = exp(z)                  B̄u_t = (exp(z) - 1)/a · v_t   (Δ v_t at a = 0)
        bilinear       Ā = (1 + z/2)/(1 - z/2)     B̄u_t = Δ/(1 - z/2) · v_t
        foh            Ā = exp(z)                  B̄u_t = Δ(φ1 - φ2)(z) v_{t-1} + Δ φ2(z) v_t
        rk4            Ā = 1 + z + z²/2 + z³/6 + z⁴/24,  B̄u_t = Δ(1 + z/2 + z²/6 + z³/24) v_t

    φ1(z) = (exp(z) - 1)/z, φ2(z) = (exp(z) - 1 - z)/z² (quamba.ops.scan.discretization derives
    each).
    foh reads ``initial_drive`` (fp32 [batch, d_inner, d_state]) as v_{-1}, zeros if None; the
    drive to continue after this scan is ``input_drive(u[..., -1], B[..., -1])``. mamba-ssm's CUDA
    kernels run zoh only: another method runs this reference (``auto``) or is refused (``cuda``).

    y has u's dtype; last_state is fp32 [batch, d_inner, d_state]. fp64 inputs compute in fp64
    (gradient checks; autograd runs through this reference).
    """
    impl = select_scan("selective_scan", u.device, backend_name, discretization,
                       initial_drive=initial_drive)
    return impl(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state)


@backend.register("selective_scan", "torch")
def _selective_scan_torch(u, delta, A, B, C, D, z, delta_bias, delta_softplus, initial_state,
                          discretization=DEFAULT, initial_drive=None):
    out_dtype, dtype = u.dtype, compute_dtype(u)
    u, delta, B, C, A = (t.to(dtype) for t in (u, delta, B, C, A))
    if delta_bias is not None:
        delta = delta + delta_bias.to(dtype)[None, :, None]
    if delta_softplus:
        delta = F.softplus(delta)
    batch, d_inner, seqlen = u.shape
    state = (torch.zeros(batch, d_inner, A.shape[1], dtype=dtype, device=u.device)
             if initial_state is None else initial_state.to(dtype).clone())
    previous_drive = initial_drive
    ys = []
    for start in range(0, seqlen, _CHUNK):
        stop = min(start + _CHUNK, seqlen)
        dt = delta[:, :, start:stop]
        if discretization == DEFAULT:
            decay = torch.exp(dt.unsqueeze(-1) * A[None, :, None, :])  # [b, d, t, n]
            step_input = ((dt * u[:, :, start:stop]).unsqueeze(-1)
                          * B[:, None, :, start:stop].transpose(-1, -2))
        else:
            decay, step_input, previous_drive = _discretized_chunk(
                discretization, dt, A, u[:, :, start:stop], B[:, :, start:stop], previous_drive)
        # unbound and stacked, not indexed and written into a buffer: each indexing or write
        # costs autograd's backward a tensor of the chunk's size, unbind and stack one in all
        states = []
        for step_decay, step_drive in zip(decay.unbind(2), step_input.unbind(2)):
            state = step_decay * state + step_drive
            states.append(state)
        ys.append(torch.einsum("bdtn,bnt->bdt", torch.stack(states, dim=2), C[:, :, start:stop]))
    y = torch.cat(ys, dim=-1) if ys else u.new_zeros(batch, d_inner, 0)
    if D is not None:
        y = y + u * D.to(dtype)[None, :, None]
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(out_dtype), state


def _discretized_chunk(method, dt, A, u, B, previous_drive):
    """Ā and B̄u [b, d, t, n] of a chunk's steps by ``method`` (dt, u [b, d, t]; B [b, n, t]),
    and the chunk's last drive, the next chunk's ``previous_drive`` (v_{-1}; None: zeros)."""
    drive = input_drive(u, B)  # v_t [b, d, t, n]
    earlier = None
    if method == "foh":  # v_{t-1}
        first = drive.new_zeros(drive[:, :, 0].shape) if previous_drive is None else previous_drive
        earlier = torch.cat([first.to(drive.dtype).unsqueeze(2), drive[:, :, :-1]], dim=2)
    decay, step_input = discretize(method, dt.unsqueeze(-1), A[None, :, None, :], drive, earlier)
    return decay, step_input, drive[:, :, -1]


def selective_state_update(state, u, delta, A, B, C, D=None, z=None, delta_bias=None,
                           delta_softplus=False, backend_name=None, discretization=DEFAULT,
                           drive=None):
    """One decode step of the selective scan; updates ``state`` in place and returns y.

    state: [batch, d_inner, d_state] (fp32); u, delta, z: [batch, d_inner];
    B, C: [batch, d_state]. y has u's dtype, shape [batch, d_inner]. The step is
    :func:`selective_scan`'s for ``discretization``; foh needs ``drive``, the previous step's
    v = u ⊗ B (fp32 [batch, d_inner, d_state]; zeros before a sequence's first step, else
    ``input_drive`` of a prefill's last step), which it overwrites with this step's.
    """
    require_drive(discretization, drive)
    impl = select_scan("selective_state_update", u.device, backend_name, discretization,
                       drive=drive)
    return impl(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus)


@backend.register("selective_state_update", "torch")
def _selective_state_update_torch(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus,
                                  discretization=DEFAULT, drive=None):
    out_dtype, dtype = u.dtype, compute_dtype(u)
    u, delta, A = u.to(dtype), delta.to(dtype), A.to(dtype)
    if delta_bias is not None:
        delta = delta + delta_bias.to(dtype)
    if delta_softplus:
        delta = F.softplus(delta)
    if discretization == DEFAULT:
        decay = torch.exp(delta.unsqueeze(-1) * A)
        step_input = (delta * u).unsqueeze(-1) * B.to(dtype).unsqueeze(1)
    else:
        current_drive = input_drive(u, B)
        previous_drive = None if drive is None else drive.to(dtype, copy=True)
        decay, step_input = discretize(discretization, delta.unsqueeze(-1), A, current_drive,
                                       previous_drive)
        if discretization == "foh":
            drive.copy_(current_drive)
    # a copy: autograd keeps the old state for decay's gradient, and state is overwritten below
    # (as the drive is)
    new_state = decay * state.to(dtype, copy=True) + step_input
    state.copy_(new_state)
    y = state_readout(new_state, C.to(dtype))
    if D is not None:
        y = y + u * D.to(dtype)
    if z is not None:
        y = y * F.silu(z.to(dtype))
    return y.to(out_dtype)


def state_readout(state, C):
    """y [batch, d_inner] = Σ_n state[:, :, n] · C[:, n] of a decode step, the products added as
    a pairwise tree over n: adjacent states first, zero-padded to a power of two. That is the order
    of quamba's decode-step kernels (the QSScan step's lanes, the fused Mamba1 step), so that they
    agree on y bit for bit where their inputs agree: a 1-ulp difference in y can flip an int8 code
    downstream and, at a near tie, a greedy token."""
    terms = state * C.unsqueeze(1)
    width = 1 << (terms.shape[-1] - 1).bit_length()
    terms = F.pad(terms, (0, width - terms.shape[-1]))
    while terms.shape[-1] > 1:
        terms = terms[..., 0::2] + terms[..., 1::2]
    return terms[..., 0]
