"""Vision Mamba: the bidirectional mixer against two causal mixers, keyword arguments through the
block wrapper, batch independence, Vim's checkpoint layout and its errors, save and reload."""
import argparse
import copy
import json

import pytest
import torch

import quamba
from quamba.errors import CheckpointError, QuambaError
from quamba.models.config import ConfigError
from quamba.models.mamba import MambaMixer, randomize_
from quamba.models.vision import VisionMamba, VisionMambaConfig
from quamba.models.vision_loading import save_vision_model
from quamba.quantization.rotation import rotate_vision_model_


def small_config(**overrides) -> VisionMambaConfig:
    values = dict(img_size=12, patch_size=4, stride=2, channels=3, d_model=24, n_layer=2, d_state=6,
                  num_classes=7)
    values.update(overrides)
    return VisionMambaConfig(**values)


def random_model(seed=0, **overrides) -> VisionMamba:
    return randomize_(VisionMamba(small_config(**overrides)).eval(), seed=seed)


def images(batch, config, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, config.channels, config.img_size, config.img_size, generator=gen)


def causal_mixer(state: dict, config, backward: bool) -> MambaMixer:
    """A Mamba1 mixer holding one direction's weights of a bidirectional mixer's state."""
    mixer = MambaMixer(config)
    rename = {"conv1d": "conv1d_b", "x_proj": "x_proj_b", "dt_proj": "dt_proj_b", "A_log": "A_b_log",
              "D": "D_b"} if backward else {}
    own = {}
    for key in mixer.state_dict():
        head, _, tail = key.partition(".")
        own[key] = state[".".join(filter(None, (rename.get(head, head), tail)))]
    mixer.load_state_dict(own)
    return mixer


@pytest.mark.parametrize("divide_out", [True, False])
def test_bidirectional_mixer_is_two_causal_mixers_in_opposite_directions(divide_out):
    config = small_config(d_model=20, d_state=5)
    mixer = randomize_(VisionMamba(small_config(d_model=20, d_state=5, divide_out=divide_out)).eval(),
                       seed=3).layers[0].mixer
    state = mixer.state_dict()
    forward = causal_mixer(state, config.mamba_config(), backward=False)
    backward = causal_mixer(state, config.mamba_config(), backward=True)
    h = torch.randn(3, 11, 20)
    with torch.no_grad():
        expected = forward(h) + backward(h.flip(1)).flip(1)
        expected = expected / 2 if divide_out else expected
        assert torch.allclose(mixer(h), expected, atol=1e-6, rtol=1e-5)


def test_separate_branches_add_two_whole_mixers():
    model = random_model(seed=4, bimamba="separate")
    mixer = model.layers[0].mixer
    state = mixer.state_dict()
    backward_state = {**state, "in_proj.weight": state["in_proj_b.weight"],
                      "out_proj.weight": state["out_proj_b.weight"]}
    mamba = model.config.mamba_config()
    forward, backward = causal_mixer(state, mamba, False), causal_mixer(backward_state, mamba, True)
    h = torch.randn(2, 9, model.config.d_model)
    with torch.no_grad():
        expected = (forward(h) + backward(h.flip(1)).flip(1)) / 2
        assert torch.allclose(mixer(h), expected, atol=1e-6, rtol=1e-5)


def test_the_block_wrapper_passes_keyword_arguments_to_the_mixer():
    """Vim's Block calls mixer(h, inference_params=...); quamba's Block forwards such arguments."""
    model = random_model()
    block = model.layers[0]
    h = torch.randn(2, model.config.seqlen, model.config.d_model)
    with torch.no_grad():
        plain, residual = block(h)
        with_kwargs, residual_kwargs = block(h, None, inference_params=None, residual_in_fp32=True)
        assert torch.equal(plain, with_kwargs) and torch.equal(residual, residual_kwargs)
        assert torch.equal(model(images(2, model.config)), model(images(2, model.config), inference_params=None))
        with pytest.raises(QuambaError, match="no decode"):
            block(h, None, inference_params=object())
        with pytest.raises(QuambaError, match="no decode"):
            block(h, step=True)


@pytest.mark.parametrize("cls_token, pool", [("middle", "cls"), ("head", "cls"), ("none", "mean"),
                                             ("none", "last")])
def test_each_sample_is_computed_on_its_own(cls_token, pool):
    model = random_model(seed=1, cls_token=cls_token, pool=pool)
    batch = images(5, model.config, seed=2)
    with torch.no_grad():
        together = model(batch)
        alone = torch.cat([model(batch[i:i + 1]) for i in range(5)])
        order = torch.tensor([3, 0, 4, 1, 2])
        shuffled = model(batch[order])
    assert torch.allclose(together, alone, atol=1e-5, rtol=1e-5)
    assert torch.allclose(shuffled, together[order], atol=1e-5, rtol=1e-5)


def test_class_token_sits_where_the_config_says():
    config = small_config()
    model = random_model()
    assert config.grid_size == 5 and config.seqlen == config.num_patches + 1 == 26
    assert config.cls_position == 12  # Vim: after num_patches // 2 patches
    with torch.no_grad():
        tokens = model.embed(images(1, config))
        assert torch.allclose(tokens[0, 12], (model.cls_token + model.pos_embed[:, 12])[0, 0])


def test_rotation_keeps_the_classifier_function():
    model = random_model(seed=5).double()
    rotated = copy.deepcopy(model)
    rotate_vision_model_(rotated)
    x = images(3, model.config).double()
    with torch.no_grad():
        assert torch.allclose(model(x), rotated(x), atol=1e-5, rtol=1e-5)


def vim_checkpoint_dir(tmp_path, model: VisionMamba, vim_args: dict, name="vim_s_midclstok.pth"):
    """A directory as Vim's releases hold them: a training checkpoint with "model" inside, plus a
    config.json of Vim's VisionMamba arguments."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model.state_dict(), "epoch": 3, "args": argparse.Namespace(lr=1e-3)},
               tmp_path / name)
    (tmp_path / "config.json").write_text(json.dumps(vim_args))
    return tmp_path


VIM_ARGS = {"img_size": 12, "patch_size": 4, "stride": 2, "channels": 3, "embed_dim": 24, "depth": 2,
            "d_state": 6, "num_classes": 7, "rms_norm": True, "final_pool_type": "mean",
            "bimamba_type": "v2", "if_cls_token": True, "use_middle_cls_token": True,
            "if_divide_out": True}


def test_loads_vims_checkpoint_layout_and_gives_the_same_logits(tmp_path):
    model = random_model(seed=6)
    directory = vim_checkpoint_dir(tmp_path, model, VIM_ARGS)
    loaded, tokenizer = quamba.load_model(directory)
    assert tokenizer is None and isinstance(loaded, VisionMamba)
    assert loaded.source["layout"] == "vim" and loaded.config == model.config
    x = images(2, model.config)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


def test_save_and_reload_in_quambas_layout(tmp_path):
    model = random_model(seed=7, cls_token="head")
    save_vision_model(model, tmp_path / "m")
    loaded, _ = quamba.load_model(tmp_path / "m")
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "vision_mamba"
    x = images(2, model.config)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))


@pytest.mark.parametrize("change, message", [
    (lambda state, args: args.update(if_cls_token=False, final_pool_type="mean"), "the weights have a cls_token"),
    (lambda state, args: args.update(bimamba_type="separate"), "the weights are bimamba 'v2'"),
    (lambda state, args: state.pop("layers.1.mixer.D_b"), "missing tensor layers.1.mixer.D_b"),
    (lambda state, args: args.update(embed_dim=32), "config.json implies"),
    (lambda state, args: [state.pop(k) for k in list(state) if "_b" in k], "no backward branch"),
    (lambda state, args: args.update(if_rope=True), "if_rope=True is not supported"),
    (lambda state, args: state.update(extra=torch.zeros(1)), "unexpected tensor extra"),
])
def test_checkpoint_problems_are_one_line_errors(tmp_path, change, message):
    model = random_model()
    state, args = dict(model.state_dict()), dict(VIM_ARGS)
    change(state, args)
    tmp_path.mkdir(exist_ok=True)
    torch.save({"model": state}, tmp_path / "ckpt.pth")
    (tmp_path / "config.json").write_text(json.dumps(args))
    with pytest.raises(CheckpointError, match=message) as info:
        quamba.load_model(tmp_path)
    assert "\n" not in str(info.value)


def test_corrupt_weights_and_bad_configs_are_reported(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(VIM_ARGS))
    (tmp_path / "model.pth").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read weight file"):
        quamba.load_model(tmp_path)
    with pytest.raises(ConfigError, match="pool 'cls' needs a class token"):
        VisionMambaConfig(cls_token="none", pool="cls")
    with pytest.raises(QuambaError, match=r"images must be \[batch, 3, 12, 12\]"):
        random_model()(torch.zeros(1, 3, 16, 16))
