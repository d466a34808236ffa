"""GPTQ (Frantar et al., 2022) for the 4-bit weights of Quamba2, and the Hessians it needs.

GPTQ quantizes a linear layer's weight W [N, K] one input column at a time and, after each
column, moves the rounding error onto the columns not yet quantized so as to minimise
‖X Wᵀ − X Ŵᵀ‖² over the calibration inputs X. The only statistic of X it needs is the
Hessian H = (2 / n) Σ xᵀx [K, K] of that objective.

The per-group scales are **static**: they are given (computed beforehand from the original
weights, as W4A8's two-level scales with multipliers in [1, 18] and W4A16's fp16 scales must be)
and each column is quantized with its group's scale by exactly quamba.ops.quant4's rule, so GPTQ
only changes which codes are chosen.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from tqdm.auto import tqdm

from quamba.errors import QuambaError
from quamba.ops.quant import reciprocal
from quamba.ops.quant4 import INT4_MAX, expand_groups

LM_HEAD = "lm_head"


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
def collect_hessians(model, tokens: torch.Tensor, layer_names=("in_proj", "out_proj"),
                     batch_size: int = 8, progress: bool = True) -> dict:
    """GPTQ Hessians H = (2 / n) Σ xᵀx (fp32, over all n input tokens) of the named linears of
    every mixer, keyed ``(layer index, name)``; with ``"lm_head"`` in ``layer_names`` also the
    lm_head's, keyed ``(None, "lm_head")``.

    One pass over the FP model: every Hessian comes from the unquantized model's activations
    (not sequentially from a model whose earlier layers are already quantized). This keeps the
    Hessians independent of the quantization order and costs a single forward per batch, at the
    price of not compensating the earlier layers' quantization error.
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
def _accumulating(linears: dict, sums: dict, counts: dict):
    """Forward pre-hooks adding each linear's xᵀx into ``sums``; removed on exit, also on error."""
    handles = []
    try:
        for key, module in linears.items():
            handles.append(module.register_forward_pre_hook(_accumulate_hook(key, sums, counts)))
        yield
    finally:
        for handle in handles:
            handle.remove()


def _accumulate_hook(key, sums: dict, counts: dict):
    def hook(module, inputs):
        rows = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).float()
        gram = rows.T @ rows
        sums[key] = gram if sums[key] is None else sums[key].add_(gram)
        counts[key] += rows.shape[0]
    return hook
