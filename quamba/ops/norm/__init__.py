"""Norms and rotations: RMSNorm with the residual add (rms_norm.py), RMSNorm → int8 (qnorm.py),
Falcon-Mamba's and Jamba's norms of dt, B and C (mixer_norm.py, Triton: mixer_norm_triton.py),
Mamba2's gated RMSNorm (gated_norm.py, Triton: gated_norm_triton.py), the Hadamard matrices and
transform (hadamard.py) and Hadamard → int8 (qhadamard.py); the int8 ones' kernels in
``quamba._C`` (cuda.py: csrc/norm)."""
from quamba.ops import backend

backend.kernel_modules("quamba.ops.norm.cuda", "quamba.ops.norm.gated_norm_triton",
                       "quamba.ops.norm.mixer_norm_triton")
