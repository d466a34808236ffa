"""The full-A selective scan (quamba.ops.scan.full_scan): a diagonal A reproduces the diagonal scan
of every method; dense stable systems against scipy (cont2discrete, expm) and a generic RK4 step;
decode steps against the prefill; the structured form; the errors."""
import numpy as np
import pytest
import torch
from scipy.linalg import expm
from scipy.signal import cont2discrete

from quamba.errors import QuambaError
from quamba.ops import backend
from quamba.ops.scan import full_scan
from quamba.ops.scan.discretization import METHODS, input_drive
from quamba.ops.scan.full_scan import full_selective_scan, full_selective_state_update, structured_A
from quamba.ops.scan.selective_scan import selective_scan, selective_state_update

SCIPY_METHOD = {"zoh-exact": "zoh", "bilinear": "bilinear", "foh": "foh"}


def diagonal_inputs(seed, batch=2, d_inner=3, d_state=4, seqlen=9):
    """fp32 scan inputs with a negative diagonal A [d_inner, d_state] (z = ΔA within [-2.4, 0))."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    return dict(u=randn(batch, d_inner, seqlen), delta=randn(batch, d_inner, seqlen) - 1.5,
                A=-(0.05 + 7 * torch.rand(d_inner, d_state, generator=gen)),
                B=randn(batch, d_state, seqlen), C=randn(batch, d_state, seqlen), D=randn(d_inner),
                z=randn(batch, d_inner, seqlen), delta_bias=0.1 * randn(d_inner))


def dense_inputs(seed, **sizes):
    """As :func:`diagonal_inputs` with a dense stable A [d_inner, d_state, d_state]."""
    inputs = diagonal_inputs(seed, **sizes)
    inputs["A"] = stable_matrices(seed, *inputs["A"].shape, dtype=torch.float32)
    return inputs


def stable_matrices(seed, d_inner, d_state, dtype=torch.float64):
    """Dense [d_inner, d_state, d_state] matrices, eigenvalues' real parts in about [-3.5, -0.5]."""
    gen = torch.Generator().manual_seed(seed + 1000)
    shift = torch.eye(d_state, dtype=dtype) * 2
    return 0.3 * torch.randn(d_inner, d_state, d_state, generator=gen, dtype=dtype) - shift


def at(inputs, t):
    """The decode-step inputs of time step t."""
    return {k: (v[..., t] if k in ("u", "delta", "B", "C", "z") else v) for k, v in inputs.items()}


@pytest.mark.parametrize("chunk", [4, 64])
@pytest.mark.parametrize("method", METHODS)
def test_a_diagonal_matrix_reproduces_the_diagonal_scan(method, chunk, monkeypatch):
    monkeypatch.setattr(full_scan, "_CHUNK", chunk)
    inputs = diagonal_inputs(0)
    initial = torch.randn(2, 3, 4)
    drive = 0.5 * torch.randn(2, 3, 4) if method == "foh" else None
    y_ref, last_ref = selective_scan(**inputs, delta_softplus=True, initial_state=initial,
                                     discretization=method, initial_drive=drive)
    y, last = full_selective_scan(**dict(inputs, A=torch.diag_embed(inputs["A"])),
                                  delta_softplus=True, initial_state=initial,
                                  discretization=method, initial_drive=drive)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(last, last_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", METHODS)
def test_a_diagonal_matrix_reproduces_the_diagonal_decode_step(method):
    step = at(diagonal_inputs(1), 4)
    state = torch.randn(2, 3, 4)
    drive = torch.randn(2, 3, 4) if method == "foh" else None
    state_ref, drive_ref = state.clone(), None if drive is None else drive.clone()
    y_ref = selective_state_update(state_ref, **step, delta_softplus=True, discretization=method,
                                   drive=drive_ref)
    y = full_selective_state_update(state, **dict(step, A=torch.diag_embed(step["A"])),
                                    delta_softplus=True, discretization=method, drive=drive)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(state, state_ref, rtol=1e-4, atol=1e-4)
    if drive is not None:
        torch.testing.assert_close(drive, drive_ref)


def one_channel_system(seed, d_state=4, seqlen=6):
    """Float64 stable system of one channel: u, Δ [1, 1, l], A [1, n, n], B, C [1, n, l]."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return dict(u=randn(1, 1, seqlen), delta=0.05 + 0.3 * torch.rand(1, 1, seqlen, generator=gen,
                                                                       dtype=torch.float64),
                A=stable_matrices(seed, 1, d_state), B=randn(1, d_state, seqlen),
                C=randn(1, d_state, seqlen))


def reference_trajectory(system, step):
    """y [l] and the last state of h_t = step(A, Δ, h, v_{t-1}, v_t), v_t = u_t B_t, from h = 0
    and v_{-1} = 0, in float64 numpy."""
    u, delta, A, B, C = (system[k].numpy()[0] for k in ("u", "delta", "A", "B", "C"))
    h, v_prev, y = np.zeros(A.shape[-1]), np.zeros(A.shape[-1]), []
    for t in range(u.shape[-1]):
        v = B[:, t] * u[0, t]
        h = step(A, delta[0, t], h, v_prev, v)
        y.append(C[:, t] @ h)
        v_prev = v
    return np.array(y), h


def scipy_step(method):
    """One step of scipy's discretization of h' = A h + I·v (output h: c = I, d = 0)."""
    def step(A, dt, h, v_prev, v):
        n = A.shape[0]
        ad, bd, cd, dd, _ = cont2discrete((A, np.eye(n), np.eye(n), np.zeros((n, n))), dt,
                                          method=SCIPY_METHOD[method])
        if method != "foh":
            return ad @ h + bd @ v
        # scipy's foh state ξ steps on the step's first input; h = cd ξ + dd v with cd = I
        xi = ad @ (h - dd @ v_prev) + bd @ v_prev
        return cd @ xi + dd @ v
    return step


def expm_euler_step(A, dt, h, v_prev, v):
    return expm(dt * A) @ h + dt * v


def rk4_step(A, dt, h, v_prev, v):
    """A classical Runge-Kutta step of h' = A h + v."""
    def f(x):
        return A @ x + v
    k1 = f(h)
    k2 = f(h + dt / 2 * k1)
    k3 = f(h + dt / 2 * k2)
    k4 = f(h + dt * k3)
    return h + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


REFERENCE_STEPS = {"zoh": expm_euler_step, "zoh-exact": scipy_step("zoh-exact"),
                   "bilinear": scipy_step("bilinear"), "foh": scipy_step("foh"), "rk4": rk4_step}


@pytest.mark.parametrize("method", METHODS)
def test_dense_systems_match_independent_discretizations(method):
    system = one_channel_system(2)
    y_ref, last_ref = reference_trajectory(system, REFERENCE_STEPS[method])
    y, last = full_selective_scan(*(system[k].float() for k in ("u", "delta", "A", "B", "C")),
                                  discretization=method)
    np.testing.assert_allclose(y[0, 0].double().numpy(), y_ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(last[0, 0].double().numpy(), last_ref, rtol=1e-4, atol=1e-5)


def test_zoh_exact_needs_no_inverse_of_a():
    system = one_channel_system(3, d_state=3, seqlen=2)
    system["A"] = torch.zeros(1, 3, 3, dtype=torch.float64)  # singular: B̄ = Δ B, Ā = I
    y, last = full_selective_scan(*(system[k].float() for k in ("u", "delta", "A", "B", "C")),
                                  discretization="zoh-exact")
    expected = (system["delta"] * system["u"] * system["B"]).sum(-1)
    torch.testing.assert_close(last, expected.float().unsqueeze(0))


@pytest.mark.parametrize("method", METHODS)
def test_decode_steps_from_zero_equal_the_prefill(method):
    inputs = dense_inputs(4, seqlen=7)
    y_prefill, last = full_selective_scan(**inputs, delta_softplus=True, discretization=method)
    state = torch.zeros(2, 3, 4)
    drive = torch.zeros(2, 3, 4) if method == "foh" else None
    ys = [full_selective_state_update(state, **at(inputs, t), delta_softplus=True,
                                      discretization=method, drive=drive) for t in range(7)]
    torch.testing.assert_close(torch.stack(ys, dim=-1), y_prefill, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, last, rtol=1e-5, atol=1e-5)
    if drive is not None:
        torch.testing.assert_close(drive, input_drive(inputs["u"][..., -1], inputs["B"][..., -1]))


def test_structured_a_is_diagonal_plus_low_rank():
    diagonal, U, V = torch.randn(3, 4), torch.randn(3, 4, 2), torch.randn(3, 4, 2)
    expected = torch.stack([torch.diag(diagonal[d]) + U[d] @ V[d].T for d in range(3)])
    torch.testing.assert_close(structured_A(diagonal, U, V), expected)
    inputs = dense_inputs(5)
    structured = (-torch.rand(3, 4) - 1, 0.3 * U, 0.3 * V)
    y, last = full_selective_scan(**dict(inputs, A=structured), discretization="bilinear")
    y_ref, last_ref = full_selective_scan(**dict(inputs, A=structured_A(*structured)),
                                          discretization="bilinear")
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(last, last_ref)


def test_both_ops_are_fp_ops_with_a_torch_reference():
    assert {"full_selective_scan", "full_selective_state_update"} <= set(backend.fp_ops())
    assert backend.resolve("full_selective_scan", torch.device("cpu"))[0] == "torch"


def one_line_error(error_type, call, match):
    with pytest.raises(error_type, match=match) as info:
        call()
    assert "\n" not in str(info.value)


def test_bad_shapes_are_one_line_errors():
    inputs = dense_inputs(6)
    one_line_error(ValueError, lambda: full_selective_scan(**dict(inputs, A=inputs["A"][:, 0])),
                   r"A must be \[d_inner, d_state, d_state\]")
    one_line_error(ValueError, lambda: full_selective_scan(**dict(inputs, A=inputs["A"][:, :3])),
                   r"A must be")
    one_line_error(ValueError, lambda: full_selective_scan(**dict(inputs, B=inputs["B"][:, :3])),
                   r"B must be \[batch, d_state, seqlen\] = \[2, 4, 9\], got \[2, 3, 9\]")
    one_line_error(ValueError, lambda: full_selective_scan(**dict(inputs, D=torch.ones(4))),
                   r"D must be \[d_inner\]")
    one_line_error(ValueError, lambda: full_selective_scan(**inputs,
                                                           initial_state=torch.zeros(2, 3, 5)),
                   r"initial_state must be \[batch, d_inner, d_state\]")
    one_line_error(ValueError, lambda: full_selective_state_update(torch.zeros(2, 3, 4), **inputs),
                   r"u must be \[batch, d_inner\]")
    one_line_error(ValueError, lambda: structured_A(torch.zeros(3, 4), torch.zeros(3, 4, 2),
                                                    torch.zeros(3, 4, 1)), r"structured A must be")


def test_unknown_methods_and_misplaced_drives_are_one_line_errors():
    inputs = dense_inputs(7)
    step = at(inputs, 0)
    one_line_error(QuambaError, lambda: full_selective_scan(**inputs, discretization="euler"),
                   r"unknown discretization 'euler'; choose one of zoh, zoh-exact")
    one_line_error(QuambaError, lambda: full_selective_state_update(
        torch.zeros(2, 3, 4), **step, discretization="euler"), r"unknown discretization")
    one_line_error(QuambaError, lambda: full_selective_state_update(
        torch.zeros(2, 3, 4), **step, discretization="foh"), r"needs drive=")
    one_line_error(QuambaError, lambda: full_selective_scan(
        **inputs, initial_drive=torch.zeros(2, 3, 4)), r"initial_drive is carried by the foh")
