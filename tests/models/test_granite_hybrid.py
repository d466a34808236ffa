"""Granite-4.0-H in FP: logits equal to transformers' GraniteMoeHybridForCausalLM (MoE and dense,
RoPE or none, the µP multipliers), decode against prefill, generate against transformers' greedy
tokens, and the configs quamba refuses."""
import pytest
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

from quamba.models.bamba import BambaLM
from tests.models import hybrid_checks as checks
from tests.models.test_bamba import ids

# Odd sizes: 3 Mamba layers and 2 attention layers; 2 B/C groups of 3 Mamba heads of 12, d_state
# 5, chunk 8 (a prompt of 37 ends in a partial chunk); 3 attention heads of 12 over 1 KV head,
# full RoPE; 5 experts of 14, 2 a token, a shared MLP of 18; every µP multiplier not 1.
HF_CONFIG = dict(vocab_size=97, hidden_size=36, num_hidden_layers=5,
                 layer_types=["mamba", "attention", "mamba", "attention", "mamba"],
                 mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=5, mamba_chunk_size=8,
                 num_attention_heads=3, num_key_value_heads=1, intermediate_size=14,
                 shared_intermediate_size=18, num_local_experts=5, num_experts_per_tok=2,
                 position_embedding_type="rope", embedding_multiplier=3.0,
                 residual_multiplier=0.4, attention_multiplier=0.2, logits_scaling=2.5,
                 time_step_limit=(0.01, float("inf")), tie_word_embeddings=False)
DENSE = dict(num_local_experts=0, position_embedding_type=None, tie_word_embeddings=True)


def random_reference(seed: int = 0, **changes) -> GraniteMoeHybridForCausalLM:
    config = GraniteMoeHybridConfig(**{**HF_CONFIG, **changes}, experts_implementation="eager")
    return checks.random_model(GraniteMoeHybridForCausalLM, config, seed)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return checks.load(checks.saved(random_reference(), tmp_path_factory.mktemp("granite")))


def test_logits_equal_transformers_granite_moe(model):
    assert isinstance(model, BambaLM) and model.model_type == "granitemoehybrid"
    assert model.config.layer_types == ("mamba", "attention", "mamba", "attention", "mamba")
    assert model.backbone.layers[2].mixer.rotary.rotary_dim == 12
    checks.assert_logits_equal_the_reference(model, random_reference(), ids(2, 37))


def test_dense_without_rope_and_tied_embeddings(tmp_path):
    reference = random_reference(seed=4, **DENSE)
    model = checks.load(checks.saved(reference, tmp_path))
    assert model.lm_head.weight is model.backbone.embedding.weight
    assert model.backbone.layers[2].mixer.rotary is None
    checks.assert_logits_equal_the_reference(model, reference, ids(1, 21))


def test_decode_steps_follow_the_prefill(model):
    checks.assert_decode_steps_follow_the_prefill(model, ids(3, 29, seed=2), 17)


def test_greedy_generate_equals_transformers(tmp_path):
    """Without Δ's floor: transformers' decode step does not apply it (quamba's does), and
    changes a token of this prompt."""
    reference = random_reference(time_step_limit=(0.0, float("inf")))
    model = checks.load(checks.saved(reference, tmp_path))
    checks.assert_greedy_generate_equals(model, reference, ids(2, 11, seed=3), 12)


@pytest.mark.parametrize("changes, message", [
    (dict(layer_types=["mamba", "sliding_attention"]),
     "layer types ['sliding_attention'] are not supported; supported: mamba"),
    (dict(position_embedding_type="alibi"), "position_embedding_type 'alibi' is not supported"),
    (dict(rope_parameters=dict(rope_type="llama3", factor=2.0)),
     "rope_type 'llama3' is not supported (only 'default')"),
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported (only 'silu')"),
    (dict(num_experts_per_tok=6), "num_experts_per_tok 6 is not in 1..5"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, changes, message):
    checks.assert_config_refused(
        checks.write_config(tmp_path, random_reference, "granite-src", **changes), message)
