"""W8A8 GEMM/GEMV kernels of quamba._C against the torch reference of w8a8_linear.

Every kernel path is exercised on its own through its ``*_out`` op, with the output poisoned
first (-128 cannot come out of the int8 epilogue, NaN out of the float one), then the dispatching
op and the ``cuda`` backend of :func:`quamba.ops.linear.qlinear.w8a8_linear`. int8 outputs must
equal the reference exactly; float outputs within 1e-3 relative. Skipped without a GPU or the
extension. Tests whose names contain ``small`` are the subset scripts/gpu_check.sh runs under
compute-sanitizer.
"""
import zlib

import pytest
import torch

from quamba.ops import backend
from quamba.ops.linear.qlinear import int8_matmul, w8a8_linear
from quamba.ops.quant import requant_multiplier
from tests.ops.skinny_plans import SKINNY_MAX_STAGED_BYTES, skinny_staged_bytes

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if backend.cuda_extension_error() is not None:
    pytest.skip(backend.cuda_extension_error(), allow_module_level=True)

ops = torch.ops.quamba
DEVICE = torch.device("cuda")

# (N, K) of the Mamba linears: in_proj, out_proj, x_proj (dt_rank + 2 * d_state), dt_proj.
MAMBA_2_8B = [(10240, 2560), (2560, 5120), (192, 5120), (5120, 160)]
MAMBA_130M = [(3072, 768), (768, 1536), (80, 1536), (1536, 48)]
SMALL_NK = [(80, 48), (192, 160)]
DECODE_M = [1, 2, 3, 4, 5, 6, 7, 8]
PREFILL_M = [9, 17, 64, 100, 1000, 2048, 4096]
SMALL_M = [1, 3, 17, 130]
OUT_DTYPES = [torch.int8, torch.float16, torch.bfloat16]

SM90_CONFIGS = ops.w8a8_gemm_sm90_configs()
IS_SM90 = torch.cuda.get_device_capability() == (9, 0)
HAS_CLUSTERS = torch.cuda.get_device_capability() >= (9, 0)
SKINNY_M = [9, 16, 17, 31, 32, 33, 48, 63, 64]


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)


def seed_for(*params) -> None:
    """Fresh inputs for every case, reproducible from its parameters."""
    torch.manual_seed(zlib.crc32(repr(params).encode()))


def random_codes(rows, cols):
    return torch.randint(-127, 128, (rows, cols), dtype=torch.int8, device=DEVICE)


def typical_multiplier(K) -> float:
    """Maps ~3 standard deviations of a random accumulator to 127: outputs span the int8 range and
    the largest ones saturate."""
    acc_std = (K ** 0.5) * 127 * 127 / 3
    return float(torch.tensor(127 / (3 * acc_std), dtype=torch.float32))


def make_case(M, N, K, out_dtype, per_channel=False, with_bias=False):
    x, w = random_codes(M, K), random_codes(N, K)
    x_scale, out_scale = 0.05, 0.05
    base = typical_multiplier(K) * out_scale / x_scale  # weight scale giving that multiplier
    w_scale = base * (0.5 + torch.rand(N)) if per_channel else base
    int8_out = out_dtype == torch.int8
    bias = torch.randn(N, device=DEVICE) if with_bias and not int8_out else None
    return dict(x=x, x_scale=x_scale, weight=w, weight_scale=w_scale,
                out_scale=out_scale if int8_out else None, bias=bias, out_dtype=out_dtype)


def reference(case):
    return w8a8_linear(case["x"], case["x_scale"], case["weight"], case["weight_scale"], case["out_scale"],
                       bias=case["bias"], out_dtype=case["out_dtype"], backend_name="torch")


def op_arguments(case):
    """(x, weight, multiplier, multiplier_per_channel, bias) as the *_out ops take them."""
    multiplier = requant_multiplier(case["x_scale"], case["weight_scale"], case["out_scale"])
    if isinstance(multiplier, torch.Tensor):
        return case["x"], case["weight"], 0.0, multiplier.to(DEVICE).contiguous(), case["bias"]
    return case["x"], case["weight"], float(multiplier), None, case["bias"]


def poisoned_out(M, N, dtype):
    fill = -128 if dtype == torch.int8 else float("nan")
    return torch.full((M, N), fill, dtype=dtype, device=DEVICE)


def assert_matches(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.int8:
        assert int(out.min()) >= -127, "unwritten (-128) or out-of-range int8 output"
        mismatches = int((out != ref).sum())
        assert mismatches == 0, f"{mismatches} of {out.numel()} int8 outputs differ from the reference"
    else:
        assert not out.isnan().any(), "unwritten (NaN) float output"
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-3, atol=1e-3 * float(ref.float().abs().max()))


def run_gemv(case, out, rows=0, splits=0):
    ops.w8a8_gemv_out(*op_arguments(case), out, rows, splits)


def run_skinny(case, out, warp_tiles=0, splits=0, x_rows=0):
    ops.w8a8_gemm_skinny_out(*op_arguments(case), out, warp_tiles, splits, x_rows)


def run_mma(case, out):
    ops.w8a8_gemm_mma_out(*op_arguments(case), out)


def run_sm90(case, out, config=-1):
    ops.w8a8_gemm_sm90_out(*op_arguments(case), out, config)


def check_path(run, M, N, K, out_dtype, **options):
    case = make_case(M, N, K, out_dtype, **options)
    out = poisoned_out(M, N, out_dtype)
    run(case, out)
    assert_matches(out, reference(case))


needs_sm90 = pytest.mark.skipif(not (IS_SM90 and SM90_CONFIGS), reason="needs the sm_90a build on a 9.0 GPU")
needs_clusters = pytest.mark.skipif(not HAS_CLUSTERS, reason="needs thread-block clusters (compute capability 9.0)")


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("N,K", MAMBA_2_8B + MAMBA_130M)
@pytest.mark.parametrize("M", DECODE_M)
def test_gemv_matches_reference(M, N, K, out_dtype):
    seed_for("gemv", M, N, K, out_dtype)
    check_path(run_gemv, M, N, K, out_dtype)


@pytest.mark.parametrize("splits", [1, 2, 4])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
@pytest.mark.parametrize("M", [1, 3, 5, 8])
@pytest.mark.parametrize("N,K", [(192, 5120), (2560, 5120), (80, 1536), (1536, 48), (36, 32), (100, 80)])
def test_gemv_every_work_split(M, N, K, rows, splits):
    seed_for("gemv-splits", M, N, K, rows, splits)
    check_path(lambda case, out: run_gemv(case, out, rows, splits), M, N, K, torch.int8)


@pytest.mark.parametrize("out_dtype", OUT_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("N,K", MAMBA_2_8B + MAMBA_130M)
@pytest.mark.parametrize("M", [1, 3, 17, 100, 1000, 2048])
def test_gemm_mma_matches_reference(M, N, K, out_dtype):
    seed_for("mma", M, N, K, out_dtype)
    check_path(run_mma, M, N, K, out_dtype)


@needs_sm90
@pytest.mark.parametrize("config", range(SM90_CONFIGS))
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("N,K", MAMBA_2_8B + MAMBA_130M)
@pytest.mark.parametrize("M", [9, 32, 64, 100, 1000, 2048, 4096])
def test_gemm_sm90_matches_reference(M, N, K, out_dtype, config):
    seed_for("sm90", M, N, K, out_dtype, config)
    check_path(lambda case, out: run_sm90(case, out, config), M, N, K, out_dtype)


@needs_sm90
@pytest.mark.parametrize("config", range(SM90_CONFIGS))
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("M", [17, 64, 1000])
def test_gemm_sm90_per_channel_multiplier_and_bias(M, out_dtype, config):
    """The epilogue's per-channel vectors, a row of D where a configuration computes w · x^T."""
    seed_for("sm90-per-channel", M, out_dtype, config)
    check_path(lambda case, out: run_sm90(case, out, config), M, 2560, 5120, out_dtype,
               per_channel=True, with_bias=out_dtype != torch.int8)


@needs_clusters
@pytest.mark.parametrize("out_dtype", OUT_DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("N,K", MAMBA_2_8B + MAMBA_130M)
@pytest.mark.parametrize("M", SKINNY_M + [1, 8])
def test_gemm_skinny_matches_reference(M, N, K, out_dtype):
    seed_for("skinny", M, N, K, out_dtype)
    check_path(run_skinny, M, N, K, out_dtype, per_channel=True, with_bias=out_dtype != torch.int8)


@needs_clusters
@pytest.mark.parametrize("x_rows", [16, 32, 64])
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("warp_tiles", [1, 2])
@pytest.mark.parametrize("M", [9, 33, 64])
@pytest.mark.parametrize("N,K", [(192, 5120), (2560, 2048), (100, 80), (36, 1040), (1536, 48)])
def test_gemm_skinny_every_plan(M, N, K, warp_tiles, splits, x_rows):
    """Every tile width, cluster size and block height of x, where K splits unevenly (the last
    range shorter, or fewer ranges than asked), where N is not a multiple of the block's rows and
    where x's rows fill the last block partly (9 or 33 rows in blocks of 16 or 32) or fill fewer
    blocks than their height. A plan whose K range of x does not fit in shared memory is refused
    with the sizes."""
    seed_for("skinny plans", M, N, K, warp_tiles, splits, x_rows)

    def run(case, out):
        run_skinny(case, out, warp_tiles, splits, x_rows)

    if skinny_staged_bytes(x_rows, K, splits) > SKINNY_MAX_STAGED_BYTES:
        with pytest.raises(RuntimeError, match=f"K = {K} in .* splits stages .* bytes of x, more than"):
            check_path(run, M, N, K, torch.int8)
    else:
        check_path(run, M, N, K, torch.int8)


@needs_clusters
@pytest.mark.parametrize("N,K,extra", [(5120, 160, 32), (1536, 48, 32), (80, 48, 16)])
@pytest.mark.parametrize("M", [9, 40, 64])
def test_gemm_skinny_reads_strided_rows_in_place(M, N, K, extra):
    seed_for("skinny strided", M, N, K, extra)
    case = make_case(M, N, K, torch.int8)
    x, weight, multiplier, per_channel, bias = op_arguments(case)
    out = poisoned_out(M, N, torch.int8)
    ops.w8a8_gemm_skinny_out(column_slice(x, extra), weight, multiplier, per_channel, bias, out, 0, 0)
    assert_matches(out, reference(case))


@needs_sm90
@pytest.mark.parametrize("config", range(SM90_CONFIGS))
@pytest.mark.parametrize("M", [17, 64, 300])
def test_gemm_sm90_reads_strided_rows_in_place(M, config):
    """x's rows at their stride (TMA's), dt_low-like: 160 codes of rows 192 bytes apart."""
    seed_for("sm90 strided", M, config)
    case = make_case(M, 5120, 160, torch.int8, per_channel=True)
    x, weight, multiplier, per_channel, bias = op_arguments(case)
    out = poisoned_out(M, 5120, torch.int8)
    ops.w8a8_gemm_sm90_out(column_slice(x, 32), weight, multiplier, per_channel, bias, out, config)
    assert_matches(out, reference(case))


def every_path():
    paths = [("gemv", run_gemv), ("mma", run_mma)]
    if HAS_CLUSTERS:
        paths.append(("skinny", run_skinny))
    if IS_SM90 and SM90_CONFIGS:
        paths.append(("sm90", run_sm90))
    return paths


@pytest.mark.parametrize("name,run", every_path(), ids=[p[0] for p in every_path()])
@pytest.mark.parametrize("per_channel,with_bias", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("N,K", SMALL_NK)
@pytest.mark.parametrize("M", SMALL_M)
def test_small_shapes_every_path(M, N, K, out_dtype, per_channel, with_bias, name, run):
    if (name == "gemv" and M > 8) or (name == "skinny" and M > 64):
        pytest.skip(f"the {name} kernel takes at most {8 if name == 'gemv' else 64} rows")
    seed_for("small", M, N, K, out_dtype, per_channel, with_bias, name)
    check_path(run, M, N, K, out_dtype, per_channel=per_channel, with_bias=with_bias)


@pytest.mark.parametrize("name,run", every_path(), ids=[p[0] for p in every_path()])
def test_small_int8_rounds_half_to_even(name, run):
    """A multiplier of 0.5 puts every odd accumulator on a tie: rne(2.5) = 2, rne(3.5) = 4."""
    seed_for("ties", name)
    M, N, K = 4, 64, 32
    x = torch.randint(-1, 2, (M, K), dtype=torch.int8, device=DEVICE)
    w = torch.randint(-3, 4, (N, K), dtype=torch.int8, device=DEVICE)
    case = dict(x=x, x_scale=1.0, weight=w, weight_scale=1.0, out_scale=2.0, bias=None, out_dtype=torch.int8)
    out = poisoned_out(M, N, torch.int8)
    run(case, out)
    acc = int8_matmul(x, w)
    assert bool((acc % 2 == 1).any()), "the case must contain ties"
    assert torch.equal(out, torch.round(acc.float() * 0.5).to(torch.int8))
    assert_matches(out, reference(case))


@pytest.mark.parametrize("name,run", every_path(), ids=[p[0] for p in every_path()])
@pytest.mark.parametrize("out_dtype", [torch.int8, torch.float16], ids=str)
def test_extreme_codes_beyond_exact_fp32_integers(name, run, out_dtype):
    """Weight rows equal to x's first row up to a growing share of flipped signs put that row's
    accumulators at 127² · (K - 2 · flips), up to 1.65e8 > 2²⁴, where int32 → fp32 rounds."""
    seed_for("extreme", name, out_dtype)
    M, N, K = 8 if name == "gemv" else 64, 128, 10240
    x = (torch.randint(0, 2, (M, K), device=DEVICE) * 254 - 127).to(torch.int8)
    flip = torch.rand(N, K, device=DEVICE) < torch.linspace(0, 1, N, device=DEVICE)[:, None]
    w = torch.where(flip, -x[0].int(), x[0].int()).to(torch.int8)
    full_scale = 127 * 127 * K  # the largest accumulator maps to 127 (int8) or 1 (float16)
    case = dict(x=x, x_scale=1.0, weight=w, weight_scale=1.0 / full_scale,
                out_scale=1.0 / 127 if out_dtype == torch.int8 else None, bias=None, out_dtype=out_dtype)
    out = poisoned_out(M, N, out_dtype)
    run(case, out)
    assert_matches(out, reference(case))


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("M", [1, 7, 8, 9, 64, 1000])
def test_w8a8_linear_cuda_backend_matches_torch(M, out_dtype):
    """The public op on the cuda backend: 3-D input, per-channel weight scale, a view for x."""
    seed_for("backend", M, out_dtype)
    N, K = 192, 5120
    case = make_case(M, N, K, out_dtype, per_channel=True, with_bias=True)
    wide = random_codes(M, 2 * K)
    wide[:, :K] = case["x"]
    x_view = wide[:, :K].reshape(1, M, K)  # not contiguous, as dt_low sliced from x_proj's output
    out = w8a8_linear(x_view, case["x_scale"], case["weight"], case["weight_scale"], case["out_scale"],
                      bias=case["bias"], out_dtype=out_dtype, backend_name="cuda")
    assert out.shape == (1, M, N)
    assert_matches(out.reshape(M, N), reference(case))


def column_slice(x, extra):
    """x's values as the first columns of a wider tensor (rows K + extra bytes apart), as dt_low is
    sliced from x_proj's output."""
    wide = random_codes(x.shape[0], x.shape[1] + extra)
    wide[:, :x.shape[1]] = x
    return wide[:, :x.shape[1]]


@pytest.mark.parametrize("rows", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("N,K,extra", [(5120, 160, 32), (1536, 48, 32), (80, 48, 16)])
@pytest.mark.parametrize("M", DECODE_M)
def test_gemv_reads_strided_rows_in_place(M, N, K, extra, rows):
    """The GEMV reads x through its row stride (dt_low at batch > 1): the same int8 outputs as on
    packed rows, for every row group size."""
    seed_for("gemv strided", M, N, K, extra, rows)
    case = make_case(M, N, K, torch.int8)
    x, weight, multiplier, per_channel, bias = op_arguments(case)
    out = poisoned_out(M, N, torch.int8)
    ops.w8a8_gemv_out(column_slice(x, extra), weight, multiplier, per_channel, bias, out, rows, 0)
    assert_matches(out, reference(case))


@pytest.mark.parametrize("splits", [1, 2])
@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("M,K", [(4, 160), (5, 8192), (5, 8208), (8, 5120), (8, 5136)])
def test_gemv_both_sides_of_the_staging_limit(M, K, rows, splits):
    """With one split of K and M >= 5 the GEMV copies x to shared memory where its M * K bytes fit
    40 KB, else it reads x from L2: both match the reference, on packed and on strided rows."""
    seed_for("gemv staging", M, K, rows, splits)
    case = make_case(M, 100, K, torch.int8)
    x, weight, multiplier, per_channel, bias = op_arguments(case)
    for x_rows in (x, column_slice(x, 48)):
        out = poisoned_out(M, 100, torch.int8)
        ops.w8a8_gemv_out(x_rows, weight, multiplier, per_channel, bias, out, rows, splits)
        assert_matches(out, reference(case))


@pytest.mark.parametrize("M", [1, 8, 9, 64, 100])
def test_small_w8a8_linear_op_takes_strided_rows(M):
    """The dispatching op on a column slice: the GEMV, the skinny and the sm90 GEMMs in place,
    mma.sync on a packed copy."""
    seed_for("linear strided", M)
    case = make_case(M, 1536, 48, torch.float16, per_channel=True, with_bias=True)
    x, weight, multiplier, per_channel, bias = op_arguments(case)
    out = poisoned_out(M, 1536, torch.float16)
    ops.w8a8_linear_out(column_slice(x, 32), weight, multiplier, per_channel, bias, out)
    assert_matches(out, reference(case))


@pytest.mark.parametrize("extra", [8, 32])
@pytest.mark.parametrize("M", [3, 20])
def test_w8a8_linear_cuda_backend_any_view(M, extra):
    """The backend passes a slice whose rows the kernels can read (32 extra bytes), and copies one
    they cannot (8: rows not 16-byte multiples apart) instead of failing."""
    seed_for("backend view", M, extra)
    case = make_case(M, 5120, 160, torch.int8)
    out = w8a8_linear(column_slice(case["x"], extra), case["x_scale"], case["weight"], case["weight_scale"],
                      case["out_scale"], backend_name="cuda")
    assert_matches(out, reference(case))


def test_small_w8a8_linear_cuda_backend_scalar_tensor_scale():
    seed_for("0-d scale")
    case = make_case(16, 80, 48, torch.int8)
    x_scale = torch.tensor(case["x_scale"], device=DEVICE)
    out = w8a8_linear(case["x"], x_scale, case["weight"], case["weight_scale"], case["out_scale"],
                      backend_name="cuda")
    assert_matches(out, reference(case))


def test_w8a8_linear_dispatch_picks_a_kernel_for_every_m():
    seed_for("dispatch")
    for M in [1, 8, 9, 16, 17, 32, 64, 65, 1000]:
        case = make_case(M, 2560, 5120, torch.float16)
        out = poisoned_out(M, 2560, torch.float16)
        ops.w8a8_linear_out(*op_arguments(case), out)
        assert_matches(out, reference(case))


@pytest.mark.parametrize("M", [4, 32, 64])
def test_small_gemm_feeds_the_next_kernel_back_to_back(M):
    """A decode GEMM (GEMV at 4 rows, CUTLASS's swapped tiles at 32 and 64 on sm_90, which let
    their dependents launch before the epilogue) followed by RMSNorm → int8, launched
    programmatically dependent on it, six pairs queued without a sync: the same codes as pairs
    waited for one by one, and the GEMM's output as the reference's."""
    seed_for("back-to-back", M)
    cases = [make_case(M, 2560, 5120, torch.float16) for _ in range(6)]
    outs = [poisoned_out(M, 2560, torch.float16) for _ in cases]

    def norm(out):
        return ops.rmsnorm_quant(out, None, None, 1e-5, 127 / 8.0, False)[0]

    queued = []
    for case, out in zip(cases, outs):
        ops.w8a8_linear_out(*op_arguments(case), out)
        queued.append(norm(out))
    for case, out, codes in zip(cases, outs, queued):
        torch.cuda.synchronize()
        assert_matches(out, reference(case))
        assert torch.equal(codes, norm(out))


@pytest.mark.parametrize("M", [1, 8, 32, 100, 1024])
def test_w8a8_linear_replays_in_a_cuda_graph(M):
    """Decode runs under CUDA graphs: the ops must capture, and replay on new inputs."""
    seed_for("graph", M)
    case = make_case(M, 2560, 5120, torch.float16, per_channel=True, with_bias=True)
    x, weight, multiplier, per_channel, bias = op_arguments(case)
    out = poisoned_out(M, 2560, torch.float16)
    ops.w8a8_linear_out(x, weight, multiplier, per_channel, bias, out)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.w8a8_linear_out(x, weight, multiplier, per_channel, bias, out)
    fresh = random_codes(M, 5120)
    x.copy_(fresh)
    out.fill_(float("nan"))
    graph.replay()
    case["x"] = fresh
    assert_matches(out, reference(case))


# ---- input checks: RuntimeError naming the argument ----

def valid_arguments(M=4, N=32, K=64):
    x, w = random_codes(M, K), random_codes(N, K)
    return dict(x=x, weight=w, multiplier=1e-4, multiplier_per_channel=None, bias=None,
                out=torch.empty(M, N, dtype=torch.float16, device=DEVICE))


def call(op, a):
    op(a["x"], a["weight"], a["multiplier"], a["multiplier_per_channel"], a["bias"], a["out"])


def misaligned(rows, cols):
    storage = random_codes(1, rows * cols + 16).reshape(-1)
    return storage[1:1 + rows * cols].view(rows, cols)


BAD_ARGUMENTS = {
    "x float": (lambda a: a.update(x=a["x"].float()), "x must be int8"),
    "x on cpu": (lambda a: a.update(x=a["x"].cpu()), "x must be a CUDA tensor"),
    "x 1-D": (lambda a: a.update(x=a["x"].reshape(-1)), "x must be 2-D"),
    "x transposed": (lambda a: a.update(x=random_codes(64, 4).t()),
                     "x must (be contiguous|have contiguous rows that start a multiple of 16 bytes apart)"),
    "x rows 72 bytes apart": (lambda a: a.update(x=random_codes(4, 72)[:, :64]),
                              "x must (be contiguous|have contiguous rows that start a multiple of 16 bytes apart)"),
    "x misaligned": (lambda a: a.update(x=misaligned(4, 64)), "x must start at a 16-byte aligned address"),
    "K not multiple of 16": (lambda a: a.update(x=random_codes(4, 40), weight=random_codes(32, 40)),
                             "x must have a last dimension that is a positive multiple of 16"),
    "weight int32": (lambda a: a.update(weight=a["weight"].int()), "weight must be int8"),
    "weight on cpu": (lambda a: a.update(weight=a["weight"].cpu()), "weight must be a CUDA tensor"),
    "weight wrong K": (lambda a: a.update(weight=random_codes(32, 128)), "weight must have shape"),
    "weight transposed": (lambda a: a.update(weight=random_codes(64, 32).t()), "weight must be contiguous"),
    "multiplier_per_channel wrong size": (lambda a: a.update(multiplier_per_channel=torch.ones(31, device=DEVICE)),
                                          "multiplier_per_channel must have shape"),
    "multiplier_per_channel float16": (
        lambda a: a.update(multiplier_per_channel=torch.ones(32, device=DEVICE, dtype=torch.float16)),
        "multiplier_per_channel must be float32"),
    "bias on cpu": (lambda a: a.update(bias=torch.ones(32)), "bias must be a CUDA tensor"),
    "bias with int8 out": (lambda a: a.update(bias=torch.ones(32, device=DEVICE),
                                              out=torch.empty(4, 32, dtype=torch.int8, device=DEVICE)),
                           "bias is only supported with a float out"),
    "out wrong shape": (lambda a: a.update(out=torch.empty(4, 31, dtype=torch.float16, device=DEVICE)),
                        "out must have shape"),
    "out int32": (lambda a: a.update(out=torch.empty(4, 32, dtype=torch.int32, device=DEVICE)),
                  "out must be int8, float16, bfloat16 or float32"),
}


@pytest.mark.parametrize("op_name", ["w8a8_linear_out", "w8a8_gemv_out", "w8a8_gemm_mma_out"]
                         + (["w8a8_gemm_skinny_out"] if HAS_CLUSTERS else []))
@pytest.mark.parametrize("bad", BAD_ARGUMENTS, ids=list(BAD_ARGUMENTS))
def test_bad_arguments_raise_naming_the_argument(bad, op_name):
    arguments = valid_arguments()
    spoil, message = BAD_ARGUMENTS[bad]
    spoil(arguments)
    with pytest.raises(RuntimeError, match=message):
        call(getattr(ops, op_name), arguments)


def test_gemv_rejects_more_than_8_rows():
    arguments = valid_arguments(M=9)
    with pytest.raises(RuntimeError, match="x must have 1 to 8 rows"):
        call(ops.w8a8_gemv_out, arguments)


def test_gemv_rejects_unknown_rows_and_splits():
    a = valid_arguments()
    with pytest.raises(RuntimeError, match="rows must be"):
        ops.w8a8_gemv_out(a["x"], a["weight"], a["multiplier"], None, None, a["out"], 3, 0)
    with pytest.raises(RuntimeError, match="splits must be"):
        ops.w8a8_gemv_out(a["x"], a["weight"], a["multiplier"], None, None, a["out"], 0, 3)


@needs_clusters
def test_skinny_rejects_more_than_64_rows_and_unknown_plans():
    with pytest.raises(RuntimeError, match="x of 1 to 64 rows"):
        call(ops.w8a8_gemm_skinny_out, valid_arguments(M=65))
    a = valid_arguments(M=20)
    with pytest.raises(RuntimeError, match="warp_tiles must be 1 to 2"):
        ops.w8a8_gemm_skinny_out(a["x"], a["weight"], a["multiplier"], None, None, a["out"], 3, 0)
    with pytest.raises(RuntimeError, match="splits must be 1 to 16"):
        ops.w8a8_gemm_skinny_out(a["x"], a["weight"], a["multiplier"], None, None, a["out"], 0, 17)
    with pytest.raises(RuntimeError, match=r"x_rows must be 16, 32 or 64 \(0: chosen\), got 48"):
        ops.w8a8_gemm_skinny_out(a["x"], a["weight"], a["multiplier"], None, None, a["out"], 0, 0, 48)


@needs_sm90
def test_sm90_rejects_unknown_config_and_unaligned_out():
    a = valid_arguments(M=64)
    with pytest.raises(RuntimeError, match="config must be in"):
        ops.w8a8_gemm_sm90_out(a["x"], a["weight"], a["multiplier"], None, None, a["out"], SM90_CONFIGS)
    odd = valid_arguments(M=64, N=36)
    odd["out"] = torch.empty(64, 36, dtype=torch.int8, device=DEVICE)  # 36-byte rows: not 16-byte aligned
    with pytest.raises(RuntimeError, match="rows are multiples of 16 bytes"):
        call(ops.w8a8_gemm_sm90_out, odd)


@pytest.mark.parametrize("N", [36, 50280])
def test_unaligned_n_falls_back_and_matches(N):
    """N whose output rows are not 16-byte multiples (the vocabulary, 50280) take the mma kernel."""
    seed_for("odd N", N)
    case = make_case(100, N, 768, torch.int8)
    out = poisoned_out(100, N, torch.int8)
    ops.w8a8_linear_out(*op_arguments(case), out)
    assert_matches(out, reference(case))
