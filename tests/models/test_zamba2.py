"""Zamba2 in FP: logits equal to transformers' Zamba2ForCausalLM, decode against prefill, generate
against transformers' greedy tokens, the shared blocks held once, and the configs quamba
refuses."""
import pytest
from transformers import Zamba2Config, Zamba2ForCausalLM

from quamba.models.zamba2 import Zamba2LM
from tests.models import hybrid_checks as checks

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
    return checks.random_model(Zamba2ForCausalLM, Zamba2Config(**{**HF_CONFIG, **changes}), seed)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return checks.load(checks.saved(random_reference(), tmp_path_factory.mktemp("zamba2")))


def ids(batch: int, length: int, seed: int = 1):
    return checks.token_ids(HF_CONFIG["vocab_size"], batch, length, seed)


def test_logits_equal_transformers_zamba2(model):
    assert isinstance(model, Zamba2LM) and model.config.n_layer == 6
    layers = model.backbone.layers
    assert len(model.backbone.shared_blocks) == 2
    assert layers[1].shared is layers[4].shared is model.backbone.shared_blocks[0]
    assert layers[3].shared is model.backbone.shared_blocks[1] and layers[0].shared is None
    assert layers[1].adapters.gate_up[1].weight.abs().sum() > 0
    checks.assert_logits_equal_the_reference(model, random_reference(), ids(2, 37))


def test_without_attention_adapters_or_rope_and_with_kv_groups(tmp_path):
    reference = random_reference(seed=4, use_shared_attention_adapter=False, use_mem_rope=False,
                                 num_key_value_heads=1, num_mem_blocks=1)
    model = checks.load(checks.saved(reference, tmp_path))
    assert len(model.backbone.shared_blocks) == 1 and model.backbone.layers[3].adapters.qkv is None
    checks.assert_logits_equal_the_reference(model, reference, ids(1, 21))


def test_the_dt_floor_binds_in_the_test(model):
    checks.assert_the_dt_floor_binds(model, ids(2, 37), HF_CONFIG["time_step_min"])


def test_decode_steps_follow_the_prefill(model):
    """Each use of a shared block keeps its own KV cache."""
    cache = checks.assert_decode_steps_follow_the_prefill(model, ids(3, 29, seed=2), 17)
    assert cache.states[1].attention.length.item() == 29
    assert cache.states[1].attention.key is not cache.states[4].attention.key


def test_greedy_generate_equals_transformers(tmp_path):
    """transformers' decode step leaves Δ unfloored (its prefill floors it; quamba floors both),
    so the reference here has a floor that never binds."""
    reference = random_reference(seed=5, time_step_min=1e-9)
    model = checks.load(checks.saved(reference, tmp_path))
    checks.assert_greedy_generate_equals(model, reference, ids(2, 11, seed=3), 12)


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
    checks.assert_config_refused(
        checks.write_config(tmp_path, random_reference, "zamba2-src", **changes), message)


def test_saving_in_a_hub_layout_is_refused(model, tmp_path):
    checks.assert_saving_in_a_hub_layout_is_refused(model, tmp_path / "out", "Zamba2LM")
