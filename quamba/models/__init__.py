from quamba.models.config import MambaConfig, preset_config
from quamba.models.loading import load_model, save_model
from quamba.models.mamba import InferenceCache, MambaLMHeadModel, randomize_

__all__ = ["MambaConfig", "MambaLMHeadModel", "InferenceCache", "load_model", "save_model",
           "preset_config", "randomize_"]
