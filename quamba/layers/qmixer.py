"""The W8A8 Mamba1 mixer (Quamba recipe), runnable in every SSM mode of quamba.layers.modes.

Data flow of the int8 mode (prefill; shapes [batch, seqlen, ·] unless noted):

    h (int8) ─ in_proj W8A8 → xz (int8, one scale) ─ x, z as [b, d, l] views
    x ─ qconv1d (+SiLU) → u (int8, percentile scale)          conv state ← last inputs of x
    u ─ x_proj W8A8 → dt_low, B, C (int8, one scale) ; dt_low ─ dt_proj W8A8 → dt (int8)
    QSScan(u, dt, B, C, z; A_log, D, dt_bias int8) → y fp16    ssm state ← int8 (percentile)
    y ─ Hadamard + quantize → int8 ─ out_proj W8A8 → fp16 out
"""
from __future__ import annotations

import torch

from quamba.layers.base import QuantModule
from quamba.layers.qlinear import W4A8Linear, W8A8Linear
from quamba.models.mamba import MixerState
from quamba.ops.causal_conv1d import causal_conv1d, causal_conv1d_update, conv_state_from_prefill
from quamba.ops.hadamard import hadamard_transform
from quamba.ops.qconv1d import qconv1d, qconv1d_update
from quamba.ops.qhadamard import hadamard_quant
from quamba.ops.qsscan import SSMParams, qsscan, qsscan_update
from quamba.ops.quant import dequantize, fake_quantize, quantize, quantize_weight
from quamba.ops.selective_scan import selective_scan, selective_state_update

# Activation scales of a mixer, named after the tensor each one quantizes.
ACTIVATION_SCALES = ("xz_scale", "u_scale", "xdbl_scale", "dt_scale", "state_scale", "y_scale")


class QMambaMixer(QuantModule):
    """Quantized mixer with the FP mixer's interface: ``forward(h, state=None, step=False)`` and
    ``allocate_state(batch, device)``. Its input h is what QRMSNorm returns (int8 codes, or
    fake-quantized floats in float-sim mode)."""

    def __init__(self, d_model: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int,
                 scales: dict[str, float], h_scale: float, hadamard: bool, out_dtype,
                 device=None, weight_bits: int = 8, group_size: int = 128):
        super().__init__()
        self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_inner, d_state, d_conv, dt_rank
        self.hadamard = hadamard
        self.out_dtype = out_dtype
        for name in ACTIVATION_SCALES:
            self.register_scale(name, scales[name])
        xz, xdbl = scales["xz_scale"], scales["xdbl_scale"]

        def linear(in_features, out_features, in_scale, out_scale, dtype=torch.float16):
            if weight_bits == 4:
                return W4A8Linear(in_features, out_features, in_scale, out_scale, dtype,
                                  group_size, device)
            return W8A8Linear(in_features, out_features, in_scale, out_scale, dtype, device)

        self.in_proj = linear(d_model, 2 * d_inner, h_scale, xz)
        self.x_proj = linear(d_inner, dt_rank + 2 * d_state, scales["u_scale"], xdbl)
        # dt_proj stays W8A8 in every recipe: its K (dt_rank) is too small for 4-bit groups
        self.dt_proj = W8A8Linear(dt_rank, d_inner, xdbl, scales["dt_scale"], device=device)
        self.out_proj = linear(d_inner, d_model, scales["y_scale"], None, out_dtype)
        int8 = dict(dtype=torch.int8, device=device)
        self.register_buffer("conv_weight", torch.zeros(d_inner, d_conv, **int8))
        self.register_buffer("conv_bias", torch.zeros(d_inner, **int8))
        self.register_buffer("A_log", torch.zeros(d_inner, d_state, **int8))
        self.register_buffer("D", torch.zeros(d_inner, **int8))
        self.register_buffer("dt_bias", torch.zeros(d_inner, **int8))
        for name in ("conv_weight_scale", "conv_bias_scale", "A_log_scale", "D_scale",
                     "dt_bias_scale"):
            self.register_scale(name, 1.0)
        self.taps: dict | None = None

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_float(cls, mixer, h_scale: float, scales: dict[str, float], hadamard: bool,
                   weight_bits: int = 8, group_size: int = 128):
        """Quantize an FP MambaMixer (already rotated if ``hadamard``) with calibrated scales;
        4-bit weights round to nearest (GPTQ replaces their codes afterwards)."""
        weight = mixer.in_proj.weight
        q = cls(weight.shape[1], mixer.d_inner, mixer.d_state, mixer.d_conv, mixer.dt_rank,
                scales, h_scale, hadamard, weight.dtype, weight.device, weight_bits, group_size)
        for name in ("in_proj", "x_proj", "dt_proj", "out_proj"):
            getattr(q, name).load_float_weight(getattr(mixer, name).weight)
        for name, tensor in (("conv_weight", mixer.conv1d.weight.squeeze(1)),
                             ("conv_bias", mixer.conv1d.bias), ("A_log", mixer.A_log),
                             ("D", mixer.D), ("dt_bias", mixer.dt_proj.bias)):
            codes, scale = quantize_weight(tensor)
            getattr(q, name).copy_(codes)
            getattr(q, name + "_scale").fill_(scale)
        for module in q.modules():
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

    def _dequantized(self, name: str):
        return dequantize(getattr(self, name), self.scales[name + "_scale"])

    def allocate_state(self, batch_size: int, device=None) -> MixerState:
        device = device or self.conv_weight.device
        dtype = torch.float32 if self.simulate else torch.int8
        return MixerState(
            conv=torch.zeros(batch_size, self.d_inner, self.d_conv - 1, dtype=dtype, device=device),
            ssm=torch.zeros(batch_size, self.d_inner, self.d_state, dtype=dtype, device=device))

    def _split_xdbl(self, x_dbl):
        return torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)

    def _out(self, y):
        """Gated scan output y [..., d_inner] → (Hadamard) → int8 → out_proj."""
        s = self.scales
        if self.simulate:
            y = hadamard_transform(y.float()) if self.hadamard else y.float()
            y_q = fake_quantize(y, s["y_scale"])
        elif self.hadamard:
            y_q = hadamard_quant(y, s["y_scale"], backend_name=self.backend)
        else:
            y_q = quantize(y, s["y_scale"])
        self._tap("out_proj.input", y_q, s["y_scale"])
        out = self.out_proj(y_q)
        self._tap("out", out)
        return out

    # --- forward -------------------------------------------------------------------------

    def forward(self, h, state: MixerState | None = None, step: bool = False):
        if step:
            return self._step(h, state)
        if self.simulate:
            return self._forward_simulated(h, state)
        s = self.scales
        xz = self.in_proj(h).transpose(1, 2)  # int8 [b, 2·d_inner, l]
        x, z = xz.chunk(2, dim=1)
        self._tap("x", x, s["xz_scale"])
        self._tap("z", z, s["xz_scale"])
        if state is not None:
            state.conv.copy_(conv_state_from_prefill(x, self.d_conv))
        fp32_conv = self.mode == "fp32-conv"
        u = qconv1d(x, s["xz_scale"], self.conv_weight, s["conv_weight_scale"], self.conv_bias,
                    s["conv_bias_scale"], out_scale=None if fp32_conv else s["u_scale"],
                    backend_name=self.backend)
        self._tap("u", u, s["u_scale"])
        u_codes = quantize(u, s["u_scale"]) if fp32_conv else u
        dt_low, B, C = self._split_xdbl(self.x_proj(u_codes.transpose(1, 2)))
        dt = self.dt_proj(dt_low)
        self._tap("dt", dt, s["dt_scale"])
        scan_inputs = [u, s["u_scale"], dt.transpose(1, 2), s["dt_scale"], B.transpose(1, 2),
                       s["xdbl_scale"], C.transpose(1, 2), s["xdbl_scale"], z, s["xz_scale"]]
        if self.mode == "fp32-ssm-input":
            scan_inputs = _dequantize_pairs(scan_inputs)
        y, last_state = qsscan(*scan_inputs, self.ssm_params, state_scale=s["state_scale"],
                               out_dtype=self.out_dtype, backend_name=self.backend)
        if state is not None:
            state.ssm.copy_(last_state)
        y = y.transpose(1, 2)
        self._tap("y", y)
        return self._out(y)

    def _step(self, h, state: MixerState):
        if self.simulate:
            return self._step_simulated(h, state)
        s = self.scales
        x, z = self.in_proj(h[:, 0]).chunk(2, dim=-1)
        fp32_conv = self.mode == "fp32-conv"
        u = qconv1d_update(x, state.conv, s["xz_scale"], self.conv_weight, s["conv_weight_scale"],
                           self.conv_bias, s["conv_bias_scale"],
                           out_scale=None if fp32_conv else s["u_scale"], backend_name=self.backend)
        u_codes = quantize(u, s["u_scale"]) if fp32_conv else u
        dt_low, B, C = self._split_xdbl(self.x_proj(u_codes))
        dt = self.dt_proj(dt_low)
        scan_inputs = [u, s["u_scale"], dt, s["dt_scale"], B, s["xdbl_scale"], C, s["xdbl_scale"],
                       z, s["xz_scale"]]
        if self.mode == "fp32-ssm-input":
            scan_inputs = _dequantize_pairs(scan_inputs)
        y = qsscan_update(state.ssm, s["state_scale"], *scan_inputs, self.ssm_params,
                          out_dtype=self.out_dtype, backend_name=self.backend)
        return self._out(y).unsqueeze(1)

    # --- float simulation of the int8 path -------------------------------------------------------

    def _forward_simulated(self, h, state: MixerState | None):
        s = self.scales
        xz = self.in_proj(h).transpose(1, 2)  # fake-quantized fp32
        x, z = xz.chunk(2, dim=1)
        self._tap("x", x)
        self._tap("z", z)
        if state is not None:
            state.conv.copy_(conv_state_from_prefill(x, self.d_conv))
        u = fake_quantize(causal_conv1d(x, self._dequantized("conv_weight"),
                                        self._dequantized("conv_bias")), s["u_scale"])
        self._tap("u", u)
        dt_low, B, C = self._split_xdbl(self.x_proj(u.transpose(1, 2)))
        dt = self.dt_proj(dt_low)
        self._tap("dt", dt)
        y, last_state = self._scan_simulated(u, dt.transpose(1, 2), B.transpose(1, 2),
                                             C.transpose(1, 2), z)
        if state is not None:
            state.ssm.copy_(fake_quantize(last_state, s["state_scale"]))
        y = y.transpose(1, 2)
        self._tap("y", y)
        return self._out(y)

    def _scan_simulated(self, u, dt, B, C, z):
        A, D, dt_bias = self.ssm_params.dequantized()
        return selective_scan(u, dt, A, B, C, D, z=z, delta_bias=dt_bias, delta_softplus=True)

    def _step_simulated(self, h, state: MixerState):
        s = self.scales
        x, z = self.in_proj(h[:, 0]).chunk(2, dim=-1)
        u = fake_quantize(causal_conv1d_update(x, state.conv, self._dequantized("conv_weight"),
                                               self._dequantized("conv_bias")), s["u_scale"])
        dt_low, B, C = self._split_xdbl(self.x_proj(u))
        dt = self.dt_proj(dt_low)
        A, D, dt_bias = self.ssm_params.dequantized()
        y = selective_state_update(state.ssm, u, dt, A, B, C, D, z=z, delta_bias=dt_bias,
                                   delta_softplus=True)
        state.ssm.copy_(fake_quantize(state.ssm, s["state_scale"]))
        return self._out(y).unsqueeze(1)


def _dequantize_pairs(values: list) -> list:
    """[t0, s0, t1, s1, ...] with int8 tensors → the same list with fp32 tensors."""
    out = list(values)
    for i in range(0, len(out), 2):
        if out[i].dtype == torch.int8:
            out[i] = dequantize(out[i], out[i + 1])
    return out
