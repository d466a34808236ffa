"""Which model a run evaluates: an FP model, a freshly quantized one, or a saved quantized one.

Shared by main.py and the lm-eval adapter, so both resolve names the same way. ``model`` is
first looked up as a directory under ``pretrained_dir`` (e.g. quamba-mamba-130m-w8a8), else
taken as a local directory or Hub id. Without ``quantize`` it is loaded as it is: FP, or
quantized when it is a quantized checkpoint. With ``quantize`` an FP model is quantized and, when
``pretrained_dir`` is given, saved there as :func:`saved_model_name`; a model saved there earlier
is reused only when its recorded recipe equals the requested one, otherwise it is re-quantized
(with a warning saying why).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

from quamba.errors import ModelNotFoundError, QuambaError
from quamba.utils.io import check_directory_target

log = logging.getLogger("quamba")

FP_MODE = "fp16"  # the SSM mode name of the unquantized model


@dataclass
class ModelRequest:
    """What a run asks for. ``None`` leaves a choice to the defaults: device cuda when present,
    fp16 on cuda and fp32 on cpu, SSM mode and Hadamard rotation the recipe's (QuantConfig) for a
    fresh quantization or the recorded ones of a saved model, QuantConfig's calibration source."""

    model: str
    quantize: bool = False
    w_bits: int = 8
    a_bits: int = 8
    group_size: int = 128
    apply_gptq: bool = False
    gptq_source: str | None = None
    gptq_num_samples: int = 128
    gptq_seqlen: int = 1024
    act_order: bool = False
    hadamard: bool | None = None
    mixed_precision: float | None = None
    ssm_mode: str | None = None
    lm_head: str = "fp16"
    quantize_embedding: bool = False
    state_cache: str | None = None  # None: the recorded one of a saved model, else int8
    percentile_alpha: float | None = 0.9995
    learn_scales: bool = False
    learn_steps: int = 200
    learn_weight_clipping: bool = False
    calib_source: str | None = None
    calib_num_samples: int = 512
    calib_seqlen: int = 512
    seed: int = 0
    pretrained_dir: str | None = None
    device: str | None = None
    dtype: str | None = None
    tokenizer: str | None = None
    backend: str | None = None

    def quant_config(self):
        from quamba import QuantConfig
        optional = {"calib_source": self.calib_source} if self.calib_source else {}
        if self.gptq_source:
            optional["gptq_source"] = self.gptq_source
        return QuantConfig(w_bits=self.w_bits, a_bits=self.a_bits, group_size=self.group_size,
                           apply_gptq=self.apply_gptq, gptq_num_samples=self.gptq_num_samples,
                           gptq_seqlen=self.gptq_seqlen, gptq_act_order=self.act_order,
                           hadamard=self.hadamard, mixed_precision=self.mixed_precision,
                           ssm_mode=self.ssm_mode, percentile_alpha=self.percentile_alpha,
                           learn_scales=self.learn_scales, learn_steps=self.learn_steps,
                           learn_weight_clipping=self.learn_weight_clipping,
                           calib_num_samples=self.calib_num_samples, calib_seqlen=self.calib_seqlen,
                           seed=self.seed, backend=self.backend, lm_head=self.lm_head,
                           quantize_embedding=self.quantize_embedding,
                           state_cache=self.state_cache or "int8", **optional)


@dataclass
class PreparedModel:
    model: torch.nn.Module
    tokenizer: object
    name: str
    layout: str
    device: str
    backend: str
    how: str  # "loaded", "quantized" or "reused saved quantized model"
    saved_to: str | None = None
    details: dict = field(default_factory=dict)

    @property
    def quant_config(self):
        return getattr(self.model, "quant_config", None)

    @property
    def ssm_mode(self) -> str:
        return getattr(self.model, "ssm_mode", FP_MODE)

    @property
    def dtype(self) -> str:
        dtype = getattr(self.model, "dtype", None) or self.model.backbone.embedding.weight.dtype
        return str(dtype).replace("torch.", "")

    def summary(self) -> str:
        """The one line a run logs at its start."""
        qcfg = self.quant_config
        if qcfg is None:
            bits = "unquantized"
        else:
            bits = f"W{qcfg.w_bits}A{qcfg.a_bits} ({'hadamard' if qcfg.hadamard else 'no hadamard'})"
        return (f"model {self.name} ({self.layout} layout, {self.how}): {bits}, "
                f"SSM mode {self.ssm_mode}, backend {self.backend}, {self.dtype} on {self.device}")

    def to_dict(self) -> dict:
        qcfg = self.quant_config
        return {"name": self.name, "layout": self.layout, "how": self.how, "device": self.device,
                "dtype": self.dtype, "backend": self.backend, "ssm_mode": self.ssm_mode,
                "saved_to": self.saved_to, "quant_config": qcfg.to_dict() if qcfg else None,
                "calibration": getattr(self.model, "calibration", None) or None}


def saved_model_name(model: str, w_bits: int, a_bits: int, mixed_precision: float | None = None,
                     lm_head: str = "fp16", quantize_embedding: bool = False,
                     learn_scales: bool = False, learn_weight_clipping: bool = False) -> str:
    """``quamba-<model basename>-w<W>a<A>`` (``-mixed<fraction>`` for per-layer mixed precision,
    ``-head<format>`` for a quantized lm_head, ``-emb8`` for the int8 embedding, ``-learned`` for
    learned scales, ``-learned-clip`` with learned weight clipping too): the name a quantized
    model is saved under."""
    basename = Path(str(model).rstrip("/")).name
    mixed = "" if mixed_precision is None else f"-mixed{mixed_precision:g}"
    ends = ("" if lm_head == "fp16" else f"-head{lm_head}") + ("-emb8" if quantize_embedding else "")
    learned = ("-learned" if learn_scales else "") + ("-clip" if learn_weight_clipping else "")
    return f"quamba-{basename}-w{w_bits}a{a_bits}{mixed}{ends}{learned}"


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """``device`` (None: :func:`default_device`) when this torch can use it, else a QuambaError
    saying what is there: checked before anything is loaded, so that a missing GPU is one line
    and not a traceback from the middle of loading or calibrating."""
    if device is None:
        return default_device()
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError, TypeError):
        raise QuambaError(f"--device {device!r} is not a torch device (e.g. cpu, cuda, "
                          "cuda:1)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            if torch.version.cuda is None and torch.version.hip is None:
                raise QuambaError(f"--device {device}: this torch ({torch.__version__}) was "
                                  "built without CUDA; use --device cpu, or install a CUDA build "
                                  "of torch")
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            shown = "" if visible is None else f" (CUDA_VISIBLE_DEVICES={visible!r})"
            raise QuambaError(f"--device {device}: no CUDA device is visible{shown}; use "
                              "--device cpu")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            shown = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
            raise QuambaError(f"--device {device}: there is no CUDA device {parsed.index}; "
                              f"{count} {'is' if count == 1 else 'are'} visible ({shown})")
    elif parsed.type != "cpu":  # mps, xpu, ...: refused only when torch says it has none
        module = getattr(torch.backends, parsed.type, None) or getattr(torch, parsed.type, None)
        available = getattr(module, "is_available", None)
        if callable(available) and not available():
            raise QuambaError(f"--device {device}: this torch ({torch.__version__}) has no "
                              f"{parsed.type} device; use --device cpu")
    return device


def check_request(request: ModelRequest) -> str:
    """What can be refused before anything is read or loaded: the device (returned, resolved)
    and a ``pretrained_dir`` to save into that is a file."""
    device = check_device(request.device)
    if request.quantize and request.pretrained_dir:
        check_directory_target(request.pretrained_dir, "--pretrained_dir", writable=False)
    return device


def prepare_model(request: ModelRequest) -> PreparedModel:
    from quamba.ops.backend import requested_backend
    device = check_request(request)
    backend = requested_backend(request.backend)
    source = _under_pretrained_dir(request.model, request.pretrained_dir) or request.model
    if request.quantize and _recorded_quant_config(Path(source)) is None:
        return _quantize_or_reuse(source, request, device, backend)
    prepared = _load(source, request, device, backend)
    _check_mode_fits(prepared, request)
    return prepared


def image_calibration_default(request: ModelRequest, image_set: str | None) -> ModelRequest:
    """``request`` for a run that evaluates a classifier on ``image_set``: a Vision Mamba model
    quantized without a ``calib_source`` calibrates on the image set's train split, as the
    language models calibrate on QuantConfig's text set (``digits``: its train split, disjoint
    from the test split evaluated). An ImageFolder directory is one set with no train split, and
    is not taken as its own calibration set: that asks for ``calib_source``. A request naming its
    calibration, or for a saved quantized model, or evaluating no images, is returned as is."""
    from quamba.eval.images import DIGITS
    from quamba.models.loading import detect_layout, is_quamba_checkpoint, resolve_model_dir
    from quamba.models.vision_loading import is_vision_config
    if not request.quantize or request.calib_source or image_set is None:
        return request
    source = _under_pretrained_dir(request.model, request.pretrained_dir) or request.model
    try:
        raw = json.loads((resolve_model_dir(source) / "config.json").read_text())
    except (ModelNotFoundError, OSError, ValueError):
        return request  # loading it says what is wrong
    if not isinstance(raw, dict) or is_quamba_checkpoint(raw):
        return request
    if not is_vision_config(raw):
        try:
            detect_layout(raw)
        except QuambaError:
            return request
        raise QuambaError("--eval_image needs a Vision Mamba classifier; this is a language model")
    if image_set != DIGITS:
        raise QuambaError(f"a Vision Mamba model is calibrated on images, and --eval_image "
                          f"{image_set} is one directory with no train split to take them from: "
                          "give --calib_data (digits or another ImageFolder directory)")
    return dataclasses.replace(request, calib_source=image_set)


def _under_pretrained_dir(model: str, pretrained_dir: str | None) -> str | None:
    """``pretrained_dir/model`` when that directory exists."""
    if not pretrained_dir or Path(model).is_absolute():
        return None
    candidate = Path(pretrained_dir) / model
    return str(candidate) if candidate.is_dir() else None


def _load(name: str, request: ModelRequest, device: str, backend: str) -> PreparedModel:
    """An FP model or a quantized checkpoint, whichever ``name`` holds."""
    from quamba import load_model
    try:
        model, tokenizer = load_model(name, dtype=request.dtype or _default_dtype(device),
                                      device=device, tokenizer=request.tokenizer)
    except ModelNotFoundError as exc:
        if request.pretrained_dir:
            raise ModelNotFoundError(
                f"{exc} (nor is it a saved model under {request.pretrained_dir})") from None
        raise
    if hasattr(model, "quant_config"):
        model.set_ssm_mode(request.ssm_mode or model.ssm_mode, backend)
        if request.state_cache is not None:
            model.set_state_cache(request.state_cache)
    layout = getattr(model, "source", {}).get("layout", "quamba")
    return PreparedModel(model, tokenizer, name, layout, device, backend, "loaded")


def _check_mode_fits(prepared: PreparedModel, request: ModelRequest) -> None:
    qcfg = prepared.quant_config
    if qcfg is None and request.ssm_mode not in (None, FP_MODE):
        raise QuambaError(f"SSM mode {request.ssm_mode!r} needs a quantized model; {prepared.name} "
                          "is an FP model (quantize it, or name a saved quantized model)")
    if qcfg is None and request.state_cache is not None:
        raise QuambaError(f"--state_cache applies to the int8 mixers of a quantized model; "
                          f"{prepared.name} is an FP model (its decode state is fp32)")
    if qcfg is not None and request.quantize and not qcfg.same_recipe(request.quant_config()):
        raise QuambaError(f"{prepared.name} is already quantized with a different recipe "
                          f"({_recipe_difference(qcfg, request.quant_config())}); "
                          "quantize its FP model instead")


def _quantize_or_reuse(source: str, request: ModelRequest, device: str, backend: str) -> PreparedModel:
    """Quantize the FP model ``source``, or reuse the copy saved earlier with the same recipe."""
    from quamba import load_model, quantize
    wanted = request.quant_config()
    target = None
    if request.pretrained_dir:
        target = Path(request.pretrained_dir) / saved_model_name(
            source, request.w_bits, request.a_bits, request.mixed_precision, request.lm_head,
            request.quantize_embedding, request.learn_scales, request.learn_weight_clipping)
    if target is not None:
        recorded = _recorded_quant_config(target)
        if recorded is not None and recorded.same_recipe(wanted):
            log.info("reusing %s: it was quantized with the requested recipe", target)
            prepared = _load(str(target), request, device, backend)
            prepared.how = "reused saved quantized model"
            return prepared
        if recorded is not None:
            log.warning("re-quantizing: %s was quantized with a different recipe (%s)", target,
                        _recipe_difference(recorded, wanted))
    fp_model, tokenizer = load_model(source, dtype=request.dtype or _default_dtype(device),
                                     device=device, tokenizer=request.tokenizer)
    if hasattr(fp_model, "quant_config"):
        raise QuambaError(f"{source} is already a quantized model; quantize its FP model instead")
    qmodel = quantize(fp_model, tokenizer, wanted)
    if target is not None:
        qmodel.save_pretrained(target)
        log.info("saved the quantized model to %s", target)
    return PreparedModel(qmodel, tokenizer, source, fp_model.source["layout"], device, backend,
                         "quantized", saved_to=str(target) if target else None)


def _recorded_quant_config(model_dir: Path):
    """The QuantConfig recorded in a saved quantized model's config.json, or None if absent."""
    from quamba import QuantConfig
    from quamba.models.loading import is_quamba_checkpoint
    try:
        raw = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return QuantConfig.from_dict(raw["quantization_config"]) if is_quamba_checkpoint(raw) else None


def _recipe_difference(saved, wanted) -> str:
    saved_recipe, wanted_recipe = saved.recipe(), wanted.recipe()
    return ", ".join(f"{key} {saved_recipe.get(key)!r} vs requested {value!r}"
                     for key, value in wanted_recipe.items() if saved_recipe.get(key) != value)


def _default_dtype(device: str) -> str:
    return "fp32" if str(device).startswith("cpu") else "fp16"
