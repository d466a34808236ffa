"""SSM dequantization modes (method.md section 5): how a quantized block runs its SSM part.

* ``int8`` — the deployed path: INT8 conv kernel, int8 codes into the INT8 scan (QSScan).
* ``fp32-ssm-input`` — same int8 codes, dequantized to fp32 (u, dt, B, C, z) for an FP32 scan;
  x_proj still takes the int8 codes. Must equal ``int8`` within noise.
* ``float-sim-asic-int8`` — everything in fp32 arithmetic, fake-quantized (quantize →
  dequantize) at every point where the int8 path holds int8; simulates INT8 hardware anywhere.
* ``fp32-conv`` — conv in fp32 from the dequantized int8 input and NOT requantized for the scan
  (x_proj still takes requantized codes): what quantizing u costs.
* ``fp16`` — the unquantized model.
"""
from quamba.errors import QuambaError

SSM_MODES = ("int8", "fp32-ssm-input", "float-sim-asic-int8", "fp32-conv", "fp16")


def check_mode(mode: str) -> str:
    if mode not in SSM_MODES:
        raise QuambaError(f"unknown SSM mode {mode!r}; choose one of {', '.join(SSM_MODES)}")
    return mode
