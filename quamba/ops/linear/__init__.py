"""Linear layers on int8 and 4-bit weights: the W8A8 reference (qlinear.py), the W4A8 and
weight-only W4A16 references (qlinear4.py; the format is quamba.ops.quant4), and their kernels in
``quamba._C`` (cuda.py: csrc/gemm's CUTLASS GEMM and GEMVs; cuda4.py: csrc/gemm4); the int8
quantizers of a float input, per tensor and per token (input_quant.py, Triton:
input_quant_triton.py)."""
from quamba.ops import backend

backend.kernel_modules("quamba.ops.linear.cuda", "quamba.ops.linear.cuda4",
                       "quamba.ops.linear.input_quant_triton")
