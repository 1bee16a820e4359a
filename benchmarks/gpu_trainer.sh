#!/usr/bin/env bash
# A call on a machine with a CUDA device (H100/H200): the trainer's pairs that set the
# generation rule (grpo_train.generation.GENERATION_RULES) and the attention rule
# (grpo_kernels.hf.ATTENTION_RULES), with TRL 1.16 beside us. Qwen2.5-0.5B shape, random weights,
# G completions of forced long-tailed lengths (cap CAP). Three parts, in this order (PARTS):
#   generation  first benchmarks.sdpa_probe: the decode step's attention call, cold (the first
#               call at a new KV length) against warm, per sdpa backend, and which backend and
#               kernels PyTorch's choice runs; then generation alone (benchmarks.generation,
#               workload trainer-64): the padded path with cuDNN attention excluded
#               (--sdpa_backends flash,efficient,math: with the probe, the decisive pair), then
#               TRL's default call (`per-row`: model.generate, a prefill per row) against
#               grpo_train's paths (padded, continuous, static), bf16 weights; then grpo_train
#               --bf16's case, float32 weights under bf16 autocast (padded, static). The untimed
#               call per path is cut to WARM_TOKENS tokens (the same shapes and compiled graphs,
#               fewer decode steps), so the timed call meets new KV lengths;
#   loss        the loss phase on synthetic completions, with a warm-up step per timed step (each
#               timed step's lengths replayed first, so no timed step compiles a kernel variant):
#               grpo_train's padded rows against packed rows at a PROMPT_SHORT-token prompt and
#               against shared rows at a PROMPT_LONG-token prompt, each attention implementation
#               the rule considers for that layout; then TRL's GRPOTrainer and grpo_kernels' TRL
#               subclass at the short prompt;
#   steps       whole steps with real generation: TRL's GRPOTrainer with its defaults, the TRL
#               subclass, and grpo_train with the static path; on a GPU each with one warm-up
#               step that replays the timed step's lengths (compiles, cuBLAS and attention
#               set-ups at those shapes), so all three are timed in the steady state of a run.
# Steps run under a DEADLINE_S deadline (a device run's; a dry run's is 280 s), each under
# `timeout` (its budget or what is left), and each appends its rows as it finishes, so a step cut
# short leaves the others; the peers' install is cut to what is left too.
#
# Usage (repository root; OUT = where results go, default ./gpu_out):
#   BENCH_COMMIT=<short sha> OUT=/some/dir bash benchmarks/gpu_trainer.sh
#   DRY_RUN=1 OUT=/tmp/dry bash benchmarks/gpu_trainer.sh   # every step on the CPU, tiny shapes
# On a GPU machine with a 10-minute limit per command, two calls that fit, copying .whl/ along:
#   BENCH_COMMIT=<sha> PARTS=generation,loss DEADLINE_S=540 OUT=$OUT bash ...   (timeout_s 570)
#   BENCH_COMMIT=<sha> PARTS=steps DEADLINE_S=540 OUT=$OUT bash ...             (timeout_s 570)
# (the steps part's warm-up steps double its time: it takes a call of its own)
# TRL and datasets may be missing on the GPU machine: copy .whl/ (benchmarks/fetch_wheels.sh, LEAN=1);
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
#   results/<device>-sdpa.csv            benchmarks.sdpa_probe rows, one per call and backend,
#                                        and the profiled default's backend and kernels
set -uo pipefail
cd "$(dirname "$0")/.."
DRY_RUN="${DRY_RUN:-0}"
PARTS="${PARTS:-generation,loss,steps}"
source benchmarks/gpu_common.sh

# ---- shapes and budgets: one block per mode (gpu_common.sh's use_block checks that both set the
# same variables). DEADLINE: seconds from the start, read by every step's timeout and by
# install_peers; a device run takes it from DEADLINE_S.
device_block() {
  KIND=cuda; DEADLINE="${DEADLINE_S:-450}"; MIN_STEP_S=30
  SHAPE=(--device cuda)
  G=8; CAP=1024; PROMPT_SHORT=64; PROMPT_LONG=1024; WARM_TOKENS=16
  LOSS_RUN=(--warmup 2 --steps 2); STEP_RUN=(--warmup 1 --steps 1)
  LOSS_BUDGET_S=60; STEP_BUDGET_S=170; GEN_BUDGET_S=200
  PROBE=(--lengths 32 --repeats 5); PROBE_BUDGET_S=45; NO_CUDNN_BUDGET_S=100
  GEN=(--max_new "$CAP" --prompt_tokens "$PROMPT_SHORT" --threads 0 --repeats 1)
  GEN_PATHS=per-row,padded,continuous,static
  AUTOCAST_PATHS=padded,static
  STATIC=static
}
dry_block() {  # the CPU, tiny shapes: every step runs, in a few minutes
  KIND=cpu; DEADLINE=280; MIN_STEP_S=15
  SHAPE=(--device cpu --tiny --profile_bytes off)
  G=4; CAP=16; PROMPT_SHORT=16; PROMPT_LONG=48; WARM_TOKENS=4
  LOSS_RUN=(--warmup 1 --steps 1); STEP_RUN=(--warmup 0 --steps 1)
  LOSS_BUDGET_S=60; STEP_BUDGET_S=90; GEN_BUDGET_S=90
  PROBE=(--tiny); PROBE_BUDGET_S=45; NO_CUDNN_BUDGET_S=90
  GEN=(--tiny --max_new "$CAP" --prompt_tokens "$PROMPT_SHORT" --threads 1 --repeats 1)
  GEN_PATHS=per-row,padded,static-eager,continuous  # a CPU compile takes ~40 s: not here
  AUTOCAST_PATHS=padded,static-eager
  STATIC=static-eager  # grpo_train's whole step on the static path (uncompiled on the CPU)
}
use_block device_block dry_block
SUMMARY="$OUT/gpu_trainer.csv"
LOG="$OUT/gpu_trainer.log"
[ -f "$SUMMARY" ] || echo "step,status,seconds,command" > "$SUMMARY"
# the random model, built once and shared by the trainer_step runs: in a scratch folder, never
# under $OUT (its weights would travel back, or fill PACK's archive, at every stamp)
make_scratch ASSETS
part() { [[ ",$PARTS," == *",$1,"* ]]; }

source benchmarks/gpu_steps.sh  # row, run_step

stamp "environment (DRY_RUN=$DRY_RUN, PARTS=$PARTS, deadline ${DEADLINE}s)"
write_env
# TRL and datasets from .whl/ (a dry run installs them into a scratch folder: the environment
# stays as it is, and the next dry run meets the same one)
if part loss || part steps; then install_peers 60; fi

STEP=(python -m benchmarks.trainer_step "${SHAPE[@]}" --num_generations "$G"
      --completion_tokens "$CAP" --length_profile lognormal --assets "$ASSETS"
      --out "$OUT/results")
LOSS=("${STEP[@]}" --synthetic "${LOSS_RUN[@]}")
WARM=(--warmup_tokens "$WARM_TOKENS")

# 1. the decode step's attention, cold against warm per sdpa backend (cheap: first); then
# generation alone: TRL's default call (per-row) against grpo_train's paths
if part generation; then
  run_step sdpa-probe "$PROBE_BUDGET_S" - python -m benchmarks.sdpa_probe --device "$KIND" \
    "${PROBE[@]}" --out "$OUT/results"
  slug=$(python -c "import torch; from benchmarks import device_slug
print(device_slug(torch.device('$KIND')))")
  GENERATION=(python -m benchmarks.generation --workloads trainer-64 --per_path --device "$KIND"
              "${GEN[@]}" "${WARM[@]}" --out "$OUT/results/$slug-generation.csv")
  # first the padded bf16 run with cuDNN attention excluded: with the probe, whether each new KV
  # length costs a cuDNN graph build (a decode step meets a new length at every token)
  run_step "generation-p${PROMPT_SHORT}-padded-no-cudnn" "$NO_CUDNN_BUDGET_S" - \
    "${GENERATION[@]}" --paths padded --dtype bfloat16 --sdpa_backends flash,efficient,math
  run_step "generation-p${PROMPT_SHORT}-bf16" "$GEN_BUDGET_S" - "${GENERATION[@]}" \
    --paths "$GEN_PATHS" --dtype bfloat16
  run_step "generation-p${PROMPT_SHORT}-autocast" "$GEN_BUDGET_S" - "${GENERATION[@]}" \
    --paths "$AUTOCAST_PATHS" --dtype float32 --autocast
fi

# 2. the loss phase: padded against packed (short prompt) and shared (long prompt) rows, each
# implementation the attention rule considers here (its table, not a copy); TRL beside us
if part loss; then
  read -r PACKED_IMPLS SHARED_IMPLS < <(python -c "
from grpo_kernels.hf import ATTENTION_RULES
print(' '.join(','.join(ATTENTION_RULES[('$KIND', l)].prefer) for l in ('packed', 'shared')))")
  stamp "attention rule on $KIND: packed ${PACKED_IMPLS}, shared ${SHARED_IMPLS}"
  run_step "loss-p${PROMPT_SHORT}-padded" "$LOSS_BUDGET_S" - "${LOSS[@]}" --provider fused \
    --prompt_tokens "$PROMPT_SHORT" --padding_free off
  for impl in ${PACKED_IMPLS//,/ }; do
    run_step "loss-p${PROMPT_SHORT}-packed-$impl" "$LOSS_BUDGET_S" - "${LOSS[@]}" \
      --provider fused --prompt_tokens "$PROMPT_SHORT" --share_prompt off \
      --attn_implementation "$impl"
  done
  run_step "loss-p${PROMPT_LONG}-padded" "$LOSS_BUDGET_S" - "${LOSS[@]}" --provider fused \
    --prompt_tokens "$PROMPT_LONG" --padding_free off
  for impl in ${SHARED_IMPLS//,/ }; do
    run_step "loss-p${PROMPT_LONG}-shared-$impl" "$LOSS_BUDGET_S" - "${LOSS[@]}" \
      --provider fused --prompt_tokens "$PROMPT_LONG" --attn_implementation "$impl"
  done
  for provider in trl trl-kernels; do
    run_step "loss-p${PROMPT_SHORT}-$provider" "$LOSS_BUDGET_S" "trl, datasets" "${LOSS[@]}" \
      --provider "$provider" --prompt_tokens "$PROMPT_SHORT"
  done
fi

# 3. whole steps with real generation: TRL's defaults, our TRL subclass, grpo_train (static)
if part steps; then
  for provider in trl trl-kernels; do
    run_step "step-p${PROMPT_SHORT}-$provider" "$STEP_BUDGET_S" "trl, datasets" "${STEP[@]}" \
      --provider "$provider" --prompt_tokens "$PROMPT_SHORT" "${STEP_RUN[@]}"
  done
  run_step "step-p${PROMPT_SHORT}-fused-$STATIC" "$STEP_BUDGET_S" - "${STEP[@]}" \
    --provider fused --prompt_tokens "$PROMPT_SHORT" "${STEP_RUN[@]}" \
    --generation static --static_compile "$([ "$STATIC" = static ] && echo on || echo off)"
fi

stamp "done"
cat "$SUMMARY"
