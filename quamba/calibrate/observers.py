"""Observers: they see a tensor kind batch after batch and give its clipping range (the value
that the int8 quantizer maps to 127).

Both observers work on |x| in fp32 and raise :class:`CalibrationError` naming the tensor when a
batch holds NaN or inf. Their results depend only on the multiset of values seen, never on how
it was split into batches.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch

from quamba.calibrate.errors import CalibrationError

OBSERVER_KINDS = ("absmax", "percentile")
_MIN_KEEP = 1024  # floor on the values a percentile observer keeps beyond what it needs


@dataclass(frozen=True)
class ObserverSpec:
    """Which observer a tensor kind gets; ``alpha`` is used by ``percentile`` only."""

    kind: str = "absmax"
    alpha: float = 0.9995

    def __post_init__(self):
        if self.kind not in OBSERVER_KINDS:
            raise CalibrationError(f"unknown observer kind {self.kind!r}; use one of {OBSERVER_KINDS}")
        if not 0 < self.alpha <= 1:
            raise CalibrationError(f"percentile alpha must lie in (0, 1], got {self.alpha!r}")


def make_observer(spec: ObserverSpec, name: str, expected_numel: int = 0):
    """An observer for ``spec``; ``name`` (e.g. "layer 3 x_proj.input") goes into its errors.
    ``expected_numel`` (the total it will see, if known) makes a percentile exact by design."""
    if spec.kind == "absmax":
        return AbsMaxObserver(name)
    return PercentileObserver(spec.alpha, name, expected_numel)


class AbsMaxObserver:
    """max |x| over everything seen."""

    def __init__(self, name: str = "tensor"):
        self.name = name
        self.absmax = None

    def update(self, tensor: torch.Tensor) -> None:
        magnitudes = finite_magnitudes(tensor, self.name)
        if magnitudes.numel() == 0:
            return
        batch_max = magnitudes.max()
        self.absmax = batch_max if self.absmax is None else torch.maximum(self.absmax, batch_max)

    def result(self) -> float:
        if self.absmax is None:
            raise CalibrationError(f"observer of {self.name} saw no data")
        return float(self.absmax)


class ChannelAbsMaxObserver:
    """max |x| per channel (the last dim) over everything seen: an fp32 tensor [channels]."""

    def __init__(self, name: str = "tensor"):
        self.name = name
        self.absmax = None

    def update(self, tensor: torch.Tensor) -> None:
        magnitudes = finite_magnitudes(tensor, self.name)  # flattened in order: channels last
        batch_max = magnitudes.view(-1, tensor.shape[-1]).amax(dim=0)
        self.absmax = batch_max if self.absmax is None else torch.maximum(self.absmax, batch_max)

    def result(self) -> torch.Tensor:
        if self.absmax is None:
            raise CalibrationError(f"observer of {self.name} saw no data")
        return self.absmax.cpu()


class PercentileObserver:
    """The α-percentile of |x| over all elements seen, exact.

    Definition: with n elements seen, the result is the k-th smallest |x| (1-based) for
    k = max(1, ceil(α·n)), i.e. the smallest observed |x| that at least a fraction α of all
    observed |x| do not exceed. This is ``numpy.quantile(|x|, α, method="inverted_cdf")`` and
    ``torch.kthvalue(|x|, k)``; no interpolation. α·n is computed exactly with α taken as the
    decimal it is written as (0.9995 is 9995/10000, not its binary neighbour).

    Memory: the result is the r-th largest |x| with r = n - k + 1 ≈ (1 - α)·n, so the observer
    keeps only the largest values, merging each batch's top values into them (torch.quantile,
    which the public implementation used, refuses inputs above ~16M elements). Exact selection
    in one pass needs to know n in advance: a value dropped early can be needed later when the
    later data are smaller. With ``expected_numel`` (the total, known to :func:`calibrate`) the
    observer keeps the r largest for that total and is exact by construction for any count up to
    it. Without it (or past it) it keeps twice the current r plus 1024, and ``result`` checks that
    nothing dropped exceeds the answer, raising instead of returning an inexact value.
    """

    def __init__(self, alpha: float = 0.9995, name: str = "tensor", expected_numel: int = 0):
        ObserverSpec("percentile", alpha)  # validates alpha
        self.alpha = Fraction(repr(float(alpha)))
        self.name = name
        self.expected_numel = expected_numel
        self.count = 0
        self.largest = None  # the kept largest |x|, in descending order
        self.max_dropped = None  # the largest |x| not kept, if any was dropped

    def update(self, tensor: torch.Tensor) -> None:
        magnitudes = finite_magnitudes(tensor, self.name)
        if magnitudes.numel() == 0:
            return
        self.count += magnitudes.numel()
        keep = self._capacity()
        candidates = magnitudes if self.largest is None else torch.cat(
            [self.largest, _top(magnitudes, keep + 1)])
        top = _top(candidates, keep + 1)
        if top.numel() > keep:
            dropped = top[keep]
            self.max_dropped = dropped if self.max_dropped is None else torch.maximum(
                self.max_dropped, dropped)
            top = top[:keep]
        self.largest = top

    def result(self) -> float:
        if self.count == 0:
            raise CalibrationError(f"observer of {self.name} saw no data")
        value = self.largest[rank_from_top(self.alpha, self.count) - 1]
        if self.max_dropped is not None and value < self.max_dropped:
            raise CalibrationError(
                f"the {float(self.alpha)} percentile of {self.name} cannot be computed exactly: "
                f"pass expected_numel (the total element count, {self.count} here) to the observer")
        return float(value)

    def _capacity(self) -> int:
        if self.count <= self.expected_numel:
            return rank_from_top(self.alpha, self.expected_numel)
        return 2 * rank_from_top(self.alpha, self.count) + _MIN_KEEP


def rank_from_top(alpha: Fraction, count: int) -> int:
    """r such that the r-th largest of ``count`` values is the α-percentile defined above."""
    k = max(1, math.ceil(alpha * count))
    return count - k + 1


def finite_magnitudes(tensor: torch.Tensor, name: str) -> torch.Tensor:
    """|tensor| flattened in fp32; raises if it holds NaN or inf (max propagates NaN)."""
    magnitudes = tensor.detach().float().abs().flatten()
    if magnitudes.numel():
        peak = magnitudes.max()
        if not torch.isfinite(peak):
            what = "NaN" if torch.isnan(peak) else "inf"
            raise CalibrationError(f"{what} in {name} during calibration: the model's activations "
                                   "are not finite")
    return magnitudes


def _top(values: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(values, min(k, values.numel()), sorted=True).values
