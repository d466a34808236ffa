#!/bin/bash
# gpu_check.sh's three new --sanitizer steps, run through the script's own sanitize function and
# variables, on an in-place build
start=$SECONDS
python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-*.whl
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 timeout 260 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { echo "build failed"; grep -n "error" $OUT/build.log | head; exit 1; }
echo "built at $((SECONDS - start)) s"
export PYTHONPATH=$PWD PYTHON=python3 SANITIZER_TIMEOUT=170
eval "$(sed -n '/^sanitize() {/,/^}/p;/^LAYER_/p' scripts/gpu_check.sh)"
for tool in memcheck synccheck initcheck; do
  t0=$SECONDS
  if [ $tool = initcheck ]; then sanitize $tool "$LAYER_TESTS" "$LAYER_SELECTION" > $OUT/${tool}_layer_tests.log 2>&1
  else sanitize $tool "$LAYER_TESTS" "$LAYER_SELECTION" "${LAYER_KERNELS[@]}" > $OUT/${tool}_layer_tests.log 2>&1; fi
  echo "$tool: rc $? in $((SECONDS - t0)) s: $(grep -E 'SUMMARY|passed|failed' $OUT/${tool}_layer_tests.log | tr '\n' ' ' | cut -c1-300)"
done
echo "done at $((SECONDS - start)) s"
