"""main.py: help, flag spellings, argument errors (one line, status 2), and offline runs."""
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
TASK_DATA = SHARED_DATA / "eval"
TOKENIZER = str(SHARED_DATA / "tokenizers" / "gpt-neox-20b" / "tokenizer.json")


def _load_main():
    spec = importlib.util.spec_from_file_location("quamba_main", REPO / "main.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


main = _load_main()


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory):
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path_factory.mktemp("hf-datasets")))
    env.pop("QUAMBA_TASK_DATA", None)
    return env


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from quamba.models import MambaConfig, MambaLMHeadModel, randomize_, save_model
    model = randomize_(MambaLMHeadModel(MambaConfig(d_model=32, n_layer=2, vocab_size=50277)), seed=0)
    return save_model(model, tmp_path_factory.mktemp("models") / "tiny-random")


@pytest.fixture(scope="module")
def small_task_data(tmp_path_factory):
    """piqa, and only the first wikitext-2 test document (the whole file takes minutes on a CPU)."""
    data_dir = tmp_path_factory.mktemp("task-data")
    (data_dir / "piqa_validation.jsonl").write_text((TASK_DATA / "piqa_validation.jsonl").read_text())
    first_document = (TASK_DATA / "wikitext2_test_docs.jsonl").read_text().splitlines()[0]
    (data_dir / "wikitext2_test_docs.jsonl").write_text(first_document + "\n")
    return data_dir


def run_cli(args, env, cwd=None):
    return subprocess.run([sys.executable, str(REPO / "main.py"), *map(str, args)], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300)


def test_help_documents_every_flag(capsys):
    with pytest.raises(SystemExit) as exited:
        main.parse_args(["--help"])
    assert exited.value.code == 0
    text = capsys.readouterr().out
    parser, _ = main.build_parser()
    for action in parser._actions:
        assert action.help, action.dest
        for option in action.option_strings:
            assert option in text


def test_dashes_and_underscores_are_interchangeable():
    dashed = main.parse_args(["m", "--batch-size", "3", "--eval-ppl", "--ppl-window=64", "--no-hadamard",
                              "--log-dir", "x", "--task-list", "piqa", "--eval-zero-shot",
                              "--fp32_ssm_input"])
    underscored = main.parse_args(["m", "--batch_size", "3", "--eval_ppl", "--ppl_window=64",
                                   "--no_hadamard", "--log_dir", "x", "--task_list", "piqa",
                                   "--eval_zero_shot", "--fp32-ssm-input"])
    assert vars(dashed) == vars(underscored)
    assert dashed.batch_size == 3 and dashed.ppl_window == 64 and dashed.ssm_mode == "fp32-ssm-input"


def test_flags_map_onto_the_library():
    args = main.parse_args(["m", "--quantize", "--pretrained_dir", "p", "--calib_data", "c.txt",
                            "--calib_data_num", "16", "--eval_few_shot", "--testing",
                            "--float-sim-asic-int8"])
    request, plan = main.model_request(args), main.eval_plan(args)
    assert request.quantize and request.calib_source == "c.txt" and request.calib_num_samples == 16
    assert request.ssm_mode == "float-sim-asic-int8" and request.hadamard is None  # recipe's default
    assert main.model_request(main.parse_args(["m", "--eval_ppl", "--no-hadamard"])).hadamard is False
    assert plan.few_shot == main.DEFAULT_FEWSHOT and not plan.zero_shot
    assert plan.limit == 100  # --testing
    assert plan.tasks == main.DEFAULT_TASKS


def test_learn_scales_flags_reach_the_recipe():
    args = main.parse_args(["m", "--quantize", "--eval_ppl", "--learn-scales", "--learn_steps", "7"])
    config = main.model_request(args).quant_config()
    assert config.learn_scales and config.learn_steps == 7
    assert not main.model_request(main.parse_args(["m", "--quantize", "--eval_ppl"])).learn_scales
    args = main.parse_args(["m", "--quantize", "--eval_ppl", "--learn_scales", "--w_bits", "4",
                            "--learn_weight_clipping"])
    assert main.model_request(args).quant_config().learn_weight_clipping


@pytest.mark.parametrize("argv", [
    ["m", "--eval_ppl", "--ssm_mode", "int8", "--fp32-ssm-input"],
    ["m", "--eval_ppl", "--fp32-ssm-input", "--float-sim-asic-int8"],
    ["m", "--eval_ppl", "--ssm_mode", "int4"],
    ["m", "--eval_ppl", "--batch_size", "many"],
    ["m", "--eval-ppl", "--no-such-flag"],
    ["m", "--fewshot", "3", "--eval_zero_shot"],
    ["m"],  # nothing to do
    ["m", "--eval_ppl", "--learn_scales"],  # nothing quantized to learn scales for
    ["m", "--quantize", "--eval_ppl", "--learn_scales", "--w_bits", "4", "--a_bits", "16"],
    ["m", "--quantize", "--eval_ppl", "--w_bits", "4", "--learn_weight_clipping"],  # no learning pass
    ["m", "--quantize", "--eval_ppl", "--learn_scales", "--learn_weight_clipping"],  # 8-bit weights
    ["m", "--quantize", "--eval_ppl", "--learn_scales", "--w_bits", "4", "--learn_weight_clipping",
     "--apply_gptq"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exited:
        main.parse_args(argv)
    assert exited.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("main.py: error:")


def test_missing_model_is_one_line_and_status_2(offline_env, tmp_path):
    done = run_cli([tmp_path / "no-model", "--eval_ppl", "--log_dir", tmp_path], offline_env)
    assert done.returncode == 2
    missing = tmp_path / "no-model"
    assert done.stderr.strip().splitlines() == [f"error: model directory '{missing}' does not exist"]


def test_unknown_task_lists_the_known_ones(offline_env, model_dir, tmp_path):
    done = run_cli([model_dir, "--eval_zero_shot", "--task_list", "piqa,nope", "--task_data", TASK_DATA,
                    "--log_dir", tmp_path], offline_env)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: unknown task 'nope'; available: ")
    assert "lambada_openai" in lines[0] and "winogrande" in lines[0]
    assert not any(tmp_path.iterdir())


def test_eval_ppl_on_the_local_wikitext_file(offline_env, model_dir, small_task_data, tmp_path):
    done = run_cli([model_dir, "--tokenizer", TOKENIZER, "--eval-ppl", "--ppl-window", "256",
                    "--batch-size", "4", "--log-dir", tmp_path / "logs"],
                   dict(offline_env, QUAMBA_TASK_DATA=str(small_task_data)))
    assert done.returncode == 0, done.stderr
    assert "SSM mode fp16, backend" in done.stderr  # the start line
    assert "perplexity wikitext2:" in done.stdout
    runs = list((tmp_path / "logs").iterdir())
    assert len(runs) == 1
    record = json.loads(runs[0].read_text())
    ppl = record["perplexity"]
    assert "wikitext2_test_docs.jsonl" in ppl["source"] and ppl["window"] == 256
    assert ppl["perplexity"] > 1 and ppl["windows"] == -(-ppl["tokens"] // 256)
    assert record["config"]["plan"]["task_data"] == str(small_task_data)
    assert record["quamba_version"] and "total_s" in record["timings"]


def test_zero_shot_run_records_per_sample_correctness(model_dir, small_task_data, tmp_path, capsys,
                                                      monkeypatch, caplog):
    monkeypatch.setattr(main, "TESTING_LIMIT", 3)  # --testing, shortened for the test
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", Path(tempfile.mkdtemp(dir=tmp_path)))
    status = main.main([str(model_dir), "--tokenizer", TOKENIZER, "--eval_zero_shot", "--testing",
                        "--task_list", "piqa", "--task_data", str(small_task_data), "--batch_size", "2",
                        "--log_dir", str(tmp_path / "logs")])
    assert status == 0
    out = capsys.readouterr().out
    assert "piqa: acc " in out and "±" in out
    record = json.loads(next((tmp_path / "logs").iterdir()).read_text())
    per_sample = record["zero_shot"]["per_sample"]["piqa"]
    assert per_sample["doc_id"] == [0, 1, 2] and set(per_sample["acc,none"]) <= {0, 1}
    assert record["config"]["plan"]["limit"] == 3
    assert "each task is limited to 3 documents" in caplog.text


def test_quantize_saves_and_a_later_run_reuses_it_by_name(model_dir, tmp_path, capsys, caplog):
    pretrained = tmp_path / "pretrained"
    calibration = ["--calib_data", SHARED_DATA / "text" / "tinyshakespeare.txt", "--calib_data_num", "4",
                   "--calib_seqlen", "32"]
    assert main.main([str(a) for a in [model_dir, "--tokenizer", TOKENIZER, "--quantize",
                                       "--pretrained_dir", pretrained, *calibration]]) == 0
    saved = pretrained / "quamba-tiny-random-w8a8"
    assert (saved / "config.json").is_file()
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 5)
    caplog.clear()
    caplog.set_level(logging.INFO, logger="quamba")
    assert main.main([str(a) for a in ["quamba-tiny-random-w8a8", "--pretrained_dir", pretrained,
                                       "--fp32-ssm-input", "--eval_ppl", "--ppl_dataset", text,
                                       "--ppl_window", "32", "--log_dir", tmp_path / "logs"]]) == 0
    assert "W8A8 (hadamard), SSM mode fp32-ssm-input" in caplog.text
    record = json.loads(next((tmp_path / "logs").iterdir()).read_text())
    assert record["model"]["ssm_mode"] == "fp32-ssm-input"
    assert record["model"]["quant_config"]["calib_num_samples"] == 4
    assert record["perplexity"]["dataset"] == str(text)


def test_w4a8_from_the_command_line_and_unsupported_bits(model_dir, tmp_path, capsys):
    pretrained = tmp_path / "pretrained"
    calibration = ["--calib_data", SHARED_DATA / "text" / "tinyshakespeare.txt", "--calib_data_num", "4",
                   "--calib_seqlen", "32"]
    assert main.main([str(a) for a in [model_dir, "--tokenizer", TOKENIZER, "--quantize", "--w_bits", "4",
                                       "--group-size", "32", "--pretrained_dir", pretrained,
                                       *calibration]]) == 0
    config = json.loads((pretrained / "quamba-tiny-random-w4a8" / "config.json").read_text())
    assert config["quantization_config"]["w_bits"] == 4
    assert config["quantization_config"]["group_size"] == 32
    assert main.main([str(a) for a in [model_dir, "--tokenizer", TOKENIZER, "--quantize", "--a_bits", "16",
                                       "--pretrained_dir", pretrained, *calibration]]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: w_bits=8 a_bits=16 is not supported")


def test_gptq_flags_reach_the_recipe(model_dir, tmp_path, capsys):
    calibration = ["--calib_data", SHARED_DATA / "text" / "tinyshakespeare.txt", "--calib_data_num", "4",
                   "--calib_seqlen", "32"]
    gptq = ["--apply_gptq", "--gptq_data", SHARED_DATA / "text" / "tinyshakespeare.txt",
            "--gptq_data_num", "4", "--gptq_seqlen", "64", "--act_order"]
    pretrained = tmp_path / "pretrained"
    assert main.main([str(a) for a in [model_dir, "--tokenizer", TOKENIZER, "--quantize", "--w_bits", "4",
                                       "--group_size", "32", "--pretrained_dir", pretrained,
                                       *calibration, *gptq]]) == 0
    recipe = json.loads((pretrained / "quamba-tiny-random-w4a8" / "config.json").read_text())
    recipe = recipe["quantization_config"]
    assert recipe["apply_gptq"] and recipe["gptq_act_order"] and recipe["gptq_seqlen"] == 64
    assert main.main([str(a) for a in [model_dir, "--tokenizer", TOKENIZER, "--quantize",
                                       "--pretrained_dir", pretrained, *calibration, *gptq]]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        "error: GPTQ applies to 4-bit weights; use it with w_bits=4"


def test_w4a16_from_the_command_line_and_reuse(model_dir, tmp_path, capsys, caplog):
    """No calibration (the default calibration source is on the Hub, so reading it offline
    would fail), GPTQ with act-order, then reuse by recipe; SSM mode flags are errors."""
    pretrained = tmp_path / "pretrained"
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 5)
    w4a16 = [model_dir, "--tokenizer", TOKENIZER, "--quantize", "--w_bits", "4", "--a_bits", "16",
             "--group_size", "32", "--pretrained_dir", pretrained, "--apply_gptq", "--gptq_data",
             SHARED_DATA / "text" / "tinyshakespeare.txt", "--gptq_data_num", "4",
             "--gptq_seqlen", "64", "--act_order", "--eval_ppl", "--ppl_dataset", text,
             "--ppl_window", "32"]
    caplog.set_level(logging.INFO, logger="quamba")
    assert main.main([str(a) for a in [*w4a16, "--log_dir", tmp_path / "first"]]) == 0
    recorded = json.loads((pretrained / "quamba-tiny-random-w4a16" / "config.json").read_text())
    recorded = recorded["quantization_config"]
    assert (recorded["w_bits"], recorded["a_bits"], recorded["group_size"]) == (4, 16, 32)
    assert recorded["apply_gptq"] and recorded["gptq_act_order"] and not recorded["hadamard"]
    assert recorded["ssm_mode"] == "fp16" and recorded["format_version"] == 5
    assert "W4A16 (no hadamard), SSM mode fp16" in caplog.text
    # calibration flags do not belong to a W4A16 recipe; the default mode may be named
    assert main.main([str(a) for a in [*w4a16, "--calib_data_num", "8", "--ssm_mode", "fp16",
                                       "--log_dir", tmp_path / "second"]]) == 0
    first, second = (json.loads(next((tmp_path / run).iterdir()).read_text())
                     for run in ("first", "second"))
    assert second["model"]["how"] == "reused saved quantized model"
    assert second["perplexity"]["perplexity"] == first["perplexity"]["perplexity"]
    capsys.readouterr()
    assert main.main([str(a) for a in [*w4a16, "--fp32-ssm-input", "--log_dir", tmp_path]]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "error: SSM mode 'fp32-ssm-input' needs 8-bit activations; a W4A16 model runs conv1d "
        "and the scan in its float dtype, so its only SSM mode is fp16")
    assert main.main([str(a) for a in ["quamba-tiny-random-w4a16", "--pretrained_dir", pretrained,
                                       "--ssm_mode", "int8", "--eval_ppl", "--ppl_dataset", text,
                                       "--log_dir", tmp_path]]) == 2
    assert "error: SSM mode 'int8' needs 8-bit activations" in capsys.readouterr().err


def test_vision_classifier_quantized_and_evaluated_on_digits(tiny_vim_dir, tmp_path, capsys):
    pretrained, logs = tmp_path / "pretrained", tmp_path / "logs"
    argv = [tiny_vim_dir, "--quantize", "--calib_data", "digits", "--calib_data_num", "64",
            "--pretrained_dir", pretrained, "--eval_image", "digits", "--log_dir", logs]
    assert main.main([str(a) for a in argv]) == 0
    assert "top-1 digits-test: 0.9" in capsys.readouterr().out
    record = json.loads(next(logs.iterdir()).read_text())
    result = record["image_classification"]
    assert result["num_images"] == 360 and len(result["correct"]) == 360
    assert record["model"]["quant_config"]["calib_source"] == "digits"
    assert (pretrained / "quamba-tiny-vim-w8a8" / "config.json").is_file()
    assert main.main([str(a) for a in ["quamba-tiny-vim-w8a8", "--pretrained_dir", pretrained,
                                       "--fp32-ssm-input", "--eval_image", "digits", "--log_dir", logs]]) == 0


@pytest.mark.parametrize("argv, message", [
    (["--eval_image", "digits", "--eval_ppl"], "image classification and language tasks"),
    (["--eval_ppl"], "evaluate it with --eval_image"),
    (["--eval_image", "no-such-dir"], "neither digits nor a directory"),
    (["--quantize", "--eval_image", str(REPO / "tests" / "fixtures")], "no train split"),
])
def test_vision_flag_mistakes_are_one_line_errors(tiny_vim_dir, tmp_path, capsys, argv, message):
    assert main.main([str(tiny_vim_dir), *argv, "--log_dir", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]


def test_eval_image_needs_a_classifier(model_dir, tmp_path, capsys):
    argv = [str(model_dir), "--tokenizer", TOKENIZER, "--eval_image", "digits", "--log_dir", str(tmp_path)]
    assert main.main(argv) == 2
    assert "needs a Vision Mamba classifier" in capsys.readouterr().err


def test_mamba2_mixed_precision_from_the_command_line(tiny_mamba2_dir, tmp_path, caplog):
    """The trained Mamba2 model quantized W4A8 with a quarter of its layers W4A16, saved under a
    name that says so, evaluated, and reused by a second run with the same recipe."""
    pretrained = tmp_path / "pretrained"
    text = tmp_path / "text.txt"
    text.write_text("The history of the city begins with a small settlement by the river. " * 20)
    argv = [tiny_mamba2_dir, "--quantize", "--w_bits", "4", "--group_size", "64",
            "--mixed_precision", "0.25", "--pretrained_dir", pretrained, "--calib_data",
            SHARED_DATA / "text" / "c4_sample.jsonl", "--calib_data_num", "8", "--calib_seqlen", "64",
            "--eval_ppl", "--ppl_dataset", text, "--ppl_window", "64"]
    assert main.main([str(a) for a in [*argv, "--log_dir", tmp_path / "first"]]) == 0
    config = json.loads((pretrained / "quamba-tiny-mamba2-w4a8-mixed0.25" / "config.json").read_text())
    recipe = config["quantization_config"]
    assert config["model"]["layer"] == "Mamba2" and recipe["mixed_precision"] == 0.25
    assert sorted(map(tuple, recipe["layer_bits"])) == [(4, 8)] * 3 + [(4, 16)]
    assert len(recipe["calibration"]["layer_sensitivity"]) == 4
    first = json.loads(next((tmp_path / "first").iterdir()).read_text())["perplexity"]["perplexity"]
    caplog.set_level(logging.INFO, logger="quamba")
    assert main.main([str(a) for a in [*argv, "--log_dir", tmp_path / "second"]]) == 0
    assert "reusing" in caplog.text
    second = json.loads(next((tmp_path / "second").iterdir()).read_text())["perplexity"]["perplexity"]
    assert second == first


def test_vision_quantize_calibrates_on_the_eval_sets_train_split(tiny_vim_dir, tmp_path, capsys):
    """No --calib_data: a Vision Mamba model quantized for --eval_image digits calibrates on
    digits' train split (disjoint from the test split it is evaluated on)."""
    logs = tmp_path / "logs"
    argv = [tiny_vim_dir, "--quantize", "--eval_image", "digits", "--calib_data_num", "16",
            "--log_dir", logs]
    assert main.main([str(a) for a in argv]) == 0
    assert "top-1 digits-test: 0.9" in capsys.readouterr().out
    record = json.loads(next(logs.iterdir()).read_text())
    assert record["image_classification"]["top1"] > 0.9
    assert record["model"]["quant_config"]["calib_source"] == "digits"
    assert record["model"]["calibration"]["source"] == "digits-train"
    assert record["model"]["calibration"]["num_samples"] == 16


# --- bad inputs: one `error:` line on stderr, status 2, nothing written ------------------------

def _only_error_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_device_cuda_without_cuda_is_one_line(offline_env, tmp_path):
    """The real command on this torch (CPU-only here): refused before the model is loaded."""
    done = run_cli([REPO / "tests" / "fixtures" / "tiny-mamba", "--eval_ppl", "--device", "cuda",
                    "--log_dir", tmp_path / "logs"], offline_env, cwd=tmp_path)
    assert done.returncode == 2
    line = _only_error_line(done.stderr)
    if torch.version.cuda is None and torch.version.hip is None:
        assert line.startswith(f"error: --device cuda: this torch ({torch.__version__}) was built "
                               "without CUDA")
    else:
        assert line.startswith("error: --device cuda: no CUDA device is visible")
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("device, built_with, count, message", [
    ("cuda", None, 0, "error: --device cuda: this torch (2.0.0+cpu) was built without CUDA; use "
                      "--device cpu, or install a CUDA build of torch"),
    ("cuda:1", "12.4", 0, "error: --device cuda:1: no CUDA device is visible; use --device cpu"),
    ("cuda:7", "12.4", 1, "error: --device cuda:7: there is no CUDA device 7; 1 is visible "
                          "(cuda:0)"),
    ("cuda:2", "12.4", 2, "error: --device cuda:2: there is no CUDA device 2; 2 are visible "
                          "(cuda:0 to cuda:1)"),
    ("gpu", None, 0, "error: --device 'gpu' is not a torch device (e.g. cpu, cuda, cuda:1)"),
])
def test_device_that_is_not_there_is_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch,
                                              device, built_with, count, message):
    """Whatever torch and GPUs the machine has, each case as that machine would see it."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch, "__version__", "2.0.0+cpu" if built_with is None else "2.0.0+cu124")
    monkeypatch.setattr(torch.version, "cuda", built_with)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    argv = [str(tiny_model_dir), "--quantize", "--eval_ppl", "--device", device,
            "--pretrained_dir", str(tmp_path / "pretrained"), "--log_dir", str(tmp_path / "logs")]
    assert main.main(argv) == 2
    assert _only_error_line(capsys.readouterr().err) == message
    assert not any(tmp_path.iterdir())


def test_log_dir_naming_a_file_is_one_line(offline_env, tmp_path):
    log_file = tmp_path / "logs"
    log_file.write_text("not a directory\n")
    done = run_cli([REPO / "tests" / "fixtures" / "tiny-mamba", "--eval_ppl", "--log_dir",
                    log_file], offline_env, cwd=tmp_path)
    assert done.returncode == 2
    assert _only_error_line(done.stderr) == \
        f"error: --log_dir {log_file} names an existing file, not a directory"
    assert [p.name for p in tmp_path.iterdir()] == ["logs"]
    assert log_file.read_text() == "not a directory\n"


@pytest.mark.parametrize("flag, under, message", [
    ("--log_dir", "file/logs", "error: --log_dir {target}: {file} is a file, not a directory"),
    ("--pretrained_dir", "file", "error: --pretrained_dir {target} names an existing file, not a "
                                 "directory"),
])
def test_output_directory_under_a_file_is_one_line(tiny_model_dir, tmp_path, capsys, flag, under,
                                                   message):
    """A file where a directory is to be made, refused before loading (not after quantizing)."""
    file = tmp_path / "file"
    file.write_text("x\n")
    target = tmp_path / under
    argv = [str(tiny_model_dir), "--quantize", "--eval_ppl", "--log_dir", str(tmp_path / "logs"),
            flag, str(target)]
    assert main.main(argv) == 2
    assert _only_error_line(capsys.readouterr().err) == message.format(target=target, file=file)
    assert [p.name for p in tmp_path.iterdir()] == ["file"] and file.read_text() == "x\n"


def test_the_hybrid_test_model_quantizes_and_is_reused_by_name(tmp_path, caplog):
    """tests/fixtures/tiny-hybrid (Nemotron-H: Mamba2, attention and MLP layers): quantized and
    saved W8A8, then evaluated by its saved name in another SSM mode."""
    from tests.models.test_fixture_hybrid import TINY_HYBRID_DIR
    pretrained = tmp_path / "pretrained"
    calibration = ["--calib_data", SHARED_DATA / "text" / "tinyshakespeare.txt", "--calib_data_num",
                   "4", "--calib_seqlen", "32"]
    assert main.main([str(a) for a in [TINY_HYBRID_DIR, "--quantize", "--pretrained_dir",
                                       pretrained, *calibration]]) == 0
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 5)
    caplog.set_level(logging.INFO, logger="quamba")
    assert main.main([str(a) for a in ["quamba-tiny-hybrid-w8a8", "--pretrained_dir", pretrained,
                                       "--ssm_mode", "fp32-conv", "--eval_ppl", "--ppl_dataset",
                                       text, "--ppl_window", "32", "--log_dir",
                                       tmp_path / "logs"]]) == 0
    assert "W8A8 (hadamard), SSM mode fp32-conv" in caplog.text
    record = json.loads(next((tmp_path / "logs").iterdir()).read_text())
    assert record["model"]["ssm_mode"] == "fp32-conv"
    assert 1 < record["perplexity"]["perplexity"] < 4096
