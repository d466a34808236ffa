"""benchmarks/profile_mamba.py's argument handling (the timings themselves need a GPU)."""
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

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


@pytest.mark.parametrize("name", ["falcon-mamba-7b", "mamba2-8b", "nemotron-h-8b", "falcon-h1-1.5b",
                                  "zamba2-2.7b", "granite-4.0-h-tiny"])
def test_every_preset_is_a_config_choice(name, capsys):
    with pytest.raises(SystemExit):  # accepted, then refused for want of a GPU
        profile_mamba.parse_args(["--config", name])
    assert "profiling needs a CUDA GPU" in capsys.readouterr().err


def test_a_hybrids_transformers_baseline_is_built_from_its_preset():
    """transformers' own model of each hybrid preset (meta device: no memory) has as many
    parameters as quamba's model of the preset; a Mamba preset has no transformers baseline."""
    from quamba.models.presets import HYBRID_PRESETS, build_preset
    for name in HYBRID_PRESETS:
        raw = profile_mamba.transformers_config(Namespace(model=None, config=name))
        runner = profile_mamba.TransformersRunner(raw, device="meta")
        ours = build_preset(name, device="meta")
        assert sum(p.numel() for p in runner.model.parameters()) == \
            sum(p.numel() for p in ours.parameters())
        assert runner.graph_refusal == profile_mamba.TRANSFORMERS_REFUSAL
    assert profile_mamba.transformers_config(Namespace(model=None, config="mamba2-8b")) is None


def _tiny_hybrid():
    from tests.models.test_fixture_hybrid import TINY_HYBRID_DIR
    import quamba
    return quamba.load_model(TINY_HYBRID_DIR, tokenizer=False)[0]


@torch.no_grad()
def test_a_model_that_graphs_refuse_decodes_eagerly_and_says_why():
    """A model whose graphed decode is refused (on the CPU, any model; on a GPU, one with MoE
    layers): the runner decodes eagerly into its own cache, which follows the full forward, and
    its row says so."""
    model = _tiny_hybrid()
    ids = torch.randint(0, 4096, (2, 11), generator=torch.Generator().manual_seed(0))
    runner = profile_mamba.QuambaRunner(model, 2, device="cpu")
    assert runner.step == runner.eager_step
    assert profile_mamba.decode_mode(runner) == {"graphed": False,
                                                 "graph_refusal": runner.graph_refusal}
    assert "CUDA graph" in runner.graph_refusal
    full = model(ids)
    logits = [runner.prefill(ids[:, :8])] + [runner.step(ids[:, t]) for t in range(8, 10)]
    for t, step_logits in zip(range(7, 10), logits):
        assert torch.allclose(step_logits, full[:, t], atol=1e-4, rtol=1e-4)
    parts = runner.cache_parts()  # 3 Mamba2 layers; one attention layer's preallocated buffers
    c, kv_tokens = model.config, runner.cache.max_seqlen
    assert parts["ssm"] == 3 * 2 * c.nheads * c.headdim * c.d_state * 4 and parts["conv"] > 0
    assert parts["kv"] == 2 * 2 * c.num_key_value_heads * kv_tokens * c.attention_head_dim * 4


@torch.no_grad()
def test_transformers_runner_decodes_from_its_cache():
    """transformers' model (a small Nemotron-H with MoE layers) prefilled, then stepped: each
    step's logits equal its full forward's, and its cache is read by kind."""
    from transformers import NemotronHConfig
    from tests.models.hybrid_checks import rel
    from tests.models.test_nemotron_h import HF_CONFIG
    raw = {"model_type": "nemotron_h", **NemotronHConfig(**HF_CONFIG).to_dict()}
    runner = profile_mamba.TransformersRunner(raw, device="cpu", dtype=torch.float32,
                                              experts_implementation="eager")
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(0))
    full = runner.model(ids).logits
    logits = [runner.prefill(ids[:, :6])] + [runner.step(ids[:, t]) for t in range(6, 8)]
    for t, step_logits in zip(range(5, 8), logits):
        assert rel(step_logits, full[:, t]) < 1e-5
    parts = runner.cache_parts()
    assert parts["ssm"] > 0 and parts["conv"] > 0 and parts["kv"] > 0


def test_cache_parts_skip_states_transformers_has_not_filled():
    """transformers 5.17's hybrid cache holds None for the states a layer has not written (the GPU
    image's version: Nemotron-H's profile ended in an AttributeError there)."""
    from types import SimpleNamespace
    runner = profile_mamba.TransformersRunner.__new__(profile_mamba.TransformersRunner)
    mamba = SimpleNamespace(recurrent_states={0: torch.zeros(2, 3), 1: None},
                            conv_states={0: torch.zeros(5), 1: None})
    attention = SimpleNamespace(recurrent_states={0: None}, conv_states={0: None},
                                keys=torch.zeros(4), values=torch.zeros(4))
    runner.cache = SimpleNamespace(layers=[mamba, attention])
    assert runner.cache_parts() == {"ssm": 24, "conv": 20, "kv": 32}


def test_decode_states_of_every_hybrid_layout():
    from quamba.models.state import AttentionState, MixerState
    from quamba.models.zamba2 import HybridState
    mixer = MixerState(torch.zeros(1, 4, 3), torch.zeros(1, 4, 2))
    attention = AttentionState.empty(1, 1, 5, 2, "cpu", torch.float32)
    states = [mixer, None, (mixer, attention), HybridState(mixer, attention), attention]
    assert profile_mamba.decode_states(states) == [mixer, mixer, attention, mixer, attention,
                                                   attention]


def _row(name, ttft, tpot, ttlt, weights=100):
    return {"name": name, "ttft_ms": ttft, "tpot_ms": tpot, "ttlt_ms": ttlt,
            "weights_bytes": weights, "cache_bytes": 0, "ssm_state_bytes_per_seq": 0,
            "peak_bytes": 0}


def test_a_hybrids_ratios_are_to_the_faster_baseline_of_each_number():
    rows = [_row("transformers fp16", 40.0, 30.0, 4000.0, 200),
            _row("quamba fp16", 50.0, 20.0, 3000.0, 100), _row("quamba w8a8", 25.0, 5.0, 700.0, 50)]
    args = Namespace(batch=1, prompt_len=1024)
    anchors = profile_mamba._add_ratios(rows, args, hybrid=True)
    assert anchors == {"ttft_speedup": "transformers fp16", "tpot_speedup": "quamba fp16",
                       "ttlt_speedup": "quamba fp16"}
    w8a8 = rows[2]
    assert (w8a8["ttft_speedup"], w8a8["tpot_speedup"], w8a8["weights_ratio"]) == (1.6, 4.0, 0.5)


def test_a_mamba_models_ratios_stay_with_mamba_ssm():
    """mamba-ssm's row is the baseline even where quamba's FP16 row is faster; without it,
    quamba's FP16 row."""
    rows = [_row("mamba-ssm fp16", 60.0, 3.0, 500.0), _row("quamba fp16", 50.0, 2.0, 400.0)]
    args = Namespace(batch=1, prompt_len=1024)
    assert set(profile_mamba._add_ratios(rows, args).values()) == {"mamba-ssm fp16"}
    assert rows[1]["tpot_speedup"] == 1.5
    assert set(profile_mamba._add_ratios(rows[1:], args).values()) == {"quamba fp16"}
    assert profile_mamba._add_ratios([_row("quamba w8a8", 1.0, 1.0, 1.0)], args) == {}


def test_the_baselines_are_described_in_the_record():
    from quamba.models import MambaConfig
    falcon = Namespace(config=MambaConfig(d_model=64, n_layer=2, mixer_rms_eps=1e-6))
    described = profile_mamba.baseline_descriptions(falcon, hybrid=False)
    assert "without Falcon-Mamba's norms of dt, B and C" in described["mamba-ssm fp16"]
    hybrid = profile_mamba.baseline_descriptions(_tiny_hybrid(), hybrid=True)
    assert set(hybrid) == {"quamba fp16", "transformers fp16"}
    assert "attention in SDPA" in hybrid["quamba fp16"]


def test_a_family_without_a_transformers_class_gets_no_transformers_row():
    assert profile_mamba.transformers_has("nemotron_h")
    assert not profile_mamba.transformers_has("no_such_hybrid")
    notes = {}
    args = Namespace(model=None, config="mamba2-8b")
    assert profile_mamba.baseline_rows(_tiny_hybrid(), None, args, 0.0, notes) == []
    assert "has no model class for this family" in notes["transformers_baseline"]


def test_a_failing_transformers_baseline_is_noted_not_fatal(monkeypatch):
    """transformers' model raising (a version's bug) leaves quamba's rows to run: the error is
    noted in one line (and the run's exit status says it, run_one)."""
    def broken(*args):
        raise AttributeError("'NoneType' object has no attribute 'nbytes'\nmore lines")
    monkeypatch.setattr(profile_mamba, "_transformers_row", broken)
    from types import SimpleNamespace
    notes = {}
    args = Namespace(model=None, config="nemotron-h-8b")
    model = SimpleNamespace(config=_tiny_hybrid().config, to=lambda device: None)  # no GPU here
    assert profile_mamba.baseline_rows(model, None, args, 0.0, notes) == []
    assert notes["transformers_baseline_error"] == ("AttributeError: 'NoneType' object has no "
                                                    "attribute 'nbytes'")


def test_a_hybrid_directorys_config_builds_transformers_baseline(tmp_path):
    """--model DIR: its config.json as published (Nemotron-H's names its remote code in auto_map,
    which is left out: the installed transformers' class is the baseline)."""
    import json
    from quamba.models.presets import NEMOTRON_H_8B
    auto_map = {"AutoConfig": "configuration_nemotron_h.NemotronHConfig",
                "AutoModelForCausalLM": "modeling_nemotron_h.NemotronHForCausalLM"}
    (tmp_path / "config.json").write_text(json.dumps(
        {**NEMOTRON_H_8B, "architectures": ["NemotronHForCausalLM"], "auto_map": auto_map,
         "torch_dtype": "bfloat16"}))
    raw = profile_mamba.transformers_config(Namespace(model=str(tmp_path), config="130m"))
    runner = profile_mamba.TransformersRunner(raw, device="meta")
    assert type(runner.model).__name__ == "NemotronHForCausalLM"
    assert sum(p.numel() for p in runner.model.parameters()) == 8_100_852_736


def test_first_sync_names_the_line_of_the_first_synchronizing_call(monkeypatch):
    """torch's sync debug mode warns at the Python line of a synchronizing call; first_sync
    returns the first such warning and ignores others (the mode itself needs a GPU: stubbed)."""
    common = pytest.importorskip("common")
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)

    def prefill():
        import warnings
        warnings.warn("an unrelated warning")
        warnings.warn("called a synchronizing CUDA operation")  # the line reported
        warnings.warn("called a synchronizing CUDA operation")

    where = common.first_sync(prefill)
    line = prefill.__code__.co_firstlineno + 3
    assert where == f"{__file__}:{line}: called a synchronizing CUDA operation"
    assert modes == ["warn", "default"]
    assert common.first_sync(lambda: None) is None
