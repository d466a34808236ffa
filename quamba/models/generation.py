"""Token generation on any quamba LM (FP or quantized): prefill once, then one decode step per
token, eagerly or replayed from a CUDA graph (``cache_graph=True``)."""
from __future__ import annotations

from typing import Callable

import torch

from quamba.errors import QuambaError


# Tokens between the checks for every row having finished, by default when decoding replays CUDA
# graphs. A check waits for the device; between checks the host queues the next step while the
# device runs this one, which hides the launch (128 tokens of Mamba-2.8B W8A8 at batch 1 on an
# H100: 310 ms, against 328 ms checking after each token: benchmarks/RESULTS.md). Eager steps are
# slower to launch than to run, so there each token is checked.
GRAPH_EOS_CHECK_EVERY = 8


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


class GraphedStep:
    """A decode step captured once in a CUDA graph and replayed per token.

    ``step_fn(input_ids [batch, 1]) -> logits [batch, vocab]`` may read only ``input_ids`` and
    tensors that outlive the graph (weights, a preallocated cache updated in place); it runs twice
    on a side stream before the capture (as CUDA graphs need), which changes the cache, so fill the
    cache (prefill) after building this. Calling it with the next ids [batch] returns the logits
    in a static tensor that the next call overwrites.
    """

    def __init__(self, step_fn: Callable, batch_size: int, device, pool=None, warmups: int = 2):
        device = _cuda_device(device)
        self.input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(warmups):
                step_fn(self.input_ids)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.logits = step_fn(self.input_ids)

    def __call__(self, next_ids: torch.Tensor) -> torch.Tensor:
        self.input_ids.copy_(next_ids.view(-1, 1))
        self.graph.replay()
        return self.logits


class _GraphCache(dict):
    """The decode graphs kept on a model. A copy of the model (deepcopy, pickle) starts with none:
    graphs are bound to this model's own weights and caches. The graphs share one memory pool."""

    def __init__(self):
        super().__init__()
        self.pool = None

    def __deepcopy__(self, memo):
        return _GraphCache()

    def __reduce__(self):
        return (_GraphCache, ())


def graphed_decoder(model, batch_size: int, device):
    """``(cache, step)`` for ``model`` at ``batch_size``: a preallocated cache and its decode step
    as a GraphedStep, captured on first use and kept on the model (per batch size, device and SSM
    mode; the graphs share one memory pool). Prefill into ``cache`` after resetting its
    ``seqlen_offset`` to 0, then call ``step``."""
    device = _cuda_device(device)
    graphs = model.__dict__.setdefault("_decode_graphs", _GraphCache())
    key = (batch_size, str(device), getattr(model, "ssm_mode", None))
    if key not in graphs:
        cache = model.allocate_cache(batch_size, device=device)

        def step_fn(input_ids):
            cache.seqlen_offset = 1  # any offset > 0 selects the decode path; Mamba has no positions
            return model(input_ids, cache=cache)[:, -1]

        if graphs.pool is None:
            graphs.pool = torch.cuda.graph_pool_handle()
        graphs[key] = (cache, GraphedStep(step_fn, batch_size, device, graphs.pool))
    return graphs[key]


def _cuda_device(device) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise QuambaError(f"CUDA graphs need a CUDA device, the model is on {device}")
    return device


@torch.inference_mode()
def generate(model, input_ids, max_new_tokens: int | None = None, max_length: int | None = None,
             temperature: float = 1.0, top_k: int = 1, top_p: float = 1.0,
             eos_token_id: int | None = None, generator: torch.Generator | None = None,
             streamer: Callable[[torch.Tensor], None] | None = None, cache_graph: bool = False,
             eos_check_every: int | None = None):
    """Generate continuations of ``input_ids`` [batch, prompt_len]; returns [batch, total_len].

    Stops after ``max_new_tokens`` (or when the total reaches ``max_length``) or once every row
    has produced ``eos_token_id`` (default: the model config's eos). Rows that finished early are
    padded with eos. That is checked every ``eos_check_every`` tokens (default: every token, or
    GRAPH_EOS_CHECK_EVERY with ``cache_graph`` and no streamer), so up to ``eos_check_every - 1``
    decode steps may run past it; their tokens are dropped, so the output does not depend on it
    (a ``generator`` does advance by those steps).
    ``streamer`` is called with each new column of tokens [batch]; with a streamer every token is
    checked.
    ``cache_graph``: replay each decode step from a CUDA graph (graphed_decoder) instead of
    running it eagerly; the tokens are the same.
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
    if eos_check_every is not None and eos_check_every < 1:
        raise ValueError(f"eos_check_every must be at least 1, got {eos_check_every}")
    if streamer is not None:
        eos_check_every = 1
    elif eos_check_every is None:
        eos_check_every = GRAPH_EOS_CHECK_EVERY if cache_graph else 1
    if eos_token_id is None:
        eos_token_id = model.config.eos_token_id
    if cache_graph:
        cache, step = graphed_decoder(model, input_ids.shape[0], input_ids.device)
        cache.seqlen_offset = 0
    else:
        cache = model.allocate_cache(input_ids.shape[0], device=input_ids.device)

        def step(next_ids):
            return model(next_ids[:, None], cache=cache)[:, -1]
    logits = model(input_ids, cache=cache, num_last_tokens=1)[:, -1]
    tokens = [input_ids]
    finished = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
    all_finished = []  # per token since the last check: whether every row had finished (on the device)
    for i in range(max_new_tokens):
        next_ids = sample_next(logits, temperature, top_k, top_p, generator)
        next_ids = torch.where(finished, torch.full_like(next_ids, eos_token_id), next_ids)
        tokens.append(next_ids[:, None])
        if streamer is not None:
            streamer(next_ids)
        finished |= next_ids == eos_token_id
        all_finished.append(finished.all())
        last = i == max_new_tokens - 1
        if last or len(all_finished) == eos_check_every:
            done = torch.stack(all_finished).nonzero()  # waits for the device
            if len(done):  # drop the tokens after the first at which every row had finished
                del tokens[len(tokens) - len(all_finished) + int(done[0]) + 1:]
                break
            all_finished.clear()
        if last:
            break
        logits = step(next_ids)
    return torch.cat(tokens, dim=1)
