"""Depthwise causal conv1d: the FP reference (causal_conv1d.py, causal-conv1d's kernels as its cuda
backend through quamba.ops.fp_kernels), the int8 reference (qconv1d.py) and its kernels in
``quamba._C`` (cuda.py: csrc/conv1d)."""
from quamba.ops import backend

backend.kernel_modules("quamba.ops.conv.cuda")
