"""Graphed prefill on the GPU: a prefill replayed from a CUDA graph into the decode graph's cache
gives the eager prefill's logits and cache bit for bit, and with the graphed decode steps the eager
path's tokens, for the FP test model, its W8A8 and W4A8 quantizations (Mamba1, also with the foh
discretization, whose cache carries a drive) and the Mamba2 test model (FP and W8A8); a prompt
length is captured once, and the least recently used length is dropped and freed."""
import gc
import weakref
from copy import deepcopy

import pytest
import torch

import quamba
from quamba.models import generation
from quamba.models.generation import PREFILL_GRAPHS_PER_BATCH, graphed_decoder, graphed_prefill
from quamba.ops.backend import cuda_extension_error

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MODELS = ["fp_model", "w8a8_model", "w4a8_model", "mamba2_model", "mamba2_w8a8_model"]
FOH_MODELS = ["foh_model", "w8a8_foh_model"]


def load_fp16(model_dir):
    model, _ = quamba.load_model(model_dir, dtype="fp16", device="cuda", tokenizer=False)
    return model


def calibrated(fp_model, **recipe):
    if cuda_extension_error() is not None:
        pytest.skip(cuda_extension_error())
    calib = torch.randint(0, fp_model.config.vocab_size, (8, 128), device="cuda",
                          generator=torch.Generator(device="cuda").manual_seed(0))
    return quamba.quantize(fp_model, config=quamba.QuantConfig(**recipe), calib_data=calib,
                           progress=False)


def with_foh(model):
    """A copy of ``model`` whose Mamba1 mixers discretize with foh (their decode state carries the
    last drive)."""
    model = deepcopy(model)
    for module in model.modules():
        if hasattr(module, "discretization"):
            module.discretization = "foh"
    return model


@pytest.fixture(scope="module")
def fp_model(tiny_model_dir):
    return load_fp16(tiny_model_dir)


@pytest.fixture(scope="module")
def w8a8_model(fp_model):
    return calibrated(fp_model)


@pytest.fixture(scope="module")
def w4a8_model(fp_model):
    return calibrated(fp_model, w_bits=4, group_size=64)  # d_model 192: groups of 64


@pytest.fixture(scope="module")
def mamba2_model(tiny_mamba2_dir):
    return load_fp16(tiny_mamba2_dir)


@pytest.fixture(scope="module")
def mamba2_w8a8_model(mamba2_model):
    return calibrated(mamba2_model)


@pytest.fixture(scope="module")
def foh_model(fp_model):
    return with_foh(fp_model)  # its scan runs the torch reference (mamba-ssm's kernel is zoh only)


@pytest.fixture(scope="module")
def w8a8_foh_model(w8a8_model):
    return with_foh(w8a8_model)


def prompts(batch: int, length: int, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 4000, (batch, length), device="cuda", generator=gen)


def generate(model, ids, graphed: bool):
    return model.generate(ids, max_new_tokens=16, eos_token_id=-1, cache_graph=graphed,
                          prefill_graph=graphed)


# 1: fewer tokens than the conv state holds; 301: more than one SSD chunk of 256
@pytest.mark.parametrize("length", [1, 37, 301])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("which", MODELS)
def test_graphed_prefill_and_decode_give_the_eager_tokens(request, which, batch, length):
    model = request.getfixturevalue(which)
    for seed in (0, 1):  # the second prompt replays the graph into a cache the first decoded from
        ids = prompts(batch, length, seed)
        assert torch.equal(generate(model, ids, graphed=True), generate(model, ids, graphed=False))


def state_tensors(cache) -> list:
    return [tensor for state in cache.states for tensor in (state.conv, state.ssm, state.drive)
            if tensor is not None]


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("which", MODELS + FOH_MODELS)
def test_graphed_prefill_equals_the_eager_prefill_bit_for_bit(request, which, batch):
    """Logits and every tensor of the cache, the replay coming after another prompt's prefill
    and decode steps left the cache full of other values."""
    model = request.getfixturevalue(which)
    ids, other = prompts(batch, 53, 7), prompts(batch, 53, 8)
    with torch.inference_mode():
        eager_cache = model.allocate_cache(batch, device="cuda")
        eager = model(ids, cache=eager_cache, num_last_tokens=1)[:, -1].clone()
        cache, step = graphed_decoder(model, batch, "cuda")
        next_ids = graphed_prefill(model, other).argmax(-1)  # captures the graph
        for _ in range(3):
            next_ids = step(next_ids).argmax(-1)
        graphed = graphed_prefill(model, ids)
        assert torch.equal(graphed, eager)
        assert cache.seqlen_offset == 53
        got, expected = state_tensors(cache), state_tensors(eager_cache)
        assert len(got) == len(expected)
        assert all(torch.equal(g, e) for g, e in zip(got, expected))


def recorded_captures(monkeypatch) -> list:
    """(prompt_len, weak reference to the PrefillGraph) of every prefill capture from now on."""
    captures = []
    capture = generation.PrefillGraph

    def recording(model, cache, batch_size, prompt_len, *args):
        graph = capture(model, cache, batch_size, prompt_len, *args)
        captures.append((prompt_len, weakref.ref(graph)))
        return graph

    monkeypatch.setattr(generation, "PrefillGraph", recording)
    return captures


def test_a_prompt_length_is_captured_once(w8a8_model, monkeypatch):
    w8a8_model.__dict__.pop("_decode_graphs", None)
    captures = recorded_captures(monkeypatch)
    for length, seed in ((45, 0), (45, 1), (47, 0), (45, 2)):
        ids = prompts(2, length, seed)
        assert torch.equal(generate(w8a8_model, ids, graphed=True), generate(w8a8_model, ids, graphed=False))
    assert [length for length, _ in captures] == [45, 47]


def test_the_least_recently_used_length_is_dropped_and_freed(fp_model, monkeypatch):
    fp_model.__dict__.pop("_decode_graphs", None)
    captures = recorded_captures(monkeypatch)
    lengths = [11 + 2 * i for i in range(PREFILL_GRAPHS_PER_BATCH + 1)]
    # all but the last, then the first again: the second is the least recently used
    for length in lengths[:-1] + lengths[:1] + lengths[-1:]:
        generate(fp_model, prompts(1, length, length), graphed=True)
    gc.collect()
    assert [length for length, _ in captures] == lengths
    assert captures[1][1]() is None, "the dropped graph is still alive"
    assert all(graph() is not None for i, (_, graph) in enumerate(captures) if i != 1)
    prefills = generation._decoder_graphs(fp_model, 1, "cuda").prefills
    assert prefills.keys() == lengths[2:-1] + [lengths[0], lengths[-1]]
    ids = prompts(1, lengths[1], 3)  # captured again, same tokens
    assert torch.equal(generate(fp_model, ids, graphed=True), generate(fp_model, ids, graphed=False))
    assert captures[-1][0] == lengths[1] and len(captures) == len(lengths) + 1
