"""On a GPU, a shape outside a kernel's limits (tests/ops/test_kernel_limits.py lists them), for
one op of every kernel family: under ``auto`` the op runs its torch reference (the numbers of the
torch backend, bit for bit) with one WARNING naming the op and the limit; under ``cuda`` it is
refused with a one-line BackendError. And end to end: tests/fixtures/tiny-vim quantized to W4A8
in groups of 16 (in_features 48 and 96 in groups no multiple of 32, which the 4-bit kernels
refuse) quantizes and classifies under ``auto``, its other quantized ops on their kernels.
Skipped without a GPU or quamba._C."""
from pathlib import Path

import pytest
import torch

import quamba
from quamba.ops import backend

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if backend.cuda_extension_error() is not None:
    pytest.skip(backend.cuda_extension_error(), allow_module_level=True)

from quamba.ops.conv.qconv1d import qconv1d, qconv1d_update  # noqa: E402
from quamba.ops.fused_decode.layer_step import qmamba_layer_step  # noqa: E402
from quamba.ops.fused_decode.w4a16_step import w4a16_ssm_step  # noqa: E402
from quamba.ops.linear.qlinear4 import (  # noqa: E402
    w4a8_linear,
    w4a16_linear,
    w4a16_linear_channel_major,
)
from quamba.ops.norm.qhadamard import gated_norm_hadamard_quant, hadamard_quant  # noqa: E402
from quamba.ops.quant4 import quantize_weight_w4a8, quantize_weight_w4a16  # noqa: E402
from quamba.ops.scan.qsscan import SSMParams, qsscan, qsscan_update  # noqa: E402
from quamba.ops.ssd.qssd import qconv1d_channelwise, qssd_scan  # noqa: E402
from tests.ops import fused_step_cases, w4a16_step_cases  # noqa: E402
from tests.ops.test_kernel_limits import qmamba_layer  # noqa: E402

DEVICE = torch.device("cuda")
TINY_VIM = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "tiny-vim"


@pytest.fixture(autouse=True)
def fresh_backend_state(monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "_WARNED", set())


def codes(*shape, low=-127, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, 128, shape, generator=gen, dtype=torch.int8).to(DEVICE)


def randn(*shape, dtype=torch.float16, seed=0, device=DEVICE):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device, dtype)


def quamba_warnings(records) -> list[str]:
    return [r.getMessage() for r in records if r.name == "quamba" and r.levelname == "WARNING"]


def assert_same(got, expected):
    if isinstance(expected, torch.Tensor):
        assert torch.equal(got, expected)
    else:
        for g, e in zip(got, expected, strict=True):
            assert_same(g, e)


def check_limit(op: str, run, caplog, limit: str):
    """``run(backend_name)`` calls ``op`` on fresh copies of its inputs (returning what it
    outputs and what it updates in place): under auto twice as the torch backend, with one
    warning naming the op and the limit; under cuda refused in one line."""
    reference = run("torch")  # its reference may run other ops, which may warn of their own
    caplog.clear()
    with caplog.at_level("WARNING", logger="quamba"):
        for _ in range(2):
            assert_same(run("auto"), reference)
    warnings = [w for w in quamba_warnings(caplog.records) if w.startswith(f"op {op} ")]
    assert len(warnings) == 1, warnings
    assert f"op {op} runs its torch reference" in warnings[0] and limit in warnings[0]
    with pytest.raises(backend.BackendError) as refused:
        run("cuda")
    assert str(refused.value).startswith(f"backend 'cuda' requested for {op} but its ")
    assert limit in str(refused.value) and "\n" not in str(refused.value)


# linear: groups of 16 over 48 input channels (tiny-vim's in_proj), at decode and prefill rows
@pytest.mark.parametrize("rows", [4, 16])
def test_w4a8_linear_in_groups_of_16(rows, caplog):
    *weight, size = quantize_weight_w4a8(randn(64, 48, dtype=torch.float32, device="cpu"), 16)
    weight = [t.to(DEVICE) for t in weight]
    x = codes(rows, 48)
    check_limit("w4a8_linear", lambda name: w4a8_linear(x, 0.05, *weight, size, backend_name=name),
                caplog, "not 48 and 16")


@pytest.mark.parametrize("op, rows", [(w4a16_linear, 3), (w4a16_linear_channel_major, 16)])
def test_w4a16_linear_in_groups_of_16(op, rows, caplog):
    packed, scales, size = quantize_weight_w4a16(randn(64, 48, dtype=torch.float32, device="cpu"),
                                                 16)
    packed, scales = packed.to(DEVICE), scales.to(DEVICE)
    x = randn(rows, 48)
    check_limit(op.__name__, lambda name: op(x, packed, scales, size, backend_name=name), caplog,
                "not 48 and 16")


# conv: a filter of 5 taps
def test_qconv1d_of_width_5(caplog):
    x, weight, bias = codes(2, 64, 20), codes(64, 5, seed=1), codes(64, seed=2)
    check_limit("qconv1d", lambda name: qconv1d(x, 0.05, weight, 0.01, bias, 0.004, 0.03,
                                                backend_name=name), caplog, "not 5")


def test_qconv1d_update_of_width_5(caplog):
    x, weight, state = codes(2, 64), codes(64, 5, seed=1), codes(2, 64, 4, seed=2)

    def run(name):
        conv_state = state.clone()
        y = qconv1d_update(x, conv_state, 0.05, weight, 0.01, None, 1.0, 0.03, backend_name=name)
        return y, conv_state
    check_limit("qconv1d_update", run, caplog, "not 5")


def test_qconv1d_channelwise_of_width_5(caplog):
    x, weight = codes(2, 64, 20), codes(64, 5, seed=1)
    x_scale = 0.05 * torch.rand(64, device=DEVICE) + 0.01
    out_scale = 0.03 * torch.rand(64, device=DEVICE) + 0.01
    check_limit("qconv1d_channelwise",
                lambda name: qconv1d_channelwise(x, x_scale, weight, 0.01, None, 1.0, out_scale,
                                                 backend_name=name), caplog, "not 5")


# scan: 64 states a channel
def ssm_params(d_inner, d_state):
    return SSMParams(codes(d_inner, d_state, low=0), 0.02, codes(d_inner, seed=1), 0.01,
                     codes(d_inner, seed=2), 4.0 / 127)


def test_qsscan_of_64_states(caplog):
    u, dt, z = codes(2, 32, 16), codes(2, 32, 16, seed=1), codes(2, 32, 16, seed=2)
    B, C = codes(2, 64, 16, seed=3), codes(2, 64, 16, seed=4)
    params = ssm_params(32, 64)
    check_limit("qsscan", lambda name: qsscan(u, 0.03, dt, 0.02, B, 0.04, C, 0.04, z, 0.05, params,
                                              state_scale=0.08, backend_name=name),
                caplog, "d_state up to 32, not 64")


def test_qsscan_update_of_64_states(caplog):
    u, dt, z = codes(2, 32), codes(2, 32, seed=1), codes(2, 32, seed=2)
    B, C, state = codes(2, 64, seed=3), codes(2, 64, seed=4), codes(2, 32, 64, seed=5)
    params = ssm_params(32, 64)

    def run(name):
        stepped = state.clone()
        y = qsscan_update(stepped, 0.08, u, 0.03, dt, 0.02, B, 0.04, C, 0.04, z, 0.05, params,
                          backend_name=name)
        return y, stepped
    check_limit("qsscan_update", run, caplog, "d_state up to 32, not 64")


# norm: a row longer than a block's shared memory, a gate of 128 groups
def test_hadamard_quant_of_a_row_beyond_shared_memory(caplog):
    x = randn(2, 65536)
    check_limit("hadamard_quant", lambda name: hadamard_quant(x, 0.05, backend_name=name), caplog,
                "not 65536")


def test_gated_norm_hadamard_quant_of_128_groups(caplog):
    y, z, weight = randn(2, 4096), codes(2, 4096, seed=1), randn(4096, dtype=torch.float32, seed=2)
    check_limit("gated_norm_hadamard_quant",
                lambda name: gated_norm_hadamard_quant(y, z, 0.05, weight, 32, 1e-5, 0.05,
                                                       backend_name=name),
                caplog, "up to 64 groups, not 128")


# ssd: more batch · nheads programs than the grid's y dimension holds
def test_qssd_scan_of_more_heads_than_the_grid_holds(caplog):
    batch, seqlen, nheads = 8193, 4, 8
    x, dt = codes(batch, seqlen, nheads, 16), codes(batch, seqlen, nheads, seed=1)
    B, C = codes(batch, seqlen, 1, 16, seed=2), codes(batch, seqlen, 1, 16, seed=3)
    params = SSMParams(codes(nheads, low=0), 0.02, codes(nheads, seed=1), 0.01,
                       codes(nheads, seed=2), 4.0 / 127)
    check_limit("qssd_scan", lambda name: qssd_scan(x, 0.03, dt, 0.02, B, 0.04, C, 0.04, params,
                                                    backend_name=name),
                caplog, "batch · nheads up to 65535, not 65544")


# fused decode: steps whose 4-bit weights the chain of CUDA ops behind the kernels refuses
def test_w4a16_ssm_step_in_groups_of_16(caplog):
    case = w4a16_step_cases.step_case(2, 48, 16, 4, 4, 16, device=DEVICE)

    def run(name):
        ran = w4a16_step_cases.cloned(case)
        return w4a16_ssm_step(**ran, backend_name=name), ran["conv_state"], ran["ssm_state"]
    check_limit("w4a16_ssm_step", run, caplog, "not 48 and 16")


def test_qmamba_layer_step_in_groups_of_16(caplog):
    case = {name: fused_step_cases._moved(value, DEVICE)
            for name, value in qmamba_layer(48, 64, 16).items()}
    case["hidden"] = randn(1, 1, 48)

    def run(name):
        ran = dict(case, conv_state=case["conv_state"].clone(),
                   ssm_state=case["ssm_state"].clone())
        return (*qmamba_layer_step(**ran, backend_name=name), ran["conv_state"], ran["ssm_state"])
    check_limit("qmamba_layer_step", run, caplog, "not 48 and 16")


# end to end: tiny-vim (d_model 48, d_inner 96) in W4A8 groups of 16
@pytest.fixture(scope="module")
def tiny_vim_w4a8():
    pytest.importorskip("sklearn", reason="the digits images come from scikit-learn")
    model, _ = quamba.load_model(TINY_VIM, device="cuda")
    config = quamba.QuantConfig(w_bits=4, a_bits=8, group_size=16, calib_num_samples=512)
    return quamba.quantize(model, config=config, calib_data="digits", progress=False)


def digits(model, count=64):
    from quamba.eval.images import load_image_set, normalize
    return normalize(load_image_set("digits", "test").images[:count], model.config).to(DEVICE)


def test_tiny_vim_w4a8_in_groups_of_16_runs_under_auto(tiny_vim_w4a8, monkeypatch, caplog):
    model = tiny_vim_w4a8
    x = digits(model)
    with torch.inference_mode(), caplog.at_level("WARNING", logger="quamba"):
        with backend.recording() as ran:
            fast = model(x).float()
        model(x)
    summary = backend.summary(ran)
    assert summary["w4a8_linear"] == "torch" and summary["qsscan"] == "cuda", summary
    warnings = [w for w in quamba_warnings(caplog.records) if "w4a8_linear" in w]
    assert warnings and len(set(warnings)) == len(warnings), warnings  # once per limit
    assert any("not 48 and 16" in w for w in warnings), warnings
    monkeypatch.setenv("QUAMBA_BACKEND", "torch")
    with torch.inference_mode():
        reference = model(x).float()
    assert (fast - reference).norm() / reference.norm() < 2e-2
    assert (fast.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9


def test_tiny_vim_w4a8_in_groups_of_16_is_refused_under_cuda(tiny_vim_w4a8, monkeypatch):
    monkeypatch.setenv("QUAMBA_BACKEND", "cuda")
    with torch.inference_mode(), pytest.raises(backend.BackendError) as refused:
        tiny_vim_w4a8(digits(tiny_vim_w4a8, 4))
    message = str(refused.value)
    assert message.startswith("backend 'cuda' requested for w4a8_linear but its 4-bit kernels")
    assert "not 48 and 16" in message and "\n" not in message
