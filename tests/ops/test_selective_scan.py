"""quamba.ops.scan.selective_scan.state_readout: the decode step's C · h, added as a pairwise
tree."""
import pytest
import torch
import torch.nn.functional as F

from quamba.ops.scan.selective_scan import state_readout


def test_the_terms_are_added_adjacent_pairs_first():
    # fp32: 1e8 + 1 = 1e8. Pairwise (1e8 + 1) + (-1e8 + 1) = 0; in order ((1e8 + 1) - 1e8) + 1
    # = 1; pairs of lanes 2 apart (1e8 - 1e8) + (1 + 1) = 2.
    state = torch.tensor([[[1e8, 1.0, -1e8, 1.0]]])
    assert state_readout(state, torch.ones(1, 4)).item() == 0.0


@pytest.mark.parametrize("d_state", [1, 7, 16, 17])
def test_it_is_the_sum_of_the_products(d_state):
    gen = torch.Generator().manual_seed(d_state)
    state, C = torch.randn(3, 5, d_state, generator=gen), torch.randn(3, d_state, generator=gen)
    y = state_readout(state, C)
    assert y.shape == (3, 5) and y.dtype == torch.float32
    exact = torch.einsum("bdn,bn->bd", state.double(), C.double())
    torch.testing.assert_close(y.double(), exact, rtol=1e-6, atol=1e-6)


def test_zero_states_past_the_power_of_two_add_nothing():
    """12 states are added as 16 (four zeros); as 32 (levels of zeros more, as the CUDA step's 8
    lanes add d_state 1 to 4) the sums are the same."""
    gen = torch.Generator().manual_seed(0)
    state, C = torch.randn(2, 3, 12, generator=gen), torch.randn(2, 12, generator=gen)
    pad = (0, 20)
    assert torch.equal(state_readout(state, C),
                       state_readout(F.pad(state, pad), F.pad(C, pad)))
