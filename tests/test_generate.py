"""generate.py on the CPU with the test model: text out, timings, flag errors (status 2)."""
import pytest
import torch

import generate


def test_generates_text_from_a_prompt(tiny_model_dir, capsys):
    assert generate.main([str(tiny_model_dir), "--prompt", "The king said", "--genlen", "6"]) == 0
    out, err = capsys.readouterr()
    assert out.startswith("The king said") and len(out.strip()) > len("The king said")
    assert "6 new tokens x batch 1 after a" in err
    assert "backends: " in err and "selective_scan torch" in err  # the CPU runs the references


def test_random_prompt_batch_and_sampling(tiny_model_dir, capsys):
    argv = [str(tiny_model_dir), "--promptlen", "9", "--genlen", "4", "--batch", "2", "--topk", "5",
            "--temperature", "0.7", "--ignore_eos"]
    assert generate.main(argv) == 0
    out, err = capsys.readouterr()
    assert len(out.strip().splitlines()) >= 2  # one continuation per row
    assert "4 new tokens x batch 2 after a 9-token prompt" in err


def test_streaming_prints_the_same_text(tiny_model_dir, capsys):
    argv = [str(tiny_model_dir), "--prompt", "The king said", "--genlen", "8", "--ignore_eos"]
    generate.main(argv)
    plain = capsys.readouterr().out
    generate.main(argv + ["--streaming"])
    streamed = capsys.readouterr().out
    assert streamed.strip() == plain.strip()


def test_cache_graph_on_the_cpu_is_a_clear_error(tiny_model_dir, capsys):
    assert generate.main([str(tiny_model_dir), "--genlen", "2", "--cache_graph"]) == 2
    assert "error: CUDA graphs need a CUDA device" in capsys.readouterr().err


def test_prefill_graph_on_the_cpu_is_a_clear_error(tiny_model_dir, capsys):
    argv = [str(tiny_model_dir), "--genlen", "2", "--cache_graph", "--prefill_graph"]
    assert generate.main(argv) == 2
    assert "error: CUDA graphs need a CUDA device" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--prefill_graph"], "--prefill_graph replays the prefill into the decode graphs' cache: use it with "
                          "--cache_graph"),
    (["--batch", "2", "--streaming"], "--streaming prints one sequence"),
    (["--genlen", "0"], "--genlen must be positive"),
    (["--prompt", "a", "--promptlen", "3"], "not allowed with argument"),
])
def test_bad_flags_exit_2(tiny_model_dir, capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        generate.parse_args([str(tiny_model_dir)] + argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_device_cuda_without_cuda_is_one_line(tiny_model_dir, tmp_path, capsys, monkeypatch):
    """--device cuda where torch has no CUDA: one line, status 2, nothing loaded or written."""
    monkeypatch.setattr(torch, "__version__", "2.0.0+cpu")
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert generate.main([str(tiny_model_dir), "--genlen", "2", "--device", "cuda"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.strip().splitlines() == [
        "error: --device cuda: this torch (2.0.0+cpu) was built without CUDA; use --device cpu, or "
        "install a CUDA build of torch"]
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("family, builder", [
    ("test_bamba", "random_reference"), ("test_granite_hybrid", "random_reference"),
    ("test_falcon_h1", "random_reference"), ("test_zamba2", "random_reference"),
    ("test_jamba", "random_reference"), ("test_falcon_mamba", "random_falcon_mamba")])
def test_every_family_generates(family, builder, tiny_model_dir, tmp_path, capsys):
    """A small random model of each family in transformers' layout (the test model's tokenizer
    beside it) generates a batch from a random prompt."""
    import importlib
    import shutil
    getattr(importlib.import_module(f"tests.models.{family}"), builder)().save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    argv = [str(tmp_path), "--promptlen", "5", "--genlen", "3", "--batch", "2", "--ignore_eos"]
    assert generate.main(argv) == 0
    err = capsys.readouterr().err
    assert "unquantized" in err and "3 new tokens x batch 2 after a 5-token prompt" in err


def test_a_prompt_past_the_models_vocabulary_is_a_one_line_error(tiny_model_dir, tmp_path, capsys):
    """A random Bamba of 97 tokens beside the test model's tokenizer of 4096: a text prompt's ids
    reach past the embedding, said in one line."""
    import shutil
    from tests.models.test_bamba import random_reference
    random_reference().save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model_dir / name, tmp_path / name)
    capsys.readouterr()  # save_pretrained's progress
    assert generate.main([str(tmp_path), "--prompt", "The king said the queen", "--genlen", "2"]) != 0
    error = capsys.readouterr().err.strip().splitlines()[-1]  # after the model's summary line
    assert error.startswith("error: the prompt: token id") and "vocabulary of 97" in error


def test_the_hybrid_test_model_generates_quantized(shared_data_dir, tmp_path, capsys):
    """tests/fixtures/tiny-hybrid (Nemotron-H) quantized W8A8 on the fly: text out, and its
    Mamba2 layers on the int8 ops."""
    from tests.models.test_fixture_hybrid import TINY_HYBRID_DIR
    argv = [str(TINY_HYBRID_DIR), "--quantize", "--calib_data",
            str(shared_data_dir / "text" / "c4_sample.jsonl"), "--calib_data_num", "4",
            "--calib_seqlen", "32", "--prompt", "The king said", "--genlen", "5", "--ignore_eos"]
    assert generate.main(argv) == 0
    out, err = capsys.readouterr()
    assert out.startswith("The king said") and len(out.strip()) > len("The king said")
    assert "W8A8 (hadamard), SSM mode int8" in err and "qssd_scan torch" in err
