"""Falcon-H1 in FP: logits equal to transformers' FalconH1ForCausalLM (µP multipliers ≠ 1),
decode against prefill, generate against transformers' greedy tokens, and the configs quamba
refuses."""
import pytest
import torch
from transformers import FalconH1Config, FalconH1ForCausalLM

import quamba
from quamba.models.falcon_h1 import FalconH1LM
from tests.models import hybrid_checks as checks

# Odd sizes: 3 layers; 2 B/C groups of 6 Mamba heads of 5 (mamba_d_ssm 30), d_state 7, chunk 8
# (a prompt of 37 ends in a partial chunk); 3 attention heads of 12 over 1 KV head; every µP
# multiplier ≠ 1 and biases in the attention, the MLP and the Mamba projections.
HF_CONFIG = dict(vocab_size=97, hidden_size=36, num_hidden_layers=3, intermediate_size=22,
                 mamba_d_ssm=30, mamba_n_heads=6, mamba_n_groups=2, mamba_d_state=7,
                 mamba_chunk_size=8, num_attention_heads=3, num_key_value_heads=1,
                 attention_bias=True, mlp_bias=True, mamba_proj_bias=True,
                 projectors_bias=True, tie_word_embeddings=False,
                 embedding_multiplier=1.7, lm_head_multiplier=0.6, key_multiplier=1.3,
                 attention_in_multiplier=0.8, attention_out_multiplier=1.2,
                 ssm_in_multiplier=0.9, ssm_out_multiplier=1.4,
                 ssm_multipliers=[0.7, 1.3, 0.8, 1.2, 0.5], mlp_multipliers=[1.1, 0.75])


def random_reference(seed: int = 0, **changes) -> FalconH1ForCausalLM:
    config = FalconH1Config(**{**HF_CONFIG, **changes})
    return checks.random_model(FalconH1ForCausalLM, config, seed, dt_bias_shift=-3)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return checks.saved(random_reference(), tmp_path_factory.mktemp("falcon_h1"))


@pytest.fixture(scope="module")
def model(hf_dir):
    return checks.load(hf_dir)


def ids(batch: int, length: int, seed: int = 1):
    return checks.token_ids(HF_CONFIG["vocab_size"], batch, length, seed)


def test_logits_equal_transformers_falcon_h1(model):
    assert isinstance(model, FalconH1LM) and model.config.n_layer == 6
    assert model.config.headdim == 5 and model.config.head_dim == 12
    checks.assert_logits_equal_the_reference(model, random_reference(), ids(2, 37))


def test_gated_norm_tied_embeddings_head_dim_and_a_dt_floor(tmp_path):
    """Mamba2's gated RMSNorm, attention heads of 10 (not hidden_size / 3), Δ floored at 0.05
    (transformers floors it in a prefill only, so no decode is compared here)."""
    reference = random_reference(seed=4, tie_word_embeddings=True, mamba_rms_norm=True,
                                 mamba_norm_before_gate=False, head_dim=10,
                                 time_step_limit=(0.05, float("inf")))
    model = checks.load(checks.saved(reference, tmp_path))
    assert model.lm_head.weight is model.backbone.embedding.weight
    assert model.backbone.layers[0].mixer.self_attn.q_proj.out_features == 30
    checks.assert_logits_equal_the_reference(model, reference, ids(1, 21))


def test_decode_steps_follow_the_prefill(model):
    checks.assert_decode_steps_follow_the_prefill(model, ids(3, 29, seed=2), 17)


def test_greedy_generate_equals_transformers(model):
    checks.assert_greedy_generate_equals(model, random_reference(), ids(2, 11, seed=3), 12)


def test_fp16_keeps_the_ssm_parameters_fp32(hf_dir):
    half = quamba.load_model(hf_dir, dtype="fp16", tokenizer=False)[0]
    mamba = half.backbone.layers[0].mixer.mamba
    assert mamba.in_proj.weight.dtype == torch.float16
    assert all(p.dtype == torch.float32 for p in (mamba.A_log, mamba.D, mamba.dt_bias))


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported (only 'silu')"),
    (dict(time_step_limit=[0.0, 0.1]), "time_step_limit [0.0, 0.1] is not supported"),
    (dict(rope_parameters=dict(rope_type="yarn", factor=2.0)),
     "rope_type 'yarn' is not supported (only 'default')"),
    (dict(mamba_rms_norm=True, mamba_norm_before_gate=True),
     "mamba_norm_before_gate with mamba_rms_norm is not supported"),
    (dict(projectors_bias=False), "mamba_proj_bias and projectors_bias differ"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, changes, message):
    checks.assert_config_refused(
        checks.write_config(tmp_path, random_reference, "falcon-h1-src", **changes), message)


def test_saving_in_a_hub_layout_is_refused(model, tmp_path):
    checks.assert_saving_in_a_hub_layout_is_refused(model, tmp_path / "out", "FalconH1LM")
