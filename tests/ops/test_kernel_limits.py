"""The shape limits of quamba's kernels, mirrored where each op chooses its backend: a shape that
no cuda path of an op takes gives a reason, with which ``auto`` runs the torch reference (with
its one-time warning on a GPU) and ``cuda`` is refused in one line naming the op and the limit;
shapes inside every limit give none. No GPU needed: shapes too large to allocate are meta
tensors, and an op asked for ``cuda`` is refused before it touches a tensor.
(tests/ops/test_cuda_kernel_limits.py runs the same shapes on a GPU.)"""
import re

import pytest
import torch

from quamba.ops import backend
from quamba.ops.conv.qconv1d import kernel_lacks as conv_lacks
from quamba.ops.conv.qconv1d import qconv1d, qconv1d_update
from quamba.ops.fused_decode import layer_step, w4a16_step
from quamba.ops.fused_decode.layer_step import LayerWeights, qmamba_layer_step
from quamba.ops.fused_decode.mixer_step import chain_lacks, linear_lacks
from quamba.ops.fused_decode.weights import W4A8Weight
from quamba.ops.linear.qlinear4 import kernel_lacks as linear4_lacks
from quamba.ops.linear.qlinear4 import (
    w4a8_linear,
    w4a16_kernel_lacks,
    w4a16_linear,
    w4a16_linear_channel_major,
)
from quamba.ops.norm import qhadamard
from quamba.ops.quant4 import quantize_weight_w4a8
from quamba.ops.scan.qsscan import SSMParams, qsscan, qsscan_update, step_kernel_lacks
from quamba.ops.scan.qsscan import kernel_lacks as scan_lacks
from quamba.ops.ssd import ssd
from quamba.ops.ssd.qssd import (
    qconv1d_channelwise,
    qconv1d_channelwise_update,
    qssd_scan,
    qssd_state_update,
)
from tests.ops import fused_step_cases, w4a16_step_cases

CUDA = torch.device("cuda")
META = torch.device("meta")
H200_SHARED_FLOATS = 232448 // 4  # an H200's (and H100's) opt-in shared memory a block


@pytest.fixture(autouse=True)
def no_backend_override(monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)


def meta(*shape, dtype=torch.int8):
    return torch.empty(*shape, dtype=dtype, device=META)


def packed(n: int, k: int):
    """A 4-bit weight [n, k] as its packed bytes (a meta tensor)."""
    return meta(n, k // 2, dtype=torch.uint8)


def ssd_lacks(batch, seqlen, nheads, headdim, ngroups=1, d_state=16):
    return ssd.kernel_lacks(meta(batch, seqlen, nheads, headdim),
                            meta(batch, seqlen, ngroups, d_state))


def fp16(*shape):
    return meta(*shape, dtype=torch.float16)


# op: (why its kernels cannot take a shape outside a limit, and None for one inside, the reason's
# words), one limit per case, by kernel family
LIMITS = {
    # linear, 4-bit (csrc/gemm4/gemm4.h kCodesPerChunk): tiny-vim's in_proj (d_model 48, G 16)
    "w4a8 in_features": ("w4a8_linear", lambda: linear4_lacks(packed(192, 48), 16),
                         lambda: linear4_lacks(packed(192, 64), 32), "not 48 and 16"),
    "w4a8 group size": ("w4a8_linear", lambda: linear4_lacks(packed(192, 96), 48),
                        lambda: linear4_lacks(packed(192, 96), 96), "not 96 and 48"),
    "w4a16 in_features": ("w4a16_linear",
                          lambda: w4a16_kernel_lacks(fp16(4, 48), packed(96, 48), 48),
                          lambda: w4a16_kernel_lacks(meta(4, 48, dtype=torch.float32),
                                                     packed(96, 48), 48), "not 48 and 48"),
    "w4a16 channel major": ("w4a16_linear_channel_major",
                            lambda: w4a16_kernel_lacks(fp16(16, 96), packed(96, 96), 16),
                            lambda: w4a16_kernel_lacks(fp16(16, 96), packed(96, 96), 32),
                            "multiples of 32"),
    # conv (csrc/conv1d/qconv1d.cu)
    "conv width": ("qconv1d", lambda: conv_lacks((2, 64, 10), 5),
                   lambda: conv_lacks((2, 64, 10), 4), "conv widths (2, 3, 4), not 5"),
    "conv batch": ("qconv1d", lambda: conv_lacks((65536, 8, 2), 4),
                   lambda: conv_lacks((65535, 8, 2), 4), "batch up to 65535, not 65536"),
    "conv seqlen": ("qconv1d_channelwise", lambda: conv_lacks((1, 1, 65535 * 16 + 1), 2),
                    lambda: conv_lacks((1, 1, 65535 * 16), 2), "seqlen up to 1048560"),
    "conv elements": ("qconv1d", lambda: conv_lacks((1, 2 ** 15, 2 ** 16), 4),
                      lambda: conv_lacks((1, 2 ** 15, 2 ** 16 - 1), 4), "fewer than 2^31"),
    "conv step width": ("qconv1d_update", lambda: conv_lacks((8, 64), 1),
                        lambda: conv_lacks((70000, 64), 3), "not 1"),  # a step's batch: any
    "conv step elements": ("qconv1d_channelwise_update", lambda: conv_lacks((2 ** 16, 2 ** 15), 4),
                           lambda: conv_lacks((2 ** 16, 2 ** 15 - 1), 4), "fewer than 2^31"),
    # scan (csrc/qsscan/qsscan.cu)
    "scan d_state": ("qsscan", lambda: scan_lacks(64, 8), lambda: scan_lacks(32, 8),
                     "d_state up to 32, not 64"),
    "scan batch": ("qsscan", lambda: scan_lacks(16, 65536), lambda: scan_lacks(16, 65535),
                   "batch up to 65535"),
    "step d_state": ("qsscan_update", lambda: step_kernel_lacks(33, 1, 64, None),
                     lambda: step_kernel_lacks(32, 1, 64, None), "d_state up to 32, not 33"),
    "step channels": ("qsscan_update", lambda: step_kernel_lacks(16, 2 ** 16, 2 ** 10, None),
                      lambda: step_kernel_lacks(16, 2 ** 16, 2 ** 10 - 1, None), "below 2^26"),
    "step dt_rank": ("qsscan_update", lambda: step_kernel_lacks(16, 1, 64, 1025),
                     lambda: step_kernel_lacks(16, 1, 64, 1024), "dt_rank up to 1024, not 1025"),
    # norm (csrc/norm/hadamard_quant.cu)
    "hadamard row": ("hadamard_quant", lambda: qhadamard.kernel_lacks(65536, H200_SHARED_FLOATS),
                     lambda: qhadamard.kernel_lacks(40960, H200_SHARED_FLOATS),
                     "up to 58112 values in shared memory, not 65536"),
    "gate groups": ("gated_norm_hadamard_quant",
                    lambda: qhadamard.kernel_lacks(4096, H200_SHARED_FLOATS, 128),
                    lambda: qhadamard.kernel_lacks(4096, H200_SHARED_FLOATS, 64),
                    "up to 64 groups, not 128"),
    # ssd (Triton, quamba.ops.ssd.ssd_triton)
    "ssd grid": ("qssd_scan", lambda: ssd_lacks(8193, 2, 8, 16), lambda: ssd_lacks(8191, 2, 8, 16),
                 "batch · nheads up to 65535, not 65544"),
    "ssd x": ("ssd_scan", lambda: ssd_lacks(5, 2 ** 19, 16, 64),
              lambda: ssd_lacks(4, 2 ** 19, 16, 64), "not x of 2684354560"),
    "ssd scores": ("qssd_scan", lambda: ssd_lacks(32769, 1, 1, 16),
                   lambda: ssd_lacks(32768, 1, 1, 16), "C·B scores"),
    "ssd chunk states": ("qssd_scan", lambda: ssd_lacks(1024, 1, 32, 64, d_state=2048),
                         lambda: ssd_lacks(1024, 1, 32, 64, d_state=1024), "chunk states"),
    "ssd step state": ("qssd_state_update", lambda: ssd.step_kernel_lacks(meta(32769, 1, 64, 1024)),
                       lambda: ssd.step_kernel_lacks(meta(32768, 1, 64, 1024)), "not state of"),
    # fused decode: what the chain of CUDA ops behind a step's kernel lacks
    "mixer chain conv": ("qmamba_layer_step", lambda: chain_lacks(*mixer_parts(width=5)),
                         lambda: chain_lacks(*mixer_parts()), "conv widths"),
    "mixer chain x_proj": ("qmamba_layer_step", lambda: chain_lacks(*mixer_parts(group_size=16)),
                           lambda: chain_lacks(*mixer_parts(group_size=32)), "not 64 and 16"),
    "mixer chain scan": ("qmamba_layer_step", lambda: chain_lacks(*mixer_parts(d_state=64)),
                         lambda: chain_lacks(*mixer_parts(d_state=32)), "d_state up to 32"),
    "in_proj": ("qmamba_layer_step", lambda: linear_lacks(w4a8_weight(96, 48, 16)),
                lambda: linear_lacks(w4a8_weight(96, 64, 64)), "not 48 and 16"),
}


def mixer_parts(width=4, group_size=64, d_state=16, batch=2, d_inner=64):
    """chain_lacks' (conv, x_proj, ssm_state) of a step (meta tensors)."""
    case = fused_step_cases.step_case(1, d_inner, 16, 4, width=width, int4=True,
                                      group_size=group_size)
    return case["conv"], case["x_proj"], meta(batch, d_inner, d_state)


def w4a8_weight(n, k, group_size):
    return W4A8Weight(packed(n, k), meta(n, k // group_size), meta(n, dtype=torch.float32),
                      group_size, 0.1, 0.1)


@pytest.mark.parametrize("case", LIMITS)
def test_a_shape_outside_a_limit_gives_the_reason_and_one_inside_none(case):
    _, outside, inside, words = LIMITS[case]
    assert words in outside()
    assert inside() is None


@pytest.mark.parametrize("case", LIMITS)
def test_auto_runs_the_reference_and_cuda_is_refused_in_one_line(case):
    op, outside, _, _ = LIMITS[case]
    reason = outside()
    assert backend.resolve(op, CUDA, "auto", reason) == ("torch", reason)
    with pytest.raises(backend.BackendError) as refused:
        backend.resolve(op, CUDA, "cuda", reason)
    assert str(refused.value) == f"backend 'cuda' requested for {op} but {reason}"
    assert "\n" not in str(refused.value)


def test_auto_on_a_gpu_warns_once_naming_the_op_and_the_limit(monkeypatch, caplog):
    monkeypatch.setattr(backend, "_WARNED", set())
    reason = linear4_lacks(packed(192, 48), 16)
    with caplog.at_level("WARNING", logger="quamba"):
        for _ in range(3):
            impl = backend.select("w4a8_linear", CUDA, "auto", cuda_lacks=reason)
    assert impl is backend._IMPLS["w4a8_linear"]["torch"]
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "w4a8_linear" in warnings[0] and reason in warnings[0]


def test_the_hadamard_limit_is_the_device_s_shared_memory(monkeypatch):
    monkeypatch.setattr(qhadamard, "_shared_floats", lambda device: 1024)
    assert "up to 1024 values" in qhadamard.lacks_on(CUDA, 2048)
    assert qhadamard.lacks_on(CUDA, 1024) is None
    assert qhadamard.lacks_on(torch.device("cpu"), 2048) is None  # no kernel runs there


def params(d_inner, d_state):
    return SSMParams(meta(d_inner, d_state), 0.1, meta(d_inner), 0.1, meta(d_inner), 0.1)


def w4a16_layer(d_model, d_inner, group_size):
    """w4a16_layer_step's weights (CPU) with in_proj, x_proj and out_proj in ``group_size``."""
    case = w4a16_step_cases.step_case(1, d_inner, 16, 4, 4, group_size)
    weight = case["x_proj"]
    in_proj = w4a16_step.W4A16Weight(torch.zeros(2 * d_inner, d_model // 2, dtype=torch.uint8),
                                     torch.ones(2 * d_inner, d_model // group_size).half(),
                                     group_size)
    out_proj = w4a16_step.W4A16Weight(torch.zeros(d_model, d_inner // 2, dtype=torch.uint8),
                                      torch.ones(d_model, d_inner // group_size).half(), group_size)
    layer = w4a16_step.W4A16LayerWeights(torch.ones(d_model).half(), 1e-5, True, in_proj, weight,
                                         case["weights"], out_proj)
    return layer, case


def qmamba_layer(d_model, d_inner, group_size):
    """qmamba_layer_step's arguments (CPU) with 4-bit in_proj, x_proj and out_proj."""
    case = fused_step_cases.step_case(1, d_inner, 16, 4, int4=True, group_size=group_size)

    gen = torch.Generator().manual_seed(0)

    def weight(n, k):
        return W4A8Weight(*quantize_weight_w4a8(torch.randn(n, k, generator=gen), group_size),
                          0.1, 0.1)
    layer = LayerWeights(1e-5, 0.1, weight(2 * d_inner, d_model), case["conv"], case["x_proj"],
                         case["dt_proj"], case["params"], case["scales"], 0.1,
                         weight(d_model, d_inner))
    hidden = torch.zeros(1, 1, d_model, dtype=torch.float16)
    return {"hidden": hidden, "residual": None, "layer": layer, "conv_state": case["conv_state"],
            "ssm_state": case["ssm_state"]}


def w4a16_layer_call(d_model, d_inner, group_size, backend_name):
    layer, case = w4a16_layer(d_model, d_inner, group_size)
    hidden = torch.zeros(1, 1, d_model, dtype=torch.float16)
    return w4a16_step.w4a16_layer_step(hidden, None, layer, case["conv_state"], case["ssm_state"],
                                       backend_name=backend_name)


def w4a16_step_call(d_inner, group_size, backend_name):
    case = w4a16_step_cases.step_case(1, d_inner, 16, 4, 4, group_size)
    return w4a16_step.w4a16_ssm_step(**case, backend_name=backend_name)


def scan_call(d_state, batch=2, d_inner=8):
    u = meta(batch, d_inner, 3)
    B = meta(batch, d_state, 3)
    return lambda name: qsscan(u, 0.1, u, 0.1, B, 0.1, B, 0.1, u, 0.1, params(d_inner, d_state),
                               backend_name=name)


def step_call(d_state, batch=2, d_inner=8):
    u, B = meta(batch, d_inner), meta(batch, d_state)
    state = meta(batch, d_inner, d_state)
    return lambda name: qsscan_update(state, 0.1, u, 0.1, u, 0.1, B, 0.1, B, 0.1, u, 0.1,
                                      params(d_inner, d_state), backend_name=name)


def linear_call(op, k, group_size, dtype=torch.int8):
    x, weight = meta(9, k, dtype=dtype), packed(64, k)
    scales = meta(64, k // group_size)
    if op is w4a8_linear:
        return lambda name: op(x, 0.1, weight, scales, meta(64, dtype=torch.float32), group_size,
                               backend_name=name)
    return lambda name: op(x, weight, scales, group_size, backend_name=name)


def conv_call(op, width, step=False):
    x = meta(2, 64) if step else meta(2, 64, 10)
    weight = meta(64, width)
    scale = meta(64, dtype=torch.float32) if "channelwise" in op.__name__ else 0.1
    state = (meta(2, 64, width - 1),) if step else ()
    return lambda name: op(x, *state, scale, weight, 0.1, None, 1.0, backend_name=name)


def ssd_call(batch, nheads):
    x, dt, B = meta(batch, 2, nheads, 16), meta(batch, 2, nheads), meta(batch, 2, 1, 16)
    return lambda name: qssd_scan(x, 0.1, dt, 0.1, B, 0.1, B, 0.1, params(nheads, 1),
                                  backend_name=name)


def ssd_step_call(batch, headdim=64, d_state=1024):
    state = meta(batch, 1, headdim, d_state, dtype=torch.float32)
    x, dt, B = meta(batch, 1, headdim), meta(batch, 1), meta(batch, 1, d_state)
    return lambda name: qssd_state_update(state, None, x, 0.1, dt, 0.1, B, 0.1, B, 0.1,
                                          params(1, 1), backend_name=name)


# op: (a call outside a limit, one inside, given the backend's name)
CALLS = {
    "w4a8_linear": (linear_call(w4a8_linear, 48, 16), linear_call(w4a8_linear, 64, 32)),
    "w4a16_linear": (linear_call(w4a16_linear, 96, 16, torch.float16),
                     linear_call(w4a16_linear, 96, 16, torch.float32)),
    "w4a16_linear_channel_major": (
        linear_call(w4a16_linear_channel_major, 48, 48, torch.bfloat16),
        linear_call(w4a16_linear_channel_major, 64, 64, torch.bfloat16)),
    "qconv1d": (conv_call(qconv1d, 5), conv_call(qconv1d, 4)),
    "qconv1d_update": (conv_call(qconv1d_update, 5, step=True),
                       conv_call(qconv1d_update, 2, step=True)),
    "qconv1d_channelwise": (conv_call(qconv1d_channelwise, 1), conv_call(qconv1d_channelwise, 3)),
    "qconv1d_channelwise_update": (conv_call(qconv1d_channelwise_update, 8, step=True),
                                   conv_call(qconv1d_channelwise_update, 4, step=True)),
    "qsscan": (scan_call(64), scan_call(16)),
    "qsscan_update": (step_call(64), step_call(16)),
    "qssd_scan": (ssd_call(8193, 8), ssd_call(8191, 8)),
    "qssd_state_update": (ssd_step_call(32769), ssd_step_call(32768)),
    "w4a16_ssm_step": (lambda name: w4a16_step_call(48, 16, name),
                       lambda name: w4a16_step_call(64, 32, name)),
    "w4a16_layer_step": (lambda name: w4a16_layer_call(48, 64, 16, name),
                         lambda name: w4a16_layer_call(64, 64, 32, name)),
    "qmamba_layer_step": (lambda name: qmamba_layer_step(**qmamba_layer(48, 64, 16),
                                                         backend_name=name),
                          lambda name: qmamba_layer_step(**qmamba_layer(64, 64, 32),
                                                         backend_name=name)),
}


@pytest.mark.parametrize("op", CALLS)
def test_each_op_passes_its_kernels_limits_to_the_backend(op):
    """Off a GPU an op asked for cuda is refused: for a shape outside its kernels' limits with the
    limit, for one inside with the device."""
    outside, inside = CALLS[op]
    with pytest.raises(backend.BackendError, match=f"^backend 'cuda' requested for {op} but its "):
        outside("cuda")
    with pytest.raises(backend.BackendError, match=re.escape("not a CUDA device")):
        inside("cuda")


def test_a_fused_step_s_cpu_reference_runs_where_its_kernels_have_limits():
    """auto off a GPU: the reference, as for any shape."""
    assert w4a16_step_call(48, 16, "auto").shape == (1, 48)
    out, _ = qmamba_layer_step(**qmamba_layer(48, 64, 16), backend_name="auto")
    assert out.shape == (1, 1, 48)


def test_the_layer_kernel_keeps_a_step_only_the_chain_cannot_take(monkeypatch):
    """qmamba_layer_step's layer kernel reads a 4-bit x_proj expanded, whatever its group size:
    where it runs a step, the chain's limits do not refuse it."""
    arguments = qmamba_layer(64, 64, 16)
    monkeypatch.setattr(layer_step, "_layer_kernel_runs", lambda *args: True)
    assert layer_step._cuda_lacks(**arguments) is None
    monkeypatch.setattr(layer_step, "_layer_kernel_runs", lambda *args: False)
    assert "not 64 and 16" in layer_step._cuda_lacks(**arguments)
