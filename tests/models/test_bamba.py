"""Bamba in FP: logits equal to transformers' BambaForCausalLM, decode against prefill, generate
against transformers' greedy tokens, and the configs quamba refuses."""
import pytest
from transformers import BambaConfig, BambaForCausalLM

from quamba.models.bamba import BambaLM
from tests.models import hybrid_checks as checks

# Odd sizes: 3 Mamba layers and 2 attention layers; 2 B/C groups of 3 Mamba heads of 12, d_state
# 5, chunk 8 (a prompt of 37 ends in a partial chunk); 3 attention heads of 12 over 1 KV head,
# RoPE on half of each head (transformers' default for Bamba); Δ floored at 0.01.
HF_CONFIG = dict(vocab_size=97, hidden_size=36, num_hidden_layers=5, attn_layer_indices=[1, 3],
                 mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=5, mamba_chunk_size=8,
                 num_attention_heads=3, num_key_value_heads=1, intermediate_size=22,
                 time_step_limit=(0.01, float("inf")), tie_word_embeddings=False)


def random_reference(seed: int = 0, **changes) -> BambaForCausalLM:
    return checks.random_model(BambaForCausalLM, BambaConfig(**{**HF_CONFIG, **changes}), seed)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return checks.load(checks.saved(random_reference(), tmp_path_factory.mktemp("bamba")))


def ids(batch: int, length: int, seed: int = 1):
    return checks.token_ids(HF_CONFIG["vocab_size"], batch, length, seed)


def test_logits_equal_transformers_bamba(model):
    assert isinstance(model, BambaLM) and model.config.n_layer == 10
    assert model.config.layer_types == ("mamba", "attention", "mamba", "attention", "mamba")
    assert model.backbone.layers[2].mixer.rotary.rotary_dim == 6
    checks.assert_logits_equal_the_reference(model, random_reference(), ids(2, 37))


def test_full_rotary_and_tied_embeddings(tmp_path):
    reference = random_reference(seed=4, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="default", rope_theta=500.0, partial_rotary_factor=1.0))
    model = checks.load(checks.saved(reference, tmp_path))
    assert model.lm_head.weight is model.backbone.embedding.weight
    checks.assert_logits_equal_the_reference(model, reference, ids(1, 21))


def test_the_dt_floor_binds_in_the_test(model):
    checks.assert_the_dt_floor_binds(model, ids(2, 37), HF_CONFIG["time_step_limit"][0])


def test_decode_steps_follow_the_prefill(model):
    checks.assert_decode_steps_follow_the_prefill(model, ids(3, 29, seed=2), 17)


def test_greedy_generate_equals_transformers(model):
    checks.assert_greedy_generate_equals(model, random_reference(), ids(2, 11, seed=3), 12)


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported (only 'silu')"),
    (dict(time_step_limit=[0.0, 0.1]), "time_step_limit [0.0, 0.1] is not supported"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0)),
     "rope_type 'yarn' is not supported (only 'default')"),
    (dict(head_dim=16), "head_dim 16 is not supported"),
    (dict(attn_layer_indices=[1, 5]), "attn_layer_indices [5] are outside the 5 layers"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, changes, message):
    checks.assert_config_refused(
        checks.write_config(tmp_path, random_reference, "bamba-src", **changes), message)


def test_saving_in_a_hub_layout_is_refused(model, tmp_path):
    checks.assert_saving_in_a_hub_layout_is_refused(model, tmp_path / "out", "BambaLM")
