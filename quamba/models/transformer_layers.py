"""The attention, MLP and MoE layers of hybrid models (Nemotron-H, Bamba), as plain nn.Linear
modules so that quantization can later swap each linear for a quantized one.

Each honours the mixer interface of quamba.models.mamba's Block: ``forward(h, state=None,
step=False)`` with h [batch, seqlen, d_model], and ``allocate_state(batch, device, max_seqlen)``:
attention's decode state is its KV cache (AttentionState: preallocated buffers of max_seqlen
tokens, in the model dtype); the MLP and MoE keep none.

``capture_safe = False`` marks a layer whose decode step cannot be captured in a CUDA graph
(quamba.models.generation refuses to graph a model holding one): the MoE layers, whose routing
reads the chosen experts on the host.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from quamba.models.state import DEFAULT_MAX_SEQLEN, AttentionState
from quamba.ops.linear.input_quant import relu2  # Nemotron-H's MLP activation


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RotaryEmbedding(nn.Module):
    """transformers' "default" RoPE on the first ``rotary_dim`` channels of each head (partial
    rotary: the others pass unchanged): cos and sin computed in fp32 from the positions, applied
    in the input's dtype. No buffers: the frequencies are recomputed, so no cast rounds them."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = rotary_dim, theta

    def forward(self, x: torch.Tensor, offset: int | torch.Tensor) -> torch.Tensor:
        """x [batch, heads, seqlen, head_dim] at positions offset, offset + 1, ... (``offset`` an
        int or a device tensor [1], as a decode step's KV cache length)."""
        dim = self.rotary_dim
        inv_freq = 1.0 / self.theta ** (torch.arange(0, dim, 2, device=x.device).float() / dim)
        positions = (torch.arange(x.shape[2], device=x.device) + offset).float()
        freqs = positions[:, None] * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
        rotated, passed = x[..., :dim], x[..., dim:]
        return torch.cat((rotated * cos + rotate_half(rotated) * sin, passed), dim=-1)


class Attention(nn.Module):
    """Causal multi-head attention with grouped KV heads: without ``rotary``, no positional
    encoding (Nemotron-H's: its position comes from the Mamba layers); with it, RoPE on q and k
    (Bamba's). Scale ``scale``, by default 1/sqrt(head_dim). Its KV cache is preallocated and its
    decode step reads the position from the device (AttentionState), so the step can be replayed
    from a CUDA graph (quamba.models.generation)."""

    def __init__(self, d_model: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False, rotary: RotaryEmbedding | None = None,
                 scale: float | None = None, device=None, dtype=None, d_out: int | None = None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.rotary, self.scale = rotary, scale
        self.q_proj = nn.Linear(d_model, num_heads * head_dim, **kw)
        self.k_proj = nn.Linear(d_model, num_kv_heads * head_dim, **kw)
        self.v_proj = nn.Linear(d_model, num_kv_heads * head_dim, **kw)
        self.o_proj = nn.Linear(num_heads * head_dim, d_out or d_model, **kw)

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> AttentionState:
        weight = self.k_proj.weight
        return AttentionState.empty(batch_size, self.num_kv_heads, max_seqlen, self.head_dim,
                                    device or weight.device, weight.dtype)

    def _heads(self, projected: torch.Tensor) -> torch.Tensor:
        """[batch, seqlen, heads · head_dim] → [batch, heads, seqlen, head_dim]."""
        return projected.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)

    def forward(self, h, state: AttentionState | None = None, step: bool = False):
        """A prefill attends causally and, with ``state``, writes its keys and values at the
        first positions of the cache; a step writes the new token's after them and attends to
        all (attend_step)."""
        return self.attend(self.q_proj(h), self.k_proj(h), self.v_proj(h), state, step)

    def attend(self, q, k, v, state: AttentionState | None, step: bool):
        """forward's attention and o_proj, from the projections q, k, v [batch, seqlen,
        heads · head_dim] (Zamba2 adds its adapters' to them)."""
        q, k, v = (self._heads(x) for x in (q, k, v))
        if step:
            out = self.attend_step(q, k, v, state)
        else:
            if self.rotary is not None:
                q, k = self.rotary(q, 0), self.rotary(k, 0)
            if state is not None:
                keep_prefill(state, k, v)
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale,
                                                 enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).flatten(-2))

    def attend_step(self, q, k, v, state: AttentionState) -> torch.Tensor:
        """One token's attention output [batch, heads, 1, head_dim] from its q, k, v [batch,
        heads, 1, head_dim]: k and v written at position ``state.length`` of the cache, then q
        over the whole buffer with the positions past the new token masked out. No host value
        that changes per step is read, so a CUDA graph replays it (the masked positions add
        exact zeros to the softmax's sums; what the longer sums may change is their order). The
        query heads that share a KV head attend as the rows of one query, so the buffer is read
        as it is, not repeated for each head of a group."""
        position = state.length
        if self.rotary is not None:
            q, k = self.rotary(q, position), self.rotary(k, position)
        state.key.index_copy_(2, position, k)
        state.value.index_copy_(2, position, v)
        state.length.add_(1)
        valid = (torch.arange(state.max_seqlen, device=q.device) < state.length).view(1, 1, 1, -1)
        batch, heads = q.shape[:2]
        grouped = q.reshape(batch, self.num_kv_heads, heads // self.num_kv_heads, self.head_dim)
        out = F.scaled_dot_product_attention(grouped, state.key, state.value, attn_mask=valid,
                                             scale=self.scale)
        return out.reshape(batch, heads, 1, self.head_dim)


def keep_prefill(state: AttentionState, k: torch.Tensor, v: torch.Tensor) -> None:
    """Write a prefill's keys and values [batch, kv heads, seqlen, head_dim] at positions
    [0, seqlen) of the cache and set its length: whatever the cache held before is dropped (the
    positions after seqlen stay, masked out by the length)."""
    seqlen = k.shape[2]
    state.key[:, :, :seqlen].copy_(k)
    state.value[:, :, :seqlen].copy_(v)
    state.length.fill_(seqlen)


class MLP(nn.Module):
    """down_proj(relu2(up_proj(h))): Nemotron-H's MLP, without a gate."""

    def __init__(self, d_model: int, intermediate_size: int, bias: bool = False, device=None,
                 dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.up_proj = nn.Linear(d_model, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, d_model, **kw)

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> None:
        return None

    def forward(self, h, state=None, step: bool = False):
        return self.down_proj(relu2(self.up_proj(h)))


class GatedMLP(nn.Module):
    """down_proj(SiLU(gate_proj(h)) · up_proj(h)): the SwiGLU feed-forward of Bamba."""

    def __init__(self, d_model: int, intermediate_size: int, bias: bool = False, device=None,
                 dtype=None):
        super().__init__()
        kw = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(d_model, intermediate_size, **kw)
        self.up_proj = nn.Linear(d_model, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, d_model, **kw)

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> None:
        return None

    def forward(self, h, state=None, step: bool = False):
        return self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class TopkRouter(nn.Module):
    """DeepSeek-V3's router as Nemotron-H uses it, in fp32 whatever the model dtype
    (``keeps_fp32``, honoured by quamba.models.hub.cast_model): sigmoid scores, the
    ``e_score_correction_bias`` added for the choice only, the best ``topk_group`` of ``n_group``
    expert groups (a group ranked by its two best scores), then the top ``top_k`` experts; their
    weights are their scores, normalized to sum 1 if ``norm_topk_prob``, times
    ``routed_scaling_factor``."""

    keeps_fp32 = True

    def __init__(self, d_model: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, device=None):
        super().__init__()
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(num_experts, d_model, device=device))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, device=device))

    def forward(self, h):
        """(weights [tokens, top_k] fp32, expert indices [tokens, top_k]) of h [tokens, d_model]."""
        scores = F.linear(h.float(), self.weight.float()).sigmoid()
        choice = scores + self.e_score_correction_bias
        grouped = choice.unflatten(-1, (self.n_group, -1))
        group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best_groups = group_scores.topk(self.topk_group, dim=-1, sorted=False).indices
        kept = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
        choice = grouped.masked_fill(~kept[..., None], float("-inf")).flatten(-2)
        experts = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, experts)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, experts


class SoftmaxTopkRouter(nn.Module):
    """Jamba's router (Mixtral's without renormalization): softmax over all experts' logits in
    fp32, the top ``top_k`` experts, their probabilities as weights, in the input's dtype."""

    def __init__(self, d_model: int, num_experts: int, top_k: int, device=None, dtype=None):
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.zeros(num_experts, d_model, device=device, dtype=dtype))

    def forward(self, h):
        """(weights [tokens, top_k] in h's dtype, expert indices [tokens, top_k]) of h."""
        probs = F.linear(h, self.weight).softmax(dim=-1, dtype=torch.float32)
        weights, experts = probs.topk(self.top_k, dim=-1)
        return weights.to(h.dtype), experts


def expert_assignments(experts: torch.Tensor, num_experts: int):
    """For each expert that some token chose (``experts`` [tokens, top_k] of expert indices), in
    ascending order: (expert, token indices, slot indices) of its (token, slot) pairs in
    row-major order, the pairs and the order in which ``torch.where(experts == expert)`` lists
    them (transformers sums the experts so). One stable sort and one read of the experts' bounds
    in it: a single host synchronization a layer on a GPU, where the unique experts and a
    ``torch.where`` per expert took one each."""
    top_k = experts.shape[-1]
    sorted_experts, order = experts.flatten().sort(stable=True)
    every_expert = torch.arange(num_experts + 1, device=experts.device, dtype=experts.dtype)
    bounds = torch.searchsorted(sorted_experts, every_expert).tolist()
    for expert, (start, end) in enumerate(zip(bounds, bounds[1:])):
        if end > start:
            pairs = order[start:end]
            yield expert, pairs // top_k, pairs % top_k


class MoE(nn.Module):
    """Routed experts (``expert`` modules without bias, MLPs by default; each token to the
    router's top_k, weighted) plus, where ``shared_size`` is not 0, one shared expert MLP that
    every token takes: Nemotron-H's MoE layer (Jamba's: GatedMLP experts, no shared expert)."""

    capture_safe = False  # experts.unique().tolist() reads the routing on the host

    def __init__(self, d_model: int, num_experts: int, expert_size: int, shared_size: int,
                 router: nn.Module, bias: bool = False, device=None, dtype=None,
                 expert: type = MLP):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.gate = router
        self.experts = nn.ModuleList(expert(d_model, expert_size, **kw)
                                     for _ in range(num_experts))
        self.shared_experts = MLP(d_model, shared_size, bias=bias, **kw) if shared_size else None

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> None:
        return None

    def forward(self, h, state=None, step: bool = False):
        tokens = h.reshape(-1, h.shape[-1])
        weights, experts = self.gate(tokens)
        routed = torch.zeros_like(tokens, dtype=weights.dtype)
        for expert, token, slot in expert_assignments(experts, len(self.experts)):
            out = self.experts[expert](tokens[token]) * weights[token, slot, None]
            routed.index_add_(0, token, out.to(routed.dtype))
        routed = routed.to(h.dtype).view_as(h)
        return routed if self.shared_experts is None else routed + self.shared_experts(h)


class GraniteMoE(nn.Module):
    """Granite-4.0-H's MoE layer: the router's top_k logits softmaxed (in fp32) into the weights
    of GatedMLP experts, plus the shared GatedMLP that every token takes."""

    capture_safe = False  # experts.unique().tolist() reads the routing on the host

    def __init__(self, d_model: int, num_experts: int, top_k: int, expert_size: int,
                 shared_size: int, device=None, dtype=None):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.top_k = top_k
        self.router = nn.Linear(d_model, num_experts, bias=False, **kw)
        self.experts = nn.ModuleList(GatedMLP(d_model, expert_size, **kw)
                                     for _ in range(num_experts))
        self.shared_mlp = GatedMLP(d_model, shared_size, **kw)

    def allocate_state(self, batch_size: int, device=None,
                       max_seqlen: int = DEFAULT_MAX_SEQLEN) -> None:
        return None

    def forward(self, h, state=None, step: bool = False):
        tokens = h.reshape(-1, h.shape[-1])
        logits, experts = self.router(tokens).float().topk(self.top_k, dim=-1)
        weights = logits.softmax(dim=-1).to(h.dtype)
        routed = torch.zeros_like(tokens)
        for expert, token, slot in expert_assignments(experts, len(self.experts)):
            out = self.experts[expert](tokens[token]) * weights[token, slot, None]
            routed.index_add_(0, token, out)
        return routed.view_as(h) + self.shared_mlp(h)
