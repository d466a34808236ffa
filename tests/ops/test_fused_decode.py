"""qmixer_ssm_step (quamba.ops.fused_decode.mixer_step): the two Triton kernels of its cuda backend
against the chain of reference ops (tests/ops/fused_step_cases.py says how each output is compared),
and what the op refuses.

Without a GPU the kernels run under Triton's interpreter on CPU tensors (tests/conftest.py sets
TRITON_INTERPRET=1); tests/ops/test_cuda_fused_decode.py runs them compiled at Mamba-2.8B's
shapes. The mixer-level tests are in tests/layers/test_fused_decode_mixer.py."""
import os

import pytest
import torch

from quamba.ops import backend
from quamba.ops.conv.qconv1d import qconv1d_update
from quamba.ops.fused_decode.mixer_step import qmixer_ssm_step
from quamba.ops.fused_decode.weights import W8A8Weight
from quamba.ops.linear.qlinear import w8a8_linear
from quamba.ops.linear.qlinear4 import w4a8_linear
from quamba.ops.scan.qsscan import qsscan_update
from tests.ops.fused_step_cases import check_step, cloned_states, reference_step, step_case

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
runs_kernel = pytest.mark.skipif(
    not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1",
    reason="runs the Triton kernels: needs a CUDA device or TRITON_INTERPRET=1")


def kernel_step(**case):
    from quamba.ops.fused_decode import mixer_step_triton
    return mixer_step_triton.ssm_step_with_codes(**case)


# (batch, d_inner, d_state, dt_rank, width): d_inner odd or past a block, batch 1 to past a row
# block (11 = 8 + 3), d_state 1 to 32, odd dt_rank, every conv width
SHAPES = [(1, 37, 16, 5, 4), (3, 300, 16, 19, 4), (8, 70, 1, 3, 2), (5, 33, 7, 12, 3),
          (11, 20, 32, 1, 4)]


@runs_kernel
@pytest.mark.parametrize("int8_state", [True, False], ids=["int8-state", "fp32-state"])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_w8a8_steps_match_the_reference_chain(shape, int8_state):
    case = step_case(*shape, int8_state=int8_state, device=DEVICE)
    for _ in range(3):  # the states carried from step to step
        check_step(case, torch.float16, kernel_step)


@runs_kernel
@pytest.mark.parametrize("int8_state", [True, False], ids=["int8-state", "fp32-state"])
@pytest.mark.parametrize("shape,group_size", [((3, 300, 16, 19, 4), 50), ((8, 64, 16, 4, 4), 64),
                                              ((1, 512, 4, 7, 4), 128)], ids=str)
def test_w4a8_steps_match_the_reference_chain(shape, group_size, int8_state):
    """4-bit x_proj, groups straddling the kernel's K blocks (300 = 6 groups of 50 in blocks of
    256) or not, one group, and two K blocks (512)."""
    case = step_case(*shape, int4=True, int8_state=int8_state, group_size=group_size,
                     device=DEVICE)
    for _ in range(2):
        check_step(case, torch.float16, kernel_step)


@runs_kernel
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
def test_other_output_dtypes(out_dtype):
    case = step_case(2, 40, 16, 6, device=DEVICE)
    check_step(case, out_dtype, kernel_step)


@runs_kernel
def test_an_empty_batch_returns_an_empty_output():
    from quamba.ops.fused_decode import mixer_step_triton
    case = step_case(1, 16, 4, 2, device=DEVICE)
    batched = ("x", "z", "conv_state", "ssm_state")
    empty = {k: (v[:0] if k in batched else v) for k, v in case.items()}
    y = mixer_step_triton.ssm_step(**empty, out_dtype=torch.float16)
    assert y.shape == (0, 16)


def test_the_torch_backend_is_the_chain_of_reference_ops():
    """Bit for bit: the op's reference against the ops it chains, called one by one."""
    case = step_case(3, 40, 16, 6, int4=True, group_size=20)
    chained = cloned_states(case)
    y = reference_step(case, torch.float16)
    s = chained["scales"]
    conv = chained["conv"]
    u = qconv1d_update(chained["x"], chained["conv_state"], s.xz, conv.weight, conv.weight_scale,
                       conv.bias, conv.bias_scale, out_scale=s.u)
    x_proj = chained["x_proj"]
    x_dbl = w4a8_linear(u, x_proj.in_scale, x_proj.packed, x_proj.group_multiplier,
                        x_proj.channel_scale, x_proj.group_size, x_proj.out_scale)
    dt_low, B, C = torch.split(x_dbl, [6, 16, 16], dim=-1)
    dt_proj = chained["dt_proj"]
    dt = w8a8_linear(dt_low, dt_proj.in_scale, dt_proj.weight, dt_proj.weight_scale,
                     dt_proj.out_scale)
    y_chain = qsscan_update(chained["ssm_state"], s.state, u, s.u, dt, s.dt, B, s.xdbl, C, s.xdbl,
                            chained["z"], s.xz, chained["params"])
    assert torch.equal(y, y_chain)
    assert torch.equal(case["conv_state"], chained["conv_state"])
    assert torch.equal(case["ssm_state"], chained["ssm_state"])


def test_cuda_is_refused_where_the_kernels_cannot_run():
    case = step_case(2, 16, 4, 2)
    with pytest.raises(backend.BackendError, match="not a CUDA device"):
        qmixer_ssm_step(**case, backend_name="cuda")
    dt_proj = case["dt_proj"]
    per_channel = W8A8Weight(dt_proj.weight, torch.ones(16), dt_proj.in_scale, dt_proj.out_scale)
    with pytest.raises(backend.BackendError, match="per-tensor"):
        qmixer_ssm_step(**dict(case, dt_proj=per_channel), backend_name="cuda")


@pytest.mark.parametrize("change,message", [
    (lambda c: dict(c, x=c["x"].float()), "int8 \\[batch, d_inner\\] codes"),
    (lambda c: dict(c, conv_state=c["conv_state"][..., :1]), "conv_state"),
    (lambda c: dict(c, ssm_state=c["ssm_state"].half()), "ssm_state"),
    (lambda c: dict(c, ssm_state=c["ssm_state"][..., :3]), "dt_rank \\+ 2 d_state"),
    (lambda c: dict(c, ssm_state=c["ssm_state"][..., 0]), "ssm_state"),
    (lambda c: dict(c, x=c["x"][:, :8], z=c["z"][:, :8], conv_state=c["conv_state"][:, :8],
                    ssm_state=c["ssm_state"][:, :8]), "d_inner = 8 rows"),
])
def test_inputs_outside_the_op_are_value_errors(change, message):
    with pytest.raises(ValueError, match=message):
        qmixer_ssm_step(**change(step_case(2, 16, 4, 2)), backend_name="torch")
