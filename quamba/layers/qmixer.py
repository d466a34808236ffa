"""The W8A8 Mamba1 mixer (Quamba recipe), runnable in every SSM mode of quamba.layers.modes.

Data flow of the int8 mode (prefill; shapes [batch, seqlen, ·] unless noted):

    h (int8) ─ in_proj W8A8 → xz (int8, one scale) ─ x, z as [b, d, l] views
    x ─ qconv1d (+SiLU) → u (int8, percentile scale)          conv state ← last inputs of x
    u ─ x_proj W8A8 → dt_low, B, C (int8, one scale) ; dt_low ─ dt_proj W8A8 → dt (int8)
    QSScan(u, dt, B, C, z; A_log, D, dt_bias int8) → y fp16    ssm state ← int8 (percentile)
    y ─ Hadamard + quantize → int8 ─ out_proj W8A8 → fp16 out

With the norms of dt, B and C (Falcon-Mamba, ``mixer_rms_eps``), x_proj's output is float, not
int8: dt_low, B and C are normalized (quamba.ops.norm.mixer_norm, torch ops on every device),
then quantized with the one scale calibrated on the normalized tensors (xdbl_scale), so dt_proj and
the scan get int8 codes as before. Jamba's norms also multiply by their weights, kept as float
buffers in the model dtype (MIXER_NORM_WEIGHTS) as the FP mixer applies them. The fused decode
ops take no such mixer: its step runs op by op.

A decode step (one token) runs conv update → x_proj → scan step op by op, dt_proj folded into
the scan step up to batch 8 where the scan takes dt as int8 codes (qsscan_update's ``dt_proj``:
the same dt codes, one kernel fewer on a GPU; above, dt_proj runs between them), or with
``fused_decode`` set (off by default: slower on a GPU so far) as one op, qmixer_ssm_step
(quamba.ops.fused_decode.mixer_step: two Triton kernels on a GPU), where
:meth:`QMambaMixer.fuses_decode` says it applies.
"""
from __future__ import annotations

import functools
import logging

import torch

from quamba.layers.base import QuantModule
from quamba.layers.qlinear import W4A8Linear, W8A8Linear, output_scale
from quamba.models.mamba import MixerState
from quamba.models.state import DEFAULT_MAX_SEQLEN
from quamba.ops import backend
from quamba.ops.conv.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_update,
    conv_state_from_prefill,
)
from quamba.ops.conv.qconv1d import qconv1d, qconv1d_update
from quamba.ops.fused_decode.layer_step import LayerWeights
from quamba.ops.fused_decode.mixer_step import qmixer_ssm_step
from quamba.ops.fused_decode.weights import ConvWeights, StepScales, W4A8Weight, W8A8Weight
from quamba.ops.linear.input_quant import quantize_per_tensor
from quamba.ops.norm.hadamard import hadamard_transform
from quamba.ops.norm.mixer_norm import mixer_rms_norm
from quamba.ops.norm.qhadamard import hadamard_quant
from quamba.ops.quant import dequantize, fake_quantize, fp32_multiplier, quantize, quantize_weight
from quamba.ops.scan.discretization import DEFAULT as DEFAULT_DISCRETIZATION
from quamba.ops.scan.discretization import check as check_discretization
from quamba.ops.scan.discretization import input_drive
from quamba.ops.scan.qsscan import DtProjection, SSMParams, qsscan, qsscan_last_drive, qsscan_update
from quamba.ops.scan.selective_scan import selective_scan, selective_state_update

log = logging.getLogger("quamba")

# The largest decode batch whose step folds dt_proj into the scan step. Measured on H100s
# (Mamba-2.8B W8A8 TPOT, dt_proj unfolded → folded, benchmarks/RESULTS.md): batch 1 2.14 → 2.13
# and 2.10 → 2.07 ms on two machines, batch 8 2.69 → 2.65; at batch 64 the fold (then without
# the tensor-core sums) cost more than the GEMM it saves (3.83 → 4.03), and the folded step's
# extra time grows with the batch (bench_ssm: +2.8 us at 64, +11 at 128).
FOLD_DT_PROJ_MAX_BATCH = 8

# Activation scales of a mixer, named after the tensor each one quantizes.
ACTIVATION_SCALES = ("xz_scale", "u_scale", "xdbl_scale", "dt_scale", "state_scale", "y_scale")
# The float weights of the norms of dt_low, B and C where the model's carry weights (Jamba's)
MIXER_NORM_WEIGHTS = ("dt_norm_weight", "B_norm_weight", "C_norm_weight")


class QMambaMixer(QuantModule):
    """Quantized mixer with the FP mixer's interface: ``forward(h, state=None, step=False)`` and
    ``allocate_state(batch, device)``. Its input h is what QRMSNorm returns (int8 codes, or
    fake-quantized floats in float-sim mode). Its scan discretizes as ``discretization`` says
    (quamba.ops.scan.discretization), in every SSM mode; ``mixer_rms_eps`` adds Falcon-Mamba's
    norms of dt, B and C (see the module's docstring), ``mixer_norm_weights`` their weights
    (Jamba's)."""

    def __init__(self, d_model: int, d_inner: int, d_state: int, d_conv: int, dt_rank: int,
                 scales: dict[str, float], h_scale: float, hadamard: bool, out_dtype,
                 device=None, weight_bits: int = 8, group_size: int = 128,
                 discretization: str = DEFAULT_DISCRETIZATION, mixer_rms_eps: float | None = None,
                 mixer_norm_weights: bool = False):
        super().__init__()
        self.d_inner, self.d_state, self.d_conv, self.dt_rank = d_inner, d_state, d_conv, dt_rank
        self.discretization = check_discretization(discretization)
        self.mixer_rms_eps = mixer_rms_eps
        self.hadamard = hadamard
        self.out_dtype = out_dtype
        self.weight_bits, self.group_size = weight_bits, group_size
        for name in scales:
            self.register_scale(name, scales[name])
        self.in_proj = self._linear(d_model, 2 * d_inner, h_scale, scales["xz_scale"], device)
        self.out_proj = self._linear(d_inner, d_model, scales["y_scale"], None, device, out_dtype)
        self._add_branch("", scales, device)
        if mixer_norm_weights:
            self._add_norm_weights(device)
        self.taps: dict | None = None
        self.state_cache = "int8"  # or "fp32": QuantConfig.state_cache
        # True: the int8 decode step's SSM side as one op (qmixer_ssm_step) where it applies
        # (:meth:`fuses_decode`); the same numbers on the torch backend. Off by default: its two
        # Triton kernels measured slower than the four CUDA kernels of the separate ops (an
        # H200: 12.8 against 7.9 µs a layer at batch 1, benchmarks/RESULTS.md).
        # QuantizedModel.set_fused_decode switches every mixer of a model.
        self.fused_decode = False
        # True: a batch-1 decode step on a GPU runs the whole block (norm included) as one op,
        # qmamba_layer_step, where its layer kernel applies (:meth:`layer_step_weights`); the
        # chain's numbers bit for bit, faster for W8A8 and W4A8 (benchmarks/RESULTS.md).
        # QuantizedModel.set_fused_layer switches every mixer.
        self.fused_layer = True

    def _linear(self, in_features, out_features, in_scale, out_scale, device, dtype=torch.float16):
        """A linear layer of the recipe's weight bits (int8 out when ``out_scale`` is given)."""
        if self.weight_bits == 4:
            return W4A8Linear(in_features, out_features, in_scale, out_scale, dtype,
                              self.group_size, device)
        return W8A8Linear(in_features, out_features, in_scale, out_scale, dtype, device)

    def _add_branch(self, suffix: str, scales: dict[str, float], device) -> None:
        """The int8 parameters and linear layers of one SSM branch, their names ending in
        ``suffix`` ("" for the forward one; QBiMambaMixer adds "_b"), with ``scales`` from
        ACTIVATION_SCALES (or their suffixed names)."""
        d_inner, d_state, dt_rank = self.d_inner, self.d_state, self.dt_rank
        u, xdbl, dt = (scales[suffixed(name, suffix)] for name in ("u_scale", "xdbl_scale", "dt_scale"))
        x_dbl_scale = None if self.mixer_rms_eps is not None else xdbl  # float out for the norms
        setattr(self, "x_proj" + suffix, self._linear(d_inner, dt_rank + 2 * d_state, u,
                                                      x_dbl_scale, device, self.out_dtype))
        # dt_proj stays W8A8 in every recipe: its K (dt_rank) is too small for 4-bit groups
        setattr(self, "dt_proj" + suffix, W8A8Linear(dt_rank, d_inner, xdbl, dt, device=device))
        int8 = dict(dtype=torch.int8, device=device)
        for name, shape in (("conv_weight", (d_inner, self.d_conv)), ("conv_bias", (d_inner,)),
                            ("A_log", (d_inner, d_state)), ("D", (d_inner,)), ("dt_bias", (d_inner,))):
            self.register_buffer(name + suffix, torch.zeros(*shape, **int8))
            self.register_scale(name + suffix + "_scale", 1.0)

    def _add_norm_weights(self, device) -> None:
        """MIXER_NORM_WEIGHTS: ones of dt_rank, d_state and d_state in the output dtype."""
        for name, dim in zip(MIXER_NORM_WEIGHTS, (self.dt_rank, self.d_state, self.d_state)):
            self.register_buffer(name, torch.ones(dim, dtype=self.out_dtype, device=device))

    @property
    def mixer_norm_weights(self) -> tuple | None:
        """The weights of the norms of dt_low, B and C (as MambaMixer.mixer_norm_weights)."""
        if not hasattr(self, MIXER_NORM_WEIGHTS[0]):
            return None
        return tuple(getattr(self, name) for name in MIXER_NORM_WEIGHTS)

    # --- construction ----------------------------------------------------------------------

    @classmethod
    def from_float(cls, mixer, h_scale: float, scales: dict[str, float], hadamard: bool,
                   weight_bits: int = 8, group_size: int = 128):
        """Quantize an FP MambaMixer (already rotated if ``hadamard``) with calibrated scales;
        4-bit weights round to nearest (GPTQ replaces their codes afterwards)."""
        weight, norm_weights = mixer.in_proj.weight, mixer.mixer_norm_weights
        q = cls(weight.shape[1], mixer.d_inner, mixer.d_state, mixer.d_conv, mixer.dt_rank,
                scales, h_scale, hadamard, weight.dtype, weight.device, weight_bits, group_size,
                discretization=mixer.discretization, mixer_rms_eps=mixer.mixer_rms_eps,
                mixer_norm_weights=norm_weights is not None)
        for buffer, norm_weight in zip(q.mixer_norm_weights or (), norm_weights or ()):
            buffer.copy_(norm_weight.detach())
        for name in ("in_proj", "out_proj"):
            getattr(q, name).load_float_weight(getattr(mixer, name).weight)
        q._load_branch("", mixer.conv1d, mixer.x_proj, mixer.dt_proj, mixer.A_log, mixer.D)
        for module in q.modules():
            module.refresh_scales()
        return q

    def _load_branch(self, suffix: str, conv1d, x_proj, dt_proj, A_log, D) -> None:
        """Quantize one FP branch's weights into the branch named by ``suffix``."""
        getattr(self, "x_proj" + suffix).load_float_weight(x_proj.weight)
        getattr(self, "dt_proj" + suffix).load_float_weight(dt_proj.weight)
        for name, tensor in (("conv_weight", conv1d.weight.squeeze(1)), ("conv_bias", conv1d.bias),
                             ("A_log", A_log), ("D", D), ("dt_bias", dt_proj.bias)):
            codes, scale = quantize_weight(tensor)
            getattr(self, name + suffix).copy_(codes)
            getattr(self, name + suffix + "_scale").fill_(scale)

    # --- helpers -----------------------------------------------------------------------------

    @property
    def ssm_params(self) -> SSMParams:
        return self.branch_ssm_params("")

    def branch_ssm_params(self, suffix: str) -> SSMParams:
        s = self.scales
        return SSMParams(getattr(self, "A_log" + suffix), s["A_log" + suffix + "_scale"],
                         getattr(self, "D" + suffix), s["D" + suffix + "_scale"],
                         getattr(self, "dt_bias" + suffix), s["dt_bias" + suffix + "_scale"])

    def _tap(self, name: str, tensor, scale=None):
        """Record a dequantized fp32 copy of an intermediate (layer-wise mode comparison)."""
        if self.taps is not None:
            self.taps[name] = dequantize(tensor, scale) if tensor.dtype == torch.int8 else tensor.float()

    def _dequantized(self, name: str):
        return dequantize(getattr(self, name), self.scales[name + "_scale"])

    def _conv_weights(self, suffix: str) -> tuple:
        s = self.scales
        return (getattr(self, "conv_weight" + suffix), s["conv_weight" + suffix + "_scale"],
                getattr(self, "conv_bias" + suffix), s["conv_bias" + suffix + "_scale"])

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
            conv=torch.zeros(batch_size, self.d_inner, self.d_conv - 1, dtype=dtype, device=device),
            ssm=torch.zeros(batch_size, self.d_inner, self.d_state, dtype=state_dtype,
                            device=device),
            drive=(torch.zeros(batch_size, self.d_inner, self.d_state, device=device)
                   if self.discretization == "foh" else None))

    def _scale(self, name: str, suffix: str) -> float:
        """The scale ``name`` (e.g. "u_scale") of the branch named by ``suffix``."""
        return self.scales[suffixed(name, suffix)]

    def _split_xdbl(self, x_dbl, suffix: str = ""):
        """dt_low, B and C of x_proj's output (branch ``suffix``). With the norms of dt, B and C,
        x_proj's float output normalized, then quantized with the branch's xdbl_scale
        (fake-quantized in float-sim mode)."""
        parts = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.mixer_rms_eps is None:
            return parts
        scale = self._scale("xdbl_scale", suffix)
        if self.simulate:
            normed = mixer_rms_norm(*parts, self.mixer_rms_eps, backend_name=self.backend,
                                    weights=self.mixer_norm_weights)
            return tuple(fake_quantize(part, scale) for part in normed)
        return mixer_rms_norm(*parts, self.mixer_rms_eps, backend_name=self.backend,
                              weights=self.mixer_norm_weights, out_scale=scale)

    def _out(self, y):
        """Gated scan output y [..., d_inner] → (Hadamard) → int8 → out_proj."""
        return out_projection(self, y)

    # --- forward -------------------------------------------------------------------------

    def forward(self, h, state: MixerState | None = None, step: bool = False):
        if step:
            return self._step(h, state)
        x, z = self._in_proj_prefill(h)
        if state is not None:
            state.conv.copy_(conv_state_from_prefill(x, self.d_conv))
        branch = self._branch_simulated if self.simulate else self._branch
        y, last_state, last_drive = branch(x, z, "", with_state=state is not None)
        if state is not None:
            state.keep_scan(last_state, last_drive)
        y = y.transpose(1, 2)
        self._tap("y", y)
        return self._out(y)

    def _in_proj_prefill(self, h):
        """x and z [b, d_inner, l]: int8 codes (fake-quantized fp32 in float-sim mode)."""
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)
        scale = None if self.simulate else self.scales["xz_scale"]
        self._tap("x", x, scale)
        self._tap("z", z, scale)
        return x, z

    def _branch(self, x, z, suffix: str, with_state: bool = False):
        """conv1d → x_proj → dt_proj → QSScan of one branch over x, z [b, d_inner, l] (int8 codes):
        (y [b, d_inner, l] in the output dtype, the last state: int8 if ``with_state``, else None,
        and the last drive: fp32 if ``with_state`` and the scan is foh, else None)."""
        s = self.scales
        fp32_conv = self.mode == "fp32-conv"
        u_scale = self._scale("u_scale", suffix)
        u = qconv1d(x, s["xz_scale"], *self._conv_weights(suffix),
                    out_scale=None if fp32_conv else u_scale, backend_name=self.backend)
        self._tap("u" + suffix, u, u_scale)
        u_codes = quantize(u, u_scale) if fp32_conv else u
        dt_low, B, C = self._split_xdbl(getattr(self, "x_proj" + suffix)(u_codes.transpose(1, 2)),
                                        suffix)
        dt = getattr(self, "dt_proj" + suffix)(dt_low)
        dt_scale, xdbl_scale = self._scale("dt_scale", suffix), self._scale("xdbl_scale", suffix)
        self._tap("dt" + suffix, dt, dt_scale)
        scan_inputs = [u, u_scale, dt.transpose(1, 2), dt_scale, B.transpose(1, 2), xdbl_scale,
                       C.transpose(1, 2), xdbl_scale, z, s["xz_scale"]]
        if self.mode == "fp32-ssm-input":
            scan_inputs = _dequantize_pairs(scan_inputs)
        y, last_state = qsscan(*scan_inputs, self.branch_ssm_params(suffix),
                               state_scale=s["state_scale"] if with_state and self.int8_state else None,
                               out_dtype=self.out_dtype, backend_name=self.backend,
                               discretization=self.discretization)
        if not with_state:
            return y, None, None
        u_and_scale, B_and_scale = scan_inputs[0:2], scan_inputs[4:6]
        last_drive = (qsscan_last_drive(*u_and_scale, *B_and_scale)
                      if self.discretization == "foh" else None)
        return y, last_state, last_drive

    def _step(self, h, state: MixerState):
        if self.simulate:
            return self._step_simulated(h, state)
        x, z = self.in_proj(h[:, 0]).chunk(2, dim=-1)
        linears = self._fused_linears()
        if linears is None:
            y = self._ssm_step(x, z, state)
        else:
            y = qmixer_ssm_step(x, z, state.conv, state.ssm, ConvWeights(*self._conv_weights("")),
                                *linears, self.ssm_params, self._step_scales(),
                                out_dtype=self.out_dtype, backend_name=self.backend)
        return self._out(y).unsqueeze(1)

    def fuses_decode(self) -> bool:
        """Whether the decode step runs its SSM side as one qmixer_ssm_step: ``fused_decode`` set,
        the int8 mode with zoh, and linear layers of the op's kinds (a W8A8 x_proj with a
        per-tensor weight scale, or W4A8; per-tensor activation scales)."""
        return self._fused_linears() is not None

    def _fused_linears(self) -> tuple | None:
        """qmixer_ssm_step's (x_proj, dt_proj) where :meth:`fuses_decode`, else None."""
        if not (self.fused_decode and self.mode == "int8"
                and self.discretization == DEFAULT_DISCRETIZATION):
            return None
        linears = (_fused_weight(self.x_proj), _fused_weight(self.dt_proj))
        return None if None in linears else linears

    def layer_step_weights(self, norm, hidden, residual, state: MixerState) -> LayerWeights | None:
        """What qmamba_layer_step reads of this block (``norm`` its QRMSNorm) where its layer
        kernel runs this decode step, else None (the block then runs norm and mixer op by op):
        ``fused_layer`` set, the int8 mode with zoh, an int8 state, no taps, :meth:`layer_weights`,
        and what the kernel checks (batch 1, a CUDA float16 model of Mamba-2.8B's sizes, compute
        capability 9.0, 128 SMs)."""
        if not (self.fused_layer and hidden.is_cuda and self.mode == "int8" and self.int8_state
                and self.taps is None and self.discretization == DEFAULT_DISCRETIZATION
                and backend.requested_backend(self.backend) != "torch"
                and backend.cuda_extension_error() is None):
            return None
        weights = self.layer_weights(norm)
        if weights is None:
            return None
        from quamba.ops.fused_decode import layer_step_cuda
        kernel_lacks = layer_step_cuda.lacks(hidden, residual, weights, state.conv, state.ssm)
        if kernel_lacks is not None:
            _log_op_by_op(kernel_lacks)
            return None
        return weights

    def layer_weights(self, norm) -> LayerWeights | None:
        """The block's weights as qmamba_layer_step takes them (``norm`` its QRMSNorm), or None
        where the op cannot take them: it needs W8A8 or W4A8 linear layers with per-tensor
        activation scales (and W8A8 weight scales), the Hadamard rotation and a norm without
        weight (the rotation folds it into in_proj), the residual in fp32."""
        if not (self.hadamard and norm.weight is None and norm.residual_in_fp32):
            return None
        in_proj, x_proj, dt_proj = (_fused_weight(linear)
                                    for linear in (self.in_proj, self.x_proj, self.dt_proj))
        out = self.out_proj
        if None in (in_proj, x_proj, dt_proj):
            return None
        if isinstance(out, W4A8Linear):
            out_proj = W4A8Weight(out.weight, out.group_multiplier, out.channel_scale,
                                  out.group_size, out.scales["in_scale"], None)
        elif out.per_channel:
            return None
        else:
            out_proj = W8A8Weight(out.weight, out.scales["weight_scale"], out.scales["in_scale"],
                                  None)
        return LayerWeights(norm.eps, norm.scales["out_scale"], in_proj,
                            ConvWeights(*self._conv_weights("")), x_proj, dt_proj, self.ssm_params,
                            self._step_scales(), self.scales["y_scale"], out_proj, self.out_dtype)

    def _step_scales(self) -> StepScales:
        s = self.scales
        return StepScales(s["xz_scale"], s["u_scale"], s["xdbl_scale"], s["dt_scale"],
                          s["state_scale"])

    def _ssm_step(self, x, z, state: MixerState):
        """The decode step's SSM side, op by op: y [batch, d_inner] in the output dtype."""
        s = self.scales
        fp32_conv = self.mode == "fp32-conv"
        u = qconv1d_update(x, state.conv, s["xz_scale"], self.conv_weight, s["conv_weight_scale"],
                           self.conv_bias, s["conv_bias_scale"],
                           out_scale=None if fp32_conv else s["u_scale"], backend_name=self.backend)
        u_codes = quantize(u, s["u_scale"]) if fp32_conv else u
        dt_low, B, C = self._split_xdbl(self.x_proj(u_codes))
        dt_projection = self._step_dt_projection(x.shape[0])
        dt = dt_low if dt_projection is not None else self.dt_proj(dt_low)
        scan_inputs = [u, s["u_scale"], dt, s["dt_scale"], B, s["xdbl_scale"], C, s["xdbl_scale"],
                       z, s["xz_scale"]]
        if self.mode == "fp32-ssm-input":
            scan_inputs = _dequantize_pairs(scan_inputs)
        return qsscan_update(state.ssm, s["state_scale"], *scan_inputs, self.ssm_params,
                             out_dtype=self.out_dtype, backend_name=self.backend,
                             discretization=self.discretization, drive=state.drive,
                             dt_proj=dt_projection)

    def _step_dt_projection(self, batch: int) -> DtProjection | None:
        """dt_proj as the decode step of ``batch`` rows folds it into the scan step, where the
        scan takes dt as int8 codes, dt_proj is a W8A8 layer with per-tensor scales and an int8
        output, and the batch is at most FOLD_DT_PROJ_MAX_BATCH; else None (dt_proj runs as its
        own op)."""
        if self.mode == "fp32-ssm-input" or batch > FOLD_DT_PROJ_MAX_BATCH:
            return None
        linear = _fused_weight(self.dt_proj)
        if not isinstance(linear, W8A8Weight):
            return None
        return DtProjection(linear.weight, fp32_multiplier(linear.in_scale, linear.weight_scale,
                                                           linear.out_scale))

    # --- float simulation of the int8 path -------------------------------------------------------

    def _branch_simulated(self, x, z, suffix: str, with_state: bool = False):
        """The float simulation of :meth:`_branch` (x, z fake-quantized fp32): y, the fp32 last
        state fake-quantized with the state scale and the last drive (foh), both None unless
        ``with_state``."""
        conv_weight, weight_scale, conv_bias, bias_scale = self._conv_weights(suffix)
        u = fake_quantize(causal_conv1d(x, dequantize(conv_weight, weight_scale),
                                        dequantize(conv_bias, bias_scale)),
                          self._scale("u_scale", suffix))
        self._tap("u" + suffix, u)
        dt_low, B, C = self._split_xdbl(getattr(self, "x_proj" + suffix)(u.transpose(1, 2)), suffix)
        dt = getattr(self, "dt_proj" + suffix)(dt_low)
        self._tap("dt" + suffix, dt)
        A, D, dt_bias = self.branch_ssm_params(suffix).dequantized()
        y, last_state = selective_scan(u, dt.transpose(1, 2), A, B.transpose(1, 2),
                                       C.transpose(1, 2), D, z=z, delta_bias=dt_bias,
                                       delta_softplus=True, discretization=self.discretization)
        if not with_state:
            return y, None, None
        last_drive = input_drive(u[..., -1], B[:, -1]) if self.discretization == "foh" else None
        if self.int8_state:
            last_state = fake_quantize(last_state, self.scales["state_scale"])
        return y, last_state, last_drive

    def _step_simulated(self, h, state: MixerState):
        s = self.scales
        x, z = self.in_proj(h[:, 0]).chunk(2, dim=-1)
        u = fake_quantize(causal_conv1d_update(x, state.conv, self._dequantized("conv_weight"),
                                               self._dequantized("conv_bias")), s["u_scale"])
        dt_low, B, C = self._split_xdbl(self.x_proj(u))
        dt = self.dt_proj(dt_low)
        A, D, dt_bias = self.ssm_params.dequantized()
        y = selective_state_update(state.ssm, u, dt, A, B, C, D, z=z, delta_bias=dt_bias,
                                   delta_softplus=True, discretization=self.discretization,
                                   drive=state.drive)
        if self.int8_state:
            state.ssm.copy_(fake_quantize(state.ssm, s["state_scale"]))
        return self._out(y).unsqueeze(1)


def out_projection(mixer: QuantModule, y):
    """A quantized mixer's y [..., d_inner] → (Hadamard if ``mixer.hadamard``) → int8 with its
    y_scale → its out_proj; fake-quantized fp32 in float-sim mode. Taps out_proj.input and out."""
    s = mixer.scales
    if mixer.simulate:
        y = hadamard_transform(y.float()) if mixer.hadamard else y.float()
        y_q = fake_quantize(y, s["y_scale"])
    elif mixer.hadamard:
        y_q = hadamard_quant(y, s["y_scale"], backend_name=mixer.backend)
    else:
        y_q = quantize_per_tensor(y, s["y_scale"], backend_name=mixer.backend)
    return project_codes(mixer, y_q)


def project_codes(mixer: QuantModule, y_q):
    """out_proj of the int8 codes (or fake-quantized values) ``y_q`` of a quantized mixer's y.
    Taps out_proj.input and out."""
    mixer._tap("out_proj.input", y_q, mixer.scales["y_scale"])
    out = mixer.out_proj(y_q)
    mixer._tap("out", out)
    return out


def _fused_weight(linear) -> W8A8Weight | W4A8Weight | None:
    """qmixer_ssm_step's view of an int8-output linear layer (its codes and scales as the layer
    runs them), or None where the op takes no such layer (a float output, a per-channel W8A8
    weight scale or output scale)."""
    out_scale = output_scale(linear)
    if not isinstance(out_scale, float):
        return None
    s = linear.scales
    if isinstance(linear, W4A8Linear):
        return W4A8Weight(linear.weight, linear.group_multiplier, linear.channel_scale,
                          linear.group_size, s["in_scale"], out_scale)
    if isinstance(linear, W8A8Linear) and not linear.per_channel:
        return W8A8Weight(linear.weight, s["weight_scale"], s["in_scale"], out_scale)
    return None


@functools.lru_cache(maxsize=None)
def _log_op_by_op(why: str) -> None:
    """Says once per reason that a block's decode step runs op by op, not as the layer kernel."""
    log.info("a quantized block's decode step runs op by op, not as qmamba_layer_step's layer "
             "kernel: %s", why)


def suffixed(scale_name: str, suffix: str) -> str:
    """A branch's name for an activation scale: "u_scale" of branch "_b" is "u_b_scale"."""
    return scale_name[:-len("_scale")] + suffix + "_scale"


def _dequantize_pairs(values: list) -> list:
    """[t0, s0, t1, s1, ...] with int8 tensors → the same list with fp32 tensors."""
    out = list(values)
    for i in range(0, len(out), 2):
        if out[i].dtype == torch.int8:
            out[i] = dequantize(out[i], out[i + 1])
    return out
