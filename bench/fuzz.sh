#!/bin/sh
# bench/fuzz.sh [SECONDS] [TARGET...] - runs every libFuzzer target of scripts/fuzz (or the ones
# named) for SECONDS each (default 300) and prints, per target: executions, executions per
# second, coverage (edges) and features reached, corpus size, and crashes (a crash stops that
# target; its input is left in the work folder). Work folders: ${TMPDIR:-/tmp}/sp-fuzz-bench-*.
set -u
root=$(cd "$(dirname "$0")/.." && pwd)
secs=${1:-300}
[ $# -gt 0 ] && shift
targets=${*:-$("$root/scripts/fuzz" list)}
printf '%-16s %12s %10s %8s %8s %8s %8s\n' target executions exec/s cov ft corpus crashes
fail=0
for t in $targets; do
  work=${TMPDIR:-/tmp}/sp-fuzz-bench-$t
  mkdir -p "$work"
  SP_FUZZ_SECONDS=$secs "$root/scripts/fuzz" run "$t" "$work" >"$work/run.log" 2>&1
  rc=$?
  if [ $rc -eq 77 ]; then
    echo "$t: skipped ($(tail -1 "$work/run.log"))"
    continue
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$work/run.log" | tail -1)
  last=$(grep -E '^#[0-9]+' "$work/run.log" | tail -1)
  cov=$(echo "$last" | sed -n 's/.*cov: \([0-9]*\).*/\1/p')
  ft=$(echo "$last" | sed -n 's/.*ft: \([0-9]*\).*/\1/p')
  corp=$(echo "$last" | sed -n 's/.*corp: \([0-9]*\).*/\1/p')
  crashes=$(ls "$work"/crash-* "$work"/leak-* "$work"/timeout-* 2>/dev/null | wc -l)
  [ $rc -ne 0 ] && fail=1
  printf '%-16s %12s %10s %8s %8s %8s %8s\n' "$t" "${execs:-?}" \
    "$(( ${execs:-0} / (secs > 0 ? secs : 1) ))" "${cov:-?}" "${ft:-?}" "${corp:-?}" "$crashes"
done
exit $fail
