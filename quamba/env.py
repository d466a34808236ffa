"""``python -m quamba.env``: the environment a bug report needs, and whether quamba's kernels run.

Prints torch, CUDA and the GPU; whether ``quamba._C`` loads (else the import error's text), the
architectures it was built for and its kernel families; whether mamba-ssm's and causal-conv1d's
kernels (the FP16 baseline) load; and, per op, the backend that ``auto`` picks on the GPU with the
reason wherever that is the slow torch reference. ``--json`` prints the same as JSON; ``--strict``
exits with status 1 when a GPU is present and any quantized op would run its torch reference.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import json
import os
import platform
import sys

import torch

from quamba.eval.run import git_state
from quamba.ops import backend, fp_kernels

# The kernel families of csrc/ and a torch.ops.quamba op that each one registers.
KERNEL_FAMILIES = {
    "gemm": "w8a8_linear",
    "gemm4": "w4a8_linear",
    "conv1d": "qconv1d",
    "qsscan": "qsscan",
    "norm": "rmsnorm_quant",
    "fused_decode": "qmamba_layer_step",
}
PACKAGES = ("torch", "triton", "transformers", "lm_eval", "mamba_ssm", "causal_conv1d",
            "nvidia-cutlass")


def collect() -> dict:
    """Everything the report prints, as plain data."""
    import quamba  # the package itself: version and where it is imported from
    info = {
        "quamba": {"version": quamba.__version__, "path": os.path.dirname(quamba.__file__),
                   "git": git_state()},
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "torch_cuda": torch.version.cuda,
        "gpus": _gpus(),
        "QUAMBA_BACKEND": os.environ.get("QUAMBA_BACKEND"),
        "extension": _extension(),
        "fp_kernels": fp_kernels.missing() or "ok",
    }
    if info["gpus"]:
        device = torch.device("cuda", torch.cuda.current_device())
        info["ops_on_gpu"] = {op: {"backend": name, "reason": reason}
                              for op, (name, reason) in backend.plan(device).items()}
    return info


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpus() -> list[dict]:
    if not torch.cuda.is_available():
        return []
    gpus = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        gpus.append({"index": index, "name": props.name, "capability": f"{props.major}.{props.minor}",
                     "memory_gib": round(props.total_memory / 2**30, 1),
                     "multiprocessors": props.multi_processor_count})
    return gpus


def _extension() -> dict:
    spec = importlib.util.find_spec("quamba._C")
    error = backend.cuda_extension_error()
    info = {"file": spec.origin if spec else None, "loads": error is None, "error": error}
    if error is None:
        info["cuda_archs"] = backend.cuda_archs() or None
        info["families"] = {family: hasattr(torch.ops.quamba, op)
                            for family, op in KERNEL_FAMILIES.items()}
        info["device_errors"] = {str(gpu["index"]): backend.device_error(gpu["index"])
                                 for gpu in _gpus()}
    return info


def format_report(info: dict) -> str:
    git = info["quamba"]["git"]
    commit = f"{git['commit'][:7]}{' with local changes' if git['dirty'] else ''}" if git else "unknown"
    lines = [f"quamba {info['quamba']['version']} (commit {commit}) from {info['quamba']['path']}",
             f"python {info['python']} on {info['platform']}",
             "packages: " + ", ".join(f"{name} {version or '-'}"
                                      for name, version in info["packages"].items()),
             f"torch CUDA: {info['torch_cuda'] or 'none (a CPU build)'}"]
    for gpu in info["gpus"] or []:
        lines.append(f"GPU {gpu['index']}: {gpu['name']}, compute capability {gpu['capability']}, "
                     f"{gpu['memory_gib']} GiB, {gpu['multiprocessors']} SMs")
    if not info["gpus"]:
        lines.append("GPU: none visible (every op runs its torch reference)")
    lines.append(f"QUAMBA_BACKEND: {info['QUAMBA_BACKEND'] or 'unset (auto)'}")
    ext = info["extension"]
    lines.append(f"quamba._C: {ext['file'] or 'no file found'}")
    if ext["loads"]:
        families = ", ".join(f"{name} {'yes' if present else 'NO'}"
                             for name, present in ext["families"].items())
        lines.append(f"  loads: yes; built for {ext['cuda_archs'] or 'unknown'}; families: {families}")
        for index, error in ext["device_errors"].items():
            lines.append(f"  GPU {index}: {error or 'kernels run here'}")
    else:
        lines.append(f"  loads: NO: {ext['error']}")
    lines.append(f"mamba-ssm / causal-conv1d kernels: {info['fp_kernels']}")
    if "ops_on_gpu" in info:
        lines.append("ops on the GPU with the requested backend:")
        for op, choice in info["ops_on_gpu"].items():
            reason = f"  ({choice['reason']})" if choice["reason"] else ""
            lines.append(f"  {op:28s} {choice['backend']}{reason}")
    return "\n".join(lines)


def slow_quantized_ops(info: dict) -> list[str]:
    """Quantized ops that would run their torch reference (or be refused) on the GPU."""
    quantized = set(backend.quamba_ops())
    return [op for op, choice in info.get("ops_on_gpu", {}).items()
            if op in quantized and choice["backend"] != "cuda"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m quamba.env", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if a GPU is present and a quantized op would run its torch reference")
    args = parser.parse_args(argv)
    info = collect()
    print(json.dumps(info, indent=2) if args.json else format_report(info))
    slow = slow_quantized_ops(info)
    if args.strict and slow:
        print(f"error: on the GPU these quantized ops would run their torch reference: {', '.join(slow)}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
