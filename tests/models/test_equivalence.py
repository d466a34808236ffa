"""quamba's Mamba1 LM against transformers' MambaForCausalLM on the same random weights, and
decoding (cache, generate, sampling) against the full forward pass."""
import pytest
import torch
from transformers import MambaForCausalLM

from quamba.errors import QuambaError
from quamba.models import MambaConfig, MambaLMHeadModel, load_model, randomize_, save_model
from quamba.models.generation import sample_next
from quamba.models.mamba import step_ssm_A

CONFIGS = {
    "d64": dict(d_model=64, n_layer=2, vocab_size=100, d_state=8),
    "d64-residual-in-model-dtype": dict(d_model=64, n_layer=2, vocab_size=100, d_state=8,
                                        residual_in_fp32=False),
    "d192": dict(d_model=192, n_layer=2, vocab_size=300, d_state=16),
}
LAYOUTS = ("transformers", "mamba_ssm")


def max_relative_error(actual, expected) -> float:
    """Largest absolute difference relative to the largest magnitude of ``expected``."""
    return ((actual.float() - expected.float()).abs().max() / expected.float().abs().max()).item()


def random_ids(config: MambaConfig, batch: int, seqlen: int, seed: int = 0):
    return torch.randint(0, config.vocab_size, (batch, seqlen), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=list(CONFIGS))
def saved(request, tmp_path_factory):
    """A randomized model and a directory holding it in both Hub layouts (one subdirectory each)."""
    config = MambaConfig(**CONFIGS[request.param])
    model = randomize_(MambaLMHeadModel(config), seed=0).eval()
    root = tmp_path_factory.mktemp(request.param)
    for layout in LAYOUTS:
        save_model(model, root / layout, layout=layout)
    return model, root


@pytest.fixture(scope="module")
def hf_model(saved):
    _, root = saved
    return MambaForCausalLM.from_pretrained(root / "transformers", dtype=torch.float32).eval()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("batch, seqlen", [(1, 1), (3, 13)])
def test_logits_match_transformers(saved, hf_model, layout, batch, seqlen):
    model, root = saved
    ours, _ = load_model(root / layout, tokenizer=False)
    assert ours.source["layout"] == layout
    ids = random_ids(model.config, batch, seqlen)
    with torch.no_grad():
        expected = hf_model(ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    assert max_relative_error(got, expected) <= 1e-4


@pytest.mark.parametrize("prefill_len", [1, 2, 6])
def test_decode_steps_reproduce_full_forward(saved, prefill_len):
    """A prefill then one token at a time gives, position by position, the full forward's logits
    (prefills shorter than the conv width exercise the zero-padded conv state)."""
    model, _ = saved
    ids = random_ids(model.config, 2, 11, seed=1)
    with torch.no_grad():
        full = model(ids)
        cache = model.allocate_cache(2)
        prefill = model(ids[:, :prefill_len], cache=cache)
        assert max_relative_error(prefill, full[:, :prefill_len]) <= 1e-5
        for t in range(prefill_len, ids.shape[1]):
            step = model(ids[:, t:t + 1], cache=cache)
            assert max_relative_error(step[:, 0], full[:, t]) <= 1e-4, f"position {t}"
    assert cache.seqlen_offset == ids.shape[1]


def test_greedy_generate_matches_transformers(saved, hf_model):
    model, _ = saved
    prompt = random_ids(model.config, 2, 5, seed=2)
    ours = model.generate(prompt, max_new_tokens=10)
    expected = hf_model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10,
                                 do_sample=False)
    assert torch.equal(ours, expected)


@pytest.mark.parametrize("sampling", [dict(top_k=5, temperature=0.8), dict(top_k=0, top_p=0.9)])
def test_sampling_is_reproducible_with_a_seeded_generator(saved, sampling):
    model, _ = saved
    prompt = random_ids(model.config, 2, 4, seed=3)
    runs = [model.generate(prompt, max_new_tokens=8, eos_token_id=-1,
                           generator=torch.Generator().manual_seed(7), **sampling) for _ in range(2)]
    assert torch.equal(runs[0], runs[1])
    assert runs[0].shape == (2, 12)


@pytest.mark.parametrize("batch", [1, 2])
def test_generate_stops_once_every_row_has_produced_eos(saved, batch):
    """Checking for every row having finished every 8 tokens gives the output of checking after
    each: it ends with the first token by which every row has produced eos, rows that finished
    earlier padded with eos."""
    model, _ = saved
    prompt = random_ids(model.config, batch, 5, seed=5)

    def run(eos, every):
        return model.generate(prompt, max_new_tokens=40, temperature=1.0, top_k=0, eos_token_id=eos,
                              generator=torch.Generator().manual_seed(0), eos_check_every=every)[:, 5:]
    free = run(-1, 1)
    lengths = []
    for eos in sorted(set.intersection(*(set(row.tolist()) for row in free))):
        new = run(eos, 8)
        assert torch.equal(new, run(eos, 1))
        first_eos = [int((row == eos).nonzero()[0]) for row in new if (row == eos).any()]
        if new.shape[1] < 40:
            assert len(first_eos) == batch and new.shape[1] == max(first_eos) + 1
        for row, first in zip(new, first_eos):
            assert (row[first:] == eos).all()
        lengths.append(new.shape[1])
    assert any(length < 40 and length % 8 for length in lengths)  # between two checks
    if batch == 1:
        assert any(length < 8 for length in lengths)  # before the first check


def test_generate_rejects_a_check_interval_below_one(saved):
    model, _ = saved
    with pytest.raises(ValueError, match="eos_check_every must be at least 1"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, eos_check_every=0)


def test_top_k_samples_only_the_k_most_likely_tokens():
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.0, 1.8]]).repeat(3000, 1)
    picked = sample_next(logits, temperature=1.0, top_k=3, generator=torch.Generator().manual_seed(0))
    assert set(picked.tolist()) == {1, 3, 5}


def test_top_p_samples_only_the_nucleus():
    # probabilities 0.5, 0.3, 0.1, 0.05, 0.05: with top_p 0.75 the nucleus is {0, 1}
    logits = torch.tensor([[0.5, 0.3, 0.1, 0.05, 0.05]]).log().repeat(3000, 1)
    picked = sample_next(logits, temperature=1.0, top_k=0, top_p=0.75,
                         generator=torch.Generator().manual_seed(0))
    assert set(picked.tolist()) == {0, 1}


def test_greedy_when_top_k_is_one_or_temperature_zero():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample_next(logits, top_k=1), logits.argmax(-1))
    assert torch.equal(sample_next(logits, temperature=0, top_k=10), logits.argmax(-1))


@pytest.mark.parametrize("dtype, torch_dtype, tolerance", [("fp16", torch.float16, 1e-2),
                                                          ("bf16", torch.bfloat16, 5e-2)])
def test_half_precision_forward_is_close_to_fp32(saved, dtype, torch_dtype, tolerance):
    model, root = saved
    half, _ = load_model(root / "transformers", dtype=dtype, tokenizer=False)
    assert all(m.A_log.dtype == torch.float32 and m.D.dtype == torch.float32 for m in half.mixers())
    ids = random_ids(model.config, 2, 9, seed=4)
    with torch.no_grad():
        got = half(ids)
        expected = model(ids)
    assert got.dtype == torch_dtype
    assert max_relative_error(got, expected) <= tolerance


def test_cache_graph_needs_a_cuda_device(saved):
    model, _ = saved
    with pytest.raises(QuambaError, match="CUDA graphs need a CUDA device"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=2, cache_graph=True)


def test_a_copy_of_the_model_holds_no_decode_graphs(saved):
    from copy import deepcopy

    from quamba.models.generation import _GraphCache
    model, _ = saved
    graphs = _GraphCache()
    graphs[(1, "cuda:0", None)] = object()  # stands for a captured graph (no GPU here)
    model.__dict__["_decode_graphs"] = graphs
    try:
        assert deepcopy(model).__dict__["_decode_graphs"] == {}
    finally:
        del model.__dict__["_decode_graphs"]


@pytest.mark.parametrize("weights", ["fp", "w4a16"])
@pytest.mark.parametrize("batch, seqlen", [(1, 7), (3, 13)])
def test_in_proj_channel_major_matches_the_module_call(saved, weights, batch, seqlen):
    """The prefill computes in_proj as W · hᵀ, [2·d_inner, batch · seqlen] (no copies before the scan),
    also for a 4-bit in_proj; with a hook on in_proj (calibration, GPTQ) it calls the module instead:
    same logits."""
    model, _ = saved
    if weights == "w4a16":
        from copy import deepcopy

        from quamba.layers.weight_only import weight_only_mixer_from_float
        model = deepcopy(model)
        for block in model.backbone.layers:
            block.mixer = weight_only_mixer_from_float(block.mixer, group_size=64)
    mixer = next(iter(model.mixers()))
    h = torch.randn(batch, seqlen, model.config.d_model, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        xz = mixer._in_proj_channel_major(h)
        assert xz.shape == (batch, 2 * model.config.d_inner, seqlen)
        assert xz.stride() == (seqlen, batch * seqlen, 1)
        torch.testing.assert_close(xz, mixer.in_proj(h).transpose(1, 2), rtol=1e-5, atol=1e-6)
        ids = random_ids(model.config, batch, seqlen, seed=6)
        fast = model(ids)
        seen = []
        handle = mixer.in_proj.register_forward_hook(lambda module, inputs, output: seen.append(output))
        try:
            hooked = model(ids)
        finally:
            handle.remove()
    assert len(seen) == 1
    assert max_relative_error(fast, hooked) <= 1e-5


def per_layer_A_step(model, ids, cache):
    """One decode step with each mixer computing its own A = -exp(A_log), as before step_ssm_A."""
    hidden, residual = model.backbone.embedding(ids), None
    for block, state in zip(model.backbone.layers, cache.states):
        hidden, residual = block(hidden, residual, state=state, step=True)
    cache.seqlen_offset += 1
    return model._head(hidden, residual)


def test_decode_step_takes_A_of_all_layers_at_once_and_sees_A_log_edits(saved):
    """The decode step takes every FP mixer's A from one multi-tensor exp and neg (step_ssm_A): the
    mixer's own values, so the logits of steps computing A per layer to the bit; A_log edited in
    place between steps (``.data``, which no cache key would see) changes the next step."""
    from copy import deepcopy
    model = deepcopy(saved[0])
    layers = model.backbone.layers
    for block, A in zip(layers, step_ssm_A(layers)):
        assert torch.equal(A, -torch.exp(block.mixer.A_log.float()))
    ids = random_ids(model.config, 2, 6, seed=7)
    with torch.no_grad():
        batched, per_layer = model.allocate_cache(2), model.allocate_cache(2)
        model(ids[:, :3], cache=batched)
        model(ids[:, :3], cache=per_layer)
        for t in (3, 4):
            assert torch.equal(model(ids[:, t:t + 1], cache=batched),
                               per_layer_A_step(model, ids[:, t:t + 1], per_layer))
        before = model(ids[:, 5:6], cache=deepcopy(batched))
        layers[0].mixer.A_log.data.mul_(0.5)
        after = model(ids[:, 5:6], cache=batched)
        assert torch.equal(after, per_layer_A_step(model, ids[:, 5:6], per_layer))
    assert not torch.equal(after, before)
