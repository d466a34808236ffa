"""Backend selection: strict for quamba's own kernels, a fallback for optional FP kernels, a
warning for every slow path on a GPU, and a record of what ran."""
import importlib.abc
import importlib.util
import sys

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


def test_fp_kernels_registered_by_the_extension_are_found_on_first_use(monkeypatch):
    """An FP op whose cuda implementation registers when quamba._C loads (the Mamba2 SSD's) runs
    it on the first call on a GPU, not the reference with a 'no CUDA kernel yet' warning."""
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    op = "test_late_fp_op"
    backend.register(op, "torch", fp=True)(lambda: "torch")

    def load_extension():
        backend.register(op, "cuda", requires=lambda: None)(lambda: "cuda")
    monkeypatch.setattr(backend, "cuda_extension_error", load_extension)
    try:
        assert backend.select(op, CUDA, "auto")() == "cuda"
    finally:
        backend._IMPLS.pop(op, None)
        backend._REQUIREMENTS.pop(op, None)
        backend._OPTIONAL.discard(op)


def test_environment_forces_the_reference(ops, monkeypatch):
    monkeypatch.setenv("QUAMBA_BACKEND", "torch")
    assert backend.select("test_strict_op", CUDA, "cuda")() == "torch"


def test_auto_on_a_gpu_warns_once_with_the_reason(ops, monkeypatch, caplog):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "cuda_extension_error", lambda: "quamba._C failed to load: boom")
    monkeypatch.setattr(backend, "_WARNED", set())
    with caplog.at_level("INFO", logger="quamba"):
        for _ in range(3):
            assert backend.select("test_strict_op", CUDA)() == "torch"
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert "test_strict_op" in warnings[0].getMessage() and "boom" in warnings[0].getMessage()


def test_optional_kernels_missing_on_a_gpu_warn_too(ops, monkeypatch, caplog):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "_WARNED", set())
    with caplog.at_level("WARNING", logger="quamba"):
        backend.select("test_optional_op", CUDA, "cuda")
    assert "package missing" in caplog.text and "FP16 kernel" in caplog.text


def test_asking_for_the_reference_does_not_warn(ops, monkeypatch, caplog):
    monkeypatch.setenv("QUAMBA_BACKEND", "torch")
    monkeypatch.setattr(backend, "_WARNED", set())
    with caplog.at_level("WARNING", logger="quamba"):
        backend.select("test_strict_op", CUDA)
    assert caplog.text == ""


def test_cpu_tensors_take_the_reference_without_a_warning(ops, monkeypatch, caplog):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "_WARNED", set())
    with caplog.at_level("WARNING", logger="quamba"):
        assert backend.select("test_strict_op", torch.device("cpu"))() == "torch"
    assert caplog.text == ""


def test_recording_collects_the_backend_of_each_selected_op(ops, monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "cuda_extension_error", lambda: None)
    monkeypatch.setattr(backend, "_kernel_missing", lambda op: None)
    monkeypatch.setattr(backend, "device_error", lambda index: None)
    with backend.recording() as outer:
        backend.select("test_strict_op", CUDA)
        with backend.recording() as inner:
            backend.select("test_optional_op", CUDA)
    backend.select("test_composite_op", CUDA)  # outside both
    assert outer == {"test_strict_op": {"cuda"}, "test_optional_op": {"torch"}}
    assert inner == {"test_optional_op": {"torch"}}
    assert backend.on_reference(outer, ["test_strict_op", "test_optional_op"]) == ["test_optional_op"]


def test_a_gpu_the_build_holds_no_kernel_for_falls_back_or_is_refused(ops, monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "cuda_extension_error", lambda: None)
    monkeypatch.setattr(backend, "_kernel_missing", lambda op: None)
    monkeypatch.setattr(backend, "device_error", lambda index: "no kernel for sm_75")
    assert backend.resolve("test_strict_op", CUDA) == ("torch", "no kernel for sm_75")
    with pytest.raises(backend.BackendError, match="no kernel for sm_75"):
        backend.select("test_strict_op", CUDA, "cuda")
    plan = backend.plan(CUDA, "cuda")
    assert plan["test_strict_op"][0] == "error" and plan["test_optional_op"] == ("torch", "package missing")


class _BrokenExtension(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Makes ``import quamba._C`` fail as a library with an undefined symbol does."""

    def find_spec(self, name, path, target=None):
        if name == "quamba._C":
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        raise ImportError("quamba/_C.so: undefined symbol: _ZN3c104cuda9SetDeviceEi")

    def exec_module(self, module):
        raise AssertionError("unreachable")


@pytest.mark.parametrize("finder, expected", [
    (_BrokenExtension(), "quamba._C failed to load: ImportError: quamba/_C.so: undefined symbol"),
    (None, "the quamba CUDA extension quamba._C is not built"),
])
def test_why_the_extension_does_not_load_is_in_the_message(monkeypatch, finder, expected):
    monkeypatch.delitem(sys.modules, "quamba._C", raising=False)
    if finder is None:
        monkeypatch.setitem(sys.modules, "quamba._C", None)  # what a missing module looks like
    else:
        monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    backend.cuda_extension_error.cache_clear()
    try:
        assert backend.cuda_extension_error().startswith(expected)
    finally:
        backend.cuda_extension_error.cache_clear()


def test_conv_input_layout_for_causal_conv1d():
    """Channel-last views whose strides causal-conv1d refuses (odd widths) become channel-first
    copies; the others pass as they are."""
    from quamba.ops.fp_kernels import conv_layout
    odd = torch.randn(2, 11, 37).transpose(1, 2)  # xBC [batch, length, 37] seen as [b, 37, len]
    fixed = conv_layout(odd)
    assert fixed.is_contiguous() and torch.equal(fixed, odd)
    aligned = torch.randn(2, 16, 40).transpose(1, 2)
    assert conv_layout(aligned) is aligned
    first = torch.randn(2, 37, 11)
    assert conv_layout(first) is first
