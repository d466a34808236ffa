"""GPTQ (Frantar et al., 2022) for the 4-bit weights of Quamba2, and the Hessians it needs.

GPTQ quantizes a linear layer's weight W [N, K] one input column at a time and, after each
column, moves the rounding error onto the columns not yet quantized so as to minimise
‖X Wᵀ − X Ŵᵀ‖² over the calibration inputs X. The only statistic of X it needs is the
Hessian H = (2 / n) Σ xᵀx [K, K] of that objective.

:func:`gptq_sequential_` runs it as GPTQ's own procedure does: layer after layer, in the order the
quantized model runs them, X being each layer's input *in the quantized model* (the int8
activations of W4A8, after every earlier layer has been quantized), so that each layer
compensates what came before it. :func:`collect_hessians` gives the FP model's Hessians instead
(used to measure a layer's output error on held-out text).

The per-group scales are **static**: they are given (computed beforehand from the original
weights, as W4A8's two-level scales with multipliers in [1, 18] and W4A16's fp16 scales must be)
and each column is quantized with its group's scale by exactly quamba.ops.quant4's rule, so GPTQ
only changes which codes are chosen.
"""
from __future__ import annotations

from contextlib import contextmanager
from itertools import zip_longest

import torch
from tqdm.auto import tqdm

from quamba.errors import QuambaError
from quamba.layers.qtransformer import (TRANSFORMER_LAYERS, QInputLinear, quantized_linears,
                                        reads_layer_input)
from quamba.models.falcon_h1 import ParallelMixer
from quamba.ops.quant import reciprocal
from quamba.ops.quant4 import INT4_MAX, expand_groups

LM_HEAD = "lm_head"
# The 4-bit linears of a mixer in the order it runs them.
MIXER_ORDER = ("in_proj", "x_proj", "out_proj")


def gptq_quantize(weight: torch.Tensor, hessian: torch.Tensor, scales: torch.Tensor,
                  group_size: int, damp: float = 0.01, block_size: int = 128,
                  act_order: bool = False) -> torch.Tensor:
    """int8 codes [N, K] in [-7, 7] of ``weight`` [N, K] against the static group ``scales``
    [N, K / group_size], chosen by GPTQ for the input ``hessian`` [K, K].

    ``damp · mean(diag H)`` is added to the diagonal; inputs that are always zero (diag 0) get a
    diagonal of 1, which leaves their columns at plain round-to-nearest and isolated from the
    others. With ``act_order`` the columns are processed by decreasing diag(H), each still
    quantized with the scale of its original group. Deterministic; runs on weight's device.
    """
    _check_shapes(weight, hessian, scales, group_size)
    work = weight.detach().float()  # not modified: work[:, order] below is a copy
    column_scales = expand_groups(scales.detach().float().to(work.device), group_size)
    column_inverses = expand_groups(reciprocal(scales.detach().to(work.device)), group_size)
    h = _damped_hessian(hessian.detach().to(work.device), damp)
    order = _column_order(h, act_order)
    h = h[order][:, order]
    codes = _quantize_columns(work[:, order], _inverse_hessian_factor(h),
                              column_scales[:, order], column_inverses[:, order], block_size)
    return codes[:, torch.argsort(order)]


def _check_shapes(weight, hessian, scales, group_size) -> None:
    n, k = weight.shape
    if hessian.shape != (k, k):
        raise QuambaError(f"hessian shape {tuple(hessian.shape)} does not match weight [{n}, {k}]")
    if k % group_size or scales.shape != (n, k // group_size):
        raise QuambaError(f"scales shape {tuple(scales.shape)} does not match weight [{n}, {k}] "
                          f"with group size {group_size}")


def _damped_hessian(hessian: torch.Tensor, damp: float) -> torch.Tensor:
    """fp64 copy of H with dead inputs' diagonal set to 1 and ``damp · mean(diag H)`` added."""
    h = hessian.double().clone()
    diagonal = h.diagonal()
    damping = damp * diagonal.mean()
    diagonal[diagonal == 0] = 1.0
    diagonal += damping
    return h


def _column_order(h: torch.Tensor, act_order: bool) -> torch.Tensor:
    """Processing order of the columns: natural, or by decreasing diag(H) (stable, so ties keep
    their natural order)."""
    if not act_order:
        return torch.arange(h.shape[0], device=h.device)
    return torch.sort(h.diagonal(), descending=True, stable=True).indices


def _inverse_hessian_factor(h: torch.Tensor) -> torch.Tensor:
    """fp32 upper Cholesky factor U of H⁻¹ (H⁻¹ = Uᵀ U), computed in fp64: row i of U gives the
    update of the later columns for column i's error."""
    lower, info = torch.linalg.cholesky_ex(h)
    if info.item() == 0:
        inverse = torch.cholesky_inverse(lower)
        upper, info = torch.linalg.cholesky_ex(inverse, upper=True)
    if info.item() != 0:
        raise QuambaError("the GPTQ Hessian is not positive definite: increase damp")
    return upper.float()


def _quantize_columns(work, upper, column_scales, column_inverses, block_size) -> torch.Tensor:
    """The GPTQ sweep over ``work`` [N, K] (modified in place), in blocks of ``block_size``
    columns: exact error feedback inside a block, one lazy batched update of the later columns
    after it."""
    codes = torch.empty(work.shape, dtype=torch.int8, device=work.device)
    for start in range(0, work.shape[1], block_size):
        end = min(start + block_size, work.shape[1])
        block_errors = _quantize_block(work, upper, column_scales, column_inverses, codes,
                                       start, end)
        work[:, end:] -= block_errors @ upper[start:end, end:]
    return codes


def _quantize_block(work, upper, column_scales, column_inverses, codes, start, end):
    """Quantizes columns start..end-1 into ``codes``; returns their scaled errors [N, end-start]."""
    errors = torch.empty(work.shape[0], end - start, device=work.device)
    for i in range(start, end):
        column = work[:, i]
        code = torch.round(column * column_inverses[:, i]).clamp_(-INT4_MAX, INT4_MAX)
        codes[:, i] = code.to(torch.int8)
        error = (column - code * column_scales[:, i]) / upper[i, i]
        work[:, i + 1:end] -= error[:, None] * upper[i, i + 1:end][None, :]
        errors[:, i - start] = error
    return errors


@torch.no_grad()
def gptq_sequential_(qmodel, fp_model, tokens: torch.Tensor, layer_names=("in_proj", "out_proj"),
                     damp: float = 0.01, block_size: int = 128, act_order: bool = False,
                     batch_size: int = 8, progress: bool = True) -> None:
    """Replace the round-to-nearest codes of the 4-bit linears of every block of ``qmodel``
    (W4A8 or W4A16, built from ``fp_model``) by GPTQ's, in place, in execution order: a Mamba
    mixer's ``layer_names``, and every quantized linear of a hybrid's attention, MLP or MoE
    (block_stages; routers stay float).

    The calibration tokens [samples, seqlen] run once through the embedding; then, block by block,
    each stage of linears gets the Hessians of their inputs in the quantized block (one block
    forward per stage, the earlier stages already replaced; an expert's Hessian over the tokens
    routed to it), each linear is quantized by GPTQ from its FP weight against its own static
    group scales (``group_scales()``), and the block's outputs, computed with every replacement
    in place, become the next block's inputs. The blocks run in their present SSM mode and
    backend. Deterministic.

    Zamba2's shared transformer blocks are replaced first, once each (gptq_shared_blocks_); a
    hybrid layer's own linear, which its Mamba2 mixer reads, before that mixer's linears.
    """
    if hasattr(qmodel.backbone, "shared_blocks"):
        gptq_shared_blocks_(qmodel, fp_model, tokens, damp, block_size, act_order, batch_size)
    device = qmodel.backbone.embedding.weight.device
    hidden = [qmodel.backbone.embedding(tokens[start:start + batch_size].to(device))
              for start in range(0, tokens.shape[0], batch_size)]
    # what each block takes besides (hidden, residual): Zamba2's, the token embeddings
    kwargs = [qmodel._layer_kwargs(h) for h in hidden]
    residual = [None] * len(hidden)
    blocks = list(zip(qmodel.backbone.layers, fp_model.backbone.layers))
    for block, fp_block in tqdm(blocks, desc="GPTQ", unit="layer", disable=not progress):
        for stage in _layer_stages(block, fp_block, layer_names):
            hessians = _block_input_hessians(block, stage, hidden, residual, kwargs)
            for (layer, fp_linear), hessian in zip(stage, hessians):
                _replace_codes(_four_bit(layer), fp_linear.weight.detach().float(), hessian,
                               damp, block_size, act_order)
        hidden, residual = map(list, zip(*(block(h, r, **kw)
                                           for h, r, kw in zip(hidden, residual, kwargs))))


@torch.no_grad()
def gptq_shared_blocks_(qmodel, fp_model, tokens: torch.Tensor, damp: float = 0.01,
                        block_size: int = 128, act_order: bool = False,
                        batch_size: int = 8) -> None:
    """Replace the codes of every 4-bit linear of Zamba2's shared transformer blocks by GPTQ's,
    each linear once, from one Hessian over all of its uses: the sum of xᵀx over every layer
    that runs the block, its inputs as ``fp_model`` computes them (each use with its own
    adapters). The weight is one for every depth, so its error is to be small over the inputs of
    all of them together; they come from the FP model since the later uses' inputs in the
    quantized model depend on the block's own codes."""
    pairs = [(block.get_submodule(name), fp_linear)
             for block, fp_block in zip(qmodel.backbone.shared_blocks,
                                        fp_model.backbone.shared_blocks)
             for name, fp_linear in quantized_linears(fp_block)]
    fp_linears = {fp_linear: fp_linear for _, fp_linear in pairs}
    sums, counts = dict.fromkeys(fp_linears), dict.fromkeys(fp_linears, 0)
    device = fp_model.backbone.embedding.weight.device
    with _accumulating(fp_linears, sums, counts):
        for start in range(0, tokens.shape[0], batch_size):
            fp_model(tokens[start:start + batch_size].to(device), num_last_tokens=1)
    for layer, fp_linear in pairs:
        hessian = sums[fp_linear] * (2.0 / counts[fp_linear])
        _replace_codes(_four_bit(layer), fp_linear.weight.detach().float(), hessian, damp,
                       block_size, act_order)


def _layer_stages(block, fp_block, layer_names) -> list[list[tuple]]:
    """block_stages of a block's mixer; a Zamba2 hybrid layer's own linear (its FP layer runs a
    shared block) in a stage before them."""
    stages = block_stages(block.mixer, fp_block.mixer, layer_names)
    if getattr(fp_block, "shared", None) is None:
        return stages
    return [[(block.linear, fp_block.linear)]] + stages


def block_stages(mixer, fp_mixer, layer_names) -> list[list[tuple]]:
    """The 4-bit linears of a block's quantized ``mixer`` that GPTQ replaces, each beside its FP
    linear of ``fp_mixer``, in stages: the inputs of a stage's linears depend on no linear of
    the same stage or a later one, so one forward gives a stage's Hessians. A Mamba mixer: one
    stage per name of ``layer_names`` it has, in MIXER_ORDER; attention, MLP or MoE: the
    linears reading the layer's input (q, k, v, gate and up projections, of every expert too),
    then the others (o_proj, down_proj); Falcon-H1's parallel mixer: the stages of its Mamba2
    mixer and of its attention side by side."""
    if isinstance(fp_mixer, ParallelMixer):
        return [sum(stage, []) for stage in zip_longest(
            block_stages(mixer.mamba, fp_mixer.mamba, layer_names),
            block_stages(mixer.self_attn, fp_mixer.self_attn, layer_names), fillvalue=[])]
    if isinstance(fp_mixer, TRANSFORMER_LAYERS):
        named = quantized_linears(fp_mixer)
        stages = [[(mixer.get_submodule(name), fp_linear) for name, fp_linear in named
                   if reads_layer_input(name) == first] for first in (True, False)]
        return [stage for stage in stages if stage]
    return [[(getattr(mixer, name), getattr(fp_mixer, name))] for name in MIXER_ORDER
            if name in layer_names and hasattr(fp_mixer, name)]


def _four_bit(layer):
    """The W4A8Linear or W4A16Linear that holds ``layer``'s codes (inside a QInputLinear)."""
    return layer.linear if isinstance(layer, QInputLinear) else layer


def _replace_codes(layer, fp_weight, hessian, damp, block_size, act_order) -> None:
    codes = gptq_quantize(fp_weight, hessian, layer.group_scales(), layer.group_size,
                          damp=damp, block_size=block_size, act_order=act_order)
    layer.load_float_weight(fp_weight, codes)


def _block_input_hessians(block, stage: list, hidden: list, residual: list,
                          kwargs: list) -> list:
    """(2 / n) Σ xᵀx of the input x of each quantized linear of ``stage`` [(linear, FP linear)]
    (dequantized when int8; zeros for a linear that saw no token, such as an expert no token
    was routed to) over one forward of ``block`` on every batch (with its ``kwargs``)."""
    layers = [layer for layer, _ in stage]
    sums, counts = dict.fromkeys(layers), dict.fromkeys(layers, 0)
    with _accumulating({layer: layer for layer in layers}, sums, counts, dequantize=True):
        for h, r, kw in zip(hidden, residual, kwargs):
            block(h, r, **kw)
    return [torch.zeros(fp_linear.in_features, fp_linear.in_features, device=hidden[0].device)
            if counts[layer] == 0 else sums[layer] * (2.0 / counts[layer])
            for layer, fp_linear in stage]


@torch.no_grad()
def collect_hessians(model, tokens: torch.Tensor, layer_names=("in_proj", "out_proj"),
                     batch_size: int = 8, progress: bool = True) -> dict:
    """GPTQ Hessians H = (2 / n) Σ xᵀx (fp32, over all n input tokens) of the named linears of
    every mixer, keyed ``(layer index, name)``; with ``"lm_head"`` in ``layer_names`` also the
    lm_head's, keyed ``(None, "lm_head")``.

    One pass over ``model`` as it is (the FP model, for measuring layer errors on held-out text;
    quantization itself uses :func:`gptq_sequential_`).
    """
    linears = _named_linears(model, layer_names)
    sums = {key: None for key in linears}
    counts = dict.fromkeys(linears, 0)
    device = next(model.parameters()).device
    # Without lm_head, logits of the last token only are enough (and much smaller).
    last_tokens = 0 if LM_HEAD in layer_names else 1
    with _accumulating(linears, sums, counts):
        for start in tqdm(range(0, tokens.shape[0], batch_size), desc="GPTQ Hessians",
                          unit="batch", disable=not progress):
            model(tokens[start:start + batch_size].to(device), num_last_tokens=last_tokens)
    return {key: sums[key] * (2.0 / counts[key]) for key in linears}


def _named_linears(model, layer_names) -> dict:
    """{(layer index, name) or (None, "lm_head"): nn.Linear} for the requested names."""
    linears = {}
    for name in layer_names:
        if name == LM_HEAD:
            linears[None, name] = model.lm_head
            continue
        for layer, mixer in enumerate(model.mixers()):
            module = getattr(mixer, name, None)
            if not isinstance(module, torch.nn.Linear):
                raise QuambaError(f"mixer has no linear layer named {name!r}")
            linears[layer, name] = module
    return linears


@contextmanager
def _accumulating(linears: dict, sums: dict, counts: dict, dequantize: bool = False):
    """Forward pre-hooks adding each linear's xᵀx into ``sums`` (x times the linear's
    ``in_scale`` when x is int8 and ``dequantize``); removed on exit, also on error."""
    handles = []
    try:
        for key, module in linears.items():
            hook = _accumulate_hook(key, sums, counts, dequantize)
            handles.append(module.register_forward_pre_hook(hook))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _accumulate_hook(key, sums: dict, counts: dict, dequantize: bool):
    def hook(module, inputs):
        x = inputs[0].detach()
        rows = x.reshape(-1, x.shape[-1]).float()
        if dequantize and x.dtype == torch.int8:
            rows *= _four_bit(module).scales["in_scale"]
        gram = rows.T @ rows
        sums[key] = gram if sums[key] is None else sums[key].add_(gram)
        counts[key] += rows.shape[0]
    return hook
