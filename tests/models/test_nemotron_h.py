"""Nemotron-H in FP: logits equal to transformers' NemotronHForCausalLM, decode against prefill,
generate against transformers' greedy tokens, and the configs quamba refuses."""
import json

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

import quamba
from quamba.errors import CheckpointError
from quamba.models.nemotron_h import NemotronHLM
from tests.models import hybrid_checks as checks

# Odd sizes: every layer kind twice; 2 B/C groups of 3 Mamba heads of 6, d_state 5, chunk 8 (a
# prompt of 37 ends in a partial chunk); 3 attention heads of 10 over 1 KV head; 6 experts in 2
# groups, 2 a token from the best group; the MoE's shared expert a different size.
HF_CONFIG = dict(vocab_size=97, hidden_size=36, hybrid_override_pattern="M*M-E*-EM",
                 mamba_num_heads=6, mamba_head_dim=6, n_groups=2, ssm_state_size=5, chunk_size=8,
                 num_attention_heads=3, num_key_value_heads=1, head_dim=10, intermediate_size=22,
                 n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1,
                 moe_intermediate_size=14, moe_shared_expert_intermediate_size=18,
                 routed_scaling_factor=1.5, time_step_min=0.01, tie_word_embeddings=False)


def random_reference(seed: int = 0) -> NemotronHForCausalLM:
    """Random weights of realistic scale; dt_bias low enough that Δ's floor (time_step_min) binds
    on some tokens."""
    config = NemotronHConfig(**HF_CONFIG, experts_implementation="eager")  # odd sizes
    model = checks.random_model(NemotronHForCausalLM, config, seed)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return checks.saved(random_reference(), tmp_path_factory.mktemp("nemotron-h"))


@pytest.fixture(scope="module")
def model(hf_dir):
    return checks.load(hf_dir)


def ids(batch: int, length: int, seed: int = 1):
    return checks.token_ids(HF_CONFIG["vocab_size"], batch, length, seed)


def test_logits_equal_transformers_nemotron_h(model):
    assert isinstance(model, NemotronHLM) and model.config.pattern == "M*M-E*-EM"
    assert model.source["layout"] == "transformers"
    checks.assert_logits_equal_the_reference(model, random_reference(), ids(2, 37))


def test_the_dt_floor_binds_in_the_test(model):
    checks.assert_the_dt_floor_binds(model, ids(2, 37), HF_CONFIG["time_step_min"])


def test_decode_steps_follow_the_prefill(model):
    checks.assert_decode_steps_follow_the_prefill(model, ids(3, 29, seed=2), 17)


def test_greedy_generate_equals_transformers(model):
    """Without an eos token on either side: the random model emits eos (2) in this prompt."""
    checks.assert_greedy_generate_equals(model, random_reference(), ids(2, 11, seed=3), 12)


def test_fp16_keeps_the_router_and_ssm_parameters_fp32(hf_dir):
    model, _ = quamba.load_model(hf_dir, dtype="fp16", tokenizer=False)
    moe, mamba = model.backbone.layers[4].mixer, model.backbone.layers[0].mixer
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert mamba.A_log.dtype == torch.float32 and mamba.in_proj.weight.dtype == torch.float16


@pytest.mark.parametrize("changes, message", [
    (dict(layers_block_type=["linear_attention", "sliding_attention"]),
     "layer types ['sliding_attention'] are not supported; supported: linear_attention, "
     "full_attention, mlp, moe"),
    (dict(layers_block_type=None, hybrid_override_pattern="M*X"),
     "layer types ['X'] are not supported; supported: M (linear_attention)"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act 'silu' is not supported (only 'relu2')"),
    (dict(moe_latent_size=8), "moe_latent_size 8 is not supported (only None)"),
    (dict(sliding_window=16), "sliding_window 16 is not supported (only None)"),
    (dict(residual_in_fp32=True), "residual_in_fp32 True is not supported (only False)"),
    (dict(n_group=4), "6 experts in n_group 4"),
])
def test_unsupported_options_are_refused_by_name(tmp_path, changes, message):
    checks.assert_config_refused(
        checks.write_config(tmp_path, random_reference, "src", **changes), message)


@pytest.mark.parametrize("model_type", ["zamba"])
def test_other_hybrids_are_refused_naming_the_supported_types(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type,
                                                      "hidden_size": 64}))
    with pytest.raises(CheckpointError, match=f"model_type '{model_type}' .* not supported; "
                       "supported: mamba, falcon_mamba, mamba2, nemotron_h"):
        quamba.load_model(tmp_path, tokenizer=False)


def test_saving_in_a_hub_layout_is_refused(model, tmp_path):
    checks.assert_saving_in_a_hub_layout_is_refused(model, tmp_path / "out", "NemotronHLM")


def test_decoding_from_cuda_graphs_is_refused_for_moe_layers(model):
    checks.assert_graph_decoding_is_refused_for_moe_layers(model, "NemotronHLM", ids(1, 4))
