"""The W8A8 quantization pipeline: recipe config, rotation, quantize(), checkpoints."""
from quamba.quantization.checkpoint import from_pretrained, save_quantized
from quamba.quantization.config import QuantConfig
from quamba.quantization.quantize import build_quantized_model, quantize

__all__ = ["QuantConfig", "quantize", "build_quantized_model", "from_pretrained", "save_quantized"]
