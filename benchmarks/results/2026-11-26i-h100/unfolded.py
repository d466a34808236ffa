"""profile_mamba.py with dt_proj run as its own op in the decode step (the A/B of the fold)."""
import runpy
import sys

import quamba.layers.qmixer as qmixer

qmixer.QMambaMixer._step_dt_projection = lambda self, batch: None
sys.path.insert(0, "benchmarks")
sys.argv = ["benchmarks/profile_mamba.py"] + sys.argv[1:]
runpy.run_path("benchmarks/profile_mamba.py", run_name="__main__")
