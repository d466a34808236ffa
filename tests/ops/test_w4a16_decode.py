"""w4a16_ssm_step on the CPU: its torch reference (the FP mixer's chain of ops) against the step in
fp64 without the chain's roundings, at several shapes, and its errors for inputs outside its
scope. The model-level tests (the mixer's decode step through the op and op by op) are in
tests/quantization/test_w4a16.py; the kernel's in test_cuda_w4a16_step.py."""
import pytest
import torch

from quamba.ops.fused_decode.w4a16_step import FloatSSMWeights, w4a16_ssm_step
from tests.ops.w4a16_step_cases import cloned, fp64_step, relative_error, step_case

# (batch, d_inner, d_state, dt_rank, conv width, group size)
SHAPES = [(1, 256, 16, 16, 4, 128), (3, 96, 16, 8, 4, 32), (5, 192, 12, 20, 3, 64),
          (2, 64, 7, 4, 2, 64)]
# relative error bounds against fp64: fp32 the sums' order; 16-bit types u, x_proj's output and dt
# rounded to the dtype as the chain stores them (measured: 2e-7, 8e-4, 5e-3 at most)
TOLERANCE = {torch.float32: 1e-6, torch.float16: 5e-3, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("dtype", list(TOLERANCE), ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_torch_reference_follows_the_step_in_fp64(shape, dtype):
    case = step_case(*shape, dtype=dtype, seed=sum(shape))
    y_ref, conv_ref, state_ref = fp64_step(**case)
    got = cloned(case)
    y = w4a16_ssm_step(**got, backend_name="torch")
    assert y.dtype == dtype and y.shape == case["x"].shape
    assert torch.equal(got["conv_state"].double(), conv_ref)  # a shift of stored values
    tol = TOLERANCE[dtype]
    assert relative_error(got["ssm_state"], state_ref) < tol
    assert relative_error(y, y_ref) < tol


def test_ungated_step_without_conv_bias():
    case = step_case(2, 96, 16, 8, 4, 32, dtype=torch.float32, gated=False, conv_bias=False)
    y_ref, _, _ = fp64_step(**case)
    y = w4a16_ssm_step(**cloned(case), backend_name="torch")
    assert relative_error(y, y_ref) < TOLERANCE[torch.float32]


def test_inputs_outside_the_ops_scope_are_value_errors():
    case = step_case(2, 96, 16, 8, 4, 32)
    with pytest.raises(ValueError, match="x and z must be float"):
        w4a16_ssm_step(**{**case, "x": case["x"].to(torch.int8)})
    with pytest.raises(ValueError, match="conv_state must be"):
        w4a16_ssm_step(**{**case, "conv_state": case["conv_state"][:, :, :2]})
    with pytest.raises(ValueError, match="ssm_state must be"):
        w4a16_ssm_step(**{**case, "ssm_state": case["ssm_state"][0]})
    weights = case["weights"]
    narrow = FloatSSMWeights(weights.conv_weight, weights.conv_bias, weights.dt_weight[:, :4],
                             weights.dt_bias, weights.A, weights.D)
    with pytest.raises(ValueError, match="does not map d_inner"):
        w4a16_ssm_step(**{**case, "weights": narrow})
