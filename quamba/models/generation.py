"""Token generation on any quamba LM (FP or quantized): prefill once, then one decode step per
token, eagerly or replayed from a CUDA graph (``cache_graph=True``); the prefill too can replay a
CUDA graph captured per prompt length (``prefill_graph=True``)."""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Callable

import torch

from quamba.errors import QuambaError
from quamba.models.state import DEFAULT_MAX_SEQLEN, InferenceCache


# Tokens between the checks for every row having finished, by default when decoding replays CUDA
# graphs. A check waits for the device; between checks the host queues the next step while the
# device runs this one, which hides the launch (128 tokens of Mamba-2.8B W8A8 at batch 1 on an
# H100: 310 ms, against 328 ms checking after each token: benchmarks/RESULTS.md). Eager steps are
# slower to launch than to run, so there each token is checked.
GRAPH_EOS_CHECK_EVERY = 8

# Prompt lengths whose prefill graphs are kept per batch size (and device and SSM mode); the least
# recently used is dropped first. A graph holds its static input ids and logits; its scratch memory
# lies in the pool that all of a model's prefill graphs share (about the largest prefill's
# activations, however many graphs are kept: a capture reuses what earlier ones freed).
PREFILL_GRAPHS_PER_BATCH = 4

# Eager prefills on a side stream before a prefill capture. One suffices: every lazy step of the
# prefill path happens in its first call (Triton's compilation and autotuning, the kernels' cached
# constants, W4A8's overflow check), and each costs a whole prefill's time at capture.
PREFILL_WARMUPS = 1

# The fewest tokens that generate's KV caches hold (hybrids): a cache holds a power of two of
# tokens, at least this many, so that a decode graph serves prompts and generations of other
# lengths. The attention runs over the whole buffer (the unused positions masked out), and eager
# decoding allocates the same length, so that both attend over buffers of one length and give the
# same tokens (sums over another length may round differently).
MIN_CACHE_SEQLEN = 256


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
    in a static tensor that the next call overwrites. Given the ``cache`` that the step writes, a
    call counts the token in its ``seqlen_offset`` and refuses a step past its KV caches, which
    the replayed graph could not check.
    """

    def __init__(self, step_fn: Callable, batch_size: int, device, pool=None, warmups: int = 2,
                 cache: InferenceCache | None = None):
        device = _cuda_device(device)
        self.cache = cache
        self.input_ids = torch.zeros(batch_size, 1, dtype=torch.long, device=device)
        _warm_up(lambda: step_fn(self.input_ids), device, warmups)
        self.graph, self.logits = _capture(lambda: step_fn(self.input_ids), pool)

    def __call__(self, next_ids: torch.Tensor) -> torch.Tensor:
        if self.cache is not None:
            self.cache.check_room(1)
        self.input_ids.copy_(next_ids.view(-1, 1))
        self.graph.replay()
        if self.cache is not None:
            self.cache.seqlen_offset += 1
        return self.logits


class PrefillGraph:
    """A prefill of ``prompt_len`` tokens per row into ``cache`` (a decode graph's), captured once
    in a CUDA graph and replayed per prompt: the host launches one graph instead of the prefill's
    hundreds of kernels.

    Every mixer's prefill overwrites the whole of its state in the cache (conv state, SSM state and
    the foh drive; tests/models/test_prefill_graph.py checks each mixer; an attention layer's
    first prompt_len positions and its length, the positions past it masked out:
    tests/models/test_kv_cache.py), so a replay resets the cache whatever it held. Calling it with
    input_ids [batch, prompt_len] returns the last position's logits [batch, vocab] in a static
    tensor that its next call overwrites, and leaves the cache as an eager prefill does
    (``seqlen_offset`` = prompt_len).

    Its static input ids and logits are allocated outside ``pool``: what the graphs sharing the
    pool keep there is only scratch that each replay writes before reading, so the graphs may be
    replayed in any order (one at a time, on one stream) without one clobbering another's result.
    """

    def __init__(self, model, cache, batch_size: int, prompt_len: int, device, pool):
        self.cache, self.prompt_len = cache, prompt_len
        self.input_ids = torch.zeros(batch_size, prompt_len, dtype=torch.long, device=device)

        def prefill():
            cache.seqlen_offset = 0  # the forward advances it; only the host sees it
            return model(self.input_ids, cache=cache, num_last_tokens=1)[:, -1]

        self.logits = torch.empty_like(_warm_up(prefill, device, PREFILL_WARMUPS))
        self.graph, _ = _capture(lambda: self.logits.copy_(prefill()), pool)

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        self.input_ids.copy_(input_ids)
        self.graph.replay()
        self.cache.seqlen_offset = self.prompt_len
        return self.logits


def _warm_up(fn: Callable[[], torch.Tensor], device: torch.device, runs: int):
    """Runs ``fn`` ``runs`` times on a side stream, as a capture needs first: lazy initialisation
    (Triton's compilation and autotuning, the kernels' cached constants, host checks that read the
    device) happens there, not in the capture, which runs nothing. Returns the last output."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    output = None
    with torch.cuda.stream(side):
        for _ in range(runs):
            output = fn()
    torch.cuda.current_stream(device).wait_stream(side)
    return output


def _capture(fn: Callable[[], torch.Tensor], pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of ``fn()``, its allocations from ``pool``, and the output of the captured call
    (a static tensor that each replay rewrites)."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        output = fn()
    return graph, output


class LRUCache:
    """At most ``capacity`` values by key. ``get`` returns a key's value, making it where missing
    and then dropping the least recently used values beyond ``capacity``; a dropped value is freed
    once nothing else holds it. (Made before the drop, a new prefill graph is captured while the
    others keep their shared pool alive: PyTorch may refuse a capture into a pool all of whose
    graphs were freed.)"""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError(f"an LRU cache holds at least one value, got capacity {capacity}")
        self.capacity = capacity
        self._values: OrderedDict = OrderedDict()

    def get(self, key: Hashable, make: Callable[[], object]):
        if key in self._values:
            self._values.move_to_end(key)
            return self._values[key]
        value = self._values[key] = make()
        while len(self._values) > self.capacity:
            self._values.popitem(last=False)
        return value

    def keys(self) -> list:
        """The keys held, the least recently used first."""
        return list(self._values)


@dataclass
class _DecoderGraphs:
    """What a model keeps per batch size (device, SSM mode, state cache format): the decode cache
    (for a hybrid, with KV caches of ``cache.max_seqlen`` tokens), its graphed decode step, and
    the prefill graphs into that cache by prompt length."""

    cache: InferenceCache
    step: GraphedStep
    prefills: LRUCache


class _GraphCache(dict):
    """The CUDA graphs kept on a model (_DecoderGraphs by batch size, device, SSM mode and state
    cache format). A copy of the model (deepcopy, pickle) starts with none: graphs are bound to
    this model's own weights and caches. The decode graphs share one memory pool, the prefill
    graphs another (see PrefillGraph)."""

    def __init__(self):
        super().__init__()
        self.pool = None
        self.prefill_pool = None

    def __deepcopy__(self, memo):
        return _GraphCache()

    def __reduce__(self):
        return (_GraphCache, ())


def graphed_decoder(model, batch_size: int, device, max_seqlen: int = DEFAULT_MAX_SEQLEN):
    """``(cache, step)`` for ``model`` at ``batch_size``: a preallocated cache and its decode step
    as a GraphedStep, captured on first use and kept on the model (per batch size, device, SSM
    mode and state cache format; the graphs share one memory pool). A hybrid's KV caches hold at
    least ``max_seqlen`` tokens (prompt and new ones; cache_seqlen); asked for more, the model
    captures a larger cache's step in place of the kept one. Prefill into ``cache`` after
    resetting its ``seqlen_offset`` to 0 (or with :func:`graphed_prefill`), then call ``step``."""
    entry = _decoder_graphs(model, batch_size, device, max_seqlen)
    return entry.cache, entry.step


@torch.inference_mode()
def graphed_prefill(model, input_ids: torch.Tensor,
                    max_seqlen: int = DEFAULT_MAX_SEQLEN) -> torch.Tensor:
    """The last position's logits [batch, vocab] of a prefill of ``input_ids`` [batch,
    prompt_len], replayed from a PrefillGraph into the cache of ``graphed_decoder(model, batch,
    device, max_seqlen)``, which it leaves ready for that decoder's steps. The first prompt of
    each length captures the graph (a warm-up prefill, the capture and a replay); later prompts of
    that length replay it. PREFILL_GRAPHS_PER_BATCH lengths are kept per batch size, the least
    recently used dropped first. The logits are a static tensor that the graph's next replay
    overwrites."""
    _check_prompt(input_ids)
    batch_size, prompt_len = input_ids.shape
    device = _cuda_device(input_ids.device)
    graphs = _graph_cache(model)
    entry = _decoder_graphs(model, batch_size, device, max_seqlen)
    if graphs.prefill_pool is None:
        graphs.prefill_pool = torch.cuda.graph_pool_handle()
    prefill = entry.prefills.get(prompt_len, lambda: PrefillGraph(
        model, entry.cache, batch_size, prompt_len, device, graphs.prefill_pool))
    return prefill(input_ids)


def _graph_cache(model) -> _GraphCache:
    return model.__dict__.setdefault("_decode_graphs", _GraphCache())


def _decoder_graphs(model, batch_size: int, device,
                    max_seqlen: int = DEFAULT_MAX_SEQLEN) -> _DecoderGraphs:
    """The _DecoderGraphs of ``model`` at ``batch_size`` on ``device`` whose cache holds
    ``max_seqlen`` tokens, its decode step captured on first use (and again, for a larger cache,
    when a longer sequence is asked for). The key holds the state cache format because a cache
    allocated for one format does not fit the other's prefill (QuantizedModel.set_state_cache),
    and whether the decode step is fused (QuantizedModel.set_fused_decode, set_fused_layer,
    set_fused_ssm_step), which a captured graph keeps."""
    _check_graphable(model)
    device = _cuda_device(device)
    graphs = _graph_cache(model)
    key = (batch_size, str(device), getattr(model, "ssm_mode", None),
           getattr(model, "state_cache", None), getattr(model, "fused_decode", None),
           getattr(model, "fused_layer", None), getattr(model, "fused_ssm_step", None))
    kept = graphs.get(key)
    if kept is None or not kept.cache.holds(max_seqlen):
        if graphs.pool is None:
            graphs.pool = torch.cuda.graph_pool_handle()
        # made before the kept entry is dropped, so that the decode pool keeps a live graph
        graphs[key] = _capture_decoder(model, batch_size, device, cache_seqlen(max_seqlen),
                                       graphs.pool)
        if kept is not None:  # its prefill graphs go with it: later ones take a fresh pool
            graphs.prefill_pool = None
    return graphs[key]


def _capture_decoder(model, batch_size: int, device, max_seqlen: int, pool) -> _DecoderGraphs:
    cache = model.allocate_cache(batch_size, device=device, max_seqlen=max_seqlen)

    def step_fn(input_ids):
        # any offset > 0 selects the decode path (the positions are on the device); the host's
        # count of the tokens is GraphedStep's to keep
        offset, cache.seqlen_offset = cache.seqlen_offset, 1
        logits = model(input_ids, cache=cache)[:, -1]
        cache.seqlen_offset = offset
        return logits

    step = GraphedStep(step_fn, batch_size, device, pool, cache=cache)
    return _DecoderGraphs(cache, step, LRUCache(PREFILL_GRAPHS_PER_BATCH))


def cache_seqlen(tokens: int) -> int:
    """The tokens that generate's KV caches hold for sequences of ``tokens``: the next power of
    two, at least MIN_CACHE_SEQLEN."""
    return max(MIN_CACHE_SEQLEN, 1 << (tokens - 1).bit_length())


def _check_graphable(model) -> None:
    """A QuambaError for a model with a layer whose decode step a CUDA graph cannot capture
    (``capture_safe = False``: the MoE layers, whose routing reads the chosen experts on the
    host)."""
    unsafe = sorted({type(module).__name__ for module in model.modules()
                     if not getattr(module, "capture_safe", True)})
    if unsafe:
        raise QuambaError(f"{type(model).__name__} cannot decode from CUDA graphs: its "
                          f"{', '.join(unsafe)} layers read their expert routing on the host")


def _check_prompt(input_ids: torch.Tensor) -> None:
    if input_ids.dim() != 2 or input_ids.shape[1] == 0:
        raise ValueError(f"input_ids must be [batch, prompt_len] with prompt_len > 0, got {tuple(input_ids.shape)}")


def _cuda_device(device) -> torch.device:
    """``device`` with its index ("cuda" is the current device), so that graphs kept by device
    find each other whichever way it was named; a QuambaError for a device that is not CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        raise QuambaError(f"CUDA graphs need a CUDA device, the model is on {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


@torch.inference_mode()
def generate(model, input_ids, max_new_tokens: int | None = None, max_length: int | None = None,
             temperature: float = 1.0, top_k: int = 1, top_p: float = 1.0,
             eos_token_id: int | None = None, generator: torch.Generator | None = None,
             streamer: Callable[[torch.Tensor], None] | None = None, cache_graph: bool = False,
             eos_check_every: int | None = None, prefill_graph: bool = False):
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
    ``prefill_graph`` (with ``cache_graph``): replay the prefill too, from a CUDA graph captured on
    the first prompt of each length into the decode graph's cache (graphed_prefill); the tokens
    are the same.
    """
    if prefill_graph and not cache_graph:
        raise ValueError("prefill_graph replays the prefill into the decode graph's cache: it needs "
                         "cache_graph=True")
    _check_prompt(input_ids)
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
    max_seqlen = cache_seqlen(prompt_len + max_new_tokens)
    if cache_graph:
        cache, step = graphed_decoder(model, input_ids.shape[0], input_ids.device, max_seqlen)
        cache.seqlen_offset = 0
    else:
        cache = model.allocate_cache(input_ids.shape[0], device=input_ids.device,
                                     max_seqlen=max_seqlen)

        def step(next_ids):
            return model(next_ids[:, None], cache=cache)[:, -1]
    if prefill_graph:
        logits = graphed_prefill(model, input_ids, max_seqlen)
    else:
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
