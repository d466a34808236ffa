"""W4A8 / W4A16 kernels of quamba._C (csrc/gemm4) against the torch reference of
:func:`quamba.ops.linear.qlinear4.w4a8_linear` / :func:`~quamba.ops.qlinear4.w4a16_linear`.

Every path (GEMV in each work split, the expansion + W8A8 GEMM on mma.sync and on each CUTLASS
sm90 configuration, the dequantization + cuBLAS GEMM, the dispatching ops and the ``cuda``
backend) runs on fresh random inputs with its output poisoned first (-128 cannot come out of the
int8 epilogue, NaN out of the float ones). W4A8 outputs must equal the reference exactly, int8
and float alike (same int32 accumulator, same fp32 multiply, same rounding). W4A16 outputs agree
to 1e-3 of the largest output plus one rounding of the output dtype: the fp32 accumulation order
differs (the GEMV scales each group's partial sum). The GEMM path rounds code × scale to x's
dtype first (what cuBLAS, or any mixed-input GEMM, multiplies): exact-to-rounding in fp16, but up
to 2⁻⁹ per weight in bfloat16, which with short K (one group of 128) measured 5.6e-3 of the largest
output on the H100, hence 1e-2 for that path. Skipped without a
GPU or the extension. Tests whose names contain ``small`` suit compute-sanitizer.
"""
import zlib

import pytest
import torch

from quamba.errors import QuambaError
from quamba.ops import backend
from quamba.ops.linear.qlinear4 import w4a8_linear, w4a16_linear, w4a16_linear_channel_major
from quamba.ops.quant4 import dequantize_int4, pack_int4
from tests.ops.skinny_plans import SKINNY_MAX_STAGED_BYTES, skinny_staged_bytes

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
if backend.cuda_extension_error() is not None:
    pytest.skip(backend.cuda_extension_error(), allow_module_level=True)
if not hasattr(torch.ops.quamba, "w4a8_linear"):
    pytest.skip("quamba._C was built without the gemm4 kernel family", allow_module_level=True)

from quamba.ops.linear.cuda import _epilogue_multiplier  # noqa: E402
from quamba.ops.linear.cuda4 import W4A8OverflowError, check_expandable  # noqa: E402

ops = torch.ops.quamba
DEVICE = torch.device("cuda")

# (N, K, G): Mamba-2.8B in_proj, out_proj, x_proj with groups of 128; the test model's shapes
# (d_model 192: groups of 64); single groups (K <= 128); groups of 32 and of 160 (a step of the
# W4A16 GEMV then touches 4 and 2 groups).
MAMBA_2_8B = [(10240, 2560, 128), (2560, 5120, 128), (192, 5120, 128)]
SMALL_SHAPES = [(80, 64, 64), (200, 128, 128), (96, 192, 64), (136, 384, 64), (72, 256, 32), (40, 96, 96),
                (48, 320, 160), (33, 1024, 128)]
DECODE_M = [1, 2, 3, 4, 5, 6, 7, 8]
PREFILL_M = [9, 17, 64, 100, 1024, 2048]
W4A8_OUT = [torch.int8, torch.float16, torch.bfloat16, torch.float32]
W4A16_OUT = [torch.float16, torch.bfloat16, torch.float32]

SM90_CONFIGS = ops.w8a8_gemm_sm90_configs()
IS_SM90 = torch.cuda.get_device_capability() == (9, 0)
HAS_CLUSTERS = torch.cuda.get_device_capability() >= (9, 0)
needs_clusters = pytest.mark.skipif(not HAS_CLUSTERS, reason="needs thread-block clusters (compute capability 9.0)")
# Shapes the skinny W4A8 GEMM takes: groups of a multiple of 128, or one group of K <= 128.
SKINNY_SHAPES = MAMBA_2_8B + [(200, 128, 128), (40, 96, 96), (80, 64, 64), (33, 1024, 128), (50, 768, 256)]
SKINNY_M = [1, 9, 16, 17, 32, 33, 63, 64]


@pytest.fixture(autouse=True)
def _no_backend_override(monkeypatch):
    monkeypatch.delenv("QUAMBA_BACKEND", raising=False)


def seed_for(*params) -> None:
    torch.manual_seed(zlib.crc32(repr(params).encode()))


def random_packed(N, K):
    codes = torch.randint(-7, 8, (N, K), dtype=torch.int8, device=DEVICE)
    return pack_int4(codes)


# ---- W4A8 ----

def w4a8_case(M, N, K, G, out_dtype, max_multiplier=18):
    x = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE)
    group_multiplier = torch.randint(1, max_multiplier + 1, (N, K // G), dtype=torch.int8, device=DEVICE)
    x_scale, out_scale = 0.05, 0.05
    # ~3 standard deviations of the accumulator map to 127 (x rms 73, code rms 4.3, multiplier rms ~ 10.7)
    acc_std = (K ** 0.5) * 73 * 4.3 * 10.7
    channel_scale = (127 / (3 * acc_std)) * (0.5 + torch.rand(N, device=DEVICE))
    return dict(x=x, x_scale=x_scale, weight_packed=random_packed(N, K), group_multiplier=group_multiplier,
                channel_scale=channel_scale, group_size=G, out_scale=out_scale if out_dtype == torch.int8 else None,
                out_dtype=out_dtype)


def w4a8_reference(case):
    return w4a8_linear(case["x"], case["x_scale"], case["weight_packed"], case["group_multiplier"],
                       case["channel_scale"], case["group_size"], case["out_scale"], out_dtype=case["out_dtype"],
                       backend_name="torch")


def w4a8_op_arguments(case):
    multiplier, per_channel = _epilogue_multiplier(case["x_scale"], case["channel_scale"], case["out_scale"],
                                                   case["weight_packed"])
    return (case["x"], case["weight_packed"], case["group_multiplier"], case["group_size"], multiplier, per_channel)


def poisoned_out(M, N, dtype):
    fill = -128 if dtype == torch.int8 else float("nan")
    return torch.full((M, N), fill, dtype=dtype, device=DEVICE)


def assert_exact(out, ref):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if out.dtype == torch.int8:
        assert int(out.min()) >= -127, "unwritten (-128) or out-of-range int8 output"
    else:
        assert not out.isnan().any(), "unwritten (NaN) float output"
    mismatches = int((out != ref).sum())
    if mismatches:
        diff = (out.float() - ref.float()).abs().max()
        raise AssertionError(f"{mismatches} of {out.numel()} outputs differ from the reference (max |diff| {diff})")


def check_w4a8(run, M, N, K, G, out_dtype, **options):
    case = w4a8_case(M, N, K, G, out_dtype, **options)
    out = poisoned_out(M, N, out_dtype)
    run(case, out)
    assert_exact(out, w4a8_reference(case))


def run_w4a8_gemv(case, out, rows=0, splits=0, x_loads=0):
    ops.w4a8_gemv_out(*w4a8_op_arguments(case), out, rows, splits, x_loads)


def run_w4a8_gemm(case, out, config=-1):
    ops.w4a8_gemm_out(*w4a8_op_arguments(case), out, config)


def run_w4a8_skinny(case, out, warp_tiles=0, splits=0, x_rows=0):
    ops.w4a8_skinny_out(*w4a8_op_arguments(case), out, warp_tiles, splits, x_rows)


def run_w4a8_tiled(case, out, splits=0):
    ops.w4a8_tiled_out(*w4a8_op_arguments(case), out, splits)


def run_w4a8_linear(case, out):
    ops.w4a8_linear_out(*w4a8_op_arguments(case), out)


@pytest.mark.parametrize("out_dtype", W4A8_OUT, ids=str)
@pytest.mark.parametrize("N,K,G", MAMBA_2_8B + SMALL_SHAPES)
@pytest.mark.parametrize("M", DECODE_M)
def test_w4a8_gemv_matches_reference(M, N, K, G, out_dtype):
    seed_for("w4a8 gemv", M, N, K, G, out_dtype)
    check_w4a8(run_w4a8_gemv, M, N, K, G, out_dtype)


GEMV_SPLIT_SHAPES = [(192, 5120, 128), (2560, 5120, 128), (96, 192, 64), (40, 96, 96), (72, 256, 32),
                     (33, 1024, 128)]
# 8 and 16 splits (a block per 16-row tile; whole 128-code steps): fewer steps than splits, a
# last tile only partly inside N.
WIDE_SPLIT_SHAPES = [(192, 5120, 128), (2560, 5120, 128), (33, 1024, 128), (200, 128, 128)]


@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("N,K,G,rows,splits",
                         [(*shape, rows, splits) for shape in GEMV_SPLIT_SHAPES for rows in (4, 16)
                          for splits in (1, 2, 4)]
                         + [(*shape, 16, splits) for shape in WIDE_SPLIT_SHAPES for splits in (8, 16)])
def test_w4a8_gemv_every_work_split(M, N, K, G, rows, splits):
    seed_for("w4a8 gemv splits", M, N, K, G, rows, splits)
    check_w4a8(lambda case, out: run_w4a8_gemv(case, out, rows, splits), M, N, K, G, torch.int8)


# x loaded per lane (1) or by the whole warp through shared memory (2), on the tensor cores in every
# split of whole 128-code steps: the 4-tile warps of N 10280, a last tile partly inside N, groups of
# 256, fewer steps than splits.
X_LOADS_SHAPES = [(2560, 5120, 128), (10280, 256, 128), (33, 1024, 128), (41, 2048, 256), (200, 128, 128)]
X_LOADS_CASES = [(M, *shape, splits, x_loads) for M in (1, 3, 8) for shape in X_LOADS_SHAPES
                 for splits in (1, 2, 4, 8, 16) for x_loads in (1, 2)]


@pytest.mark.parametrize("M,N,K,G,splits,x_loads", X_LOADS_CASES)
def test_w4a8_gemv_both_x_loads(M, N, K, G, splits, x_loads):
    seed_for("w4a8 x loads", M, N, K, G, splits, x_loads)
    check_w4a8(lambda case, out: run_w4a8_gemv(case, out, 16, splits, x_loads), M, N, K, G, torch.int8)


@pytest.mark.parametrize("out_dtype", W4A8_OUT, ids=str)
@pytest.mark.parametrize("N,K,G", MAMBA_2_8B + SMALL_SHAPES)
@pytest.mark.parametrize("M", PREFILL_M)
def test_w4a8_linear_prefill_matches_reference(M, N, K, G, out_dtype):
    """The dispatching op: the skinny GEMM at 9-32 rows (and at 33-64 for at most 256 weight rows,
    x_proj) where it takes the groups, else expansion + the W8A8 GEMM the device gets (sm90 where
    it can run)."""
    seed_for("w4a8 gemm", M, N, K, G, out_dtype)
    check_w4a8(run_w4a8_linear, M, N, K, G, out_dtype)


@pytest.mark.parametrize("out_dtype", W4A8_OUT, ids=str)
@pytest.mark.parametrize("N,K,G", [(2560, 5120, 128), (136, 384, 64), (33, 1024, 128)])
@pytest.mark.parametrize("M", [9, 100, 1024])
def test_w4a8_gemm_mma_matches_reference(M, N, K, G, out_dtype):
    seed_for("w4a8 mma", M, N, K, G, out_dtype)
    check_w4a8(lambda case, out: run_w4a8_gemm(case, out, -2), M, N, K, G, out_dtype)


@pytest.mark.skipif(not (IS_SM90 and SM90_CONFIGS), reason="needs the sm_90a build on a 9.0 GPU")
@pytest.mark.parametrize("config", range(SM90_CONFIGS))
@pytest.mark.parametrize("out_dtype", [torch.int8, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N,K,G", MAMBA_2_8B + [(96, 192, 64)])
@pytest.mark.parametrize("M", [17, 1024])
def test_w4a8_gemm_sm90_configs_match_reference(M, N, K, G, out_dtype, config):
    seed_for("w4a8 sm90", M, N, K, G, out_dtype, config)
    check_w4a8(lambda case, out: run_w4a8_gemm(case, out, config), M, N, K, G, out_dtype)


@pytest.mark.parametrize("M", [17, 64])
def test_w4a8_gemm_reads_its_expansion_after_it_is_written(M):
    """Above 8 rows W4A8 expands its weight into a temporary that the caching allocator hands out
    again at the same address, and the GEMM after it may launch before the expansion ends
    (programmatic launch). With two weights of one shape taking turns, a GEMM that read the weight
    before the expansion was done would see the other weight's codes. Groups of 64: the skinny
    GEMM does not take them on the packed weight, so the expansion runs."""
    seed_for("w4a8 expansion then gemm", M)
    N, K, G = 10240, 2560, 64
    cases = [w4a8_case(M, N, K, G, torch.int8) for _ in range(2)]
    references = [w4a8_reference(case) for case in cases]
    for _ in range(10):
        for case, reference in zip(cases, references):
            out = poisoned_out(M, N, torch.int8)
            run_w4a8_gemm(case, out)
            assert_exact(out, reference)


@needs_clusters
@pytest.mark.parametrize("out_dtype", W4A8_OUT, ids=str)
@pytest.mark.parametrize("N,K,G", SKINNY_SHAPES)
@pytest.mark.parametrize("M", SKINNY_M)
def test_w4a8_skinny_matches_reference(M, N, K, G, out_dtype):
    """The skinny GEMM on the packed weight, exact for any int8 multiplier (up to 127 here)."""
    seed_for("w4a8 skinny", M, N, K, G, out_dtype)
    check_w4a8(run_w4a8_skinny, M, N, K, G, out_dtype, max_multiplier=127)


@needs_clusters
@pytest.mark.parametrize("x_rows", [16, 32])
@pytest.mark.parametrize("splits", [1, 2, 3, 8, 16])
@pytest.mark.parametrize("M", [9, 40, 64])
@pytest.mark.parametrize("N,K,G", [(192, 5120, 128), (100, 1024, 256), (33, 1024, 128)])
def test_w4a8_skinny_every_split(M, N, K, G, splits, x_rows):
    """Every cluster size and block height of x (at most 32 rows: 64 take two blocks); a plan
    whose K range of x does not fit in shared memory is refused."""
    seed_for("w4a8 skinny splits", M, N, K, G, splits, x_rows)

    def run(case, out):
        run_w4a8_skinny(case, out, 1, splits, x_rows)

    if skinny_staged_bytes(x_rows, K, splits) > SKINNY_MAX_STAGED_BYTES:
        with pytest.raises(RuntimeError, match=f"K = {K} in .* splits stages .* bytes of x, more than"):
            check_w4a8(run, M, N, K, G, torch.int8)
    else:
        check_w4a8(run, M, N, K, G, torch.int8)


@needs_clusters
def test_w4a8_skinny_refuses_groups_that_straddle_its_steps():
    case = w4a8_case(16, 72, 256, 32, torch.int8)
    with pytest.raises(RuntimeError, match="group_size % 128 == 0 or one group of at most 128"):
        run_w4a8_skinny(case, poisoned_out(16, 72, torch.int8))
    with pytest.raises(RuntimeError, match="warp_tiles must be 1 to 1"):
        run_w4a8_skinny(w4a8_case(16, 72, 256, 128, torch.int8), poisoned_out(16, 72, torch.int8), 2, 0)
    with pytest.raises(RuntimeError, match=r"x_rows must be 16, 32 \(0: chosen\), got 64"):
        run_w4a8_skinny(w4a8_case(16, 72, 256, 128, torch.int8), poisoned_out(16, 72, torch.int8), 0, 0, 64)


@needs_clusters
@pytest.mark.parametrize("out_dtype", W4A8_OUT, ids=str)
@pytest.mark.parametrize("N,K,G", SKINNY_SHAPES + [(2560, 640, 128), (264, 256, 128)])
@pytest.mark.parametrize("M", [1, 16, 17, 31, 32, 33, 48, 63, 64])
def test_w4a8_tiled_matches_reference(M, N, K, G, out_dtype):
    """The tiled GEMM on the packed weight (either tile: N <= 256 or wider; 4 or 8 tiles of x),
    exact for any int8 multiplier (up to 127 here)."""
    seed_for("w4a8 tiled", M, N, K, G, out_dtype)
    check_w4a8(run_w4a8_tiled, M, N, K, G, out_dtype, max_multiplier=127)


@needs_clusters
@pytest.mark.parametrize("splits", [1, 2, 3, 5, 8, 16])
@pytest.mark.parametrize("M", [20, 64])
@pytest.mark.parametrize("N,K,G", [(192, 5120, 128), (100, 1024, 256), (33, 1024, 128), (300, 1280, 256),
                                   (2560, 640, 128)])
def test_w4a8_tiled_every_split(M, N, K, G, splits):
    """Every cluster size, including splits whose K ranges end inside a stage or a group, and more
    splits than the K range has stages (fewer are used)."""
    seed_for("w4a8 tiled splits", M, N, K, G, splits)
    check_w4a8(lambda case, out: run_w4a8_tiled(case, out, splits), M, N, K, G, torch.int8, max_multiplier=127)


@needs_clusters
def test_w4a8_tiled_refuses_what_it_cannot_run():
    with pytest.raises(RuntimeError, match="group_size % 128 == 0 or one group of at most 128 codes"):
        run_w4a8_tiled(w4a8_case(20, 72, 256, 32, torch.int8), poisoned_out(20, 72, torch.int8))
    with pytest.raises(RuntimeError, match="x of 1 to 64 rows"):
        run_w4a8_tiled(w4a8_case(65, 72, 256, 128, torch.int8), poisoned_out(65, 72, torch.int8))
    with pytest.raises(RuntimeError, match=r"splits must be 1 to 16 \(0: chosen\), got 17"):
        run_w4a8_tiled(w4a8_case(20, 72, 256, 128, torch.int8), poisoned_out(20, 72, torch.int8), 17)


@pytest.mark.parametrize("out_dtype", [torch.int8, torch.float16], ids=str)
@pytest.mark.parametrize("M", [1, 5, 8])
def test_small_w4a8_gemv_is_exact_for_any_multiplier(M, out_dtype):
    """Checkpoints from before the 1..18 cap hold multipliers up to 127: the GEMV stays exact."""
    seed_for("w4a8 big multipliers", M, out_dtype)
    check_w4a8(run_w4a8_gemv, M, 136, 384, 64, out_dtype, max_multiplier=127)


@pytest.mark.parametrize("M", [1, 7, 8, 9, 64, 1000])
@pytest.mark.parametrize("out_dtype", [torch.int8, torch.float16, torch.bfloat16], ids=str)
def test_w4a8_linear_cuda_backend_matches_torch(M, out_dtype):
    """The public op on the cuda backend: 3-D x (batch 2), a strided view for x."""
    seed_for("w4a8 backend", M, out_dtype)
    N, K, G = 2560, 5120, 128
    case = w4a8_case(2 * M, N, K, G, out_dtype)
    wide = torch.randint(-127, 128, (2 * M, 2 * K), dtype=torch.int8, device=DEVICE)
    wide[:, :K] = case["x"]
    x_view = wide[:, :K].reshape(2, M, K)
    out = w4a8_linear(x_view, case["x_scale"], case["weight_packed"], case["group_multiplier"],
                      case["channel_scale"], G, case["out_scale"], out_dtype=out_dtype, backend_name="cuda")
    assert out.shape == (2, M, N)
    assert_exact(out.reshape(2 * M, N), w4a8_reference(case))


def test_small_w4a8_expand_flags_overflow():
    seed_for("expand")
    N, K, G = 64, 256, 64
    codes = torch.randint(-7, 8, (N, K), dtype=torch.int8, device=DEVICE)
    codes[5, 70] = 7
    multipliers = torch.randint(1, 19, (N, K // G), dtype=torch.int8, device=DEVICE)
    multipliers[7, 2] = -3  # outside 0..18: expanded code by code
    packed = pack_int4(codes)
    out = torch.full((N, K), -99, dtype=torch.int8, device=DEVICE)
    overflow = torch.zeros(1, dtype=torch.int32, device=DEVICE)

    def expected():
        return codes.int() * multipliers.int().repeat_interleave(G, dim=1)

    ops.w4a8_expand_out(packed, multipliers, G, out, overflow)
    assert torch.equal(out.int(), expected()) and int(overflow.item()) == 0
    multipliers[5, 1] = 19  # 7 * 19 = 133: stored truncated to 8 bits
    ops.w4a8_expand_out(packed, multipliers, G, out, overflow)
    assert int(overflow.item()) == 1
    assert torch.equal(out.int(), (expected() + 128) % 256 - 128)


def test_small_w4a8_backend_refuses_overflowing_weight_for_prefill_only():
    seed_for("refuse")
    case = w4a8_case(16, 64, 256, 64, torch.int8)
    gm = case["group_multiplier"]
    args = (case["x_scale"], case["weight_packed"], gm, case["channel_scale"], 64, case["out_scale"])
    out = w4a8_linear(case["x"], *args, backend_name="cuda")
    assert_exact(out, w4a8_reference(case))
    gm[3, 2] = 100  # in place: bumps _version, so the cached verdict is dropped
    case["weight_packed"][3, 64:96] = 0x77  # codes 7 in group 2 of row 3: 700 does not fit int8
    with pytest.raises(W4A8OverflowError, match="group multipliers must lie in 1…18"):
        w4a8_linear(case["x"], *args, backend_name="cuda")
    out = w4a8_linear(case["x"][:8], *args, backend_name="cuda")  # decode (GEMV) stays exact
    case["x"] = case["x"][:8]
    assert_exact(out, w4a8_reference(case))
    with pytest.raises(W4A8OverflowError):
        check_expandable(case["weight_packed"], gm, 64)


# ---- W4A16 ----

def w4a16_case(M, N, K, G, x_dtype, out_dtype, x_offset=0.0):
    x = (x_offset + torch.randn(M, K, device=DEVICE)).to(x_dtype)
    scales = ((0.5 + torch.rand(N, K // G, device=DEVICE)) * 0.02).half()
    return dict(x=x, weight_packed=random_packed(N, K), scales=scales, group_size=G, out_dtype=out_dtype)


def w4a16_reference(case):
    return w4a16_linear(case["x"], case["weight_packed"], case["scales"], case["group_size"],
                        out_dtype=case["out_dtype"], backend_name="torch")


def w4a16_op_arguments(case):
    return case["x"], case["weight_packed"], case["scales"], case["group_size"]


def assert_close_w4a16(out, ref, relative=1e-3):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not out.isnan().any(), "unwritten (NaN) output"
    scale = float(ref.float().abs().max())
    torch.testing.assert_close(out.float(), ref.float(), rtol=torch.finfo(out.dtype).eps + 1e-3,
                               atol=relative * scale)


def check_w4a16(run, M, N, K, G, x_dtype, out_dtype, relative=1e-3, x_offset=0.0):
    case = w4a16_case(M, N, K, G, x_dtype, out_dtype, x_offset)
    out = poisoned_out(M, N, out_dtype)
    run(case, out)
    assert_close_w4a16(out, w4a16_reference(case), relative)


def gemm_tolerance(x_dtype):
    return 1e-2 if x_dtype == torch.bfloat16 else 1e-3


@pytest.mark.parametrize("out_dtype", W4A16_OUT, ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N,K,G", MAMBA_2_8B + SMALL_SHAPES)
@pytest.mark.parametrize("M", DECODE_M)
def test_w4a16_gemv_matches_reference(M, N, K, G, x_dtype, out_dtype):
    seed_for("w4a16 gemv", M, N, K, G, x_dtype, out_dtype)
    check_w4a16(lambda case, out: ops.w4a16_gemv_out(*w4a16_op_arguments(case), out), M, N, K, G, x_dtype, out_dtype)


# (10280, 256, 128): enough rows for the GEMV's 64-row warps (more 16-row tiles than 2 per SM on
# an H100), with a last warp only partly inside N. Rows 4 (CUDA cores) take M = 1.
W4A16_SPLIT_SHAPES = [(192, 5120, 128), (2560, 5120, 128), (96, 192, 64), (72, 256, 32), (48, 320, 160),
                      (10280, 256, 128)]


@pytest.mark.parametrize("M,N,K,G,rows,splits",
                         [(M, *shape, 16, splits) for M in (1, 8)
                          for shape in W4A16_SPLIT_SHAPES for splits in (1, 2, 4)]
                         + [(M, *shape, 16, splits) for M in (1, 8)
                            for shape in WIDE_SPLIT_SHAPES for splits in (8, 16)]
                         + [(1, *shape, 4, splits) for shape in W4A16_SPLIT_SHAPES + [(33, 1024, 128)]
                            for splits in (1, 2, 4)])
def test_w4a16_gemv_every_work_split(M, N, K, G, rows, splits):
    seed_for("w4a16 splits", M, N, K, G, rows, splits)
    check_w4a16(lambda case, out: ops.w4a16_gemv_out(*w4a16_op_arguments(case), out, rows, splits), M, N, K, G,
                torch.float16, torch.float16)


@pytest.mark.parametrize("M,N,K,G,splits,x_loads", X_LOADS_CASES)
def test_w4a16_gemv_both_x_loads(M, N, K, G, splits, x_loads):
    seed_for("w4a16 x loads", M, N, K, G, splits, x_loads)
    check_w4a16(lambda case, out: ops.w4a16_gemv_out(*w4a16_op_arguments(case), out, 16, splits, x_loads), M, N, K,
                G, torch.float16, torch.float16)


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("M", [1, 5])
def test_small_w4a16_gemv_shared_x_loads_other_types(M, x_dtype, out_dtype):
    seed_for("w4a16 shared x types", M, x_dtype, out_dtype)
    check_w4a16(lambda case, out: ops.w4a16_gemv_out(*w4a16_op_arguments(case), out, 0, 0, 2), M, 40, 1024, 128,
                x_dtype, out_dtype)


@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("M,N,K,G,splits", [(1, 2560, 5120, 128, 8), (8, 10280, 256, 128, 4), (1, 72, 256, 32, 2),
                                            (3, 48, 320, 160, 1)])
def test_w4a16_gemv_activations_far_from_zero(M, N, K, G, splits, x_dtype):
    """Activations with a large common offset: the tensor-core GEMV's f16 codes come from the
    magic number 1024 + code + 8 and an fma that takes 1032 off; any code arithmetic that left
    that bias to be cancelled against the activations' sum later would lose most here."""
    seed_for("w4a16 offset", M, N, K, G, splits, x_dtype)
    check_w4a16(lambda case, out: ops.w4a16_gemv_out(*w4a16_op_arguments(case), out, 16, splits), M, N, K, G,
                x_dtype, torch.float32, x_offset=30.0)


@pytest.mark.parametrize("out_dtype", W4A16_OUT, ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N,K,G", MAMBA_2_8B + SMALL_SHAPES)
@pytest.mark.parametrize("M", PREFILL_M)
def test_w4a16_linear_prefill_matches_reference(M, N, K, G, x_dtype, out_dtype):
    seed_for("w4a16 gemm", M, N, K, G, x_dtype, out_dtype)
    check_w4a16(lambda case, out: ops.w4a16_linear_out(*w4a16_op_arguments(case), out), M, N, K, G, x_dtype,
                out_dtype, gemm_tolerance(x_dtype))


@pytest.mark.parametrize("N,K,G", [(136, 384, 64), (40, 96, 96), (72, 256, 32), (33, 1024, 128), (2560, 5120, 128)])
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_small_w4a16_dequantize_matches_reference(N, K, G, x_dtype):
    seed_for("dequantize", N, K, G, x_dtype)
    case = w4a16_case(1, N, K, G, x_dtype, x_dtype)
    out = torch.full((N, K), float("nan"), dtype=x_dtype, device=DEVICE)
    ops.w4a16_dequantize_out(case["weight_packed"], case["scales"], G, out)
    assert torch.equal(out, dequantize_int4(case["weight_packed"], case["scales"], G).to(x_dtype))


@pytest.mark.parametrize("M", [1, 8, 9, 64])
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_w4a16_linear_cuda_backend_matches_torch(M, x_dtype):
    seed_for("w4a16 backend", M, x_dtype)
    N, K, G = 2560, 5120, 128
    case = w4a16_case(2 * M, N, K, G, x_dtype, x_dtype)
    wide = torch.randn(2 * M, 2 * K, device=DEVICE).to(x_dtype)
    wide[:, :K] = case["x"]
    out = w4a16_linear(wide[:, :K].reshape(2, M, K), case["weight_packed"], case["scales"], G, backend_name="cuda")
    assert out.shape == (2, M, N) and out.dtype == x_dtype
    assert_close_w4a16(out.reshape(2 * M, N), w4a16_reference(case), gemm_tolerance(x_dtype))


@pytest.mark.parametrize("batch,seqlen", [(1, 5), (1, 37), (3, 2), (3, 100), (8, 256)])
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_w4a16_linear_cuda_backend_reads_transposed_activations(batch, seqlen, x_dtype):
    """x [batch, seqlen, K] as the FP mixer gives x_proj and out_proj: a transposed view of a
    channel-major [batch, K, seqlen] tensor, read through its strides past 8 rows, copied for the
    GEMV up to 8; the cuda backend's result matches the reference on the same view."""
    seed_for("w4a16 transposed", batch, seqlen, x_dtype)
    N, K, G = 192, 5120, 128
    case = w4a16_case(1, N, K, G, x_dtype, x_dtype)
    x = torch.randn(batch, K, seqlen, device=DEVICE).to(x_dtype).transpose(1, 2)
    args = (case["weight_packed"], case["scales"], G)
    out = w4a16_linear(x, *args, backend_name="cuda")
    assert out.shape == (batch, seqlen, N) and out.dtype == x_dtype
    expected = w4a16_linear(x, *args, backend_name="torch")
    assert_close_w4a16(out.reshape(-1, N), expected.reshape(-1, N), gemm_tolerance(x_dtype))


@pytest.mark.parametrize("M", [1, 8, 9, 64, 1024])
@pytest.mark.parametrize("x_dtype", [torch.float16, torch.bfloat16], ids=str)
def test_w4a16_linear_channel_major_cuda_matches_torch(M, x_dtype):
    """W · xᵀ [N, M] (the FP mixer's prefill layout for a 4-bit in_proj), x also a column-major view
    (a transposed activation): the transpose of the reference."""
    seed_for("w4a16 channel major", M, x_dtype)
    N, K, G = 2560, 5120, 128
    case = w4a16_case(M, N, K, G, x_dtype, x_dtype)
    expected = w4a16_reference(case).t()
    for x in (case["x"], case["x"].t().contiguous().t()):
        out = w4a16_linear_channel_major(x, case["weight_packed"], case["scales"], G, backend_name="cuda")
        assert out.shape == (N, M) and out.dtype == x_dtype
        assert_close_w4a16(out, expected, gemm_tolerance(x_dtype))


@pytest.mark.parametrize("M", [1, 3, 8, 9, 17])
@pytest.mark.parametrize("N,K,G", [(40, 96, 96), (72, 256, 32), (33, 1024, 128)])
def test_small_every_path_small_shapes(M, N, K, G):
    """Every kernel on small odd shapes (the set compute-sanitizer runs)."""
    seed_for("small every path", M, N, K, G)
    w4a8_runs = [run_w4a8_linear, lambda case, out: run_w4a8_gemm(case, out, -2)]
    if M <= 8:
        w4a8_runs.append(run_w4a8_gemv)
    if HAS_CLUSTERS and (G % 128 == 0 or G == K <= 128):
        w4a8_runs += [run_w4a8_skinny, run_w4a8_tiled]
    for run in w4a8_runs:
        check_w4a8(run, M, N, K, G, torch.int8)
        check_w4a8(run, M, N, K, G, torch.float16)
    w4a16_runs = [lambda case, out: ops.w4a16_linear_out(*w4a16_op_arguments(case), out),
                  lambda case, out: ops.w4a16_gemm_out(*w4a16_op_arguments(case), out)]
    if M <= 8:
        w4a16_runs.append(lambda case, out: ops.w4a16_gemv_out(*w4a16_op_arguments(case), out))
    for run in w4a16_runs:
        check_w4a16(run, M, N, K, G, torch.float16, torch.float16)
        check_w4a16(run, M, N, K, G, torch.bfloat16, torch.float32, gemm_tolerance(torch.bfloat16))


def test_small_w4a16_cuda_backend_runs_float32_x_as_the_reference():
    """No kernel takes fp32 activations: the cuda backend runs the reference computation on the GPU."""
    seed_for("w4a16 fp32 x")
    case = w4a16_case(5, 136, 384, 64, torch.float32, torch.float32)
    out = w4a16_linear(case["x"], case["weight_packed"], case["scales"], 64, backend_name="cuda")
    assert torch.equal(out, w4a16_reference(case))


# ---- CUDA graphs ----

@pytest.mark.parametrize("M", [1, 8, 100])
def test_linear4_ops_replay_in_a_cuda_graph(M):
    seed_for("graph", M)
    N, K, G = 2560, 5120, 128
    a8 = w4a8_case(M, N, K, G, torch.float16)
    a16 = w4a16_case(M, N, K, G, torch.float16, torch.float16)
    out8, out16 = poisoned_out(M, N, torch.float16), poisoned_out(M, N, torch.float16)
    args8, args16 = w4a8_op_arguments(a8), w4a16_op_arguments(a16)
    ops.w4a8_linear_out(*args8, out8)  # warm-up outside the capture
    ops.w4a16_linear_out(*args16, out16)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.w4a8_linear_out(*args8, out8)
        ops.w4a16_linear_out(*args16, out16)
    a8["x"].copy_(torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE))
    a16["x"].copy_(torch.randn(M, K, device=DEVICE).half())
    out8.fill_(float("nan"))
    out16.fill_(float("nan"))
    graph.replay()
    assert_exact(out8, w4a8_reference(a8))
    assert_close_w4a16(out16, w4a16_reference(a16))



def test_w4a8_prefill_of_inference_tensors_is_captured_with_the_warm_up_check():
    """A capture cannot read the device: the overflow check of weights made under inference_mode
    (no version counter, so checked in every eager call) keeps the verdict of the warm-up's check
    there, and a weight never checked is refused with a QuambaError."""
    seed_for("graph", "inference")
    M, N, K, G = 100, 256, 512, 128
    with torch.inference_mode():
        case = w4a8_case(M, N, K, G, torch.float16)
        args = (case["x_scale"], case["weight_packed"], case["group_multiplier"], case["channel_scale"],
                G, None)
        w4a8_linear(case["x"], *args, backend_name="cuda")  # the warm-up: checks the weight
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = w4a8_linear(case["x"], *args, backend_name="cuda")
        case["x"].copy_(torch.randint(-127, 128, (M, K), dtype=torch.int8, device=DEVICE))
        graph.replay()
        assert_exact(out, w4a8_reference(case))
        unchecked = w4a8_case(M, N, K, G, torch.float16)
        with pytest.raises(QuambaError, match="checked before the capture"), \
                torch.cuda.graph(torch.cuda.CUDAGraph()):
            w4a8_linear(unchecked["x"], unchecked["x_scale"], unchecked["weight_packed"],
                        unchecked["group_multiplier"], unchecked["channel_scale"], G, None,
                        backend_name="cuda")

# ---- input checks: RuntimeError naming the argument ----

def misaligned(t):
    flat = torch.empty(t.numel() + 16, dtype=t.dtype, device=t.device)
    view = flat[1:1 + t.numel()].view(t.shape)
    view.copy_(t)
    return view


def valid_w4a8(M=4, N=32, K=128, G=64):
    case = w4a8_case(M, N, K, G, torch.float16)
    x, w, gm, g, multiplier, per_channel = w4a8_op_arguments(case)
    return dict(x=x, weight_packed=w, group_multiplier=gm, group_size=g, multiplier=multiplier,
                multiplier_per_channel=per_channel, out=torch.empty(M, N, dtype=torch.float16, device=DEVICE))


def call_w4a8(op, a):
    op(a["x"], a["weight_packed"], a["group_multiplier"], a["group_size"], a["multiplier"],
       a["multiplier_per_channel"], a["out"])


BAD_W4A8 = {
    "x float": (lambda a: a.update(x=a["x"].float()), "x must be int8"),
    "x on cpu": (lambda a: a.update(x=a["x"].cpu()), "x must be a CUDA tensor"),
    "x 1-D": (lambda a: a.update(x=a["x"].reshape(-1)), "x must be 2-D"),
    "x not contiguous": (lambda a: a.update(x=torch.zeros(4, 256, dtype=torch.int8, device=DEVICE)[:, :128]),
                         "x must be contiguous"),
    "x misaligned": (lambda a: a.update(x=misaligned(a["x"])), "x must start at a 16-byte aligned address"),
    "K not multiple of 32": (lambda a: a.update(x=torch.zeros(4, 48, dtype=torch.int8, device=DEVICE)),
                             "positive multiple of 32"),
    "weight int8": (lambda a: a.update(weight_packed=a["weight_packed"].view(torch.int8)),
                    "weight_packed must be uint8"),
    "weight on cpu": (lambda a: a.update(weight_packed=a["weight_packed"].cpu()),
                      "weight_packed must be a CUDA tensor"),
    "weight unpacked": (lambda a: a.update(weight_packed=torch.zeros(32, 128, dtype=torch.uint8, device=DEVICE)),
                        "weight_packed must have shape"),
    "weight transposed": (lambda a: a.update(weight_packed=torch.zeros(64, 32, dtype=torch.uint8,
                                                                       device=DEVICE).t()),
                          "weight_packed must be contiguous"),
    "weight misaligned": (lambda a: a.update(weight_packed=misaligned(a["weight_packed"])),
                          "weight_packed must start at a 16-byte aligned address"),
    "group size 48": (lambda a: a.update(group_size=48), "group_size must be a positive multiple of 32"),
    "group size 96 for K 128": (lambda a: a.update(group_size=96), "group_size must be"),
    "multiplier wrong shape": (lambda a: a.update(group_size=32), "group_multiplier must have shape"),
    "multiplier int32": (lambda a: a.update(group_multiplier=a["group_multiplier"].int()),
                         "group_multiplier must be"),
    "multiplier_per_channel wrong size": (
        lambda a: a.update(multiplier_per_channel=torch.ones(31, device=DEVICE)), "multiplier_per_channel must have"),
    "multiplier_per_channel fp16": (
        lambda a: a.update(multiplier_per_channel=torch.ones(32, device=DEVICE, dtype=torch.float16)),
        "multiplier_per_channel must be float32"),
    "out wrong shape": (lambda a: a.update(out=torch.empty(4, 31, dtype=torch.float16, device=DEVICE)),
                        "out must have shape"),
    "out int32": (lambda a: a.update(out=torch.empty(4, 32, dtype=torch.int32, device=DEVICE)),
                  "out must be int8, float16, bfloat16 or float32"),
}


@pytest.mark.parametrize("op_name", ["w4a8_linear_out", "w4a8_gemv_out", "w4a8_gemm_out"])
@pytest.mark.parametrize("bad", BAD_W4A8, ids=list(BAD_W4A8))
def test_w4a8_bad_arguments_raise_naming_the_argument(bad, op_name):
    arguments = valid_w4a8()
    spoil, message = BAD_W4A8[bad]
    spoil(arguments)
    with pytest.raises(RuntimeError, match=message):
        call_w4a8(getattr(ops, op_name), arguments)


def test_w4a8_gemv_and_gemm_reject_bad_options():
    a = valid_w4a8(M=9)
    with pytest.raises(RuntimeError, match="x must have 1 to 8 rows"):
        call_w4a8(ops.w4a8_gemv_out, a)
    a = valid_w4a8()
    args = (a["x"], a["weight_packed"], a["group_multiplier"], a["group_size"], a["multiplier"], None, a["out"])
    with pytest.raises(RuntimeError, match="rows must be"):
        ops.w4a8_gemv_out(*args, 3, 0)
    with pytest.raises(RuntimeError, match="splits must be"):
        ops.w4a8_gemv_out(*args, 0, 3)
    with pytest.raises(RuntimeError, match=r"splits must be 0 \(auto\), 1, 2 or 4 \(8 and 16: rows 16\), got 8"):
        ops.w4a8_gemv_out(*args, 4, 8)
    with pytest.raises(RuntimeError, match="16 splits need group_size % 128 == 0, got 64"):
        ops.w4a8_gemv_out(*args, 16, 16)
    with pytest.raises(RuntimeError, match="config must be"):
        ops.w4a8_gemm_out(*args, 99)


def gemv_arguments(op_name, M, G):
    """Positional arguments up to `out` of a valid w4a8 / w4a16 GEMV call (N 32, K 256)."""
    if op_name == "w4a8_gemv_out":
        a = valid_w4a8(M=M, K=256, G=G)
        return a["x"], a["weight_packed"], a["group_multiplier"], a["group_size"], a["multiplier"], None, a["out"]
    a = valid_w4a16(M=M, K=256, G=G)
    return a["x"], a["weight_packed"], a["scales"], a["group_size"], a["out"]


@pytest.mark.parametrize("op_name", ["w4a8_gemv_out", "w4a16_gemv_out"])
def test_gemv_rejects_bad_x_loads(op_name):
    op = getattr(ops, op_name)
    with pytest.raises(RuntimeError, match=r"x_loads must be 0 \(auto\), 1 \(per lane\) or 2 \(shared\), got 3"):
        op(*gemv_arguments(op_name, 1, 128), 0, 0, 3)
    with pytest.raises(RuntimeError, match=r"x_loads 2 \(shared\) needs the tensor cores \(rows 0 or 16\)"):
        op(*gemv_arguments(op_name, 1, 128), 4, 1, 2)
    with pytest.raises(RuntimeError, match=r"x_loads 2 \(shared\) needs group_size % 128 == 0, got 64"):
        op(*gemv_arguments(op_name, 1, 64), 16, 1, 2)


def valid_w4a16(M=4, N=32, K=128, G=64):
    case = w4a16_case(M, N, K, G, torch.float16, torch.float16)
    return dict(x=case["x"], weight_packed=case["weight_packed"], scales=case["scales"], group_size=G,
                out=torch.empty(M, N, dtype=torch.float16, device=DEVICE))


def call_w4a16(op, a):
    op(a["x"], a["weight_packed"], a["scales"], a["group_size"], a["out"])


BAD_W4A16 = {
    "x int8": (lambda a: a.update(x=torch.zeros(4, 128, dtype=torch.int8, device=DEVICE)),
               "x must be float16 or bfloat16"),
    "x float32": (lambda a: a.update(x=a["x"].float()), "x must be float16 or bfloat16"),
    "x on cpu": (lambda a: a.update(x=a["x"].cpu()), "x must be a CUDA tensor"),
    "x misaligned": (lambda a: a.update(x=misaligned(a["x"])), "x must start at a 16-byte aligned address"),
    "weight on cpu": (lambda a: a.update(weight_packed=a["weight_packed"].cpu()),
                      "weight_packed must be a CUDA tensor"),
    "weight wrong K": (lambda a: a.update(weight_packed=torch.zeros(32, 32, dtype=torch.uint8, device=DEVICE)),
                       "weight_packed must have shape"),
    "scales fp32": (lambda a: a.update(scales=a["scales"].float()), "scales must be"),
    "scales wrong shape": (lambda a: a.update(scales=a["scales"][:, :1].contiguous()), "scales must have shape"),
    "group size 0": (lambda a: a.update(group_size=0), "group_size must be a positive multiple of 32"),
    "out int8": (lambda a: a.update(out=torch.empty(4, 32, dtype=torch.int8, device=DEVICE)),
                 "out must be float16, bfloat16 or float32"),
    "out wrong shape": (lambda a: a.update(out=torch.empty(5, 32, dtype=torch.float16, device=DEVICE)),
                        "out must have shape"),
}


@pytest.mark.parametrize("op_name", ["w4a16_linear_out", "w4a16_gemv_out", "w4a16_gemm_out"])
@pytest.mark.parametrize("bad", BAD_W4A16, ids=list(BAD_W4A16))
def test_w4a16_bad_arguments_raise_naming_the_argument(bad, op_name):
    arguments = valid_w4a16()
    spoil, message = BAD_W4A16[bad]
    spoil(arguments)
    with pytest.raises(RuntimeError, match=message):
        call_w4a16(getattr(ops, op_name), arguments)


def test_w4a16_gemv_rejects_bad_options():
    a = valid_w4a16()  # M 4, groups of 64
    args = (a["x"], a["weight_packed"], a["scales"], a["group_size"], a["out"])
    with pytest.raises(RuntimeError, match=r"rows must be 0 \(auto\), 4 \(CUDA cores\) or 16 \(tensor cores\), got 3"):
        ops.w4a16_gemv_out(*args, 3, 0)
    with pytest.raises(RuntimeError, match=r"rows 4 \(CUDA cores\) takes M = 1, got 4"):
        ops.w4a16_gemv_out(*args, 4, 0)
    with pytest.raises(RuntimeError, match=r"splits must be 0 \(auto\), 1, 2, 4, 8 or 16, got 3"):
        ops.w4a16_gemv_out(*args, 0, 3)
    with pytest.raises(RuntimeError, match="8 splits need group_size % 128 == 0, got 64"):
        ops.w4a16_gemv_out(*args, 16, 8)
    a = valid_w4a16(M=1)
    with pytest.raises(RuntimeError, match=r"splits must be 0 \(auto\), 1, 2 or 4 \(8 and 16: rows 16\), got 8"):
        ops.w4a16_gemv_out(a["x"], a["weight_packed"], a["scales"], a["group_size"], a["out"], 4, 8)
