#!/usr/bin/env bash
# One call on a machine with a CUDA device: our fused linear loss against the peers that also
# avoid [N, V] logits (TRL's head, Cut Cross-Entropy, Liger-Kernel) and the eager and compiled
# reference. Built to finish inside 8 minutes: every step's `timeout` is cut to what is left of
# a 450 s deadline, each sweep stops starting new (provider, shape) pairs when its --time-budget
# runs out, and rows are appended as they are measured, so a step cut short keeps its numbers.
# The most important rows come first: the Llama-3-8B head at N = 16384.
#
# Usage (repository root, with the wheels of benchmarks/fetch_wheels.sh in .whl/ when the machine
# has no network):
#   BENCH_COMMIT=<short sha> OUT=/some/dir bash benchmarks/gpu_peers.sh
#
# Writes under $OUT:
#   env.txt                nvidia-smi, versions, commit, what the wheels installed
#   peers-llama8b.md       Llama-3-8B head, N = 16384: all peers, forward and fwd+bwd
#   profile.md             per-kernel profile of ours and eager at the Llama-3-8B head, N = 16384
#   peers-n*.md            fwd+bwd at the other heads and token counts, as time allows
#   results/<device>.csv   every row (copy into benchmarks/results/)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_common.sh
DEADLINE="${DEADLINE:-450}"  # seconds from the start; the device call's limit is 8 minutes
# timeout for a step: its own limit, or what is left before the deadline if that is less
limit() { local left=$(( DEADLINE - ($(date +%s) - START) )); echo $(( left < $1 ? left : $1 )); }

stamp "environment"
write_env
stamp "installing the peers from .whl/"
timeout "$(limit 90)" bash benchmarks/install_wheels.sh >> "$OUT/env.txt" 2>&1
tail -n 3 "$OUT/env.txt"

# sweep NAME BUDGET TIMEOUT ARGS...: one `python -m benchmarks` run into $OUT/NAME.md
sweep() {
  local name=$1 budget=$2 cap t
  cap=$(limit "$3")
  shift 3
  if [ "$cap" -le 20 ]; then stamp "skipped $name: deadline"; return; fi
  t=$(( budget < cap - 15 ? budget : cap - 15 ))
  stamp "sweep: $name (timeout ${cap}s, budget ${t}s)"
  timeout "$cap" python -m benchmarks --kernels fused_linear --out "$OUT/results" \
    --time-budget "$t" --markdown "$@" > "$OUT/$name.md" 2> "$OUT/$name.log"
  echo "exit $?" >> "$OUT/$name.log"
  tail -n 3 "$OUT/$name.log"
}

# 1. The Llama-3-8B head at N = 16384, every provider (the compiled reference runs last), with
#    the matmul and copy ceilings measured first.
sweep peers-llama8b 140 190 --heads llama8b --tokens 16384 --modes forward,fwd+bwd \
  --providers ours,trl,cce,cce-filter,liger,reference,reference-compile
# Where the time goes at that shape: a per-kernel profile of ours and the eager reference
# (docs/gpu.md compares it across commits).
cap=$(limit 60)
if [ "$cap" -gt 20 ]; then
  stamp "profile: llama8b N=16384 (timeout ${cap}s)"
  timeout "$cap" python -m benchmarks.profile_head --head llama8b --tokens 16384 \
    --providers ours reference --out "$OUT/results" > "$OUT/profile.md" 2> "$OUT/profile.log"
  echo "exit $?" >> "$OUT/profile.log"
else
  stamp "skipped profile: deadline"
fi
# 2. Forward + backward at the other shapes, eager providers, N = 16384 first, then 65536, 4096.
eager=ours,trl,cce,liger,reference
sweep peers-n16384 60 80 --heads qwen0.5b,qwen7b --tokens 16384 --modes fwd+bwd \
  --providers "$eager" --no-ceilings
sweep peers-n65536 70 90 --heads llama8b,qwen7b,qwen0.5b --tokens 65536 --modes fwd+bwd \
  --providers "$eager" --no-ceilings
sweep peers-n4096 40 60 --heads llama8b,qwen7b,qwen0.5b --tokens 4096 --modes fwd+bwd \
  --providers "$eager" --no-ceilings
stamp "done"
