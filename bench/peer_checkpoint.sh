#!/usr/bin/env bash
# What keeping a peer checkpoint costs in steady state (issue 37, item 6: at most 5% of a
# step on the example's TCP run): examples/train on TCP processes, once plain and once with
# --peer-checkpoint (after every step, a copy of each rank's state in host memory and one
# on the next rank, fsdp::PeerCheckpoint::refresh), interleaved so the machine's load falls
# on both. Each run's steady-state time is from rank 0's step 2 line to its last step line
# (start-up, the unsharded reference and the first step left out). Prints each pair, the
# medians, their ratio and the host memory the copies hold, and checks that both runs
# trained the same parameters (a refresh must not change the model).
#
# Usage: bench/peer_checkpoint.sh [TRAIN_BINARY] [RUNS]   (default: bazel-bin/examples/train, 3)
# Or: bazel run -c opt //bench:peer_checkpoint [-- RUNS]
# Model and job (environment): NPROC=4 STEPS=30 BLOCKS=6 DIM=256 HIDDEN=1024, and
# STRATEGY=FULL_SHARD (HYBRID_SHARD with MESH=2x2: the replicas hold the copies, and refresh
# sends none to rank + 1)
set -uo pipefail

train=${1:-bazel-bin/examples/train}
if [[ -n ${RUNFILES_DIR:-} || -d "$0.runfiles" ]]; then  # bazel run
  runfiles=${RUNFILES_DIR:-$0.runfiles}
  [[ $# -ge 1 && $1 =~ ^[0-9]+$ ]] && set -- "" "$1"
  train="$runfiles/fsdp/examples/train"
fi
runs=${2:-3}
nproc=${NPROC:-4} steps=${STEPS:-30}
model=(--blocks "${BLOCKS:-6}" --dim "${DIM:-256}" --hidden "${HIDDEN:-1024}" --strategy "${STRATEGY:-FULL_SHARD}")
[[ -n ${MESH:-} ]] && model+=(--mesh "$MESH")
[[ -x $train ]] || { echo "bench/peer_checkpoint.sh: no train binary at '$train' (bazel build -c opt //examples:train)" >&2; exit 2; }
[[ $runs =~ ^[1-9][0-9]?$ ]] || { echo "bench/peer_checkpoint.sh: RUNS must be 1..99, got '$runs'" >&2; exit 2; }
[[ $steps =~ ^[0-9]+$ && $steps -ge 3 ]] || { echo "bench/peer_checkpoint.sh: STEPS must be at least 3, got '$steps'" >&2; exit 2; }

tmp=$(mktemp -d "${TMPDIR:-/tmp}/fsdp-peer-bench.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# one NAME ARGS...: runs train once, each output line after the seconds since the start in
# $tmp/NAME.log; prints the seconds from rank 0's step 2 to its last step.
one() {
  local name=$1 start line from to
  shift
  start=$(date +%s.%N)
  {
    timeout 600 "$train" "${model[@]}" --backend tcp --nproc "$nproc" --steps "$steps" "$@" 2>&1
    echo "exit status: $?"
  } | while IFS= read -r line; do echo "$(echo "$(date +%s.%N) - $start" | bc -l) $line"; done >"$tmp/$name.log"
  if ! grep -q ' exit status: 0$' "$tmp/$name.log"; then
    echo "bench/peer_checkpoint.sh: run '$name' failed:" >&2
    tail -5 "$tmp/$name.log" >&2
    return 1
  fi
  from=$(grep -m1 ' \[rank 0\] step   2:' "$tmp/$name.log" | cut -d' ' -f1)
  to=$(grep "$(printf ' \\[rank 0\\] step %3d:' "$steps")" "$tmp/$name.log" | cut -d' ' -f1)
  echo "$to - $from" | bc -l
}
median() { sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
fingerprint() { sed -n 's/^[0-9.]* \[rank 0\] parameters: xxh64=//p' "$1"; }

echo "model: ${model[*]}; $nproc TCP processes, $steps steps; steady state: step 2 to step $steps"
plain=() peer=()
for ((i = 1; i <= runs; ++i)); do
  p=$(one plain) || exit 1
  q=$(one peer --peer-checkpoint) || exit 1
  plain+=("$p") peer+=("$q")
  printf 'run %d: plain %.3f s, --peer-checkpoint %.3f s (%.3fx)\n' "$i" "$p" "$q" "$(echo "$q / $p" | bc -l)"
  if [[ $(fingerprint "$tmp/plain.log") != "$(fingerprint "$tmp/peer.log")" ]]; then
    echo "bench/peer_checkpoint.sh: the runs trained different parameters ($(fingerprint "$tmp/plain.log") vs $(fingerprint "$tmp/peer.log"))" >&2
    exit 1
  fi
done
mp=$(printf '%s\n' "${plain[@]}" | median) mq=$(printf '%s\n' "${peer[@]}" | median)
printf 'median steady state over %d steps: plain %.3f s, --peer-checkpoint %.3f s: %.3fx (%.1f%% per step)\n' \
  "$((steps - 2))" "$mp" "$mq" "$(echo "$mq / $mp" | bc -l)" "$(echo "100 * ($mq - $mp) / $mp" | bc -l)"
sed -n 's/^[0-9.]* \[rank 0\] \(peer checkpoint: .*\)/\1/p' "$tmp/peer.log"
sed -n 's/^[0-9.]* \[rank 0\] \(params: .*\)/\1/p' "$tmp/peer.log" | head -1
echo "same parameters in every pair: yes (xxh64=$(fingerprint "$tmp/peer.log"))"
