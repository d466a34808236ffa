"""The hybrids' part of the export (quamba.export): which quantized linears a QuantizedHybridLM
holds, their compressed-tensors targets, and each family's transformers layout (config.json and
tensor names). Only the families in HYBRID_FAMILIES export; the others are refused by name."""
from __future__ import annotations

from pathlib import Path

from quamba.errors import QuambaError
from quamba.layers.qlinear import W4A8Linear, W4A16Linear, W8A8Linear
from quamba.layers.qtransformer import QInputLinear
from quamba.models.hub import read_config_json, resolve_model_dir
from quamba.models import bamba
from quamba.models.loading import to_transformers_names

QUANTIZED_LINEARS = (W8A8Linear, W4A16Linear, W4A8Linear)
W8A8_EXPERTS_REFUSED = (
    "W8A8 MoE layers cannot be exported: quamba quantizes the experts' up_proj input with a "
    "static per-tensor scale, which vLLM's int8 MoE method (per-channel weights with dynamic "
    "per-token inputs only) cannot run, nor transformers' fused experts (no Linear modules for "
    "compressed-tensors); export W4A16")


def _nemotron_h_names(state: dict, config) -> dict:
    return to_transformers_names(state)


def _nemotron_h_fields(config) -> dict:
    """vLLM's NemotronH classes read hybrid_override_pattern, which transformers 5 writes as
    layers_block_type."""
    return {"hybrid_override_pattern": config.pattern}


def _no_fields(config) -> dict:
    return {}


# model_type → ((quamba's FP names, config) → transformers' names, float Linear-like modules an
# engine must not quantize beyond lm_head and conv1d (the MoE routers), config.json fields the
# engines read that the FP config.json may lack)
HYBRID_FAMILIES = {
    "nemotron_h": (_nemotron_h_names, (r"re:.*mixer\.gate$",), _nemotron_h_fields),
    "bamba": (bamba.to_transformers_names, (), _no_fields),
}


def is_hybrid(qmodel) -> bool:
    from quamba.models.quantized_hybrid import QuantizedHybridLM
    return isinstance(qmodel, QuantizedHybridLM)


def check_family(qmodel) -> None:
    model_type = qmodel.config.model_type
    if model_type not in HYBRID_FAMILIES:
        raise QuambaError(f"exporting {type(qmodel).__name__} ({model_type}) is not supported "
                          "yet")
    if any(".experts." in name and isinstance(linear, W8A8Linear)
           for name, linear, _ in quantized_linears(qmodel)):
        raise QuambaError(W8A8_EXPERTS_REFUSED)


def quantized_linears(qmodel) -> list[tuple[str, object, bool]]:
    """(module name, quantized linear, input quantized per token) of every quantized linear of
    the blocks (a QInputLinear's inner linear under the QInputLinear's name)."""
    found, inner = [], set()
    for name, module in qmodel.backbone.layers.named_modules(prefix="backbone.layers"):
        if isinstance(module, QInputLinear):
            found.append((name, module.linear, module.dynamic))
            inner.add(id(module.linear))
        elif isinstance(module, QUANTIZED_LINEARS) and id(module) not in inner:
            found.append((name, module, False))
    return found


def target(name: str) -> str:
    """The compressed-tensors target of linear ``name``: its last name (in_proj, q_proj ...),
    whichever module holds it (Nemotron-H's mixer, Bamba's mamba, self_attn, feed_forward)."""
    return rf"re:.*\.{name.rsplit('.', 1)[-1]}$"


def transformers_names(qmodel, state: dict) -> dict:
    return HYBRID_FAMILIES[qmodel.config.model_type][0](state, qmodel.config)


def ignore(qmodel) -> list[str]:
    return ["lm_head", r"re:.*\.conv1d$", *HYBRID_FAMILIES[qmodel.config.model_type][1]]


def transformers_config(fp_model) -> dict:
    """The FP model's own config.json (the family's transformers config) with the fields the
    engines read added; the export adds its quantization_config."""
    source = getattr(fp_model, "source", {}).get("name_or_path")
    if not source:
        raise QuambaError("the FP model's directory is unknown; its config.json is exported")
    config = read_config_json(Path(resolve_model_dir(source)))
    config.pop("quantization_config", None)
    extra_fields = HYBRID_FAMILIES[fp_model.config.model_type][2]
    return {**config, **extra_fields(fp_model.config)}
