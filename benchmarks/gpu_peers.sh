#!/usr/bin/env bash
# One call on a machine with a CUDA device: our fused linear loss, on both of its routes (`ours`,
# the default three-pass route; `ours-4pass`, GRPO_KERNELS_THREE_PASS=0), against the peers that
# also avoid [N, V] logits (TRL's head, Cut Cross-Entropy, Liger-Kernel) and the eager and
# compiled reference. Built to finish inside 8 minutes: every step's `timeout` is cut to what is
# left of a 450 s deadline, each sweep stops starting new (provider, shape) pairs when its
# --time-budget runs out, and rows are appended as they are measured, so a step cut short keeps
# its numbers. The most important rows come first.
#
# The device run, step by step (seconds: the step's budget / its timeout):
#   1. environment; the peers from .whl/ (90; 29 s on an H200)
#   2. pytest: the three-pass route's tests on the device, Triton backend (60; 41 s with 8
#      workers on an H200)
#   3. peers-main: the Llama-3-8B head at N = 16384, score (the forward under no_grad), forward
#      (before a backward) and fwd+bwd, the matmul and copy
#      ceilings first, then the providers in the order the goals compare with them: ours, the
#      eager reference, TRL, CCE, ours-4pass, Liger (about a second a call there), the compiled
#      reference last (170 / 210)
#   4. profile: per-kernel profile of ours, ours-4pass and eager at that shape (70; 17 s)
#   5. three-pass-knobs: the route's chunk budget (half its default, the default, twice) and
#      row kernels (two, or fused) raced at the Llama-3-8B and Qwen2.5-0.5B heads, N = 16384
#      (benchmarks/three_pass_knobs.py; 60)
#   6. peers-heads: fwd+bwd at the Qwen2.5-0.5B and -7B heads, N = 16384 (60 / 80)
#   7. peers-logits: logits input at Qwen2.5-0.5B, N = 16384: ours, Liger's triton_grpo_loss,
#      the reference (25 / 45)
#   8. row-tiles: the logits row kernels' launch configurations raced at Qwen2.5-0.5B,
#      N = 16384 (benchmarks/row_tiles.py; 60)
#   9. peers-long, peers-short: fwd+bwd at N = 65536 and N = 4096, three heads, as time allows
#      (50 / 70, 30 / 45)
#
# On a GPU machine that gets a copy of the tree (repository root here; wheels fetched once,
# 4 MiB; where the copy is size-limited, the tree and .whl/ together):
#   LEAN=1 bash benchmarks/fetch_wheels.sh
#   BENCH_COMMIT=<sha> OUT=$OUT PACK=peers bash benchmarks/gpu_peers.sh   (.whl/ copied along)
#   with <sha> = `git rev-parse --short HEAD` here, written into the command (the device's copy
#   of the tree has no .git); the files come back as $OUT/peers.tgz and $OUT/peers-steps.txt
# Elsewhere: BENCH_COMMIT=<short sha> OUT=/some/dir bash benchmarks/gpu_peers.sh
#
# The dry run: DRY_RUN=1 OUT=/some/dir bash benchmarks/gpu_peers.sh runs every step on the CPU at
# the synthetic heads (a few hundred tokens, float32; the chunked path where the device runs
# Triton) in about two minutes, and writes the same files (tests/benchmarks/test_gpu_dry_run.py).
#
# Writes under $OUT (with PACK=NAME: in $OUT/NAME.tgz, and the steps in $OUT/NAME-steps.txt):
#   env.txt, steps.txt     versions, commit, what the wheels installed; each step, timed
#   pytest.txt             the three-pass route's tests on the device
#   peers-main.md          the main shape: all providers, score, forward and fwd+bwd
#   profile.md             per-kernel profile of both routes of ours and eager there
#   three-pass-knobs.md    the three-pass route's chunk budgets and row kernels raced
#   peers-heads.md, peers-logits.md, peers-long.md, peers-short.md   (and a .log per table)
#   row-tiles.md           the row kernels' configurations raced (and row-tiles.log)
#   results/<device>.csv, results/<device>-profile.csv   every row (copy into benchmarks/results/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_common.sh

device_block() {
  DEADLINE=470  # seconds from the start; the device call's limit is 8 minutes
  INSTALL_TIMEOUT=90
  PYTEST_SELECT=()  # all of the three-pass route's tests
  PYTEST_WORKERS=8
  PYTEST_TIMEOUT=60
  SWEEP_ARGS=()  # flags every sweep gets
  MAIN=(--heads llama8b --tokens 16384)
  MAIN_PROVIDERS=ours,reference,trl,cce,ours-4pass,liger,reference-compile
  MAIN_TIME=(170 210)  # (--time-budget, timeout) in seconds
  PROFILE=(--head llama8b --tokens 16384 --dtype bfloat16 --warmup 2 --steps 3)
  PROFILE_TIMEOUT=70
  KNOBS=(--heads llama8b,qwen0.5b --tokens 16384)
  KNOBS_TIMEOUT=60
  EAGER=ours,reference,trl,cce,ours-4pass,liger
  HEADS=(--heads qwen0.5b,qwen7b --tokens 16384)
  HEADS_TIME=(60 80)
  LOGITS=(--heads qwen0.5b --tokens 16384)
  LOGITS_PROVIDERS=ours,liger,reference
  LOGITS_TIME=(25 45)
  ROW_TILES=(--head qwen0.5b --tokens 16384)
  ROW_TILES_TIMEOUT=60
  LONG=(--heads llama8b,qwen7b,qwen0.5b --tokens 65536)
  LONG_TIME=(50 70)
  SHORT=(--heads llama8b,qwen7b,qwen0.5b --tokens 4096)
  SHORT_TIME=(30 45)
  ON_CPU=""
}
dry_block() {
  DEADLINE=280
  INSTALL_TIMEOUT=90
  PYTEST_SELECT=(-k "triton and (fully_masked or several_chunks)")
  PYTEST_WORKERS=0
  PYTEST_TIMEOUT=60
  SWEEP_ARGS=(--cpu-budget 0.1 --threads 1)
  MAIN=(--heads tiny --tokens 256)
  MAIN_PROVIDERS=ours,reference,trl,cce,ours-4pass,cce-filter,liger,reference-compile
  MAIN_TIME=(170 210)
  PROFILE=(--head tiny --tokens 256 --dtype float32 --warmup 1 --steps 1)
  PROFILE_TIMEOUT=70
  KNOBS=(--heads tiny --tokens 32 --budgets_mib 0.02,0.04 --device cpu)  # 24, 14, 16 rows
  KNOBS_TIMEOUT=60
  EAGER=ours,reference,ours-4pass  # the peers run in peers-main (imports cost seconds a step)
  HEADS=(--heads tiny --tokens 192)
  HEADS_TIME=(60 80)
  LOGITS=(--heads tiny --tokens 256)
  LOGITS_PROVIDERS=ours,liger,reference
  LOGITS_TIME=(25 45)
  ROW_TILES=(--head tiny --tokens 24 --device cpu)
  ROW_TILES_TIMEOUT=60
  LONG=(--heads tiny --tokens 512)
  LONG_TIME=(50 70)
  SHORT=(--heads tiny --tokens 64)
  SHORT_TIME=(30 45)
  ON_CPU="CPU, float32, chunked path; CUDA-only providers n/a"
}
use_block device_block dry_block

stamp "environment$(dry_says "$ON_CPU")"
write_env
if [ "$DRY_RUN" = 1 ]; then stamp "carry size: $(carry_size)"; fi
install_peers "$INSTALL_TIMEOUT"

# The three-pass route's tests on the device first: its rows below mean little if it is wrong
# there (the Triton cases run on the GPU, tests/helpers.py on_device; test_shared_rows.py checks
# at a real vocabulary that the d logits written over the logits chunk match a buffer of their
# own, which the interpreter cannot race; test_value_checks.py that a packed batch's call reads
# nothing back to the host; the NaN tests that the GPU's min / max and block skips keep a NaN)
pytest_step "pytest: the three-pass route's tests" pytest.txt "CPU: Triton's interpreter, a \
small selection" tests/api/test_three_pass.py tests/kernels/test_linear_loss_grad.py \
  tests/kernels/test_gemm.py tests/kernels/test_shared_rows.py tests/api/test_value_checks.py \
  "tests/api/test_fused_linear_grpo.py::test_a_nan_ratio_gives_a_nan_loss" \
  "tests/api/test_fused_linear_grpo.py::test_a_nan_rollout_ratio_gives_nan_gradients"

sweep peers-main "${MAIN_TIME[@]}" --kernels fused_linear "${MAIN[@]}" \
  --modes score,forward,fwd+bwd --providers "$MAIN_PROVIDERS"
# Where the time goes at that shape, on both routes: a per-kernel profile (docs/gpu.md compares
# it across commits).
if step_cap profile "$PROFILE_TIMEOUT"; then
  stamp "profile: ${PROFILE[*]} (timeout ${CAP}s)$(dry_says "CPU: ATen operators, not CUDA \
kernels")"
  timeout "$CAP" python -m benchmarks.profile_head "${PROFILE[@]}" \
    --providers ours ours-4pass reference --out "$OUT/results" > "$OUT/profile.md" \
    2> "$OUT/profile.log"
  echo "exit $?" >> "$OUT/profile.log"
fi
# The three-pass route's launch knobs (the defaults of kernels.linear_loss_grad): chunk budget
# and row kernels
if step_cap three-pass-knobs "$KNOBS_TIMEOUT"; then
  stamp "three-pass-knobs: ${KNOBS[*]} (timeout ${CAP}s)$(dry_says "Triton's interpreter, a \
check of the race, not a measurement")"
  interp=""; if [ "$DRY_RUN" = 1 ]; then interp=TRITON_INTERPRET=1; fi
  env $interp timeout "$CAP" python -m benchmarks.three_pass_knobs "${KNOBS[@]}" \
    --out "$OUT/results" > "$OUT/three-pass-knobs.md" 2> "$OUT/three-pass-knobs.log"
  echo "exit $?" >> "$OUT/three-pass-knobs.log"
fi
sweep peers-heads "${HEADS_TIME[@]}" --kernels fused_linear "${HEADS[@]}" --modes fwd+bwd \
  --providers "$EAGER" --no-ceilings
sweep peers-logits "${LOGITS_TIME[@]}" --kernels logits "${LOGITS[@]}" --modes forward,fwd+bwd \
  --providers "$LOGITS_PROVIDERS" --no-ceilings
# The logits row kernels' launch configurations raced (the default of tile_configs.logits)
if step_cap row-tiles "$ROW_TILES_TIMEOUT"; then
  stamp "row-tiles: ${ROW_TILES[*]} (timeout ${CAP}s)$(dry_says "Triton's interpreter, a check \
of the race, not a measurement")"
  interp=""; if [ "$DRY_RUN" = 1 ]; then interp=TRITON_INTERPRET=1; fi
  env $interp timeout "$CAP" python -m benchmarks.row_tiles "${ROW_TILES[@]}" \
    --out "$OUT/results" > "$OUT/row-tiles.md" 2> "$OUT/row-tiles.log"
  echo "exit $?" >> "$OUT/row-tiles.log"
fi
sweep peers-long "${LONG_TIME[@]}" --kernels fused_linear "${LONG[@]}" --modes fwd+bwd \
  --providers "$EAGER" --no-ceilings
sweep peers-short "${SHORT_TIME[@]}" --kernels fused_linear "${SHORT[@]}" --modes fwd+bwd \
  --providers "$EAGER" --no-ceilings
stamp "done"
