"""The W8A8 / W4A8 Mamba2 mixer (Quamba2 recipe), runnable in every SSM mode of quamba.layers.modes.

Data flow of the int8 mode (prefill; shapes [batch, seqlen, ·]):

    h (int8) ─ in_proj → z | xBC | dt, int8 with one scale per segment (x, B and C of xBC each
               their own), folded into the GEMM's per-channel epilogue
    xBC ─ qconv1d_channelwise (+SiLU) → x int8 with sort-and-clustered per-channel scales,
          B and C int8 with one scale per state group          conv state ← last inputs of xBC
    qssd_scan(x, dt, B, C; A_log, D, dt_bias int8) → y fp16     ssm state ← int8 (percentile)
    gated RMSNorm(y, z) (its weight folded into out_proj) ─ Hadamard + quantize → int8
    ─ out_proj → fp16 out
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn

from quamba.layers.base import QuantModule
from quamba.layers.qlinear import W4A8Linear, W8A8Linear
from quamba.layers.qmixer import out_projection, project_codes
from quamba.models.config import MambaConfig
from quamba.models.mamba2 import GatedRMSNorm, Mamba2Mixer
from quamba.models.state import DEFAULT_MAX_SEQLEN, MixerState
from quamba.ops.conv.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_update,
    conv_state_from_prefill,
)
from quamba.ops.norm.qhadamard import gated_norm_hadamard_quant
from quamba.ops.quant import dequantize, fake_quantize, quantize, quantize_weight
from quamba.ops.scan.qsscan import SSMParams
from quamba.ops.ssd.qssd import (
    qconv1d_channelwise,
    qconv1d_channelwise_update,
    qssd_scan,
    qssd_state_update,
)
from quamba.ops.ssd.ssd import ssd_scan, ssd_state_update

# Per-tensor activation scales of a Mamba2 mixer; xbc_in_scale and xbc_scale are per channel.
ACTIVATION_SCALES = ("z_scale", "dt_scale", "state_scale", "y_scale")
SSM_PARAMETERS = ("A_log", "D", "dt_bias")


class QMamba2Mixer(QuantModule):
    """Quantized Mamba2 mixer with the FP mixer's interface: ``forward(h, state=None,
    step=False)`` and ``allocate_state(batch, device)``; h is what QRMSNorm returns.

    scales: ACTIVATION_SCALES as floats. xbc_in_scale: fp32 [conv_dim], the scales of xBC as
    in_proj writes it (x, B, C one each); xbc_scale: fp32 [conv_dim], after the conv (x per
    channel, B and C per state group). ``dt_floor`` (Nemotron-H): dt is floored at dt_floor -
    dt_bias before the SSD, as NemotronHMamba2Mixer does, on its int8 codes (round is monotone,
    so the codes of the floored dt are the floored codes) in every mode. ``gate``: a module that
    gates y by z in place of Mamba2's gated RMSNorm, called as it is (Falcon-H1's SiluGate, no
    norm and no weight); None: the gated RMSNorm."""

    def __init__(self, config: MambaConfig, scales: dict[str, float], xbc_in_scale: torch.Tensor,
                 xbc_scale: torch.Tensor, h_scale: float, hadamard: bool, out_dtype, device=None,
                 weight_bits: int = 8, group_size: int = 128, dt_floor: float | None = None,
                 gate: nn.Module | None = None):
        super().__init__()
        self.d_inner, self.d_state, self.d_conv = config.d_inner, config.d_state, config.d_conv
        self.nheads, self.headdim, self.ngroups = config.nheads, config.headdim, config.ngroups
        self.chunk_size = config.chunk_size
        self.conv_dim = self.d_inner + 2 * self.ngroups * self.d_state
        self.hadamard, self.out_dtype = hadamard, out_dtype
        self.weight_bits, self.group_size = weight_bits, group_size
        self.norm = gate if gate is not None else GatedRMSNorm(
            self.d_inner, self.d_inner // self.ngroups, config.norm_epsilon, device=device)
        for name in ACTIVATION_SCALES:
            self.register_scale(name, scales[name])
        self.register_buffer("xbc_in_scale", xbc_in_scale.float().to(device, copy=True))
        self.register_buffer("xbc_scale", xbc_scale.float().to(device, copy=True))
        self.in_proj = self._linear(config.d_model, self.d_inner + self.conv_dim + self.nheads,
                                    h_scale, self._in_proj_out_scale(), device)
        self.out_proj = self._linear(self.d_inner, config.d_model, scales["y_scale"], None, device,
                                     out_dtype)
        int8 = dict(dtype=torch.int8, device=device)
        self.register_buffer("conv_weight", torch.zeros(self.conv_dim, self.d_conv, **int8))
        self.register_buffer("conv_bias", torch.zeros(self.conv_dim, **int8))
        self.register_scale("conv_weight_scale", 1.0)
        self.register_scale("conv_bias_scale", 1.0)
        for name in SSM_PARAMETERS:
            self.register_buffer(name, torch.zeros(self.nheads, **int8))
            self.register_scale(name + "_scale", 1.0)
        self.dt_floor = dt_floor  # Δ's floor on dt (NemotronHMamba2Mixer.dt_floor) or None
        self.taps: dict | None = None
        self.state_cache = "int8"  # or "fp32": QuantConfig.state_cache

    def _in_proj_out_scale(self) -> torch.Tensor:
        """fp32 [d_inner + conv_dim + nheads]: the scale of each of in_proj's output channels."""
        s, device = self.scales, self.xbc_in_scale.device
        return torch.cat([torch.full((self.d_inner,), s["z_scale"], device=device),
                          self.xbc_in_scale,
                          torch.full((self.nheads,), s["dt_scale"], device=device)])

    def _linear(self, in_features, out_features, in_scale, out_scale, device, dtype=torch.float16):
        if self.weight_bits == 4:
            return W4A8Linear(in_features, out_features, in_scale, out_scale, dtype,
                              self.group_size, device)
        return W8A8Linear(in_features, out_features, in_scale, out_scale, dtype, device)

    @classmethod
    def from_float(cls, mixer: Mamba2Mixer, config: MambaConfig, h_scale: float,
                   scales: dict[str, float], xbc_in_scale, xbc_scale, hadamard: bool,
                   weight_bits: int = 8, group_size: int = 128):
        """Quantize an FP Mamba2Mixer whose gated-norm weight is folded into out_proj (and rotated
        if ``hadamard``) with calibrated scales; 4-bit weights round to nearest."""
        gated_norm = isinstance(mixer.norm, GatedRMSNorm)
        if gated_norm and not torch.all(mixer.norm.weight == 1):
            raise ValueError("fold the gated norm's weight into out_proj first "
                             "(quamba.quantization.rotation.fold_gated_norm_)")
        weight = mixer.in_proj.weight
        q = cls(config, scales, xbc_in_scale, xbc_scale, h_scale, hadamard, weight.dtype,
                weight.device, weight_bits, group_size, getattr(mixer, "dt_floor", None),
                None if gated_norm else copy.deepcopy(mixer.norm))
        q.in_proj.load_float_weight(weight)
        q.out_proj.load_float_weight(mixer.out_proj.weight)
        for name, tensor in (("conv_weight", mixer.conv1d.weight.squeeze(1)),
                             ("conv_bias", mixer.conv1d.bias), ("A_log", mixer.A_log),
                             ("D", mixer.D), ("dt_bias", mixer.dt_bias)):
            codes, scale = quantize_weight(tensor)
            getattr(q, name).copy_(codes)
            getattr(q, name + "_scale").fill_(scale)
        for module in q.modules():
            if isinstance(module, QuantModule):
                module.refresh_scales()
        return q

    # --- helpers -----------------------------------------------------------------------------

    @property
    def ssm_params(self) -> SSMParams:
        s = self.scales
        return SSMParams(self.A_log, s["A_log_scale"], self.D, s["D_scale"], self.dt_bias,
                         s["dt_bias_scale"])

    def _tap(self, name: str, tensor, scale=None):
        """Record a dequantized fp32 copy of an intermediate (layer-wise mode comparison)."""
        if self.taps is not None:
            self.taps[name] = dequantize(tensor, scale) if tensor.dtype == torch.int8 else tensor.float()

    def _split_in_proj(self, projected):
        z, xbc, dt = torch.split(projected, [self.d_inner, self.conv_dim, self.nheads], dim=-1)
        return z, xbc, dt if self.dt_floor is None else self._floored(dt)

    def _floored(self, dt):
        """dt (int8 codes, or fake-quantized fp32 in float-sim) floored at the codes of
        dt_floor - dt_bias (the quantized bias the SSD adds)."""
        s = self.scales
        floor = quantize(self.dt_floor - dequantize(self.dt_bias, s["dt_bias_scale"]),
                         s["dt_scale"])
        if dt.dtype == torch.int8:
            return torch.maximum(dt, floor)
        return torch.maximum(dt, dequantize(floor, s["dt_scale"]))

    def _ssd_inputs(self, xbc, xbc_scale):
        """(x [..., nheads, headdim], its scale [nheads, headdim], B [..., ngroups, d_state], its
        scale [ngroups, d_state], C, its scale) from xBC [..., conv_dim] and its [conv_dim] scale."""
        sizes = [self.d_inner, self.ngroups * self.d_state, self.ngroups * self.d_state]
        x, B, C = torch.split(xbc, sizes, dim=-1)
        x_scale, B_scale, C_scale = torch.split(xbc_scale, sizes)
        return (x.unflatten(-1, (self.nheads, self.headdim)), x_scale.view(self.nheads, -1),
                B.unflatten(-1, (self.ngroups, -1)), B_scale.view(self.ngroups, -1),
                C.unflatten(-1, (self.ngroups, -1)), C_scale.view(self.ngroups, -1))

    def _conv_weights(self) -> tuple:
        s = self.scales
        return self.conv_weight, s["conv_weight_scale"], self.conv_bias, s["conv_bias_scale"]

    @property
    def int8_state(self) -> bool:
        """Whether the decode SSM state is int8 codes (QuantConfig.state_cache); in float-sim
        mode it is then fake-quantized fp32."""
        return self.state_cache == "int8"

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> MixerState:
        """The conv and SSM states (their size does not depend on ``max_seqlen``)."""
        device = device or self.conv_weight.device
        dtype = torch.float32 if self.simulate else torch.int8
        state_dtype = torch.int8 if self.int8_state and not self.simulate else torch.float32
        return MixerState(
            conv=torch.zeros(batch_size, self.conv_dim, self.d_conv - 1, dtype=dtype, device=device),
            ssm=torch.zeros(batch_size, self.nheads, self.headdim, self.d_state, dtype=state_dtype,
                            device=device))

    def _out(self, y, z):
        """SSD output y [..., d_inner] and in_proj's z → gated RMSNorm → (Hadamard) → int8 →
        out_proj; with the Hadamard, the norm, the transform and the int8 codes are one op
        (after a plain gate, Falcon-H1's SiluGate: the gate, then Hadamard → int8)."""
        if self.simulate:
            return out_projection(self, self.norm(y.float(), z.float(), backend_name="torch"))
        if self.hadamard and isinstance(self.norm, GatedRMSNorm):
            norm = self.norm
            return project_codes(self, gated_norm_hadamard_quant(
                y, z, self.scales["z_scale"], norm.weight, norm.group_size, norm.eps,
                self.scales["y_scale"], backend_name=self.backend))
        return out_projection(self, self.norm(y, z, self.scales["z_scale"], out_dtype=torch.float32,
                                              backend_name=self.backend))

    def _scan_inputs(self, xbc, dt) -> list:
        """[x, x_scale, dt, dt_scale, B, B_scale, C, C_scale] for the int8 SSD from the conv output
        xBC [..., conv_dim]; dequantized in the fp32-ssm-input mode."""
        x, x_scale, B, B_scale, C, C_scale = self._ssd_inputs(xbc, self.xbc_scale)
        pairs = [x, x_scale, dt, self.scales["dt_scale"], B, B_scale, C, C_scale]
        if self.mode == "fp32-ssm-input":
            for i in range(0, len(pairs), 2):
                if pairs[i].dtype == torch.int8:
                    pairs[i] = dequantize(pairs[i], pairs[i + 1])
        return pairs

    # --- forward -------------------------------------------------------------------------

    def forward(self, h, state: MixerState | None = None, step: bool = False):
        if step:
            return self._step_simulated(h, state) if self.simulate else self._step(h, state)
        z, xbc, dt = self._split_in_proj(self.in_proj(h))
        self._tap("z", z, self.scales["z_scale"])
        xbc = xbc.transpose(1, 2)  # [b, conv_dim, l]
        if state is not None:
            state.conv.copy_(conv_state_from_prefill(xbc, self.d_conv))
        scan = self._scan_simulated if self.simulate else self._scan
        y, last_state = scan(xbc, dt, with_state=state is not None)
        if state is not None:
            state.ssm.copy_(last_state)
        y = y.flatten(-2)
        self._tap("y", y)
        return self._out(y, z)

    def _scan(self, xbc, dt, with_state: bool):
        """conv1d → SSD over xBC [b, conv_dim, l] (int8 codes): y [b, l, nheads, headdim] in the
        output dtype and the last state (int8 if ``with_state``, else None)."""
        fp32_conv = self.mode == "fp32-conv"
        xbc = qconv1d_channelwise(xbc, self.xbc_in_scale, *self._conv_weights(),
                                  out_scale=None if fp32_conv else self.xbc_scale,
                                  backend_name=self.backend).transpose(1, 2)
        self._tap("xbc", xbc, self.xbc_scale)
        y, last_state = qssd_scan(*self._scan_inputs(xbc, dt),
                                  self.ssm_params, self.chunk_size,
                                  state_scale=(self.scales["state_scale"]
                                               if with_state and self.int8_state else None),
                                  out_dtype=self.out_dtype, backend_name=self.backend)
        return y, (last_state if with_state else None)

    def _step(self, h, state: MixerState):
        z, xbc, dt = self._split_in_proj(self.in_proj(h[:, 0]))
        fp32_conv = self.mode == "fp32-conv"
        xbc = qconv1d_channelwise_update(xbc, state.conv, self.xbc_in_scale, *self._conv_weights(),
                                         out_scale=None if fp32_conv else self.xbc_scale,
                                         backend_name=self.backend)
        y = qssd_state_update(state.ssm, self.scales["state_scale"], *self._scan_inputs(xbc, dt),
                              self.ssm_params,
                              out_dtype=self.out_dtype, backend_name=self.backend)
        return self._out(y.flatten(-2), z).unsqueeze(1)

    # --- float simulation of the int8 path -------------------------------------------------------

    def _dequantized_conv(self):
        s = self.scales
        return (dequantize(self.conv_weight, s["conv_weight_scale"]),
                dequantize(self.conv_bias, s["conv_bias_scale"]))

    def _scan_simulated(self, xbc, dt, with_state: bool):
        """The float simulation of :meth:`_scan` (inputs fake-quantized fp32): y and the last
        state fake-quantized with the state scale (None unless ``with_state``)."""
        xbc = fake_quantize(causal_conv1d(xbc, *self._dequantized_conv()).transpose(1, 2),
                            self.xbc_scale)
        self._tap("xbc", xbc)
        x, _, B, _, C, _ = self._ssd_inputs(xbc, self.xbc_scale)
        A, D, dt_bias = self.ssm_params.dequantized()
        y, last_state = ssd_scan(x, dt, A, B, C, D, dt_bias, self.chunk_size)
        if not with_state or not self.int8_state:
            return y, last_state if with_state else None
        return y, fake_quantize(last_state, self.scales["state_scale"])

    def _step_simulated(self, h, state: MixerState):
        z, xbc, dt = self._split_in_proj(self.in_proj(h[:, 0]))
        xbc = fake_quantize(causal_conv1d_update(xbc, state.conv, *self._dequantized_conv()),
                            self.xbc_scale)
        x, _, B, _, C, _ = self._ssd_inputs(xbc, self.xbc_scale)
        A, D, dt_bias = self.ssm_params.dequantized()
        y = ssd_state_update(state.ssm, x, dt, A, B, C, D, dt_bias)
        if self.int8_state:
            state.ssm.copy_(fake_quantize(state.ssm, self.scales["state_scale"]))
        return self._out(y.flatten(-2), z).unsqueeze(1)
