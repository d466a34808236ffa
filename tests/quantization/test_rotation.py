"""Hadamard rotation of the residual stream leaves the FP model's function unchanged."""
import copy

import pytest
import torch

from quamba.models.config import MambaConfig
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.ops.norm.hadamard import HadamardTransform
from quamba.quantization.rotation import rotate_model_

BATCH, PREFILL_LEN, DECODE_STEPS = 2, 7, 3


def _random_model(d_model, bias=False, tie_embeddings=True, seed=0):
    config = MambaConfig(d_model=d_model, n_layer=2, vocab_size=100, bias=bias,
                         tie_embeddings=tie_embeddings)
    return randomize_(MambaLMHeadModel(config), seed=seed).eval()


def _max_relative_error(actual, expected):
    return ((actual - expected).abs().max() / expected.abs().max()).item()


def _prefill_then_decode(model, tokens):
    cache = model.allocate_cache(BATCH)
    logits = [model(tokens[:, :PREFILL_LEN], cache=cache)]
    logits += [model(tokens[:, t:t + 1], cache=cache) for t in range(PREFILL_LEN, tokens.shape[1])]
    return torch.cat(logits, dim=1)


# 192 = 12·16 (d_inner 384 = 12·32) and 80 = 20·4 (d_inner 160 = 20·8) have non-symmetric H:
# a transposed H anywhere would show.
@pytest.mark.parametrize("d_model, bias, tie", [(64, False, True), (192, False, True),
                                                (80, True, False)])
def test_rotation_preserves_logits_in_prefill_and_decode(d_model, bias, tie):
    model = _random_model(d_model, bias, tie)
    rotated = rotate_model_(copy.deepcopy(model))
    tokens = torch.randint(0, 100, (BATCH, PREFILL_LEN + DECODE_STEPS),
                           generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert _max_relative_error(rotated(tokens), model(tokens)) <= 1e-4
        stepped = _prefill_then_decode(model, tokens)
        rotated_stepped = _prefill_then_decode(rotated, tokens)
    assert rotated_stepped.shape == (BATCH, PREFILL_LEN + DECODE_STEPS, 104)
    assert _max_relative_error(rotated_stepped, stepped) <= 1e-4


def test_rotated_model_layout():
    model = _random_model(192)
    embedding_before = model.backbone.embedding.weight.clone()
    assert rotate_model_(model) is model
    assert model.rotated and not model.config.tie_embeddings
    assert model.lm_head.weight is not model.backbone.embedding.weight
    assert not torch.allclose(model.backbone.embedding.weight, embedding_before)
    norms = [block.norm for block in model.backbone.layers] + [model.backbone.norm_f]
    assert all(torch.equal(norm.weight, torch.ones_like(norm.weight)) for norm in norms)
    for mixer in model.mixers():
        assert isinstance(mixer.online_hadamard, HadamardTransform)
        assert mixer.online_hadamard.n == 384


def test_rotation_keeps_parameter_dtypes():
    model = _random_model(64).to(torch.bfloat16)
    dtypes = {name: t.dtype for name, t in model.state_dict().items()}
    rotate_model_(model)
    assert {name: t.dtype for name, t in model.state_dict().items()} == dtypes


def test_rotating_twice_raises():
    model = rotate_model_(_random_model(64))
    with pytest.raises(ValueError, match="already Hadamard-rotated"):
        rotate_model_(model)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rotation_on_cuda_matches_cpu():
    model = _random_model(192)
    rotated_cpu = rotate_model_(copy.deepcopy(model))
    rotated_cuda = rotate_model_(copy.deepcopy(model).cuda())
    cuda_state = rotated_cuda.state_dict()
    for name, expected in rotated_cpu.state_dict().items():
        torch.testing.assert_close(cuda_state[name].cpu(), expected, msg=name)


def test_a_width_without_a_hadamard_matrix_is_a_one_line_error():
    import quamba
    from quamba.errors import QuambaError
    model = randomize_(MambaLMHeadModel(MambaConfig(d_model=37, n_layer=1, vocab_size=64)))
    calib = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    message = (r"cannot rotate d_model: no Hadamard matrix of size 37: supported sizes .*; "
               r"quantize without it .*--no_hadamard")
    with pytest.raises(QuambaError, match=message):
        quamba.quantize(model, None, quamba.QuantConfig(), calib_data=calib, progress=False)
    quamba.quantize(model, None, quamba.QuantConfig(hadamard=False), calib_data=calib,
                    progress=False)
