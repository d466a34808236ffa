from quamba.models.config import MambaConfig, preset_config
from quamba.models.loading import load_model, save_model
from quamba.models.mamba import MambaLMHeadModel, randomize_
from quamba.models.state import InferenceCache

__all__ = ["MambaConfig", "MambaLMHeadModel", "InferenceCache", "load_model", "save_model",
           "preset_config", "randomize_"]
