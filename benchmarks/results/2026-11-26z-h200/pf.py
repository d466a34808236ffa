"""L2 prefetch experiment: Mamba-2.8B decode TPOT (graph replay) with the out_proj weight (and the next
layer's in_proj weight) prefetched to L2 while the step's small kernels run. argv: out.json [batches]."""
import json, sys, time
import torch
sys.path.insert(0, "benchmarks")
import profile_mamba as pm
from common import median_ms
from quamba.ops import backend

out_path = sys.argv[1]
batches = [int(b) for b in (sys.argv[2] if len(sys.argv) > 2 else "1,8").split(",")]
precisions = (sys.argv[3] if len(sys.argv) > 3 else "w8a8,w4a8").split(",")
args = pm.parse_args(["--config", "2.8b", "--no_baseline"])
torch.manual_seed(0)
fp = pm.fp_model_for(args).eval()

# name: {position: (what, blocks, chunk, wait_first, bulk)}
MODES = {
    "none": {},
    "side_out": {"side": ("out", 32, 16384, True, True)},
    "side_outin": {"side": ("outin", 32, 16384, True, True)},
    "side_outin_nowait": {"side": ("outin", 32, 16384, False, True)},
    "side_outin_b132_c4k": {"side": ("outin", 132, 4096, True, True)},
    "side_outin_lines": {"side": ("outin", 132, 16384, True, False)},
    "side_out_b16": {"side": ("out", 16, 65536, True, True)},
}
SIDE = torch.cuda.Stream()


def set_mode(layers, mode):
    for i, block in enumerate(layers):
        m = block.mixer
        spec = {}
        for pos, (what, blocks, chunk, wait_first, bulk) in MODES[mode].items():
            nxt = layers[i + 1].mixer.in_proj.weight if i + 1 < len(layers) else None
            tensors = {"out": [m.out_proj.weight], "in": [nxt] if nxt is not None else [],
                       "outin": [m.out_proj.weight] + ([nxt] if nxt is not None else [])}[what]
            if tensors:
                spec[pos] = (tensors, blocks, chunk, wait_first, bulk)
        if "side" in spec:
            spec["stream"] = SIDE
            spec["join"] = i + 1 == len(layers)
        m.__dict__["_l2_prefetch"] = spec


rows = []
for prec in precisions:
    with torch.no_grad():
        qm = pm.quantized_model(fp, prec, args)
    fp.to("cpu")
    layers = qm.backbone.layers
    for batch in batches:
        gen = torch.Generator(device="cuda").manual_seed(1)
        prompt = torch.randint(0, fp.config.vocab_size, (batch, 1024), generator=gen, device="cuda")
        ref = None
        for rep in range(2):
            for mode in MODES:
                set_mode(layers, mode)
                with torch.inference_mode(), backend.recording() as ran:
                    runner = pm.QuambaRunner(qm, batch)
                    first = runner.prefill(prompt).argmax(-1)
                    logits = runner.step(first).float().clone()
                    if ref is None:
                        ref = logits
                    same = bool(torch.equal(ref, logits))
                    t = median_ms(lambda: runner.step(first), 200, warmup=20)
                    runner.close()
                row = {"precision": prec, "batch": batch, "mode": mode, "rep": rep, "tpot_ms": t,
                       "same_logits": same, "backends": backend.summary(ran)}
                rows.append(row)
                print(f"{prec} b{batch} {mode:16s} rep{rep} {t:.4f} ms same={same}", flush=True)
    del qm
    torch.cuda.empty_cache()
    fp.to("cuda")
meta = {"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
json.dump({"meta": meta, "modes": {k: {p: list(v) for p, v in d.items()} for k, d in MODES.items()}, "rows": rows},
          open(out_path, "w"), indent=1)
