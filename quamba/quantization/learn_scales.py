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
  the scan is quamba.ops.scan.selective_scan's torch reference (autograd);
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

* weight clipping (``learn_weight_clipping``, W4A8 with round-to-nearest weights): each 4-bit
  layer's (in_proj, x_proj, out_proj) weights are clamped per group to clip · the group's absmax,
  clip = sigmoid(logit) learned with the ranges (one per output channel and group, starting at
  sigmoid(4) ≈ 0.98, as OmniQuant's learnable weight clipping); the forward quantizes the clamped
  weight exactly as quamba.ops.quant4.quantize_weight_w4a8 does (two-level scales, codes in
  [-7, 7]), with straight-through rounding. Where a block keeps its learned values, its FP
  weights are clamped in place, so that the quantized model's round-to-nearest weights are the
  ones the pass simulated.

Learning samples: the first ``learn_num_samples`` calibration samples. Memory: four fp32 copies
of their hidden states (samples × seqlen × d_model × 16 bytes).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quamba.errors import QuambaError
from quamba.layers.qlinear import W4A8Linear
from quamba.models.mamba import Block, MambaMixer
from quamba.ops.conv.causal_conv1d import causal_conv1d
from quamba.ops.norm.hadamard import hadamard_transform
from quamba.ops.norm.rms_norm import rms_norm
from quamba.ops.quant import INT8_MAX, SCALE_FLOOR, dequantize
from quamba.ops.quant4 import INT4_MAX, W4A8_MAX_MULTIPLIER
from quamba.ops.scan.discretization import input_drive
from quamba.ops.scan.selective_scan import selective_scan
from quamba.quantization.blocks import quantized_block

LEARNED_KINDS = ("in_proj.input", "in_proj.output", "x_proj.input", "x_proj.output",
                 "dt_proj.output", "ssm_state", "out_proj.input")
INPUTS = "outputs of the quantized blocks before (sequential); target: FP block on FP inputs"
CLIPPED_LINEARS = ("in_proj", "x_proj", "out_proj")  # the 4-bit weights of W4A8
CLIP_LOGIT_INIT = 4.0


def learn_ranges(fp_model, ranges: dict, tokens: torch.Tensor, config, progress: bool = True):
    """(ranges with each A8 layer's LEARNED_KINDS learned, the record of the pass) for the FP model
    ``fp_model`` (in the quantization basis) and its calibrated ``ranges[layer][kind]``, learned on
    the calibration ``tokens``. ``ranges`` itself is not modified; with
    ``config.learn_weight_clipping`` the 4-bit weights of ``fp_model`` are clamped in place to
    their learned bounds (quantize() passes its own copy)."""
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
            weights = _BlockWeights(fp_block, calibrated_block, config.learn_weight_clipping)
            kinds, clips, record["layers"][str(layer)] = _learn_block(
                weights, q_stream, _target(fp_stream), learned[layer], config, layer, progress)
            learned[layer].update(kinds)
            clip_weights_(fp_block, clips, weights)
        block = quantized_block(fp_block, layer, learned, config, fp_model.config)
        q_stream = _block_outputs(block, *q_stream, batch)
    return learned, record


def check_learnable(model) -> None:
    """A one-line QuambaError unless every block of ``model`` is a Mamba1 block without the
    norms of dt, B and C."""
    for layer, mixer in enumerate(model.mixers()):
        if type(mixer) is not MambaMixer:
            raise QuambaError(f"--learn_scales supports Mamba1 blocks; layer {layer} is a "
                              f"{type(mixer).__name__}")
    if model.config.mixer_rms_eps is not None:
        raise QuambaError("--learn_scales does not support the norms of dt, B and C "
                          "(mixer_rms_eps: Falcon-Mamba) yet")


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
    """(learned ranges of LEARNED_KINDS and clip factors of the clipped weights, or none of them
    if the calibrated ranges and round-to-nearest weights fit better; the record)."""
    log_ranges = {kind: torch.tensor(math.log(calibrated[kind]), requires_grad=True)
                  for kind in LEARNED_KINDS}
    clip_logits = {name: torch.full(weights.clip_shape(name), CLIP_LOGIT_INIT, requires_grad=True)
                   for name in weights.clipped}
    optimizer = torch.optim.Adam([*log_ranges.values(), *clip_logits.values()], lr=config.learn_lr)
    generator = torch.Generator().manual_seed(config.seed * 1000 + layer)
    hidden, residual = q_stream
    n = hidden.shape[0]
    steps = tqdm(range(config.learn_steps), desc=f"learning scales of layer {layer}",
                 disable=not progress)
    for step in steps:
        idx = torch.randint(n, (config.learn_batch_size,), generator=generator)
        out = weights.forward(hidden[idx], None if residual is None else residual[idx],
                              _scales(log_ranges), _clips(clip_logits))
        loss = F.mse_loss(out, target[idx])
        check_finite(loss, layer, step)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    learned = {kind: float(torch.exp(value.detach())) for kind, value in log_ranges.items()}
    clips = {name: torch.sigmoid(logit.detach()) for name, logit in clip_logits.items()}
    before = _full_loss(weights, q_stream, target, calibrated, config.calib_batch_size)
    after = _full_loss(weights, q_stream, target, learned, config.calib_batch_size, clips)
    kept = "learned" if after < before else "calibrated"
    record = {"loss_calibrated": before, "loss_learned": after, "kept": kept,
              "calibrated": {kind: calibrated[kind] for kind in LEARNED_KINDS},
              "learned": learned}
    if clips:
        record["weight_clipping"] = {name: _clip_summary(clip) for name, clip in clips.items()}
    if kept == "calibrated":
        return {}, {}, record
    return learned, clips, record


def _clips(clip_logits: dict) -> dict:
    return {name: torch.sigmoid(logit) for name, logit in clip_logits.items()}


def _clip_summary(clip: torch.Tensor) -> dict:
    """What a layer's learned clip factors did: their mean and minimum, and the fraction of
    groups clipped by more than 1%."""
    return {"mean": float(clip.mean()), "min": float(clip.min()),
            "groups_below_0.99": float((clip < 0.99).float().mean())}


def fake_quantize_w4a8_weight(weight: torch.Tensor, clip: torch.Tensor, group_size: int):
    """fp32 [N, K]: ``weight`` clamped per group to ``clip`` [N, K / G] · the group's absmax,
    then quantized as quamba.ops.quant4.quantize_weight_w4a8 quantizes that clamped weight (group
    scale = absmax / 7, two-level channel scale and multiplier in [1, 18], codes in [-7, 7]),
    with straight-through rounding: differentiable in ``clip`` (through the clamp and the scales,
    LSQ's gradient) and in ``weight``."""
    n, k = weight.shape
    clamped, bound = _clamped_groups(weight, clip, group_size)
    scales = bound.clamp(min=SCALE_FLOOR) / INT4_MAX
    channel_scale = scales.amax(dim=1).clamp(min=SCALE_FLOOR) / W4A8_MAX_MULTIPLIER
    multiplier = _ste_round(scales / channel_scale[:, None]).clamp(1, W4A8_MAX_MULTIPLIER)
    effective = (channel_scale[:, None] * multiplier)[..., None]
    codes = _ste_round((clamped * torch.reciprocal(effective)).clamp(-INT4_MAX, INT4_MAX))
    return (codes * effective).view(n, k)


def _clamped_groups(weight: torch.Tensor, clip: torch.Tensor, group_size: int):
    """(fp32 [N, K / G, G] groups of ``weight`` clamped to ±bound, the bounds [N, K / G]): bound =
    clip · the group's absmax, rounded to the weight's dtype so that the clamped weight stored in
    that dtype keeps it as its absmax."""
    n, k = weight.shape
    groups = weight.float().view(n, k // group_size, group_size)
    bound = (clip * groups.abs().amax(-1)).to(weight.dtype).float()
    return torch.minimum(torch.maximum(groups, -bound[..., None]), bound[..., None]), bound


def _ste_round(x: torch.Tensor) -> torch.Tensor:
    """round(x) (half to even) with the identity's gradient."""
    return x + (torch.round(x) - x).detach()


@torch.no_grad()
def clip_weights_(fp_block: Block, clips: dict, weights: "_BlockWeights") -> None:
    """Clamp the FP weights of ``fp_block`` named in ``clips`` to their groups' learned bounds,
    in place: round-to-nearest of the result is :func:`fake_quantize_w4a8_weight`'s value."""
    for name, clip in clips.items():
        weight = getattr(fp_block.mixer, name).weight
        clamped, _ = _clamped_groups(weight, clip, weights.clipped[name][1])
        weight.copy_(clamped.view(weight.shape))


def check_finite(loss: torch.Tensor, layer: int, step: int) -> None:
    if not torch.isfinite(loss):
        raise QuambaError(f"learning the scales of layer {layer}: the loss is {float(loss.detach())} at "
                          f"step {step} (non-finite activations or learning rate too high)")


@torch.no_grad()
def _full_loss(weights: "_BlockWeights", q_stream, target, kind_ranges: dict, batch: int,
               clips: dict | None = None) -> float:
    """MSE over every learning sample with ranges ``kind_ranges`` and clip factors ``clips`` (None:
    the round-to-nearest weights), a float64 sum of per-batch sums."""
    scales = {kind: torch.tensor(float(kind_ranges[kind]) / INT8_MAX) for kind in LEARNED_KINDS}
    hidden, residual = q_stream
    total = 0.0
    for i in range(0, hidden.shape[0], batch):
        out = weights.forward(hidden[i:i + batch],
                              None if residual is None else residual[i:i + batch], scales, clips)
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
    the FP weights of its 4-bit layers where their clipping is learned (``clipped``: name →
    (weight in the model's dtype, group size)), and its differentiable float-simulated forward."""

    def __init__(self, fp_block: Block, qblock: Block, clip_weights: bool = False):
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
        self.clipped = {}
        for name in CLIPPED_LINEARS if clip_weights else ():
            linear = getattr(mixer, name)
            if isinstance(linear, W4A8Linear):
                weight = getattr(fp_block.mixer, name).weight.detach().clone()
                self.clipped[name] = (weight, linear.group_size)

    def clip_shape(self, name: str) -> tuple[int, int]:
        """[N, K / G]: one clip factor per output channel and group of a clipped weight."""
        weight, group_size = self.clipped[name]
        return weight.shape[0], weight.shape[1] // group_size

    def _weight(self, name: str, clips: dict | None) -> torch.Tensor:
        if clips is None or name not in clips:
            return getattr(self, name)
        weight, group_size = self.clipped[name]
        return fake_quantize_w4a8_weight(weight, clips[name], group_size)

    def forward(self, hidden, residual, scales: dict, clips: dict | None = None) -> torch.Tensor:
        """The residual stream after the block (fp32 [b, l, d_model]) with activation scales
        ``scales[kind]`` (0-dim fp32 tensors) and the clipped 4-bit weights of ``clips[name]``
        (clip factors; None or a name left out: the round-to-nearest weights)."""
        in_proj, x_proj, out_proj = (self._weight(name, clips) for name in CLIPPED_LINEARS)
        normed, residual = rms_norm(hidden, residual, self.norm_weight, self.eps,
                                    self.residual_in_fp32, backend_name="torch")
        h = ste_fake_quantize(normed, scales["in_proj.input"])
        xz = ste_fake_quantize(h @ in_proj.t(), scales["in_proj.output"])
        x, z = xz.transpose(1, 2).chunk(2, dim=1)
        u = ste_fake_quantize(causal_conv1d(x, self.conv_weight, self.conv_bias, backend_name="torch"),
                              scales["x_proj.input"])
        x_dbl = ste_fake_quantize(u.transpose(1, 2) @ x_proj.t(), scales["x_proj.output"])
        dt_low, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        dt = ste_fake_quantize(dt_low @ self.dt_proj.t(), scales["dt_proj.output"])
        y = self._scan(u, dt.transpose(1, 2), B.transpose(1, 2), C.transpose(1, 2), z,
                       scales["ssm_state"]).transpose(1, 2)
        if self.hadamard:
            y = hadamard_transform(y)
        out = ste_fake_quantize(y, scales["out_proj.input"]) @ out_proj.t()
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
