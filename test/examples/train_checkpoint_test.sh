#!/usr/bin/env bash
# examples/train.cpp with --save / --resume: a run stopped after step 3 and resumed to step 6
# trains what an uninterrupted 6-step run trains (bit for bit on the same ranks and strategy,
# within a tolerance on other ranks, strategies and backends), for AdamW, SGD, bf16 and fp16;
# a checkpoint without the train.accumulate key (saved before it existed) resumes as
# --accumulate 1; a missing or damaged checkpoint, another global batch, nothing left to
# train, another optimizer and --save-every without --save are refused before anything trains.
# With --backend tcp: a failed save names rank 0's reason first, and a rank killed mid-run
# (--kill) is survived by restarting the job from its last checkpoint (--max-restarts).
#
# Usage: train_checkpoint_test.sh TRAIN_BINARY
set -u
train="$1"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
tmp=$(mktemp -d "${TEST_TMPDIR:-/tmp}/train_checkpoint.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

# losses OUTPUT: "step loss unsharded_loss" for each step line.
losses() { sed -n 's/^step *\([0-9]*\): loss=\([^ ]*\) unsharded_loss=\([^ ]*\) .*/\1 \2 \3/p' <<<"$1"; }
# steps_from FIRST OUTPUT: the losses of steps >= FIRST.
steps_from() { losses "$2" | awk -v first="$1" '$1 >= first'; }
fingerprint() { sed -n 's/^parameters: xxh64=//p' <<<"$1"; }
# max_diff A B: the largest |loss difference| between two step lists of the same steps.
max_diff() {
  paste -d' ' <(echo "$1") <(echo "$2") |
    awk '$1 != $4 { bad = 1 } { d = $2 - $5; if (d < 0) d = -d; if (d > m) m = d } END { if (bad || NR == 0) print "mismatch"; else printf "%.3g\n", m }'
}
# A smaller model than the default keeps the script fast.
small=(--blocks 3 --hidden 128)
# run VAR NAME ARGS...: VAR = the output of a run that must succeed, without the launcher's
# "[rank 0] " prefixes (--backend tcp).
run() {
  local -n into="$1"
  local name="$2"
  shift 2
  into=$("$train" "${small[@]}" "$@" 2>&1) || fail "$name: exited with $? ($(tail -1 <<<"$into"))"
  into=$(sed 's/^\[rank [0-9]*\] //' <<<"$into")
}

# (1) and (3): stopped and resumed on the same 4 ranks and strategy = uninterrupted, bitwise.
for flags in "" "--optimizer sgd" "--precision bf16" "--precision fp16"; do
  name="4 ranks${flags:+ $flags}"
  dir="$tmp/ckpt${flags// /_}"
  # shellcheck disable=SC2086
  run whole "$name: 6 steps" --steps 6 $flags
  # shellcheck disable=SC2086
  run first "$name: save" --steps 3 --save-every 2 --save "$dir" $flags
  saved=$(grep '^checkpoint: ' <<<"$first" | sed 's/ (.*//')  # without the size and the hidden share
  [[ "$saved" == "checkpoint: saved step 2 to $dir"$'\n'"checkpoint: saved step 3 to $dir" ]] ||
    fail "$name: --save-every 2 --steps 3 printed '$saved'"
  # shellcheck disable=SC2086
  run rest "$name: resume" --steps 6 --resume "$dir" $flags
  grep -qx "checkpoint: resumed step 3 from $dir (4 ranks -> 4 ranks)" <<<"$rest" || fail "$name: no resume line"
  want=$(steps_from 4 "$whole") got=$(losses "$rest")
  if [[ -z "$want" || "$got" != "$want" ]]; then
    fail "$name: steps 4..6 differ: uninterrupted '$want', resumed '$got'"
  elif [[ -z "$(fingerprint "$whole")" || "$(fingerprint "$rest")" != "$(fingerprint "$whole")" ]]; then
    fail "$name: parameters differ: $(fingerprint "$whole") vs $(fingerprint "$rest")"
  elif [[ "$(grep '^fp16:' <<<"$whole")" != "$(grep '^fp16:' <<<"$rest")" ]]; then
    fail "$name: loss scaler lines differ"
  else
    echo "PASS: $name: resumed at step 3, steps 4..6 and parameters $(fingerprint "$rest") bitwise equal"
  fi
  [[ -z "$flags" ]] && adamw_whole=$whole
done

# (2) Resharded: the fp32 AdamW checkpoint of 4 ranks (FULL_SHARD) resumed on other ranks,
# strategies and backends with the same global batch of 32. Reductions run in another
# order, so the losses agree to a tolerance.
tolerance=1e-5
adamw_dir="$tmp/ckpt"
want=$(steps_from 4 "$adamw_whole")
for flags in "--ranks 2 --batch 16 --strategy SHARD_GRAD_OP" "--ranks 8 --batch 4 --strategy HYBRID_SHARD" \
  "--backend tcp --nproc 2 --batch 16 --strategy NO_SHARD"; do
  # shellcheck disable=SC2086
  run rest "$flags" --steps 6 --resume "$adamw_dir" $flags
  ranks=$(sed -n 's/^checkpoint: resumed step 3 from .* (4 ranks -> \([0-9]*\) ranks)$/\1/p' <<<"$rest")
  diff=$(max_diff "$want" "$(losses "$rest")")
  if [[ -z "$ranks" ]]; then
    fail "$flags: no resume line"
  elif [[ "$diff" == mismatch ]] || awk -v d="$diff" -v t="$tolerance" 'BEGIN { exit !(d > t) }'; then
    fail "$flags: steps 4..6 differ from the uninterrupted run by $diff (tolerance $tolerance)"
  else
    echo "PASS: $flags: 4 -> $ranks ranks, steps 4..6 within $diff of the uninterrupted run (tolerance $tolerance)"
  fi
done

# (5) An index edited after the save (here: the train.accumulate key removed, as a
# checkpoint written before that key existed would look) is refused as changed: the index
# carries its own checksum (docs/checkpoints.md, "What the checksums cover").
old_dir="$tmp/edited_index"
cp -r "$adamw_dir" "$old_dir"
sed -i -E 's/"train\.accumulate": *"[0-9]+", *//' "$old_dir/index.json"
if grep -q 'train\.accumulate' "$old_dir/index.json"; then
  fail "could not remove train.accumulate from $old_dir/index.json"
fi

# (4) Refusals: an error naming the problem, a failing exit code, no training step.
bad="$tmp/damaged"
cp -r "$adamw_dir" "$bad"
file="$bad/rank-00001.safetensors"
offset=$(($(stat -c %s "$file") / 2))
byte=$(od -An -tu1 -j "$offset" -N1 "$file" | tr -d ' ')
printf "$(printf '\\%03o' $((byte ^ 1)))" | dd of="$file" bs=1 seek="$offset" conv=notrunc status=none
cmp -s "$file" "$adamw_dir/rank-00001.safetensors" && fail "the byte flip did not change $file"
refuse() {
  local name="$1" expect="$2" out rc
  shift 2
  out=$("$train" "${small[@]}" "$@" 2>&1)
  rc=$?
  if ((rc == 0)); then
    fail "$name: accepted"
  elif grep -q '^step ' <<<"$out"; then
    fail "$name: trained before refusing"
  elif ! grep -qF -- "$expect" <<<"$out"; then
    fail "$name: the error does not say '$expect': $out"
  else
    echo "PASS: $name: refused (exit $rc): $(grep -F -- "$expect" <<<"$out" | head -1 | cut -c1-150)"
  fi
}
refuse "missing directory" "$tmp/none" --steps 6 --resume "$tmp/none"
refuse "flipped byte" "rank-00001.safetensors" --steps 6 --resume "$bad"
refuse "other global batch" "global batch of 32 samples, but this run's is 16" --steps 6 --ranks 2 --resume "$adamw_dir"
refuse "nothing left to train" "saved after step 3; --steps 3 leaves nothing to train" --steps 3 --resume "$adamw_dir"
refuse "other optimizer" "saved with --optimizer adamw" --steps 6 --optimizer sgd --resume "$adamw_dir"
refuse "edited index" "does not match its checksum" --steps 6 --resume "$old_dir"
refuse "other --accumulate" "saved with --accumulate 1, this run uses 2" --steps 6 --accumulate 2 --resume "$adamw_dir"
refuse "other --local-gradients" "saved with --local-gradients mean, this run uses sum" --steps 6 --local-gradients sum --resume "$adamw_dir"
refuse "--save-every without --save" "--save-every requires --save" --steps 6 --save-every 2

# A save that fails on rank 0 only (its parent directory is missing): the reason is shown,
# naming rank 0, whichever rank failed first, on thread ranks (ThreadGroup::run rethrows rank
# 0's own error, not rank 1's echo) and on TCP processes (every rank's error quotes rank 0).
for backend in "--ranks 2" "--backend tcp --nproc 2"; do
  shown=0
  for attempt in 1 2 3; do  # which rank fails first is a race: a few tries
    # shellcheck disable=SC2086
    out=$("$train" "${small[@]}" $backend --steps 1 --save "$tmp/nonexistent/dir/ckpt" 2>&1)
    rc=$?
    if ((rc == 0)); then
      fail "save into a missing directory ($backend): accepted"
      break
    elif ! grep -q "rank 0.*parent directory '$tmp/nonexistent/dir' does not exist" <<<"$out"; then
      fail "save into a missing directory ($backend, attempt $attempt): rank 0's reason is not shown: $out"
      break
    elif [[ $backend == *tcp* ]] && { ((rc != 2)) || ! grep -q "^fsdp_run: rank 0 exited with status 2[;]" <<<"$out"; }; then
      # Rank 1 only echoes rank 0 (exit status 86, fsdp::kEchoExitStatus): fsdp_run names
      # rank 0 first and exits with its status, whichever exited first (rank 1 too, as
      # "an echo of that failure", when it exited before fsdp_run stopped it).
      fail "save into a missing directory ($backend, attempt $attempt): exit $rc, the launcher does not name rank 0 first: $out"
      break
    fi
    shown=$((shown + 1))
  done
  ((shown == 3)) && echo "PASS: save into a missing directory ($backend): $(grep -m1 "does not exist" <<<"$out" | cut -c1-200)"
done

# A lost rank survived by restarting the job (fsdp_run --max-restarts, through train's own
# launcher): --kill 1@5 SIGKILLs rank 1 as step 5 begins (first start only); the restarted
# job resumes from the last checkpoint --save committed (step 2 or 4) and trains the same
# model, bit for bit, as the run that never failed. Killed before the first save, the
# restart starts from scratch, the same way.
tcp=(--backend tcp --nproc 2 --steps 6)
run whole "tcp: 6 steps" "${tcp[@]}"
for kill in 1@5 0@1; do
  name="--kill $kill --max-restarts 2"
  dir="$tmp/restart_${kill/@/_}"
  run restarted "$name" "${tcp[@]}" --save "$dir" --save-every 2 --max-restarts 2 --kill "$kill"
  if ! grep -q "^fsdp_run: rank ${kill%@*} exited with status 137 (signal SIGKILL)" <<<"$restarted"; then
    fail "$name: the kill is not reported: $restarted"
  elif ! grep -qx "fsdp_run: restarting every rank (restart 1 of 2)" <<<"$restarted"; then
    fail "$name: no restart: $restarted"
  elif [[ $kill == 1@5 ]] && ! grep -q "^checkpoint: resumed step [24] from $dir" <<<"$restarted"; then
    fail "$name: the restart did not resume from $dir: $restarted"
  elif [[ $kill == 0@1 ]] && grep -q "resum" <<<"$restarted"; then
    fail "$name: resumed from a checkpoint that was never saved: $restarted"
  elif [[ -z "$(fingerprint "$whole")" || "$(fingerprint "$restarted")" != "$(fingerprint "$whole")" ]]; then
    fail "$name: parameters differ from the run that never failed: $(fingerprint "$whole") vs $(fingerprint "$restarted")"
  elif [[ "$(steps_from 5 "$restarted" | tail -2)" != "$(steps_from 5 "$whole")" ]]; then
    fail "$name: the losses of steps 5..6 differ"
  else
    echo "PASS: $name: restarted, parameters xxh64=$(fingerprint "$restarted") as without the kill"
  fi
done
# A --save directory holding an earlier run's checkpoint: never resumed by a restart (the
# job's id differs), which starts from scratch; a failure after the final save: the restart
# finds the job's final checkpoint and ends at once, successfully.
dir="$tmp/restart_reused"
run earlier "restart: an earlier run" "${tcp[@]}" --save "$dir"
run restarted "restart over an earlier run's checkpoint" "${tcp[@]}" --save "$dir" --save-every 2 --max-restarts 1 --kill 0@1
if ! grep -qx "restart 1: no checkpoint of this job in $dir; starting from scratch" <<<"$restarted"; then
  fail "restart over an earlier run's checkpoint: did not start from scratch: $restarted"
elif [[ "$(fingerprint "$restarted")" != "$(fingerprint "$whole")" ]]; then
  fail "restart over an earlier run's checkpoint: parameters differ: $(fingerprint "$restarted") vs $(fingerprint "$whole")"
else
  echo "PASS: restart over an earlier run's checkpoint: started from scratch, same parameters"
fi
run restarted "a failure after the final save" "${tcp[@]}" --save "$tmp/restart_end" --max-restarts 1 --kill 1@end
if ! grep -qx "restart 1: the last checkpoint in $tmp/restart_end is after step 6, the last: the job had finished training before it failed" <<<"$restarted"; then
  fail "a failure after the final save: the restart did not see training was done: $restarted"
elif grep -q "^step " <<<"$(sed -n '/restarting every rank/,$p' <<<"$restarted")"; then
  fail "a failure after the final save: the restart trained again: $restarted"
else
  echo "PASS: a failure after the final save: the restart ends at once"
fi
# An existing, empty --save directory (the first save works into it): a job killed before
# its first save restarts from scratch. Two jobs that share a run id (TORCHELASTIC_RUN_ID set
# by hand, the same for both): the second's restart checks the first's checkpoint as
# --resume does and refuses it (another optimizer) instead of resuming or ending it.
mkdir -p "$tmp/restart_empty"
run restarted "restart with an empty --save directory" "${tcp[@]}" --save "$tmp/restart_empty" --save-every 2 --max-restarts 1 --kill 1@1
grep -qx "restart 1: no checkpoint of this job in $tmp/restart_empty; starting from scratch" <<<"$restarted" &&
  [[ "$(fingerprint "$restarted")" == "$(fingerprint "$whole")" ]] &&
  echo "PASS: restart with an empty --save directory: from scratch, same parameters" ||
  fail "restart with an empty --save directory: $restarted"
out=$(TORCHELASTIC_RUN_ID=shared "$train" "${small[@]}" "${tcp[@]}" --save "$tmp/restart_shared" 2>&1) ||
  fail "a job with a shared run id: the first job failed: $out"
out=$(TORCHELASTIC_RUN_ID=shared "$train" "${small[@]}" "${tcp[@]}" --save "$tmp/restart_shared" --optimizer sgd \
  --max-restarts 1 --kill 1@1 2>&1)
rc=$?
if ((rc == 0)) || ! grep -q "saved with --optimizer adamw, this run uses sgd" <<<"$out"; then
  fail "another job's checkpoint under a shared run id: exit $rc: $out"
else
  echo "PASS: another job's checkpoint under a shared run id: refused as --resume refuses it (exit $rc)"
fi
# No restarts: the job ends with the killed rank's status, naming it.
out=$("$train" "${small[@]}" "${tcp[@]}" --kill 1@3 2>&1)
rc=$?
if ((rc != 137)) || ! grep -q "^fsdp_run: rank 1 exited with status 137 (signal SIGKILL)" <<<"$out"; then
  fail "--kill 1@3 without restarts: exit $rc: $out"
else
  echo "PASS: --kill 1@3 without restarts: exit 137, rank 1 named"
fi
refuse "--kill on thread ranks" "--kill needs --backend tcp" --steps 2 --kill 1@1
refuse "--max-restarts on thread ranks" "--max-restarts needs --backend tcp" --steps 2 --max-restarts 1
refuse "--kill of a rank that does not exist" "there is no rank 2 among --nproc 2" "${tcp[@]}" --kill 2@1
refuse "--kill of a step that does not exist" "there is no step 7 in --steps 6" "${tcp[@]}" --kill 1@7
refuse "--kill without @" "'3' is not RANK@STEP" "${tcp[@]}" --kill 3

[[ $failures -eq 0 ]] && echo "all cases as expected" || { echo "$failures case(s) wrong"; exit 1; }
