"""The ``cuda`` backend: wrappers that register the kernels of ``quamba._C`` (and the Triton
kernels of Mamba2's SSD, ssd.py, and gated RMSNorm, gated_norm.py) with
:mod:`quamba.ops.backend`. Imported by ``backend.cuda_extension_error()`` once ``quamba._C`` has
loaded; each kernel family has its own module."""
import importlib.util

from quamba.ops.cuda_backend import gemm  # noqa: F401
from quamba.ops.cuda_backend import gated_norm  # noqa: F401  Triton
from quamba.ops.cuda_backend import gemm4  # noqa: F401
from quamba.ops.cuda_backend import ssd  # noqa: F401  Triton (it ships with PyTorch's CUDA builds)

if importlib.util.find_spec("quamba.ops.cuda_backend.ssm") is not None:
    from quamba.ops.cuda_backend import ssm  # noqa: F401
