"""A Mamba1 language model in plain PyTorch (parameter names as in mamba_ssm).

The model is a stack of ``Block(norm, mixer)``. Quantization replaces a block's norm and mixer with
quantized modules that honour the same two small interfaces:

* norm: ``norm(hidden, residual) -> (normed, residual)``
* mixer: ``mixer(h, state=None, step=False) -> out`` and ``mixer.allocate_state(batch, device)``

so the model, the cache and ``generate`` work unchanged on FP and quantized blocks.
"""
from __future__ import annotations

import math
import re

import torch
import torch.nn as nn
import torch.nn.functional as F

from quamba.models.config import MambaConfig
from quamba.models.generation import generate
from quamba.models.mamba2 import Mamba2Mixer, init_mamba2_parameters
from quamba.models.state import DEFAULT_MAX_SEQLEN, InferenceCache, MixerState
from quamba.models.transformer_layers import Attention
from quamba.ops import backend
from quamba.ops.conv.causal_conv1d import (
    causal_conv1d,
    causal_conv1d_update,
    conv_state_from_prefill,
)
from quamba.ops.norm.mixer_norm import mixer_rms_norm
from quamba.ops.norm.rms_norm import rms_norm
from quamba.ops.scan.discretization import input_drive
from quamba.ops.scan.selective_scan import selective_scan, selective_state_update


class RMSNorm(nn.Module):
    """RMSNorm with the residual add in front, as mamba_ssm's fused add-norm.

    ``forward(hidden, residual)`` returns ``(normed, residual_out)`` where
    residual_out = hidden + residual (fp32 if ``residual_in_fp32``) and
    normed = weight * residual_out / rms(residual_out), computed in fp32, in hidden's dtype.
    """

    def __init__(self, dim: int, eps: float = 1e-5, residual_in_fp32: bool = True, device=None,
                 dtype=None):
        super().__init__()
        self.eps = eps
        self.residual_in_fp32 = residual_in_fp32
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, hidden, residual=None):
        return rms_norm(hidden, residual, self.weight, self.eps, self.residual_in_fp32)


def watched(module: nn.Module) -> bool:
    """Whether forward hooks (the module's own or global ones) would see a call of ``module``."""
    hooks = nn.modules.module
    return bool(module._forward_hooks or module._forward_pre_hooks or hooks._global_forward_hooks
                or hooks._global_forward_pre_hooks)


def ssm_branch(config: MambaConfig, device=None, dtype=None) -> tuple:
    """(conv1d, x_proj, dt_proj, A_log, D) of one Mamba1 SSM branch, uninitialised; A_log and D
    stay fp32 whatever the model dtype, as in mamba_ssm."""
    kw = dict(device=device, dtype=dtype)
    d_inner = config.d_inner
    return (nn.Conv1d(d_inner, d_inner, config.d_conv, groups=d_inner, padding=config.d_conv - 1,
                      bias=config.conv_bias, **kw),
            nn.Linear(d_inner, config.dt_rank + 2 * config.d_state, bias=False, **kw),
            nn.Linear(config.dt_rank, d_inner, bias=True, **kw),
            nn.Parameter(torch.empty(d_inner, config.d_state, device=device)),
            nn.Parameter(torch.empty(d_inner, device=device)))


class MambaMixer(nn.Module):
    """The Mamba1 mixer: in_proj → causal conv1d + SiLU → x_proj → dt_proj → selective scan →
    out_proj. ``online_hadamard`` (set by the rotation pass) rotates y before out_proj. The scan
    discretizes as ``config.discretization`` says (quamba.ops.scan.discretization). With
    ``config.mixer_rms_eps`` (Falcon-Mamba), dt_low, B and C are normalized after x_proj."""

    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        d_inner, self.d_state, self.d_conv = config.d_inner, config.d_state, config.d_conv
        self.d_inner, self.dt_rank = d_inner, config.dt_rank
        self.discretization = config.discretization
        self.mixer_rms_eps = config.mixer_rms_eps
        self.in_proj = nn.Linear(config.d_model, 2 * d_inner, bias=config.bias, **kw)
        self.conv1d, self.x_proj, self.dt_proj, self.A_log, self.D = ssm_branch(config, device, dtype)
        self.out_proj = nn.Linear(d_inner, config.d_model, bias=config.bias, **kw)
        self.online_hadamard = nn.Identity()
        self.taps: dict | None = None  # set to {} to record intermediates (mode comparisons)

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> MixerState:
        """The conv and SSM states (their size does not depend on ``max_seqlen``)."""
        device = device or self.in_proj.weight.device
        return MixerState(
            conv=torch.zeros(batch_size, self.d_inner, self.d_conv - 1, device=device,
                             dtype=self.conv1d.weight.dtype),
            ssm=torch.zeros(batch_size, self.d_inner, self.d_state, device=device),
            drive=(torch.zeros(batch_size, self.d_inner, self.d_state, device=device)
                   if self.discretization == "foh" else None),
        )

    @property
    def mixer_norm_weights(self) -> tuple | None:
        """The weights of the norms of dt_low, B and C (Jamba's), or None: weightless norms
        (Falcon-Mamba's) or none."""
        return None

    def split_x_dbl(self, x_dbl) -> tuple:
        """dt_low, B and C of x_proj's output, normalized where the model has their norms."""
        dt_low, B, C = torch.split(x_dbl, [self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.mixer_rms_eps is None:
            return dt_low, B, C
        return mixer_rms_norm(dt_low, B, C, self.mixer_rms_eps, weights=self.mixer_norm_weights)

    def _ssm_params(self, x_dbl):
        dt_low, B, C = self.split_x_dbl(x_dbl)
        dt = F.linear(dt_low, self.dt_proj.weight)  # bias is added inside the scan
        return dt, B, C

    def _ssm_params_channels_first(self, u, x_proj: nn.Module, dt_proj: nn.Linear):
        """dt [b, d_inner, l], B and C [b, d_state, l] from the conv output u [b, d_inner, l], each
        with time contiguous, the layout mamba-ssm's scan reads without copies (dt computed as
        dt_proj.weight · dt_lowᵀ, as mamba_ssm does)."""
        b, _, l = u.shape
        x_dbl = x_proj(u.transpose(1, 2))
        dt_low, B, C = self.split_x_dbl(x_dbl.reshape(b * l, -1))
        dt = (dt_proj.weight @ dt_low.t()).view(-1, b, l).transpose(0, 1)
        B, C = (t.reshape(b, l, -1).transpose(1, 2).contiguous() for t in (B, C))
        return dt, B, C

    def _scan_branch(self, x, z, conv1d: nn.Conv1d, x_proj: nn.Module, dt_proj: nn.Linear, A_log, D):
        """conv1d + SiLU → x_proj → dt_proj → selective scan gated by z, for x and z [b, d_inner, l]
        and one set of SSM parameters: (u, dt, y [b, d_inner, l], the last state, the last drive
        (foh, else None))."""
        u = causal_conv1d(x, conv1d.weight.squeeze(1), conv1d.bias, activation="silu")
        dt, B, C = self._ssm_params_channels_first(u, x_proj, dt_proj)
        A = -torch.exp(A_log.float())
        y, last_state = selective_scan(u, dt, A, B, C, D, z=z, delta_bias=dt_proj.bias,
                                       delta_softplus=True, discretization=self.discretization)
        last_drive = input_drive(u[..., -1], B[..., -1]) if self.discretization == "foh" else None
        return u, dt, y, last_state, last_drive

    def _in_proj_channel_major(self, h):
        """in_proj(h) as [batch, 2·d_inner, seqlen] held as [2·d_inner, batch · seqlen] (W · hᵀ, as
        mamba_ssm computes it): x, z, the conv output, dt and y are then views that the conv and
        scan kernels, and x_proj's and out_proj's GEMMs, read through their strides, where
        in_proj(h) (time-major) costs copies of u and z before the scan. An in_proj that hooks
        watch (calibration, GPTQ) is called as a module; a 4-bit one (W4A16Linear) computes its own
        W · hᵀ."""
        proj = self.in_proj
        if watched(proj):
            return proj(h).transpose(1, 2)
        b, l, _ = h.shape
        h2d = h.reshape(b * l, -1)
        if isinstance(proj, nn.Linear) and proj.bias is None:
            xz = proj.weight @ h2d.t()
        elif isinstance(proj, nn.Linear):
            xz = torch.addmm(proj.bias[:, None], proj.weight, h2d.t())  # the bias in the GEMM's epilogue
        else:
            xz = proj.forward_channel_major(h2d)
        return xz.view(-1, b, l).transpose(0, 1)

    def forward(self, h, state: MixerState | None = None, step: bool = False, ssm_A: torch.Tensor | None = None):
        """h: [batch, seqlen, d_model] → [batch, seqlen, d_model]. With ``state`` a prefill fills it;
        with ``step=True`` (seqlen 1) one decode step updates it in place, with ``ssm_A`` as
        -exp(A_log) where the caller computed it (see ``step_ssm_A``)."""
        if step:
            return self._step(h, state, ssm_A)
        xz = self._in_proj_channel_major(h)  # [b, 2·d_inner, l]
        x, z = xz.chunk(2, dim=1)
        if state is not None:
            state.conv.copy_(conv_state_from_prefill(x, self.d_conv))
        u, dt, y, last_state, last_drive = self._scan_branch(x, z, self.conv1d, self.x_proj,
                                                             self.dt_proj, self.A_log, self.D)
        if state is not None:
            state.keep_scan(last_state, last_drive)
        y = y.transpose(1, 2)
        y_rotated = self.online_hadamard(y)
        out = self.out_proj(y_rotated)
        if self.taps is not None:
            self.taps.update({"x": x, "z": z, "u": u, "dt": dt.transpose(1, 2), "y": y,
                              "out_proj.input": y_rotated, "out": out})
        return out

    def _step(self, h, state: MixerState, ssm_A: torch.Tensor | None = None):
        x, z = self.in_proj(h[:, 0]).chunk(2, dim=-1)
        u = causal_conv1d_update(x, state.conv, self.conv1d.weight.squeeze(1), self.conv1d.bias)
        dt, B, C = self._ssm_params(self.x_proj(u))
        A = -torch.exp(self.A_log.float()) if ssm_A is None else ssm_A
        y = selective_state_update(state.ssm, u, dt, A, B, C, self.D, z=z,
                                   delta_bias=self.dt_proj.bias, delta_softplus=True,
                                   discretization=self.discretization, drive=state.drive)
        return self.out_proj(self.online_hadamard(y)).unsqueeze(1)


class Block(nn.Module):
    def __init__(self, norm: nn.Module, mixer: nn.Module):
        super().__init__()
        self.norm = norm
        self.mixer = mixer

    def forward(self, hidden, residual=None, state=None, step=False, ssm_A=None, **mixer_kwargs):
        """(mixer(norm(hidden + residual)), hidden + residual). ``mixer_kwargs`` (e.g. the
        ``inference_params`` of Vision Mamba's code) reach the mixer as they are."""
        normed, residual = self.norm(hidden, residual)
        if ssm_A is not None:  # only FP mixers take it (step_ssm_A)
            mixer_kwargs["ssm_A"] = ssm_A
        return self.mixer(normed, state=state, step=step, **mixer_kwargs), residual


def step_ssm_A(layers) -> list:
    """Each block's A = -exp(A_log) for one decode step, None where the mixer takes no A (the int8
    QMambaMixer). One multi-tensor exp and one neg for all FP mixers replace an exp and a neg per
    layer: 128 kernels of a Mamba-2.8B decode step. Recomputed every step rather than cached:
    A_log can be rewritten in place (weights loaded, ``.data`` edits) where no cache key sees it."""
    fp_layers = [i for i, block in enumerate(layers) if isinstance(block.mixer, MambaMixer)]
    ssm_A = [None] * len(layers)
    if fp_layers:
        A_logs = [layers[i].mixer.A_log.float() for i in fp_layers]
        for i, A in zip(fp_layers, torch._foreach_neg(torch._foreach_exp(A_logs))):
            ssm_A[i] = A
    return ssm_A


class MambaBackbone(nn.Module):
    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__()
        self.embedding = nn.Embedding(config.padded_vocab_size, config.d_model, device=device,
                                      dtype=dtype)
        mixer = Mamba2Mixer if config.layer == "Mamba2" else MambaMixer
        self.layers = nn.ModuleList(
            Block(RMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, device, dtype),
                  mixer(config, device, dtype))
            for _ in range(config.n_layer))
        self.norm_f = RMSNorm(config.d_model, config.norm_epsilon, config.residual_in_fp32, device,
                              dtype)


class MambaLMHeadModel(nn.Module):
    """Mamba LM: embedding → blocks → final RMSNorm → lm_head (tied to the embedding by default);
    the blocks' mixers are Mamba1 or Mamba2 (quamba.models.mamba2) as ``config.layer`` says."""

    def __init__(self, config: MambaConfig, device=None, dtype=None):
        super().__init__()
        self._assemble(config, MambaBackbone(config, device, dtype), config.padded_vocab_size,
                       device, dtype)

    def _assemble(self, config, backbone: nn.Module, vocab_size: int, device, dtype) -> None:
        """What every LM of quamba holds, the hybrids' too (they build other blocks): ``backbone``,
        an lm_head of ``vocab_size`` rows (tied to the embedding where the config says), and
        the SSM parameters of its Mamba1 and Mamba2 mixers initialised."""
        self.config = config
        self.backbone = backbone
        self.lm_head = nn.Linear(config.d_model, vocab_size, bias=False, device=device,
                                 dtype=dtype)
        if config.tie_embeddings:
            self.lm_head.weight = self.backbone.embedding.weight
        with torch.no_grad():
            for mixer in self.mixers():
                if isinstance(mixer, Mamba2Mixer):
                    init_mamba2_parameters(mixer)
                elif isinstance(mixer, MambaMixer):
                    init_ssm_parameters(mixer)

    def mixers(self):
        return [block.mixer for block in self.backbone.layers]

    def allocate_cache(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> InferenceCache:
        """A fresh decode cache; ``max_seqlen``: the tokens that the KV caches of a hybrid's
        attention layers hold (prompt and new tokens; more is an error)."""
        return self.new_cache([m.allocate_state(batch_size, device, max_seqlen)
                               for m in self.mixers()], max_seqlen)

    def new_cache(self, states: list, max_seqlen: int) -> InferenceCache:
        """An InferenceCache of ``states``, limited to ``max_seqlen`` tokens if this model has
        attention layers (a Mamba state holds any number)."""
        has_kv_cache = any(isinstance(module, Attention) for module in self.modules())
        return InferenceCache(states, max_seqlen=max_seqlen if has_kv_cache else None)

    def forward(self, input_ids, cache: InferenceCache | None = None, num_last_tokens: int = 0):
        """Logits [batch, seqlen or num_last_tokens, vocab] in the model dtype.

        Without ``cache``: a plain forward. With a fresh cache (seqlen_offset 0): a prefill that
        fills it. With a used cache: one decode step per input token, updating it in place.
        """
        if cache is not None:
            cache.check_room(input_ids.shape[1])
        hidden = self.backbone.embedding(input_ids)
        if cache is not None and cache.seqlen_offset > 0:
            logits = [self._step(hidden[:, t:t + 1], cache) for t in range(input_ids.shape[1])]
            logits = torch.cat(logits, dim=1)
            return logits[:, -num_last_tokens:] if num_last_tokens > 0 else logits
        residual, kwargs = None, self._layer_kwargs(hidden)
        for i, block in enumerate(self.backbone.layers):
            state = cache.states[i] if cache is not None else None
            hidden, residual = block(hidden, residual, state=state, **kwargs)
        if cache is not None:
            cache.seqlen_offset += input_ids.shape[1]
        if num_last_tokens > 0:
            hidden, residual = hidden[:, -num_last_tokens:], residual[:, -num_last_tokens:]
        return self._head(hidden, residual)

    def _step(self, hidden, cache: InferenceCache):
        residual, kwargs = None, self._layer_kwargs(hidden)
        layers = self.backbone.layers
        for block, state, ssm_A in zip(layers, cache.states, step_ssm_A(layers)):
            hidden, residual = block(hidden, residual, state=state, step=True, ssm_A=ssm_A,
                                     **kwargs)
        cache.seqlen_offset += 1
        return self._head(hidden, residual)

    def _layer_kwargs(self, embedding) -> dict:
        """What every block gets besides (hidden, residual), from the token embeddings: nothing
        here (Zamba2's layers take the embeddings)."""
        return {}

    def _head(self, hidden, residual):
        normed, _ = self.backbone.norm_f(hidden, residual)
        return self.lm_head(normed)

    @torch.inference_mode()
    def op_backends(self) -> dict[str, str]:
        """op → the backend it runs on here ('cuda' or 'torch'), for every op that this model's
        prefill and decode step select, in its present SSM mode, on its device. Found by running a
        two-token prefill and one decode step at batch 1 under :func:`quamba.ops.backend.recording`
        (a fresh cache; the model's own caches and CUDA graphs are untouched). On a GPU, an op on
        'torch' is a slow path: quamba.ops.backend's warning says why."""
        device = self.backbone.embedding.weight.device
        ids = torch.zeros(1, 2, dtype=torch.long, device=device)
        with backend.recording() as ran:
            cache = self.allocate_cache(1, device)
            self(ids, cache=cache)
            self(ids[:, :1], cache=cache)
        return backend.summary(ran)

    def generate(self, input_ids, **kwargs):
        """See :func:`quamba.models.generation.generate`."""
        return generate(self, input_ids, **kwargs)


def init_ssm_parameters(mixer: MambaMixer, dt_min: float = 1e-3, dt_max: float = 0.1,
                        generator: torch.Generator | None = None):
    """mamba_ssm's initialisation of the SSM parameters: A = -(1..d_state), D = 1, and dt_proj's
    bias = softplus⁻¹(dt) with dt log-uniform in [dt_min, dt_max]."""
    d_inner, d_state = mixer.A_log.shape
    mixer.A_log.copy_(torch.log(torch.arange(1, d_state + 1, dtype=torch.float32)).repeat(d_inner, 1))
    mixer.D.fill_(1.0)
    rand = torch.rand(d_inner, generator=generator)
    dt = torch.exp(rand * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp(min=1e-4)
    mixer.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))


@torch.no_grad()
def randomize_(model: MambaLMHeadModel, seed: int = 0, std: float = 0.02) -> MambaLMHeadModel:
    """Fill every parameter with seeded random values of realistic scale (tests, benchmarks).

    Norm weights, A_log, D and dt bias get random but well-conditioned values so no tensor is at
    its trivial initial value. The numbers are drawn on the model's device (a multi-billion
    parameter model fills in seconds on a GPU), so they differ between CPU and GPU."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(shape):
        return torch.rand(shape, generator=gen, device=device)

    def randn(shape):
        return torch.randn(shape, generator=gen, device=device)

    for name, param in model.named_parameters():
        shape, dtype = param.shape, param.dtype
        kind = re.sub(r"_b\b", "", name.replace("A_b_log", "A_log"))  # a backward branch's as its own
        if kind.endswith("A_log"):
            value = torch.log(rand(shape) * 15 + 0.5)
        elif kind.endswith(".D"):
            value = rand(shape) + 0.5
        elif kind.endswith(("dt_proj.bias", "dt_bias")):
            dt = torch.exp(rand(shape) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            value = dt + torch.log(-torch.expm1(-dt))
        elif "norm" in kind:
            value = 1.0 + 0.1 * randn(shape)
        elif kind.endswith("conv1d.weight"):
            value = randn(shape) * 0.3
        elif kind.endswith("dt_proj.weight"):
            value = randn(shape) * model.config.dt_rank ** -0.5
        else:
            value = randn(shape) * std
        param.copy_(value.to(dtype))
    return model
