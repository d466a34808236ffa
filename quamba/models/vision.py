"""Vision Mamba (Vim, Zhu et al., arXiv 2401.09417): an image classifier of bidirectional Mamba
blocks, with the parameter names of hustvl/Vim, so that its checkpoints load as they are.

    images [b, C, H, W] (normalized) → patch embedding (Conv2d) → tokens [b, N, d]
    → class token (in the middle of the sequence as Vim-T/S/B, first, or none)
    → + absolute position embedding → blocks: Add → RMSNorm → BiMambaMixer
    → final Add → RMSNorm → the class token (or the mean of the tokens, or the last) → head

A bidirectional mixer reads the whole sequence in both directions, so the model has no decode
step and no cache; every sample of a batch is computed on its own.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn

from quamba.errors import QuambaError
from quamba.models.config import ConfigError, MambaConfig
from quamba.models.mamba import Block, MambaMixer, RMSNorm, init_ssm_parameters, ssm_branch
from quamba.ops import backend

CLS_POSITIONS = ("middle", "head", "none")
POOLS = ("cls", "mean", "last")
BIMAMBA_TYPES = ("v2", "separate")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@dataclass
class VisionMambaConfig:
    """Shape and structure of a Vision Mamba classifier.

    cls_token: where the class token sits ("middle": after N // 2 patches, as Vim's published
    models; "head"; "none"). pool: what the head reads ("cls", "mean" of all tokens, or "last").
    bimamba: "v2" (Vim's: in_proj and out_proj shared by the two directions) or "separate" (each
    direction a whole mixer). divide_out halves the sum of the two directions.
    image_mean / image_std: the per-channel normalization the model was trained with.
    """

    img_size: int = 224
    patch_size: int = 16
    stride: int = 16
    channels: int = 3
    d_model: int = 192
    n_layer: int = 24
    d_state: int = 16
    d_conv: int = 4
    expand: int = 2
    dt_rank: int = 0  # 0: ceil(d_model / 16)
    num_classes: int = 1000
    cls_token: str = "middle"
    pool: str = "cls"
    bimamba: str = "v2"
    divide_out: bool = True
    norm_epsilon: float = 1e-5
    residual_in_fp32: bool = True
    image_mean: tuple = IMAGENET_MEAN
    image_std: tuple = IMAGENET_STD

    def __post_init__(self):
        self.image_mean, self.image_std = tuple(self.image_mean), tuple(self.image_std)
        if self.dt_rank in (0, "auto", None):
            self.dt_rank = -(-self.d_model // 16)
        for name in ("img_size", "patch_size", "stride", "channels", "d_model", "n_layer",
                     "d_state", "d_conv", "expand", "dt_rank", "num_classes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"config field {name} must be a positive integer, got {value!r}")
        for name, allowed in (("cls_token", CLS_POSITIONS), ("pool", POOLS), ("bimamba", BIMAMBA_TYPES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"config field {name} must be one of {', '.join(allowed)}, "
                                  f"got {getattr(self, name)!r}")
        if self.pool == "cls" and self.cls_token == "none":
            raise ConfigError("pool 'cls' needs a class token (cls_token 'middle' or 'head')")
        if self.patch_size > self.img_size:
            raise ConfigError(f"patch_size {self.patch_size} is larger than img_size {self.img_size}")
        if len(self.image_mean) != self.channels or len(self.image_std) != self.channels:
            raise ConfigError(f"image_mean and image_std need one value per channel ({self.channels})")

    @property
    def d_inner(self) -> int:
        return self.expand * self.d_model

    @property
    def grid_size(self) -> int:
        return (self.img_size - self.patch_size) // self.stride + 1

    @property
    def num_patches(self) -> int:
        return self.grid_size ** 2

    @property
    def seqlen(self) -> int:
        return self.num_patches + (self.cls_token != "none")

    @property
    def cls_position(self) -> int | None:
        """Index of the class token in the sequence (None without one)."""
        return {"middle": self.num_patches // 2, "head": 0, "none": None}[self.cls_token]

    def mamba_config(self) -> MambaConfig:
        """The Mamba1 block shape of each direction (quamba.models.mamba.MambaMixer's config)."""
        return MambaConfig(d_model=self.d_model, n_layer=self.n_layer, vocab_size=1,
                           d_state=self.d_state, d_conv=self.d_conv, expand=self.expand,
                           dt_rank=self.dt_rank, norm_epsilon=self.norm_epsilon,
                           residual_in_fp32=self.residual_in_fp32)

    def to_dict(self) -> dict:
        values = dataclasses.asdict(self)
        values["image_mean"], values["image_std"] = list(self.image_mean), list(self.image_std)
        return {"model_type": "vision_mamba", **values}

    @classmethod
    def from_dict(cls, values: dict) -> "VisionMambaConfig":
        """From quamba's own config.json (``to_dict``) or from Vim's model arguments
        (embed_dim, depth, if_cls_token, use_middle_cls_token, final_pool_type, bimamba_type, ...)."""
        if "embed_dim" in values or "depth" in values:
            return cls.from_vim_args(values)
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in values.items() if k in known})

    @classmethod
    def from_vim_args(cls, args: dict) -> "VisionMambaConfig":
        """From the keyword arguments of hustvl/Vim's ``VisionMamba``; the options it has and this
        model lacks (RoPE, two class tokens, alternating-layer bidirectionality, LayerNorm, layer
        scale) are refused rather than ignored."""
        unsupported = {"if_rope": True, "use_double_cls_token": True, "if_bidirectional": True,
                       "rms_norm": False, "if_bimamba": True}
        for key, bad in unsupported.items():
            if args.get(key, not bad) == bad:
                raise ConfigError(f"Vim option {key}={bad} is not supported")
        if args.get("init_layer_scale") is not None:
            raise ConfigError("Vim option init_layer_scale is not supported")
        if args.get("bimamba_type", "v2") not in BIMAMBA_TYPES:
            raise ConfigError(f"Vim bimamba_type {args.get('bimamba_type')!r} is not supported "
                              f"(only {', '.join(BIMAMBA_TYPES)})")
        ssm_cfg = dict(args.get("ssm_cfg") or {})
        has_cls = args.get("if_cls_token", True)
        cls_token = ("middle" if args.get("use_middle_cls_token", True) else "head") if has_cls else "none"
        pool = "cls" if has_cls else {"mean": "mean", "none": "last"}.get(args.get("final_pool_type", "mean"))
        if pool is None:
            raise ConfigError(f"Vim final_pool_type {args.get('final_pool_type')!r} is not supported")
        channels = args.get("channels", 3)
        return cls(img_size=args.get("img_size", 224), patch_size=args.get("patch_size", 16),
                   stride=args.get("stride", args.get("patch_size", 16)), channels=channels,
                   d_model=args.get("embed_dim", 192), n_layer=args.get("depth", 24),
                   d_state=args.get("d_state", ssm_cfg.get("d_state", 16)),
                   d_conv=ssm_cfg.get("d_conv", 4), expand=ssm_cfg.get("expand", 2),
                   dt_rank=ssm_cfg.get("dt_rank", 0), num_classes=args.get("num_classes", 1000),
                   cls_token=cls_token, pool=pool, bimamba=args.get("bimamba_type", "v2"),
                   divide_out=args.get("if_divide_out", args.get("if_devide_out", True)),
                   norm_epsilon=args.get("norm_epsilon", 1e-5),
                   residual_in_fp32=args.get("residual_in_fp32", True),
                   image_mean=args.get("image_mean", IMAGENET_MEAN if channels == 3 else (0.5,) * channels),
                   image_std=args.get("image_std", IMAGENET_STD if channels == 3 else (0.5,) * channels))


# Shapes of the published Vim classifiers (ImageNet-1k, 224 × 224, patch 16, middle class token).
VISION_PRESETS = {
    "vim-tiny": dict(d_model=192, n_layer=24),
    "vim-small": dict(d_model=384, n_layer=24),
    "vim-base": dict(d_model=768, n_layer=24),
}


def vision_preset(name: str) -> VisionMambaConfig:
    if name not in VISION_PRESETS:
        raise ConfigError(f"unknown Vision Mamba size {name!r}; choose one of {', '.join(VISION_PRESETS)}")
    return VisionMambaConfig(**VISION_PRESETS[name])


class BiMambaMixer(MambaMixer):
    """Bidirectional Mamba mixer: the MambaMixer's forward branch over the sequence and a backward
    branch (conv1d_b, x_proj_b, dt_proj_b, A_b_log, D_b) over it reversed, both gated by z, their
    outputs added (halved if ``divide_out``). "v2" shares in_proj and out_proj between the
    directions; "separate" gives the backward one its own (in_proj_b, out_proj_b) and adds the
    two mixers' outputs.

    ``forward(h, state=None, step=False, **kwargs)`` takes the keyword arguments a Mamba block
    wrapper passes (Vim's ``inference_params`` and others) and ignores them: it reads the whole
    sequence, so a decode step or a cache (``step``, ``state``, a non-None ``inference_params``) is
    an error, not a silent no-op.
    """

    def __init__(self, config: MambaConfig, bimamba: str = "v2", divide_out: bool = True,
                 device=None, dtype=None):
        super().__init__(config, device, dtype)
        if bimamba not in BIMAMBA_TYPES:
            raise ConfigError(f"bimamba must be one of {', '.join(BIMAMBA_TYPES)}, got {bimamba!r}")
        self.bimamba, self.divide_out = bimamba, divide_out
        self.conv1d_b, self.x_proj_b, self.dt_proj_b, self.A_b_log, self.D_b = \
            ssm_branch(config, device, dtype)
        if bimamba == "separate":
            kw = dict(device=device, dtype=dtype)
            self.in_proj_b = nn.Linear(config.d_model, 2 * config.d_inner, bias=config.bias, **kw)
            self.out_proj_b = nn.Linear(config.d_inner, config.d_model, bias=config.bias, **kw)

    def backward_branch(self) -> tuple:
        """(conv1d, x_proj, dt_proj, A_log, D) of the backward direction."""
        return self.conv1d_b, self.x_proj_b, self.dt_proj_b, self.A_b_log, self.D_b

    def forward(self, h, state=None, step: bool = False, inference_params=None, **kwargs):
        """h: [batch, seqlen, d_model] → [batch, seqlen, d_model]."""
        if step or state is not None or inference_params is not None:
            raise QuambaError("a bidirectional Mamba mixer reads the whole sequence: it has no decode "
                              "step and no cache (got step, state or inference_params)")
        xz = self._in_proj_channel_major(h)
        x, z = xz.chunk(2, dim=1)
        y = self._scan_branch(x, z, self.conv1d, self.x_proj, self.dt_proj, self.A_log, self.D)[2]
        if self.bimamba == "separate":
            x, z = self.in_proj_b(h).transpose(1, 2).chunk(2, dim=1)
        y_b = self._scan_branch(x.flip(-1), z.flip(-1), *self.backward_branch())[2].flip(-1)
        if self.bimamba == "separate":
            out = self.out_proj(y.transpose(1, 2)) + self.out_proj_b(y_b.transpose(1, 2))
            return out / 2 if self.divide_out else out
        y = y + y_b
        if self.divide_out:
            y = y / 2
        return self.out_proj(self.online_hadamard(y.transpose(1, 2)))


class PatchEmbed(nn.Module):
    """Images [b, C, H, W] → patch tokens [b, N, d] (a strided Conv2d, as Vim's)."""

    def __init__(self, config: VisionMambaConfig, device=None, dtype=None):
        super().__init__()
        self.img_size = config.img_size
        self.proj = nn.Conv2d(config.channels, config.d_model, config.patch_size, config.stride,
                              device=device, dtype=dtype)

    def forward(self, images):
        if images.dim() != 4 or tuple(images.shape[1:]) != (self.proj.in_channels, self.img_size, self.img_size):
            raise QuambaError(f"images must be [batch, {self.proj.in_channels}, {self.img_size}, "
                              f"{self.img_size}], got {tuple(images.shape)}")
        return self.proj(images.to(self.proj.weight.dtype)).flatten(2).transpose(1, 2)


class VisionMamba(nn.Module):
    """The Vim classifier; ``forward(images)`` returns logits [batch, num_classes]."""

    def __init__(self, config: VisionMambaConfig, device=None, dtype=None):
        super().__init__()
        self.config = config
        kw = dict(device=device, dtype=dtype)
        self.patch_embed = PatchEmbed(config, **kw)
        if config.cls_token != "none":
            self.cls_token = nn.Parameter(torch.zeros(1, 1, config.d_model, **kw))
        self.pos_embed = nn.Parameter(torch.zeros(1, config.seqlen, config.d_model, **kw))
        mamba = config.mamba_config()
        self.layers = nn.ModuleList(
            Block(RMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, **kw),
                  BiMambaMixer(mamba, config.bimamba, config.divide_out, **kw))
            for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, **kw)
        self.head = nn.Linear(config.d_model, config.num_classes, **kw)
        with torch.no_grad():
            for mixer in self.mixers():
                init_ssm_parameters(mixer)
                init_backward_ssm_parameters(mixer)

    @property
    def dtype(self) -> torch.dtype:
        return self.pos_embed.dtype

    def mixers(self):
        return [block.mixer for block in self.layers]

    def embed(self, images):
        """Tokens with the class token and the position embedding: [b, seqlen, d]."""
        x = self.patch_embed(images)
        position = self.config.cls_position
        if position is not None:
            cls = self.cls_token.expand(x.shape[0], -1, -1)
            x = torch.cat([x[:, :position], cls, x[:, position:]], dim=1)
        return x + self.pos_embed

    def forward_features(self, images, **block_kwargs):
        """The pooled, normed features [b, d_model] that the head reads."""
        hidden, residual = self.embed(images), None
        for block in self.layers:
            hidden, residual = block(hidden, residual, **block_kwargs)
        normed, _ = self.norm_f(hidden, residual)
        return pool_tokens(normed, self.config)

    def forward(self, images, **block_kwargs):
        return self.head(self.forward_features(images, **block_kwargs))

    @torch.inference_mode()
    def op_backends(self) -> dict[str, str]:
        """op → the backend it runs on here ('cuda' or 'torch'), for every op a forward selects
        in the present SSM mode on the model's device (one forward of a blank image under
        :func:`quamba.ops.backend.recording`)."""
        config, parameter = self.config, next(self.parameters())
        images = torch.zeros(1, config.channels, config.img_size, config.img_size,
                             device=parameter.device, dtype=parameter.dtype)
        with backend.recording() as ran:
            self(images)
        return backend.summary(ran)


def pool_tokens(tokens, config: VisionMambaConfig):
    """The head's input from the final tokens [b, seqlen, d]: the class token, their mean, or the last."""
    if config.pool == "cls":
        return tokens[:, config.cls_position]
    if config.pool == "mean":
        return tokens.mean(dim=1)
    return tokens[:, -1]


def init_backward_ssm_parameters(mixer: BiMambaMixer, generator: torch.Generator | None = None):
    """mamba_ssm's initialisation (init_ssm_parameters) of the backward branch's A, D and dt bias."""
    init_ssm_parameters(SimpleNamespace(A_log=mixer.A_b_log, D=mixer.D_b, dt_proj=mixer.dt_proj_b),
                        generator=generator)
