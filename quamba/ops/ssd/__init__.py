"""Mamba2's SSD: the FP reference (ssd.py), the int8 conv over xBC and the SSD on int8 inputs
(qssd.py), and both SSDs in Triton (ssd_triton.py)."""
from quamba.ops import backend

backend.kernel_modules("quamba.ops.ssd.ssd_triton")
