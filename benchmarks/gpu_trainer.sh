#!/usr/bin/env bash
# One call on a machine with a CUDA device (H100/H200): the trainer step's pairs that set the
# attention rule (grpo_kernels.hf.ATTENTION_RULES) and the generation rule
# (grpo_train.generation.GENERATION_RULES), and TRL 1.16 beside us, within 8 minutes:
#   1. the loss phase of grpo_train's own step (synthetic completions), Qwen2.5-0.5B shape,
#      random weights, G completions of long-tailed lengths (cap CAP): padded against packed
#      rows at a PROMPT_SHORT-token prompt and against shared rows at a PROMPT_LONG-token
#      prompt, each attention implementation the rule considers for that layout on this device;
#   2. whole steps with real generation: TRL's GRPOTrainer with its defaults, grpo_kernels' TRL
#      subclass and grpo_train (the same shape, prompt and lengths; TRL generates with
#      model.generate, a prefill per row);
#   3. generation alone (benchmarks.generation, workload trainer-64, forced lengths): TRL's
#      default call (`per-row`) against grpo_train's paths (padded, continuous, static).
# Steps run in that order under a DEADLINE_S deadline, each under `timeout` (its budget or what
# is left), and each appends its rows as it finishes, so a step cut short leaves the others.
#
# Usage (repository root; OUT = where results go, default ./gpu_out):
#   BENCH_COMMIT=<short sha> OUT=/some/dir bash benchmarks/gpu_trainer.sh
#   DEADLINE_S=540 ... : a longer deadline (default 450 s) for a call with time to spare
#   DRY_RUN=1 OUT=/tmp/dry bash benchmarks/gpu_trainer.sh   # every step on the CPU, tiny shapes
# TRL and datasets are not on the device image: carry .whl (benchmarks/fetch_wheels.sh, LEAN=1);
# install_wheels.sh installs them. A step whose package is missing writes an "n/a" row.
#
# Writes under $OUT:
#   env.txt, steps.txt                   versions and nvidia-smi; a timed line per step
#   gpu_trainer.csv                      one row per step: status (ok, n/a: ..., timeout after
#                                        Ns, failed: exit N, skipped: ...), seconds, command
#   gpu_trainer.log                      every step's output
#   results/<device>-trainer.csv         benchmarks.trainer_step rows (phases' time and memory,
#                                        the row layout, attention and generation path that ran)
#   results/<device>-generation.csv      benchmarks.generation rows, one per path
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN="${DRY_RUN:-0}"
source benchmarks/gpu_common.sh

# ---- shapes and budgets: one block per mode --------------------------------------------------
if [ "$DRY_RUN" = 1 ]; then  # the CPU, tiny shapes: every step runs, in a few minutes
  KIND=cpu; DEADLINE_S=280; MIN_STEP_S=15
  SHAPE=(--device cpu --tiny --profile_bytes off)
  G=4; CAP=16; PROMPT_SHORT=16; PROMPT_LONG=48
  LOSS_RUN=(--warmup 0 --steps 1); STEP_RUN=(--warmup 0 --steps 1)
  LOSS_BUDGET_S=60; STEP_BUDGET_S=90; GEN_BUDGET_S=90
  GEN=(--tiny --max_new "$CAP" --prompt_tokens "$PROMPT_SHORT" --threads 1 --repeats 1)
  GEN_PATHS=per-row,padded,static-eager,continuous  # a CPU compile takes ~40 s: not here
else
  KIND=cuda; DEADLINE_S="${DEADLINE_S:-450}"; MIN_STEP_S=30
  SHAPE=(--device cuda)
  G=8; CAP=1024; PROMPT_SHORT=64; PROMPT_LONG=1024
  LOSS_RUN=(--warmup 1 --steps 2); STEP_RUN=(--warmup 0 --steps 1)
  LOSS_BUDGET_S=60; STEP_BUDGET_S=120; GEN_BUDGET_S=240
  GEN=(--device cuda --dtype bfloat16 --max_new "$CAP" --prompt_tokens "$PROMPT_SHORT"
       --threads 0 --repeats 1)
  GEN_PATHS=per-row,padded,continuous,static
fi
# the random model, built once and shared by the trainer_step runs: in a scratch folder, never
# under $OUT (its weights would travel back, or fill PACK's archive, at every stamp)
make_scratch ASSETS
SUMMARY="$OUT/gpu_trainer.csv"
LOG="$OUT/gpu_trainer.log"
[ -f "$SUMMARY" ] || echo "step,status,seconds,command" > "$SUMMARY"

source benchmarks/gpu_steps.sh  # row, run_step

stamp "environment (DRY_RUN=$DRY_RUN)"
write_env
if [ "$DRY_RUN" != 1 ] || ls .whl/*.whl > /dev/null 2>&1; then
  stamp "installing TRL and datasets from .whl/"
  timeout 60 bash benchmarks/install_wheels.sh >> "$OUT/env.txt" 2>&1
fi

# the implementations the attention rule considers here, per layout (its table, not a copy)
read -r PADDED_IMPLS PACKED_IMPLS SHARED_IMPLS < <(python -c "
from grpo_kernels.hf import ATTENTION_RULES
print(' '.join(','.join(ATTENTION_RULES[('$KIND', l)].prefer) for l in ('padded', 'packed', 'shared')))")
stamp "attention rule on $KIND: padded ${PADDED_IMPLS}, packed ${PACKED_IMPLS}, shared ${SHARED_IMPLS}"

STEP=(python -m benchmarks.trainer_step "${SHAPE[@]}" --num_generations "$G"
      --completion_tokens "$CAP" --length_profile lognormal --assets "$ASSETS"
      --out "$OUT/results")
LOSS=("${STEP[@]}" --provider fused --synthetic "${LOSS_RUN[@]}")

# 1. the loss phase: padded against packed (short prompt) and shared (long prompt) rows
run_step "loss-p${PROMPT_SHORT}-padded" "$LOSS_BUDGET_S" - "${LOSS[@]}" \
  --prompt_tokens "$PROMPT_SHORT" --padding_free off
for impl in ${PACKED_IMPLS//,/ }; do
  run_step "loss-p${PROMPT_SHORT}-packed-$impl" "$LOSS_BUDGET_S" - "${LOSS[@]}" \
    --prompt_tokens "$PROMPT_SHORT" --share_prompt off --attn_implementation "$impl"
done
run_step "loss-p${PROMPT_LONG}-padded" "$LOSS_BUDGET_S" - "${LOSS[@]}" \
  --prompt_tokens "$PROMPT_LONG" --padding_free off
for impl in ${SHARED_IMPLS//,/ }; do
  run_step "loss-p${PROMPT_LONG}-shared-$impl" "$LOSS_BUDGET_S" - "${LOSS[@]}" \
    --prompt_tokens "$PROMPT_LONG" --attn_implementation "$impl"
done

# 2. whole steps with real generation: TRL's defaults, our TRL subclass, grpo_train
for provider in trl trl-kernels fused; do
  modules=-
  [ "$provider" = fused ] || modules="trl, datasets"
  run_step "step-p${PROMPT_SHORT}-$provider" "$STEP_BUDGET_S" "$modules" "${STEP[@]}" \
    --provider "$provider" --prompt_tokens "$PROMPT_SHORT" "${STEP_RUN[@]}"
done

# 3. generation alone: TRL's default call (per-row) against grpo_train's paths
slug=$(python -c "import torch; from benchmarks import device_slug
print(device_slug(torch.device('$KIND')))")
run_step "generation-p${PROMPT_SHORT}" "$GEN_BUDGET_S" - python -m benchmarks.generation \
  --workloads trainer-64 --paths "$GEN_PATHS" --per_path "${GEN[@]}" \
  --out "$OUT/results/$slug-generation.csv"

stamp "done"
cat "$SUMMARY"
