#!/usr/bin/env bash
# Fetches into .whl/ (git-ignored) what scripts/gpu_check.sh installs offline on a GPU machine that
# reaches no package index, from a machine that reaches PyPI:
#   - the CUTLASS headers' wheel (quamba._C's GEMMs);
#   - the sdists of the FP16 baseline, mamba-ssm and causal-conv1d (--baseline);
#   - in .whl/eval/: lm-eval 0.4.13 and the pure-Python packages it needs that the GPU image
#     (torch, transformers, accelerate, pandas, pyarrow, scikit-learn, sacrebleu, ...) lacks, for
#     Python 3.12 (--eval). Three of them ship as sdists only and are built into wheels here.
#
#   scripts/fetch_gpu_wheels.sh        (about 20 MB)
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=(python3 -m pip)
mkdir -p .whl/eval
"${PIP[@]}" download -q --no-deps -d .whl nvidia-cutlass==4.2.0.0
MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE "${PIP[@]}" download -q --no-deps \
  --no-binary :all: --no-build-isolation -d .whl mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0
"${PIP[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl/eval \
  lm-eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 \
  more-itertools==11.2.1 nltk==3.10.4 pytablewriter==1.2.1 dataproperty==1.1.1 \
  mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5 \
  chardet==6.0.0.post1 defusedxml==0.7.1
"${PIP[@]}" wheel -q --no-deps --no-binary :all: -w .whl/eval sqlitedict==2.1.0 rouge-score==0.1.2 \
  word2number==1.1
ls .whl .whl/eval
