#!/usr/bin/env bash
# examples/torch_train.cpp, the libtorch adapter's example, as a user runs it: it exists so
# that the example's command line and its promise (a torch::nn model trained sharded on
# thread ranks ends where the same model trained unsharded does) are checked on every run,
# not only its compile. --help prints a usage and exits 0; the default run exits 0 and ends
# with a `final:` line whose sharded loss equals its unsharded loss to float rounding; so
# does a run with each --strategy it lists, with --offload, SGD with --accumulate, 3 ranks
# and HYBRID_SHARD on 4 (parameters within 1e-5 too); MixedPrecision<bf16, float> stays
# within 1% of float libtorch's loss; a bad --strategy is refused naming it, and --device
# cuda in a build without CUDA (this one: tools/gpu_proof.sh runs it on a GPU).
#
# Usage: torch_train_test.sh TORCH_TRAIN_BINARY   (//test/torch:torch_train_test)
set -u
train="$1"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# field NAME OUTPUT: the value of NAME=... in the final line.
field() { grep '^final: ' <<<"$2" | tail -n 1 | tr ' ' '\n' | sed -n "s/^$1=//p"; }

# check_final WHAT OUTPUT: a `final:` line whose sharded and unsharded losses agree to float
# rounding (2e-6: the sum over ranks runs in another order than over one batch, so the
# sixth decimal may differ).
check_final() {
  local what=$1 out=$2 final l u
  final=$(grep '^final: ' <<<"$out" | tail -n 1)
  if [[ -z $final ]]; then
    fail "$what: no line starting 'final:'; the output ends: $(tail -n 5 <<<"$out")"
    return
  fi
  l=$(field loss "$out") u=$(field unsharded_loss "$out")
  if [[ -n $l && -n $u ]] && awk -v l="$l" -v u="$u" 'BEGIN { d = l - u; if (d < 0) d = -d; exit !(d <= 2e-6) }'; then
    echo "PASS: $what: $final"
  else
    fail "$what: sharded loss '$l', unsharded loss '$u': $final"
  fi
}

out=$("$train" --help 2>&1)
rc=$?
if ((rc == 0)) && [[ -n $out ]]; then echo "PASS: --help prints a usage and exits 0"; else
  fail "--help exited with $rc: $(tail -n 5 <<<"$out")"; fi

out=$("$train" 2>&1)
rc=$?
if ((rc == 0)); then check_final "the default run" "$out"; else
  fail "the default run exited with $rc; its output ends: $(tail -n 5 <<<"$out")"; fi

# Every sharding strategy --help lists, each ending where unsharded training does.
help=$("$train" --help 2>&1)
for s in FULL_SHARD SHARD_GRAD_OP NO_SHARD HYBRID_SHARD HYBRID_SHARD_ZERO2; do
  if ! grep -q -- "$s" <<<"$help"; then
    fail "--help does not list strategy $s"
    continue
  fi
  out=$("$train" --strategy "$s" 2>&1)
  rc=$?
  if ((rc == 0)); then check_final "--strategy $s" "$out"; else
    fail "--strategy $s exited with $rc; its output ends: $(tail -n 5 <<<"$out")"; fi
done

# The other flags in full precision: losses equal to the printed digits, parameters within
# float rounding of unsharded libtorch's.
for flags in "--offload" "--optimizer sgd --accumulate 3" "--ranks 3 --steps 4" \
  "--strategy HYBRID_SHARD --ranks 4 --accumulate 2"; do
  out=$("$train" $flags 2>&1)
  rc=$?
  if ((rc != 0)); then
    fail "$flags exited with $rc; its output ends: $(tail -n 5 <<<"$out")"
    continue
  fi
  check_final "$flags" "$out"
  d=$(field max_param_diff "$out")
  if [[ -z $d ]] || ! awk -v d="$d" 'BEGIN { exit !(d < 1e-5) }'; then
    fail "$flags: max_param_diff '$d' is not below 1e-5"
  fi
done

# MixedPrecision<bf16, float> (and with offload): the loss within 1% of float libtorch's,
# the parameters within bf16's rounding of it, and not equal to it (bf16 was used).
for flags in "--precision bf16" "--precision bf16 --offload"; do
  out=$("$train" $flags 2>&1)
  rc=$?
  if ((rc != 0)); then
    fail "$flags exited with $rc; its output ends: $(tail -n 5 <<<"$out")"
    continue
  fi
  l=$(field loss "$out") u=$(field unsharded_loss "$out") d=$(field max_param_diff "$out")
  if awk -v l="$l" -v u="$u" -v d="$d" 'BEGIN { r = (l - u) / u; if (r < 0) r = -r; exit !(r < 0.01 && d > 1e-6 && d < 0.05) }'; then
    echo "PASS: $flags: loss $l, unsharded $u, max_param_diff $d"
  else
    fail "$flags: loss $l against $u, max_param_diff $d (want within 1%, 1e-6 < diff < 0.05)"
  fi
done

# A bad flag is refused, naming it.
out=$("$train" --strategy bogus 2>&1)
rc=$?
if ((rc != 0)) && grep -q "unknown sharding strategy 'bogus'" <<<"$out"; then
  echo "PASS: --strategy bogus is refused naming it"
else
  fail "--strategy bogus: exit $rc, output: $(tail -n 3 <<<"$out")"
fi

# --device cuda in a build without CUDA (Debian's libtorch is CPU-only): refused at once,
# saying how to build it; tools/gpu_proof.sh runs it on a GPU.
out=$("$train" --device cuda 2>&1)
rc=$?
if ((rc == 2)) && grep -q -- "--device cuda: this build has no CUDA" <<<"$out"; then
  echo "PASS: --device cuda without a CUDA build is refused, saying how to build one"
else
  fail "--device cuda: exit $rc, output: $(tail -n 3 <<<"$out")"
fi

[[ $failures -eq 0 ]] && echo "all cases as expected" || { echo "$failures case(s) wrong"; exit 1; }
