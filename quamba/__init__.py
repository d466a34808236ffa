"""quamba: post-training quantization of Mamba language models."""
from quamba.errors import CheckpointError, ModelNotFoundError, QuambaError
from quamba.models import MambaConfig, MambaLMHeadModel, load_model, save_model
from quamba.version import __version__

__all__ = ["__version__", "load_model", "save_model", "MambaConfig", "MambaLMHeadModel",
           "QuambaError", "CheckpointError", "ModelNotFoundError"]
