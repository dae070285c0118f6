#!/usr/bin/env bash
# One GPU check, ~10 minutes on one H100 (docs/scaling.md "Checking a GPU"):
#   scripts/gpu_check.sh [--quick] [--only STEP,...] [--budget SECONDS] [--work DIR] [OUT]
# Steps, in this order (each one's log is OUT/STEP.log, written as it runs; `--only` runs a subset, in this order):
#   env          nvidia-smi, host memory and disk, torch, CUDA and the packages' versions;
#   sampling     bench/bench_sampling.py at auto rows on a `make-checkpoint --synthetic qwen2.5-1.5b` checkpoint's
#                model: E 512 × 256 with the default engine in bf16, then every engine in bf16 and fp32 at
#                E 128 × 128;
#   bench_probe  bench/bench_probe.py: the default probe's phases and the whole beside one Dr-GRPO training step on
#                the same tokens (goals: phases 1–3 ≤ 1.2×, whole ≤ 2.5×), E 128 + U 8 × 4 at T 256, with the
#                sampler's tokens/s and the correction's ESS/E;
#   precision    bench/bench_precision.py --tf32: δH₁, SE_E, SE_U, ΔH(η) and seconds for fp32, fp32 + TF32 and a
#                bf16 base on the same E and U;
#   callback     bench/bench_callback.py --device cuda: TRL GRPOTrainer steps on that model with the callback
#                probing every step, per prediction mode (probe_U, trainer_step), as a ratio to a training step;
#   test_cuda    tests/test_cuda.py: every phase on CUDA against the CPU on the same batches (it ends with a
#                deliberate out-of-memory allocation, so it comes after the numbers);
#   probe_run    the whole default probe (`entropy-probe run`) at E 512 × T 256 on that checkpoint
#                (WORK/probe_run/results.json: sampler, correction and phase seconds).
# The checkpoint (WORK/qwen1.5b; WORK is --work, default OUT) is made once and reused when there, and the
# make_checkpoint step logs to OUT too; OUT holds only the logs (at most 8 files). Each step runs under
# `timeout`, capped by what is left of --budget (default 3600 s), so a slow step ends with its log kept and the
# next one still runs.
# --quick: the same steps on the CPU with the embedded model's demo checkpoint and tiny sizes (the script's own
# check). Run it with the project's environment active (python with torch and the project on the path).
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
QUICK=0; ONLY=""; BUDGET=3600; WORK=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --only) ONLY="$2"; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --work) WORK="$2"; shift 2 ;;
    -*) echo "gpu_check: unknown option $1" >&2; exit 2 ;;
    *) break ;;
  esac
done
OUT="${1:-gpu_check_$(date +%Y%m%d-%H%M%S)}"
mkdir -p "$OUT" && OUT="$(cd "$OUT" && pwd)"
WORK="${WORK:-$OUT}"
mkdir -p "$WORK" && WORK="$(cd "$WORK" && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONUNBUFFERED=1
cd "$ROOT"
DEADLINE=$(( $(date +%s) + BUDGET ))
status=0
wanted() { [[ -z "$ONLY" || ",$ONLY," == *",$1,"* ]]; }
step() { wanted "$1" && run_step "$@"; return 0; }  # a step that --only may leave out
run_step() {  # run_step NAME CAP_S COMMAND...: run under timeout, keep the log, print its tail and the seconds
  local name="$1" cap="$2"; shift 2
  local left=$(( DEADLINE - $(date +%s) ))
  (( left < cap )) && cap=$left
  if (( cap < 10 )); then echo "== $name: skipped, the budget is spent"; status=1; return 0; fi
  local t0=$(date +%s)
  echo "== $name (at most $cap s): $*"
  timeout --kill-after=10 "$cap" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  tail -n 30 "$OUT/$name.log" | grep -v '^\s*$' | cut -c1-220
  echo "== $name: exit $rc after $(( $(date +%s) - t0 )) s$( [[ $rc -eq 124 ]] && echo ' (timed out)')"
  [[ $rc -eq 0 ]] || status=1
}
probe_steps=(sampling bench_probe precision callback probe_run)  # the steps that need the checkpoint
if [[ $QUICK -eq 1 ]]; then
  DEVICE=cpu; CKPT=""; MODEL_ARGS=(); CB_ARGS=(--steps 1 --repeats 1 --B-E 4 --B-U 2 --max-new-tokens 8)
  RUN=(python -m entropy_experiments.cli demo --steps 1 --out "$WORK/probe_run" --overwrite)
  RUN_SIZES=(--set batch_config.B_E=4 --set batch_config.B_U=2 --set batch_config.G=2 --set generation.max_new_tokens=8)
  SAMPLE_BIG=(--B-E 4 --max-new-tokens 8); SAMPLE_ALL=(--B-E 2 --max-new-tokens 4)
  PROBE_SIZES=(--B-E 4 --B-U 2 --G 2 --max-new-tokens 8); PREC=(--B_E 4 --B_U 2 --G 2 --T 8)
else
  DEVICE=cuda; CKPT="$WORK/qwen1.5b"; MODEL_ARGS=(--checkpoint "$CKPT/synthetic_base")
  CB_ARGS=(--model-dir "$CKPT/synthetic_base" --steps 3 --repeats 1 --B-E 16 --B-U 2 --max-new-tokens 32)
  RUN=(python -m entropy_experiments.cli run --config entropy_experiments/configs/default.yaml --out "$WORK/probe_run"
       --overwrite --set "checkpoint.checkpoint_path=$CKPT" --set reward.name=math_density)
  RUN_SIZES=(--set batch_config.B_E=512 --set generation.max_new_tokens=256)
  SAMPLE_BIG=(--B-E 512 --max-new-tokens 256); SAMPLE_ALL=(--B-E 128 --max-new-tokens 128)
  PROBE_SIZES=(--B-E 128 --B-U 8 --G 4 --max-new-tokens 256); PREC=(--B_E 32 --B_U 4 --G 4 --T 64)
fi
step env 30 bash -c 'nvidia-smi 2>&1 | head -15; free -g; df -h "$0"; python -c "import torch, transformers, peft, trl;
print(\"torch\", torch.__version__, \"cuda\", torch.version.cuda, torch.cuda.is_available() and
torch.cuda.get_device_name()); print(\"transformers\", transformers.__version__, \"peft\", peft.__version__,
\"trl\", trl.__version__)"' "$WORK"
needs_checkpoint=0
for s in "${probe_steps[@]}"; do wanted "$s" && needs_checkpoint=1; done
if [[ -n "$CKPT" && $needs_checkpoint -eq 1 && ! -f "$CKPT/optimizer.pt" ]]; then
  run_step make_checkpoint 240 python -m entropy_experiments.cli make-checkpoint --synthetic qwen2.5-1.5b --steps 1 \
       --out "$CKPT" --set checkpoint.device_map=cuda --set batch_config.B_U=4
fi
step sampling 150 bash -c "python bench/bench_sampling.py ${MODEL_ARGS[*]} --device $DEVICE ${SAMPLE_BIG[*]} --rows auto \
     --dtypes bf16 --engines generate && python bench/bench_sampling.py ${MODEL_ARGS[*]} --device $DEVICE \
     ${SAMPLE_ALL[*]} --rows auto --dtypes bf16 fp32 --engines generate static_cache continuous_batching"
step bench_probe 200 python bench/bench_probe.py ${CKPT:+--checkpoint "$CKPT"} --device "$DEVICE" --repeats 1 \
     --no-previous "${PROBE_SIZES[@]}"
step precision 120 python bench/bench_precision.py ${CKPT:+--checkpoint "$CKPT"} "${PREC[@]}" --device "$DEVICE" \
     --tf32 --symmetric --out "$WORK/precision.json"
step callback 150 python bench/bench_callback.py "${CB_ARGS[@]}" --device "$DEVICE"
step test_cuda 150 python -m pytest -q tests/test_cuda.py -rs -p no:cacheprovider
step probe_run 400 "${RUN[@]}" "${RUN_SIZES[@]}"
echo "gpu_check: logs in $OUT, files in $WORK; $( [[ $status -eq 0 ]] && echo 'every step exited 0' || echo 'a step FAILED or was skipped' )"
exit $status
