#!/usr/bin/env bash
# Runs fsdp::NcclComm's multi-rank cases on the emulated CUDA runtime and NCCL
# (tools/cuda_emulator): every rank a process with its own emulated GPU, meeting through a
# TcpStore on loopback, with 2 ranks and then 4. They test the library's host code
# (bootstrap, split, collective tags, the watchdog, stream order, sharded training against
# the host reference bit for bit, eager and captured into a CUDA graph), not NCCL or a GPU:
# tools/gpu_proof.sh does that.
#
#   tools/nccl_emulated.sh [BAZEL_BUILD_FLAG...]
#
# Flags go to its `bazel build` (.ci/run passes its plain stage's, so that the binaries that
# stage built are used as they are, not compiled again).
#
# Each case runs on its own (doctest --test-case), so a case that reports itself skipped
# (its GPUs not visible) is counted as skipped; there must be none. Last line:
#   nccl emulated: ranks=2,4 passed=N failed=F skipped=S
# Exit status: non-zero unless every case passed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

tools/setup.sh || exit 1
bazel build "$@" //test/nccl:nccl_comm_emulated_test //test/nccl:nccl_streams_emulated_test || {
  echo "nccl emulated: ranks=2,4 passed=0 failed=1 skipped=0 (the tests did not build)"
  exit 1
}
bin=$(bazel info "$@" bazel-bin 2>/dev/null)/test/nccl

passed=0 failed=0 skipped=0
# run <ranks> <binary> <case name pattern>
run() {
  local ranks=$1 binary=$2 pattern=$3 out summary
  out=$(FSDP_CUDA_EMULATOR_DEVICES=$ranks FSDP_NCCL_TEST_WORLDS=$ranks timeout 300 \
        "$bin/$binary" --test-case="$pattern" --no-version 2>&1)
  summary=$(grep -E '^\[doctest\] test cases:' <<<"$out" | tail -n 1)
  if [[ $summary =~ \|\ +1\ passed ]]; then
    passed=$((passed + 1))
    echo "PASSED  ranks=$ranks $pattern"
  elif [[ $summary =~ \|\ +0\ passed\ \|\ +0\ failed ]]; then
    skipped=$((skipped + 1))
    echo "SKIPPED ranks=$ranks $pattern"
  else
    failed=$((failed + 1))
    echo "FAILED  ranks=$ranks $pattern"
    echo "$out" | tail -n 60
  fi
}

for ranks in 2 4; do
  run "$ranks" nccl_comm_emulated_test "processes through a TcpStore*"
  run "$ranks" nccl_streams_emulated_test "processes: every combination*"
  run "$ranks" nccl_streams_emulated_test "processes: a step captured into a CUDA graph*"
done
# Two ranks only: two communicators driven by one process, and a peer that holds its stream.
run 2 nccl_comm_emulated_test "several ranks in one process*"
run 2 nccl_streams_emulated_test "a collective that cannot complete*"
# One rank, whose failure paths run in child processes: the watchdog, and every collective
# and dtype against the host.
run 1 nccl_comm_emulated_test "the watchdog turns a collective*"
run 1 nccl_comm_emulated_test "one rank: every collective*"
run 1 nccl_streams_emulated_test "a step captured into a CUDA graph and replayed*"
run 1 nccl_streams_emulated_test "a step that cannot be captured*"

echo "nccl emulated: ranks=2,4 passed=$passed failed=$failed skipped=$skipped"
((failed == 0 && skipped == 0))
