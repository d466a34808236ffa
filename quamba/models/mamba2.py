"""The Mamba2 mixer (Dao & Gu, arXiv 2405.21060), with mamba_ssm's parameter names.

    h → in_proj → z [d_inner], xBC [d_inner + 2·ngroups·d_state], dt [nheads]
    xBC → causal conv1d + SiLU → x (nheads × headdim), B, C (ngroups × d_state each)
    SSD (quamba.ops.ssd.ssd): scalar A = -exp(A_log) per head, dt_bias, D per head
    y → gated RMSNorm: norm(y · SiLU(z)), RMS over each group of d_inner / ngroups channels
    → out_proj

Its decode state is the last d_conv - 1 inputs of the conv over xBC and the SSM state
[nheads, headdim, d_state] (fp32).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn

from quamba.models.config import MambaConfig
from quamba.models.state import DEFAULT_MAX_SEQLEN, MixerState
from quamba.ops.conv.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_update,
    conv_state_from_prefill,
)
from quamba.ops.norm.gated_norm import gated_rms_norm
from quamba.ops.ssd.ssd import ssd_scan, ssd_state_update


class GatedRMSNorm(nn.Module):
    """weight · g / rms(g) with g = y · SiLU(z), the RMS taken over groups of ``group_size``
    channels; computed in fp32, returned in ``out_dtype`` (default y's dtype)."""

    def __init__(self, dim: int, group_size: int, eps: float = 1e-5, device=None, dtype=None):
        super().__init__()
        self.group_size, self.eps = group_size, eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, y, z, z_scale=None, out_dtype=None, backend_name=None):
        """z float, or int8 codes of ``z_scale`` (quamba.ops.norm.gated_norm.gated_rms_norm)."""
        return gated_rms_norm(y, z, self.weight, self.group_size, self.eps, z_scale=z_scale,
                              out_dtype=out_dtype, backend_name=backend_name)


class Mamba2Mixer(nn.Module):
    """``forward(h, state=None, step=False)`` as the Mamba1 mixer: h [batch, seqlen, d_model]; a
    prefill fills ``state``, a step (seqlen 1) updates it in place."""

    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.d_inner, self.d_state, self.d_conv = config.d_inner, config.d_state, config.d_conv
        self.nheads, self.headdim, self.ngroups = config.nheads, config.headdim, config.ngroups
        self.chunk_size = config.chunk_size
        self.conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        self.in_proj = nn.Linear(config.d_model, self.d_inner + self.conv_dim + self.nheads,
                                 bias=config.bias, **kw)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, config.d_conv, groups=self.conv_dim,
                                padding=config.d_conv - 1, bias=config.conv_bias, **kw)
        # SSM parameters stay fp32 whatever the model dtype
        self.dt_bias = nn.Parameter(torch.empty(self.nheads, device=device))
        self.A_log = nn.Parameter(torch.empty(self.nheads, device=device))
        self.D = nn.Parameter(torch.empty(self.nheads, device=device))
        self.norm = GatedRMSNorm(self.d_inner, self.d_inner // self.ngroups, config.norm_epsilon, **kw)
        self.out_proj = nn.Linear(self.d_inner, config.d_model, bias=config.bias, **kw)
        # y · G before out_proj once the model is Hadamard-rotated (quamba.quantization.rotation)
        self.online_hadamard: nn.Module = nn.Identity()
        self.taps: dict | None = None  # set to {} to record intermediates (mode comparisons)

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> MixerState:
        """The conv and SSM states (their size does not depend on ``max_seqlen``)."""
        device = device or self.in_proj.weight.device
        return MixerState(
            conv=torch.zeros(batch_size, self.conv_dim, self.d_conv - 1, device=device,
                             dtype=self.conv1d.weight.dtype),
            ssm=torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, device=device))

    def split_in_proj(self, projected):
        """z [..., d_inner], xBC [..., conv_dim], dt [..., nheads] from in_proj's output."""
        return torch.split(projected, [self.d_inner, self.conv_dim, self.nheads], dim=-1)

    def split_xbc(self, xbc):
        """x [..., d_inner], B and C [..., ngroups · d_state] from xBC [..., conv_dim]."""
        return torch.split(xbc, [self.d_inner, self.ngroups * self.d_state,
                                 self.ngroups * self.d_state], dim=-1)

    def ssd_inputs(self, xbc):
        """x [..., nheads, headdim], B and C [..., ngroups, d_state] from xBC [..., conv_dim]."""
        x, B, C = self.split_xbc(xbc)
        return (x.unflatten(-1, (self.nheads, self.headdim)), B.unflatten(-1, (self.ngroups, -1)),
                C.unflatten(-1, (self.ngroups, -1)))

    def forward(self, h, state=None, step: bool = False):
        if step:
            return self._step(h, state)
        z, xbc, dt = self.split_in_proj(self.in_proj(h))
        xbc = xbc.transpose(1, 2)  # [b, conv_dim, l]
        if state is not None:
            state.conv.copy_(conv_state_from_prefill(xbc, self.d_conv))
        xbc = causal_conv1d(xbc, self.conv1d.weight.squeeze(1), self.conv1d.bias).transpose(1, 2)
        x, B, C = self.ssd_inputs(xbc)
        A = -torch.exp(self.A_log.float())
        y, last_state = ssd_scan(x, dt, A, B, C, self.D, self.dt_bias, self.chunk_size)
        if state is not None:
            state.ssm.copy_(last_state)
        y = y.flatten(-2)
        out_proj_input = self.online_hadamard(self.norm(y, z))
        out = self.out_proj(out_proj_input)
        if self.taps is not None:
            self.taps.update({"z": z, "xbc": xbc, "y": y, "out_proj.input": out_proj_input,
                              "out": out})
        return out

    def _step(self, h, state):
        z, xbc, dt = self.split_in_proj(self.in_proj(h[:, 0]))
        xbc = causal_conv1d_update(xbc, state.conv, self.conv1d.weight.squeeze(1), self.conv1d.bias)
        x, B, C = self.ssd_inputs(xbc)
        A = -torch.exp(self.A_log.float())
        y = ssd_state_update(state.ssm, x, dt, A, B, C, self.D, self.dt_bias)
        return self.out_proj(self.online_hadamard(self.norm(y.flatten(-2), z))).unsqueeze(1)


def init_mamba2_parameters(mixer: Mamba2Mixer, dt_min: float = 1e-3, dt_max: float = 0.1,
                           generator: torch.Generator | None = None) -> None:
    """mamba_ssm's initialisation of the SSM parameters: A uniform in [1, 16] per head, D = 1,
    dt_bias = softplus⁻¹(dt) with dt log-uniform in [dt_min, dt_max]."""
    nheads = mixer.A_log.shape[0]
    A = torch.rand(nheads, generator=generator) * 15 + 1
    mixer.A_log.copy_(torch.log(A))
    mixer.D.fill_(1.0)
    rand = torch.rand(nheads, generator=generator)
    dt = torch.exp(rand * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
    mixer.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
