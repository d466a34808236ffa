"""The fused Triton scan (quamba.ops.scan.trainable_scan_triton, the cuda backend of
trainable_selective_scan) against autograd through the fp32 reference: y, the last state and every
gradient.

Without a GPU its kernels run under TRITON_INTERPRET=1 (set by tests/conftest.py) on CPU tensors
(tiny shapes, chunks shorter than the sequence); on a GPU the same cases run compiled, and the
``gpu`` tests add real shapes."""
import pytest
import torch

pytest.importorskip("triton")

from quamba.ops import backend  # noqa: E402
from quamba.ops.scan import trainable_scan_triton
from quamba.ops.scan.discretization import METHODS  # noqa: E402
from quamba.ops.scan.selective_scan import selective_scan  # noqa: E402
from quamba.ops.scan.trainable_scan import FUSED_METHODS, trainable_selective_scan  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


def scan_inputs(batch, d_inner, d_state, seqlen, seed, optional=True):
    """fp32 inputs needing gradients; Δ after softplus around 0.1–0.7 (A in [-2.1, -0.1])."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0, shift=0.0):
        values = torch.randn(*shape, generator=gen) * scale + shift
        return values.to(DEVICE).requires_grad_()

    inputs = dict(u=rand(batch, d_inner, seqlen), delta=rand(batch, d_inner, seqlen, scale=0.3),
                  A=(-torch.rand(d_inner, d_state, generator=gen) * 2 - 0.1).to(DEVICE).requires_grad_(),
                  B=rand(batch, d_state, seqlen), C=rand(batch, d_state, seqlen),
                  D=rand(d_inner), z=rand(batch, d_inner, seqlen),
                  delta_bias=rand(d_inner, scale=0.3, shift=-1.0))
    if not optional:
        inputs.update(D=None, z=None, delta_bias=None)
    return inputs


def outputs_and_grads(scan, inputs, seed):
    """(y, last_state, gradients of Σ y·gy + Σ last·gl for the given inputs) of ``scan``."""
    y, last = scan(**inputs)
    gen = torch.Generator().manual_seed(seed)
    gy = torch.randn(y.shape, generator=gen).to(DEVICE)
    gl = torch.randn(last.shape, generator=gen).to(DEVICE)
    given = [t for t in inputs.values() if t is not None]
    grads = torch.autograd.grad((y * gy).sum() + (last * gl).sum(), given)
    return y, last, grads


def assert_matches_reference(inputs, method, softplus, seed, rtol, atol, **tile):
    """The fused scan with ``tile`` (chunk, block_d, num_warps) against the reference."""
    def fused(**values):
        return trainable_scan_triton.selective_scan(**values, delta_softplus=softplus,
                                                    discretization=method, **tile)

    def reference(**values):
        return selective_scan(**values, delta_softplus=softplus, discretization=method,
                              backend_name="torch")

    got, want = (outputs_and_grads(scan, inputs, seed) for scan in (fused, reference))
    torch.testing.assert_close(got[0], want[0], rtol=rtol, atol=atol, msg="y")
    torch.testing.assert_close(got[1], want[1], rtol=rtol, atol=atol, msg="last state")
    names = [name for name in NAMES if inputs[name] is not None]
    for name, fast, slow in zip(names, got[2], want[2]):
        scale = slow.abs().max().item()
        torch.testing.assert_close(fast, slow, rtol=rtol, atol=atol * max(1.0, scale),
                                   msg=f"gradient of {name}")


@pytest.mark.parametrize("method", FUSED_METHODS)
@pytest.mark.parametrize("d_inner,d_state,seqlen,chunk,block_d",
                         [(6, 5, 19, 4, 4), pytest.param(4, 4, 33, 8, 4, marks=pytest.mark.sweep),
                          pytest.param(8, 16, 9, 16, 8, marks=pytest.mark.sweep)])
def test_tiny_shapes_match_autograd_through_the_reference(method, d_inner, d_state, seqlen,
                                                          chunk, block_d):
    inputs = scan_inputs(2, d_inner, d_state, seqlen, seed=seqlen + d_state)
    assert_matches_reference(inputs, method, True, seed=1, rtol=1e-4, atol=1e-5, chunk=chunk,
                             block_d=block_d)


def test_without_optional_tensors_or_softplus():
    inputs = scan_inputs(2, 5, 4, 13, seed=3, optional=False)
    assert_matches_reference(inputs, "zoh", False, seed=2, rtol=1e-4, atol=1e-5, chunk=4, block_d=4)


def test_only_some_inputs_need_gradients():
    inputs = scan_inputs(2, 4, 4, 11, seed=4)
    for name in ("A", "D", "delta_bias", "z"):
        inputs[name] = inputs[name].detach()
    y, _ = trainable_scan_triton.selective_scan(**inputs, delta_softplus=True, chunk=4, block_d=4)
    du, dB = torch.autograd.grad(y.sum(), (inputs["u"], inputs["B"]))
    want = torch.autograd.grad(selective_scan(**inputs, delta_softplus=True, backend_name="torch")[0].sum(),
                               (inputs["u"], inputs["B"]))
    torch.testing.assert_close(du, want[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dB, want[1], rtol=1e-4, atol=1e-5)


def test_bad_options_are_one_line_errors():
    inputs = scan_inputs(1, 4, 4, 5, seed=5)
    with pytest.raises(ValueError, match="foh"):
        trainable_scan_triton.selective_scan(**inputs, discretization="foh")
    with pytest.raises(ValueError, match="chunk must be a power of two"):
        trainable_scan_triton.selective_scan(**inputs, chunk=12)
    with pytest.raises(ValueError, match="num_warps must be a power of two"):
        trainable_scan_triton.selective_scan(**inputs, num_warps=3)


def test_backward_partials_stay_under_their_cap():
    """Mamba-2.8B's d_inner at batch 8, 2048 steps: (2, 2) would keep 5.4 GB of dB and dC
    partials; the block widens to 8 channels (1.3 GB). The benchmark's shape keeps its tile."""
    assert trainable_scan_triton.partial_capped((2, 2), 8, 5120, 2048, 16) == (8, 2)
    assert trainable_scan_triton.partial_capped((2, 2), 8, 1536, 2048, 16) == (2, 2)
    assert trainable_scan_triton.partial_capped((1, 1), 1, 64, 16, 4) == (1, 1)


def test_the_torch_backend_is_the_reference():
    inputs = scan_inputs(2, 3, 4, 7, seed=6)
    got = trainable_selective_scan(**inputs, delta_softplus=True, discretization="bilinear",
                                   backend_name="torch")
    want = selective_scan(**inputs, delta_softplus=True, discretization="bilinear",
                          backend_name="torch")
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("method", sorted(set(METHODS) - set(FUSED_METHODS)))
def test_cuda_refuses_what_the_kernels_lack(method, monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    inputs = scan_inputs(1, 2, 2, 3, seed=7)
    with pytest.raises(backend.BackendError, match=f"not {method!r}"):
        trainable_selective_scan(**inputs, discretization=method, backend_name="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", FUSED_METHODS)
@pytest.mark.parametrize("batch,d_inner,d_state,seqlen", [(2, 1536, 16, 2048), (3, 200, 16, 517),
                                                          (1, 64, 8, 1001)])
def test_real_shapes_match_autograd_through_the_reference(method, batch, d_inner, d_state, seqlen):
    inputs = scan_inputs(batch, d_inner, d_state, seqlen, seed=seqlen)
    y, last = trainable_selective_scan(**inputs, delta_softplus=True, discretization=method,
                                       backend_name="cuda")
    assert y.is_cuda
    assert_matches_reference(inputs, method, True, seed=3, rtol=1e-3, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("method", ["zoh", "bilinear"])
@pytest.mark.parametrize("chunk,block_d,num_warps", [(32, 2, 4), (32, 4, 4), (32, 8, 8), (16, 4, 2),
                                                     (64, 4, 4), (32, 1, 1), (32, 8, 2)])
def test_tiles_match_autograd_through_the_reference(method, chunk, block_d, num_warps):
    inputs = scan_inputs(3, 200, 16, 517, seed=chunk + block_d)
    assert_matches_reference(inputs, method, True, seed=4, rtol=1e-3, atol=1e-4, chunk=chunk,
                             block_d=block_d, num_warps=num_warps)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_half_precision_inputs_compute_in_fp32():
    """fp16 inputs: y and every gradient in fp16 (the kernels store du, dΔ and dz in it), each
    within fp16's rounding of autograd through the fp32 reference."""
    inputs = scan_inputs(2, 256, 16, 300, seed=8)
    half = {name: t.detach().half().requires_grad_() for name, t in inputs.items()}
    y, _ = trainable_selective_scan(**half, delta_softplus=True, backend_name="cuda")
    gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    grads = torch.autograd.grad((y.float() * gy).sum(), list(half.values()))
    assert y.dtype == torch.float16 and all(g.dtype == torch.float16 for g in grads)
    single = {name: t.detach().float().requires_grad_() for name, t in half.items()}
    want_y = selective_scan(**single, delta_softplus=True, backend_name="torch")[0]
    want = torch.autograd.grad((want_y * gy).sum(), list(single.values()))
    torch.testing.assert_close(y.float(), want_y, rtol=1e-2, atol=1e-2)
    for name, fast, slow in zip(NAMES, grads, want):
        torch.testing.assert_close(fast.float(), slow, rtol=1e-2,
                                   atol=1e-2 * max(1.0, slow.abs().max().item()),
                                   msg=f"gradient of {name}")