"""The SSM-side kernels of quamba._C (qconv1d, qsscan, rmsnorm_quant, hadamard_quant and the
decode steps) against their torch references, run on the same CUDA tensors.

Tolerances, and why:

* the conv's int8 prefill codes equal the reference's exactly (``assert_codes_equal``): it
  accumulates exactly and applies the reference's epilogue with the same roundings (its division
  takes div.rn's own fast path, which gives the correctly rounded quotient wherever the result
  can reach a code other than 0).
* other int8 outputs equal the reference, or differ by one step for a tiny fraction of elements
  (``assert_codes_close``: at most max(2, 1e-3 · numel) elements). Every kernel follows the
  rounding rule of quamba.ops.quant operation by operation, so a difference can only come from
  an fp32 value the two backends compute a few ulps apart landing on opposite sides of a .5
  boundary: the scan's last state (it sums in another order than the sequential reference, takes
  exp(Δ A) through ex2.approx and softplus through ex2.approx / lg2.approx, which keeps Δ within
  ~1e-5 relative), the decode step's int8 state (zoh's decay through ex2.approx), RMSNorm (sums
  the squares in another order), the Hadamard kernel (adds the m × m factor in another order than
  BLAS).
* float outputs within 1e-3 relative, plus one unit in the last place of a 16-bit output dtype
  (two fp32 values a few ulps apart may round to neighbouring fp16/bf16 numbers), with an
  absolute floor of 1e-4 of the reference's RMS for values that cancel to near zero.
* every output element is compared, after the caching allocator was primed with poison (-128 for
  int8, which the rule never produces; NaN for floats), so an unwritten element shows.

Decode: the fp32-state step chained over many tokens equals the prefill; with an int8 state each
step requantizes (so a chain is not a prefill), and every step of a chain is checked against the
torch step from the same state. Input-check errors are RuntimeErrors naming the argument.
Tests whose names contain ``small`` are the subset run under compute-sanitizer.
"""
import math
import zlib

import pytest
import torch

from quamba.ops import backend
from quamba.ops.conv.qconv1d import qconv1d, qconv1d_update
from quamba.ops.linear.qlinear import w8a8_linear
from quamba.ops.norm.qhadamard import gated_norm_hadamard_quant, hadamard_quant
from quamba.ops.norm.qnorm import rmsnorm_quant
from quamba.ops.quant import (
    dequantize,
    quantize,
    quantize_weight,
    requant_multiplier,
    scale_from_range,
)
from quamba.ops.scan.discretization import DEFAULT, METHODS
from quamba.ops.scan.qsscan import DtProjection, SSMParams, qsscan, qsscan_last_drive, qsscan_update

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if backend.cuda_extension_error() is not None:
    pytest.skip(backend.cuda_extension_error(), allow_module_level=True)
if not hasattr(torch.ops.quamba, "qsscan"):
    pytest.skip("quamba._C was built without the SSM kernels", allow_module_level=True)

DEVICE = torch.device("cuda")
D_STATE = 16
ULP_16 = {torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7, torch.float32: 0.0}


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)


def seed_for(*params) -> None:
    """Fresh inputs for every case, reproducible from its parameters."""
    torch.manual_seed(zlib.crc32(repr(params).encode()))


def codes(*shape):
    return torch.randint(-127, 128, shape, dtype=torch.int8, device=DEVICE)


def prime_allocator(*outputs):
    """Hand the caching allocator freed blocks of the outputs' sizes filled with poison, so that an
    output allocated from them and left unwritten shows (best effort: the allocator chooses)."""
    blocks = [torch.full((numel,), -128 if dtype == torch.int8 else float("nan"), dtype=dtype,
                         device=DEVICE) for numel, dtype in outputs]
    del blocks


def assert_codes_close(out, ref):
    assert out.dtype == torch.int8 and out.shape == ref.shape
    assert int(out.min()) >= -127, "unwritten (-128) or out-of-range int8 output"
    diff = (out.int() - ref.int()).abs()
    differing = int((diff > 0).sum())
    assert int(diff.max()) <= 1, f"codes differ by up to {int(diff.max())}"
    assert differing <= max(2, 1e-3 * out.numel()), f"{differing} of {out.numel()} codes differ"


def assert_codes_equal(out, ref):
    assert out.dtype == torch.int8 and out.shape == ref.shape
    assert int(out.min()) >= -127, "unwritten (-128) or out-of-range int8 output"
    differing = int((out != ref).sum())
    assert differing == 0, f"{differing} of {out.numel()} codes differ"


def assert_close_to(out, ref):
    """int8 codes within one step, floats within 1e-3 relative (see the module docstring)."""
    if ref.dtype == torch.int8:
        assert_codes_close(out, ref)
    else:
        assert not out.isnan().any(), "unwritten (NaN) float output"
        rtol = 1e-3 + ULP_16[ref.dtype]
        rms = float(ref.float().pow(2).mean().sqrt()) if ref.numel() else 0.0
        torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=1e-4 * rms + 1e-30)


# ---- qconv1d ---------------------------------------------------------------------------------

def conv_input(batch, dim, seqlen, layout):
    """int8 x [batch, dim, seqlen]: 'module' is the x half of a transposed [b, l, 2·dim] in_proj
    output (stride(1) == 1), 'contiguous' is channel-first, 'strided' a step-2 time slice."""
    if layout == "module":
        return codes(batch, seqlen, 2 * dim).transpose(1, 2)[:, :dim]
    if layout == "strided":
        return codes(batch, dim, 2 * seqlen)[:, :, ::2]
    return codes(batch, dim, seqlen)


def conv_params(dim, width, with_bias):
    weight, weight_scale = quantize_weight(torch.randn(dim, width, device=DEVICE) * 0.3)
    bias, bias_scale = (quantize_weight(torch.randn(dim, device=DEVICE) * 0.2) if with_bias
                        else (None, None))
    return dict(weight=weight, weight_scale=float(weight_scale), bias=bias,
                bias_scale=None if bias_scale is None else float(bias_scale))


X_SCALE = 0.04


def run_conv(x, params, out_scale, activation, backend_name):
    return qconv1d(x, X_SCALE, params["weight"], params["weight_scale"], params["bias"],
                   params["bias_scale"], out_scale, activation, backend_name=backend_name)


def conv_out_scale(x, params, activation="silu"):
    """Maps 90% of the output's absmax to 127: outputs span the int8 range, the largest saturate."""
    y = run_conv(x, params, None, activation, "torch")
    return float(scale_from_range(0.9 * float(y.abs().max())))


CONV_SHAPES = [(1, 5120, 2048), (2, 1536, 1), (3, 2560, 17), (8, 48, 4096), (4, 4096, 333),
               (1, 40, 1), (2, 3072, 1000), (1, 1536, 4096), (5, 2048, 255)]


@pytest.mark.parametrize("layout", ["module", "contiguous"])
@pytest.mark.parametrize("batch,dim,seqlen", CONV_SHAPES)
def test_qconv1d_matches_reference(batch, dim, seqlen, layout):
    seed_for("conv", batch, dim, seqlen, layout)
    x, params = conv_input(batch, dim, seqlen, layout), conv_params(dim, 4, with_bias=True)
    out_scale = conv_out_scale(x, params)
    prime_allocator((x.numel(), torch.int8))
    out = run_conv(x, params, out_scale, "silu", "cuda")
    assert out.stride(1) == 1 if layout == "module" else out.is_contiguous()
    assert_codes_equal(out, run_conv(x, params, out_scale, "silu", "torch"))


@pytest.mark.parametrize("layout", ["module", "contiguous", "strided"])
@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("out_int8", [True, False])
@pytest.mark.parametrize("activation", ["silu", None])
def test_small_qconv1d_every_variant(layout, width, with_bias, out_int8, activation):
    seed_for("conv-variants", layout, width, with_bias, out_int8, activation)
    batch, dim, seqlen = 3, 200, 37
    x, params = conv_input(batch, dim, seqlen, layout), conv_params(dim, width, with_bias)
    out_scale = conv_out_scale(x, params, activation) if out_int8 else None
    prime_allocator((x.numel(), torch.int8 if out_int8 else torch.float32))
    out = run_conv(x, params, out_scale, activation, "cuda")
    ref = run_conv(x, params, out_scale, activation, "torch")
    if out_int8:
        assert_codes_equal(out, ref)
    else:
        assert_close_to(out, ref)


def conv_step(x_t, state, params, out_scale, backend_name):
    return qconv1d_update(x_t, state, X_SCALE, params["weight"], params["weight_scale"],
                          params["bias"], params["bias_scale"], out_scale,
                          backend_name=backend_name)


@pytest.mark.parametrize("width", [2, 3, 4])
@pytest.mark.parametrize("batch,dim", [(1, 5120), (8, 1536), (3, 40)])
def test_small_qconv1d_update_chain_equals_prefill(batch, dim, width):
    """Decode steps from a zero state over seqlen tokens give the prefill's outputs exactly (the
    same integer accumulation and epilogue) and leave the last width - 1 inputs as the state."""
    seed_for("conv-chain", batch, dim, width)
    seqlen = 40
    xz = codes(batch, seqlen, 2 * dim)  # decode reads x as a slice of the in_proj output
    params = conv_params(dim, width, with_bias=True)
    x = xz.transpose(1, 2)[:, :dim]
    out_scale = conv_out_scale(x, params)
    prefill = run_conv(x, params, out_scale, "silu", "cuda")
    state = torch.zeros(batch, dim, width - 1, dtype=torch.int8, device=DEVICE)
    for t in range(seqlen):
        step_out = conv_step(xz[:, t, :dim], state, params, out_scale, "cuda")
        assert torch.equal(step_out, prefill[:, :, t]), f"step {t} differs from the prefill"
    assert torch.equal(state, xz[:, seqlen - width + 1:, :dim].transpose(1, 2))


@pytest.mark.parametrize("batch,dim", [(1, 5120), (8, 5120)])
def test_small_qconv1d_update_back_to_back_equals_synchronized_steps(batch, dim):
    """Steps queued back to back on one state (each launched programmatically dependent on the
    one before, which it must wait for before reading the state) equal steps waited for one by one."""
    seed_for("conv-back-to-back", batch, dim)
    seqlen = 16
    xz = codes(batch, seqlen, 2 * dim)
    params = conv_params(dim, 4, with_bias=True)
    out_scale = conv_out_scale(xz.transpose(1, 2)[:, :dim], params)
    queued_state, waited_state = (torch.zeros(batch, dim, 3, dtype=torch.int8, device=DEVICE)
                                  for _ in range(2))
    queued = [conv_step(xz[:, t, :dim], queued_state, params, out_scale, "cuda")
              for t in range(seqlen)]
    for t in range(seqlen):
        waited = conv_step(xz[:, t, :dim], waited_state, params, out_scale, "cuda")
        torch.cuda.synchronize()
        assert torch.equal(queued[t], waited), f"step {t}"
    assert torch.equal(queued_state, waited_state)


@pytest.mark.parametrize("batch,dim", [(1, 5120), (8, 1536), (3, 40)])
def test_small_qconv1d_update_matches_reference(batch, dim):
    seed_for("conv-step", batch, dim)
    params = conv_params(dim, 4, with_bias=True)
    x_t = codes(batch, 2 * dim)[:, dim:]
    state = codes(batch, dim, 3)
    state_ref = state.clone()
    out_scale = 0.05
    prime_allocator((batch * dim, torch.int8))
    out = conv_step(x_t, state, params, out_scale, "cuda")
    assert_codes_close(out, conv_step(x_t, state_ref, params, out_scale, "torch"))
    assert torch.equal(state, state_ref)


# ---- qsscan ----------------------------------------------------------------------------------

def ssm_params(dim):
    """Mamba's initialisation (A = -(1..d_state), dt in [1e-3, 0.1]) with some noise, quantized."""
    a_log = torch.log(torch.arange(1, D_STATE + 1, device=DEVICE).float()).expand(dim, D_STATE)
    a_log = a_log + 0.1 * torch.randn(dim, D_STATE, device=DEVICE)
    dt = torch.exp(torch.rand(dim, device=DEVICE) * (math.log(0.1) - math.log(1e-3))
                   + math.log(1e-3))
    dt_bias = dt + torch.log(-torch.expm1(-dt))  # inverse softplus
    d_skip = 1 + 0.2 * torch.randn(dim, device=DEVICE)
    (A_log, A_log_scale), (D, D_scale), (dt_b, dt_b_scale) = (
        quantize_weight(a_log), quantize_weight(d_skip), quantize_weight(dt_bias))
    return SSMParams(A_log, float(A_log_scale), D, float(D_scale), dt_b, float(dt_b_scale))


SCALES = dict(u_scale=0.03, dt_scale=0.02, B_scale=0.02, C_scale=0.02, z_scale=0.03)


def scales_for(method):
    """SCALES, with a 20× smaller dt scale for rk4: its Ā = R(Δa) leaves [-1, 1] below
    Δa = -2.78 (the state would overflow), so its Δ stays under ~0.11 (Δa above ~-2.7 here)."""
    return dict(SCALES, dt_scale=0.001) if method == "rk4" else SCALES


def scan_inputs(batch, dim, seqlen, layout, in_dtype=torch.int8, with_z=True, method=DEFAULT):
    """u, dt, z [batch, dim, seqlen] and B, C [batch, d_state, seqlen] as the module lays them out
    ('module': transposed GEMM outputs, B and C slices of x_proj's output) or channel-first
    ('contiguous'); int8 codes, or their dequantized values in in_dtype (fp32-ssm-input mode)
    with the scales of ``method``."""
    if layout == "module":
        u = codes(batch, seqlen, dim).transpose(1, 2)
        dt = codes(batch, seqlen, dim).transpose(1, 2)
        z = codes(batch, seqlen, 2 * dim).transpose(1, 2)[:, dim:]
        x_dbl = codes(batch, seqlen, 48 + 2 * D_STATE)
        B, C = (s.transpose(1, 2) for s in x_dbl.split([48, D_STATE, D_STATE], dim=-1)[1:])
    else:
        u, dt, z = codes(batch, dim, seqlen), codes(batch, dim, seqlen), codes(batch, dim, seqlen)
        B, C = codes(batch, D_STATE, seqlen), codes(batch, D_STATE, seqlen)
    tensors = dict(u=u, dt=dt, B=B, C=C, z=z if with_z else None)
    if in_dtype != torch.int8:
        scales = scales_for(method)
        tensors = {name: None if t is None else dequantize(t, scales[f"{name}_scale"]).to(in_dtype)
                   for name, t in tensors.items()}
    return tensors


def run_scan(inputs, params, state_scale, out_dtype, backend_name, method=DEFAULT):
    s = scales_for(method)
    return qsscan(inputs["u"], s["u_scale"], inputs["dt"], s["dt_scale"], inputs["B"],
                  s["B_scale"], inputs["C"], s["C_scale"], inputs["z"], s["z_scale"], params,
                  state_scale=state_scale, out_dtype=out_dtype, backend_name=backend_name,
                  discretization=method)


def check_scan(batch, dim, seqlen, layout, out_dtype=torch.float16, int8_state=True,
               in_dtype=torch.int8, with_z=True, method=DEFAULT):
    inputs = scan_inputs(batch, dim, seqlen, layout, in_dtype, with_z, method)
    params = ssm_params(dim)
    y_ref, h_ref = run_scan(inputs, params, None, out_dtype, "torch", method)
    state_scale = None
    if int8_state:  # what the torch backend returns for this scale, without a second scan
        state_scale = float(scale_from_range(float(h_ref.abs().max())))
        h_ref = quantize(h_ref, state_scale)
    prime_allocator((batch * dim * seqlen, out_dtype),
                    (batch * dim * D_STATE, h_ref.dtype))
    y, h = run_scan(inputs, params, state_scale, out_dtype, "cuda", method)
    if layout == "module":
        assert y.stride(1) == 1
    assert_close_to(y, y_ref)
    assert_close_to(h, h_ref)


SCAN_SHAPES = [(1, 5120, 1024), (1, 5120, 2048), (2, 1536, 1), (3, 2560, 17), (8, 48, 4096),
               (4, 1536, 257), (1, 40, 1000), (2, 3072, 255), (1, 1536, 4096), (5, 2048, 513)]


@pytest.mark.parametrize("layout", ["module", "contiguous"])
@pytest.mark.parametrize("batch,dim,seqlen", SCAN_SHAPES)
def test_qsscan_matches_reference(batch, dim, seqlen, layout):
    seed_for("scan", batch, dim, seqlen, layout)
    check_scan(batch, dim, seqlen, layout)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("int8_state", [True, False])
@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("layout", ["module", "contiguous"])
def test_small_qsscan_every_variant(out_dtype, int8_state, with_z, layout):
    seed_for("scan-variants", out_dtype, int8_state, with_z, layout)
    check_scan(2, 72, 300, layout, out_dtype, int8_state, with_z=with_z)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["module", "contiguous"])
def test_small_qsscan_float_inputs(in_dtype, layout):
    """The fp32-ssm-input mode passes dequantized floats (their scales are ignored)."""
    seed_for("scan-float", in_dtype, layout)
    check_scan(2, 136, 333, layout, torch.float32, False, in_dtype)


SCAN_CONFIGS = 3  # the launch configurations of csrc/qsscan (kScanConfigs)
CHUNKED_CONFIG = 2  # the chunked scan (csrc/qsscan/qsscan_chunked.cu), the op's default for
# channel-last inputs (config 0 for channel-first ones)


@pytest.mark.parametrize("config", range(SCAN_CONFIGS))
@pytest.mark.parametrize("layout", ["module", "contiguous"])
@pytest.mark.parametrize("dim,seqlen", [(200, 700), (208, 704)])
def test_small_qsscan_every_config(layout, config, dim, seqlen):
    """Every launch configuration, called directly (the op's default is one of them), on a shape
    the kernel stages element by element (dim 200) and one it moves in 16-byte vectors."""
    from quamba.ops.scan.cuda import qsscan_op_args

    seed_for("scan-config", layout, config, dim, seqlen)
    inputs, params = scan_inputs(3, dim, seqlen, layout), ssm_params(dim)
    y_ref, h_ref = run_scan(inputs, params, None, torch.float16, "torch")
    s = SCALES
    args = qsscan_op_args(inputs["u"], s["u_scale"], inputs["dt"], s["dt_scale"], inputs["B"],
                          s["B_scale"], inputs["C"], s["C_scale"], inputs["z"], s["z_scale"],
                          params, None, torch.float16)
    prime_allocator((3 * dim * seqlen, torch.float16), (3 * dim * D_STATE, torch.float32))
    y, h = torch.ops.quamba.qsscan(*args, config)
    assert_close_to(y, y_ref)
    assert_close_to(h, h_ref)


def chunked_scan(inputs, params, out_dtype, chunk_len, method=DEFAULT, state_scale=None):
    """The chunked configuration with an explicit chunk length (0: the launcher's choice)."""
    from quamba.ops.scan.cuda import qsscan_op_args

    s = scales_for(method)
    args = qsscan_op_args(inputs["u"], s["u_scale"], inputs["dt"], s["dt_scale"], inputs["B"],
                          s["B_scale"], inputs["C"], s["C_scale"], inputs["z"], s["z_scale"],
                          params, state_scale, out_dtype)
    return torch.ops.quamba.qsscan(*args, CHUNKED_CONFIG, method, chunk_len)


@pytest.mark.parametrize("layout", ["module", "contiguous"])
@pytest.mark.parametrize("batch,dim,seqlen,chunk_len", [
    (1, 5120, 1024, 16), (2, 1536, 1000, 48), (3, 200, 257, 32), (1, 40, 4097, 512),
    (4, 72, 17, 16), (2, 5120, 2048, 0), (1, 2048, 300, 1024), (3, 96, 333, 80)])
def test_qsscan_chunked_chunk_lengths(batch, dim, seqlen, chunk_len, layout):
    """The chunked scan split into many chunks (down to one staging window), few, or one, with a
    short last chunk, on dims that fill whole warps and dims that do not: the chunks' end states
    folded into start states give the sequential scan's y and last state."""
    seed_for("scan-chunked", batch, dim, seqlen, chunk_len, layout)
    inputs, params = scan_inputs(batch, dim, seqlen, layout), ssm_params(dim)
    y_ref, h_ref = run_scan(inputs, params, None, torch.float16, "torch")
    state_scale = float(scale_from_range(float(h_ref.abs().max())))
    prime_allocator((batch * dim * seqlen, torch.float16), (batch * dim * D_STATE, torch.int8))
    y, h = chunked_scan(inputs, params, torch.float16, chunk_len, state_scale=state_scale)
    assert_close_to(y, y_ref)
    assert_close_to(h, quantize(h_ref, state_scale))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("layout", ["module", "contiguous"])
def test_small_qsscan_chunked_every_method(method, layout):
    """Every discretization across chunk boundaries (foh carries v = u B over them)."""
    seed_for("scan-chunked-method", method, layout)
    inputs, params = scan_inputs(2, 72, 301, layout, method=method), ssm_params(72)
    y_ref, h_ref = run_scan(inputs, params, None, torch.float32, "torch", method)
    y, h = chunked_scan(inputs, params, torch.float32, 32, method)
    assert_close_to(y, y_ref)
    assert_close_to(h, h_ref)


@pytest.mark.parametrize("d_state", [1, 8, 15, 24, 32])
@pytest.mark.parametrize("in_dtype", [torch.int8, torch.float16])
def test_small_qsscan_chunked_state_sizes(d_state, in_dtype):
    """State sizes the kernel pads (to 16 or 32 states) or fills exactly, through the element-wise
    and the vector staging of B and C (int8 rows of 16 or 32 codes)."""
    seed_for("scan-chunked-states", d_state, in_dtype)
    batch, dim, seqlen = 2, 64, 129
    x_dbl = codes(batch, seqlen, 16 + 2 * d_state)
    B, C = (t.transpose(1, 2) for t in x_dbl.split([16, d_state, d_state], dim=-1)[1:])
    inputs = dict(u=codes(batch, seqlen, dim).transpose(1, 2),
                  dt=codes(batch, seqlen, dim).transpose(1, 2), B=B, C=C,
                  z=codes(batch, seqlen, 2 * dim).transpose(1, 2)[:, dim:])
    if in_dtype != torch.int8:
        inputs = {k: dequantize(v, SCALES[f"{k}_scale"]).to(in_dtype) for k, v in inputs.items()}
    a_log = torch.log(torch.arange(1, d_state + 1, device=DEVICE).float()).expand(dim, d_state)
    A_log, A_log_scale = quantize_weight(a_log + 0.1 * torch.randn(dim, d_state, device=DEVICE))
    base = ssm_params(dim)
    params = SSMParams(A_log, float(A_log_scale), base.D, base.D_scale, base.dt_bias,
                       base.dt_bias_scale)
    y_ref, h_ref = run_scan(inputs, params, None, torch.float32, "torch")
    y, h = chunked_scan(inputs, params, torch.float32, 48)
    assert_close_to(y, y_ref)
    assert_close_to(h, h_ref)


@pytest.mark.parametrize("layout,config", [("module", CHUNKED_CONFIG), ("contiguous", 0)])
def test_small_qsscan_default_config_follows_the_layout(layout, config):
    """The op's default runs the chunked scan on channel-last inputs and config 0 on channel-first
    ones (which the chunked scan reads element by element): the same bits as that config."""
    from quamba.ops.scan.cuda import qsscan_op_args

    seed_for("scan-default-config", layout)
    inputs, params = scan_inputs(2, 256, 300, layout), ssm_params(256)
    s = SCALES
    args = qsscan_op_args(inputs["u"], s["u_scale"], inputs["dt"], s["dt_scale"], inputs["B"],
                          s["B_scale"], inputs["C"], s["C_scale"], inputs["z"], s["z_scale"],
                          params, None, torch.float16)
    default = torch.ops.quamba.qsscan(*args)
    chosen = torch.ops.quamba.qsscan(*args, config)
    assert all(torch.equal(a, b) for a, b in zip(default, chosen))


def test_small_qsscan_chunked_is_deterministic():
    """Whichever warp folds the chunks' states, it folds them in chunk order: two runs on the
    same inputs agree bit for bit."""
    seed_for("scan-chunked-determinism")
    inputs, params = scan_inputs(3, 1536, 1000, "module"), ssm_params(1536)
    first = chunked_scan(inputs, params, torch.float16, 16)
    second = chunked_scan(inputs, params, torch.float16, 16)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_small_qsscan_mixed_inputs():
    """fp32-conv mode: a float u with int8 dt, B, C, z."""
    seed_for("scan-mixed")
    inputs = scan_inputs(2, 96, 129, "module")
    inputs["u"] = dequantize(inputs["u"], SCALES["u_scale"])
    params = ssm_params(96)
    y_ref, h_ref = run_scan(inputs, params, None, torch.float32, "torch")
    y, h = run_scan(inputs, params, None, torch.float32, "cuda")
    assert_close_to(y, y_ref)
    assert_close_to(h, h_ref)


def step_inputs(inputs, t):
    return {name: None if x is None else x[:, :, t] for name, x in inputs.items()}


def run_step(state, state_scale, step, params, out_dtype, backend_name, method=DEFAULT,
             drive=None):
    s = scales_for(method)
    return qsscan_update(state, state_scale, step["u"], s["u_scale"], step["dt"], s["dt_scale"],
                         step["B"], s["B_scale"], step["C"], s["C_scale"], step["z"],
                         s["z_scale"], params, out_dtype=out_dtype, backend_name=backend_name,
                         discretization=method, drive=drive)


@pytest.mark.parametrize("batch,dim", [(1, 5120), (8, 1536), (3, 40)])
def test_small_qsscan_update_chain_equals_prefill(batch, dim):
    """fp32 state: decode steps chained over 64 tokens give the prefill's y and last state."""
    seed_for("scan-chain", batch, dim)
    seqlen = 64
    inputs, params = scan_inputs(batch, dim, seqlen, "module"), ssm_params(dim)
    y_prefill, h_prefill = run_scan(inputs, params, None, torch.float32, "cuda")
    state = torch.zeros(batch, dim, D_STATE, device=DEVICE)
    for t in range(seqlen):
        y_t = run_step(state, None, step_inputs(inputs, t), params, torch.float32, "cuda")
        assert_close_to(y_t, y_prefill[:, :, t])
    assert_close_to(state, h_prefill)


@pytest.mark.parametrize("state_scale", [None, 0.05])
@pytest.mark.parametrize("batch,dim", [(1, 5120), (8, 5120)])
def test_small_qsscan_update_back_to_back_equals_synchronized_steps(batch, dim, state_scale):
    """Steps queued back to back on one state (each launched programmatically dependent on the
    one before, which it must wait for before reading the state) equal steps waited for one by
    one: batch 1 takes a lane a state, batch 8 the one-lane layout."""
    seed_for("scan-back-to-back", batch, dim, state_scale)
    seqlen = 16
    inputs, params = scan_inputs(batch, dim, seqlen, "module"), ssm_params(dim)
    state_dtype = torch.float32 if state_scale is None else torch.int8
    queued_state, waited_state = (torch.zeros(batch, dim, D_STATE, dtype=state_dtype, device=DEVICE)
                                  for _ in range(2))
    queued = [run_step(queued_state, state_scale, step_inputs(inputs, t), params, torch.float16,
                       "cuda") for t in range(seqlen)]
    for t in range(seqlen):
        waited = run_step(waited_state, state_scale, step_inputs(inputs, t), params, torch.float16,
                          "cuda")
        torch.cuda.synchronize()
        assert torch.equal(queued[t], waited), f"step {t}"
    assert torch.equal(queued_state, waited_state)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch,dim", [(1, 5120), (8, 1536), (3, 40)])
def test_small_qsscan_update_int8_state_matches_reference(batch, dim, out_dtype):
    """int8 state: each of 32 chained steps matches the torch step taken from the same state."""
    seed_for("scan-int8-step", batch, dim, out_dtype)
    seqlen = 32
    inputs, params = scan_inputs(batch, dim, seqlen, "module"), ssm_params(dim)
    _, h_last = run_scan(inputs, params, None, torch.float32, "torch")
    state_scale = float(scale_from_range(float(h_last.abs().max())))
    state_ref = torch.zeros(batch, dim, D_STATE, dtype=torch.int8, device=DEVICE)
    for t in range(seqlen):
        state = state_ref.clone()
        step = step_inputs(inputs, t)
        prime_allocator((batch * dim, out_dtype))
        y = run_step(state, state_scale, step, params, out_dtype, "cuda")
        y_ref = run_step(state_ref, state_scale, step, params, out_dtype, "torch")
        assert_close_to(y, y_ref)
        assert_codes_close(state, state_ref)


@pytest.mark.parametrize("method", [DEFAULT, "bilinear"])
@pytest.mark.parametrize("lanes", [0, 16, 4, 1])
@pytest.mark.parametrize("batch,dim", [(8, 1536), (3, 40), (32, 2560)])
def test_small_qsscan_update_lanes_match_reference(lanes, method, batch, dim):
    """Each lanes-per-channel variant of the step (0: the one the shape picks) against the torch
    step, int8 state: codes within one step, y within the float bound."""
    seed_for("scan-update-lanes", lanes, method, batch, dim)
    case = lanes_case(batch, dim, method)
    state_ref = case["state"].clone()
    y = step_with_lanes(**case, lanes=lanes)
    y_ref = run_step(state_ref, case["state_scale"], case["step"], case["params"], torch.float16,
                     "torch", method)
    assert_close_to(y, y_ref)
    assert_codes_close(case["state"], state_ref)


@pytest.mark.parametrize("method", [DEFAULT, "bilinear", "foh"])
@pytest.mark.parametrize("batch,dim", [(8, 1536), (3, 40), (32, 2560)])
def test_small_qsscan_update_lanes_agree_bit_for_bit(method, batch, dim):
    """Every lanes-per-channel layout of the step adds C · h in state_readout's pairwise order:
    the same y, int8 state (and foh drive) bit for bit (the fused Mamba1 step's y rests on that
    order too)."""
    seed_for("scan-update-lanes-agree", method, batch, dim)
    case = lanes_case(batch, dim, method)
    drive = torch.randn(batch, dim, D_STATE, device=DEVICE) if method == "foh" else None
    outputs = []
    for lanes in STEP_LANES:
        stepped = dict(case, state=case["state"].clone(),
                       drive=None if drive is None else drive.clone())
        y = step_with_lanes(**stepped, lanes=lanes)
        outputs.append((y.view(torch.int16), stepped["state"], stepped["drive"]))
    for out, lanes in zip(outputs[1:], STEP_LANES[1:]):
        for value, first in zip(out, outputs[0]):
            assert first is None or torch.equal(value, first), f"{lanes} lanes"


STEP_LANES = (16, 4, 1)  # the step's layouts at d_state 16


def lanes_case(batch, dim, method) -> dict:
    """An int8 state (a 4-step scan's last, quantized) and the inputs of the step after it."""
    inputs, params = scan_inputs(batch, dim, 4, "module", method=method), ssm_params(dim)
    _, h_last = run_scan(inputs, params, None, torch.float32, "torch", method)
    state_scale = float(scale_from_range(float(h_last.abs().max())))
    return dict(state=quantize(h_last, state_scale), state_scale=state_scale,
                step=step_inputs(inputs, 3), params=params, method=method)


def step_with_lanes(state, state_scale, step, params, method, lanes, drive=None):
    """y (fp16) of the CUDA step with ``lanes`` lanes a channel; ``state`` (and foh's ``drive``)
    stepped in place."""
    from quamba.ops.scan.cuda import _input_scale, _param_args

    s = scales_for(method)
    return torch.ops.quamba.qsscan_update(
        state, _input_scale(state, state_scale), *(
            value for name in ("u", "dt", "B", "C", "z")
            for value in (step[name], _input_scale(step[name], s[f"{name}_scale"]))),
        *_param_args(params), torch.float16, drive=drive, discretization=method, lanes=lanes)


@pytest.mark.parametrize("d_state,aligned,int8_state", [
    (16, False, True), (15, True, True), (12, True, False), (8, True, True), (1, True, False)])
def test_small_qsscan_update_one_lane_odd_states(d_state, aligned, int8_state):
    """The one-lane layout where its states are not whole 16-byte rows (d_state below 16, a state
    tensor off 16-byte alignment), on partial channel and row tiles (5 rows of 72 channels):
    y and the state equal the one-lane-a-state layout's bit for bit."""
    seed_for("scan-update-one-lane", d_state, aligned, int8_state)
    batch, dim = 5, 72
    x_dbl = codes(batch, 16 + 2 * d_state)
    B, C = x_dbl.split([16, d_state, d_state], dim=-1)[1:]
    u, dt, z = codes(batch, dim), codes(batch, dim), codes(batch, dim)
    a_log = torch.log(torch.arange(1, d_state + 1, device=DEVICE).float()).expand(dim, d_state)
    A_log, A_log_scale = quantize_weight(a_log + 0.1 * torch.randn(dim, d_state, device=DEVICE))
    base = ssm_params(dim)
    numel = batch * dim * d_state
    storage = codes(numel + 1) if int8_state else torch.randn(numel + 1, device=DEVICE)
    start = 0 if aligned else 1  # one element in: off 16-byte alignment
    s = SCALES
    results = []
    for lanes in (8 if d_state <= 8 else 16, 1):
        state = storage.clone()[start:start + numel].view(batch, dim, d_state)
        y = torch.ops.quamba.qsscan_update(
            state, 0.05, u, s["u_scale"], dt, s["dt_scale"], B, s["B_scale"], C, s["C_scale"],
            z, s["z_scale"], A_log, float(A_log_scale), base.D, base.D_scale, base.dt_bias,
            base.dt_bias_scale, torch.float16, lanes=lanes)
        results.append((y.view(torch.int16), state))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])


def test_small_qsscan_update_rejects_unknown_lanes():
    inputs, params = scan_inputs(1, 64, 1, "module"), ssm_params(64)
    step, s = step_inputs(inputs, 0), SCALES
    args = (torch.zeros(1, 64, D_STATE, device=DEVICE), 1.0, step["u"], s["u_scale"], step["dt"],
            s["dt_scale"], step["B"], s["B_scale"], step["C"], s["C_scale"], step["z"],
            s["z_scale"], params.A_log, params.A_log_scale, params.D, params.D_scale,
            params.dt_bias, params.dt_bias_scale, torch.float16)
    with pytest.raises(RuntimeError, match="lanes must be 0 \\(chosen\\), 16, 4 or 1"):
        torch.ops.quamba.qsscan_update(*args, lanes=2)


# ---- dt_proj folded into the step ------------------------------------------------------------

def folded_dt_case(batch, dim, dt_rank, offset=0):
    """x_proj's output codes (dt_low, B, C slices, ``offset`` columns in: off 16-byte alignment), a
    quantized dt_proj [dim, dt_rank] and the other step inputs, as the mixer passes them."""
    x_dbl = codes(batch, offset + dt_rank + 2 * D_STATE)[:, offset:]
    dt_low, B, C = x_dbl.split([dt_rank, D_STATE, D_STATE], dim=-1)
    weight, weight_scale = quantize_weight(torch.randn(dim, dt_rank, device=DEVICE))
    s = SCALES
    multiplier = requant_multiplier(s["B_scale"], float(weight_scale), s["dt_scale"])
    return dict(dt_low=dt_low, B=B, C=C, u=codes(batch, dim), z=codes(batch, dim),
                weight=weight, weight_scale=float(weight_scale),
                projection=DtProjection(weight, multiplier), params=ssm_params(dim))


def step_raw(state, case, dt, method=DEFAULT, lanes=0, **projection):
    """The CUDA step with ``lanes`` lanes a channel (0: chosen); y fp16, the state in place."""
    s, p = SCALES, case["params"]
    return torch.ops.quamba.qsscan_update(
        state, 0.05, case["u"], s["u_scale"], dt, s["dt_scale"], case["B"], s["B_scale"],
        case["C"], s["C_scale"], case["z"], s["z_scale"], p.A_log, p.A_log_scale, p.D, p.D_scale,
        p.dt_bias, p.dt_bias_scale, torch.float16, discretization=method, lanes=lanes,
        **projection)


FOLDED_SHAPES = [(1, 5120, 160, 0), (8, 1536, 48, 0), (8, 1536, 48, 1), (3, 40, 7, 0),
                 (5, 72, 13, 3), (11, 72, 16, 0), (64, 2560, 160, 0)]


@pytest.mark.parametrize("method", [DEFAULT, "bilinear"])
@pytest.mark.parametrize("int8_state", [True, False])
@pytest.mark.parametrize("lanes", [0, 16, 4, 1])
@pytest.mark.parametrize("batch,dim,dt_rank,offset", FOLDED_SHAPES)
def test_small_qsscan_update_folded_dt_proj_is_the_chain(batch, dim, dt_rank, offset, lanes,
                                                         int8_state, method):
    """dt_proj folded into each layout of the step against w8a8_linear (int8 out) then the same
    layout's step, both on the GPU: y and the state bit for bit (dt_low read in 16-byte pieces
    where dt_rank is a multiple of 16 and its rows aligned, else code by code; the one-lane
    layout's tiles of 4 rows, and of 8 from batch 8, partial at batch 11)."""
    seed_for("folded-dt", batch, dim, dt_rank, offset, lanes, int8_state, method)
    case = folded_dt_case(batch, dim, dt_rank, offset)
    state = (codes(batch, dim, D_STATE) if int8_state
             else torch.randn(batch, dim, D_STATE, device=DEVICE))
    folded_state = state.clone()
    dt = w8a8_linear(case["dt_low"], SCALES["B_scale"], case["weight"], case["weight_scale"],
                     SCALES["dt_scale"], backend_name="cuda")
    y = step_raw(state, case, dt, method, lanes)
    prime_allocator((batch * dim, torch.float16))
    y_folded = step_raw(folded_state, case, case["dt_low"], method, lanes,
                        dt_proj=case["weight"], dt_multiplier=case["projection"].multiplier)
    assert torch.equal(y_folded.view(torch.int16), y.view(torch.int16))
    assert torch.equal(folded_state, state)


@pytest.mark.parametrize("batch,dim,dt_rank,offset", FOLDED_SHAPES[:4])
def test_small_qsscan_update_folded_dt_proj_matches_reference(batch, dim, dt_rank, offset):
    """The op with dt_proj on the GPU against its torch reference: codes within one step."""
    seed_for("folded-dt-reference", batch, dim, dt_rank, offset)
    case = folded_dt_case(batch, dim, dt_rank, offset)
    state_ref = codes(batch, dim, D_STATE)
    state = state_ref.clone()
    s = SCALES
    outputs = []
    for stepped, backend_name in ((state, "cuda"), (state_ref, "torch")):
        outputs.append(qsscan_update(
            stepped, 0.05, case["u"], s["u_scale"], case["dt_low"], s["dt_scale"], case["B"],
            s["B_scale"], case["C"], s["C_scale"], case["z"], s["z_scale"], case["params"],
            backend_name=backend_name, dt_proj=case["projection"]))
    assert_close_to(*outputs)
    assert_codes_close(state, state_ref)


def test_small_qsscan_update_folded_dt_proj_rejects_bad_inputs():
    case = folded_dt_case(2, 64, 8)
    state = torch.zeros(2, 64, D_STATE, device=DEVICE)
    projection = dict(dt_proj=case["weight"], dt_multiplier=case["projection"].multiplier)
    with pytest.raises(RuntimeError, match=r"dt \(dt_low's codes, with dt_proj\) must have shape "
                                           r"\[2, 8\], got \[2, 64\]"):
        step_raw(state, case, case["u"], **projection)
    with pytest.raises(RuntimeError, match=r"dt_proj must be \[dim, dt_rank\] = \[64, dt_rank\]"):
        step_raw(state, case, case["dt_low"], dt_proj=case["weight"][:32],
                 dt_multiplier=projection["dt_multiplier"])
    wide = codes(64, 2048)
    with pytest.raises(RuntimeError, match=r"dt_proj: dt_rank must be in 1..1024, got 2048"):
        step_raw(state, case, codes(2, 2048), dt_proj=wide, dt_multiplier=1e-3)
    with pytest.raises(RuntimeError, match=r"dt_multiplier must be a positive finite scale"):
        step_raw(state, case, case["dt_low"], dt_proj=case["weight"], dt_multiplier=float("nan"))


# ---- discretizations -------------------------------------------------------------------------
# The methods other than zoh (zoh is every test above), with the same contract: QSScan computes
# their coefficients in fp32 with ex2.approx / rcp.approx (within a few ulps of the reference's),
# the decode step operation by operation as the reference does (expf, expm1f, IEEE divisions;
# only zoh's decay takes ex2.approx).

OTHER_METHODS = [m for m in METHODS if m != DEFAULT]
DISCRETIZED_SHAPES = [(1, 5120, 1024), (2, 1536, 1), (3, 2560, 17), (8, 48, 4096),
                      (4, 1536, 257), (2, 3072, 255), (1, 40, 1000)]


@pytest.mark.parametrize("layout", ["module", "contiguous"])
@pytest.mark.parametrize("batch,dim,seqlen", DISCRETIZED_SHAPES)
@pytest.mark.parametrize("method", OTHER_METHODS)
def test_qsscan_discretization_matches_reference(method, batch, dim, seqlen, layout):
    seed_for("scan-method", method, batch, dim, seqlen, layout)
    check_scan(batch, dim, seqlen, layout, method=method)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("int8_state", [True, False])
@pytest.mark.parametrize("with_z", [True, False])
@pytest.mark.parametrize("layout", ["module", "contiguous"])
@pytest.mark.parametrize("method", OTHER_METHODS)
def test_small_qsscan_discretization_every_variant(method, out_dtype, int8_state, with_z, layout):
    seed_for("scan-method-variants", method, out_dtype, int8_state, with_z, layout)
    check_scan(2, 72, 300, layout, out_dtype, int8_state, with_z=with_z, method=method)


@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("method", OTHER_METHODS)
def test_small_qsscan_discretization_float_inputs(method, in_dtype):
    seed_for("scan-method-float", method, in_dtype)
    check_scan(2, 136, 333, "module", torch.float32, False, in_dtype, method=method)


@pytest.mark.parametrize("config", range(SCAN_CONFIGS))
@pytest.mark.parametrize("method", OTHER_METHODS)
def test_small_qsscan_discretization_every_config(method, config):
    """Every launch configuration, on a shape staged in 16-byte vectors, for every method."""
    from quamba.ops.scan.cuda import qsscan_op_args

    seed_for("scan-method-config", method, config)
    inputs, params = scan_inputs(3, 208, 704, "module"), ssm_params(208)
    y_ref, h_ref = run_scan(inputs, params, None, torch.float16, "torch", method)
    s = scales_for(method)
    args = qsscan_op_args(inputs["u"], s["u_scale"], inputs["dt"], s["dt_scale"], inputs["B"],
                          s["B_scale"], inputs["C"], s["C_scale"], inputs["z"], s["z_scale"],
                          params, None, torch.float16)
    y, h = torch.ops.quamba.qsscan(*args, config, method)
    assert_close_to(y, y_ref)
    assert_close_to(h, h_ref)


def fresh_drive(method, batch, dim):
    """foh's drive before a sequence's first step (zeros); None for the other methods."""
    return torch.zeros(batch, dim, D_STATE, device=DEVICE) if method == "foh" else None


@pytest.mark.parametrize("batch,dim", [(1, 5120), (8, 1536), (3, 40)])
@pytest.mark.parametrize("method", OTHER_METHODS)
def test_small_qsscan_update_discretization_chain_equals_prefill(method, batch, dim):
    """fp32 state: 64 chained decode steps from the zero state give the prefill's y and last
    state (foh: and the prefill's last drive); so do 24 steps continuing a 40-step prefill from
    its last state and drive."""
    seed_for("scan-method-chain", method, batch, dim)
    seqlen, split = 64, 40
    inputs, params = scan_inputs(batch, dim, seqlen, "module", method=method), ssm_params(dim)
    y_prefill, h_prefill = run_scan(inputs, params, None, torch.float32, "cuda", method)
    state, drive = torch.zeros(batch, dim, D_STATE, device=DEVICE), fresh_drive(method, batch, dim)
    for t in range(seqlen):
        y_t = run_step(state, None, step_inputs(inputs, t), params, torch.float32, "cuda", method,
                       drive)
        assert_close_to(y_t, y_prefill[:, :, t])
    assert_close_to(state, h_prefill)
    s = scales_for(method)
    if drive is not None:
        last_drive = qsscan_last_drive(inputs["u"], s["u_scale"], inputs["B"], s["B_scale"])
        assert torch.equal(drive, last_drive), "the drive is u ⊗ B, one fp32 product"

    head = {name: None if x is None else x[:, :, :split] for name, x in inputs.items()}
    _, state = run_scan(head, params, None, torch.float32, "cuda", method)
    drive = (qsscan_last_drive(head["u"], s["u_scale"], head["B"], s["B_scale"])
             if method == "foh" else None)
    for t in range(split, seqlen):
        y_t = run_step(state, None, step_inputs(inputs, t), params, torch.float32, "cuda", method,
                       drive)
        assert_close_to(y_t, y_prefill[:, :, t])
    assert_close_to(state, h_prefill)


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("batch,dim", [(1, 5120), (8, 1536), (3, 40)])
@pytest.mark.parametrize("method", OTHER_METHODS)
def test_small_qsscan_update_discretization_matches_reference(method, batch, dim, out_dtype):
    """int8 state: each of 32 chained steps matches the torch step taken from the same state and
    (foh) the same drive, which both backends overwrite with the same u ⊗ B."""
    seed_for("scan-method-step", method, batch, dim, out_dtype)
    seqlen = 32
    inputs, params = scan_inputs(batch, dim, seqlen, "module", method=method), ssm_params(dim)
    _, h_last = run_scan(inputs, params, None, torch.float32, "torch", method)
    state_scale = float(scale_from_range(float(h_last.abs().max())))
    state_ref = torch.zeros(batch, dim, D_STATE, dtype=torch.int8, device=DEVICE)
    drive_ref = fresh_drive(method, batch, dim)
    for t in range(seqlen):
        state = state_ref.clone()
        drive = None if drive_ref is None else drive_ref.clone()
        step = step_inputs(inputs, t)
        prime_allocator((batch * dim, out_dtype))
        y = run_step(state, state_scale, step, params, out_dtype, "cuda", method, drive)
        y_ref = run_step(state_ref, state_scale, step, params, out_dtype, "torch", method,
                         drive_ref)
        assert_close_to(y, y_ref)
        assert_codes_close(state, state_ref)
        if drive is not None:
            assert torch.equal(drive, drive_ref)


def test_small_qsscan_discretization_errors():
    from quamba.ops.scan.cuda import qsscan_op_args

    inputs, ssm = scan_inputs(1, 64, 8, "module"), ssm_params(64)
    s = SCALES
    args = qsscan_op_args(inputs["u"], s["u_scale"], inputs["dt"], s["dt_scale"], inputs["B"],
                          s["B_scale"], inputs["C"], s["C_scale"], inputs["z"], s["z_scale"], ssm,
                          None, torch.float16)
    with pytest.raises(RuntimeError, match="discretization must be one of zoh, zoh-exact"):
        torch.ops.quamba.qsscan(*args, discretization="euler")
    state, step = torch.zeros(1, 64, D_STATE, device=DEVICE), step_inputs(inputs, 0)
    step_args = (state, 1.0, step["u"], s["u_scale"], step["dt"], s["dt_scale"], step["B"],
                 s["B_scale"], step["C"], s["C_scale"], step["z"], s["z_scale"], ssm.A_log,
                 ssm.A_log_scale, ssm.D, ssm.D_scale, ssm.dt_bias, ssm.dt_bias_scale,
                 torch.float16)
    drive = torch.zeros(1, 64, D_STATE, device=DEVICE)
    with pytest.raises(RuntimeError, match="a foh decode step needs drive"):
        torch.ops.quamba.qsscan_update(*step_args, discretization="foh")
    with pytest.raises(RuntimeError, match="drive is carried by the foh discretization only"):
        torch.ops.quamba.qsscan_update(*step_args, drive=drive, discretization="rk4")
    with pytest.raises(RuntimeError, match="drive must have shape"):
        torch.ops.quamba.qsscan_update(*step_args, drive=drive[:, :32], discretization="foh")
    with pytest.raises(RuntimeError, match="drive must be Float"):
        torch.ops.quamba.qsscan_update(*step_args, drive=drive.half(), discretization="foh")


# ---- rmsnorm_quant ---------------------------------------------------------------------------

# Rows of a multiple of 8 values up to 8192 take the kernel that holds a row in registers; (3, 100)
# and (2, 8200) the one for any row.
NORM_CASES = [((1, 384), torch.float16), ((7, 768), torch.bfloat16),
              ((2048, 2560), torch.float16), ((3, 5, 1536), torch.float32),
              ((1, 1, 5120), torch.float16), ((33, 40), torch.float32),
              ((3, 100), torch.float16), ((2, 8192), torch.bfloat16), ((2, 8200), torch.float32)]


@pytest.mark.parametrize("residual_kind", ["none", "same", "fp32"])
@pytest.mark.parametrize("with_weight", [True, False])
@pytest.mark.parametrize("residual_in_fp32", [True, False])
@pytest.mark.parametrize("shape,dtype", NORM_CASES, ids=str)
def test_rmsnorm_quant_matches_reference(shape, dtype, residual_kind, with_weight,
                                         residual_in_fp32):
    seed_for("norm", shape, dtype, residual_kind, with_weight, residual_in_fp32)
    x = torch.randn(shape, device=DEVICE).to(dtype)
    residual = {"none": None, "same": torch.randn(shape, device=DEVICE).to(dtype),
                "fp32": torch.randn(shape, device=DEVICE)}[residual_kind]
    weight = (1 + 0.1 * torch.randn(shape[-1], device=DEVICE)).to(dtype) if with_weight else None
    args = (x, residual, weight, 1e-5, 4.0 / 127, residual_in_fp32)
    numel = x.numel()
    prime_allocator((numel, torch.int8), (numel, torch.float32 if residual_in_fp32 else dtype))
    q, r = rmsnorm_quant(*args, backend_name="cuda")
    q_ref, r_ref = rmsnorm_quant(*args, backend_name="torch")
    assert_codes_close(q, q_ref)
    assert r.dtype == r_ref.dtype and torch.equal(r, r_ref), "the residual sum is exact"


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_small_rmsnorm_quant_unaligned_rows(dtype):
    """x, residual and weight one element past an aligned address: the kernel for any row."""
    seed_for("norm-unaligned", dtype)
    x, residual = (torch.randn(1 + 5 * 768, device=DEVICE).to(dtype)[1:].view(5, 768)
                   for _ in range(2))
    weight = (1 + 0.1 * torch.randn(769, device=DEVICE)).to(dtype)[1:]
    args = (x, residual, weight, 1e-5, 4.0 / 127, True)
    q, r = rmsnorm_quant(*args, backend_name="cuda")
    q_ref, r_ref = rmsnorm_quant(*args, backend_name="torch")
    assert_codes_close(q, q_ref)
    assert torch.equal(r, r_ref)


def test_small_rmsnorm_quant_non_contiguous_input():
    seed_for("norm-view")
    x = torch.randn(6, 2 * 384, device=DEVICE)[:, ::2]
    q, r = rmsnorm_quant(x, None, None, 1e-5, 0.03, backend_name="cuda")
    q_ref, r_ref = rmsnorm_quant(x, None, None, 1e-5, 0.03, backend_name="torch")
    assert_codes_close(q, q_ref)
    assert torch.equal(r, r_ref)


# ---- hadamard_quant --------------------------------------------------------------------------

HADAMARD_SIZES = [1, 2, 12, 20, 28, 40, 64, 112, 384, 1536, 1792, 2048, 2560, 3072, 4096, 5120,
                  8192]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("n", HADAMARD_SIZES)
def test_hadamard_quant_matches_reference(n, rows, dtype):
    seed_for("hadamard", n, rows, dtype)
    x = torch.randn(rows, n, device=DEVICE).to(dtype)
    out_scale = 4.0 / 127
    prime_allocator((x.numel(), torch.int8))
    q = hadamard_quant(x, out_scale, backend_name="cuda")
    assert_codes_close(q, hadamard_quant(x, out_scale, backend_name="torch"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("n", [1536, 5120])
def test_small_hadamard_quant_unaligned_rows(n, dtype):
    """x starting one element into its storage: the kernel cannot use its wide loads."""
    seed_for("hadamard-unaligned", n, dtype)
    x = torch.randn(3 * n + 1, device=DEVICE).to(dtype)[1:].view(3, n)
    assert x.is_contiguous() and x.data_ptr() % 16 != 0
    q = hadamard_quant(x, 4.0 / 127, backend_name="cuda")
    assert_codes_close(q, hadamard_quant(x, 4.0 / 127, backend_name="torch"))


def test_small_hadamard_quant_batched_rows():
    seed_for("hadamard-3d")
    x = torch.randn(2, 7, 384, device=DEVICE, dtype=torch.float16)
    q = hadamard_quant(x, 0.03, backend_name="cuda")
    assert q.shape == x.shape
    assert_codes_close(q, hadamard_quant(x, 0.03, backend_name="torch"))


def test_small_hadamard_quant_rejects_other_sign_matrices():
    """The kernel has S_m built in; masks of any other matrix are refused, not ignored."""
    from quamba.ops.norm.cuda import _hadamard_plan
    m, p, masks, norm = _hadamard_plan(20 * 16)
    x = torch.randn(2, m * p, device=DEVICE, dtype=torch.float16)
    torch.ops.quamba.hadamard_quant(x, m, p, masks, norm, 10.0)
    with pytest.raises(RuntimeError, match="sign_columns must be the column masks of S_m"):
        torch.ops.quamba.hadamard_quant(x, m, p, [masks[1]] + masks[1:], norm, 10.0)


# Mamba2's gated RMSNorm before the transform (one kernel): (n, group_size) of Mamba2 sizes, one
# group (the published small models) and several (8: Codestral's, Mamba2-8B's and Nemotron-H-8B's
# 8192 in groups of 1024), odd and power-of-two transforms.
GATED_SIZES = [(5120, 5120), (5120, 640), (8192, 1024), (1536, 1536), (2560, 320), (4096, 4096),
               (896, 896), (40, 40), (40, 20)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("rows", [1, 3, 300])
@pytest.mark.parametrize("n,group_size", GATED_SIZES)
def test_gated_norm_hadamard_quant_matches_the_chain(n, group_size, rows, dtype):
    """Against the torch chain gated_rms_norm → hadamard_quant, z a slice of wider int8 rows (as
    in_proj's output; one byte in, the kernel cannot use its wide loads), with and without a norm
    weight: codes within one step."""
    seed_for("gated-hadamard", n, group_size, rows, dtype)
    y = torch.randn(rows, n, device=DEVICE).to(dtype)
    wide_rows = codes(rows, n + 48)
    cases = [(wide_rows[:, 16:16 + n], None), (wide_rows[:, 16:16 + n], torch.rand(n, device=DEVICE) + 0.5),
             (wide_rows[:, 1:1 + n], None)]
    for z, weight in cases:
        args = (y, z, 0.03, weight, group_size, 1e-5, 0.02)
        prime_allocator((y.numel(), torch.int8))
        q = gated_norm_hadamard_quant(*args, backend_name="cuda")
        assert_codes_close(q, gated_norm_hadamard_quant(*args, backend_name="torch"))


def test_small_gated_norm_hadamard_quant_batched_rows_and_checks():
    """[batch, seqlen, n] rows (a prefill's); z whose rows have no one stride and a float z are
    refused with the argument named, too many groups for the kernel with its limit."""
    seed_for("gated-hadamard-3d")
    y = torch.randn(2, 5, 1536, device=DEVICE, dtype=torch.float16)
    z = codes(2, 5, 1600)[..., :1536]
    args = (0.03, None, 768, 1e-5, 0.02)
    q = gated_norm_hadamard_quant(y, z, *args, backend_name="cuda")
    assert q.shape == y.shape
    assert_codes_close(q, gated_norm_hadamard_quant(y, z, *args, backend_name="torch"))
    with pytest.raises(RuntimeError, match="z: its leading dimensions"):
        gated_norm_hadamard_quant(y, codes(5, 2, 1536).transpose(0, 1), *args, backend_name="cuda")
    with pytest.raises(ValueError, match="z must be int8"):
        gated_norm_hadamard_quant(y, z.half(), *args, backend_name="cuda")
    with pytest.raises(backend.BackendError, match="up to 64 groups, not 96"):
        gated_norm_hadamard_quant(y, z, 0.03, None, 16, 1e-5, 0.02, backend_name="cuda")


# ---- input checks ----------------------------------------------------------------------------

def test_small_errors_name_the_argument():
    params = conv_params(64, 4, with_bias=True)
    x = codes(1, 64, 8)
    with pytest.raises(RuntimeError, match="x must be"):
        run_conv(x.float(), params, 0.05, "silu", "cuda")
    with pytest.raises(backend.BackendError, match=r"conv widths \(2, 3, 4\), not 5"):
        run_conv(x, dict(params, weight=codes(64, 5)), 0.05, "silu", "cuda")
    with pytest.raises(RuntimeError, match="bias"):
        run_conv(x, dict(params, bias=codes(63)), 0.05, "silu", "cuda")
    with pytest.raises(RuntimeError, match="conv_state"):
        conv_step(x[:, :, 0], codes(1, 3, 64).transpose(1, 2), params, 0.05, "cuda")

    inputs, ssm = scan_inputs(1, 64, 8, "module"), ssm_params(64)
    with pytest.raises(RuntimeError, match="B must have shape"):
        run_scan(dict(inputs, B=inputs["B"][:, :8]), ssm, None, torch.float16, "cuda")
    with pytest.raises(RuntimeError, match="dt must be a CUDA tensor"):
        run_scan(dict(inputs, dt=inputs["dt"].cpu()), ssm, None, torch.float16, "cuda")
    with pytest.raises(RuntimeError, match="A_log"):
        bad = SSMParams(ssm.A_log.float(), 1.0, ssm.D, 1.0, ssm.dt_bias, 1.0)
        run_scan(inputs, bad, None, torch.float16, "cuda")
    with pytest.raises(RuntimeError, match="out_dtype"):
        run_scan(inputs, ssm, None, torch.int8, "cuda")
    with pytest.raises(RuntimeError, match="config must be in"):
        from quamba.ops.scan.cuda import qsscan_op_args
        s = SCALES
        torch.ops.quamba.qsscan(*qsscan_op_args(
            inputs["u"], s["u_scale"], inputs["dt"], s["dt_scale"], inputs["B"], s["B_scale"],
            inputs["C"], s["C_scale"], inputs["z"], s["z_scale"], ssm, None, torch.float16),
            SCAN_CONFIGS)
    with pytest.raises(RuntimeError, match="state must be contiguous"):
        state = torch.zeros(1, D_STATE, 64, device=DEVICE).transpose(1, 2)
        run_step(state, None, step_inputs(inputs, 0), ssm, torch.float16, "cuda")

    with pytest.raises(RuntimeError, match="residual"):
        rmsnorm_quant(torch.randn(4, 64, device=DEVICE), torch.randn(4, 32, device=DEVICE), None,
                      1e-5, 0.03, backend_name="cuda")
    with pytest.raises(RuntimeError, match="x must be float16"):
        hadamard_quant(codes(4, 64), 0.03, backend_name="cuda")
