"""The Hadamard rotation of a hybrid's residual stream leaves the FP model's function unchanged
(relative error of the fp32 logits ≤ 1e-5, prefill and decode), for each family it covers, on
random small models; the quantized rotated hybrids stay close to FP and reload bit for bit; a
width without a Hadamard matrix is quantized unrotated, with a warning saying why.

d_model 40 (H of order 40) and 24 (12·2), d_inner 24 and 40: non-symmetric Hadamard matrices,
so a transposed H anywhere would show."""
import copy
import logging

import pytest
import torch

import quamba
from quamba.models.bamba import BambaConfig, BambaLM
from quamba.models.falcon_h1 import FalconH1Config, FalconH1LM
from quamba.models.jamba import JambaConfig, JambaLM
from quamba.models.nemotron_h import NemotronHConfig, NemotronHLM
from quamba.models.zamba2 import Zamba2Config, Zamba2LM
from quamba.models.quantized_hybrid import (QuantizedBambaLM, QuantizedFalconH1LM,
                                            QuantizedJambaLM, QuantizedNemotronHLM,
                                            QuantizedZamba2LM)
from quamba.ops.norm.hadamard import HadamardTransform
from quamba.quantization.rotation import rotate_model_
from tests.models.hybrid_checks import randomize_, token_ids
from tests.quantization.hybrid_checks import assert_reload_is_bit_identical, logits, rel

VOCAB = 97
MAMBA2 = dict(d_state=5, nheads=6, headdim=4, ngroups=2, chunk_size=8)  # d_inner 24
ATTENTION = dict(num_attention_heads=4, num_key_value_heads=2)


def _nemotron_h():
    return NemotronHLM(NemotronHConfig(
        pattern="M*M-E*-EM", d_model=40, vocab_size=VOCAB, **MAMBA2, **ATTENTION,
        attention_head_dim=10, intermediate_size=22, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=14, moe_shared_expert_intermediate_size=18))


def _bamba():
    return BambaLM(BambaConfig(layer_types=("mamba", "attention", "mamba"), d_model=40,
                               vocab_size=VOCAB, **MAMBA2, **ATTENTION, rotary_dim=6,
                               intermediate_size=22))


def _granite():
    """Granite-4.0-H: MoE feed-forwards and the µP embedding multiplier and logits scaling."""
    return BambaLM(BambaConfig(
        layer_types=("mamba", "attention", "mamba"), d_model=24, vocab_size=VOCAB, **MAMBA2,
        **ATTENTION, rotary_dim=0, intermediate_size=18, num_experts=4, expert_size=14,
        embedding_multiplier=6.0, attention_multiplier=0.2, logits_scaling=3.0,
        model_type="granitemoehybrid"))


def _jamba():
    """Mamba1 layers (d_inner 80 = expand 2 · 40) with weighted norms, attention, MoE."""
    return JambaLM(JambaConfig(d_model=40, num_hidden_layers=4, vocab_size=VOCAB, d_state=5,
                               **ATTENTION, head_dim=10, attn_layer_period=2,
                               attn_layer_offset=1, intermediate_size=22, num_experts=4))


def _falcon_h1(mamba_rms_norm: bool):
    """Parallel Mamba2 (d_inner 40) and attention; µP embedding and lm_head multipliers."""
    return FalconH1LM(FalconH1Config(
        num_hidden_layers=2, d_model=24, vocab_size=VOCAB, d_inner=40, d_state=5, nheads=5,
        headdim=8, ngroups=1, chunk_size=8, mamba_rms_norm=mamba_rms_norm, **ATTENTION,
        head_dim=6, intermediate_size=22, embedding_multiplier=3.0, lm_head_multiplier=0.5))


def _zamba2():
    """Two shared blocks (block 0 run by layers 1 and 4) with RoPE and q, k, v adapters."""
    return Zamba2LM(Zamba2Config(
        layer_types=("mamba", "hybrid", "mamba", "hybrid", "hybrid"), d_model=24,
        vocab_size=VOCAB, **MAMBA2, num_attention_heads=4, num_key_value_heads=4, use_rope=True,
        intermediate_size=22, num_mem_blocks=2, adapter_rank=3, attention_adapters=True))


# family → (FP model, its quantized class, bound on W8A8's relative error against FP). Measured
# W8A8 rotated / unrotated (calibration 4 × 32 random tokens, 2 × 21 tokens): Nemotron-H 0.136 /
# 0.115, Bamba 0.091 / 0.087, Granite 0.043 / 0.044, Jamba 0.254 / 0.354, Falcon-H1 0.036 / 0.041
# (with its gated norm 0.044 / 0.051), Zamba2 0.186 / 0.210. Random models amplify any rounding;
# the accuracy that counts is the trained model's (test_quantize_tiny_hybrid.py).
FAMILIES = {"nemotron_h": (_nemotron_h, QuantizedNemotronHLM, 0.2),
            "bamba": (_bamba, QuantizedBambaLM, 0.15),
            "granite": (_granite, QuantizedBambaLM, 0.08),
            "jamba": (_jamba, QuantizedJambaLM, 0.35),
            "falcon_h1": (lambda: _falcon_h1(False), QuantizedFalconH1LM, 0.07),
            "falcon_h1_rms_norm": (lambda: _falcon_h1(True), QuantizedFalconH1LM, 0.07),
            "zamba2": (_zamba2, QuantizedZamba2LM, 0.25)}


def _random(family: str):
    torch.manual_seed(0)
    return randomize_(FAMILIES[family][0]()).eval()


def _prefill_then_decode(model, tokens):
    cache = model.allocate_cache(tokens.shape[0])
    with torch.no_grad():
        out = [model(tokens[:, :11], cache=cache)]
        out += [model(tokens[:, t:t + 1], cache=cache) for t in range(11, tokens.shape[1])]
    return torch.cat(out, dim=1).float()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rotation_preserves_the_logits(family):
    model = _random(family)
    rotated = rotate_model_(copy.deepcopy(model))
    tokens = token_ids(VOCAB, 2, 15)
    assert rel(logits(rotated, tokens), logits(model, tokens)) <= 1e-5
    assert rel(_prefill_then_decode(rotated, tokens), _prefill_then_decode(model, tokens)) <= 1e-5
    assert not torch.allclose(rotated.backbone.embedding.weight, model.backbone.embedding.weight)
    mambas = [m for m in rotated.modules() if hasattr(m, "online_hadamard")]
    assert mambas and all(isinstance(m.online_hadamard, HadamardTransform) for m in mambas)
    assert all(torch.all(block.norm.weight == 1) for block in rotated.backbone.layers)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_rotated_hybrid_quantizes_and_reloads_bit_identically(family, tmp_path):
    """W8A8 by default (rotated): close to FP on the random model and bit-identical on reload."""
    model, (_, quantized_class, bound) = _random(family), FAMILIES[family]
    qmodel = quamba.quantize(model, None, quamba.QuantConfig(),
                             calib_data=token_ids(VOCAB, 4, 32, 5), progress=False)
    assert qmodel.quant_config.hadamard
    tokens = token_ids(VOCAB, 2, 21)
    assert rel(logits(qmodel, tokens), logits(model, tokens)) < bound
    assert_reload_is_bit_identical(qmodel, tmp_path / family, tokens, quantized_class, 12, 8)


def test_rotated_w4a16_hybrid_reloads_bit_identically(tmp_path):
    """W4A16 rotates only when asked (hadamard=True): its FP Mamba2 mixers rotate y online.
    Measured 0.169 off FP (unrotated 0.182)."""
    model = _random("bamba")
    config = quamba.QuantConfig(w_bits=4, a_bits=16, group_size=2, hadamard=True)
    qmodel = quamba.quantize(model, None, config, progress=False)
    tokens = token_ids(VOCAB, 2, 21)
    assert rel(logits(qmodel, tokens), logits(model, tokens)) < 0.25
    assert_reload_is_bit_identical(qmodel, tmp_path, tokens, QuantizedBambaLM, 12, 16)


def test_rotated_hybrid_with_int8_head_and_embedding_reloads_bit_identically(tmp_path):
    """The int8 head reads the weightless final norm of a rotated model (its weight in lm_head).
    Measured 0.142 off FP."""
    model = _random("nemotron_h")
    config = quamba.QuantConfig(lm_head="int8", quantize_embedding=True)
    qmodel = quamba.quantize(model, None, config, calib_data=token_ids(VOCAB, 4, 32, 5),
                             progress=False)
    assert qmodel.backbone.norm_f.weight is None
    tokens = token_ids(VOCAB, 2, 21)
    assert rel(logits(qmodel, tokens), logits(model, tokens)) < FAMILIES["nemotron_h"][2]
    assert_reload_is_bit_identical(qmodel, tmp_path, tokens, QuantizedNemotronHLM, 12, 8)


def test_hybrids_without_an_exact_rotation_are_quantized_unrotated(caplog):
    """A d_model without a Hadamard matrix (36): quantized unrotated, the warning says why."""
    model = randomize_(NemotronHLM(NemotronHConfig(
        pattern="M-", d_model=36, vocab_size=VOCAB, **MAMBA2, intermediate_size=22)))
    with caplog.at_level(logging.WARNING, logger="quamba"):
        qmodel = quamba.quantize(model, None, quamba.QuantConfig(),
                                 calib_data=token_ids(VOCAB, 2, 16), progress=False)
    assert not qmodel.quant_config.hadamard
    assert ("no Hadamard rotation: nemotron_h: cannot rotate d_model: no Hadamard matrix of "
            "size 36") in caplog.text
