"""Learned clipping ranges (``QuantConfig.learn_scales``, ``main.py --learn_scales``).

The observers of quamba.calibrate hand-set each activation's clipping range (absmax, or a
percentile for the SSM input and state). This pass refines them, block after block, by gradient
descent on the block's output error against the FP block:

* learned: every static activation range of a Mamba1 block (LEARNED_KINDS: in_proj's input and
  output, the SSM input u, x_proj's output dt_low/B/C, dt, the SSM state and out_proj's input),
  each as log(range), initialised from the calibrated range;
* forward: the block in float simulation (the ``float-sim-asic-int8`` arithmetic: dequantized
  int8 / 4-bit weights, every activation fake-quantized where the int8 path holds int8) with
  straight-through rounding, q = clamp(round(x / s), -127, 127) · s, whose gradient to the scale
  is LSQ's (round(x / s) - x / s inside the range, ±127 outside) and to x is 1 inside, 0 outside;
  the scan is quamba.ops.selective_scan's torch reference (autograd);
* the state scale: a prefill never quantizes the state, so each sample's scan is cut at its
  middle and the second half continues from the fake-quantized state, as a decode continues
  from the int8 state a prefill left;
* inputs and target (OmniQuant's sequential choice): block i reads the outputs of the already
  quantized blocks 0..i-1 (int8 path, learned ranges), so its ranges also absorb the error
  upstream; its target is the FP block's output on the FP model's own hidden states; the loss is
  the MSE of the residual stream after the block (mixer output + residual);
* Adam on ``learn_steps`` minibatches of ``learn_batch_size`` samples drawn by a generator seeded
  with ``seed`` and the layer, in fp32: same model, data, seed and machine (device, thread
  count) give bit-identical ranges;
* guard: a non-finite loss stops with a QuambaError; a block keeps its learned ranges only where
  their loss over all learning samples is below the calibrated ranges' (else the calibrated ones,
  recorded as such).

Learning samples: the first ``learn_num_samples`` calibration samples. Memory: four fp32 copies
of their hidden states (samples × seqlen × d_model × 16 bytes).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quamba.errors import QuambaError
from quamba.models.mamba import Block, MambaMixer
from quamba.ops.causal_conv1d import causal_conv1d
from quamba.ops.discretization import input_drive
from quamba.ops.hadamard import hadamard_transform
from quamba.ops.quant import INT8_MAX, dequantize
from quamba.ops.rms_norm import rms_norm
from quamba.ops.selective_scan import selective_scan

LEARNED_KINDS = ("in_proj.input", "in_proj.output", "x_proj.input", "x_proj.output",
                 "dt_proj.output", "ssm_state", "out_proj.input")
INPUTS = "outputs of the quantized blocks before (sequential); target: FP block on FP inputs"


def learn_ranges(fp_model, ranges: dict, tokens: torch.Tensor, config, progress: bool = True):
    """(ranges with each A8 layer's LEARNED_KINDS learned, the record of the pass) for the FP model
    ``fp_model`` (in the quantization basis) and its calibrated ``ranges[layer][kind]``, learned on
    the calibration ``tokens``. ``ranges`` itself is not modified."""
    from quamba.quantization.quantize import quantized_block
    check_learnable(fp_model)
    samples = tokens[:config.learn_num_samples]
    batch = config.calib_batch_size
    with torch.no_grad():
        fp_stream = (fp_model.backbone.embedding(samples), None)
    q_stream = fp_stream
    learned = {layer: dict(kinds) for layer, kinds in ranges.items()}
    record = {"inputs": INPUTS, "num_samples": samples.shape[0], "layers": {}}
    for layer, fp_block in enumerate(fp_model.backbone.layers):
        fp_stream = _block_outputs(fp_block, *fp_stream, batch)
        if config.bits_of(layer)[1] == 8:
            calibrated_block = quantized_block(fp_block, layer, learned, config, fp_model.config)
            weights = _BlockWeights(fp_block, calibrated_block)
            kinds, record["layers"][str(layer)] = _learn_block(weights, q_stream, _target(fp_stream),
                                                               learned[layer], config, layer, progress)
            learned[layer].update(kinds)
        block = quantized_block(fp_block, layer, learned, config, fp_model.config)
        q_stream = _block_outputs(block, *q_stream, batch)
    return learned, record


def check_learnable(model) -> None:
    """A one-line QuambaError unless every block of ``model`` is a Mamba1 block."""
    for layer, mixer in enumerate(model.mixers()):
        if type(mixer) is not MambaMixer:
            raise QuambaError(f"--learn_scales supports Mamba1 blocks; layer {layer} is a "
                              f"{type(mixer).__name__}")


def _run_batched(fn, *tensors, batch: int):
    """``fn`` over row batches of ``tensors`` (None passes through), outputs concatenated."""
    n = tensors[0].shape[0]
    outs = [fn(*(None if t is None else t[i:i + batch] for t in tensors)) for i in range(0, n, batch)]
    if isinstance(outs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*outs))
    return torch.cat(outs)


@torch.no_grad()
def _block_outputs(block: Block, hidden, residual, batch: int):
    """(hidden, residual) after ``block`` for every sample."""
    return _run_batched(lambda h, r: block(h, r), hidden, residual, batch=batch)


def _target(stream) -> torch.Tensor:
    """The residual stream after a block: its mixer output plus its residual, fp32."""
    hidden, residual = stream
    return hidden.float() + residual.float()


def _learn_block(weights: "_BlockWeights", q_stream, target, calibrated: dict, config, layer: int,
                 progress: bool):
    """(learned ranges of LEARNED_KINDS, or the calibrated ones if those fit better; the record)."""
    log_ranges = {kind: torch.tensor(math.log(calibrated[kind]), requires_grad=True)
                  for kind in LEARNED_KINDS}
    optimizer = torch.optim.Adam(log_ranges.values(), lr=config.learn_lr)
    generator = torch.Generator().manual_seed(config.seed * 1000 + layer)
    hidden, residual = q_stream
    n = hidden.shape[0]
    steps = tqdm(range(config.learn_steps), desc=f"learning scales of layer {layer}",
                 disable=not progress)
    for step in steps:
        idx = torch.randint(n, (config.learn_batch_size,), generator=generator)
        out = weights.forward(hidden[idx], None if residual is None else residual[idx],
                              _scales(log_ranges))
        loss = F.mse_loss(out, target[idx])
        check_finite(loss, layer, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    learned = {kind: float(torch.exp(value.detach())) for kind, value in log_ranges.items()}
    before = _full_loss(weights, q_stream, target, calibrated, config.calib_batch_size)
    after = _full_loss(weights, q_stream, target, learned, config.calib_batch_size)
    kept = "learned" if after < before else "calibrated"
    record = {"loss_calibrated": before, "loss_learned": after, "kept": kept,
              "calibrated": {kind: calibrated[kind] for kind in LEARNED_KINDS},
              "learned": learned}
    return (learned if kept == "learned" else {}), record


def check_finite(loss: torch.Tensor, layer: int, step: int) -> None:
    if not torch.isfinite(loss):
        raise QuambaError(f"learning the scales of layer {layer}: the loss is {float(loss.detach())} at "
                          f"step {step} (non-finite activations or learning rate too high)")


@torch.no_grad()
def _full_loss(weights: "_BlockWeights", q_stream, target, kind_ranges: dict, batch: int) -> float:
    """MSE over every learning sample with ranges ``kind_ranges`` (float64 sum of per-batch sums)."""
    scales = {kind: torch.tensor(float(kind_ranges[kind]) / INT8_MAX) for kind in LEARNED_KINDS}
    hidden, residual = q_stream
    total = 0.0
    for i in range(0, hidden.shape[0], batch):
        out = weights.forward(hidden[i:i + batch],
                              None if residual is None else residual[i:i + batch], scales)
        total += float(F.mse_loss(out, target[i:i + batch], reduction="sum").double())
    return total / target.numel()


def _scales(log_ranges: dict) -> dict:
    return {kind: torch.exp(value) / INT8_MAX for kind, value in log_ranges.items()}


def ste_fake_quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """clamp(round(x / scale), -127, 127) · scale with straight-through rounding: d/dx is 1 inside
    the range and 0 outside; d/dscale is LSQ's, round(x/s) - x/s inside and ±127 outside."""
    ratio = (x.float() / scale).clamp(-INT8_MAX, INT8_MAX)
    return (ratio + (torch.round(ratio) - ratio).detach()) * scale


class _BlockWeights:
    """The quantized block's weights, dequantized to fp32 (fixed while the ranges are learned),
    and its differentiable float-simulated forward."""

    def __init__(self, fp_block: Block, qblock: Block):
        mixer = qblock.mixer
        norm = fp_block.norm
        self.norm_weight = norm.weight.detach().float()
        self.eps, self.residual_in_fp32 = norm.eps, norm.residual_in_fp32
        self.in_proj, self.x_proj, self.dt_proj, self.out_proj = (
            _float_weight(getattr(mixer, name)) for name in ("in_proj", "x_proj", "dt_proj", "out_proj"))
        weight, weight_scale, bias, bias_scale = mixer._conv_weights("")
        self.conv_weight, self.conv_bias = dequantize(weight, weight_scale), dequantize(bias, bias_scale)
        self.A, self.D, self.dt_bias = mixer.ssm_params.dequantized()
        self.hadamard, self.discretization = mixer.hadamard, mixer.discretization
        self.dt_rank, self.d_state = mixer.dt_rank, mixer.d_state

    def forward(self, hidden, residual, scales: dict) -> torch.Tensor:
        """The residual stream after the block (fp32 [b, l, d_model]) with activation scales
        ``scales[kind]`` (0-dim fp32 tensors)."""
        normed, residual = rms_norm(hidden, residual, self.norm_weight, self.eps,
                                    self.residual_in_fp32, backend_name="torch")
        h = ste_fake_quantize(normed, scales["in_proj.input"])
        xz = ste_fake_quantize(h @ self.in_proj.t(), scales["in_proj.output"])
        x, z = xz.transpose(1, 2).chunk(2, dim=1)
        u = ste_fake_quantize(causal_conv1d(x, self.conv_weight, self.conv_bias, backend_name="torch"),
                              scales["x_proj.input"])
        x_dbl = ste_fake_quantize(u.transpose(1, 2) @ self.x_proj.t(), scales["x_proj.output"])
        dt_low, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = ste_fake_quantize(dt_low @ self.dt_proj.t(), scales["dt_proj.output"])
        y = self._scan(u, dt.transpose(1, 2), B.transpose(1, 2), C.transpose(1, 2), z,
                       scales["ssm_state"]).transpose(1, 2)
        if self.hadamard:
            y = hadamard_transform(y)
        out = ste_fake_quantize(y, scales["out_proj.input"]) @ self.out_proj.t()
        return out + residual.float()

    def _scan(self, u, dt, B, C, z, state_scale):
        """The selective scan over [b, ·, l], cut at the middle: the second half continues from
        the first half's last state fake-quantized with ``state_scale``."""
        cut = u.shape[-1] // 2
        params = dict(A=self.A, D=self.D, delta_bias=self.dt_bias, delta_softplus=True,
                      discretization=self.discretization, backend_name="torch")
        if cut == 0:
            return selective_scan(u, dt, B=B, C=C, z=z, **params)[0]
        first, second = slice(None, cut), slice(cut, None)
        y1, state = selective_scan(u[..., first], dt[..., first], B=B[..., first], C=C[..., first],
                                   z=z[..., first], **params)
        drive = input_drive(u[..., cut - 1], B[..., cut - 1]) if self.discretization == "foh" else None
        y2, _ = selective_scan(u[..., second], dt[..., second], B=B[..., second], C=C[..., second],
                               z=z[..., second], initial_state=ste_fake_quantize(state, state_scale),
                               initial_drive=drive, **params)
        return torch.cat([y1, y2], dim=-1)


def _float_weight(linear) -> torch.Tensor:
    """A W8A8Linear's or W4A8Linear's weight as the fp32 values its codes stand for."""
    if hasattr(linear, "dequantized_weight"):
        return linear.dequantized_weight()
    return dequantize(linear.weight, linear.scales["weight_scale"])
