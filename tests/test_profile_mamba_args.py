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


def test_fused_decode_rows_are_added_for_the_int8_activation_precisions():
    wanted, unwanted = Namespace(fused_decode=True), Namespace(fused_decode=False)
    added = [p for p in profile_mamba.PRECISIONS if profile_mamba.fused_row(p, wanted)]
    assert added == ["w8a8", "w4a8"]
    assert not profile_mamba.fused_row("w8a8", unwanted)
