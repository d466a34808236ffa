"""A kernel file of quamba/ops loaded on its own, for tests on any machine: a Triton file's
kernels compiled on a GPU, under Triton's interpreter on CPU tensors elsewhere (tests/conftest.py
sets TRITON_INTERPRET=1 there); a kernel launcher's pure-torch parts (repacked weights, what the
kernel lacks). quamba.ops.backend imports such a file only once quamba._C loads, which a CPU
machine lacks."""
import copy
import importlib.util
from pathlib import Path

import pytest
import torch

from quamba.ops import backend

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_backend_file(monkeypatch, filename: str):
    """quamba/ops/``filename`` (e.g. ``ssd/ssd_triton.py``), a Triton file, as a fresh module; its
    backend registrations are undone after the test."""
    pytest.importorskip("triton")
    for name in ("_IMPLS", "_REQUIREMENTS", "_KERNELS"):
        monkeypatch.setattr(backend, name, copy.deepcopy(getattr(backend, name)))
    monkeypatch.setattr(backend, "_OPTIONAL", set(backend._OPTIONAL))
    return load_file(filename)


def load_file(filename: str):
    """quamba/ops/``filename`` as a fresh module (a launcher that registers no backend)."""
    path = Path(backend.__file__).parent / filename
    spec = importlib.util.spec_from_file_location(f"{path.stem}_kernels_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernels_for_references(monkeypatch, filename: str, launchers: dict[str, str]) -> None:
    """Loads quamba/ops/``filename`` (:func:`load_backend_file`) and has each op of ``launchers``
    (op → the name of its launcher there) run that launcher wherever it would run its torch
    reference, until the test ends: a model on the CPU then runs those kernels under Triton's
    interpreter."""
    module = load_backend_file(monkeypatch, filename)
    for op, launcher in launchers.items():
        backend._IMPLS[op]["torch"] = getattr(module, launcher)
