"""Zamba2 in FP: logits equal to transformers' Zamba2ForCausalLM, decode against prefill, generate
against transformers' greedy tokens, the shared blocks held once, and the configs quamba
refuses."""
import json

import pytest
import torch
from transformers import Zamba2Config, Zamba2ForCausalLM

import quamba
from quamba.errors import CheckpointError
from quamba.models.zamba2 import Zamba2LM
from tests.models.hybrid_checks import randomize_, rel, token_ids

# Odd sizes: 3 Mamba layers and 3 hybrid layers over 2 shared blocks (block 0 used twice);
# 2 B/C groups of 6 Mamba heads of 12, d_state 5, chunk 8 (a prompt of 37 ends in a partial
# chunk); 3 attention heads of 24 (2 · 36 / 3) with RoPE; adapters of rank 4 on q, k, v and
# gate_up; Δ floored at 0.01.
HF_CONFIG = dict(vocab_size=97, hidden_size=36, num_hidden_layers=6,
                 layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "hybrid", "mamba"],
                 mamba_d_state=5, n_mamba_heads=6, mamba_ngroups=2, chunk_size=8,
                 num_attention_heads=3, num_key_value_heads=3, intermediate_size=22,
                 num_mem_blocks=2, use_shared_attention_adapter=True, adapter_rank=4,
                 use_mem_rope=True, time_step_min=0.01)


def random_reference(seed: int = 0, **changes) -> Zamba2ForCausalLM:
    torch.manual_seed(seed)
    return randomize_(Zamba2ForCausalLM(Zamba2Config(**{**HF_CONFIG, **changes})).eval())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("zamba2")
    random_reference().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model(hf_dir):
    return quamba.load_model(hf_dir, tokenizer=False)[0]


def ids(batch: int, length: int, seed: int = 1):
    return token_ids(HF_CONFIG["vocab_size"], batch, length, seed)


def test_logits_equal_transformers_zamba2(model):
    assert isinstance(model, Zamba2LM) and model.config.n_layer == 6
    layers = model.backbone.layers
    assert len(model.backbone.shared_blocks) == 2
    assert layers[1].shared is layers[4].shared is model.backbone.shared_blocks[0]
    assert layers[3].shared is model.backbone.shared_blocks[1] and layers[0].shared is None
    assert layers[1].adapters.gate_up[1].weight.abs().sum() > 0
    tokens = ids(2, 37)
    with torch.no_grad():
        assert rel(model(tokens), random_reference()(tokens).logits) < 1e-4


def test_without_attention_adapters_or_rope_and_with_kv_groups(tmp_path):
    reference = random_reference(seed=4, use_shared_attention_adapter=False, use_mem_rope=False,
                                 num_key_value_heads=1, num_mem_blocks=1)
    reference.save_pretrained(tmp_path)
    model = quamba.load_model(tmp_path, tokenizer=False)[0]
    assert len(model.backbone.shared_blocks) == 1 and model.backbone.layers[3].adapters.qkv is None
    tokens = ids(1, 21)
    with torch.no_grad():
        assert rel(model(tokens), reference(tokens).logits) < 1e-4


def test_the_dt_floor_binds_in_the_test(model):
    mixer = model.backbone.layers[0].mixer
    with torch.no_grad():
        _, _, dt = torch.split(mixer.in_proj(model.backbone.embedding(ids(2, 37))),
                               [mixer.d_inner, mixer.conv_dim, mixer.nheads], dim=-1)
        delta = torch.nn.functional.softplus(dt + mixer.dt_bias)
    assert 0.05 < (delta < HF_CONFIG["time_step_min"]).float().mean() < 0.95


def test_decode_steps_follow_the_prefill(model):
    """Each use of a shared block keeps its own KV cache."""
    tokens = ids(3, 29, seed=2)
    with torch.no_grad():
        full = model(tokens)
        cache = model.allocate_cache(3)
        model(tokens[:, :17], cache=cache)
        steps = model(tokens[:, 17:], cache=cache)
        assert cache.states[1].attention.length.item() == 29
        assert cache.states[1].attention.key is not cache.states[4].attention.key
    assert rel(steps, full[:, 17:]) < 1e-5


def test_greedy_generate_equals_transformers(tmp_path):
    """transformers' decode step leaves Δ unfloored (its prefill floors it; quamba floors both),
    so the reference here has a floor that never binds."""
    reference = random_reference(seed=5, time_step_min=1e-9)
    reference.save_pretrained(tmp_path)
    model = quamba.load_model(tmp_path, tokenizer=False)[0]
    prompt = ids(2, 11, seed=3)
    reference.generation_config.eos_token_id = None
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, eos_token_id=-1), expected)


def write_config(tmp_path, **changes):
    """A copy of the model directory with config.json changed (None drops a field)."""
    source = tmp_path.parent / "zamba2-src"
    if not source.exists():
        random_reference().save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(source / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="silu"), "hidden_act 'silu' is not supported (only 'gelu')"),
    (dict(add_bias_linear=True), "add_bias_linear True is not supported (only False)"),
    (dict(use_long_context=True), "use_long_context True is not supported (only False)"),
    (dict(tie_word_embeddings=False), "tie_word_embeddings False is not supported"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0)),
     "rope_type 'yarn' is not supported (only 'default')"),
    (dict(num_key_value_heads=1), "use_shared_attention_adapter with num_key_value_heads 1"),
    (dict(layers_block_type=["mamba", "attention"]), "layer types ['attention'] are not "
     "supported; supported: mamba, linear_attention, hybrid"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, changes, message):
    with pytest.raises(CheckpointError, match="config.json: " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        quamba.load_model(write_config(tmp_path, **changes), tokenizer=False)


def test_saving_in_a_hub_layout_is_refused(model, tmp_path):
    with pytest.raises(CheckpointError, match="saving a Zamba2LM in a Hub layout"):
        quamba.save_model(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
