"""Step-level A/B of the W8A8 GEMV dispatch (experiment switches QX_MMA_MIN_M / QX_MMA_SPLITS, read at
each launch): Mamba-2.8B W8A8 TPOT (graph replay) at batch 1, 4, 8. argv: out.json."""
import json, os, sys, time
import torch
sys.path.insert(0, "benchmarks")
import profile_mamba as pm
from common import median_ms
from quamba.ops import backend

MODES = {"dp4a": {}, "ring": {"QX_MMA_MIN_M": "1"}, "ring_s1": {"QX_MMA_MIN_M": "1", "QX_MMA_SPLITS": "1"},
         "ring_s4": {"QX_MMA_MIN_M": "1", "QX_MMA_SPLITS": "4"}}
args = pm.parse_args(["--config", "2.8b", "--no_baseline"])
torch.manual_seed(0)
fp = pm.fp_model_for(args).eval()
with torch.no_grad():
    qm = pm.quantized_model(fp, "w8a8", args)
fp.to("cpu")
rows = []
for batch in (1, 4, 8):
    prompt = torch.randint(0, fp.config.vocab_size, (batch, 1024), device="cuda")
    ref = None
    for rep in range(2):
        for mode, env in MODES.items():
            for k in ("QX_MMA_MIN_M", "QX_MMA_SPLITS"):
                os.environ.pop(k, None)
            os.environ.update(env)
            with torch.inference_mode(), backend.recording() as ran:
                runner = pm.QuambaRunner(qm, batch)
                first = runner.prefill(prompt).argmax(-1)
                logits = runner.step(first).float().clone()
                ref = logits if ref is None else ref
                same = bool(torch.equal(ref, logits))
                t = median_ms(lambda: runner.step(first), 200, warmup=20)
                runner.close()
            rows.append({"batch": batch, "mode": mode, "rep": rep, "tpot_ms": t, "same_logits": same,
                         "backends": backend.summary(ran)})
            print(f"w8a8 b{batch} {mode:8s} rep{rep} {t:.4f} ms same={same}", flush=True)
json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "modes": MODES, "rows": rows}, open(sys.argv[1], "w"), indent=1)
