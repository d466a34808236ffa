"""The hybrids' part of the export (quamba.export): which quantized linears a QuantizedHybridLM
holds, their compressed-tensors targets, and each family's transformers layout (config.json and
tensor names, Granite's fused and unscaled tensors). Only the families in HYBRID_FAMILIES
export; the others are refused by name."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from quamba.errors import QuambaError
from quamba.layers.qlinear import W4A8Linear, W4A16Linear, W8A8Linear
from quamba.layers.qtransformer import QInputLinear
from quamba.models import bamba
from quamba.models.falcon_h1 import linear_multipliers, to_falcon_h1_names
from quamba.models.hub import read_config_json, resolve_model_dir
from quamba.models.jamba import to_jamba_names
from quamba.models.loading import to_transformers_names
from quamba.models.zamba2 import to_zamba2_names

QUANTIZED_LINEARS = (W8A8Linear, W4A16Linear, W4A8Linear)
# Quantized in quamba, exported float (from the FP model): Mamba1's dt_proj feeds the scan
FLOAT_IN_EXPORT = ("dt_proj",)
W8A8_EXPERTS_REFUSED = (
    "W8A8 MoE layers cannot be exported: quamba quantizes the experts' input (to gate_proj / "
    "up_proj) with a static per-tensor scale, which vLLM's int8 MoE method (per-channel "
    "weights with dynamic per-token inputs only) cannot run, nor transformers' fused experts "
    "(no Linear modules for compressed-tensors); export W4A16")
ZAMBA2_W8A8_REFUSED = (
    "W8A8 Zamba2 cannot be exported: its shared blocks run at several depths, and transformers "
    "ties only their weights across the uses, not compressed-tensors' scales (they would load "
    "uninitialised), while vLLM loads each block's tensors once, under its first use (it "
    "cannot take them repeated); export W4A16")
GRANITE_MOE_REFUSED = ("exporting Granite-4.0-H MoE layers is not supported yet (their experts "
                       "are stacked tensors, not per-expert linears); dense Granite-4.0-H exports")


def _no_fields(config) -> dict:
    return {}


def _unchanged(state: dict, groups: dict, config) -> tuple[dict, dict]:
    return state, groups


def _never_refused(qmodel) -> None:
    return None


@dataclass(frozen=True)
class Family:
    """How one hybrid family leaves in its transformers layout."""

    names: Callable  # (state under quamba's names, config) → under transformers' names
    ignore: tuple = ()  # float Linear-like modules beyond lm_head, conv1d: routers, dt_proj
    fields: Callable = _no_fields  # config → config.json fields the engines read
    layout: Callable = _unchanged  # (state, groups, config) → both in the family's own layout
    refuse: Callable = _never_refused  # qmodel → why it cannot export, or None


def _nemotron_h_names(state: dict, config) -> dict:
    return to_transformers_names(state)


def _nemotron_h_fields(config) -> dict:
    """vLLM's NemotronH classes read hybrid_override_pattern, which transformers 5 writes as
    layers_block_type."""
    return {"hybrid_override_pattern": config.pattern}


GATED = ("gate_proj", "up_proj")
# Granite's names of the blocks' output linears, which transformers multiplies by
# residual_multiplier at run time (quamba folds it into their weights)
GRANITE_OUTPUTS = (".mamba.out_proj.", ".self_attn.o_proj.", ".shared_mlp.output_linear.")


def _granite_layout(state: dict, groups: dict, config) -> tuple[dict, dict]:
    """Granite's shared_mlp: gate_proj and up_proj fused into input_linear (the gate's rows
    first; W8A8's two per-tensor weight scales become one per row), down_proj as
    output_linear; every output linear divided by residual_multiplier again."""
    state = _unscale_outputs(_fuse_gated(state), config.residual_multiplier)
    renamed = {}
    for target, scheme in groups.items():
        last = target[len(r"re:.*\."):-1]
        if last in GATED:
            renamed[r"re:.*\.input_linear$"] = _per_channel(scheme)
        else:
            renamed[target.replace("down_proj", "output_linear")] = scheme
    return state, renamed


def _per_channel(scheme: dict) -> dict:
    if scheme["input_activations"] is None:  # W4A16: group scales fuse as they are
        return scheme
    return {**scheme, "weights": {**scheme["weights"], "strategy": "channel"}}


def _fuse_gated(state: dict) -> dict:
    fused = {}
    for key, value in state.items():
        module, _, suffix = key.rpartition(".")
        owner, _, name = module.rpartition(".")
        if not owner.endswith(".shared_mlp"):
            fused[key] = value
        elif name == "down_proj":
            fused[f"{owner}.output_linear.{suffix}"] = value
        elif name == "gate_proj":  # with up_proj's tensors
            parts = [{s: state[f"{owner}.{n}.{s}"] for s in _suffixes(state, f"{owner}.{n}")}
                     for n in GATED]
            fused[f"{owner}.input_linear.{suffix}"] = _fused_tensor(suffix, *parts)
    return fused


def _suffixes(state: dict, module: str) -> list[str]:
    return [key[len(module) + 1:] for key in state if key.startswith(module + ".")]


def _fused_tensor(suffix: str, gate: dict, up: dict) -> torch.Tensor:
    """One tensor of input_linear from gate_proj's and up_proj's tensors (by suffix)."""
    if suffix == "input_scale":  # both read the layer's normed input: one scale
        return gate[suffix]
    if suffix == "weight_shape":
        return torch.stack([gate[suffix][0] + up[suffix][0], gate[suffix][1]])
    if suffix == "weight_scale" and gate[suffix].numel() == 1:  # W8A8 per tensor → per row
        return torch.cat([gate[suffix].expand(len(gate["weight"]), 1),
                          up[suffix].expand(len(up["weight"]), 1)])
    return torch.cat([gate[suffix], up[suffix]])


def _unscale_outputs(state: dict, multiplier: float) -> dict:
    """Float weights and quantized weights' scales of the output linears divided by
    ``multiplier`` (in float64); int8 / packed codes and input scales as they are."""
    if multiplier == 1:
        return state
    return {key: (value.double() / multiplier).to(value.dtype) if _is_output_weight(key, value)
            else value for key, value in state.items()}


def _is_output_weight(key: str, value: torch.Tensor) -> bool:
    """A float weight or a weight scale of an output linear (not its input scale)."""
    return (any(part in key for part in GRANITE_OUTPUTS) and value.is_floating_point()
            and key.rsplit(".", 1)[-1] in ("weight", "weight_scale"))


def _granite_refusal(qmodel) -> str | None:
    return GRANITE_MOE_REFUSED if qmodel.config.num_experts else None


def _zamba2_refusal(qmodel) -> str | None:
    return ZAMBA2_W8A8_REFUSED if qmodel.quant_config.a_bits == 8 else None


def _falcon_h1_names(state: dict, config) -> dict:
    return to_falcon_h1_names(_unfold_multipliers(state, config))


def _unfold_multipliers(state: dict, config) -> dict:
    """Falcon-H1's µP multipliers, which quamba folds into the linears on load
    (quamba.models.falcon_h1), taken out again: transformers and vLLM apply them at run time,
    to a linear's output (per row for in_proj) and to its input (q/k/v's, in_proj's)."""
    outputs, inputs = linear_multipliers(config)
    unfolded = {}
    for key, value in state.items():
        linear, _, kind = key.partition(".mixer.")[2].rpartition(".")
        linear = "mixer." + linear
        if key.startswith("backbone.layers.") and (linear in outputs or linear in inputs):
            value = _unfolded(kind, value, torch.as_tensor(outputs.get(linear, 1.0),
                                                           dtype=torch.float64),
                              inputs.get(linear, 1.0))
        unfolded[key] = value
    return unfolded


def _unfolded(kind: str, value: torch.Tensor, output: torch.Tensor, input_multiplier: float):
    """One tensor of a linear whose output was multiplied by ``output`` (a scalar or one per
    row) and its input by ``input_multiplier``: weights and weight scales divided by both (a
    per-tensor scale becomes one per row under a per-row multiplier), the input scale times the
    input's (the engine's input is x · multiplier, quamba's codes are those of x). quantize()
    refuses biases on these linears."""
    rows = output.reshape(-1, 1)
    if kind == "input_scale":
        return (value.double() * input_multiplier).float()
    if kind == "weight_scale" or (kind == "weight" and value.is_floating_point()):
        if value.numel() == 1 and output.numel() > 1:
            value = value.reshape(1, 1).expand(output.numel(), 1)
        divisor = rows * input_multiplier if value.dim() == 2 else output * input_multiplier
        return (value.double() / divisor).to(value.dtype)
    return value


def _falcon_h1_layout(state: dict, groups: dict, config) -> tuple[dict, dict]:
    """in_proj's W8A8 weight scale is one per row (its multipliers are)."""
    return state, {target: _per_channel(scheme) if target == r"re:.*\.in_proj$" else scheme
                   for target, scheme in groups.items()}


HYBRID_FAMILIES = {
    "nemotron_h": Family(_nemotron_h_names, (r"re:.*mixer\.gate$",), _nemotron_h_fields),
    "bamba": Family(bamba.to_transformers_names),
    "granitemoehybrid": Family(bamba.to_transformers_names, layout=_granite_layout,
                               refuse=_granite_refusal),
    # Jamba's Mamba1 mixers: dt_proj float (its input is the weighted-normed dt), as Mamba1's
    "jamba": Family(to_jamba_names, (r"re:.*\.router$", r"re:.*\.dt_proj$")),
    "falcon_h1": Family(_falcon_h1_names, layout=_falcon_h1_layout),
    # Zamba2's LoRA adapters stay float (vLLM builds them as linears)
    "zamba2": Family(to_zamba2_names, (r"re:.*_adapter_list\..*",), refuse=_zamba2_refusal),
}


def is_hybrid(qmodel) -> bool:
    from quamba.models.quantized_hybrid import QuantizedHybridLM
    return isinstance(qmodel, QuantizedHybridLM)


def _family(config) -> Family:
    return HYBRID_FAMILIES[config.model_type]


def check_family(qmodel) -> None:
    model_type = qmodel.config.model_type
    if model_type not in HYBRID_FAMILIES:
        raise QuambaError(f"exporting {type(qmodel).__name__} ({model_type}) is not supported "
                          "yet")
    refusal = _family(qmodel.config).refuse(qmodel)
    if refusal:
        raise QuambaError(refusal)
    if any(".experts." in name and isinstance(linear, W8A8Linear)
           for name, linear, _ in quantized_linears(qmodel)):
        raise QuambaError(W8A8_EXPERTS_REFUSED)


def quantized_linears(qmodel) -> list[tuple[str, object, bool]]:
    """(module name, quantized linear, input quantized per token) of every quantized linear of
    the blocks and Zamba2's shared blocks (a QInputLinear's inner linear under the
    QInputLinear's name) but FLOAT_IN_EXPORT's."""
    found, inner = [], set()
    for name, module in qmodel.backbone.named_modules(prefix="backbone"):
        if isinstance(module, QInputLinear):
            found.append((name, module.linear, module.dynamic))
            inner.add(id(module.linear))
        elif (isinstance(module, QUANTIZED_LINEARS) and id(module) not in inner
              and not name.endswith(FLOAT_IN_EXPORT)):
            found.append((name, module, False))
    return found


def target(name: str) -> str:
    """The compressed-tensors target of linear ``name``: its last name (in_proj, q_proj ...),
    whichever module holds it (Nemotron-H's mixer, Bamba's mamba, self_attn, feed_forward)."""
    return rf"re:.*\.{name.rsplit('.', 1)[-1]}$"


def transformers_layout(qmodel, state: dict, groups: dict) -> tuple[dict, dict]:
    """(tensors, {target: scheme}) under quamba's names → in the family's transformers
    layout."""
    family = _family(qmodel.config)
    return family.layout(family.names(state, qmodel.config), groups, qmodel.config)


def ignore(qmodel) -> list[str]:
    return ["lm_head", r"re:.*\.conv1d$", *_family(qmodel.config).ignore]


def transformers_config(fp_model) -> dict:
    """The FP model's own config.json (the family's transformers config) with the fields the
    engines read added; the export adds its quantization_config."""
    source = getattr(fp_model, "source", {}).get("name_or_path")
    if not source:
        raise QuambaError("the FP model's directory is unknown; its config.json is exported")
    config = read_config_json(Path(resolve_model_dir(source)))
    config.pop("quantization_config", None)
    return {**config, **_family(fp_model.config).fields(fp_model.config)}
