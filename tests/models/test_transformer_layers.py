"""The hybrids' MoE layers (quamba.models.transformer_layers): the experts' (token, slot) pairs
from one sort give the sums of the formulation they replaced, one ``torch.where`` per unique
expert, bit for bit."""
import pytest
import torch

from quamba.models.transformer_layers import (GraniteMoE, MoE, TopkRouter,
                                              expert_assignments)


def where_per_expert(moe, tokens, weights, experts):
    """The routed sum as the layers computed it before: unique experts ascending, each expert's
    pairs from torch.where, index_add_ into fp32 or the tokens' dtype."""
    routed = torch.zeros_like(tokens, dtype=weights.dtype)
    for expert in experts.unique().tolist():
        token, slot = torch.where(experts == expert)
        out = moe.experts[expert](tokens[token]) * weights[token, slot, None]
        routed.index_add_(0, token, out.to(routed.dtype))
    return routed


def randomized(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.3)
    return module


def test_assignments_are_where_per_expert_in_order():
    g = torch.Generator().manual_seed(0)
    experts = torch.stack([torch.randperm(9, generator=g)[:3] for _ in range(11)])
    listed = list(expert_assignments(experts, 9))
    assert [expert for expert, _, _ in listed] == experts.unique().tolist()
    for expert, token, slot in listed:
        expected_token, expected_slot = torch.where(experts == expert)
        assert torch.equal(token, expected_token) and torch.equal(slot, expected_slot)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nemotron_moe_sums_equal_the_where_formulation(dtype):
    router = TopkRouter(12, 8, top_k=3, n_group=2, topk_group=1, norm_topk_prob=True,
                        routed_scaling_factor=1.5)
    moe = randomized(MoE(12, 8, 10, 0, router), seed=1).to(dtype)
    moe.gate.float()
    h = torch.randn(3, 7, 12, generator=torch.Generator().manual_seed(2)).to(dtype)
    tokens = h.reshape(-1, 12)
    weights, experts = moe.gate(tokens)
    expected = where_per_expert(moe, tokens, weights, experts).to(dtype).view_as(h)
    assert torch.equal(moe(h), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_granite_moe_sums_equal_the_where_formulation(dtype):
    moe = randomized(GraniteMoE(12, 6, 3, 10, 8), seed=3).to(dtype)
    h = torch.randn(2, 9, 12, generator=torch.Generator().manual_seed(4)).to(dtype)
    tokens = h.reshape(-1, 12)
    logits, experts = moe.router(tokens).float().topk(3, dim=-1)
    weights = logits.softmax(dim=-1).to(dtype)
    expected = where_per_expert(moe, tokens, weights, experts).view_as(h) + moe.shared_mlp(h)
    assert torch.equal(moe(h), expected)
