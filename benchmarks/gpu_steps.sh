# Sourced by benchmarks/gpu_trainer.sh: one step of a device script under a deadline, with a
# summary row per step. Expects START (gpu_common.sh), DEADLINE, MIN_STEP_S, SUMMARY (a CSV
# with the header "step,status,seconds,command") and LOG, and `stamp`.
#   row NAME STATUS SECONDS COMMAND       appends a summary row (and says it)
#   run_step NAME BUDGET_S MODULES CMD... runs CMD under `timeout` (its budget or what is left
#                                         of the deadline), output appended to LOG; the row says
#                                         ok, "timeout after Ns" or "failed: exit N"; "n/a: ...
#                                         not installed" where `import MODULES` fails (MODULES:
#                                         "-" for none), "skipped: ..." under MIN_STEP_S left

row() {
  printf '"%s","%s",%s,"%s"\n' "$1" "$2" "$3" "$4" >> "$SUMMARY"
  echo "  $1: $2 (${3}s)"
}

run_step() {
  local name=$1 budget=$2 modules=$3
  shift 3
  if [ "$modules" != - ] && ! python -c "import ${modules}" > /dev/null 2>&1; then
    row "$name" "n/a: ${modules} not installed" 0 "$*"
    return
  fi
  local left=$(( DEADLINE - ($(date +%s) - START) ))
  if [ "$left" -lt "$MIN_STEP_S" ]; then
    row "$name" "skipped: ${left}s left of the ${DEADLINE}s deadline" 0 "$*"
    return
  fi
  local limit=$(( budget < left ? budget : left ))
  stamp "$name (timeout ${limit}s)"
  echo "==== $name: $*" >> "$LOG"
  local t0 rc status
  t0=$(date +%s)
  timeout "$limit" "$@" >> "$LOG" 2>&1
  rc=$?
  case $rc in
    0) status=ok ;;
    124) status="timeout after ${limit}s" ;;
    *) status="failed: exit $rc" ;;
  esac
  row "$name" "$status" $(( $(date +%s) - t0 )) "$*"
}
