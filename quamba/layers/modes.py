"""SSM dequantization modes (method.md section 5): how a quantized block runs its SSM part.

* ``int8`` — the deployed path: INT8 conv kernel, int8 codes into the INT8 scan (QSScan).
* ``fp32-ssm-input`` — same int8 codes, dequantized to fp32 (u, dt, B, C, z) for an FP32 scan;
  x_proj still takes the int8 codes. Must equal ``int8`` within noise.
* ``float-sim-asic-int8`` — everything in fp32 arithmetic, fake-quantized (quantize →
  dequantize) at every point where the int8 path holds int8; simulates INT8 hardware anywhere.
* ``fp32-conv`` — conv in fp32 from the dequantized int8 input and NOT requantized for the scan
  (x_proj still takes requantized codes): what quantizing u costs.
* ``fp16`` — the unquantized SSM: an A8 model (W8A8, W4A8) runs its FP model instead. A
  weight-only W4A16 model never quantizes its activations, so its conv1d and scan always run in
  the float dtype: ``fp16`` is its only mode (its 4-bit linear layers stay), and the int8 modes
  above are an error for it.
"""
from quamba.errors import QuambaError

SSM_MODES = ("int8", "fp32-ssm-input", "float-sim-asic-int8", "fp32-conv", "fp16")
FP_MODE = "fp16"
# Formats of the decode SSM state of the int8 mixers (see QuantConfig.state_cache).
STATE_CACHE_FORMATS = ("int8", "fp32")


def check_mode(mode: str) -> str:
    if mode not in SSM_MODES:
        raise QuambaError(f"unknown SSM mode {mode!r}; choose one of {', '.join(SSM_MODES)}")
    return mode


def check_weight_only_mode(mode: str) -> str:
    """``mode`` if a weight-only (W4A16) model can run in it, else a one-line QuambaError."""
    check_mode(mode)
    if mode != FP_MODE:
        raise QuambaError(f"SSM mode {mode!r} needs 8-bit activations; a W4A16 model runs conv1d "
                          f"and the scan in its float dtype, so its only SSM mode is {FP_MODE}")
    return mode
