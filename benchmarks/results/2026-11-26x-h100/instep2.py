"""Tree b's experiment switches (b53.patch) on the tiled out_proj / in_proj at 64 rows, in and out
of their neighbours: argv out.json."""
import json, os, sys
sys.path.insert(0, ".dev")
from instep import out_proj_chain, in_proj_chain, record, rows

variants = {"base": {}, "spread": {"QUAMBA_EXP_SPREAD": "1"}, "nopdl": {"QUAMBA_EXP_NOPDL": "1"},
            "smem80k": {"QUAMBA_EXP_TILED_SMEM": str(80 * 1024)},
            "smem115k": {"QUAMBA_EXP_TILED_SMEM": str(115 * 1024)},
            "spread_smem80k": {"QUAMBA_EXP_SPREAD": "1", "QUAMBA_EXP_TILED_SMEM": str(80 * 1024)}}
keys = {"QUAMBA_EXP_SPREAD", "QUAMBA_EXP_NOPDL", "QUAMBA_EXP_TILED_SMEM"}
for name, env in variants.items():
    for k in keys:
        os.environ.pop(k, None)
    os.environ.update(env)
    for kind in ("w4_tiled", "w4_tiled6"):
        for parts in (("gemm",), ("had", "gemm"), ("had", "gemm", "norm")):
            record({"variant": name, "chain": "out_proj", "kind": kind, "parts": "+".join(parts),
                    "us": out_proj_chain(kind, 64, parts)})
    for parts in (("gemm",), ("norm", "gemm")):
        record({"variant": name, "chain": "in_proj", "kind": "w4_tiled", "parts": "+".join(parts),
                "us": in_proj_chain("w4_tiled", 64, parts)})
json.dump(rows, open(sys.argv[1], "w"), indent=1)
