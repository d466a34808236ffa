"""Per-call constants of the kernel launchers (scale tables, per-channel multipliers, dequantized
parameters), built once per version of the tensor they come from instead of in every call (small
kernels per layer and decode step). Not kept for an inference tensor (no version counter).

During a CUDA-graph capture a constant kept from before is served as it is, so the graph reads it
instead of replaying the kernels that made it (a Mamba2 prefill graph otherwise replays several
such kernels per layer). One made during a capture is not kept: its kernels run only at replay, so it
holds its values only while that graph replays. A graph bakes the scales its launchers passed as
numbers into its kernels anyway, so after an in-place change of a scale it is stale either way and
must be captured again; until then the constants it read stay alive.

A kernel's scratch (:func:`workspace`) is kept per tensor too, an inference tensor's included (it
follows no version), and not when made during a capture."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

from quamba.ops.quant import fp32_reciprocal

_CONSTANTS = WeakIdKeyDictionary()
_WORKSPACES = WeakIdKeyDictionary()
# Constants that a CUDA-graph capture read and that their cache has since replaced: the graph's
# kernels still read their memory at every replay.
_READ_BY_GRAPHS: list = []


@dataclass
class _Entry:
    version: int
    value: object
    captured: bool = False


def keeps_constants(device: torch.device) -> bool:
    """Whether a constant made now on ``device`` may be kept (no CUDA-graph capture under way)."""
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def cached(anchor: torch.Tensor, key: tuple, make: Callable[[], object]):
    """``make()``, kept per (``anchor``, ``key``) until ``anchor`` changes (several views of one
    buffer each keep theirs)."""
    if anchor.is_inference():
        return make()
    entries = _CONSTANTS.setdefault(anchor, {})
    entry = entries.get(key)
    capturing = not keeps_constants(anchor.device)
    if entry is not None and entry.version == anchor._version:
        entry.captured |= capturing
        return entry.value
    # made with inference mode off: a kept inference tensor could never anchor constants of its own
    with torch.inference_mode(False):
        value = make()
    if capturing:
        return value
    if entry is not None and entry.captured:
        _READ_BY_GRAPHS.append(entry.value)
    entries[key] = _Entry(anchor._version, value)
    return value


def workspace(anchor: torch.Tensor, words_op: str) -> torch.Tensor:
    """A kernel's scratch, int32 [``torch.ops.quamba.<words_op>()``] and zero when made, kept per
    ``anchor`` (an SSM state tensor: one per layer and cache) and kernel (the op that sizes it).
    One made during a CUDA-graph capture is not kept (its zeroing runs at every replay)."""
    kept = _WORKSPACES.setdefault(anchor, {})
    scratch = kept.get(words_op)
    if scratch is None:
        words = getattr(torch.ops.quamba, words_op)()
        scratch = torch.zeros(words, dtype=torch.int32, device=anchor.device)
        if keeps_constants(anchor.device):
            kept[words_op] = scratch
    return scratch


def scale_float(value) -> float | None:
    """A scale as a hashable Python float for a kernel's launch (0-d tensors are read once)."""
    return None if value is None else float(value)


def reciprocal_or_none(scale) -> float | None:
    """The fp32 reciprocal of an optional output scale, as the kernels take it."""
    return None if scale is None else fp32_reciprocal(scale_float(scale))
