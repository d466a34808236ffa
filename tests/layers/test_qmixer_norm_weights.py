"""QMambaMixer with weighted norms of dt, B and C (Jamba's), against the FP JambaMambaMixer it
was quantized from: on the normed embeddings of random tokens (not the calibration's) of several
shapes (odd lengths, batch > 1, one token), in the int8 mode and its float simulation, and the
decode step against the prefill."""
import pytest
import torch

import quamba
from quamba.layers.base import QuantModule
from quamba.layers.qmixer import QMambaMixer
from quamba.models.jamba import JambaConfig, JambaLM
from quamba.ops.quant import quantize
from tests.models.hybrid_checks import randomize_, rel, token_ids

# two Jamba layers: a Mamba mixer (d_inner 46, dt_rank 5, d_state 3) and attention, gated MLPs
CONFIG = dict(d_model=23, num_hidden_layers=2, vocab_size=67, dt_rank=5, d_state=3,
              num_attention_heads=1, num_key_value_heads=1, head_dim=23, attn_layer_period=2,
              attn_layer_offset=1, intermediate_size=15, num_experts=1, num_experts_per_tok=1)


@pytest.fixture(scope="module")
def mixers():
    """(the FP model, its first mixer's W8A8 form, the quantized norm before it)."""
    torch.manual_seed(0)
    fp = randomize_(JambaLM(JambaConfig(**CONFIG)).eval())
    qmodel = quamba.quantize(fp, None, quamba.QuantConfig(),
                             calib_data=token_ids(67, 8, 64, seed=3), progress=False)
    block = qmodel.backbone.layers[0]
    assert isinstance(block.mixer, QMambaMixer) and block.mixer.mixer_norm_weights is not None
    return fp, block.mixer, block.norm


def normed_input(fp, qnorm, batch: int, length: int):
    """The first block's normed input on random tokens: (the float one, its int8 codes)."""
    hidden = fp.backbone.embedding(token_ids(67, batch, length, seed=batch * 100 + length))
    norm = fp.backbone.layers[0].norm
    normed = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight
    return normed, quantize(normed, qnorm.scales["out_scale"])


def set_mode(mixer, mode: str) -> None:
    for module in mixer.modules():
        if isinstance(module, QuantModule):
            module.set_mode(mode)


@pytest.mark.parametrize("batch, length", [(4, 1), (2, 7), (3, 33)])
def test_the_int8_mixer_and_its_simulation_follow_the_fp_mixer(mixers, batch, length):
    """Measured 0.070, 0.068 and 0.076 off the FP mixer (as much with the norm weights set to 1:
    0.073 at 3 × 33; a single token of small output can be 0.46 off); the simulation 1.2e-7 off
    the int8 mode."""
    fp, qmixer, norm = mixers
    with torch.no_grad():
        normed, codes = normed_input(fp, norm, batch, length)
        reference = fp.backbone.layers[0].mixer(normed)
        int8 = qmixer(codes)
        set_mode(qmixer, "float-sim-asic-int8")
        simulated = qmixer(codes.float() * norm.scales["out_scale"])
    set_mode(qmixer, "int8")
    assert rel(int8, reference) < 0.1 and rel(simulated, int8) < 1e-5


def test_the_decode_steps_follow_the_prefill(mixers):
    """With an fp32 state the steps equal the prefill's outputs to float rounding."""
    fp, qmixer, norm = mixers
    qmixer.state_cache = "fp32"
    try:
        state = qmixer.allocate_state(2)
        with torch.no_grad():
            _, codes = normed_input(fp, norm, 2, 13)
            full = qmixer(codes)
            prefill = qmixer(codes[:, :6], state=state)
            steps = torch.cat([qmixer(codes[:, t:t + 1], state=state, step=True)
                               for t in range(6, 13)], 1)
    finally:
        qmixer.state_cache = "int8"
    assert rel(prefill, full[:, :6]) < 1e-6 and rel(steps, full[:, 6:]) < 1e-4
