#!/usr/bin/env bash
# The one command for a GPU machine: install quamba as the README says (building quamba._C), print
# the environment (python -m quamba.env --strict: fails where a quantized op would fall back to its
# torch reference), run the GPU tests and every benchmarks/bench_*.py, and print a summary table. Logs and the benchmarks'
# JSON go to $OUT when set (the lent GPU machine), else to logs/gpu_check/.
#
#   scripts/gpu_check.sh [--baseline] [--no-build] [--sanitizer] [--no-bench] [--no-tests] [--quick]
#                        [--e2e] [--eval]
#
#   --baseline    also build mamba-ssm 2.3.2.post1 and causal-conv1d 1.7.0 (the FP16 baseline) from
#                 the sdists in .whl/, for sm_90 only, beside quamba._C (413 s alone on the 16-core
#                 H200 machine, ~610 s beside quamba._C on the H100 one: more than one 10-minute
#                 device command). The ops' GPU tests run while it builds, the models' once it is
#                 installed (their FP ops take its kernels). There, start it detached in one command,
#                   mkdir -p /tmp/gc; (OUT=/tmp/gc setsid nohup scripts/gpu_check.sh --baseline
#                     --no-bench >/tmp/gc/main.log 2>&1 </dev/null &)
#                 and wait in the next ones until /tmp/gc/gpu_check.log holds its summary (a later
#                 call with --no-build reuses what it built)
#   --sanitizer   also run the tests named *small* under compute-sanitizer --tool memcheck, and the
#                 small conv, scan and norm tests (the kernels that share memory between threads)
#                 under --tool racecheck; and the layer kernels' exactness tests under memcheck and
#                 synccheck, filtered to the layer kernels. Not racecheck on the layer kernels: it
#                 reports their mbarrier-ordered ring refills, as it does a minimal mbarrier ring's;
#                 nor initcheck on these tests: it takes cuBLAS's outputs for unwritten memory
#                 (benchmarks/RESULTS.md). Each step stops after $SANITIZER_TIMEOUT seconds
#                 (default 1800)
#   --no-build    reuse quamba._C (and the baseline) built by an earlier call on the same machine
#   --quick       shorter benchmark timing runs
#   --eval        install lm-eval and the packages it needs from .whl/eval/ (offline), run the
#                 README's main command on the GPU and on the CPU, and write their per-document
#                 agreement (python -m quamba.eval.agreement) beside the log; the GPU tests then
#                 include tests/eval/test_cuda_eval_agreement.py. Needs ../shared/data (the offline
#                 data) beside the checkout
#   --e2e         end-to-end generation profiles (benchmarks/profile_mamba.py): Mamba-130m and
#                 Mamba-2.8b shapes, prompt 1024, 128 new tokens, batch 1 and 8, 3 repeats as the
#                 README's numbers ($E2E_CONFIGS, $E2E_BATCHES and $E2E_REPEATS override them)
#
# .whl/ (git-ignored, carried to the machine) holds the nvidia-cutlass 4.2.0.0 wheel, for --baseline
# the two sdists, for --eval the wheels in .whl/eval/: scripts/fetch_gpu_wheels.sh fetches them.
# TORCH_CUDA_ARCH_LIST defaults to the GPU's own architecture (9.0a on Hopper);
# QUAMBA_CUDA_FAMILIES limits the build to some kernel families (setup.py); QUAMBA_COMMIT names the
# commit in the results (the copy of the repository on the GPU machine may carry a stale .git).
set -uo pipefail
cd "$(dirname "$0")/.."

BASELINE=0 BUILD=1 SANITIZER=0 BENCH=1 TESTS=1 E2E=0 EVAL=0 QUICK=()
for arg in "$@"; do
  case "$arg" in
    --baseline) BASELINE=1 ;;
    --no-build) BUILD=0 ;;
    --e2e) E2E=1 ;;
    --eval) EVAL=1 ;;
    --sanitizer) SANITIZER=1 ;;
    --no-bench) BENCH=0 ;;
    --no-tests) TESTS=0 ;;
    --quick) QUICK=(--quick) ;;
    *) echo "gpu_check.sh: unknown option $arg" >&2; exit 2 ;;
  esac
done

LOG_DIR=${OUT:-logs/gpu_check}
mkdir -p "$LOG_DIR"
LOG="$LOG_DIR/gpu_check.log"
: >"$LOG"
export PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
PYTHON=${PYTHON:-python3}
SUMMARY=()
FAILED=0

# step NAME COMMAND...: runs COMMAND with its output in the log, and records status and seconds.
step() {
  local name=$1 start=$SECONDS status
  shift
  echo "=== $name: $*" | tee -a "$LOG"
  "$@" 2>&1 | tee -a "$LOG"
  status=${PIPESTATUS[0]}
  SUMMARY+=("$(printf '%-22s %-6s %5ds' "$name" "$([ "$status" = 0 ] && echo ok || echo FAIL)" $((SECONDS - start)))")
  [ "$status" = 0 ] || FAILED=1
  return "$status"
}

# The README's GPU install, offline: the CUTLASS headers' wheel from .whl/ (without its Python
# dependencies, which a header build does not use), then quamba in editable mode (setup.py picks a
# compiler that links libstdc++ dynamically and checks the built library).
build_extension() {
  "$PYTHON" -m pip install -q --no-index --no-deps .whl/nvidia_cutlass-*.whl || return 1
  "$PYTHON" -m pip install --no-build-isolation --no-deps --no-index -e . || return 1
  "$PYTHON" -c "import quamba._C; print('quamba._C built')"
}

# lm-eval for the GPU image, offline (pure-Python wheels: --no-deps, the rest is in the image).
install_eval_packages() {
  "$PYTHON" -m pip install -q --no-index --no-deps .whl/eval/*.whl || return 1
  "$PYTHON" -c "import lm_eval, datasets; print('lm-eval', lm_eval.__version__, 'datasets', datasets.__version__)"
}

# The README's main command (Quantize and evaluate) on DEVICE, its run JSON under $LOG_DIR/DEVICE.
readme_main() {
  local device=$1 out=$LOG_DIR/readme_$1
  rm -rf "$out"
  HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 HF_DATASETS_CACHE=$(mktemp -d) "$PYTHON" main.py \
    tests/fixtures/tiny-mamba --quantize \
    --calib_data ../shared/data/text/c4_sample.jsonl --calib_data_num 64 --calib_seqlen 256 \
    --eval_zero_shot --task_list lambada_openai,piqa --testing \
    --task_data ../shared/data/eval --log_dir "$out" --device "$device"
}

readme_agreement() {
  "$PYTHON" -m quamba.eval.agreement "$LOG_DIR"/readme_cpu/*.json "$LOG_DIR"/readme_cuda/*.json \
    --out "$LOG_DIR" && cat "$LOG_DIR/agreement.md"
}

# The GPU tests: the test_cuda_* files, and the Triton kernels' files whose small cases also run
# on CPU under Triton's interpreter. (`pytest -m gpu tests/` needs every test module's imports,
# datasets and lm_eval included, which this offline --no-deps install does not bring.) The
# sweeps, left out of the default run (pyproject.toml), run here too. In two parts: the ops'
# tests (quamba's kernels against their references), and the rest, whose models run their FP ops
# on mamba-ssm's and causal-conv1d's kernels where those are installed.
run_op_tests() {
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m "sweep or not sweep" tests/ops/test_cuda_*.py \
    tests/ops/test_trainable_scan.py tests/ops/test_full_scan_kernel.py tests/ops/test_qssd.py \
    tests/ops/test_gated_norm.py
}

run_model_tests() {
  local files=()
  for file in tests/*/test_cuda_*.py; do [[ $file == tests/ops/* ]] || files+=("$file"); done
  "$PYTHON" -m pytest -q -rs -p no:cacheprovider -m "sweep or not sweep" "${files[@]}"
}

# sanitize TOOL TESTS SELECTION [OPTION...]: runs the selected tests under compute-sanitizer's TOOL
# with its OPTIONs; any error it reports fails the step.
sanitize() {
  local sanitizer tool=$1 tests=$2 selection=$3
  shift 3
  sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
  timeout "${SANITIZER_TIMEOUT:-1800}" "$sanitizer" --tool "$tool" --error-exitcode 9 --target-processes all \
    "$@" "$PYTHON" -m pytest -q -x -p no:cacheprovider $tests -k "$selection"
}

# The layer kernels' exactness tests: a W8A8 and a W4A8 block step bit for bit against the chain,
# a W4A16 one against fp64.
LAYER_TESTS="tests/ops/test_cuda_fused_layer.py tests/ops/test_cuda_w4a16_layer.py"
LAYER_SELECTION="bit_for_bit or fp64"
LAYER_KERNELS=(--kernel-name kns=layer_)  # layer_step_kernel, w4a16_layer_kernel

run_benchmarks() {
  local bench status=0
  for bench in benchmarks/bench_*.py; do
    echo "--- $bench"
    "$PYTHON" "$bench" "${QUICK[@]}" --out "$LOG_DIR/$(basename "$bench" .py).json" || status=1
  done
  return $status
}

{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader; "$PYTHON" -c \
  "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; nvcc --version | tail -1; } 2>&1 | tee -a "$LOG"
run_e2e() {
  local config batch status=0
  for config in ${E2E_CONFIGS:-130m 2.8b}; do
    for batch in ${E2E_BATCHES:-1 8}; do
      "$PYTHON" benchmarks/profile_mamba.py --config "$config" --batch "$batch" --prompt_len 1024 \
        --gen_len 128 --repeats "${E2E_REPEATS:-3}" --breakdown \
        --out "$LOG_DIR/profile_${config}_b${batch}.json" || status=1
    done
  done
  return $status
}

# The baseline builds in the background while quamba._C builds and the ops' tests run; its log
# joins ours when it ends.
wait_for_baseline() {
  while [ ! -f "$LOG_DIR/baseline.status" ]; do sleep 5; done
  cat "$LOG_DIR/baseline.log"
  return "$(cat "$LOG_DIR/baseline.status")"
}

if [ "$BASELINE" = 1 ] && [ "$BUILD" = 1 ]; then
  rm -f "$LOG_DIR/baseline.status"
  { scripts/build_baseline.sh >"$LOG_DIR/baseline.log" 2>&1; echo $? >"$LOG_DIR/baseline.status"; } &
fi
BUILT=1
[ "$BUILD" = 1 ] && { step build-quamba build_extension || BUILT=0; }
if [ "$BUILT" = 1 ]; then
  step environment "$PYTHON" -m quamba.env --strict  # quamba._C loads and runs every quantized op
  [ "$TESTS" = 1 ] && step op-tests run_op_tests
fi
[ "$BASELINE" = 1 ] && [ "$BUILD" = 1 ] && step build-baseline wait_for_baseline
if [ "$BUILT" = 1 ]; then
  if [ "$EVAL" = 1 ]; then
    step eval-packages install_eval_packages
    step readme-main-cuda readme_main cuda
    step readme-main-cpu readme_main cpu
    step agreement readme_agreement
  fi
  [ "$TESTS" = 1 ] && step model-tests run_model_tests
  [ "$BENCH" = 1 ] && step benchmarks run_benchmarks
  [ "$E2E" = 1 ] && step e2e run_e2e
  [ "$SANITIZER" = 1 ] && step memcheck sanitize memcheck "tests/*/test_cuda_*.py" small
  [ "$SANITIZER" = 1 ] && step racecheck sanitize racecheck tests/ops/test_cuda_ssm.py small
  [ "$SANITIZER" = 1 ] && step memcheck-layer sanitize memcheck "$LAYER_TESTS" "$LAYER_SELECTION" "${LAYER_KERNELS[@]}"
  [ "$SANITIZER" = 1 ] && step synccheck-layer sanitize synccheck "$LAYER_TESTS" "$LAYER_SELECTION" "${LAYER_KERNELS[@]}"
fi

{
  echo
  echo "gpu_check summary ($(date -u '+%Y-%m-%d %H:%M UTC'), commit ${QUAMBA_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)})"
  printf '%s\n' "${SUMMARY[@]}"
  grep -E '[0-9]+ (passed|failed|errors?)\b.* in [0-9.]+s' "$LOG" || true
} | tee -a "$LOG"
exit $FAILED
