"""The compressed-tensors format of quamba's quantized linears (compressed-tensors 0.20.1, the
schema vLLM and transformers read; docs/export.md lists the facts used and their sources).

* W8A8Linear → format ``int-quantized``: ``weight`` int8 [out, in], ``weight_scale`` fp32 [1]
  (strategy ``tensor``), ``input_scale`` fp32 [1] (static, symmetric, strategy ``tensor``); an
  input quantized per token at run time (the hybrids' down_proj ...) has no ``input_scale``:
  ``dynamic`` true, strategy ``token``.
* W4A16Linear → format ``pack-quantized``: ``weight_packed`` int32 [out, in / 8] (code + 8 in
  each 4-bit field, element k in bits 4·(k mod 8) of word k // 8), ``weight_scale`` fp32
  [out, in / group] holding quamba's fp16 scales exactly (strategy ``group``; fp32 so that
  compressed-tensors, which dequantizes in the scale's dtype, gives quamba's fp32 products),
  ``weight_shape`` int64 [2].
"""
from __future__ import annotations

import torch

from quamba.errors import QuambaError
from quamba.layers.qlinear import W4A8Linear, W4A16Linear, W8A8Linear
from quamba.ops.quant4 import unpack_int4

INT4_OFFSET = 8  # compressed-tensors stores a signed 4-bit code c as the unsigned c + 8
CODES_PER_WORD = 8

W4A8_REFUSED = ("W4A8 cannot be exported: compressed-tensors can store its effective group "
                "scales (channel scale x group multiplier), but no engine scheme runs 4-bit "
                "group weights with static per-tensor int8 activations (vLLM's W4A8 int "
                "scheme needs dynamic per-token ones); export W8A8 or W4A16")


def _int8_args(strategy: str, dynamic: bool = False) -> dict:
    return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": strategy,
            "group_size": None, "dynamic": dynamic}


def linear_scheme(linear, dynamic: bool = False) -> dict:
    """The compressed-tensors scheme (weights, input_activations) of one quantized linear
    (``dynamic``: its input quantized per token at run time)."""
    if isinstance(linear, W8A8Linear):
        strategy = "channel" if linear.per_channel else "tensor"
        inputs = _int8_args("token", True) if dynamic else _int8_args("tensor")
        return {"weights": _int8_args(strategy), "input_activations": inputs}
    if isinstance(linear, W4A16Linear):
        weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                   "group_size": linear.group_size, "dynamic": False}
        return {"weights": weights, "input_activations": None}
    if isinstance(linear, W4A8Linear):
        raise QuambaError(W4A8_REFUSED)
    raise QuambaError(f"cannot export a {type(linear).__name__} in the compressed-tensors format")


def scheme_format(scheme: dict) -> str:
    return "int-quantized" if scheme["input_activations"] else "pack-quantized"


def pack_int32(codes: torch.Tensor) -> torch.Tensor:
    """int8 4-bit codes [N, K] (K a multiple of 8) → int32 [N, K / 8] as compressed-tensors
    packs them."""
    n, k = codes.shape
    if k % CODES_PER_WORD:
        raise QuambaError(f"cannot pack {k} 4-bit codes per row into int32 words")
    fields = (codes.to(torch.int64) + INT4_OFFSET).view(n, k // CODES_PER_WORD, CODES_PER_WORD)
    shifts = torch.arange(CODES_PER_WORD, dtype=torch.int64) * 4
    words = (fields << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def linear_tensors(linear, dynamic: bool = False) -> dict[str, torch.Tensor]:
    """The tensors one quantized linear is stored as, by their suffix after the module name (a
    per-token ``dynamic`` input has no input_scale)."""
    if isinstance(linear, W8A8Linear):
        scale = linear.weight_scale if linear.per_channel else linear.scales["weight_scale"]
        tensors = {"weight": linear.weight.detach().cpu().clone(),
                   "weight_scale": torch.as_tensor(scale, dtype=torch.float32).reshape(-1, 1)
                   if linear.per_channel else torch.tensor([scale], dtype=torch.float32)}
        if not dynamic:
            tensors["input_scale"] = torch.tensor([linear.scales["in_scale"]],
                                                  dtype=torch.float32)
        return tensors
    codes = unpack_int4(linear.weight.detach().cpu())
    return {"weight_packed": pack_int32(codes),
            "weight_scale": linear.scales.detach().cpu().float(),
            "weight_shape": torch.tensor(list(codes.shape), dtype=torch.int64)}


def quantization_config(groups: dict[str, dict], ignore: list[str]) -> dict:
    """config.json's ``quantization_config`` for ``groups`` {target regex: scheme}: one config
    group per distinct scheme."""
    merged: list[tuple[dict, list[str]]] = []
    for target, scheme in sorted(groups.items()):
        for known, targets in merged:
            if known == scheme:
                targets.append(target)
                break
        else:
            merged.append((scheme, [target]))
    formats = {scheme_format(scheme) for scheme, _ in merged}
    if len(formats) != 1:
        raise QuambaError(f"a model mixing formats {sorted(formats)} cannot be exported")
    config_groups = {f"group_{i}": {"targets": targets, **scheme, "output_activations": None,
                                    "format": scheme_format(scheme)}
                     for i, (scheme, targets) in enumerate(merged)}
    return {"quant_method": "compressed-tensors", "format": formats.pop(),
            "quantization_status": "compressed", "config_groups": config_groups,
            "ignore": ignore, "kv_cache_scheme": None}
