#!/usr/bin/env bash
# //examples:cuda_train as a process. Without a GPU: it must report "skipped" (exit 77),
# never train or pass, and FSDP_REQUIRE_GPU=1 must turn that into a failure (of the binary,
# and of this test when it runs with FSDP_REQUIRE_GPU=1); its training cases then count as
# skipped. With a GPU: every mode tools/gpu_proof.sh runs must train the small default
# model and match the host reference ("parity: ok").
# Ends with a line in doctest's summary format, so tools/test_summary.py counts the
# skipped cases as skipped (not passed).
set -u
bin=$1
passed=0 failed=0 skipped=0
fail() { echo "FAILED: $*"; failed=$((failed + 1)); }

modes=("" "--precision f32" "--offload" "--precision f32 --offload" "--no-fsdp" "--precision f32 --no-fsdp"
       "--cuda-graph" "--precision f32 --cuda-graph")
out=$(env -u FSDP_REQUIRE_GPU "$bin" 2>&1); rc=$?
echo "$out"
if [ "$rc" -eq 77 ]; then
  if grep -q '^cuda_train: skipped: no CUDA GPU visible' <<<"$out" && ! grep -q '^summary:' <<<"$out"; then
    passed=$((passed + 1))
  else
    fail "exit 77 without the skipped message, or with a summary"
  fi
  out=$(FSDP_REQUIRE_GPU=1 "$bin" 2>&1); rc=$?
  echo "$out"
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && grep -q 'FSDP_REQUIRE_GPU=1 but no CUDA GPU' <<<"$out"; then
    passed=$((passed + 1))
  else
    fail "FSDP_REQUIRE_GPU=1 without a GPU exited $rc (must fail, not skip or pass)"
  fi
  skipped=${#modes[@]}
  echo "no GPU: the ${#modes[@]} training modes are skipped"
  # A lane that requires a GPU (--test_env=FSDP_REQUIRE_GPU=1) must not pass without one.
  [ "${FSDP_REQUIRE_GPU:-}" = 1 ] && fail "FSDP_REQUIRE_GPU=1 but no CUDA GPU is visible"
else
  for m in "${modes[@]}"; do
    # shellcheck disable=SC2086  # the mode is a list of flags
    out=$("$bin" $m 2>&1); rc=$?
    echo "== cuda_train $m (rc=$rc)"; echo "$out"
    if [ "$rc" -eq 0 ] && grep -q '^parity: ok' <<<"$out" && grep -q '^summary: .*parity=ok' <<<"$out"; then
      passed=$((passed + 1))
    else
      fail "cuda_train $m"
    fi
  done
fi
# Unknown flags are refused before anything runs, GPU or not.
if "$bin" --no-such-flag >/dev/null 2>&1; then fail "an unknown flag was accepted"; else passed=$((passed + 1)); fi
# A CUDA graph of a step that cannot be captured is refused before anything runs, naming why.
refused() {  # refused <message> <flags...>
  local want=$1 out rc
  shift
  out=$("$bin" "$@" 2>&1); rc=$?
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 77 ] && grep -qF -- "$want" <<<"$out"; then passed=$((passed + 1)); else fail "cuda_train $* (rc=$rc): $out"; fi
}
refused "--cuda-graph captures fsdp's step (fsdp::CapturedStep); it needs fsdp" --cuda-graph --no-fsdp
refused "--cuda-graph with --offload: an offloaded step waits for the GPU on the host" --cuda-graph --offload
refused "--cuda-graph needs --warmup 2 or more" --cuda-graph --warmup 1
echo "[doctest] test cases: $((passed + failed + skipped)) | $passed passed | $failed failed | $skipped skipped"
[ "$failed" -eq 0 ]
