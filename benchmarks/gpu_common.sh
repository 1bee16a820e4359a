# Sourced by the GPU scripts (gpu_session.sh, gpu_peers.sh, ...) from the repository root. It sets
#   OUT       the output folder (default ./gpu_out, with results/)
#   START     the start time (seconds since the epoch)
#   DRY_RUN   1: the dry run, every step on the CPU at tiny shapes (CUDA hidden); 0 (default):
#             the device run
# and defines
#   stamp MESSAGE       a timed line on stdout and in $OUT/steps.txt (and, with PACK, the archive)
#   write_env           $OUT/env.txt: nvidia-smi, Python, torch, CUDA, Triton, the device, the
#                       commit (BENCH_COMMIT when the tree copy has no .git), the kind of run
#   use_block DEV DRY   calls the function DEV (device run) or DRY (dry run), which set the run's
#                       shapes, providers and budgets, after checking that both set the same
#                       variables (so the dry run cannot drift from the device run)
#   step_limit SECONDS  a step's timeout: SECONDS, or what is left before $DEADLINE if less
#   step_cap NAME SECONDS   CAP = step_limit SECONDS; false, after a "skipped NAME: deadline"
#                       stamp, when 20 s or less are left
#   install_peers SECONDS   the peers from .whl/ (benchmarks/install_wheels.sh; a dry run
#                       installs into a scratch folder put on PYTHONPATH), into $OUT/env.txt;
#                       skipped as a step is (step_cap) when 20 s or less are left
#   dry_says TEXT       " [dry run: TEXT]" in a dry run, nothing in a device run (for stamps)
#   carry_size          one line: the size of the tracked tree and of .whl/
#   make_scratch VAR    VAR = a new temporary folder, removed when the script exits
#   pytest_step, sweep  a step of tests, a benchmark sweep (each described where defined)
# PACK=NAME (letters, digits, '.', '_', '-'): the files are written to a scratch folder instead,
# and $OUT holds NAME.tgz (all of them, rewritten at every stamp and at exit, so a run cut short
# keeps what it wrote) and NAME-steps.txt: for a runner that returns only a few files from $OUT.
_SCRATCH=()
PACKED=""
make_scratch() { printf -v "$1" '%s' "$(mktemp -d)"; _SCRATCH+=("${!1}"); }
pack() {
  [ -n "$PACKED" ] && [ -d "$OUT" ] || return 0
  tar -czf "$PACKED.tgz.part" -C "$(dirname "$OUT")" "$(basename "$OUT")" \
    && mv -f "$PACKED.tgz.part" "$PACKED.tgz"
  cp -f "$OUT/steps.txt" "$PACKED-steps.txt" 2> /dev/null || true
}
stamp() { echo "[$(( $(date +%s) - START ))s] $*" | tee -a "$OUT/steps.txt"; pack; }
write_env() {
  {
    if command -v nvidia-smi > /dev/null; then nvidia-smi; else echo "nvidia-smi: not found"; fi
    python -c "import sys, torch, triton; print(sys.version); print('torch', torch.__version__,
      'cuda', torch.version.cuda, 'triton', triton.__version__,
      'device', torch.cuda.get_device_name() if torch.cuda.is_available() else None)"
    echo "commit ${BENCH_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
    if [ "$DRY_RUN" = 1 ]; then echo "run: dry (DRY_RUN=1: CPU, tiny shapes)"
    else echo "run: device"; fi
  } > "$OUT/env.txt" 2>&1
}

# the names of the variables that function $1 sets (run in a subshell: nothing is kept)
_block_vars() {
  (
    __before=$(compgen -v | sort)
    "$1" > /dev/null
    comm -13 <(echo "$__before") <(compgen -v | sort) | grep -vx "__before"
  )
}
use_block() {
  local dev dry
  dev=$(_block_vars "$1")
  dry=$(_block_vars "$2")
  if [ "$dev" != "$dry" ]; then
    echo "$1 and $2 must set the same variables; they differ in:" \
      $(comm -3 <(echo "$dev") <(echo "$dry")) >&2
    exit 2
  fi
  if [ "$DRY_RUN" = 1 ]; then "$2"; else "$1"; fi
}
step_limit() {
  local left=$(( ${DEADLINE:-100000} - ($(date +%s) - START) ))
  echo $(( left < $1 ? left : $1 ))
}
step_cap() {
  CAP=$(step_limit "$2")
  if [ "$CAP" -le 20 ]; then stamp "skipped $1: deadline"; return 1; fi
}
install_peers() {
  local site
  if ! ls .whl/*.whl > /dev/null 2>&1; then
    stamp "install peers: skipped, no .whl/ (benchmarks/fetch_wheels.sh); the peers found here:"
    bash benchmarks/install_wheels.sh >> "$OUT/env.txt" 2>&1
  elif ! step_cap "install peers" "$1"; then  # (timeout 0 would mean no limit)
    return 0
  elif [ "$DRY_RUN" = 1 ]; then  # a rehearsal leaves the environment as it is
    make_scratch site
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    stamp "install peers from .whl/$(dry_says "pip --target $site, missing ones only")"
    TARGET="$site" timeout "$CAP" bash benchmarks/install_wheels.sh \
      >> "$OUT/env.txt" 2>&1
  else
    stamp "install peers from .whl/"
    timeout "$CAP" bash benchmarks/install_wheels.sh >> "$OUT/env.txt" 2>&1
  fi
  tail -n 3 "$OUT/env.txt"
}
dry_says() { if [ "$DRY_RUN" = 1 ]; then echo " [dry run: $*]"; fi; }
carry_size() {
  local tree what="tracked tree" whl
  if git rev-parse --git-dir > /dev/null 2>&1; then
    tree=$(git ls-files -z | du -cb --files0-from=- 2> /dev/null | tail -n 1 | cut -f1)
  else  # a copy of the tree without .git (as a device machine gets it): all of it but .whl/
    what="tree copy"
    tree=$(du -sb --exclude=./.whl . 2> /dev/null | cut -f1)
  fi
  whl=$(du -sb .whl 2> /dev/null | cut -f1)
  echo "$what $(( ${tree:-0} / 1048576 )) MiB, .whl/ $(( ${whl:-0} / 1048576 )) MiB" \
    "(a device call carries at most 64 MiB in all)"
}

# pytest_step LABEL FILE NOTE TEST_PATH...: the tests at TEST_PATH (PYTEST_SELECT; PYTEST_WORKERS
# xdist workers where xdist is installed) within PYTEST_TIMEOUT into $OUT/FILE, then "exit N"
# there; NOTE says how a dry run differs
pytest_step() {
  local label=$1 file=$2 note=$3 workers=()
  shift 3
  step_cap "$label" "$PYTEST_TIMEOUT" || return 0
  stamp "$label (timeout ${CAP}s)$(dry_says "$note")"
  if [ "$PYTEST_WORKERS" -gt 0 ] && python -c "import xdist" 2> /dev/null; then
    workers=(-n "$PYTEST_WORKERS")
  fi
  timeout "$CAP" python -m pytest -q -ra "${workers[@]}" -p no:cacheprovider "$@" \
    "${PYTEST_SELECT[@]}" > "$OUT/$file" 2>&1
  echo "exit $?" >> "$OUT/$file"
  tail -n 3 "$OUT/$file"
}
# sweep NAME BUDGET TIMEOUT ARGS...: one `python -m benchmarks` run (SWEEP_ARGS first) into
# $OUT/NAME.md (table) and $OUT/NAME.log (progress, the routes ours took, the exit status)
sweep() {
  local name=$1 budget=$2
  step_cap "sweep $name" "$3" || return 0
  shift 3
  budget=$(( budget < CAP - 15 ? budget : CAP - 15 ))
  stamp "sweep $name: $* (timeout ${CAP}s, budget ${budget}s)$(dry_says "$ON_CPU")"
  timeout "$CAP" python -m benchmarks --out "$OUT/results" --time-budget "$budget" --markdown \
    "${SWEEP_ARGS[@]}" "$@" > "$OUT/$name.md" 2> "$OUT/$name.log"
  echo "exit $?" >> "$OUT/$name.log"
  tail -n 3 "$OUT/$name.log"
}

_at_exit() { pack; rm -rf "${_SCRATCH[@]}"; }
trap _at_exit EXIT
OUT="${OUT:-./gpu_out}"
DRY_RUN="${DRY_RUN:-0}"
case "$DRY_RUN" in
  0 | 1) ;;
  *) echo "DRY_RUN must be 0 or 1, got '$DRY_RUN'" >&2; exit 2 ;;
esac
if [ -n "${PACK:-}" ]; then
  case "$PACK" in
    *[!A-Za-z0-9._-]*) echo "PACK must be letters, digits, '.', '_' or '-', got '$PACK'" >&2
                       exit 2 ;;
  esac
  mkdir -p "$OUT"
  PACKED="$(cd "$OUT" && pwd)/$PACK"
  make_scratch _packing
  OUT="$_packing/$PACK"
fi
mkdir -p "$OUT/results"
export PYTHONUNBUFFERED=1
if [ "$DRY_RUN" = 1 ]; then
  export CUDA_VISIBLE_DEVICES=""  # the CPU, whatever the machine has
  unset TRITON_INTERPRET  # the chunked path on CPU tensors, as a user's CPU run takes it
fi
# `python` must be the interpreter that holds torch (an image may have it only as python3)
if ! python -c "import importlib.util as u, sys; sys.exit(u.find_spec('torch') is None)" \
    2> /dev/null && command -v python3 > /dev/null; then
  make_scratch _bin
  ln -s "$(command -v python3)" "$_bin/python"
  export PATH="$_bin:$PATH"
fi
START=$(date +%s)
