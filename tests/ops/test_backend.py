"""Backend selection: strict for quamba's own kernels, a fallback for optional FP kernels."""
import pytest
import torch

from quamba.ops import backend

CUDA = torch.device("cuda")


@pytest.fixture
def ops():
    """Two throwaway ops: one with a quamba._C-style cuda impl, one with an optional one."""
    ops = ("test_strict_op", "test_optional_op", "test_composite_op")
    for op in ops:
        backend.register(op, "torch")(lambda: "torch")
    backend.register("test_strict_op", "cuda")(lambda: "cuda")
    backend.register("test_optional_op", "cuda", requires=lambda: "package missing")(lambda: "cuda")
    backend.register("test_composite_op", "cuda", kernels=("test_absent_kernel",))(lambda: "cuda")
    yield
    for op in ops:
        backend._IMPLS.pop(op, None)
        backend._REQUIREMENTS.pop(op, None)
        backend._OPTIONAL.discard(op)
        backend._KERNELS.pop(op, None)
    backend._kernel_missing.cache_clear()


def test_optional_cuda_kernels_fall_back_to_the_reference(ops, monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    for choice in ("auto", "cuda"):
        assert backend.select("test_optional_op", CUDA, choice)() == "torch"


def test_quamba_kernels_are_strict(ops, monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "cuda_extension_error", lambda: "the extension is not built")
    assert backend.select("test_strict_op", CUDA, "auto")() == "torch"
    with pytest.raises(backend.BackendError, match="the extension is not built"):
        backend.select("test_strict_op", CUDA, "cuda")


def test_kernels_left_out_of_a_partial_build_fall_back_or_are_refused(ops, monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "cuda_extension_error", lambda: None)  # built, but without this op
    assert backend.select("test_strict_op", CUDA, "auto")() == "torch"
    with pytest.raises(backend.BackendError, match="built without the test_strict_op kernel"):
        backend.select("test_strict_op", CUDA, "cuda")


def test_a_composite_cuda_op_needs_every_kernel_it_runs(ops, monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "cuda_extension_error", lambda: None)
    assert backend.select("test_composite_op", CUDA, "auto")() == "torch"
    with pytest.raises(backend.BackendError, match="built without the test_absent_kernel kernel"):
        backend.select("test_composite_op", CUDA, "cuda")


def test_environment_forces_the_reference(ops, monkeypatch):
    monkeypatch.setenv("QUAMBA_BACKEND", "torch")
    assert backend.select("test_strict_op", CUDA, "cuda")() == "torch"
