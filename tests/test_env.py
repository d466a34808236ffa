"""``python -m quamba.env``: the bug-report environment, on a machine without a GPU."""
import json
import subprocess
import sys

from quamba import env


def test_report_names_the_software_and_why_the_extension_does_not_load():
    info = env.collect()
    assert info["packages"]["torch"] and info["quamba"]["version"]
    report = env.format_report(info)
    assert "quamba._C:" in report and "mamba-ssm / causal-conv1d kernels:" in report
    if not info["extension"]["loads"]:  # the CPU suite: no extension built
        assert f"loads: NO: {info['extension']['error']}" in report
    if not info["gpus"]:
        assert "GPU: none visible" in report and env.slow_quantized_ops(info) == []


def test_runs_as_a_module_and_prints_json(repo_root):
    done = subprocess.run([sys.executable, "-m", "quamba.env", "--json", "--strict"], cwd=repo_root,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    assert {"quamba", "packages", "gpus", "extension", "fp_kernels"} <= set(info)
    assert info["extension"]["loads"] == (info["extension"]["error"] is None)


def test_strict_fails_when_a_quantized_op_would_run_its_reference_on_the_gpu(monkeypatch, capsys):
    info = {"ops_on_gpu": {"w8a8_linear": {"backend": "torch", "reason": "not built"},
                           "selective_scan": {"backend": "torch", "reason": "mamba-ssm missing"}}}
    monkeypatch.setattr(env, "collect", lambda: info)
    monkeypatch.setattr(env, "format_report", lambda info: "report")
    assert env.main(["--strict"]) == 1
    assert "w8a8_linear" in capsys.readouterr().err
    assert env.main([]) == 0
