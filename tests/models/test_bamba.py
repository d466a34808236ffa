"""Bamba in FP: logits equal to transformers' BambaForCausalLM, decode against prefill, generate
against transformers' greedy tokens, and the configs quamba refuses."""
import json

import pytest
import torch
from transformers import BambaConfig, BambaForCausalLM

import quamba
from quamba.errors import CheckpointError
from quamba.models.bamba import BambaLM
from tests.models.hybrid_checks import randomize_, rel, token_ids

# Odd sizes: 3 Mamba layers and 2 attention layers; 2 B/C groups of 3 Mamba heads of 12, d_state
# 5, chunk 8 (a prompt of 37 ends in a partial chunk); 3 attention heads of 12 over 1 KV head,
# RoPE on half of each head (transformers' default for Bamba); Δ floored at 0.01.
HF_CONFIG = dict(vocab_size=97, hidden_size=36, num_hidden_layers=5, attn_layer_indices=[1, 3],
                 mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=5, mamba_chunk_size=8,
                 num_attention_heads=3, num_key_value_heads=1, intermediate_size=22,
                 time_step_limit=(0.01, float("inf")), tie_word_embeddings=False)


def random_reference(seed: int = 0, **changes) -> BambaForCausalLM:
    torch.manual_seed(seed)
    return randomize_(BambaForCausalLM(BambaConfig(**{**HF_CONFIG, **changes})).eval())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bamba")
    random_reference().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model(hf_dir):
    return quamba.load_model(hf_dir, tokenizer=False)[0]


def ids(batch: int, length: int, seed: int = 1):
    return token_ids(HF_CONFIG["vocab_size"], batch, length, seed)


def test_logits_equal_transformers_bamba(model):
    assert isinstance(model, BambaLM) and model.config.n_layer == 10
    assert model.config.layer_types == ("mamba", "attention", "mamba", "attention", "mamba")
    assert model.backbone.layers[2].mixer.rotary.rotary_dim == 6
    tokens = ids(2, 37)
    with torch.no_grad():
        assert rel(model(tokens), random_reference()(tokens).logits) < 1e-4


def test_full_rotary_and_tied_embeddings(tmp_path):
    reference = random_reference(seed=4, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="default", rope_theta=500.0, partial_rotary_factor=1.0))
    reference.save_pretrained(tmp_path)
    model = quamba.load_model(tmp_path, tokenizer=False)[0]
    assert model.lm_head.weight is model.backbone.embedding.weight
    tokens = ids(1, 21)
    with torch.no_grad():
        assert rel(model(tokens), reference(tokens).logits) < 1e-4


def test_the_dt_floor_binds_in_the_test(model):
    mixer = model.backbone.layers[0].mixer
    with torch.no_grad():
        _, _, dt = torch.split(mixer.in_proj(model.backbone.embedding(ids(2, 37))),
                               [mixer.d_inner, mixer.conv_dim, mixer.nheads], dim=-1)
        delta = torch.nn.functional.softplus(dt + mixer.dt_bias)
    assert 0.05 < (delta < HF_CONFIG["time_step_limit"][0]).float().mean() < 0.95


def test_decode_steps_follow_the_prefill(model):
    tokens = ids(3, 29, seed=2)
    with torch.no_grad():
        full = model(tokens)
        cache = model.allocate_cache(3)
        model(tokens[:, :17], cache=cache)
        steps = model(tokens[:, 17:], cache=cache)
    assert rel(steps, full[:, 17:]) < 1e-5


def test_greedy_generate_equals_transformers(model):
    prompt = ids(2, 11, seed=3)
    reference = random_reference()
    reference.generation_config.eos_token_id = None
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, eos_token_id=-1), expected)


def write_config(tmp_path, **changes):
    """A copy of the model directory with config.json changed (None drops a field)."""
    source = tmp_path.parent / "bamba-src"
    if not source.exists():
        random_reference().save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(source / "model.safetensors")
    return tmp_path


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported (only 'silu')"),
    (dict(time_step_limit=[0.0, 0.1]), "time_step_limit [0.0, 0.1] is not supported"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0)),
     "rope_type 'yarn' is not supported (only 'default')"),
    (dict(head_dim=16), "head_dim 16 is not supported"),
    (dict(attn_layer_indices=[1, 5]), "attn_layer_indices [5] are outside the 5 layers"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, changes, message):
    with pytest.raises(CheckpointError, match="config.json: " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        quamba.load_model(write_config(tmp_path, **changes), tokenizer=False)


def test_saving_in_a_hub_layout_is_refused(model, tmp_path):
    with pytest.raises(CheckpointError, match="saving a BambaLM in a Hub layout"):
        quamba.save_model(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()
