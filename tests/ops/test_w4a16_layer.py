"""w4a16_layer_step (quamba.ops.fused_decode.w4a16_step) on the CPU, on a random-weight W4A16 model
with groups of 128: its torch reference with the weights a block hands it
(WeightOnlyMambaMixer.layer_weights) is the block's own decode step, norm and mixer op by op, bit
for bit (out, residual, both states), float32 and float16, the residual in fp32 or not; a block
steps through it where its mixer offers it; the op refuses inputs outside its scope with a
one-line error; and its kernel launcher (quamba.ops.fused_decode.w4a16_layer_cuda) says why the
kernel cannot run a step and repacks the weights in the layout the kernel reads.
tests/ops/test_cuda_w4a16_layer.py checks the kernel on a GPU."""
import copy
import dataclasses

import pytest
import torch

import quamba
from quamba.layers.weight_only import WeightOnlyMambaMixer
from quamba.models import MambaConfig, MambaLMHeadModel, randomize_
from quamba.models.mamba import Block, step_ssm_A
from quamba.models.quantized import WeightOnlyBlock
from quamba.ops import backend
from quamba.ops.fused_decode.w4a16_step import LAYER_OP, W4A16Weight, w4a16_layer_step
from tests.ops.standalone_backend import load_file
from tests.ops.w4a16_step_cases import fp64_layer_step, relative_error

D_MODEL, VOCAB, PROMPT_LEN, STEPS = 256, 256, 8, 3
# relative error bounds against fp64 (test_w4a16_decode.py's): fp32 the sums' order; float16 h,
# x, z, u, x_proj's output, dt, y and out rounded as the chain stores them (measured: 3e-7, 6e-4)
TOLERANCE = {torch.float32: 1e-6, torch.float16: 5e-3}


def w4a16_model(dtype=torch.float16, **config):
    fp_model = MambaLMHeadModel(MambaConfig(d_model=D_MODEL, n_layer=2, vocab_size=VOCAB),
                                dtype=dtype).eval()
    return quamba.quantize(randomize_(fp_model, seed=0), config=quamba.QuantConfig(
        w_bits=4, a_bits=16, **config), progress=False)


@pytest.fixture(scope="module")
def model():
    return w4a16_model()


@pytest.fixture(scope="module")
def w4a16_layer():
    return load_file("fused_decode/w4a16_layer_cuda.py")


def prompt_ids(length=PROMPT_LEN):
    return torch.randint(0, VOCAB, (1, length), generator=torch.Generator().manual_seed(0))


def prefilled_cache(model):
    cache = model.allocate_cache(1)
    with torch.no_grad():
        model(prompt_ids(), cache=cache)
    return cache


@pytest.mark.parametrize("dtype,residual_in_fp32", [(torch.float32, True), (torch.float16, True),
                                                    (torch.float16, False)], ids=str)
def test_the_reference_is_the_block_step_bit_for_bit(dtype, residual_in_fp32):
    model = w4a16_model(dtype)
    layers = model.backbone.layers
    for block in layers:
        block.norm.residual_in_fp32 = residual_in_fp32
    cache = prefilled_cache(model)
    gen = torch.Generator().manual_seed(1)
    for step in range(STEPS):
        hidden, residual = torch.randn(1, 1, D_MODEL, generator=gen).to(dtype), None
        # A as the model's step passes it (step_ssm_A), or None: the mixer's own -exp(A_log)
        ssm_As = step_ssm_A(layers) if step % 2 else [None] * len(layers)
        for block, state, ssm_A in zip(layers, cache.states, ssm_As):
            weights = block.mixer.layer_weights(block.norm, ssm_A)
            fused_state = copy.deepcopy(state)
            with torch.no_grad(), backend.recording() as used:
                out, res = w4a16_layer_step(hidden, residual, weights, fused_state.conv,
                                            fused_state.ssm, backend_name="torch")
                ref_out, ref_res = block(hidden, residual, state=state, step=True, ssm_A=ssm_A)
            assert used[LAYER_OP] == {"torch"}
            assert res.dtype == (torch.float32 if residual_in_fp32 else dtype)
            assert out.dtype == dtype and torch.equal(out, ref_out) and torch.equal(res, ref_res)
            assert torch.equal(fused_state.conv, state.conv)
            assert torch.equal(fused_state.ssm, state.ssm)
            hidden, residual = out, res  # the next block's input, as the model chains them


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
def test_the_reference_follows_the_block_step_in_fp64(dtype):
    """The fp64 step that tests/ops/test_cuda_w4a16_layer.py measures the kernel against."""
    model = w4a16_model(dtype)
    cache = prefilled_cache(model)
    hidden = torch.randn(1, 1, D_MODEL, generator=torch.Generator().manual_seed(1)).to(dtype)
    residual = None
    for block, state in zip(model.backbone.layers, cache.states):
        weights = block.mixer.layer_weights(block.norm)
        expected = fp64_layer_step(hidden, residual, weights, state.conv, state.ssm)
        with torch.no_grad():
            out, res = w4a16_layer_step(hidden, residual, weights, state.conv, state.ssm,
                                        backend_name="torch")
        for got, ref in zip((out, res, state.conv, state.ssm), expected):
            assert relative_error(got, ref) < TOLERANCE[dtype]
        hidden, residual = out, res


def decode(model):
    """(the logits of STEPS decode steps after a prefill, the cache, the ops run)."""
    ids = prompt_ids(PROMPT_LEN + STEPS)
    cache = model.allocate_cache(1)
    with torch.no_grad(), backend.recording() as ran:
        model(ids[:, :PROMPT_LEN], cache=cache)
        logits = [model(ids[:, t:t + 1], cache=cache) for t in range(PROMPT_LEN, ids.shape[1])]
    return torch.cat(logits, dim=1), cache, ran


def test_a_block_steps_through_the_op_where_its_mixer_offers_it(model, monkeypatch):
    """On the CPU no mixer offers the op (its kernel runs on a GPU); offered here anyway, the
    model's decode steps through it are its op-by-op steps bit for bit, and set_fused_layer(False)
    turns it off."""
    op_by_op, op_by_op_cache, ran = decode(model)
    assert LAYER_OP not in ran and "w4a16_ssm_step" in ran

    def offered(mixer, norm, hidden, residual, state, ssm_A=None):
        return mixer.layer_weights(norm, ssm_A) if mixer.fused_layer else None

    monkeypatch.setattr(WeightOnlyMambaMixer, "layer_step_weights", offered)
    fused, fused_cache, ran = decode(model)
    assert ran[LAYER_OP] == {"torch"}
    assert torch.equal(fused, op_by_op)
    for state, op_by_op_state in zip(fused_cache.states, op_by_op_cache.states):
        assert torch.equal(state.conv, op_by_op_state.conv)
        assert torch.equal(state.ssm, op_by_op_state.ssm)
    try:
        assert LAYER_OP not in decode(model.set_fused_layer(False))[2]
    finally:
        model.set_fused_layer(True)


def test_which_blocks_take_the_op():
    """W4A16 Mamba1 blocks are WeightOnlyBlocks whose mixers offer the op by default; a rotated
    one's (its online Hadamard) cannot take it; Mamba2 blocks stay plain Blocks."""
    model = w4a16_model()
    assert all(type(block) is WeightOnlyBlock and block.mixer.fused_layer
               for block in model.backbone.layers)
    rotated = w4a16_model(hadamard=True)
    assert all(block.mixer.layer_weights(block.norm) is None for block in rotated.backbone.layers)
    fp_mamba2 = MambaLMHeadModel(MambaConfig(d_model=D_MODEL, n_layer=1, vocab_size=VOCAB,
                                             layer="Mamba2"))
    mamba2 = quamba.quantize(randomize_(fp_mamba2), config=quamba.QuantConfig(w_bits=4, a_bits=16),
                             progress=False)
    assert type(mamba2.backbone.layers[0]) is Block


def test_bad_inputs_get_one_line_errors(model):
    block, state = model.backbone.layers[0], model.allocate_cache(1).states[0]
    hidden = torch.zeros(1, 1, D_MODEL, dtype=torch.float16)
    cases = [
        (dict(hidden=torch.zeros(1, 2, D_MODEL, dtype=torch.float16)), "hidden must be float"),
        (dict(hidden=hidden.to(torch.int8)), "hidden must be float"),
        (dict(residual=torch.zeros(1, 1, D_MODEL, dtype=torch.float16)), "residual must be"),
        (dict(residual=torch.zeros(1, 2, D_MODEL)), "residual must be"),
        (dict(conv_state=state.conv.expand(2, -1, -1)), "batch"),
        (dict(ssm_state=state.ssm.expand(2, -1, -1)), "batch"),
    ]
    for change, message in cases:
        args = dict(hidden=hidden, residual=None, layer=block.mixer.layer_weights(block.norm),
                    conv_state=state.conv, ssm_state=state.ssm, backend_name="torch")
        args.update(change)
        with pytest.raises(ValueError, match=message) as error:
            w4a16_layer_step(**args)
        assert "\n" not in str(error.value)


def test_the_kernel_says_why_it_cannot_run_a_step(model, w4a16_layer):
    """Every reason that does not depend on the device comes before the device's (no GPU here)."""
    block, state = model.backbone.layers[0], model.allocate_cache(1).states[0]
    weights = block.mixer.layer_weights(block.norm)
    hidden = torch.zeros(1, 1, D_MODEL, dtype=torch.float16)
    x_proj, out_proj, ssm = weights.x_proj, weights.out_proj, weights.ssm
    replace = dataclasses.replace
    cases = [
        ({}, "CUDA device, not cpu"),
        (dict(hidden=hidden.expand(2, -1, -1)), "batch 1, not 2"),
        (dict(hidden=hidden.float()), "float16 model"),
        (dict(layer=replace(weights, residual_in_fp32=False)), "residual in fp32"),
        (dict(layer=replace(weights, x_proj=W4A16Weight(x_proj.packed, x_proj.scales, 64))),
         "groups of 128"),
        (dict(layer=replace(weights, out_proj=W4A16Weight(out_proj.packed, out_proj.scales.float(),
                                                          128))), "fp16 group scales"),
        (dict(layer=replace(weights, ssm=replace(ssm, dt_weight=ssm.dt_weight.float()))),
         "in float16"),
        (dict(ssm_state=state.ssm.half()), "fp32 SSM state"),
        (dict(conv_state=torch.zeros(1, 3, 512, dtype=torch.float16).transpose(1, 2)),
         "contiguous"),
    ]
    for change, reason in cases:
        args = dict(hidden=hidden, residual=None, layer=weights, conv_state=state.conv,
                    ssm_state=state.ssm)
        args.update(change)
        assert reason in w4a16_layer.lacks(**args)


@pytest.mark.skipif(backend.cuda_extension_error() is None, reason="quamba._C loads here")
def test_a_build_without_the_kernel_says_so(w4a16_layer):
    device = torch.device("cuda", 0)
    assert "no W4A16 layer kernel" in w4a16_layer._shape_lacks(2560, 5120, 16, 160, 4, device)


def test_small_weights_hold_each_blocks_x_proj_columns_and_scales_and_dt_proj_rows(w4a16_layer):
    """At Mamba-2.8B's sizes block b (channels c0 = 40 b … c0 + 39) reads, as bytes: x_proj's
    packed columns of its channels, the scales of the groups of c0 and c0 + 39, its dt_proj
    rows."""
    gen = torch.Generator().manual_seed(0)
    packed = torch.randint(0, 256, (192, 2560), generator=gen, dtype=torch.uint8)
    scales = torch.randn(192, 40, generator=gen).half()
    dt_weight = torch.randn(5120, 160, generator=gen).half()
    x_proj = W4A16Weight(packed, scales, 128)
    small = w4a16_layer.small_weights(x_proj, dt_weight)
    assert small.dtype == torch.int8 and small.shape == (128, 17408)
    for b in (0, 3, 127):  # block 3's channels 120 … 159 lie in two groups
        c0, row, columns = 40 * b, small[b], slice(20 * b, 20 * b + 20)
        assert torch.equal(row[:3840].view(torch.uint8).view(192, 20), packed[:, columns])
        group_scales = torch.stack([scales[:, c0 // 128], scales[:, (c0 + 39) // 128]], dim=1)
        assert torch.equal(row[3840:4608].view(torch.float16).view(192, 2), group_scales)
        assert torch.equal(row[4608:].view(torch.float16).view(40, 160), dt_weight[c0:c0 + 40])
    assert w4a16_layer.small_weights(x_proj, dt_weight) is small  # kept
    scales.mul_(2)
    assert not torch.equal(w4a16_layer.small_weights(x_proj, dt_weight), small)


def test_group_scales_hold_each_blocks_in_proj_and_out_proj_rows_scales(w4a16_layer):
    """At Mamba-2.8B's sizes block b reads its in_proj x rows' scales (rows 40 b …), its z rows'
    (5120 + 40 b …), then its out_proj rows' (20 b …)."""
    gen = torch.Generator().manual_seed(0)
    in_scales = torch.randn(10240, 20, generator=gen).half()
    out_scales = torch.randn(2560, 40, generator=gen).half()
    in_proj = W4A16Weight(torch.zeros(10240, 1280, dtype=torch.uint8), in_scales, 128)
    out_proj = W4A16Weight(torch.zeros(2560, 2560, dtype=torch.uint8), out_scales, 128)
    groups = w4a16_layer.group_scales(in_proj, out_proj)
    assert groups.dtype == torch.float16 and groups.shape == (128, 2400)
    for b in (0, 5, 127):
        x, z = in_scales[40 * b:40 * b + 40], in_scales[5120 + 40 * b:5120 + 40 * b + 40]
        assert torch.equal(groups[b, :800].view(40, 20), x)
        assert torch.equal(groups[b, 800:1600].view(40, 20), z)
        assert torch.equal(groups[b, 1600:].view(20, 40), out_scales[20 * b:20 * b + 20])
    assert w4a16_layer.group_scales(in_proj, out_proj) is groups  # kept
    out_scales.mul_(2)
    assert not torch.equal(w4a16_layer.group_scales(in_proj, out_proj), groups)
