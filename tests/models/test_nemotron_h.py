"""Nemotron-H in FP: logits equal to transformers' NemotronHForCausalLM, decode against prefill,
generate against transformers' greedy tokens, and the configs quamba refuses."""
import json

import pytest
import torch
from transformers import NemotronHConfig, NemotronHForCausalLM

import quamba
from quamba.errors import CheckpointError
from quamba.models.nemotron_h import NemotronHLM
from tests.models.hybrid_checks import randomize_, rel, token_ids

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
    torch.manual_seed(seed)
    config = NemotronHConfig(**HF_CONFIG, experts_implementation="eager")  # odd sizes
    model = NemotronHForCausalLM(config).eval()
    randomize_(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn_like(buffer) * 0.1)
    return model


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("nemotron-h")
    random_reference().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model(hf_dir):
    return quamba.load_model(hf_dir, tokenizer=False)[0]


def ids(batch: int, length: int, seed: int = 1):
    return token_ids(HF_CONFIG["vocab_size"], batch, length, seed)


def test_logits_equal_transformers_nemotron_h(model):
    assert isinstance(model, NemotronHLM) and model.config.pattern == "M*M-E*-EM"
    assert model.source["layout"] == "transformers"
    tokens = ids(2, 37)
    with torch.no_grad():
        assert rel(model(tokens), random_reference()(tokens).logits) < 1e-4


def test_the_dt_floor_binds_in_the_test(model):
    mixer = model.backbone.layers[0].mixer
    with torch.no_grad():
        _, _, dt = torch.split(mixer.in_proj(model.backbone.embedding(ids(2, 37))),
                               [mixer.d_inner, mixer.conv_dim, mixer.nheads], dim=-1)
        delta = torch.nn.functional.softplus(dt + mixer.dt_bias)
    assert 0.05 < (delta < HF_CONFIG["time_step_min"]).float().mean() < 0.95


def test_decode_steps_follow_the_prefill(model):
    tokens = ids(3, 29, seed=2)
    with torch.no_grad():
        full = model(tokens)
        cache = model.allocate_cache(3)
        model(tokens[:, :17], cache=cache)
        steps = model(tokens[:, 17:], cache=cache)
    assert rel(steps, full[:, 17:]) < 1e-5


def test_greedy_generate_equals_transformers(model):
    """Without an eos token on either side: the random model emits eos (2) in this prompt."""
    prompt = ids(2, 11, seed=3)
    reference = random_reference()
    reference.generation_config.eos_token_id = None
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, eos_token_id=-1), expected)


def test_fp16_keeps_the_router_and_ssm_parameters_fp32(hf_dir):
    model, _ = quamba.load_model(hf_dir, dtype="fp16", tokenizer=False)
    moe, mamba = model.backbone.layers[4].mixer, model.backbone.layers[0].mixer
    assert moe.gate.weight.dtype == moe.gate.e_score_correction_bias.dtype == torch.float32
    assert mamba.A_log.dtype == torch.float32 and mamba.in_proj.weight.dtype == torch.float16


def write_config(tmp_path, **changes):
    """A copy of the model directory with config.json changed (None drops a field)."""
    source = tmp_path.parent / "src"
    if not source.exists():
        random_reference().save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(source / "model.safetensors")
    return tmp_path


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
    with pytest.raises(CheckpointError, match="config.json: " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        quamba.load_model(write_config(tmp_path, **changes), tokenizer=False)


@pytest.mark.parametrize("model_type", ["zamba"])
def test_other_hybrids_are_refused_naming_the_supported_types(tmp_path, model_type):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type,
                                                      "hidden_size": 64}))
    with pytest.raises(CheckpointError, match=f"model_type '{model_type}' .* not supported; "
                       "supported: mamba, falcon_mamba, mamba2, nemotron_h"):
        quamba.load_model(tmp_path, tokenizer=False)


def test_saving_in_a_hub_layout_is_refused(model, tmp_path):
    with pytest.raises(CheckpointError, match="saving a NemotronHLM in a Hub layout"):
        quamba.save_model(model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_decoding_from_cuda_graphs_is_refused_for_moe_layers(model):
    with pytest.raises(quamba.QuambaError, match="^NemotronHLM cannot decode from CUDA graphs: its "
                       "MoE layers read their expert routing on the host$"):
        model.generate(ids(1, 4), max_new_tokens=2, cache_graph=True)
