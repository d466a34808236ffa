"""benchmarks/profile_mamba.py's argument handling (the timings themselves need a GPU)."""
import sys
from argparse import Namespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
profile_mamba = pytest.importorskip("profile_mamba")


@pytest.mark.parametrize("value,message", [("1,x", "comma-separated integers"),
                                           ("0,8", "must be positive"), ("8,8", "repeats a size")])
def test_bad_batch_lists_are_one_line_errors(value, message, capsys):
    with pytest.raises(SystemExit):
        profile_mamba.parse_args(["--batch", value])
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_each_batch_size_runs_with_its_own_argv():
    assert profile_mamba._with_batch(["--config", "2.8b", "--batch", "1,8,32,64", "--breakdown"], 32) \
        == ["--config", "2.8b", "--breakdown", "--batch", "32"]


def test_cache_memory_is_reported_per_sequence():
    memory = profile_mamba.cache_memory({"ssm": 64 * 5120 * 16 * 8, "conv": 64 * 5120 * 3 * 2 * 8}, 8)
    assert memory["ssm_state_bytes_per_seq"] == 64 * 5120 * 16  # int8 state, Mamba-2.8B shapes
    assert memory["cache_bytes"] == memory["ssm_state_bytes"] + memory["conv_state_bytes"]


def test_replay_timeline_gives_each_kernel_its_share_of_the_critical_path():
    # Two replays, 20 µs apart, of: norm 0-3, a GEMM launched early (1-10, waiting until 3), a scan
    # 11-14 after a 1 µs gap, and a Hadamard launched early (12-15) that ends 1 µs after the scan.
    replay = [("norm", 0.0, 3.0), ("gemm", 1.0, 10.0), ("scan", 11.0, 14.0), ("hadamard", 12.0, 15.0)]
    kernels = replay + [(name, start + 20.0, end + 20.0) for name, start, end in replay]
    timeline = profile_mamba.replay_timeline(kernels, replays=2)
    critical = {row["kernel"]: row["us"] for row in timeline["critical"]}
    assert critical == {"gemm": 7.0, "norm": 3.0, "scan": 3.0, "hadamard": 1.0}
    assert timeline["busy_us"] == sum(critical.values()) == 14.0
    times = {row["kernel"]: row["us"] for row in timeline["kernels"]}
    assert times["gemm"] == 9.0 and timeline["kernel_sum_us"] == 18.0
    gaps = {row["kernel"]: row["us"] for row in timeline["gaps_before"]}
    assert gaps == {"scan": 1.0, "norm": 2.5}  # the second replay starts 5 µs after the first ends
    assert timeline["span_us"] == 17.5 and timeline["idle_us"] == 3.5


def test_an_int8_head_with_w4a16_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit):
        profile_mamba.parse_args(["--lm_head", "int8", "--precisions", "w8a8,w4a16"])
    assert "w4a16 does not calibrate" in capsys.readouterr().err.strip().splitlines()[-1]


def test_unknown_head_formats_are_refused(capsys):
    with pytest.raises(SystemExit):
        profile_mamba.parse_args(["--lm_head", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("op_by_op,fused_decode,precision,rows", [
    (False, False, "w8a8", []), (True, False, "w8a8", ["op-by-op"]),
    (True, True, "w4a8", ["op-by-op", "fused"]), (False, True, "w4a8", ["fused"]),
    (True, True, "w4a16", ["op-by-op"]), (False, True, "w4a16", []), (True, True, "fp16", []),
])
def test_variant_rows_are_added_for_the_quantized_precisions(op_by_op, fused_decode, precision,
                                                             rows):
    """--op_by_op times the quantized models without their fused decode kernels (on by default:
    the layer kernel of W8A8 and W4A8, W4A16's SSM-side kernel), --fused_decode the int8 mixers
    with their SSM side as qmixer_ssm_step instead; FP16 has neither."""
    args = Namespace(op_by_op=op_by_op, fused_decode=fused_decode)
    assert profile_mamba.variant_rows(precision, args) == rows
