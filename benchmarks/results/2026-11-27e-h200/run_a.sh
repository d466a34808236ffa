#!/bin/bash
# From the repository root on the GPU machine: racecheck on the minimal ring (three orderings of the
# same slot refills); an in-place build of the tree; every cuda op test. (The ring logs here come
# from the session's second call, which ran this loop with the barrier mode added; the first
# call's bulk and generic logs were the same.)
start=$SECONDS
nvcc -O2 -arch=sm_90a -o /tmp/rr benchmarks/results/2026-11-27e-h200/racecheck_ring.cu
for v in barrier generic bulk; do
  timeout 60 compute-sanitizer --tool racecheck /tmp/rr $v > $OUT/racecheck_ring_$v.log 2>&1
  echo "$v: rc $? $(grep -E 'SUMMARY|sum ' $OUT/racecheck_ring_$v.log | tr '\n' ' ')"
done
echo "ring at $((SECONDS - start)) s"
python3 -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-*.whl
TORCH_CUDA_ARCH_LIST=9.0a MAX_JOBS=16 timeout 260 python3 setup.py build_ext --inplace > $OUT/build.log 2>&1 || { echo "build failed"; grep -n "error" $OUT/build.log | head -30; exit 1; }
echo "built at $((SECONDS - start)) s"
export PYTHONPATH=$PWD QUAMBA_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo adf0723)
timeout $((560 - (SECONDS - start))) python3 -m pytest -q -rs --tb=short -p no:cacheprovider tests/ops/test_cuda_*.py -k "not beats" > $OUT/cuda_op_tests.log 2>&1
tail -n 4 $OUT/cuda_op_tests.log | cut -c1-300
echo "done at $((SECONDS - start)) s"
