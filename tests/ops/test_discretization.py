"""The scan's discretizations (quamba.ops.scan.discretization) against independent ones: scipy's
cont2discrete (zoh-exact, bilinear, foh), an ODE solve of the foh interpolation and a generic RK4
step; decode steps against the prefill for every method; zoh unchanged; the errors; the config
field through save and load."""
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from scipy.integrate import solve_ivp
from scipy.signal import cont2discrete

import quamba
from quamba.errors import QuambaError
from quamba.models import MambaConfig, MambaLMHeadModel, load_model, randomize_, save_model
from quamba.models.config import ConfigError
from quamba.ops import backend
from quamba.ops.backend import BackendError
from quamba.ops.quant import quantize_weight
from quamba.ops.scan import discretization
from quamba.ops.scan.discretization import METHODS, input_drive
from quamba.ops.scan.qsscan import SSMParams, qsscan, qsscan_last_drive, qsscan_update
from quamba.ops.scan.selective_scan import selective_scan, selective_state_update, state_readout

SCIPY_METHOD = {"zoh-exact": "zoh", "bilinear": "bilinear", "foh": "foh"}
TINY = dict(d_model=32, n_layer=2, vocab_size=64, d_state=8)


def random_system(seed, batch=2, d_inner=3, d_state=4, seqlen=7):
    """float64 u, Δ [b, d, l], A [d, n] < 0, B, C [b, n, l], D [d]; z = ΔA spans [-2.4, 0)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.rand(*shape, generator=gen, dtype=torch.float64)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return dict(u=randn(batch, d_inner, seqlen), delta=0.005 + 0.3 * rand(batch, d_inner, seqlen),
                A=-(0.05 + 8 * rand(d_inner, d_state)), B=randn(batch, d_state, seqlen),
                C=randn(batch, d_state, seqlen), D=randn(d_inner))


def scan_fp32(system, method, **kwargs):
    """quamba's scan of a float64 system (run in fp32) as float64 (y, last_state)."""
    y, last = selective_scan(*(system[k].float() for k in ("u", "delta", "A", "B", "C", "D")),
                             discretization=method, **kwargs)
    return y.double(), last.double()


def reference_scan(system, step):
    """y [b, d, l] and the last state of h_t = step(a [n], Δ, h, v_{t-1}, v_t), v_t = u_t B_t,
    from h = 0 and v_{-1} = 0, in float64 numpy."""
    u, delta, A, B, C, D = (system[k].numpy() for k in ("u", "delta", "A", "B", "C", "D"))
    batch, d_inner, seqlen = u.shape
    y = np.zeros_like(u)
    last = np.zeros((batch, d_inner, A.shape[1]))
    for b in range(batch):
        for d in range(d_inner):
            h, v_prev = np.zeros(A.shape[1]), np.zeros(A.shape[1])
            for t in range(seqlen):
                v = B[b, :, t] * u[b, d, t]
                h = step(A[d], delta[b, d, t], h, v_prev, v)
                y[b, d, t] = C[b, :, t] @ h + D[d] * u[b, d, t]
                v_prev = v
            last[b, d] = h
    return torch.from_numpy(y), torch.from_numpy(last)


def scipy_step(method):
    """One step of scipy's discretization of h' = diag(a) h + I·v (output h: c = I, d = 0)."""
    def step(a, dt, h, v_prev, v):
        n = len(a)
        ad, bd, cd, dd, _ = cont2discrete((np.diag(a), np.eye(n), np.eye(n), np.zeros((n, n))),
                                          dt, method=SCIPY_METHOD[method])
        if method != "foh":
            return ad @ h + bd @ v
        # scipy's foh system steps its state ξ on the step's first input; h = cd ξ + dd v, cd = I
        xi = ad @ (h - dd @ v_prev) + bd @ v_prev
        return cd @ xi + dd @ v
    return step


def rk4(f, h, s, dt):
    """One classical Runge-Kutta step of h' = f(s, h)."""
    k1 = f(s, h)
    k2 = f(s + dt / 2, h + dt / 2 * k1)
    k3 = f(s + dt / 2, h + dt / 2 * k2)
    k4 = f(s + dt, h + dt * k3)
    return h + dt / 6 * (k1 + 2 * k2 + 2 * k3 + k4)


def rk4_step(a, dt, h, v_prev, v):
    return rk4(lambda s, x: a * x + v, h, 0.0, dt)


def foh_ode_step(a, dt, h, v_prev, v):
    """h' = a h + v(s) with v linear from v_prev (s = 0) to v (s = dt), solved to 1e-12."""
    def f(s, x):
        return a * x + v_prev + (s / dt) * (v - v_prev)
    return solve_ivp(f, (0.0, dt), h, method="DOP853", rtol=1e-12, atol=1e-14).y[:, -1]


# --- each method against an independent discretization --------------------------------------------

@pytest.mark.parametrize("method", ["zoh-exact", "bilinear", "foh"])
def test_matches_scipy_cont2discrete(method):
    system = random_system(seed=1)
    y, last = scan_fp32(system, method)
    y_ref, last_ref = reference_scan(system, scipy_step(method))
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, last_ref, rtol=1e-5, atol=1e-5)


def test_foh_solves_the_ode_of_the_interpolated_drive():
    system = random_system(seed=2, batch=1, d_inner=2, d_state=3, seqlen=5)
    y, last = scan_fp32(system, "foh")
    y_ref, last_ref = reference_scan(system, foh_ode_step)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, last_ref, rtol=1e-5, atol=1e-5)


def test_rk4_is_one_runge_kutta_step():
    system = random_system(seed=3)
    y, last = scan_fp32(system, "rk4")
    y_ref, last_ref = reference_scan(system, rk4_step)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last, last_ref, rtol=1e-5, atol=1e-5)


def test_coefficients_have_their_limits_at_zero():
    """a → 0: B̄ → Δ for every method (zoh-exact's (exp(Δa) - 1)/a has no 0/0)."""
    dt = torch.tensor([0.1, 0.1, 0.1])
    A = torch.tensor([0.0, -1e-30, -1e-6])
    for method in METHODS[1:]:
        decay, gain, previous_gain = discretization.coefficients(method, dt, A)
        total_gain = gain if previous_gain is None else gain + previous_gain
        torch.testing.assert_close(decay, torch.ones(3), rtol=0, atol=1e-6)
        torch.testing.assert_close(total_gain, dt, rtol=1e-6, atol=0)


# --- decode steps against the prefill -------------------------------------------------------------

def fp_inputs(seed, batch=3, d_inner=5, d_state=4, seqlen=9):
    """Inputs of selective_scan with Δ|A| < 2.7 (rk4's stable range)."""
    gen = torch.Generator().manual_seed(seed)
    u, delta, z = (torch.randn(batch, d_inner, seqlen, generator=gen) for _ in range(3))
    B, C = (torch.randn(batch, d_state, seqlen, generator=gen) for _ in range(2))
    A = -torch.exp(torch.rand(d_inner, d_state, generator=gen) * 1.5)
    delta = delta.clamp(-2, 2)
    D, delta_bias = torch.rand(d_inner, generator=gen), torch.rand(d_inner, generator=gen) - 3
    return dict(u=u, delta=delta, A=A, B=B, C=C, D=D, z=z, delta_bias=delta_bias,
                delta_softplus=True)


def at(inputs, times):
    """The inputs of the time steps ``times`` (a slice or an index)."""
    timed = ("u", "delta", "z", "B", "C")
    return {k: v[..., times] if k in timed else v for k, v in inputs.items()}


def empty_drive(method, like):
    return torch.zeros_like(like) if method == "foh" else None


def decode(inputs, state, drive, method, steps):
    ys = [selective_state_update(state, **at(inputs, t), discretization=method, drive=drive)
          for t in steps]
    return torch.stack(ys, dim=-1)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seqlen", [1, 9, 259])  # 259: past the reference's 256-step chunk
def test_decode_steps_equal_the_prefill(method, seqlen):
    inputs = fp_inputs(seed=seqlen, seqlen=seqlen)
    y, last = selective_scan(**inputs, discretization=method)
    state = torch.zeros_like(last)
    steps = decode(inputs, state, empty_drive(method, last), method, range(seqlen))
    torch.testing.assert_close(steps, y, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(state, last, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
def test_decode_and_prefill_continue_a_prefill(method):
    inputs, split = fp_inputs(seed=5, seqlen=11), 4
    y, last = selective_scan(**inputs, discretization=method)
    first = at(inputs, slice(0, split))
    _, state = selective_scan(**first, discretization=method)
    drive = input_drive(inputs["u"][..., split - 1], inputs["B"][..., split - 1])
    carried = drive if method == "foh" else None
    y_rest, last_rest = selective_scan(**at(inputs, slice(split, None)), initial_state=state,
                                       discretization=method, initial_drive=carried)
    torch.testing.assert_close(y_rest, y[..., split:], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(last_rest, last, rtol=1e-5, atol=1e-6)
    steps = decode(inputs, state, carried, method, range(split, 11))
    torch.testing.assert_close(steps, y[..., split:], rtol=1e-5, atol=1e-6)


def qsscan_inputs(seed, batch=2, d_inner=6, d_state=4, seqlen=9):
    gen = torch.Generator().manual_seed(seed)

    def codes(*shape):
        return torch.randint(-127, 128, shape, generator=gen, dtype=torch.int8)

    A = torch.rand(d_inner, d_state, generator=gen) * 8 + 1
    A_log, A_log_scale = quantize_weight(torch.log(A))
    D, D_scale = quantize_weight(torch.rand(d_inner, generator=gen) + 0.5)
    dt_bias, dt_bias_scale = quantize_weight(torch.randn(d_inner, generator=gen) - 3)
    params = SSMParams(A_log, A_log_scale, D, D_scale, dt_bias, dt_bias_scale)
    u, dt, z = (codes(batch, d_inner, seqlen) for _ in range(3))
    B, C = codes(batch, d_state, seqlen), codes(batch, d_state, seqlen)
    return [u, 0.02, dt, 0.01, B, 0.05, C, 0.05, z, 0.03], params


def qsscan_at(args, times):
    return [a[..., times] if isinstance(a, torch.Tensor) else a for a in args]


@pytest.mark.parametrize("method", METHODS)
def test_qsscan_decode_continues_its_prefill(method):
    args, params, split, seqlen = *qsscan_inputs(seed=7), 4, 9
    y, last = qsscan(*args, params, out_dtype=torch.float32, discretization=method)
    _, state = qsscan(*qsscan_at(args, slice(0, split)), params, discretization=method)
    prefix = qsscan_at(args, slice(0, split))
    drive = qsscan_last_drive(*prefix[0:2], *prefix[4:6]) if method == "foh" else None
    steps = [qsscan_update(state, None, *qsscan_at(args, t), params, out_dtype=torch.float32,
                           discretization=method, drive=drive) for t in range(split, seqlen)]
    torch.testing.assert_close(torch.stack(steps, -1), y[..., split:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, last, rtol=1e-5, atol=1e-5)


def test_qsscan_is_the_fp_scan_of_its_dequantized_inputs():
    args, params = qsscan_inputs(seed=8)
    u, u_scale, dt, dt_scale, B, B_scale, C, C_scale, z, z_scale = args
    A, D, dt_bias = params.dequantized()
    for method in METHODS:
        y, last = qsscan(*args, params, out_dtype=torch.float32, discretization=method)
        y_fp, last_fp = selective_scan(u.float() * u_scale, dt.float() * dt_scale, A,
                                       B.float() * B_scale, C.float() * C_scale, D,
                                       z=z.float() * z_scale, delta_bias=dt_bias,
                                       delta_softplus=True, discretization=method)
        assert torch.equal(y, y_fp) and torch.equal(last, last_fp)


# --- zoh stays what it was ------------------------------------------------------------------------

def zoh_as_before(u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    """The reference scan's arithmetic before discretizations existed (one chunk)."""
    delta = F.softplus(delta + delta_bias[None, :, None])
    decay = torch.exp(delta.unsqueeze(-1) * A[None, :, None, :])
    drive = (delta * u).unsqueeze(-1) * B[:, None, :, :].transpose(-1, -2)
    state = torch.zeros(u.shape[0], u.shape[1], A.shape[1])
    states = torch.empty_like(decay)
    for t in range(u.shape[-1]):
        state = decay[:, :, t] * state + drive[:, :, t]
        states[:, :, t] = state
    y = torch.einsum("bdtn,bnt->bdt", states, C) + u * D[None, :, None]
    return y * F.silu(z), state


def zoh_step_as_before(state, u, delta, A, B, C, D, z, delta_bias, delta_softplus):
    """The decode step's arithmetic before discretizations existed: (y, new state). C · h is
    added in the decode kernels' pairwise order (state_readout), which the step took later."""
    delta = F.softplus(delta + delta_bias)
    state = torch.exp(delta.unsqueeze(-1) * A) * state + (delta * u).unsqueeze(-1) * B.unsqueeze(1)
    y = state_readout(state, C) + u * D
    return y * F.silu(z), state


@pytest.mark.parametrize("kwargs", [{}, {"discretization": "zoh"}])
def test_zoh_is_bit_identical_to_the_scan_before(kwargs):
    inputs = fp_inputs(seed=9, seqlen=13)
    y, last = selective_scan(**inputs, **kwargs)
    y_before, last_before = zoh_as_before(**inputs)
    assert torch.equal(y, y_before) and torch.equal(last, last_before)
    state, state_before = torch.zeros_like(last), torch.zeros_like(last)
    for t in range(13):
        y_t = selective_state_update(state, **at(inputs, t), **kwargs)
        y_t_before, state_before = zoh_step_as_before(state_before, **at(inputs, t))
        assert torch.equal(y_t, y_t_before) and torch.equal(state, state_before)


def test_qsscan_default_is_zoh():
    args, params = qsscan_inputs(seed=10)
    default = qsscan(*args, params, out_dtype=torch.float32)
    zoh = qsscan(*args, params, out_dtype=torch.float32, discretization="zoh")
    assert all(torch.equal(a, b) for a, b in zip(default, zoh))


# --- the methods converge to each other as Δ → 0 --------------------------------------------------

def relative_difference(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("method, other", [("bilinear", "zoh-exact"), ("rk4", "zoh-exact"),
                                           ("rk4", "bilinear")])
def test_methods_converge_as_the_step_shrinks(method, other):
    system = random_system(seed=11, seqlen=16)
    differences = []
    for scale in (1e-1, 1e-2, 1e-3):
        small = dict(system, delta=system["delta"] * scale / 0.3)
        differences.append(relative_difference(scan_fp32(small, method)[0],
                                               scan_fp32(small, other)[0]))
    assert differences[0] > 1e-5 and differences[2] < 1e-6, differences  # distinct, then equal
    assert differences[1] < differences[0] / 100, differences  # at least second order


# --- errors ---------------------------------------------------------------------------------------

def one_line_error(error_type, call, match):
    with pytest.raises(error_type, match=match) as caught:
        call()
    assert "\n" not in str(caught.value)


def every_op(method, backend_name=None):
    """Calls of the four scan ops with ``method``."""
    inputs = fp_inputs(seed=12, seqlen=3)
    args, params = qsscan_inputs(seed=12, seqlen=3)
    drive = torch.zeros(3, 5, 4) if method == "foh" else None
    kw = dict(discretization=method, backend_name=backend_name)
    return [
        lambda: selective_scan(**inputs, **kw),
        lambda: selective_state_update(torch.zeros(3, 5, 4), **at(inputs, 0), drive=drive, **kw),
        lambda: qsscan(*args, params, **kw),
        lambda: qsscan_update(torch.zeros(2, 6, 4), None, *qsscan_at(args, 0), params,
                              drive=None if drive is None else torch.zeros(2, 6, 4), **kw),
    ]


def test_unknown_method_is_refused_with_the_choices():
    for call in every_op("euler"):
        one_line_error(QuambaError, call,
                       "unknown discretization 'euler'; "
                       "choose one of zoh, zoh-exact, bilinear, foh, rk4")


@pytest.mark.parametrize("method", METHODS[1:])
def test_cuda_backend_refuses_what_its_kernels_lack(method, monkeypatch):
    """mamba-ssm's FP kernels run zoh only; QSScan's run every method, so on CPU tensors the
    only reason they are refused is the device."""
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    fp_calls, quantized_calls = every_op(method, backend_name="cuda")[:2], every_op(method)[2:]
    for call in fp_calls:
        one_line_error(BackendError, call,
                       f"implements only the 'zoh' discretization, not '{method}'")
    monkeypatch.setenv("QUAMBA_BACKEND", "cuda")
    for call in every_op(method)[:2]:
        one_line_error(BackendError, call, "implements only the 'zoh' discretization")
    for call in quantized_calls:
        with pytest.raises(BackendError) as caught:
            call()
        assert "discretization" not in str(caught.value)


def kernels_present(monkeypatch):
    """The backend as on a GPU machine whose quamba._C loads and holds every kernel."""
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setattr(backend, "cuda_extension_error", lambda: None)
    monkeypatch.setattr(backend, "_kernel_missing", lambda name: None)
    monkeypatch.setattr(backend, "device_error", lambda index: None)
    monkeypatch.setattr(backend, "_WARNED", set())


@pytest.mark.parametrize("backend_name", [None, "cuda"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("op", ["qsscan", "qsscan_update"])
def test_qsscan_runs_every_method_on_its_kernel(op, method, backend_name, monkeypatch):
    kernels_present(monkeypatch)
    monkeypatch.setitem(backend._IMPLS[op], "cuda", lambda *args, **kwargs: None)
    drives = {"drive": torch.zeros(1)} if op == "qsscan_update" and method == "foh" else {}
    impl = discretization.select_scan(op, torch.device("cuda"), backend_name, method,
                                      kernel_methods=METHODS, **drives)
    if method == "zoh":
        assert impl is backend._IMPLS[op]["cuda"]
    else:
        assert impl.func is backend._IMPLS[op]["cuda"]
        assert impl.keywords == {"discretization": method, **drives}


def test_qsscan_update_foh_needs_its_drive_on_every_backend():
    args, params = qsscan_inputs(seed=12, seqlen=3)
    for backend_name in ("torch", "cuda"):
        one_line_error(QuambaError, lambda: qsscan_update(
            torch.zeros(2, 6, 4), None, *qsscan_at(args, 0), params, discretization="foh",
            backend_name=backend_name), "foh decode step needs drive=")


@pytest.mark.parametrize("op", ["selective_scan", "selective_state_update"])
def test_auto_on_a_gpu_runs_the_reference_and_says_why(op, monkeypatch, caplog):
    kernels_present(monkeypatch)
    monkeypatch.setitem(backend._REQUIREMENTS, op, lambda: None)  # mamba-ssm installed
    with caplog.at_level("WARNING", logger="quamba"):
        for _ in range(2):
            impl = discretization.select_scan(op, torch.device("cuda"), None, "bilinear")
            assert impl.func is backend._IMPLS[op]["torch"]
            assert impl.keywords == {"discretization": "bilinear"}
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1
    assert op in warnings[0] and "only the 'zoh' discretization, not 'bilinear'" in warnings[0]


def test_a_gpu_without_kernels_still_names_the_discretization(monkeypatch, caplog):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)
    monkeypatch.setitem(backend._REQUIREMENTS, "selective_scan", lambda: "mamba-ssm is missing")
    monkeypatch.setattr(backend, "_WARNED", set())
    with caplog.at_level("WARNING", logger="quamba"):
        for method in ("zoh", "foh", "foh", "zoh"):
            discretization.select_scan("selective_scan", torch.device("cuda"), None, method)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2
    assert "mamba-ssm is missing" in warnings[0] and "not 'foh'" in warnings[1]


def test_the_drive_belongs_to_foh():
    inputs, state = fp_inputs(seed=13, seqlen=2), torch.zeros(3, 5, 4)
    one_line_error(QuambaError, lambda: selective_state_update(state, **at(inputs, 0),
                                                               discretization="foh"),
                   "foh decode step needs drive=")
    one_line_error(QuambaError, lambda: selective_scan(**inputs, initial_drive=state,
                                                       discretization="rk4"),
                   "initial_drive is carried by the foh discretization only, not 'rk4'")


# --- the model config -----------------------------------------------------------------------------

def test_config_field_round_trips_and_defaults_to_zoh():
    config = MambaConfig(**TINY, discretization="foh")
    assert MambaConfig.from_dict(config.to_dict()).discretization == "foh"
    without = {k: v for k, v in config.to_dict().items() if k != "discretization"}
    assert MambaConfig.from_dict(without).discretization == "zoh"
    with pytest.raises(ConfigError, match="discretization must be one of zoh, zoh-exact"):
        MambaConfig(**TINY, discretization="tustin")
    with pytest.raises(ConfigError, match="Mamba2's SSD scan implements only the 'zoh'"):
        MambaConfig(**TINY, layer="Mamba2", headdim=16, discretization="bilinear")


@pytest.mark.parametrize("layout", ["transformers", "mamba_ssm"])
@pytest.mark.parametrize("method", ["zoh", "bilinear"])
def test_save_model_and_load_model_keep_the_discretization(layout, method, tmp_path):
    model = randomize_(MambaLMHeadModel(MambaConfig(**TINY, discretization=method)), seed=0).eval()
    save_model(model, tmp_path / "model", layout=layout)
    written = json.loads((tmp_path / "model" / "config.json").read_text())
    assert ("discretization" in json.dumps(written)) == (method != "zoh")  # zoh files unchanged
    loaded, _ = load_model(tmp_path / "model", tokenizer=False)
    assert loaded.config.discretization == method
    assert {m.discretization for m in loaded.mixers()} == {method}
    ids = torch.randint(0, 64, (2, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids), model(ids))


@pytest.fixture(scope="module")
def foh_model():
    """A random foh FP model whose scan dominates its mixers' output: Δ ≈ softplus(1), D = 0."""
    model = randomize_(MambaLMHeadModel(MambaConfig(**TINY, discretization="foh")), seed=1).eval()
    with torch.no_grad():
        for mixer in model.mixers():
            mixer.dt_proj.bias.fill_(1.0)
            mixer.D.zero_()
    return model


@pytest.fixture(scope="module")
def foh_quantized(foh_model):
    """W8A8 of ``foh_model``, calibrated on random tokens."""
    calib = torch.randint(0, 64, (8, 16), generator=torch.Generator().manual_seed(2))
    return quamba.quantize(foh_model, config=quamba.QuantConfig(calib_num_samples=8,
                                                                calib_seqlen=16),
                           calib_data=calib, progress=False)


def decoded_against_prefill(mixer, h, split=5):
    """Relative difference of a mixer's decode steps after a prefill of ``split`` tokens of h
    from its prefill of all of h."""
    with torch.no_grad():
        full = mixer(h).float()[:, split:]
        state = mixer.allocate_state(h.shape[0])
        mixer(h[:, :split], state=state)
        steps = [mixer(h[:, t:t + 1], state=state, step=True) for t in range(split, h.shape[1])]
    return relative_difference(torch.cat(steps, dim=1).float(), full)


def test_fp_mixer_decode_carries_the_foh_drive(foh_model):
    mixer = foh_model.backbone.layers[0].mixer
    h = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(0))
    assert decoded_against_prefill(mixer, h) < 1e-5  # 0.15 without the carried drive


@pytest.mark.parametrize("mode", ["int8", "fp32-ssm-input", "float-sim-asic-int8", "fp32-conv"])
def test_quantized_mixer_decode_carries_the_foh_drive(foh_quantized, mode):
    block = foh_quantized.backbone.layers[0]
    assert block.mixer.discretization == "foh"
    foh_quantized.set_ssm_mode(mode)
    h = torch.randn(3, 9, 32, generator=torch.Generator().manual_seed(0)).half()
    # the int8 state is requantized every step: 0.07 here, 0.33 without the carried drive
    assert decoded_against_prefill(block.mixer, block.norm(h, None)[0]) < 0.15


def test_quantized_checkpoint_keeps_the_config_field(foh_quantized, tmp_path):
    foh_quantized.save_pretrained(tmp_path / "q")
    config = json.loads((tmp_path / "q" / "config.json").read_text())["model"]
    assert config["discretization"] == "foh"
    loaded, _ = quamba.from_pretrained(tmp_path / "q", tokenizer=False)
    assert loaded.config.discretization == "foh"


def test_reloaded_quantized_mixers_run_the_discretization(foh_quantized, tmp_path):
    foh_quantized.save_pretrained(tmp_path / "q")
    loaded, _ = quamba.from_pretrained(tmp_path / "q", tokenizer=False)
    assert {m.discretization for m in loaded.mixers()} == {"foh"}
