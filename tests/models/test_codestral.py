"""Mamba-Codestral-7B's two layouts: Mistral's (params.json + consolidated.safetensors) and
transformers' Mamba2ForCausalLM, each loaded with logits equal to transformers' model; the
options quamba cannot honour, refused by name. (NVIDIA's Megatron-LM layout: test_megatron.py.)"""
import json

import pytest
import torch
from safetensors.torch import save_file
from transformers import Mamba2Config, Mamba2ForCausalLM

import quamba
from quamba.errors import CheckpointError
from quamba.models.config import MambaConfig, preset_config
from quamba.models.mamba import MambaLMHeadModel

# Mistral's layout fixes mamba_ssm's Mamba2 defaults (d_state 128, headdim 64, expand 2, chunk
# 256): 3 heads in 3 groups, a vocabulary of 101 padded to 104, an untied head, 2 layers.
PARAMS = dict(dim=96, n_layers=2, vocab_size=101, n_groups=3, rms_norm=True,
              residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=8,
              tie_embeddings=False, model_type="mamba")
HF_CONFIG = dict(vocab_size=104, hidden_size=96, num_hidden_layers=2, state_size=128, expand=2,
                 num_heads=3, head_dim=64, n_groups=3, chunk_size=256, tie_word_embeddings=False)
# params.json of mistralai/Mamba-Codestral-7B-v0.1 (mistral-inference's MambaArgs fields)
CODESTRAL_PARAMS = dict(dim=4096, n_layers=64, vocab_size=32768, n_groups=8, rms_norm=True,
                        residual_in_fp32=True, fused_add_norm=True, pad_vocab_size_multiple=1,
                        tie_embeddings=False, model_type="mamba")


def random_reference(seed: int = 0) -> Mamba2ForCausalLM:
    torch.manual_seed(seed)
    model = Mamba2ForCausalLM(Mamba2Config(**HF_CONFIG)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("A_log"):
                param.copy_(torch.log(torch.rand_like(param) * 15 + 1))
            elif name.endswith(".D"):
                param.copy_(torch.rand_like(param) + 0.5)
            elif name.endswith("dt_bias"):
                param.copy_(torch.randn_like(param) * 0.5 - 3)
            elif "norm" in name:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            else:
                param.copy_(torch.randn_like(param) * 0.1)
    return model


def write_mistral_layout(model: Mamba2ForCausalLM, directory, params=None):
    """The weights as mistral-inference's Mamba holds them: mamba_ssm's names under ``model.``."""
    directory.mkdir(parents=True, exist_ok=True)
    state = {"model." + key.replace("backbone.embeddings.", "backbone.embedding."):
             value.detach().clone().contiguous() for key, value in model.state_dict().items()}
    save_file(state, str(directory / "consolidated.safetensors"))
    (directory / "params.json").write_text(json.dumps(params or PARAMS))
    return directory


@pytest.fixture(scope="module")
def reference():
    return random_reference()


@pytest.fixture(scope="module")
def mistral_dir(reference, tmp_path_factory):
    return write_mistral_layout(reference, tmp_path_factory.mktemp("codestral") / "mistral")


def tokens(batch: int = 2, length: int = 300):  # two chunks of 256, the last partial
    return torch.randint(0, PARAMS["vocab_size"], (batch, length),
                         generator=torch.Generator().manual_seed(1))


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("layout", ["mistral", "transformers"])
def test_logits_equal_transformers(layout, reference, mistral_dir, tmp_path):
    if layout == "transformers":
        reference.save_pretrained(tmp_path / "hf")
    model, _ = quamba.load_model(mistral_dir if layout == "mistral" else tmp_path / "hf",
                                 tokenizer=False)
    assert model.source["layout"] == layout and not model.config.tie_embeddings
    shape = (model.config.nheads, model.config.ngroups, model.config.padded_vocab_size)
    assert shape == (3, 3, 104)
    ids = tokens()
    with torch.no_grad():
        assert rel(model(ids), reference(ids).logits) < 1e-4


def test_codestral_params_give_its_published_size():
    """7,285,403,648 parameters, the count Mistral publishes for Mamba-Codestral-7B-v0.1."""
    from quamba.models.mistral import _to_config
    config = _to_config(dict(CODESTRAL_PARAMS))
    with torch.device("meta"):
        model = MambaLMHeadModel(config)
    assert sum(p.numel() for p in model.parameters()) == 7_285_403_648
    assert (config.nheads, config.headdim, config.ngroups, config.d_state) == (128, 64, 8, 128)


def test_presets_have_the_published_shapes():
    """profile_mamba.py's codestral-mamba-7b is Codestral's params.json; mamba2-8b is NVIDIA's
    Megatron-LM model (56 layers, 256000-token vocabulary, untied)."""
    from quamba.models.mistral import _to_config
    assert preset_config("codestral-mamba-7b") == _to_config(dict(CODESTRAL_PARAMS))
    config = preset_config("mamba2-8b")
    assert (config.d_model, config.n_layer, config.nheads, config.ngroups) == (4096, 56, 128, 8)
    assert (config.padded_vocab_size, config.chunk_size) == (256000, 128)
    assert not config.tie_embeddings


def test_transformers_defaults_are_codestral():
    """A Mamba2 config.json that omits a field gets transformers' default, Codestral's shape."""
    config = MambaConfig.from_transformers({"model_type": "mamba2"})
    assert (config.d_model, config.n_layer, config.ngroups) == (4096, 64, 8)
    assert config.vocab_size == 32768
    assert (config.nheads, config.d_state, config.tie_embeddings) == (128, 128, False)


def load_error(path, **kwargs) -> str:
    with pytest.raises(CheckpointError) as caught:
        quamba.load_model(path, **{"tokenizer": False, **kwargs})
    assert "\n" not in str(caught.value)
    return str(caught.value)


@pytest.mark.parametrize("edit, message", [
    ({"rms_norm": False}, "rms_norm is false"),
    ({"model_type": "transformer"}, "model_type is 'transformer'"),
    ({"d_state": 64}, "field 'd_state' is not one of mistral-inference's MambaArgs"),
    ({"n_groups": 2}, "3 heads do not split into ngroups 2"),
    ({"dim": None}, "dim must be a positive integer, got None"),
    ({"tie_embeddings": "no"}, "tie_embeddings must be true or false, got 'no'"),
])
def test_unsupported_params_are_refused(reference, tmp_path, edit, message):
    directory = write_mistral_layout(reference, tmp_path / "m", {**PARAMS, **edit})
    assert message in load_error(directory)


def test_missing_params_field_and_weights_are_named(reference, tmp_path):
    params = {k: v for k, v in PARAMS.items() if k != "tie_embeddings"}
    assert "lacks the field 'tie_embeddings'" in load_error(
        write_mistral_layout(reference, tmp_path / "a", params))
    directory = write_mistral_layout(reference, tmp_path / "b")
    (directory / "consolidated.safetensors").unlink()
    assert "has no consolidated.safetensors" in load_error(directory)


def test_mistral_layout_needs_a_tokenizer(mistral_dir):
    assert "pass tokenizer=" in load_error(mistral_dir, tokenizer=None)


def test_hidden_act_other_than_silu_is_refused(reference, tmp_path):
    reference.save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu"}))
    assert "hidden_act 'gelu' is not supported" in load_error(tmp_path / "hf")

