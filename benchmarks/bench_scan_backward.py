"""Forward + backward of Mamba1's selective scan on the GPU (training): quamba's fused Triton
kernels (``trainable_selective_scan`` on ``cuda``, quamba.ops.scan.trainable_scan_triton) against
autograd through the torch reference and mamba-ssm's ``selective_scan_fn`` (CUDA, zoh only) where it
is installed. Shapes: d_inner 1536, d_state 16, L 2048, batch 1 and 8, with D, z, Δ bias and
softplus as Mamba's mixer uses them; fp32 inputs (and bf16 u, Δ, B, C, z for the kernels).
Times: the median of fwd + bwd (autograd.grad of y against a fixed dy), per discretization for
the fused kernels (mamba-ssm and the reference at zoh).

    python benchmarks/bench_scan_backward.py --out results_scan_backward.json [--quick] [--sweep]
"""
from __future__ import annotations

import common
import torch

from quamba.ops.scan import trainable_scan_triton
from quamba.ops.scan.trainable_scan import FUSED_METHODS, trainable_selective_scan

DEVICE = torch.device("cuda")
D_INNER, D_STATE, SEQLEN = 1536, 16, 2048
BATCHES = (1, 8)
NAMES = ("u", "delta", "A", "B", "C", "D", "z", "delta_bias")
COLUMNS = ["batch", "dtype", "method", "fused_fwd_us", "fused_us", "mamba_ssm_us", "reference_us",
           "vs_reference", "vs_mamba_ssm"]


def inputs(batch, dtype):
    """Mamba-like inputs needing gradients: A = -(1..16) per channel, Δ = softplus(δ + bias)."""
    def rand(*shape, scale=1.0, shift=0.0, dt=dtype):
        return (torch.randn(*shape, device=DEVICE) * scale + shift).to(dt).requires_grad_()
    A = -torch.arange(1, D_STATE + 1, dtype=torch.float32, device=DEVICE).repeat(D_INNER, 1)
    return dict(u=rand(batch, D_INNER, SEQLEN), delta=rand(batch, D_INNER, SEQLEN, scale=0.5),
                A=A.requires_grad_(), B=rand(batch, D_STATE, SEQLEN), C=rand(batch, D_STATE, SEQLEN),
                D=rand(D_INNER, dt=torch.float32), z=rand(batch, D_INNER, SEQLEN),
                delta_bias=rand(D_INNER, scale=0.5, shift=-4.0, dt=torch.float32))


def forward_backward(scan, values):
    """A call running ``scan`` and the gradients of its y for every input."""
    dy = torch.randn(values["u"].shape, device=DEVICE, dtype=values["u"].dtype)
    tensors = list(values.values())

    def call():
        y = scan(**values)[0]
        return torch.autograd.grad(y, tensors, dy)
    return call


def fused(method, **options):
    if options:
        return lambda **v: trainable_scan_triton.selective_scan(**v, delta_softplus=True,
                                                      discretization=method, **options)
    return lambda **v: trainable_selective_scan(**v, delta_softplus=True, discretization=method,
                                                backend_name="cuda")


def reference(**values):
    return trainable_selective_scan(**values, delta_softplus=True, backend_name="torch")


def mamba_ssm_scan():
    try:
        from mamba_ssm.ops.selective_scan_interface import selective_scan_fn
    except ImportError as exc:
        return None, f"mamba-ssm not installed ({exc}): no mamba_ssm_us column"
    return (lambda **v: (selective_scan_fn(**v, delta_softplus=True),)), None


def sweep(rep_ms):
    """fwd + bwd of the fused zoh scan at batch 1 per (chunk, block_d)."""
    values = inputs(1, torch.float32)
    rows = []
    for chunk in (16, 32, 64):
        for block_d in (4, 8, 16):
            call = forward_backward(fused("zoh", chunk=chunk, block_d=block_d), values)
            rows.append({"chunk": chunk, "block_d": block_d,
                         "fused_us": 1e3 * common.time_ms(call, rep_ms=rep_ms)})
    return rows


def main():
    args = common.parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--sweep", action="store_true", help="also time the fused kernels' chunk and block sizes"))
    torch.manual_seed(0)
    baseline, note = mamba_ssm_scan()
    rep_ms = 30 if args.quick else 200
    rows = []
    for batch in BATCHES:
        for dtype in (torch.float32, torch.bfloat16):
            values = inputs(batch, dtype)
            for method in FUSED_METHODS:
                row = {"batch": batch, "dtype": str(dtype).split(".")[1], "method": method}
                with torch.no_grad():
                    row["fused_fwd_us"] = 1e3 * common.time_ms(
                        lambda: fused(method)(**values), rep_ms=rep_ms)
                row["fused_us"] = 1e3 * common.time_ms(forward_backward(fused(method), values),
                                                       rep_ms=rep_ms)
                if method == "zoh" and baseline is not None:
                    row["mamba_ssm_us"] = 1e3 * common.time_ms(
                        forward_backward(baseline, values), rep_ms=rep_ms)
                    row["vs_mamba_ssm"] = row["fused_us"] / row["mamba_ssm_us"]
                if method == "zoh" and dtype == torch.float32:
                    row["reference_us"] = 1e3 * common.time_ms(
                        forward_backward(reference, values), warmup_ms=1, rep_ms=1)
                    row["vs_reference"] = row["reference_us"] / row["fused_us"]
                rows.append(row)
    meta = common.run_metadata()
    title = (f"Selective scan fwd+bwd on {meta['device']} (d_inner {D_INNER}, d_state {D_STATE}, "
             f"L {SEQLEN}; vs_reference = reference / fused, vs_mamba_ssm = fused / mamba-ssm)")
    print(common.format_table(rows, COLUMNS, title))
    payload = {"meta": meta, "backends": {"fused": "cuda (Triton)", "reference": "torch"},
               "rows": rows, "notes": [note] if note else []}
    if args.sweep:
        payload["sweep"] = sweep(rep_ms)
        print(common.format_table(payload["sweep"], ["chunk", "block_d", "fused_us"],
                                  "fused zoh fwd+bwd, batch 1, fp32"))
    if note:
        print("note:", note)
    common.write_json(args.out, payload)


if __name__ == "__main__":
    main()
