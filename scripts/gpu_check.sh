#!/usr/bin/env bash
# One GPU check, ~8 minutes on one H100 (docs/scaling.md "Checking a GPU"): `scripts/gpu_check.sh [--quick] [OUT]`.
#   1. tests/test_cuda.py: every phase on CUDA against the CPU on the same batches (tolerances from ΔH's rounding floor);
#   2. bench/bench_probe.py on a `make-checkpoint --synthetic qwen2.5-1.5b` checkpoint with --device cuda: the default
#      probe's phases and the whole beside one Dr-GRPO training step on the same tokens (goal: whole ≤ 2.5×);
#   3. bench/bench_precision.py --tf32: δH₁, SE_E, SE_U, ΔH(η) at lr/1000 … 100·lr and seconds for fp32, fp32 + TF32 and a
#      bf16 base on the same E and U.
# --quick: the same steps on the CPU with the embedded model's demo checkpoint and tiny sizes (the script's own check).
# Run it with the project's environment active (python with torch and the project on the path). Logs go to OUT
# (default gpu_check_<time>/); each step's last lines are printed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0
if [[ "${1:-}" == "--quick" ]]; then QUICK=1; shift; fi
OUT="${1:-gpu_check_$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
cd "$ROOT"
status=0
step() {  # step NAME COMMAND...: run, keep the log, print its tail and the seconds
  local name="$1"; shift
  local t0=$(date +%s)
  echo "== $name: $*"
  "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  tail -n 25 "$OUT/$name.log" | grep -v '^\s*$'
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s"
  [[ $rc -eq 0 ]] || status=1
}
if [[ $QUICK -eq 1 ]]; then
  DEVICE=cpu; CKPT_ARGS=(); SIZES=(--B-E 4 --B-U 2 --G 2 --max-new-tokens 8); PREC=(--B_E 4 --B_U 2 --G 2 --T 8)
else
  DEVICE=cuda
  step make_checkpoint python -m entropy_experiments.cli make-checkpoint --synthetic qwen2.5-1.5b --steps 1 \
       --out "$OUT/qwen1.5b" --set checkpoint.device_map=cuda
  CKPT_ARGS=(--checkpoint "$OUT/qwen1.5b"); SIZES=(--B-E 64 --B-U 8 --G 4 --max-new-tokens 128)
  PREC=(--checkpoint "$OUT/qwen1.5b" --B_E 32 --B_U 4 --G 4 --T 64)
fi
step test_cuda python -m pytest -q tests/test_cuda.py -rs
step bench_probe python bench/bench_probe.py "${CKPT_ARGS[@]}" --device "$DEVICE" --repeats 1 --no-previous "${SIZES[@]}"
step precision python bench/bench_precision.py "${PREC[@]}" --device "$DEVICE" --tf32 --symmetric \
     --out "$OUT/precision.json"
echo "gpu_check: logs in $OUT; $( [[ $status -eq 0 ]] && echo 'every step exited 0' || echo 'a step FAILED' )"
exit $status
