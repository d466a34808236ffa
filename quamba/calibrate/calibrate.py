"""Calibration: batched forwards over the calibration tokens with hooks that feed one observer per
layer and tensor kind, giving the clipping ranges the int8 quantizer maps to 127."""
from __future__ import annotations

from contextlib import contextmanager
from types import MappingProxyType

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from quamba.calibrate.data import CalibrationSet
from quamba.calibrate.errors import CalibrationError
from quamba.calibrate.observers import ChannelAbsMaxObserver, ObserverSpec, make_observer
from quamba.layers.qtransformer import TRANSFORMER_LAYERS, input_kind, quantized_linears
from quamba.models.hub import check_token_ids
from quamba.models.falcon_h1 import ParallelMixer
from quamba.models.mamba2 import Mamba2Mixer
from quamba.models.state import MixerState
from quamba.models.zamba2 import HybridState
from quamba.ops.conv.causal_conv1d import causal_conv1d

_ABSMAX = ObserverSpec("absmax")
_PERCENTILE = ObserverSpec("percentile", 0.9995)

# Tensor kinds per layer (names fixed: the quantizer reads them) and the Quamba recipe's observers.
DEFAULT_OBSERVERS = MappingProxyType({
    "in_proj.input": _ABSMAX,  # the block's normed hidden state
    "in_proj.output": _ABSMAX,  # x and z together
    "x_proj.input": _PERCENTILE,  # u = SiLU(conv1d(x)), the SSM input
    "x_proj.output": _ABSMAX,  # dt_low, B and C together
    "dt_proj.output": _ABSMAX,  # dt before the bias (the bias is added in the scan)
    "ssm_state": _PERCENTILE,  # the last SSM state of each sample
    "out_proj.input": _ABSMAX,  # after the online Hadamard, if the model was rotated
})
# The kinds of a Mamba2 layer beyond in_proj.input, ssm_state and out_proj.input (Quamba2's
# scales): in_proj's output by segment, before the conv.
MAMBA2_OBSERVERS = MappingProxyType({
    "z": _ABSMAX,
    "x_in": _ABSMAX,
    "B_in": _ABSMAX,
    "C_in": _ABSMAX,
    "dt": _ABSMAX,
})
TENSOR_KINDS = tuple(DEFAULT_OBSERVERS)
MAMBA2_KINDS = tuple(MAMBA2_OBSERVERS)
# The backward branch of a bidirectional (Vision Mamba) mixer: observed as the forward kinds.
BACKWARD_KINDS = ("x_proj_b.input", "x_proj_b.output", "dt_proj_b.output")
# The final norm's output, lm_head's input: observed (absmax) under the pseudo-layer HEAD_LAYER
# when ``calibrate(observe_head=True)``, for an int8 lm_head (quamba.layers.qhead).
HEAD_LAYER = "lm_head"
HEAD_KIND = "lm_head.input"
# Zamba2: the inputs of a shared block's linears are observed under the layer using it as this
# prefix + their kind ("shared.in_proj.input": q, k and v's), the layer's own linear's as
# "linear.input" (absmax, as every hybrid linear's)
SHARED_PREFIX = "shared."
# Per-channel absmax of a Mamba2 layer's conv output: x per channel [d_inner], B and C per state
# group [ngroups]; their results are fp32 tensors.
CHANNEL_KINDS = ("x", "B", "C")


def base_kind(kind: str) -> str:
    """The kind whose observer a backward-branch kind uses ("x_proj_b.input" → "x_proj.input")."""
    return kind.replace("_b.", ".")


@torch.no_grad()
def calibrate(model, calib: CalibrationSet | torch.Tensor,
              observers: dict[str, ObserverSpec] | None = None, batch_size: int = 8,
              progress: bool = True, observe_head: bool = False) -> dict[int, dict[str, float]]:
    """Clipping ranges ``{layer index: {tensor kind: range}}`` of ``model`` over ``calib``; with
    ``observe_head`` also ``{HEAD_LAYER: {HEAD_KIND: range}}``, the final norm's output over every
    token.

    ``observers`` overrides the observer of some kinds (e.g. all absmax for a naive recipe);
    the others keep ``DEFAULT_OBSERVERS``. Each batch is one prefill into a fresh cache, so the
    SSM state observed is each sample's state after its last token. Results are bit-identical
    for the same model and tokens, whatever the batch size, as far as the model's own forward
    does not depend on the batch size.
    """
    tokens = _calibration_tokens(calib)
    check_token_ids(tokens, model.config.vocab_size, "the calibration tokens")
    _check_batch_size(batch_size)
    recorder = _Recorder(_observer_specs(observers), num_samples=tokens.shape[0])
    device = next(model.parameters()).device
    batches = range(0, tokens.shape[0], batch_size)
    with (_observing(model, recorder), _observing_shared_blocks(model, recorder),
          _observing_head(model, recorder, observe_head)):
        for start in tqdm(batches, desc="calibrating", unit="batch", disable=not progress):
            ids = tokens[start:start + batch_size].to(device)
            cache = model.allocate_cache(ids.shape[0], device, max_seqlen=ids.shape[1])
            model(ids, cache=cache, num_last_tokens=1)
            for layer, state in enumerate(cache.states):
                state = _mixer_state(state)
                if state is not None:  # not a hybrid's attention or MLP layer
                    recorder.observe(layer, "ssm_state", state.ssm)
    return recorder.results()


@torch.no_grad()
def calibrate_images(model, images: torch.Tensor, observers: dict[str, ObserverSpec] | None = None,
                     batch_size: int = 8, progress: bool = True) -> dict[int, dict[str, float]]:
    """Clipping ranges ``{layer: {kind: range}}`` of a Vision Mamba classifier over ``images``
    [n, C, H, W] (normalized as the model expects): the forward kinds of ``calibrate`` but the SSM
    state (a bidirectional model keeps none), and the backward branch's (BACKWARD_KINDS)."""
    if not isinstance(images, torch.Tensor) or images.dim() != 4 or not images.is_floating_point():
        raise CalibrationError("calibration images must be a float tensor [num_images, C, H, W]")
    if images.shape[0] == 0:
        raise CalibrationError("there are no calibration images")
    if not torch.isfinite(images).all():
        raise CalibrationError("calibration images hold NaN or infinite values")
    _check_batch_size(batch_size)
    recorder = _Recorder(_observer_specs(observers), num_samples=images.shape[0])
    parameter = next(model.parameters())
    batches = range(0, images.shape[0], batch_size)
    with _observing(model, recorder):
        for start in tqdm(batches, desc="calibrating", unit="batch", disable=not progress):
            model(images[start:start + batch_size].to(parameter.device, parameter.dtype))
    return recorder.results()


def _mixer_state(state) -> MixerState | None:
    """A block's SSM decode state: its own, that of Falcon-H1's parallel mixer (the pair
    (MixerState, AttentionState)) or of Zamba2's hybrid layer (HybridState), or None (a hybrid's
    attention, MLP or MoE)."""
    if isinstance(state, tuple):
        state = state[0]
    if isinstance(state, HybridState):
        state = state.mixer
    return state if isinstance(state, MixerState) else None


def _check_batch_size(batch_size) -> None:
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
        raise CalibrationError(f"batch_size must be a positive integer, got {batch_size!r}")


def _calibration_tokens(calib) -> torch.Tensor:
    tokens = calib.tokens if isinstance(calib, CalibrationSet) else calib
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        raise CalibrationError("calibration tokens must be an integer tensor [num_samples, seqlen]")
    if tokens.numel() == 0:
        raise CalibrationError(f"calibration tokens are empty (shape {tuple(tokens.shape)})")
    return tokens


def _observer_specs(overrides) -> dict[str, ObserverSpec]:
    known = TENSOR_KINDS + MAMBA2_KINDS + (HEAD_KIND,)
    unknown = set(overrides or {}) - set(known)
    if unknown:
        raise CalibrationError(f"unknown tensor kind(s) {sorted(unknown)}; known: {list(known)}")
    return {**DEFAULT_OBSERVERS, **MAMBA2_OBSERVERS, HEAD_KIND: _ABSMAX, **(overrides or {})}


class _Recorder:
    """One observer per (layer, kind), made at the kind's first batch, when the total element
    count it will see is known (per-sample count × number of samples): percentile observers
    need it to be exact."""

    def __init__(self, specs: dict[str, ObserverSpec], num_samples: int):
        self.specs = specs
        self.num_samples = num_samples
        self.observers = {}

    def observe(self, layer: int, kind: str, tensor: torch.Tensor) -> None:
        key = (layer, kind)
        if kind in CHANNEL_KINDS:
            self.observers.setdefault(key, ChannelAbsMaxObserver(f"layer {layer} {kind}"))
        elif key not in self.observers:
            per_sample = tensor.numel() // tensor.shape[0]
            spec = self.specs.get(base_kind(kind), _ABSMAX)  # a hybrid's linears: absmax
            self.observers[key] = make_observer(spec, f"layer {layer} {kind}",
                                                expected_numel=per_sample * self.num_samples)
        self.observers[key].update(tensor)

    def results(self) -> dict[int, dict[str, float]]:
        layers = sorted({layer for layer, _ in self.observers},
                        key=lambda layer: (layer == HEAD_LAYER, 0 if layer == HEAD_LAYER else layer))
        known = TENSOR_KINDS + MAMBA2_KINDS + BACKWARD_KINDS + CHANNEL_KINDS + (HEAD_KIND,)
        others = sorted({kind for _, kind in self.observers} - set(known))  # hybrids' linears
        return {layer: {kind: self.observers[layer, kind].result()
                        for kind in known + tuple(others) if (layer, kind) in self.observers}
                for layer in layers}


@contextmanager
def _observing(model, recorder: _Recorder):
    """Forward hooks on every mixer's in_proj, x_proj and out_proj, removed on exit (also on
    error)."""
    handles = []
    try:
        for layer, mixer in enumerate(model.mixers()):
            if isinstance(mixer, TRANSFORMER_LAYERS):
                handles += _linear_input_hooks(recorder, layer, mixer)
                continue
            if isinstance(mixer, ParallelMixer):
                handles += _parallel_hooks(recorder, layer, mixer)
                continue
            if isinstance(mixer, Mamba2Mixer):
                handles += _mamba2_hooks(recorder, layer, mixer)
                continue
            handles += [
                mixer.in_proj.register_forward_hook(_in_proj_hook(recorder, layer)),
                mixer.x_proj.register_forward_hook(_x_proj_hook(recorder, layer, mixer,
                                                                mixer.dt_proj)),
                mixer.out_proj.register_forward_hook(_out_proj_hook(recorder, layer)),
            ]
            if hasattr(mixer, "x_proj_b"):  # the backward branch of a bidirectional mixer
                handles.append(mixer.x_proj_b.register_forward_hook(
                    _x_proj_hook(recorder, layer, mixer, mixer.dt_proj_b, "_b")))
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _observing_head(model, recorder: _Recorder, enabled: bool):
    """With ``enabled``, a forward hook on the last block that observes the final norm of its
    output for every token (the model applies the norm to the last tokens only)."""
    if not enabled:
        yield
        return
    def hook(module, inputs, output):
        normed, _ = model.backbone.norm_f(*output)
        recorder.observe(HEAD_LAYER, HEAD_KIND, normed)
    handle = model.backbone.layers[-1].register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _linear_input_hooks(recorder: _Recorder, layer: int, mixer) -> list:
    """Forward pre-hooks on a hybrid's attention, MLP or MoE layer: its normed input as
    "in_proj.input" and each quantized linear's input as "<name>.input" (an expert's, over the
    tokens routed to it; a router's is not observed)."""
    handles = [mixer.register_forward_pre_hook(_input_observer(recorder, layer, "in_proj.input"))]
    return handles + _linears_hooks(recorder, layer, mixer)


def _input_observer(recorder: _Recorder, layer: int, kind: str):
    return lambda module, inputs: recorder.observe(layer, kind, inputs[0])


def _linears_hooks(recorder: _Recorder, layer: int, mixer) -> list:
    """Forward pre-hooks observing each quantized linear's input of ``mixer`` as
    "<name>.input"."""
    return [module.register_forward_pre_hook(_input_observer(recorder, layer, f"{name}.input"))
            for name, module in quantized_linears(mixer)]


def _mamba2_hooks(recorder: _Recorder, layer: int, mixer: Mamba2Mixer) -> list:
    return [mixer.in_proj.register_forward_hook(_mamba2_in_proj_hook(recorder, layer, mixer)),
            mixer.out_proj.register_forward_hook(_out_proj_hook(recorder, layer))]


def _parallel_hooks(recorder: _Recorder, layer: int, mixer: ParallelMixer) -> list:
    """Falcon-H1's parallel mixer: its Mamba2 mixer's kinds, whose "in_proj.input" is the normed
    input that its attention reads too (observed once), and its attention's linears' inputs
    ("o_proj.input" ...)."""
    return _mamba2_hooks(recorder, layer, mixer.mamba) + _linears_hooks(recorder, layer,
                                                                         mixer.self_attn)


@contextmanager
def _observing_shared_blocks(model, recorder: _Recorder):
    """Forward pre-hooks on Zamba2's shared blocks (a layer's ``shared``) and the layers that use
    them, removed on exit: each distinct input of a block's quantized linears observed as
    SHARED_PREFIX + its kind under the layer running the block (a pre-hook on each such layer
    says which: a block is hooked once and runs at several depths), and the layer's own linear's
    input."""
    using = {}  # "layer": the layer whose shared block runs now

    def enter(layer):
        return lambda module, inputs: using.update(layer=layer)

    def observer(kind, layer=None):
        def hook(module, inputs):
            recorder.observe(using["layer"] if layer is None else layer, kind, inputs[0])
        return hook

    handles, hooked = [], set()
    try:
        for layer, block in enumerate(model.backbone.layers):
            shared = getattr(block, "shared", None)
            if shared is None:
                continue
            handles += [block.register_forward_pre_hook(enter(layer)),
                        block.linear.register_forward_pre_hook(observer("linear.input", layer))]
            if id(shared) in hooked:
                continue
            hooked.add(id(shared))
            kinds = {}  # kind → the first linear reading it (q_proj for q, k and v)
            for name, module in quantized_linears(shared):
                kinds.setdefault(SHARED_PREFIX + input_kind(name), module)
            handles += [module.register_forward_pre_hook(observer(kind))
                        for kind, module in kinds.items()]
        yield
    finally:
        for handle in handles:
            handle.remove()


def _in_proj_hook(recorder: _Recorder, layer: int):
    def hook(module, inputs, output):
        recorder.observe(layer, "in_proj.input", inputs[0])
        recorder.observe(layer, "in_proj.output", output)
    return hook


def _mamba2_in_proj_hook(recorder: _Recorder, layer: int, mixer: Mamba2Mixer):
    """Observes in_proj's input, its output by segment (z, x, B, C, dt) and the conv output (x per
    channel, B and C per state group). The mixer runs the conv as an op, not a module, so the
    hook recomputes it from in_proj's output (a whole prefill: calibration runs no decode)."""
    def hook(module, inputs, output):
        recorder.observe(layer, "in_proj.input", inputs[0])
        z, xbc, dt = mixer.split_in_proj(output)
        recorder.observe(layer, "z", z)
        recorder.observe(layer, "dt", dt)
        for kind, part in zip(("x_in", "B_in", "C_in"), mixer.split_xbc(xbc)):
            recorder.observe(layer, kind, part)
        conv_out = causal_conv1d(xbc.transpose(1, 2), mixer.conv1d.weight.squeeze(1),
                                 mixer.conv1d.bias).transpose(1, 2)
        x, B, C = mixer.split_xbc(conv_out)
        recorder.observe(layer, "x", x)
        for kind, part in (("B", B), ("C", C)):
            recorder.observe(layer, kind, part.unflatten(-1, (mixer.ngroups, -1)).abs().amax(-1))
    return hook


def _x_proj_hook(recorder: _Recorder, layer: int, mixer, dt_proj, suffix: str = ""):
    """Observes x_proj's input and output, and dt: the mixer computes dt = dt_low @ dt_proj.weight.T
    with F.linear (no module call, the bias is added in the scan), so it is recomputed here the
    same way. x_proj's output is observed as the mixer's SSM reads it: dt_low, B and C normalized
    where the model has their norms (Falcon-Mamba; Jamba's times their weights). ``suffix`` "_b"
    names a backward branch's kinds."""
    def hook(module, inputs, output):
        recorder.observe(layer, f"x_proj{suffix}.input", inputs[0])
        if mixer.mixer_rms_eps is None:
            x_dbl = output
        else:
            x_dbl = torch.cat(mixer.split_x_dbl(output), dim=-1)
        recorder.observe(layer, f"x_proj{suffix}.output", x_dbl)
        dt_low = x_dbl[..., :mixer.dt_rank]
        recorder.observe(layer, f"dt_proj{suffix}.output", F.linear(dt_low, dt_proj.weight))
    return hook


def _out_proj_hook(recorder: _Recorder, layer: int):
    def hook(module, inputs, output):
        recorder.observe(layer, "out_proj.input", inputs[0])
    return hook
