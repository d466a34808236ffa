"""Granite-4.0-H in FP: logits equal to transformers' GraniteMoeHybridForCausalLM (MoE and dense,
RoPE or none, the µP multipliers), decode against prefill, generate against transformers' greedy
tokens, and the configs quamba refuses."""
import json

import pytest
import torch
from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

import quamba
from quamba.errors import CheckpointError
from quamba.models.bamba import BambaLM
from tests.models.hybrid_checks import randomize_, rel
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
    torch.manual_seed(seed)
    config = GraniteMoeHybridConfig(**{**HF_CONFIG, **changes}, experts_implementation="eager")
    return randomize_(GraniteMoeHybridForCausalLM(config).eval())


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("granite")
    random_reference().save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model(hf_dir):
    return quamba.load_model(hf_dir, tokenizer=False)[0]


def test_logits_equal_transformers_granite_moe(model):
    assert isinstance(model, BambaLM) and model.model_type == "granitemoehybrid"
    assert model.config.layer_types == ("mamba", "attention", "mamba", "attention", "mamba")
    assert model.backbone.layers[2].mixer.rotary.rotary_dim == 12
    tokens = ids(2, 37)
    with torch.no_grad():
        assert rel(model(tokens), random_reference()(tokens).logits) < 1e-4


def test_dense_without_rope_and_tied_embeddings(tmp_path):
    reference = random_reference(seed=4, **DENSE)
    reference.save_pretrained(tmp_path)
    model = quamba.load_model(tmp_path, tokenizer=False)[0]
    assert model.lm_head.weight is model.backbone.embedding.weight
    assert model.backbone.layers[2].mixer.rotary is None
    tokens = ids(1, 21)
    with torch.no_grad():
        assert rel(model(tokens), reference(tokens).logits) < 1e-4


def test_decode_steps_follow_the_prefill(model):
    tokens = ids(3, 29, seed=2)
    with torch.no_grad():
        full = model(tokens)
        cache = model.allocate_cache(3)
        model(tokens[:, :17], cache=cache)
        steps = model(tokens[:, 17:], cache=cache)
    assert rel(steps, full[:, 17:]) < 1e-5


def test_greedy_generate_equals_transformers(tmp_path):
    """Without Δ's floor: transformers' decode step does not apply it (quamba's does), and
    changes a token of this prompt."""
    reference = random_reference(time_step_limit=(0.0, float("inf")))
    reference.save_pretrained(tmp_path)
    model = quamba.load_model(tmp_path, tokenizer=False)[0]
    prompt = ids(2, 11, seed=3)
    reference.generation_config.eos_token_id = None
    expected = reference.generate(prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=12, eos_token_id=-1), expected)


def write_config(tmp_path, **changes):
    """A copy of the model directory with config.json changed (None drops a field)."""
    source = tmp_path.parent / "granite-src"
    if not source.exists():
        random_reference().save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(source / "model.safetensors")
    return tmp_path


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
    with pytest.raises(CheckpointError, match="config.json: " + message.replace("(", r"\(")
                       .replace(")", r"\)").replace("[", r"\[").replace("]", r"\]")):
        quamba.load_model(write_config(tmp_path, **changes), tokenizer=False)
