#!/usr/bin/env bash
# Compare every SSM mode of one quantized model on the same tasks and documents.
#
#   scripts/compare_modes.sh MODEL [TASKS] [-- extra main.py flags]
#
# Quantizes MODEL once (saved under $PRETRAINED_DIR and reused by every later mode), evaluates
# int8, fp32-ssm-input, float-sim-asic-int8, fp32-conv and the unquantized fp16 model, then
# writes under $OUT_DIR a Markdown report (accuracy ± stderr, difference to int8, McNemar's exact
# test on per-document correctness) with a PNG chart, and a layer-by-layer SQNR table and plot.
#
# Flags after -- go to every main.py run (e.g. --testing, --device cuda, --batch_size 32).
# Environment: OUT_DIR (default compare_modes/<model>), PRETRAINED_DIR (default pretrained),
# CALIB_DATA, CALIB_NUM, CALIB_SEQLEN (calibration), TASK_DATA (offline task data), SQNR_TEXT
# (text for the layer comparison; default the local wikitext2 file in TASK_DATA).
set -euo pipefail

if [[ $# -lt 1 || "$1" == -h || "$1" == --help ]]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
model=$1; shift
tasks=lambada_openai,hellaswag,piqa,arc_easy,arc_challenge,winogrande
if [[ $# -gt 0 && "$1" != -- ]]; then tasks=$1; shift; fi
[[ "${1:-}" == -- ]] && shift
extra=("$@")

name=$(basename "${model%/}")
out_dir=${OUT_DIR:-compare_modes/$name}
pretrained_dir=${PRETRAINED_DIR:-pretrained}
here=$(cd "$(dirname "$0")/.." && pwd)

common=(--eval_zero_shot --task_list "$tasks" --pretrained_dir "$pretrained_dir")
[[ -n "${TASK_DATA:-}" ]] && common+=(--task_data "$TASK_DATA")
quant=(--quantize)
[[ -n "${CALIB_DATA:-}" ]] && quant+=(--calib_data "$CALIB_DATA")
[[ -n "${CALIB_NUM:-}" ]] && quant+=(--calib_data_num "$CALIB_NUM")
[[ -n "${CALIB_SEQLEN:-}" ]] && quant+=(--calib_seqlen "$CALIB_SEQLEN")

rm -rf "$out_dir/runs"
mkdir -p "$out_dir/runs"
for mode in int8 fp32-ssm-input float-sim-asic-int8 fp32-conv; do
  echo "== mode $mode"
  python "$here/main.py" "$model" "${quant[@]}" --ssm_mode "$mode" "${common[@]}" \
    --log_dir "$out_dir/runs/$mode" "${extra[@]}"
done
echo "== mode fp16 (unquantized)"
python "$here/main.py" "$model" "${common[@]}" --log_dir "$out_dir/runs/fp16" "${extra[@]}"

python -m quamba.eval.compare report "$out_dir"/runs/*/*.json --out "$out_dir"

saved=$(python -c 'import sys; from quamba.cli_support import saved_model_name as n; print(n(sys.argv[1], 8, 8))' "$model")
sqnr_text=${SQNR_TEXT:-${TASK_DATA:+$TASK_DATA/wikitext2_test_docs.jsonl}}
if [[ -z "$sqnr_text" ]]; then
  echo "layer comparison skipped: set SQNR_TEXT (a .txt or .jsonl file) or TASK_DATA" >&2
else
  python -m quamba.eval.compare layers "$pretrained_dir/$saved" --text "$sqnr_text" --out "$out_dir"
fi
echo "report: $out_dir/mode_report.md"
