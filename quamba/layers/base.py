"""Common plumbing of quantized modules: scales kept both as checkpointed fp32 buffers and as
Python floats (so kernels get host scalars and forwards never synchronise to read a scale)."""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.layers.modes import check_mode


class QuantModule(nn.Module):
    """A module with named scales and an SSM mode."""

    def __init__(self):
        super().__init__()
        self._scale_names: list[str] = []
        self.scales: dict[str, float] = {}
        self.mode = "int8"
        self.backend: str | None = None
        self.register_load_state_dict_post_hook(lambda module, _: module.refresh_scales())

    def register_scale(self, name: str, value) -> None:
        """A per-tensor fp32 scale, saved in the state dict as a 0-dim tensor."""
        self.register_buffer(name, torch.tensor(float(value), dtype=torch.float32))
        self._scale_names.append(name)
        self.scales[name] = float(getattr(self, name))

    def refresh_scales(self) -> None:
        for name in self._scale_names:
            self.scales[name] = float(getattr(self, name))

    def set_mode(self, mode: str, backend: str | None = None) -> None:
        self.mode = check_mode(mode)
        self.backend = backend

    @property
    def simulate(self) -> bool:
        return self.mode == "float-sim-asic-int8"
