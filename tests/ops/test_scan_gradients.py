"""Gradients through the selective-scan references: torch.autograd.gradcheck in float64 for every
discretization, with respect to u, Δ, A, B, C, D, z and the Δ bias, for the prefill and the
decode step of the diagonal scan and the prefill of the full-A scan."""
import pytest
import torch

from quamba.ops.scan.discretization import METHODS
from quamba.ops.scan.full_scan import full_selective_scan
from quamba.ops.scan.selective_scan import selective_scan, selective_state_update

BATCH, D_INNER, D_STATE, SEQLEN = 2, 3, 4, 7


def scan_inputs(seed: int, step: bool = False) -> dict:
    """Small float64 inputs that need gradients; Δ before softplus stays around 0.1–0.7."""
    gen = torch.Generator().manual_seed(seed)
    time = () if step else (SEQLEN,)

    def rand(*shape, scale=1.0, shift=0.0):
        values = torch.randn(*shape, generator=gen, dtype=torch.float64) * scale + shift
        return values.requires_grad_()

    return dict(u=rand(BATCH, D_INNER, *time), delta=rand(BATCH, D_INNER, *time, scale=0.3),
                A=(-torch.rand(D_INNER, D_STATE, generator=gen, dtype=torch.float64) * 2 - 0.1
                   ).requires_grad_(),
                B=rand(BATCH, D_STATE, *time), C=rand(BATCH, D_STATE, *time),
                D=rand(D_INNER), z=rand(BATCH, D_INNER, *time), delta_bias=rand(D_INNER, scale=0.3, shift=-1.0))


NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")


@pytest.mark.parametrize("method", METHODS)
def test_prefill_gradients(method):
    inputs = scan_inputs(seed=len(method))

    def scan(*values):
        y, last_state = selective_scan(**dict(zip(NAMES, values)), delta_softplus=True,
                                       discretization=method)
        return y, last_state

    assert torch.autograd.gradcheck(scan, tuple(inputs[name] for name in NAMES))


@pytest.mark.parametrize("method", METHODS)
def test_decode_step_gradients(method):
    inputs = scan_inputs(seed=len(method) + 1, step=True)
    gen = torch.Generator().manual_seed(0)
    state = torch.randn(BATCH, D_INNER, D_STATE, generator=gen, dtype=torch.float64)
    drive = torch.randn(BATCH, D_INNER, D_STATE, generator=gen, dtype=torch.float64)

    def step(*values):
        carried = drive.clone() if method == "foh" else None
        return selective_state_update(state.clone(), **dict(zip(NAMES, values)),
                                      delta_softplus=True, discretization=method, drive=carried)

    assert torch.autograd.gradcheck(step, tuple(inputs[name] for name in NAMES))


@pytest.mark.parametrize("method", METHODS)
def test_full_A_prefill_gradients(method):
    """The full-A scan (quamba.ops.scan.full_scan), A a dense stable matrix per channel."""
    inputs = scan_inputs(seed=len(method) + 2)
    gen = torch.Generator().manual_seed(1)
    dense = torch.randn(D_INNER, D_STATE, D_STATE, generator=gen, dtype=torch.float64) * 0.3
    full_A = (dense - 1.5 * torch.eye(D_STATE, dtype=torch.float64)).requires_grad_()
    values = tuple(full_A if name == "A" else inputs[name] for name in NAMES)

    def scan(*values):
        return full_selective_scan(**dict(zip(NAMES, values)), delta_softplus=True,
                                   discretization=method)

    assert torch.autograd.gradcheck(scan, values)
