#!/usr/bin/env bash
# examples/train.cpp, as the README's Quick start runs it: the default run ends with exactly
# the `final:` line the README shows; --precision and --offload run every precision with
# and without offload, and offload moves the shards and optimizer state out of device space;
# bad flags are refused.
#
# Usage: train_test.sh TRAIN_BINARY README
set -u
train="$1" readme="$2"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# The README's line, and the default run's.
expected=$(grep -m1 '^final: ' "$readme")
[[ -n "$expected" ]] || fail "no 'final:' line in $readme"
out=$("$train" 2>&1) || fail "default run exited with $?"
actual=$(grep '^final: ' <<<"$out")
[[ "$actual" == "$expected" ]] && echo "PASS: default run ends with the README's line" ||
  fail "default run: '$actual', README: '$expected'"

# field NAME OUTPUT: the value of NAME=... in the final line.
field() { grep '^final: ' <<<"$2" | tr ' ' '\n' | sed -n "s/^$1=//p"; }

for precision in fp32 bf16 fp16; do
  plain=$("$train" --steps 3 --precision "$precision" 2>&1) || fail "$precision: exited with $?"
  moved=$("$train" --steps 3 --precision "$precision" --offload 2>&1) || fail "$precision --offload: exited with $?"
  p=$(field peak_bytes_per_rank "$plain") q=$(field peak_bytes_per_rank "$moved")
  l=$(field loss "$plain") m=$(field loss "$moved")
  host=$(sed -n 's/^host space: peak \([0-9]*\) B.*/\1/p' <<<"$moved")
  if [[ -z "$p" || -z "$q" || -z "$host" ]]; then
    fail "$precision: missing figures (peak '$p', offload peak '$q', host peak '$host')"
  elif ((q >= p)); then
    fail "$precision: offload did not lower the device-space peak ($q >= $p)"
  elif [[ "$l" != "$m" ]]; then
    fail "$precision: offload changed the loss ($l vs $m)"
  else
    echo "PASS: $precision: device-space peak $p -> $q B with offload, host space $host B, same loss $l"
  fi
  if [[ $precision == fp16 ]] && ! grep -q '^fp16: the loss scaler skipped' <<<"$plain"; then
    fail "fp16: no loss scaler line"
  fi
done

for bad in "--precision fp8" "--strategy sharded_everything" "--mesh 3x3"; do
  # shellcheck disable=SC2086
  if "$train" $bad >/dev/null 2>&1; then fail "'$bad' was accepted"; else echo "PASS: '$bad' is refused"; fi
done

[[ $failures -eq 0 ]] && echo "all cases as expected" || { echo "$failures case(s) wrong"; exit 1; }
