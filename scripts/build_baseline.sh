#!/usr/bin/env bash
# Builds the FP16 baseline, mamba-ssm 2.3.2.post1 and causal-conv1d 1.7.0, from the sdists in .whl/
# (no network), for sm_90 only, into the current Python environment:
#
#   scripts/build_baseline.sh            (~410 s alone on 16 cores; ~610 s beside quamba._C's build)
#
# BASELINE_WHEELS=DIR keeps the two built wheels in DIR (default: a temporary folder), so that
# another machine of the same kind can install them with pip instead of building again.
#
# Their setup.py compile for a long list of architectures and try to download prebuilt wheels;
# here every -gencode but sm_90's is dropped and the builds are forced. The sdists were fetched with
#   MAMBA_SKIP_CUDA_BUILD=TRUE CAUSAL_CONV1D_SKIP_CUDA_BUILD=TRUE pip download --no-deps \
#     --no-binary :all: --no-build-isolation -d .whl mamba-ssm==2.3.2.post1 causal-conv1d==1.7.0
# Ends by importing both packages' kernels in a fresh process; exit status 0 only if that works.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
dir=$(mktemp -d /tmp/quamba_baseline.XXXXXX)
for sdist in .whl/causal_conv1d-*.tar.gz .whl/mamba_ssm-*.tar.gz; do
  tar -xzf "$sdist" -C "$dir"
done
"$PYTHON" - "$dir"/*/setup.py <<'PY'
import re, sys
gencode = re.compile(r'^([ \t]*)cc_flag\.append\("-gencode"\)[ \t]*\n[ \t]*cc_flag\.append\("arch=compute_(\d+),code=sm_\d+"\)',
                     re.M)
for path in sys.argv[1:]:
    text = open(path).read()
    text, count = gencode.subn(lambda m: m.group(0) if m.group(2) == "90" else m.group(1) + "pass", text)
    assert count, f"no -gencode flags found in {path}"
    open(path, "w").write(text)
PY
wheels=${BASELINE_WHEELS:-$dir/wheels}
MAMBA_FORCE_BUILD=TRUE CAUSAL_CONV1D_FORCE_BUILD=TRUE TORCH_CUDA_ARCH_LIST=9.0 \
  "$PYTHON" -m pip wheel --no-build-isolation --no-deps --no-index -w "$wheels" \
  "$dir"/causal_conv1d-*/ "$dir"/mamba_ssm-*/
"$PYTHON" -m pip install --no-deps --no-index "$wheels"/causal_conv1d-*.whl "$wheels"/mamba_ssm-*.whl
"$PYTHON" -c "from quamba.ops import fp_kernels; import sys; print(fp_kernels.missing() or 'mamba-ssm and causal-conv1d kernels load'); sys.exit(bool(fp_kernels.missing()))"
