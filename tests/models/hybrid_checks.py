"""What the hybrid families' FP tests share: random weights of a realistic scale for a
transformers reference model, random token ids, the relative error they compare by, and the
checks every family runs (logits and greedy tokens against transformers, decode against prefill,
Δ's floor, refused configs), parametrized by the family's model and vocabulary."""
import json
import re

import pytest
import torch

import quamba
from quamba.errors import CheckpointError


@torch.no_grad()
def randomize_(model, dt_bias_shift: float = -4.5):
    """Random weights of realistic scale; dt_bias around ``dt_bias_shift``, low enough that Δ's
    floor binds on some tokens; norm weights near 1."""
    for name, param in model.named_parameters():
        if name.endswith("A_log"):
            param.copy_(torch.log(torch.rand_like(param) * 15 + 1))
        elif name.endswith(".D"):
            param.copy_(torch.rand_like(param) + 0.5)
        elif name.endswith("dt_bias"):
            param.copy_(torch.randn_like(param) + dt_bias_shift)
        elif "norm" in name:
            param.copy_(1 + 0.1 * torch.randn_like(param))
        else:
            param.copy_(torch.randn_like(param) * 0.2)
    return model


def token_ids(vocab_size: int, batch: int, length: int, seed: int = 1) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


def random_model(model_class, config, seed: int, dt_bias_shift: float = -4.5):
    """A transformers ``model_class`` of ``config`` in eval mode, its weights those of
    randomize_ after seeding torch with ``seed``."""
    torch.manual_seed(seed)
    return randomize_(model_class(config).eval(), dt_bias_shift)


def load(directory):
    return quamba.load_model(directory, tokenizer=False)[0]


def saved(reference, directory):
    """``reference`` saved in ``directory``, which is returned."""
    reference.save_pretrained(directory)
    return directory


def assert_logits_equal_the_reference(model, reference, tokens):
    with torch.no_grad():
        assert rel(model(tokens), reference(tokens).logits) < 1e-4


def assert_decode_steps_follow_the_prefill(model, tokens, prefill_length: int):
    """A prefill of ``prefill_length`` tokens, then the rest in one call on its cache: the latter
    equal the full forward's last logits. Returns the cache."""
    with torch.no_grad():
        full = model(tokens)
        cache = model.allocate_cache(tokens.shape[0])
        model(tokens[:, :prefill_length], cache=cache)
        steps = model(tokens[:, prefill_length:], cache=cache)
    assert rel(steps, full[:, prefill_length:]) < 1e-5
    return cache


def assert_greedy_generate_equals(model, reference, prompt, new_tokens: int):
    """Without an eos token on either side, so both generate ``new_tokens`` tokens."""
    reference.generation_config.eos_token_id = None
    expected = reference.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=new_tokens, eos_token_id=-1),
                       expected)


def assert_the_dt_floor_binds(model, tokens, floor: float):
    """Δ of the first Mamba2 mixer falls below ``floor`` on some tokens, not on all."""
    mixer = model.backbone.layers[0].mixer
    with torch.no_grad():
        _, _, dt = torch.split(mixer.in_proj(model.backbone.embedding(tokens)),
                               [mixer.d_inner, mixer.conv_dim, mixer.nheads], dim=-1)
        delta = torch.nn.functional.softplus(dt + mixer.dt_bias)
    assert 0.05 < (delta < floor).float().mean() < 0.95


def write_config(tmp_path, random_reference, source_name: str, **changes):
    """A copy of the directory of ``random_reference()`` (saved once, in ``source_name`` beside
    ``tmp_path``) with config.json changed (None drops a field)."""
    source = tmp_path.parent / source_name
    if not source.exists():
        random_reference().save_pretrained(source)
    config = json.loads((source / "config.json").read_text())
    config.update(changes)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").symlink_to(source / "model.safetensors")
    return tmp_path


def assert_config_refused(directory, message: str):
    with pytest.raises(CheckpointError, match="config.json: " + re.escape(message)):
        quamba.load_model(directory, tokenizer=False)


def assert_saving_in_a_hub_layout_is_refused(model, directory, class_name: str):
    with pytest.raises(CheckpointError, match=f"saving a {class_name} in a Hub layout"):
        quamba.save_model(model, directory)
    assert not directory.exists()


def assert_graph_decoding_is_refused_for_moe_layers(model, class_name: str, tokens):
    with pytest.raises(quamba.QuambaError, match=f"^{class_name} cannot decode from CUDA graphs: "
                       "its MoE layers read their expert routing on the host$"):
        model.generate(tokens, max_new_tokens=2, cache_graph=True)
