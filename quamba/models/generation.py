"""Token generation on any quamba LM (FP or quantized): prefill once, then one decode step per token."""
from __future__ import annotations

from typing import Callable

import torch


def sample_next(logits, temperature: float = 1.0, top_k: int = 1, top_p: float = 1.0,
                generator: torch.Generator | None = None):
    """Next token ids [batch] from last-position logits [batch, vocab].

    Greedy when top_k == 1 or temperature == 0 (as mamba_ssm); otherwise softmax(logits /
    temperature) restricted to the top_k tokens (0 = all) and to the smallest set whose
    probability reaches top_p."""
    if top_k == 1 or temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k > 0:
        kth = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the tokens ranked above it already reach top_p
        drop = probs.cumsum(dim=-1) - probs >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@torch.inference_mode()
def generate(model, input_ids, max_new_tokens: int | None = None, max_length: int | None = None,
             temperature: float = 1.0, top_k: int = 1, top_p: float = 1.0,
             eos_token_id: int | None = None, generator: torch.Generator | None = None,
             streamer: Callable[[torch.Tensor], None] | None = None):
    """Generate continuations of ``input_ids`` [batch, prompt_len]; returns [batch, total_len].

    Stops after ``max_new_tokens`` (or when the total reaches ``max_length``) or once every row
    has produced ``eos_token_id`` (default: the model config's eos). Rows that finished early are
    padded with eos. ``streamer`` is called with each new column of tokens [batch].
    """
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, prompt_len] with prompt_len > 0, got {tuple(input_ids.shape)}")
    prompt_len = input_ids.shape[1]
    if max_new_tokens is None:
        if max_length is None:
            raise ValueError("give max_new_tokens or max_length")
        max_new_tokens = max_length - prompt_len
    if max_new_tokens < 0:
        raise ValueError(f"max_length {max_length} is shorter than the prompt ({prompt_len} tokens)")
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
    cache = model.allocate_cache(input_ids.shape[0], device=input_ids.device)
    logits = model(input_ids, cache=cache, num_last_tokens=1)[:, -1]
    tokens = [input_ids]
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    for i in range(max_new_tokens):
        next_ids = sample_next(logits, temperature, top_k, top_p, generator)
        next_ids = torch.where(finished, torch.full_like(next_ids, eos_token_id), next_ids)
        tokens.append(next_ids[:, None])
        if streamer is not None:
            streamer(next_ids)
        finished |= next_ids == eos_token_id
        if bool(finished.all()) or i == max_new_tokens - 1:
            break
        logits = model(next_ids[:, None], cache=cache)[:, -1]
    return torch.cat(tokens, dim=1)
