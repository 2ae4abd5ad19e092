#!/usr/bin/env bash
# examples/train survives a rank killed at random points (issue 37, item 5): each case kills
# one rank (SIGKILL) at a seeded random step and phase of the job's first start (--kill
# RANK@STEP:PHASE: as the step begins, mid backward once a unit's gradient is final, before
# the optimizer, while its checkpoint is written, or after training), the launcher restarts
# every rank (--max-restarts 1), the job resumes from the last checkpoint it committed (or
# starts from scratch before the first), and its parameters must equal, bit for bit, those
# of the same job without a failure. Under FullShard on 2 processes and HybridShard on 4
# (a 2x2 mesh). Every run is bounded (timeout 120 s).
#
# Usage: train_restart_test.sh TRAIN_BINARY [SEED] [CASES]
set -u
train="$1"
seed=${2:-20261130}
cases=${3:-24}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/train_restart.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
RANDOM=$seed

fingerprint() { sed -n 's/^\[rank 0\] parameters: xxh64=//p' <<<"$1"; }
steps=6 every=2
small=(--blocks 3 --hidden 128 --backend tcp --steps "$steps")
declare -A job=([full]="--nproc 2 --strategy FULL_SHARD" [hybrid]="--nproc 4 --strategy HYBRID_SHARD --mesh 2x2")
declare -A nproc=([full]=2 [hybrid]=4) whole=()
for kind in full hybrid; do
  # shellcheck disable=SC2086
  out=$(timeout 120 "$train" "${small[@]}" ${job[$kind]} 2>&1) || { fail "$kind: the run without a failure failed: $out"; continue; }
  whole[$kind]=$(fingerprint "$out")
  [[ -n ${whole[$kind]} ]] || fail "$kind: no parameters line: $out"
done

phases=(begin backward optimizer save end)
for ((i = 1; i <= cases; i++)); do
  kind=$([[ $((i % 2)) == 1 ]] && echo full || echo hybrid)
  rank=$((RANDOM % nproc[$kind]))
  phase=${phases[$(((i - 1) / 2 % ${#phases[@]}))]}  # every phase under both strategies; rank and step drawn
  step=$((RANDOM % steps + 1))
  case $phase in
    save) step=$(((RANDOM % (steps / every) + 1) * every)) kill="$rank@$step:save" ;;  # a step that saves
    end) kill="$rank@end" ;;
    *) kill="$rank@$step:$phase" ;;
  esac
  name="case $i ($kind, --kill $kill)"
  dir="$tmp/ckpt$i"
  start=$SECONDS
  # shellcheck disable=SC2086
  out=$(timeout 120 "$train" "${small[@]}" ${job[$kind]} --save "$dir" --save-every "$every" --max-restarts 1 \
    --kill "$kill" 2>&1)
  rc=$?
  if ((rc != 0)); then
    fail "$name: exited $rc: $(tail -5 <<<"$out")"
  elif ! grep -q "^fsdp_run: rank $rank exited with status 137 (signal SIGKILL)" <<<"$out"; then
    fail "$name: the kill is not reported: $out"
  elif ! grep -qx "fsdp_run: restarting every rank (restart 1 of 1)" <<<"$out"; then
    fail "$name: no restart: $out"
  elif [[ $phase != end && "$(fingerprint "$out")" != "${whole[$kind]}" ]]; then
    fail "$name: parameters $(fingerprint "$out"), without the failure ${whole[$kind]}"
  elif [[ $phase == end ]] && ! grep -q "the job had finished training before it failed" <<<"$out"; then
    fail "$name: the restart did not find the finished job's checkpoint: $out"
  elif [[ $phase != end ]] && { ((step >= every + 3)) || [[ $step == $((2 * every)) && $phase == save ]]; } &&
    ! grep -q "^\[rank 0\] checkpoint: resumed step [0-9]* from $dir" <<<"$out"; then
    # By then the step-2 save is committed (at the latest by the next save's call, which
    # waits for it): a restart that starts from scratch would train the same parameters,
    # so the fingerprint alone would not show that resuming broke.
    fail "$name: did not resume from a committed checkpoint: $out"
  else
    from=$(sed -n 's/^\[rank 0\] checkpoint: resumed step \([0-9]*\) from .*/resumed from step \1/p' <<<"$out")
    if [[ $phase == end ]]; then
      echo "PASS: $name: the restart found training done ($((SECONDS - start)) s)"
    else
      echo "PASS: $name: ${from:-started again from scratch}, same parameters ($((SECONDS - start)) s)"
    fi
  fi
done

[[ $failures -eq 0 ]] && echo "all $cases cases as expected (seed $seed)" || { echo "$failures case(s) wrong (seed $seed)"; exit 1; }
