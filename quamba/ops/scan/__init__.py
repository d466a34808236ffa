"""Selective scans: the FP reference (selective_scan.py, mamba-ssm's kernels as its cuda backend
through quamba.ops.fp_kernels), the discretizations (discretization.py), QSScan on int8 inputs
(qsscan.py, its kernels in ``quamba._C``: cuda.py, csrc/qsscan), the scan with a full A per
channel (full_scan.py, Triton: full_scan_triton.py) and the differentiable scan for training
(trainable_scan.py, Triton: trainable_scan_triton.py)."""
from quamba.ops import backend

backend.kernel_modules("quamba.ops.scan.cuda")
