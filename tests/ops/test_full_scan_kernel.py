"""The full-A scan's Triton kernel (quamba.ops.scan.full_scan_triton) against the torch reference
(quamba.ops.scan.full_scan), fp32 with stable A (eigenvalues' real parts in about [-3.5, -0.5]).

The small-shape tests run the kernel itself: on a GPU, or on CPU under Triton's interpreter
(``TRITON_INTERPRET=1 python -m pytest -q tests/ops/test_full_scan_kernel.py``); the others go
through the ops' ``cuda`` backend on real shapes and need a GPU. What the kernel lacks is a
BackendError under ``cuda`` on any device."""
import importlib.util
import os

import pytest
import torch

from quamba.ops import backend
from quamba.ops.scan.discretization import METHODS, input_drive
from quamba.ops.scan.full_scan import full_selective_scan, full_selective_state_update, structured_A
from quamba.ops.scan.selective_scan import selective_scan

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
runs_kernel = pytest.mark.skipif(
    importlib.util.find_spec("triton") is None
    or (not HAS_CUDA and os.environ.get("TRITON_INTERPRET") != "1"),
    reason="runs the Triton kernel: needs Triton, and a CUDA device or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


def scan_inputs(seed, batch, d_inner, d_state, seqlen, dtype=torch.float32):
    """Scan inputs on DEVICE with a dense stable A (as tests/ops/test_full_scan.py's)."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    A = 0.3 * randn(d_inner, d_state, d_state) - 2 * torch.eye(d_state)
    inputs = dict(u=randn(batch, d_inner, seqlen), delta=randn(batch, d_inner, seqlen) - 1.5,
                  A=A, B=randn(batch, d_state, seqlen), C=randn(batch, d_state, seqlen),
                  D=randn(d_inner), z=randn(batch, d_inner, seqlen),
                  delta_bias=0.1 * randn(d_inner))
    return {k: v.to(DEVICE, dtype if k in ("u", "delta", "B", "C", "z") else torch.float32)
            for k, v in inputs.items()}


def at(inputs, t):
    return {k: (v[..., t] if k in ("u", "delta", "B", "C", "z") else v) for k, v in inputs.items()}


def reference(inputs, method, **options):
    return full_selective_scan(**inputs, delta_softplus=True, discretization=method,
                               backend_name="torch", **options)


def assert_close(actual, expected, rtol):
    torch.testing.assert_close(actual.float(), expected.float(), rtol=rtol,
                               atol=rtol * float(expected.float().abs().max()))


@runs_kernel
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("d_state,seqlen", [(16, 9), pytest.param(4, 17, marks=pytest.mark.sweep),
                                            pytest.param(8, 5, marks=pytest.mark.sweep)])
def test_the_kernel_matches_the_reference(method, d_state, seqlen):
    from quamba.ops.scan import full_scan_triton
    inputs = scan_inputs(d_state + seqlen, 2, 5, d_state, seqlen)
    initial = torch.randn(2, 5, d_state, device=DEVICE)
    drive = torch.randn(2, 5, d_state, device=DEVICE) if method == "foh" else None
    y_ref, last_ref = reference(inputs, method, initial_state=initial, initial_drive=drive)
    y, last = full_scan_triton.scan(*inputs.values(), True, initial, method, initial_drive=drive)
    assert_close(y, y_ref, 1e-4)
    assert_close(last, last_ref, 1e-4)


@runs_kernel
@pytest.mark.parametrize("method", METHODS)
def test_kernel_decode_steps_continue_the_kernel_prefill(method):
    from quamba.ops.scan import full_scan_triton
    inputs = scan_inputs(3, 2, 3, 6, 7)
    y_all, last_all = reference(inputs, method)
    prefix = {k: (v[..., :4] if k in ("u", "delta", "B", "C", "z") else v) for k, v in inputs.items()}
    y_prefix, state = full_scan_triton.scan(*prefix.values(), True, None, method)
    drive = input_drive(inputs["u"][..., 3], inputs["B"][..., 3]) if method == "foh" else None
    state_view = state.transpose(0, 1).contiguous().transpose(0, 1)  # steps a strided state too
    ys = [full_scan_triton.step(state_view, *at(inputs, t).values(), True, method, drive)
          for t in range(4, 7)]
    assert_close(torch.cat([y_prefix, torch.stack(ys, dim=-1)], dim=-1), y_all, 1e-4)
    assert_close(state_view, last_all, 1e-4)
    if drive is not None:
        assert_close(drive, input_drive(inputs["u"][..., -1], inputs["B"][..., -1]), 1e-6)


@runs_kernel
@pytest.mark.parametrize("method", ["zoh", "foh"])
@pytest.mark.parametrize("shift", [6.0, 3.5, 2.5])
def test_short_steps_take_shorter_series(method, shift):
    """Δ around softplus(-shift): sub-step norms in each of the series' length ranges."""
    from quamba.ops.scan import full_scan_triton
    inputs = scan_inputs(10, 2, 5, 16, 6)
    inputs["delta"] = inputs["delta"] + 1.5 - shift
    y_ref, last_ref = reference(inputs, method)
    y, last = full_scan_triton.scan(*inputs.values(), True, None, method)
    assert_close(y, y_ref, 1e-4)
    assert_close(last, last_ref, 1e-4)


@runs_kernel
def test_half_inputs_and_no_optional_inputs():
    from quamba.ops.scan import full_scan_triton
    inputs = scan_inputs(4, 2, 5, 16, 6, dtype=torch.float16)
    for name in ("D", "z", "delta_bias"):
        inputs[name] = None
    y_ref, last_ref = reference(inputs, "zoh")
    y, last = full_scan_triton.scan(*inputs.values(), True, None, "zoh")
    assert y.dtype == torch.float16 and last.dtype == torch.float32
    assert_close(y, y_ref, 2e-3)
    assert_close(last, last_ref, 1e-4)


def test_what_the_kernel_lacks_is_refused_under_cuda():
    big = scan_inputs(5, 1, 2, 17, 3)
    with pytest.raises(backend.BackendError, match=r"handles d_state ≤ 16, not 17"):
        full_selective_scan(**big, backend_name="cuda")
    small = scan_inputs(6, 1, 2, 4, 3)
    with pytest.raises(backend.BackendError, match=r"computes in fp32, not fp64"):
        full_selective_scan(**{k: v.double() for k, v in small.items()}, backend_name="cuda")
    with pytest.raises(backend.BackendError, match=r"no backward"):
        full_selective_state_update(torch.zeros(1, 2, 4, device=DEVICE),
                                    **dict(at(small, 0), u=small["u"][..., 0].requires_grad_()),
                                    backend_name="cuda")
    y, _ = full_selective_scan(**big)  # auto: the reference
    assert y.shape == (1, 2, 3)


# Real shapes through the ops' cuda backend, on a GPU

REAL_SHAPES = [(2, 256, 1024, 16), (2, 300, 1023, 16), (2, 256, 333, 5)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("batch,d_inner,seqlen,d_state", REAL_SHAPES)
def test_real_shapes_match_the_reference(batch, d_inner, seqlen, d_state, method):
    inputs = scan_inputs(seqlen + d_state, batch, d_inner, d_state, seqlen)
    initial = torch.randn(batch, d_inner, d_state, device=DEVICE)
    y_ref, last_ref = reference(inputs, method, initial_state=initial)
    with backend.recording() as ran:
        y, last = full_selective_scan(**inputs, delta_softplus=True, initial_state=initial,
                                      discretization=method, backend_name="cuda")
    assert ran == {"full_selective_scan": {"cuda"}}
    assert_close(y, y_ref, 1e-3)
    assert_close(last, last_ref, 1e-3)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method", METHODS)
def test_real_decode_steps_continue_the_prefill(method):
    inputs = scan_inputs(7, 2, 512, 16, 1030)
    y_all, last_all = full_selective_scan(**inputs, delta_softplus=True, discretization=method,
                                          backend_name="cuda")
    prefix = {k: (v[..., :1024] if k in ("u", "delta", "B", "C", "z") else v)
              for k, v in inputs.items()}
    _, state = full_selective_scan(**prefix, delta_softplus=True, discretization=method,
                                   backend_name="cuda")
    drive = input_drive(inputs["u"][..., 1023], inputs["B"][..., 1023]) if method == "foh" else None
    for t in range(1024, 1030):
        y = full_selective_state_update(state, **at(inputs, t), delta_softplus=True,
                                        discretization=method, drive=drive, backend_name="cuda")
        assert_close(y, y_all[..., t], 1e-5)
    assert_close(state, last_all, 1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method", METHODS)
def test_a_diagonal_full_a_reproduces_the_diagonal_scan(method):
    inputs = scan_inputs(8, 2, 384, 16, 1024)
    # rk4's |Ā| passes 1 where Δ·a < -2.79 (its stability limit): the states explode and both
    # scans end in nan. These inputs' largest step is Δ ≈ 3.4, so rk4's a stays above -0.65
    spread = 0.6 if method == "rk4" else 7
    diagonal = -(0.05 + spread * torch.rand(384, 16, device=DEVICE))
    y_ref, last_ref = selective_scan(**dict(inputs, A=diagonal), delta_softplus=True,
                                     discretization=method, backend_name="torch")
    y, last = full_selective_scan(**dict(inputs, A=torch.diag_embed(diagonal)),
                                  delta_softplus=True, discretization=method, backend_name="cuda")
    assert_close(y, y_ref, 1e-3)
    assert_close(last, last_ref, 1e-3)


@pytest.mark.gpu
@needs_cuda
def test_structured_a_runs_the_kernel_on_its_dense_form():
    inputs = scan_inputs(9, 2, 256, 16, 1024)
    gen = torch.Generator(device=DEVICE).manual_seed(9)
    structured = (-1 - torch.rand(256, 16, device=DEVICE, generator=gen),
                  0.3 * torch.randn(256, 16, 2, device=DEVICE, generator=gen),
                  0.3 * torch.randn(256, 16, 2, device=DEVICE, generator=gen))
    y, last = full_selective_scan(**dict(inputs, A=structured), delta_softplus=True,
                                  backend_name="cuda")
    y_ref, last_ref = reference(dict(inputs, A=structured_A(*structured)), "zoh")
    assert_close(y, y_ref, 1e-3)
    assert_close(last, last_ref, 1e-3)



@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_dispatch_limit_is_the_kernels_tile():
    from quamba.ops.scan import full_scan, full_scan_triton
    assert full_scan.KERNEL_MAX_D_STATE == full_scan_triton.D_STATE_TILE
