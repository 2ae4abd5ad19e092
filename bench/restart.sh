#!/usr/bin/env bash
# What a lost rank costs today (issue 37's baseline): examples/train on TCP processes,
# saving a checkpoint every K steps, once without a failure and once with one rank killed
# (SIGKILL, --kill R@S) and the job restarted by the launcher (--max-restarts 1), which
# resumes from the last committed checkpoint and redoes the steps since. The runs
# interleave (plain, killed, plain, killed, ...), so the machine's load falls on both;
# the script prints each run's wall time, the medians, the difference (what the failure
# cost: the restart, the checkpoint load and the redone steps) and how many steps were
# redone, and checks that both runs trained the same parameters (the fingerprint line).
# The same kill with in-memory recovery runs third in each round (--peer-checkpoint
# --restart-scope rank: only the killed rank restarts; every rank restores the last step
# from its peers' copies in host memory), against the restart of every rank in the same run.
#
# Usage: bench/restart.sh [TRAIN_BINARY] [RUNS]   (default: bazel-bin/examples/train, 3)
# Or: bazel run -c opt //bench:restart [-- RUNS]
# Model and job (environment): NPROC=4 STEPS=12 EVERY=4 KILL=2@10 BLOCKS=6 DIM=256 HIDDEN=1024
set -uo pipefail

train=${1:-bazel-bin/examples/train}
if [[ -n ${RUNFILES_DIR:-} || -d "$0.runfiles" ]]; then  # bazel run
  runfiles=${RUNFILES_DIR:-$0.runfiles}
  [[ $# -ge 1 && $1 =~ ^[0-9]+$ ]] && set -- "" "$1"
  train="$runfiles/fsdp/examples/train"
fi
runs=${2:-3}
nproc=${NPROC:-4} steps=${STEPS:-12} every=${EVERY:-4} kill=${KILL:-2@10}
model=(--blocks "${BLOCKS:-6}" --dim "${DIM:-256}" --hidden "${HIDDEN:-1024}")
[[ -x $train ]] || { echo "bench/restart.sh: no train binary at '$train' (bazel build -c opt //examples:train)" >&2; exit 2; }
[[ $runs =~ ^[1-9][0-9]?$ ]] || { echo "bench/restart.sh: RUNS must be 1..99, got '$runs'" >&2; exit 2; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fsdp-restart-bench.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# one NAME ARGS...: runs train once; prints its wall seconds, the seconds to its first step
# and (a killed run) from the kill being reported to the first step after the restart. Its
# output, each line after the seconds since the start, goes to $tmp/NAME.log.
one() {
  local name=$1 start line now first="" killed_at="" again=""
  shift
  rm -rf "$tmp/ckpt"
  start=$(date +%s.%N)
  {
    timeout 600 "$train" "${model[@]}" --backend tcp --nproc "$nproc" --steps "$steps" --save "$tmp/ckpt" \
      --save-every "$every" "$@" 2>&1
    echo "exit status: $?"
  } | while IFS= read -r line; do echo "$(echo "$(date +%s.%N) - $start" | bc -l) $line"; done >"$tmp/$name.log"
  if ! grep -q ' exit status: 0$' "$tmp/$name.log"; then  # in a subshell: the caller checks $tmp/failed
    echo "bench/restart.sh: run '$name' failed:" >&2
    tail -5 "$tmp/$name.log" >&2
    touch "$tmp/failed"
    return 1
  fi
  now=$(tail -1 "$tmp/$name.log" | cut -d' ' -f1)
  first=$(grep -m1 ' \[rank 0\] step ' "$tmp/$name.log" | cut -d' ' -f1)
  killed_at=$(grep -m1 ' fsdp_run: rank .* exited with status 137' "$tmp/$name.log" | cut -d' ' -f1)
  [[ -n $killed_at ]] && again=$(awk -v k="$killed_at" '$1 > k && / \[rank 0\] step / { print $1; exit }' "$tmp/$name.log")
  echo "$now ${first:-0} $(if [[ -n $again ]]; then echo "$again - $killed_at" | bc -l; else echo 0; fi)"
}
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
fingerprint() { sed -n 's/^[0-9.]* \[rank 0\] parameters: xxh64=//p' "$1"; }

echo "model: ${model[*]}; $nproc TCP processes, $steps steps, --save-every $every; killed: --kill $kill --max-restarts 1"
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
plain=() killed=() startup=() recovery=() memory=() memory_recovery=()
for ((i = 1; i <= runs; i++)); do
  read -r wall first _ < <(one plain)
  [[ -e $tmp/failed ]] && exit 1
  plain+=("$wall") startup+=("$first")
  read -r wall _ again < <(one killed --kill "$kill" --max-restarts 1)
  [[ -e $tmp/failed ]] && exit 1
  killed+=("$wall") recovery+=("$again")
  read -r wall _ again < <(one memory --kill "$kill" --max-restarts 1 --restart-scope rank --peer-checkpoint)
  [[ -e $tmp/failed ]] && exit 1
  memory+=("$wall") memory_recovery+=("$again")
  printf 'run %d: without a failure %.2f s (first step after %.2f s); with rank %s killed and the job restarted %.2f s (from the kill to training again: %.2f s); recovered in memory %.2f s (%.2f s)\n' \
    "$i" "${plain[-1]}" "${startup[-1]}" "${kill%@*}" "${killed[-1]}" "${recovery[-1]}" "${memory[-1]}" "${memory_recovery[-1]}"
done
p=$(printf '%s\n' "${plain[@]}" | median) k=$(printf '%s\n' "${killed[@]}" | median)
s0=$(printf '%s\n' "${startup[@]}" | median) rec=$(printf '%s\n' "${recovery[@]}" | median)
m=$(printf '%s\n' "${memory[@]}" | median) mrec=$(printf '%s\n' "${memory_recovery[@]}" | median)
resumed=$(sed -n 's/^[0-9.]* \[rank 0\] checkpoint: resumed step \([0-9]*\) from .*/\1/p' "$tmp/killed.log")
printf 'median: %.2f s without a failure, %.2f s with one (%.2fx); the failure cost %.2f s\n' "$p" "$k" \
  "$(echo "$k / $p" | bc -l)" "$(echo "$k - $p" | bc -l)"
printf 'median: from the kill to training again %.2f s, of which a fresh start of the job takes about %.2f s (its time to the first step without a failure: starting processes, the example'"'"'s unsharded reference run on rank 0, sharding)\n' \
  "$rec" "$s0"
printf 'median, recovered in memory (only rank %s restarted): %.2f s (%.2fx of without a failure; the failure and the copies cost %.2f s), from the kill to training again %.2f s (%.2fx of the restart'"'"'s)\n' \
  "${kill%@*}" "$m" "$(echo "$m / $p" | bc -l)" "$(echo "$m - $p" | bc -l)" "$mrec" "$(echo "$mrec / $rec" | bc -l)"
sed -n 's/^[0-9.]* \[rank 0\] \(recovered: .*\)/in memory: \1/p' "$tmp/memory.log"
echo "killed as step ${kill#*@} began; resumed from step ${resumed:-?} (the last committed checkpoint);" \
  "steps redone: $(( ${kill#*@} - 1 - ${resumed:-0} ))"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
if [[ -z $(fingerprint "$tmp/plain.log") || $(fingerprint "$tmp/plain.log") != $(fingerprint "$tmp/killed.log") ]]; then
  echo "bench/restart.sh: the restarted run trained other parameters: $(fingerprint "$tmp/plain.log") vs" \
    "$(fingerprint "$tmp/killed.log")" >&2
  exit 1
fi
if [[ $(fingerprint "$tmp/plain.log") != $(fingerprint "$tmp/memory.log") ]]; then
  echo "bench/restart.sh: the run recovered in memory trained other parameters: $(fingerprint "$tmp/plain.log") vs" \
    "$(fingerprint "$tmp/memory.log")" >&2
  exit 1
fi
echo "parameters: xxh64=$(fingerprint "$tmp/killed.log") in all three (bit for bit)"
