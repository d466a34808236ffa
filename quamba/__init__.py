"""quamba: post-training quantization of Mamba language models."""
from quamba.errors import CheckpointError, ModelNotFoundError, QuambaError
from quamba.export import export
from quamba.layers.modes import SSM_MODES
from quamba.models import MambaConfig, MambaLMHeadModel, load_model, save_model
from quamba.models.quantized import QuantizedMambaLM
from quamba.models.quantized_vision import QuantizedVisionMamba
from quamba.models.vision import VisionMamba, VisionMambaConfig
from quamba.quantization import QuantConfig, from_pretrained, quantize
from quamba.version import __version__

__all__ = ["__version__", "load_model", "save_model", "quantize", "export", "from_pretrained",
           "QuantConfig", "SSM_MODES", "MambaConfig", "MambaLMHeadModel", "QuantizedMambaLM", "VisionMamba",
           "VisionMambaConfig", "QuantizedVisionMamba", "QuambaError",
           "CheckpointError", "ModelNotFoundError"]
