"""Export of a quantized LM for the serving engines: a Hub directory in the transformers
architecture (MambaForCausalLM, Mamba2ForCausalLM, the hybrids' of quamba.export.hybrid) whose
config.json carries a compressed-tensors ``quantization_config`` (what vLLM, SGLang and
transformers read; docs/export.md).

Only what the plain architecture computes exactly leaves quantized: in_proj, x_proj (Mamba1)
and out_proj, and the hybrids' attention, MLP and expert linears. Everything else (the int8
conv1d, the scan and its parameters, dt_proj, the norms, the embedding and lm_head) is written in
float from the FP model, and a Hadamard-rotated model is refused (the engines cannot apply the
online Hadamard before out_proj)."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from quamba.errors import QuambaError
from quamba.export import compressed, hybrid
from quamba.models.hub import TOKENIZER_FILES
from quamba.models.loading import load_model, to_transformers_names
from quamba.version import __version__

FORMATS = ("compressed-tensors",)
EXPORT_RECORD = "quamba_export.json"
EXPORTED_LINEARS = ("in_proj", "x_proj", "out_proj")
KEPT_FP = {
    "embedding": "the engines read a float embedding",
    "conv1d": "the int8 causal conv1d has no compressed-tensors form (vLLM's Mamba2 builds it "
              "with quant_config=None)",
    "scan": "QSScan / the int8 SSD and their int8 A_log, D, dt_bias have no engine form; the "
            "engines run the float scan",
    "dt_proj": "Mamba1's dt_proj feeds the scan (vLLM adds its bias inside the scan kernel); kept "
               "float",
    "norms": "RMSNorm weights are float in every engine (Mamba2's gated-norm weight is folded "
             "into out_proj, as quamba does, and written as ones)",
    "lm_head": "the float head (a quamba int8/int4 head is not exported)",
}
MIXER_NORMS_KEPT = ("Jamba's weighted RMSNorms of dt, B and C after x_proj are float in quamba "
                    "and in the engines")
KEPT_FP_HYBRID = {
    "scan": KEPT_FP["scan"] + " (with the family's floor on Δ)",
    "attention": "RoPE, softmax and the KV cache are float in quamba and in the engines",
}
ROUTERS_KEPT = "the MoE routers are float in quamba and in the engines (ignore)"


def export(qmodel, out_dir, format: str = "compressed-tensors", fp_model=None,
           overwrite: bool = False, tokenizer=None) -> dict:
    """Write ``qmodel`` (a QuantizedMambaLM) to ``out_dir`` in ``format``; returns the export
    record (also written as quamba_export.json) and prints its summary. ``fp_model``: the FP
    model it was quantized from (default: the one quantize() kept, else its base_model)."""
    if format not in FORMATS:
        raise QuambaError(f"export format must be one of {', '.join(FORMATS)}, got {format!r}")
    _check_target(Path(out_dir), overwrite)
    _check_exportable(qmodel)
    fp_model = _fp_model(qmodel, fp_model)
    state, groups = export_state(qmodel, fp_model)
    config = (hybrid.transformers_config(fp_model) if hybrid.is_hybrid(qmodel)
              else qmodel.config.to_transformers())
    config["quantization_config"] = compressed.quantization_config(groups, _ignore(qmodel))
    record = _record(qmodel, fp_model, groups)
    _write(Path(out_dir), state, config, record, _tokenizer_source(fp_model, tokenizer))
    print(summary(record, out_dir))
    return record


def _check_target(out_dir: Path, overwrite: bool) -> None:
    if out_dir.is_file():
        raise QuambaError(f"export directory {out_dir} is an existing file")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not overwrite:
        raise QuambaError(f"export directory {out_dir} exists and is not empty (use --overwrite)")


def _check_exportable(qmodel) -> None:
    config = getattr(qmodel, "quant_config", None)
    if config is None or not hasattr(qmodel, "backbone"):
        raise QuambaError("export needs a quantized Mamba LM (QuantizedMambaLM)")
    if hybrid.is_hybrid(qmodel):
        hybrid.check_family(qmodel)
    elif not hasattr(qmodel.config, "to_transformers"):
        raise QuambaError(f"exporting {type(qmodel).__name__} is not supported yet")
    if config.hadamard:
        raise QuambaError("a Hadamard-rotated model cannot be exported: the engines run the plain "
                          "architecture, which cannot rotate y online before out_proj; quantize "
                          "with hadamard off (--no_hadamard) to export")
    for _, linear, dynamic in exported_linears(qmodel):
        compressed.linear_scheme(linear, dynamic)  # refuses W4A8 with its reason


def exported_linears(qmodel) -> list[tuple[str, object, bool]]:
    """(module name, quantized linear, input quantized per token) of each exported linear."""
    if hybrid.is_hybrid(qmodel):
        return hybrid.quantized_linears(qmodel)
    found = []
    for i, layer in enumerate(qmodel.backbone.layers):
        found += [(f"backbone.layers.{i}.mixer.{name}", getattr(layer.mixer, name), False)
                  for name in EXPORTED_LINEARS if hasattr(layer.mixer, name)]
    return found


def _fp_model(qmodel, fp_model):
    """The FP model in the basis ``qmodel`` was built in (Mamba2: gated norm folded)."""
    from quamba.quantization.rotation import quantization_basis_
    fp_model = fp_model or qmodel.__dict__.get("fp_model")
    if fp_model is None:
        if not qmodel.base_model:
            raise QuambaError("the FP model this checkpoint was quantized from is unknown; give "
                              "it (--pretrained_dir)")
        fp_model, _ = load_model(qmodel.base_model, dtype="fp16", tokenizer=False)
    if _config_dict(fp_model.config) != _config_dict(qmodel.config):
        raise QuambaError("the FP model's config differs from the quantized model's")
    basis = quantization_basis_(copy.deepcopy(fp_model), hadamard=False)
    basis.source = getattr(fp_model, "source", {})
    return basis


def _config_dict(config) -> dict:
    return config.to_transformers() if hasattr(config, "to_transformers") else config.to_dict()


def export_state(qmodel, fp_model) -> tuple[dict, dict]:
    """(the transformers-named state dict, {target regex: scheme} of the exported linears)."""
    state = {k: v.detach().contiguous().cpu() for k, v in fp_model.state_dict().items()}
    if fp_model.config.tie_embeddings:
        state.pop("lm_head.weight", None)
    groups = {}
    for name, linear, dynamic in exported_linears(qmodel):
        del state[name + ".weight"]
        state.update({f"{name}.{k}": v
                      for k, v in compressed.linear_tensors(linear, dynamic).items()})
        scheme = compressed.linear_scheme(linear, dynamic)
        target = (hybrid.target(name) if hybrid.is_hybrid(qmodel)
                  else rf"re:.*mixer\.{name.rsplit('.', 1)[-1]}$")
        if groups.setdefault(target, scheme) != scheme:
            raise QuambaError(f"{name} is quantized unlike the other linears of its name")
    if hybrid.is_hybrid(qmodel):
        return hybrid.transformers_layout(qmodel, state, groups)
    return to_transformers_names(state), groups


def _ignore(qmodel) -> list[str]:
    """Float Linear-like modules an engine must not quantize: lm_head, conv1d (a linear in
    vLLM), Mamba1's dt_proj, the hybrids' routers."""
    if hybrid.is_hybrid(qmodel):
        return hybrid.ignore(qmodel)
    ignore = ["lm_head", r"re:.*mixer\.conv1d$"]
    if qmodel.config.layer != "Mamba2":
        ignore.append(r"re:.*mixer\.dt_proj$")
    return ignore


def _record(qmodel, fp_model, groups: dict) -> dict:
    if hybrid.is_hybrid(qmodel):
        architecture = hybrid.transformers_config(fp_model)["architectures"][0]
    else:
        architecture = qmodel.config.to_transformers()["architectures"][0]
    return {"format": "compressed-tensors", "quamba_version": __version__,
            "architecture": architecture,
            "recipe": qmodel.quant_config.recipe(),
            "base_model": getattr(fp_model, "source", {}).get("name_or_path"),
            "quantized": {target: scheme for target, scheme in sorted(groups.items())},
            "kept_fp": _kept_fp(qmodel)}


def _kept_fp(qmodel) -> dict:
    """What the export writes in float, and why."""
    kept, names = dict(KEPT_FP), [name for name, _, _ in exported_linears(qmodel)]
    if not any(name.endswith(".x_proj") for name in names):
        del kept["dt_proj"]  # no Mamba1 mixer
    if not hybrid.is_hybrid(qmodel):
        return kept
    kept.update(KEPT_FP_HYBRID)
    if any(name.endswith(".x_proj") for name in names):
        kept["mixer_norms"] = MIXER_NORMS_KEPT
    if any(".experts." in name for name in names):
        kept["routers"] = ROUTERS_KEPT
    return kept


def _tokenizer_source(fp_model, tokenizer):
    """A tokenizer object to save, or the FP model's directory to copy tokenizer files from."""
    if tokenizer is not None:
        return tokenizer
    source = getattr(fp_model, "source", {}).get("name_or_path")
    return Path(source) if source and Path(source).is_dir() else None


def _write(out_dir: Path, state: dict, config: dict, record: dict, tokenizer) -> None:
    from safetensors.torch import save_file

    from quamba.utils.io import atomic_directory
    with atomic_directory(out_dir) as tmp:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        (tmp / EXPORT_RECORD).write_text(json.dumps(record, indent=2))
        if isinstance(tokenizer, Path):
            for name in TOKENIZER_FILES:
                if (tokenizer / name).is_file():
                    shutil.copy2(tokenizer / name, tmp / name)
        elif tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))


def summary(record: dict, out_dir) -> str:
    lines = [f"exported {record['architecture']} ({record['format']}) to {out_dir}",
             "quantized: " + ", ".join(f"{target[3:]} ({_scheme_name(scheme)})"
                                       for target, scheme in record["quantized"].items()),
             "kept in float:"]
    lines += [f"  {part}: {why}" for part, why in record["kept_fp"].items()]
    return "\n".join(lines)


def _scheme_name(scheme: dict) -> str:
    weights = scheme["weights"]
    inputs = scheme["input_activations"]
    activations = ("A16" if inputs is None else
                   "A8 dynamic per-token" if inputs["dynamic"] else "A8 static per-tensor")
    group = f", group {weights['group_size']}" if weights["group_size"] else ""
    return f"W{weights['num_bits']}{activations}{group}"


def reference_model(qmodel, fp_model=None):
    """quamba's model in the export's configuration: the FP model (in the quantized model's
    basis) with only the exported linears quantized, as quamba computes them (dequantized
    weights; W8A8 inputs fake-quantized with their static scale, or per token as quamba's
    QInputLinear does, by quamba.ops.quant)."""
    from quamba.export.reference import ExportedLinear
    _check_exportable(qmodel)
    model = _fp_model(qmodel, fp_model)
    for name, linear, dynamic in exported_linears(qmodel):
        model.set_submodule(name, ExportedLinear.of(linear, dynamic))
    return model.eval()


__all__ = ["export", "reference_model", "summary", "FORMATS", "EXPORT_RECORD"]
