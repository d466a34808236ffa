"""QuantConfig: the plain, serialisable description of a quantization recipe."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from quamba.errors import QuambaError
from quamba.layers.modes import (FP_MODE, STATE_CACHE_FORMATS, check_mode,
                                 check_weight_only_mode)

# Tensor kinds observed per layer during calibration (see quamba.calibrate.calibrate).
PERCENTILE_KINDS = ("x_proj.input", "ssm_state")
SUPPORTED_BITS = {(8, 8), (4, 8), (4, 16)}

# Fields that change how a run executes but not what the quantized model holds.
_RUNTIME_FIELDS = ("ssm_mode", "backend", "calib_batch_size", "state_cache")
# Fields of the activation calibration, which weight-only recipes do not run.
_CALIBRATION_FIELDS = ("percentile_alpha", "observers", "calib_source", "calib_num_samples",
                       "calib_seqlen", "learn_scales", "learn_steps", "learn_lr",
                       "learn_num_samples", "learn_batch_size", "learn_weight_clipping")
# Fields of the learned-scales pass, part of a recipe only when it runs.
_LEARN_FIELDS = ("learn_steps", "learn_lr", "learn_num_samples", "learn_batch_size",
                 "learn_weight_clipping")


@dataclass
class QuantConfig:
    """Quamba recipe (defaults as the W8A8 paper); W4A8 quantizes in_proj, x_proj and out_proj
    to 4-bit groups of ``group_size`` (quamba.ops.quant4) and keeps the rest as W8A8. W4A16
    (weight-only, ``a_bits=16``) quantizes the same three weights to 4 bits with fp16 group
    scales and leaves everything else in the float dtype: no activation calibration, and the
    calibration fields are not part of its recipe.

    hadamard: rotate the residual stream (None = the recipe's default: on for 8-bit
      activations, off for W4A16). ssm_mode: None = int8 for 8-bit activations, fp16 (the only
      mode) for W4A16.

    percentile_alpha: α of the percentile observer used for the SSM input u and the SSM state
      (None = absmax for them too: the naive recipe). ``observers`` overrides any tensor kind:
      {"kind": "absmax"} or {"kind": α as float}.

    lm_head: "fp16" (the float head, tied to the embedding where the model ties them), "int8"
      (W8A8 with per-output-channel weight scales; needs 8-bit activations) or "int4" (W4A16 in
      groups of ``group_size``); quamba.layers.qhead. quantize_embedding: int8 embedding rows with
      per-row scales. Both off by default: the float head and embedding of format ≤ 4.

    state_cache: the decode SSM state of the int8 mixers, "int8" (Quamba: per-tensor calibrated
      ``state_scale``, requantized every step) or "fp32" (the prefill's last state and every
      decode step kept in fp32; 4× the memory). A runtime choice: no weight depends on it.

    learn_scales: refine the calibrated activation ranges of each Mamba1 block by minimizing its
      output error against the FP block (quamba.quantization.learn_scales): Adam with learning
      rate ``learn_lr`` on log(range), ``learn_steps`` minibatches of ``learn_batch_size`` of the
      first ``learn_num_samples`` calibration samples. 8-bit activations only.
      learn_weight_clipping: with learn_scales, a W4A8 recipe with round-to-nearest weights (no
      GPTQ, no mixed precision) also learns a clipping bound per output channel and group of its
      4-bit weights (a fraction of the group's absmax), with the same loss and optimizer.
    """

    w_bits: int = 8
    a_bits: int = 8
    group_size: int = 128  # 4-bit weights: input channels per scale group
    hadamard: bool | None = None
    ssm_mode: str | None = None
    percentile_alpha: float | None = 0.9995
    observers: dict = field(default_factory=dict)
    calib_source: str = "monology/pile-uncopyrighted"
    calib_num_samples: int = 512
    calib_seqlen: int = 512
    calib_batch_size: int = 8
    learn_scales: bool = False
    learn_steps: int = 200
    learn_lr: float = 0.01
    learn_num_samples: int = 128
    learn_batch_size: int = 4
    learn_weight_clipping: bool = False
    seed: int = 0
    backend: str | None = None
    # GPTQ for 4-bit weights (Quamba2): Hessians from gptq_num_samples × gptq_seqlen tokens
    apply_gptq: bool = False
    gptq_source: str = "wikitext:wikitext-2-raw-v1:train"
    gptq_num_samples: int = 128
    gptq_seqlen: int = 1024
    gptq_layers: tuple = ("in_proj", "out_proj")
    gptq_damp: float = 0.01
    gptq_block_size: int = 128
    gptq_act_order: bool = False
    # Per-layer mixed precision (Quamba2's W4AX), W4A8 recipes only: the fraction of layers, the
    # most sensitive ones by measurement, that run W4A16 instead (quamba.quantization.mixed).
    mixed_precision: float | None = None
    # (w_bits, a_bits) of each layer: set by quantize() from mixed_precision, or given; None:
    # every layer takes (w_bits, a_bits).
    layer_bits: tuple | None = None
    lm_head: str = "fp16"
    quantize_embedding: bool = False
    state_cache: str = "int8"

    def __post_init__(self):
        if (self.w_bits, self.a_bits) not in SUPPORTED_BITS:
            raise QuambaError(f"w_bits={self.w_bits} a_bits={self.a_bits} is not supported; "
                              f"supported: {', '.join(f'W{w}A{a}' for w, a in sorted(SUPPORTED_BITS))}")
        self._resolve_defaults()
        alpha = self.percentile_alpha
        if alpha is not None and not 0.5 < alpha <= 1.0:
            raise QuambaError(f"percentile_alpha must be in (0.5, 1], got {alpha}")
        if self.apply_gptq and self.w_bits != 4:
            raise QuambaError("GPTQ applies to 4-bit weights; use it with w_bits=4")
        unknown = set(self.gptq_layers) - {"in_proj", "x_proj", "out_proj"}
        if unknown:
            raise QuambaError(f"gptq_layers may name in_proj, x_proj and out_proj, not {sorted(unknown)}")
        self.gptq_layers = tuple(self.gptq_layers)  # JSON round trips give lists
        self._check_mixed_precision()
        self._check_head_and_state()
        if self.learn_scales and self.weight_only:
            raise QuambaError("learn_scales learns activation scales; a W4A16 recipe has none "
                              "(use a_bits=8)")
        self._check_weight_clipping()
        if not self.learn_lr > 0:
            raise QuambaError(f"learn_lr must be positive, got {self.learn_lr}")
        for kind in ("calib_num_samples", "calib_seqlen", "calib_batch_size", "group_size",
                     "gptq_num_samples", "gptq_seqlen", "gptq_block_size", "learn_steps",
                     "learn_num_samples", "learn_batch_size"):
            if getattr(self, kind) <= 0:
                raise QuambaError(f"{kind} must be positive, got {getattr(self, kind)}")

    def _check_weight_clipping(self) -> None:
        if not self.learn_weight_clipping:
            return
        if not self.learn_scales:
            raise QuambaError("learn_weight_clipping is part of the learned-scales pass; set "
                              "learn_scales too")
        if (self.w_bits, self.a_bits) != (4, 8):
            raise QuambaError("learn_weight_clipping learns the clipping of 4-bit weights; use it "
                              "with w_bits=4 a_bits=8")
        if self.apply_gptq or self.mixed_precision is not None:
            raise QuambaError("learn_weight_clipping clips round-to-nearest W4A8 weights; it does "
                              "not combine with GPTQ or mixed precision")

    def _check_mixed_precision(self) -> None:
        fraction = self.mixed_precision
        if fraction is not None:
            if (self.w_bits, self.a_bits) != (4, 8):
                raise QuambaError("mixed precision chooses W4A16 layers in a W4A8 model; use it "
                                  "with w_bits=4 a_bits=8")
            if not 0.0 <= fraction <= 1.0:
                raise QuambaError(f"mixed_precision is a fraction of the layers in [0, 1], got {fraction}")
        if self.layer_bits is None:
            return
        self.layer_bits = tuple(tuple(bits) for bits in self.layer_bits)
        for bits in set(self.layer_bits):
            if bits not in SUPPORTED_BITS:
                raise QuambaError(f"layer_bits holds {bits}; each layer takes one of "
                                  f"{sorted(SUPPORTED_BITS)}")
        if self.weight_only and any(a == 8 for _, a in self.layer_bits):
            raise QuambaError("a W4A16 recipe calibrates no activations; layers with 8-bit "
                              "activations need a_bits=8")

    def _check_head_and_state(self) -> None:
        from quamba.layers.qhead import LM_HEAD_FORMATS
        if self.lm_head not in LM_HEAD_FORMATS:
            raise QuambaError(f"lm_head must be one of {', '.join(LM_HEAD_FORMATS)}, got {self.lm_head!r}")
        if self.lm_head == "int8" and self.weight_only:
            raise QuambaError("an int8 lm_head quantizes its input with a calibrated scale, which a "
                              "W4A16 recipe does not calibrate; use lm_head int4 (weight-only)")
        if not isinstance(self.quantize_embedding, bool):
            raise QuambaError(f"quantize_embedding must be true or false, got {self.quantize_embedding!r}")
        if self.state_cache not in STATE_CACHE_FORMATS:
            raise QuambaError(f"state_cache must be one of {', '.join(STATE_CACHE_FORMATS)}, got "
                              f"{self.state_cache!r}")

    def bits_of(self, layer: int) -> tuple[int, int]:
        """(w_bits, a_bits) of layer ``layer``."""
        return (self.w_bits, self.a_bits) if self.layer_bits is None else self.layer_bits[layer]

    def _resolve_defaults(self) -> None:
        """Fill hadamard and ssm_mode left at None with the recipe's defaults; check the mode."""
        if self.hadamard is None:
            self.hadamard = not self.weight_only
        if self.ssm_mode is None:
            self.ssm_mode = FP_MODE if self.weight_only else "int8"
        if self.weight_only:
            check_weight_only_mode(self.ssm_mode)
        else:
            check_mode(self.ssm_mode)

    @property
    def weight_only(self) -> bool:
        """True for W4A16: activations stay in the float dtype."""
        return self.a_bits == 16

    def observer_specs(self) -> dict:
        """ObserverSpec per tensor kind for quamba.calibrate.calibrate (none for W4A16)."""
        from quamba.calibrate import DEFAULT_OBSERVERS, ObserverSpec
        if self.weight_only:
            return {}
        specs = {}
        for kind in DEFAULT_OBSERVERS:
            choice = self.observers.get(kind)
            if choice is None and kind in PERCENTILE_KINDS:
                choice = self.percentile_alpha
            if choice is None or choice == "absmax" or choice == 1.0:
                specs[kind] = ObserverSpec(kind="absmax")
            else:
                specs[kind] = ObserverSpec(kind="percentile", alpha=float(choice))
        return specs

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, values: dict) -> "QuantConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    def recipe(self) -> dict:
        """The fields that determine the quantized weights and scales (not how they are run)."""
        ignored = _RUNTIME_FIELDS + (_CALIBRATION_FIELDS if self.weight_only else ())
        if not self.learn_scales:
            ignored += _LEARN_FIELDS
        if self.mixed_precision is not None:  # the layers follow from it and the calibration data
            ignored += ("layer_bits",)
        return {k: v for k, v in self.to_dict().items() if k not in ignored}

    def same_recipe(self, other: "QuantConfig") -> bool:
        return self.recipe() == other.recipe()
