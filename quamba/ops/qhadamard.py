"""Online Hadamard transform fused with int8 quantization (the out_proj input)."""
from __future__ import annotations

from quamba.ops import backend
from quamba.ops.hadamard import hadamard_transform
from quamba.ops.quant import quantize


def hadamard_quant(x, out_scale, backend_name=None):
    """x: [..., n] float, n a supported Hadamard size (quamba.ops.hadamard). Returns int8
    ``quantize(x @ hadamard_matrix(n), out_scale)`` [..., n], the transform in fp32. int8 outputs
    agree across backends to one step (fp32 summation order differs)."""
    impl = backend.select("hadamard_quant", x.device, backend_name)
    return impl(x, out_scale)


@backend.register("hadamard_quant", "torch")
def _hadamard_quant_torch(x, out_scale):
    return quantize(hadamard_transform(x.float()), out_scale)
