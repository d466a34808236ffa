"""QuantizedVisionMamba: the Vision Mamba classifier with W8A8 or W4A8 blocks (QRMSNorm → int8
and QBiMambaMixer). The patch embedding, class token, position embedding, final norm and head stay
in the float dtype; forward and pooling are VisionMamba's."""
from __future__ import annotations

import torch
import torch.nn as nn

from quamba.errors import QuambaError
from quamba.layers.qbimixer import BI_ACTIVATION_SCALES, QBiMambaMixer
from quamba.layers.qnorm import QRMSNorm
from quamba.models.mamba import Block, RMSNorm
from quamba.models.quantized import QuantizedModel
from quamba.models.vision import PatchEmbed, VisionMamba, VisionMambaConfig


class QuantizedVisionMamba(QuantizedModel, VisionMamba):
    """Built empty (codes zero, scales one) with the shapes of ``config``; ``quantize`` or
    ``from_pretrained`` fill it. ``set_ssm_mode`` switches the SSM mode; ``fp16`` runs the FP
    classifier."""

    def __init__(self, config: VisionMambaConfig, quant_config, dtype=torch.float16, device=None):
        nn.Module.__init__(self)
        if quant_config.weight_only:
            raise QuambaError("Vision Mamba models are quantized W8A8 or W4A8; W4A16 is not supported")
        if config.bimamba != "v2":
            raise QuambaError("only bimamba 'v2' Vision Mamba models can be quantized")
        self.config, self.quant_config = config, quant_config
        self.calibration: dict = {}
        self.base_model: str | None = None
        kw = dict(device=device, dtype=dtype)
        self.patch_embed = PatchEmbed(config, **kw)
        if config.cls_token != "none":
            self.cls_token = nn.Parameter(torch.zeros(1, 1, config.d_model, **kw))
        self.pos_embed = nn.Parameter(torch.zeros(1, config.seqlen, config.d_model, **kw))
        self.layers = nn.ModuleList(_int8_block(config, quant_config, dtype, device)
                                    for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, **kw)
        self.head = nn.Linear(config.d_model, config.num_classes, **kw)
        self.__dict__["fp_model"] = None  # the unquantized classifier for the fp16 mode
        self.ssm_mode = "int8"

    def forward(self, images, **block_kwargs):
        if self._runs_fp_model:
            return self._fp()(images, **block_kwargs)
        return super().forward(images, **block_kwargs)


def _int8_block(config: VisionMambaConfig, quant_config, dtype, device) -> Block:
    ones = {name: 1.0 for name in BI_ACTIVATION_SCALES}
    hadamard = quant_config.hadamard
    return Block(QRMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, 1.0,
                          has_weight=not hadamard, device=device),
                 QBiMambaMixer(config.d_model, config.d_inner, config.d_state, config.d_conv,
                               config.dt_rank, ones, 1.0, hadamard, dtype, device,
                               quant_config.w_bits, quant_config.group_size, config.divide_out))
