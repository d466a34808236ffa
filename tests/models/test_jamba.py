"""Jamba in FP: logits equal to transformers' JambaForCausalLM (loaded from the directory its
save_pretrained writes), decode against prefill, generate against transformers' greedy tokens,
and what quamba refuses."""
import json

import pytest
import torch
from transformers import JambaConfig, JambaForCausalLM

from quamba.models.jamba import JambaLM, JambaMambaMixer
from quamba.models.transformer_layers import Attention, GatedMLP, MoE
from tests.models import hybrid_checks as checks

# Odd sizes, every kind twice: layers 1 and 3 attention (3 heads of 12 over 1 KV head), 0, 2 and
# 4 Mamba (d_inner 72, dt_rank 7, d_state 5); layers 1 and 4 MoE (5 experts, 2 a token), the
# others gated MLPs (22 wide).
HF_CONFIG = dict(vocab_size=101, hidden_size=36, intermediate_size=22, num_hidden_layers=5,
                 num_attention_heads=3, num_key_value_heads=1, attn_layer_period=2,
                 attn_layer_offset=1, num_experts=5, num_experts_per_tok=2,
                 expert_layer_period=3, expert_layer_offset=1, mamba_d_state=5, mamba_expand=2,
                 mamba_dt_rank=7, rms_norm_eps=1e-5, tie_word_embeddings=False,
                 use_mamba_kernels=False)


def random_reference(seed: int = 0, std: float = 0.2) -> JambaForCausalLM:
    """Random weights of realistic scale (``std``), norm weights (those of dt, B and C too) near
    1."""
    torch.manual_seed(seed)
    model = JambaForCausalLM(JambaConfig(**HF_CONFIG, experts_implementation="eager")).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand_like(param) * 15 + 1))
            elif name.endswith((".D", "dt_proj.bias")):
                param.add_(0.1 * torch.randn_like(param))
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * std)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return checks.saved(random_reference(), tmp_path_factory.mktemp("jamba"))


@pytest.fixture(scope="module")
def model(hf_dir):
    return checks.load(hf_dir)


def ids(batch: int, length: int, seed: int = 1):
    return checks.token_ids(HF_CONFIG["vocab_size"], batch, length, seed)


def test_each_layer_is_two_blocks_of_the_right_kinds(hf_dir, model):
    assert json.loads((hf_dir / "config.json").read_text())["model_type"] == "jamba"
    assert isinstance(model, JambaLM) and model.source["layout"] == "transformers"
    assert model.config.num_hidden_layers == 5 and model.config.n_layer == 10
    kinds = [type(block.mixer) for block in model.backbone.layers]
    assert kinds == [JambaMambaMixer, GatedMLP, Attention, MoE, JambaMambaMixer, GatedMLP,
                     Attention, GatedMLP, JambaMambaMixer, MoE]


def test_logits_equal_transformers_jamba(model):
    checks.assert_logits_equal_the_reference(model, random_reference(), ids(2, 23))


def test_the_norm_weights_are_the_checkpoints(model):
    reference = random_reference().model.layers[2].mamba
    mixer = model.backbone.layers[4].mixer
    for name in ("dt_layernorm", "b_layernorm", "c_layernorm"):
        weight = getattr(reference, name).weight
        assert torch.equal(getattr(mixer, name).weight, weight) and (weight != 1).all()


def test_decode_steps_follow_the_prefill(model):
    checks.assert_decode_steps_follow_the_prefill(model, ids(3, 19, seed=2), 11)


def test_greedy_generate_equals_transformers(model):
    checks.assert_greedy_generate_equals(model, random_reference(), ids(2, 9, seed=3), 10)


@pytest.mark.parametrize("changes, message", [
    (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported (only 'silu')"),
    (dict(attn_layer_offset=2), "attn_layer_offset 2 is not in [0, attn_layer_period 2)"),
    (dict(num_experts_per_tok=6), "num_experts_per_tok 6 is not in [1, num_experts 5]"),
    (dict(num_key_value_heads=2), "3 attention heads do not split into 2 KV heads"),
])
def test_unsupported_options_are_refused_before_any_weight_is_read(tmp_path, changes, message):
    """The directory has no weight file: the config alone is refused."""
    config = {**JambaConfig(**HF_CONFIG).to_dict(), **changes}
    (tmp_path / "config.json").write_text(json.dumps(config))
    checks.assert_config_refused(tmp_path, message)


def test_saving_in_a_hub_layout_and_graph_decoding_are_refused(model, tmp_path):
    checks.assert_saving_in_a_hub_layout_is_refused(model, tmp_path / "out", "JambaLM")
    checks.assert_graph_decoding_is_refused_for_moe_layers(model, "JambaLM", ids(1, 4))
