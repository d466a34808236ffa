#!/bin/bash
for n in 1 1024; do
  timeout 60 compute-sanitizer --tool initcheck --print-limit 3 python3 benchmarks/results/2026-11-27e-h200/initcheck_linear.py $n > $OUT/initcheck_linear_$n.log 2>&1
  echo "rows $n: $(grep -E 'SUMMARY|sum|Uninit' $OUT/initcheck_linear_$n.log | sort | uniq -c | tr '\n' ' ' | cut -c1-300)"
  grep -m3 "at void\|at [a-z_]*(" $OUT/initcheck_linear_$n.log | cut -c1-200
done
