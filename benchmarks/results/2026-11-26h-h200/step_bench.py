"""GPU time (graph replays, cold copies) of the decode scan step: quamba's layouts, int8 and fp32
state, against mamba-ssm's Triton selective_state_update loaded from the sdist's source."""
import importlib.util, json, os, sys, types, glob
import torch
import quamba._C  # noqa: F401
sys.path.insert(0, "benchmarks"); sys.path.insert(0, ".")
import common, bench_ssm as bs

def load_mamba_step():
    root = glob.glob("/tmp/msdist/mamba_ssm-*/")[0]
    for name in ("mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        m = types.ModuleType(name); m.__path__ = [root + name.replace(".", "/")]; sys.modules[name] = m
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    return selective_state_update

fn = load_mamba_step() if len(sys.argv) <= 3 or "mamba" in sys.argv[3] else None
D, N = bs.D_INNER, bs.D_STATE
rows = []
for batch in [int(b) for b in sys.argv[1].split(",")]:
    params = bs.ssm_params()
    def ours(lanes, fp32):
        def make(_):
            state = (torch.randn(batch, D, N, device="cuda") if fp32 else bs.codes(batch, D, N))
            u, dt, z = bs.codes(batch, D), bs.codes(batch, D), bs.codes(batch, D)
            x_dbl = bs.codes(batch, 160 + 2 * N)
            B, C = x_dbl[:, 160:160 + N], x_dbl[:, 160 + N:]
            args = bs._step_op_args(state, u, dt, B, C, z, params)
            if fp32:
                args = (state, 0.0) + args[2:]
            return lambda: torch.ops.quamba.qsscan_update(*args, lanes=lanes)
        return make
    def theirs(dtype):
        def make(_):
            half = dict(dtype=torch.float16, device="cuda")
            state = torch.randn(batch, D, N, dtype=dtype, device="cuda")
            x, dt, z = (torch.randn(batch, D, **half) for _ in range(3))
            B, C = (torch.randn(batch, N, **half) for _ in range(2))
            A = -torch.rand(D, N, device="cuda") * 16
            Dk, bias = torch.ones(D, device="cuda"), torch.full((D,), -4.0, device="cuda")
            return lambda: fn(state, x, dt, A, B, C, Dk, z=z, dt_bias=bias, dt_softplus=True)
        return make
    state_bytes = batch * D * N
    for name, make, nbytes in [("mamba fp32 state", theirs(torch.float32), 8 * state_bytes),
                               ("mamba fp16 state", theirs(torch.float16), 4 * state_bytes),
                               ("quamba int8 1 lane", ours(1, False), 2 * state_bytes),
                               ("quamba int8 4 lanes", ours(4, False), 2 * state_bytes),
                               ("quamba int8 16 lanes", ours(16, False), 2 * state_bytes),
                               ("quamba int8 chosen", ours(0, False), 2 * state_bytes),
                               ("quamba fp32 1 lane", ours(1, True), 8 * state_bytes),
                               ("quamba fp32 4 lanes", ours(4, True), 8 * state_bytes),
                               ("quamba fp32 chosen", ours(0, True), 8 * state_bytes)]:
        if len(sys.argv) > 3 and sys.argv[3] not in name:
            continue
        try:
            us = 1e3 * common.time_graph_ms(make, nbytes)
        except Exception as exc:
            print(name, batch, "failed", str(exc).splitlines()[0]); continue
        rows.append({"name": name, "batch": batch, "us": us})
        print(f"{name:22s} b{batch:4d} {us:8.2f} us", flush=True)
if len(sys.argv) > 2:
    json.dump(rows, open(sys.argv[2], "w"), indent=1)
