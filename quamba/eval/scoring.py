"""Token-level scoring shared by the lm-eval adapter and the perplexity evaluation.

Both score ``(context tokens, continuation tokens)`` pairs the way lm-eval does: the model reads
context + continuation minus its last token, and the logits at the continuation's positions give
its log-probability. Mamba is causal, so right-padding a batch leaves every row's scores as they
would be alone (up to float rounding of the batched matmuls).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window


def model_device(model) -> torch.device:
    """The device of the model's first tensor: a parameter, else a buffer (a model quantized
    end to end, int8 embedding and head, holds buffers only)."""
    return next(t for t in (*model.parameters(), *model.buffers())).device


@torch.inference_mode()
def score_continuations(model, pairs: list[tuple[list[int], list[int]]], max_length: int,
                        pad_id: int) -> list[tuple[float, bool]]:
    """``(logprob, is_greedy)`` of each continuation given its context, as one right-padded batch.

    The model reads the last ``max_length`` tokens of context + continuation[:-1] (lm-eval's
    left truncation); a continuation longer than ``max_length`` cannot be scored.
    """
    inputs, targets = [], []
    for context, continuation in pairs:
        if not context or not continuation:
            raise ValueError("context and continuation must each hold at least one token")
        if len(continuation) > max_length:
            raise ValueError(
                f"continuation of {len(continuation)} tokens exceeds max_length {max_length}")
        inputs.append((context + continuation)[-(max_length + 1):-1])
        targets.append(continuation)
    width = max(len(row) for row in inputs)
    batch = torch.full((len(inputs), width), pad_id, dtype=torch.long)
    for i, row in enumerate(inputs):
        batch[i, :len(row)] = torch.tensor(row, dtype=torch.long)
    # Only the positions from the earliest continuation start onward are needed.
    first_scored = min(len(row) - len(cont) for row, cont in zip(inputs, targets))
    logits = model(batch.to(model_device(model)), num_last_tokens=width - first_scored)
    scores = []
    for row_logits, row, cont in zip(logits, inputs, targets):
        start = len(row) - len(cont) - first_scored
        logprobs = F.log_softmax(row_logits[start:start + len(cont)].float(), dim=-1)
        cont_ids = torch.tensor(cont, device=logprobs.device)
        picked = logprobs.gather(-1, cont_ids[:, None]).squeeze(-1)
        is_greedy = bool((logprobs.argmax(dim=-1) == cont_ids).all())
        scores.append((float(picked.sum()), is_greedy))
    return scores


def rolling_windows(tokens: list[int], prefix_id: int,
                    max_length: int) -> list[tuple[list[int], list[int]]]:
    """lm-eval's rolling windows as ``(context, continuation)`` pairs: every token is predicted
    exactly once, the first one after ``prefix_id``; the model reads ``max_length`` tokens per
    window and the windows' inputs do not overlap, except that the last window takes its full
    context from the tokens before it."""
    return [make_disjoint_window(window)
            for window in get_rolling_token_windows(tokens, prefix_token=prefix_id,
                                                    max_seq_len=max_length, context_len=1)]
