"""Per-call constants of the kernel launchers (scale tables, dequantized parameters, per-channel
multipliers), built once per version of the tensor they come from instead of in every call
(small kernels per layer and decode step). Not kept for an inference tensor (no version counter)
nor while a CUDA graph is being captured (its kernels run only at replay, so a tensor made then
holds its values only while that graph replays)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils.weak import WeakIdKeyDictionary

_CONSTANTS = WeakIdKeyDictionary()


def keeps_constants(device: torch.device) -> bool:
    """Whether a constant made now on ``device`` may be kept (no CUDA-graph capture under way)."""
    return not (device.type == "cuda" and torch.cuda.is_current_stream_capturing())


def cached(anchor: torch.Tensor, key: tuple, make: Callable[[], object]):
    """``make()``, kept per (``anchor``, ``key``) until ``anchor`` changes (several views of one
    buffer each keep theirs)."""
    if anchor.is_inference() or not keeps_constants(anchor.device):
        return make()
    entries = _CONSTANTS.setdefault(anchor, {})
    version, value = entries.get(key, (None, None))
    if version != anchor._version:
        value = make()
        entries[key] = (anchor._version, value)
    return value
