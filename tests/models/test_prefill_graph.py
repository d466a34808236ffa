"""Graphed prefill without a GPU: its argument errors, the LRU cache that keeps prefill graphs per
batch size, its bookkeeping (which graph, which cache, which static tensors) with stand-in graphs,
and what a replayed prefill graph relies on to reset the decode cache: every mixer's prefill
overwrites the whole of its state (conv state, SSM state, foh drive), in every SSM mode and state
cache format. The graphs themselves: tests/models/test_cuda_prefill_graph.py."""
import dataclasses
import gc
import weakref

import pytest
import torch

import quamba
from quamba.errors import QuambaError
from quamba.models import generation
from quamba.models.config import MambaConfig
from quamba.models.generation import LRUCache, graphed_prefill
from quamba.models.mamba import MambaLMHeadModel, randomize_

VOCAB = 101
MAMBA1 = dict(d_model=64, n_layer=2, vocab_size=VOCAB, d_state=8)
MAMBA2 = dict(d_model=96, n_layer=2, vocab_size=VOCAB, layer="Mamba2", headdim=12, ngroups=2,
              d_state=16, chunk_size=16)


def fp_model(**config):
    return randomize_(MambaLMHeadModel(MambaConfig(**config))).eval()


def quantized(fp, **recipe):
    calib = torch.randint(0, VOCAB, (8, 45), generator=torch.Generator().manual_seed(1))
    return quamba.quantize(fp, config=quamba.QuantConfig(**recipe), calib_data=calib, progress=False)


def tokens(batch, length, seed):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


# (model, SSM mode or None for an FP model): each mixer kind and each cache layout it allocates
MODELS = {
    "mamba1 fp": (lambda: fp_model(**MAMBA1), None),
    "mamba1 fp foh": (lambda: fp_model(**MAMBA1, discretization="foh"), None),
    "mamba1 w8a8": (lambda: quantized(fp_model(**MAMBA1)), "int8"),
    "mamba1 w8a8 float-sim": (lambda: quantized(fp_model(**MAMBA1)), "float-sim-asic-int8"),
    "mamba1 w8a8 fp32-conv": (lambda: quantized(fp_model(**MAMBA1)), "fp32-conv"),
    "mamba1 w8a8 foh fp32 state": (lambda: quantized(fp_model(**MAMBA1, discretization="foh"),
                                                     state_cache="fp32"), "int8"),
    "mamba1 w8a8 foh float-sim": (lambda: quantized(fp_model(**MAMBA1, discretization="foh")),
                                  "float-sim-asic-int8"),
    "mamba1 w4a8": (lambda: quantized(fp_model(**MAMBA1), w_bits=4, group_size=32), "int8"),
    "mamba1 w4a16": (lambda: quantized(fp_model(**MAMBA1), w_bits=4, a_bits=16, group_size=32), None),
    "mamba2 fp": (lambda: fp_model(**MAMBA2), None),
    "mamba2 w8a8": (lambda: quantized(fp_model(**MAMBA2)), "int8"),
    "mamba2 w8a8 float-sim": (lambda: quantized(fp_model(**MAMBA2)), "float-sim-asic-int8"),
}


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    make, mode = MODELS[request.param]
    model = make()
    if mode is not None:
        model.set_ssm_mode(mode)
    return model


def state_tensors(cache) -> list[tuple[str, torch.Tensor | None]]:
    """(layer.field, tensor or None) for every field of every layer's MixerState."""
    return [(f"layer {i} {field.name}", getattr(state, field.name))
            for i, state in enumerate(cache.states) for field in dataclasses.fields(state)]


def poison_(cache) -> None:
    """Fill every state tensor with what no prefill writes: NaN, or -128 for int8 codes (quantize
    saturates at ±127)."""
    for _, tensor in state_tensors(cache):
        if tensor is not None:
            tensor.fill_(-128 if tensor.dtype == torch.int8 else float("nan"))


@pytest.mark.parametrize("prompt_len", [2, 9])  # 2: fewer tokens than the conv state holds
def test_a_prefill_overwrites_every_part_of_the_cache(model, prompt_len):
    ids = tokens(2, prompt_len, seed=prompt_len)
    with torch.inference_mode():
        fresh = model.allocate_cache(2)
        expected = model(ids, cache=fresh, num_last_tokens=1)
        used = model.allocate_cache(2)
        poison_(used)
        got = model(ids, cache=used, num_last_tokens=1)
    assert torch.equal(got, expected)
    assert used.seqlen_offset == fresh.seqlen_offset == prompt_len
    for (name, tensor), (_, reference) in zip(state_tensors(used), state_tensors(fresh)):
        assert (tensor is None) == (reference is None), name
        assert tensor is None or torch.equal(tensor, reference), f"{name} keeps what it held"


def test_foh_caches_carry_a_drive(model):
    """The foh rows above check the drive: their caches have one."""
    drives = [state.drive for state in model.allocate_cache(1).states]
    foh = any(getattr(m, "discretization", None) == "foh" for m in model.modules())
    assert all(d is not None for d in drives) if foh else all(d is None for d in drives)



class StandInGraph:
    """Replays by calling the captured function again, on the CPU, writing its result into the
    output of the capture (as a CUDA graph's replay rewrites its static output)."""

    def __init__(self, fn):
        self.fn = fn
        self.output = fn()

    def replay(self):
        self.output.copy_(self.fn())


def stand_in_capture(fn, pool):
    graph = StandInGraph(fn)
    return graph, graph.output


@pytest.fixture
def stand_in_graphs(model, monkeypatch):
    """CUDA graphs replaced by StandInGraph on any device, so that generate(cache_graph=True,
    prefill_graph=True) runs its bookkeeping on the CPU; yields the prompt lengths captured."""
    lengths = []
    capture = generation.PrefillGraph

    def recording(model, cache, batch_size, prompt_len, *args):
        lengths.append(prompt_len)
        return capture(model, cache, batch_size, prompt_len, *args)

    monkeypatch.setattr(generation, "PrefillGraph", recording)
    monkeypatch.setattr(generation, "_warm_up", lambda fn, device, runs: fn())
    monkeypatch.setattr(generation, "_capture", stand_in_capture)
    monkeypatch.setattr(generation, "_cuda_device", torch.device)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    yield lengths
    model.__dict__.pop("_decode_graphs", None)


def test_graphed_generation_prefills_into_the_decode_cache(model, stand_in_graphs):
    """With stand-in graphs the replays recompute, so equal tokens mean that the prefill graph and
    the decode graph share one cache and that the static inputs and logits are wired right."""
    for length, seed in ((5, 0), (9, 1), (5, 2)):
        ids = tokens(2, length, seed)
        eager = model.generate(ids, max_new_tokens=6, eos_token_id=-1)
        graphed = model.generate(ids, max_new_tokens=6, eos_token_id=-1, cache_graph=True,
                                 prefill_graph=True)
        assert torch.equal(graphed, eager)
    assert stand_in_graphs == [5, 9]
    cache, _ = generation.graphed_decoder(model, 2, "cpu")
    with torch.inference_mode():
        logits = graphed_prefill(model, tokens(2, 9, 3))
        expected = model(tokens(2, 9, 3), cache=model.allocate_cache(2), num_last_tokens=1)[:, -1]
    assert torch.equal(logits, expected) and cache.seqlen_offset == 9
    assert generation._decoder_graphs(model, 2, "cpu").prefills.keys() == [5, 9]

# --- arguments ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_model():
    return fp_model(**MAMBA1)


def test_prefill_graph_needs_cache_graph(small_model):
    with pytest.raises(ValueError, match="prefill_graph replays the prefill into the decode graph's "
                                         "cache: it needs cache_graph=True"):
        small_model.generate(tokens(1, 5, 0), max_new_tokens=2, prefill_graph=True)


def test_prefill_graph_on_the_cpu_needs_a_cuda_device(small_model):
    with pytest.raises(QuambaError, match="CUDA graphs need a CUDA device, the model is on cpu"):
        small_model.generate(tokens(1, 5, 0), max_new_tokens=2, cache_graph=True, prefill_graph=True)
    with pytest.raises(QuambaError, match="CUDA graphs need a CUDA device"):
        graphed_prefill(small_model, tokens(1, 5, 0))


@pytest.mark.parametrize("shape", [(5,), (1, 0)])
def test_graphed_prefill_takes_a_batch_of_prompts(small_model, shape):
    with pytest.raises(ValueError, match="input_ids must be \\[batch, prompt_len\\]"):
        graphed_prefill(small_model, torch.zeros(shape, dtype=torch.long))


# --- the LRU cache of prefill graphs --------------------------------------------------------------

class Made:
    """Counts what an LRUCache made, by key."""

    def __init__(self):
        self.keys = []

    def maker(self, key):
        def make():
            self.keys.append(key)
            return object()
        return make


def test_lru_cache_makes_each_key_once_while_held():
    made, lru = Made(), LRUCache(2)
    first = lru.get(10, made.maker(10))
    assert lru.get(10, made.maker(10)) is first
    assert made.keys == [10]


def test_lru_cache_drops_the_least_recently_used():
    made, lru = Made(), LRUCache(2)
    for key in (10, 20, 10, 30):  # 10 used after 20: 20 goes
        lru.get(key, made.maker(key))
    assert lru.keys() == [10, 30]
    lru.get(20, made.maker(20))  # made again; 10 goes
    assert made.keys == [10, 20, 30, 20]
    assert lru.keys() == [30, 20]


def test_lru_cache_frees_what_it_drops():
    class Graph:
        pass

    lru = LRUCache(1)
    dropped = weakref.ref(lru.get("a", Graph))
    kept = lru.get("b", Graph)
    gc.collect()
    assert dropped() is None and lru.get("b", Graph) is kept


def test_lru_cache_holds_at_least_one_value():
    with pytest.raises(ValueError, match="at least one value, got capacity 0"):
        LRUCache(0)
