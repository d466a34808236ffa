"""Upper bound of fusing RMSNorm into in_proj: TPOT with each block's RMSNorm kernel replaced by a
ready int8 buffer (timing only, wrong values)."""
import sys
import torch
sys.path.insert(0, "benchmarks")
import profile_mamba as pm
from common import median_ms

args = pm.parse_args(["--config", "2.8b", "--no_baseline"])
torch.manual_seed(0)
fp = pm.fp_model_for(args).eval()
for prec in ("w8a8", "w4a8"):
    with torch.no_grad():
        qm = pm.quantized_model(fp, prec, args)
    fp.to("cpu")
    layers = qm.backbone.layers
    for batch in (1, 8, 64):
        prompt = torch.randint(0, fp.config.vocab_size, (batch, 1024), device="cuda")
        for rep in range(2):
            for mode in ("norm", "nonorm"):
                for block in layers:
                    block.norm.__dict__.pop("forward", None)
                with torch.inference_mode():
                    runner = pm.QuambaRunner(qm, batch)
                    first = runner.prefill(prompt).argmax(-1)
                    if mode == "nonorm":
                        codes = torch.zeros(batch, 1, fp.config.d_model, dtype=torch.int8, device="cuda")
                        for block in layers:
                            block.norm.__dict__["forward"] = (
                                lambda hidden, residual=None: (codes, hidden if residual is None else residual))
                        runner.close()
                        runner = pm.QuambaRunner(qm, batch)
                    t = median_ms(lambda: runner.step(first), 200, warmup=20)
                    runner.close()
                print(f"{prec} b{batch} {mode:7s} rep{rep} {t:.4f} ms", flush=True)
    del qm
    torch.cuda.empty_cache()
    fp.to("cuda")
