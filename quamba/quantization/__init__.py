"""The quantization pipeline (W8A8, W4A8, W4A16): recipe, rotation, quantize(), checkpoints."""
from quamba.quantization.checkpoint import from_pretrained, save_quantized
from quamba.quantization.config import QuantConfig
from quamba.quantization.quantize import build_quantized_model, quantize

__all__ = ["QuantConfig", "quantize", "build_quantized_model", "from_pretrained", "save_quantized"]
