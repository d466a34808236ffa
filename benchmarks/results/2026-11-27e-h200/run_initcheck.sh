#!/bin/bash
# initcheck on both layer kernels' harnesses, every kernel instrumented (a --kernel-name filter
# leaves the writes of other kernels untracked)
start=$SECONDS
python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-*.whl
QUAMBA_CUDA_FAMILIES=fused_decode TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 timeout 200 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { echo "build failed"; grep -n "error" $OUT/build.log | head; exit 1; }
echo "built at $((SECONDS - start)) s"
export PYTHONPATH=$PWD
I="timeout 150 compute-sanitizer --tool initcheck --print-limit 20"
$I python3 benchmarks/results/2026-11-27d-h200/racecheck_w4a16_layer.py > $OUT/initcheck_w4a16_layer.log 2>&1
$I python3 benchmarks/results/2026-11-27d-h200/racecheck_layer_step.py 8 > $OUT/initcheck_w8a8_layer.log 2>&1
$I python3 benchmarks/results/2026-11-27d-h200/racecheck_layer_step.py 4 > $OUT/initcheck_w4a8_layer.log 2>&1
for f in w4a16 w8a8 w4a8; do echo "$f: $(grep -E 'SUMMARY|ran twice|Device Frame' $OUT/initcheck_${f}_layer.log | sort | uniq -c | head -6 | cut -c1-220 | tr '\n' ' ')"; done
echo "done at $((SECONDS - start)) s"
