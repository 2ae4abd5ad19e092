#!/usr/bin/env bash
# examples/train recovers a lost rank in memory (issue 37, item 2): each case kills one rank
# (SIGKILL) at a seeded random step and phase (--kill RANK@STEP:PHASE: as the step begins,
# mid backward once a unit's gradient is final, or before the optimizer); the launcher
# starts a replacement for that rank only (--restart-scope rank); the other ranks keep
# running, rejoin it, and every rank restores the last step of the peer checkpoint
# (--peer-checkpoint: each rank's state in its own memory and its neighbour's; under
# HybridShard, its replica's; with the fp16 loss scaler's state) and redoes the steps since. The parameters must equal, bit
# for bit, those of the same job without a failure, no rank but the killed one may start
# twice, and the job says what it recovered and from where. FullShard on 2 and 4
# processes, ShardGradOp on 3 and HybridShard on 4 (mesh 2x2: ranks r and r + 2 are
# replicas), then fp16 on 4 with a loss scale that changes every step; then two ranks lost, the second during the recovery from the first. Every run
# is bounded (timeout 120 s).
#
# Usage: train_recover_test.sh TRAIN_BINARY [SEED] [CASES]
set -u
# A rank that stalls fails within this (its error says what it waited for), inside the 120 s bound.
export FSDP_TIMEOUT_MS=30000
train="$1"
seed=${2:-20261202}
cases=${3:-20}
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
RANDOM=$seed

fingerprint() { sed -n 's/^\[rank 0\] parameters: xxh64=//p' <<<"$1"; }
steps=6
small=(--blocks 3 --hidden 128 --backend tcp --steps "$steps")
declare -A job=([full2]="--nproc 2 --strategy FULL_SHARD" [full4]="--nproc 4 --strategy FULL_SHARD"
                [grad3]="--nproc 3 --strategy SHARD_GRAD_OP" [hyb4]="--nproc 4 --strategy HYBRID_SHARD --mesh 2x2")
declare -A nproc=([full2]=2 [full4]=4 [grad3]=3 [hyb4]=4) whole=()
kinds=(full2 full4 grad3 hyb4)
# fp16 whose loss scale doubles every step until a step overflows and is skipped: the
# scaler's state changes every step, and the copies carry it (PeerCheckpoint's metadata).
job[fp16]="--nproc 4 --strategy FULL_SHARD --precision fp16 --scaler-growth-interval 1"
nproc[fp16]=4
# Where rank R's state comes from: its replica R + 2 under the 2x2 mesh, else rank R + 1's copy.
source_of() {
  local kind=$1 r=$2
  if [[ $kind == hyb4 ]]; then echo "rank $r from its replica rank $(((r + 2) % 4))"; else echo "rank $r from rank $(((r + 1) % nproc[$kind]))'s copy"; fi
}
declare -A skipped=()
for kind in "${kinds[@]}" fp16; do
  # shellcheck disable=SC2086
  out=$(timeout 120 "$train" "${small[@]}" ${job[$kind]} 2>&1) || { fail "$kind: the run without a failure failed: $out"; continue; }
  whole[$kind]=$(fingerprint "$out")
  [[ -n ${whole[$kind]} ]] || fail "$kind: no parameters line: $out"
  skipped[$kind]=$(sed -n 's/^\[rank 0\] fp16: the loss scaler skipped \([0-9]*\) of.*/\1/p' <<<"$out")
done
[[ ${skipped[fp16]:-0} -gt 0 ]] || fail "fp16: the loss scaler skipped no step, so the test shows nothing: $out"

# What the copies cannot restore is refused before anything starts (exit 2, saying why).
refused() {
  local want=$1
  shift
  out=$(timeout 60 "$train" "${small[@]}" --max-restarts 1 --restart-scope rank "$@" 2>&1)
  rc=$?
  if ((rc != 2)) || ! grep -qF -- "$want" <<<"$out"; then fail "refusal of $*: exit $rc: $out"; else echo "PASS: refused $*"; fi
}
refused "--restart-scope rank needs --peer-checkpoint (the copies every rank restores from)"
refused "--restart-scope rank needs --nproc 2 or more" --peer-checkpoint --nproc 1
refused "--kill 2@3:recovery: needs another rank killed in step 3 (begin, backward or optimizer)" --peer-checkpoint --nproc 4 --kill 2@3:recovery
# A rank killed while its checkpoint is written dies after the step's refresh: the others fail in the next step.
refused "--kill 2@2:rejoin: needs another rank killed in step 2 (begin, backward or optimizer)" --peer-checkpoint --nproc 4 \
  --save "${TEST_TMPDIR:-/tmp}/recover_refusal" --save-every 2 --kill 1@2:save --kill 2@2:rejoin
refused "--kill 1@4:recovery: needs another rank killed in step 4" --peer-checkpoint --nproc 4 --kill 0@3 --kill 1@4:recovery
refused "--kill 1@3:begin: rank 1 is killed more than once; a rank dies once" --peer-checkpoint --nproc 4 --kill 1@3 --kill 1@4

phases=(begin backward optimizer)
for ((i = 1; i <= cases + 2; i++)); do
  kind=${kinds[$(((i - 1) % ${#kinds[@]}))]}
  phase=${phases[$(((i - 1) / ${#kinds[@]} % ${#phases[@]}))]}  # every phase under every job; rank and step drawn
  # Then fp16 twice (not at the optimizer: a skipped step has no optimizer phase to die in).
  ((i > cases)) && kind=fp16 phase=${phases[$((i - cases - 1))]}
  rank=$((RANDOM % nproc[$kind]))
  step=$((RANDOM % steps + 1))
  kill="$rank@$step:$phase"
  name="case $i ($kind, --kill $kill)"
  start=$SECONDS
  # shellcheck disable=SC2086
  out=$(timeout 120 "$train" "${small[@]}" ${job[$kind]} --peer-checkpoint --max-restarts 1 --restart-scope rank \
    --kill "$kill" 2>&1)
  rc=$?
  if ((rc != 0)); then
    fail "$name: exited $rc: $(tail -8 <<<"$out")"
  elif ! grep -q "^fsdp_run: rank $rank exited with status 137 (signal SIGKILL); starting a replacement for rank $rank" <<<"$out"; then
    fail "$name: the kill and the replacement are not reported: $out"
  elif grep -q "restarting every rank" <<<"$out"; then
    fail "$name: the job restarted every rank: $out"
  elif [[ "$(fingerprint "$out")" != "${whole[$kind]}" ]]; then
    fail "$name: parameters $(fingerprint "$out"), without the failure ${whole[$kind]}"
  elif ! grep -q "^\[rank 0\] recovery: every rank restored step [0-9]* from the peer checkpoint ($(source_of "$kind" "$rank"))$" <<<"$out"; then
    fail "$name: no restore from the peer checkpoint: $out"
  elif ! grep -q "^\[rank 0\] recovered: failures=1 restarts=1 redone_steps=[0-9]* recovery_ms_max=[0-9]*$" <<<"$out"; then
    fail "$name: no recovered line: $out"
  elif [[ $kind == fp16 ]] && ! grep -q "^\[rank 0\] fp16: the loss scaler skipped ${skipped[fp16]} of $steps steps$" <<<"$out"; then
    fail "$name: the loss scaler did not skip the ${skipped[fp16]} steps it skips without the failure: $out"
  else
    survivors=$(grep -c "lost a peer at step" <<<"$out")
    if ((survivors != nproc[$kind] - 1)); then
      fail "$name: $survivors ranks say they rejoined, not $((nproc[$kind] - 1)): $out"
    else
      echo "PASS: $name: $(sed -n 's/^\[rank 0\] \(recovered: .*\)/\1/p' <<<"$out"), same parameters ($((SECONDS - start)) s)"
    fi
  fi
done

# A second failure during the recovery from the first (--kill R@S:recovery: a survivor dies
# after every rank agreed what to restore, before the copies move), on 4 processes. When
# the two ranks' states each have a copy left (FullShard: they are not neighbours;
# HybridShard: they are not replicas) the job recovers twice over, to the same parameters.
# When the second held the first's state, no step can be restored: every rank says so and
# exits 87, and fsdp_run starts the whole job again (restart 3 of 3), which resumes from
# the last checkpoint --save wrote (full4 neighbours, --save-every 2), or from scratch
# without one (hyb4 replicas), and trains the same parameters. With no restart left
# (exhausted: --max-restarts 2) the job ends with status 87.
# forming: the second rank dies 300 ms after the first failure, before it rejoins
# (--kill B@S:rejoin): the others' new ring cannot form, they leave it when the launcher
# announces the next epoch, and join that one with both replacements.
save_dir="${TEST_TMPDIR:-/tmp}/recover_fallback.$$"
for twice in full4:apart full4:neighbours full4:forming hyb4:neighbours hyb4:replicas full4:exhausted; do
  kind=${twice%%:*} twice=${twice#*:}
  first=$((RANDOM % 4))
  apart=2
  [[ $twice == neighbours || $twice == exhausted ]] && apart=1
  restarts=3 save=()
  [[ $twice == exhausted ]] && restarts=2
  rm -rf "$save_dir"
  [[ $kind:$twice == full4:neighbours ]] && save=(--save "$save_dir" --save-every 2)
  second=$(((first + apart) % 4))
  low=$((first < second ? first : second)) high=$((first < second ? second : first))
  when=recovery
  [[ $twice == forming ]] && when=rejoin
  step=$((RANDOM % steps + 1))
  phase=${phases[$((RANDOM % ${#phases[@]}))]}
  name="second failure, $twice ($kind, --kill $first@$step:$phase --kill $second@$step:$when)"
  start=$SECONDS
  # shellcheck disable=SC2086
  out=$(timeout 120 "$train" "${small[@]}" ${job[$kind]} --peer-checkpoint --max-restarts $restarts --restart-scope rank \
    "${save[@]}" --kill "$first@$step:$phase" --kill "$second@$step:$when" 2>&1)
  rc=$?
  while_recovering=$(grep -c "lost a peer while recovering; rejoining" <<<"$out")
  if [[ $kind == full4 && $apart == 1 ]]; then
    why="rank $first was lost and so was rank $second, which held its copy"
  elif [[ $twice == replicas ]]; then
    why="rank $low was lost and so was its replica, rank $high, which held the same state"
  else
    why=""
  fi
  if [[ -n $why ]] && ! grep -q "in-memory recovery is not possible: $why. Exiting 87" <<<"$out"; then
    fail "$name: no rank says why it cannot recover: $out"
  elif [[ -n $why ]] && ! grep -q "^fsdp_run: rank [0-9] exited with status 87 (a replacement cannot mend it)" <<<"$out"; then
    fail "$name: fsdp_run does not stop the job: $out"
  elif [[ -n $why && $twice != exhausted ]]; then
    if [[ ${#save[@]} -gt 0 ]]; then
      from="resuming from the last checkpoint in $save_dir\|no checkpoint of this job in $save_dir; starting from scratch"
    else
      from="no checkpoint of this job in (no --save); starting from scratch"
    fi
    if ((rc != 0)); then
      fail "$name: exited $rc after falling back to a restart of every rank: $(tail -8 <<<"$out")"
    elif ! grep -q "^fsdp_run: in-memory recovery is not possible; restarting every rank (restart 3 of 3)$" <<<"$out"; then
      fail "$name: fsdp_run does not start every rank again: $out"
    elif ! grep -q "^\[rank 0\] restart 3: \($from\)" <<<"$out"; then
      fail "$name: the restart does not say where it resumed from: $out"
    elif [[ "$(fingerprint "$out")" != "${whole[$kind]}" ]]; then
      fail "$name: parameters $(fingerprint "$out") after the restart, without the failures ${whole[$kind]}"
    else
      echo "PASS: $name: $why; every rank restarted ($(sed -n 's/^\[rank 0\] restart 3: //p' <<<"$out" | head -1)), same parameters ($((SECONDS - start)) s)"
    fi
  elif [[ -z $why ]]; then
    if ((rc != 0)); then
      fail "$name: exited $rc: $(tail -8 <<<"$out")"
    elif ! grep -q "^fsdp_run: rank $second exited with status 137 (signal SIGKILL); starting a replacement for rank $second (restart 2 of 3)" <<<"$out"; then
      fail "$name: the second kill and its replacement are not reported: $out"
    elif [[ $twice != forming ]] && ((while_recovering != 3)); then  # (forming: the ring left fails no collective)
      fail "$name: $while_recovering ranks say they lost a peer while recovering, not 3: $out"
    elif ! grep -q "^\[rank 0\] recovery: every rank restored step [0-9]* from the peer checkpoint ($(source_of "$kind" "$low"); $(source_of "$kind" "$high"))$" <<<"$out"; then
      fail "$name: no restore of both ranks: $out"
    elif ! grep -q "^\[rank 0\] recovered: failures=2 restarts=2 redone_steps=1 recovery_ms_max=[0-9]*$" <<<"$out"; then
      fail "$name: no recovered line with two failures: $out"
    elif [[ "$(fingerprint "$out")" != "${whole[$kind]}" ]]; then
      fail "$name: parameters $(fingerprint "$out"), without the failures ${whole[$kind]}"
    else
      echo "PASS: $name: $(sed -n 's/^\[rank 0\] \(recovered: .*\)/\1/p' <<<"$out"), same parameters ($((SECONDS - start)) s)"
    fi
  else
    if ((rc != 87)); then
      fail "$name: exited $rc, not 87 (no recovery possible, no restart left): $(tail -8 <<<"$out")"
    elif ! grep -q "^fsdp_run: no restart left (--max-restarts 2); the job failed with status 87$" <<<"$out"; then
      fail "$name: fsdp_run does not end the job for want of restarts: $out"
    elif grep -q "restart 3 of" <<<"$out"; then
      fail "$name: a third start: $out"
    else
      echo "PASS: $name: exit 87, $why, no restart left ($((SECONDS - start)) s)"
    fi
  fi
done
rm -rf "$save_dir"

[[ $failures -eq 0 ]] && echo "all $((cases + 2)) random cases and the two-failure cases as expected (seed $seed)" || { echo "$failures case(s) wrong (seed $seed)"; exit 1; }
