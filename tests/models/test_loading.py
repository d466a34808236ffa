"""load_model: every user error is a one-line QuambaError; sharded weights and tokenizers load."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

import quamba
from quamba.errors import CheckpointError, ModelNotFoundError
from quamba.models import MambaConfig, MambaLMHeadModel, load_model, randomize_, save_model

CONFIG = dict(d_model=32, n_layer=2, vocab_size=64, d_state=8)


@pytest.fixture(scope="module")
def model():
    return randomize_(MambaLMHeadModel(MambaConfig(**CONFIG)), seed=0).eval()


@pytest.fixture
def model_dir(model, tmp_path):
    """A fresh transformers-layout copy of ``model`` for each test to damage."""
    return save_model(model, tmp_path / "model")


@pytest.fixture(scope="module")
def neox_tokenizer_file(shared_data_dir):
    return shared_data_dir / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"


def load_error(path, error_type, **kwargs) -> str:
    """The message of the error ``load_model(path)`` raises, checked to be a one-line QuambaError."""
    with pytest.raises(error_type) as caught:
        load_model(path, tokenizer=kwargs.pop("tokenizer", False), **kwargs)
    assert isinstance(caught.value, quamba.QuambaError)
    message = str(caught.value)
    assert message and "\n" not in message
    return message


def rewrite_weights(model_dir, edit) -> None:
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    edit(state)
    save_file(state, str(path))


def test_nonexistent_local_path(tmp_path):
    message = load_error(tmp_path / "no-such-model", ModelNotFoundError)
    assert "does not exist" in message
    assert "does not exist" in load_error("./no-such-model", ModelNotFoundError)


def test_empty_name_is_not_the_current_directory():
    assert "empty" in load_error("", ModelNotFoundError)


def test_file_instead_of_directory(model_dir):
    assert "is a file" in load_error(model_dir / "config.json", ModelNotFoundError)


def test_hub_id_not_in_cache_while_offline():
    message = load_error("quamba-tests/no-such-model", ModelNotFoundError)
    assert "quamba-tests/no-such-model" in message and "offline" in message


def test_directory_without_config(tmp_path):
    assert "no config.json" in load_error(tmp_path, CheckpointError)


@pytest.mark.parametrize("config, expected", [
    ({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}, "'llama'"),
    ({"model_type": "mamba2", "hidden_size": 64, "state_size": 128, "num_hidden_layers": 2,
      "vocab_size": 64}, "num_heads 128 x head_dim 64 is not expand x hidden_size 128"),
    ({"d_model": 64, "n_layer": 2, "vocab_size": 64, "ssm_cfg": {"layer": "Mamba3"}},
     "Mamba1 and Mamba2 models are supported"),
    ({"d_model": 64, "n_layer": 2}, "'vocab_size'"),
])
def test_config_that_is_not_a_supported_layout(model_dir, config, expected):
    (model_dir / "config.json").write_text(json.dumps(config))
    assert expected in load_error(model_dir, CheckpointError)


def test_config_that_is_not_json(model_dir):
    (model_dir / "config.json").write_text("{not json")
    assert "not valid JSON" in load_error(model_dir, CheckpointError)


def test_missing_weight_file(model_dir):
    (model_dir / "model.safetensors").unlink()
    assert "no weight file" in load_error(model_dir, CheckpointError)


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_safetensors(model_dir, damage):
    path = model_dir / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"\x00not safetensors" * 8)
    assert "cannot read weight file" in load_error(model_dir, CheckpointError)


def test_corrupt_pytorch_bin(model, tmp_path):
    model_dir = save_model(model, tmp_path / "ssm", layout="mamba_ssm")
    path = model_dir / "pytorch_model.bin"
    path.write_bytes(path.read_bytes()[:1000])
    assert "cannot read weight file" in load_error(model_dir, CheckpointError)


def test_missing_tensor_is_named(model_dir):
    rewrite_weights(model_dir, lambda state: state.pop("backbone.layers.1.mixer.D"))
    assert "backbone.layers.1.mixer.D" in load_error(model_dir, CheckpointError)


def test_shape_mismatch_is_named(model_dir):
    def widen(state):
        state["backbone.layers.0.mixer.x_proj.weight"] = torch.zeros(99, 64)
    rewrite_weights(model_dir, widen)
    message = load_error(model_dir, CheckpointError)
    assert "backbone.layers.0.mixer.x_proj.weight" in message and "(99, 64)" in message


def test_unexpected_tensor_is_named(model_dir):
    rewrite_weights(model_dir, lambda state: state.update({"backbone.extra.weight": torch.zeros(2)}))
    assert "backbone.extra.weight" in load_error(model_dir, CheckpointError)


def test_sharded_safetensors(model, model_dir):
    state = load_file(str(model_dir / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[:len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(model_dir / file))
    index = {"metadata": {}, "weight_map": {k: file for file, keys in shards.items() for k in keys}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (model_dir / "model.safetensors").unlink()
    loaded, _ = load_model(model_dir, tokenizer=False)
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}', '{"weight_map": ["a", "b"]}',
                                   '{"weight_map": {"backbone.norm_f.weight": 3}}'])
def test_malformed_shard_index(model_dir, index):
    (model_dir / "model.safetensors.index.json").write_text(index)
    (model_dir / "model.safetensors").unlink()
    assert "not a valid shard index" in load_error(model_dir, CheckpointError)


def test_sharded_index_naming_a_missing_shard(model_dir):
    index = {"weight_map": {"backbone.norm_f.weight": "model-00009-of-00009.safetensors"}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index))
    (model_dir / "model.safetensors").unlink()
    assert "model-00009-of-00009.safetensors" in load_error(model_dir, CheckpointError)


def test_tokenizer_from_the_model_directory(model, tmp_path, neox_tokenizer_file):
    from quamba.models.loading import load_tokenizer
    saved = save_model(model, tmp_path / "with-tokenizer", tokenizer=load_tokenizer(None, neox_tokenizer_file))
    _, tokenizer = load_model(saved)
    assert tokenizer("Hello world")["input_ids"] == [12092, 1533]


def test_default_tokenizer_can_be_overridden_with_a_file(model_dir, neox_tokenizer_file):
    _, tokenizer = load_model(model_dir, tokenizer=str(neox_tokenizer_file))
    assert tokenizer("Hello world")["input_ids"] == [12092, 1533]
    assert tokenizer.eos_token_id == 0


def test_default_tokenizer_unavailable_offline_is_a_one_line_error(model_dir):
    message = load_error(model_dir, ModelNotFoundError, tokenizer=None)
    assert "tokenizer" in message


@pytest.mark.parametrize("tokenizer", ["/no/such/tokenizer.json", "/no/such/tokenizer-dir"])
def test_tokenizer_override_that_does_not_exist(model_dir, tokenizer):
    assert "cannot load tokenizer" in load_error(model_dir, ModelNotFoundError, tokenizer=tokenizer)


def test_tokenizer_false_skips_the_tokenizer(model_dir):
    _, tokenizer = load_model(model_dir, tokenizer=False)
    assert tokenizer is None
