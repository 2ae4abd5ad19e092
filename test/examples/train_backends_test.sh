#!/usr/bin/env bash
# examples/train.cpp on every backend: the same training as N TCP processes (started by
# the example itself through fsdp_run's launcher) or N MPI processes (under mpirun) as on
# N thread ranks. The `parameters: xxh64=` line fingerprints every trained parameter's
# bits, so equal fingerprints mean bitwise-equal training.
#  - 2 ranks: every backend sums a + b, so training is bitwise equal (fingerprint and
#    final line) for FullShard and for bf16.
#  - 4 ranks: TCP's ring reduces chunk c in the order c+1, c+2, ..., c and MPI in its own,
#    ThreadComm in rank order, so the sums may differ in the last bit: every step's loss
#    must agree to the 6 printed decimals, and the per-rank peak exactly.
# Usage: train_backends_test.sh TRAIN_BINARY
set -u
train="$1"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
pass() { echo "PASS: $*"; }

# mpirun as root, shared memory and loopback only, and a private session directory (Bazel
# runs tests in parallel in PID namespaces, where equal PIDs would share OpenMPI's segments).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_plm=isolated
export OMPI_MCA_btl=self,vader OMPI_MCA_btl_vader_single_copy_mechanism=none OMPI_MCA_oob_tcp_if_include=lo
export TMPDIR="${TEST_TMPDIR:-$(mktemp -d)}" OMPI_MCA_btl_vader_backing_directory="${TEST_TMPDIR:-/tmp}"
export FSDP_TIMEOUT_MS=60000  # a hang fails in a minute, not five

# run BACKEND N ARGS...: the run's output with fsdp_run's "[rank 0] " prefix removed.
run() {
  local backend=$1 n=$2
  shift 2
  case $backend in
    thread) timeout 300 "$train" --ranks "$n" "$@" ;;
    tcp) timeout 300 "$train" --backend tcp --nproc "$n" "$@" ;;
    mpi) timeout 300 mpirun -np "$n" --oversubscribe "$train" --backend mpi "$@" ;;
  esac 2>&1 | sed 's/^\[rank 0\] //'
  return "${PIPESTATUS[0]}"
}
line() { grep -m1 "^$1" <<<"$2"; }
steps() { grep '^step ' <<<"$1" | sed 's/ live_bytes=.*//'; }

# compare NAME BITWISE(yes|no) ARGS...: thread vs tcp vs mpi on the same flags.
compare() {
  local name=$1 bitwise=$2 n=$3
  shift 3
  local ref out
  ref=$(run thread "$n" "$@") || { fail "$name: thread run exited with $?"; return; }
  for backend in tcp mpi; do
    out=$(run "$backend" "$n" "$@") || { fail "$name: $backend run exited with $?: $(tail -3 <<<"$out")"; continue; }
    if [[ $bitwise == yes ]]; then
      if [[ "$(line final: "$out")" == "$(line final: "$ref")" && -n "$(line parameters: "$ref")" &&
            "$(line parameters: "$out")" == "$(line parameters: "$ref")" ]]; then
        pass "$name: $backend equals threads bit for bit ($(line parameters: "$out"))"
      else
        fail "$name: $backend '$(line final: "$out")' $(line parameters: "$out") vs threads '$(line final: "$ref")' $(line parameters: "$ref")"
      fi
    else
      local peak_ref peak_out
      peak_ref=$(line final: "$ref" | sed -n 's/.*peak_bytes_per_rank=\([0-9]*\).*/\1/p')
      peak_out=$(line final: "$out" | sed -n 's/.*peak_bytes_per_rank=\([0-9]*\).*/\1/p')
      if [[ -n "$(steps "$ref")" && "$(steps "$out")" == "$(steps "$ref")" && -n "$peak_ref" && "$peak_out" == "$peak_ref" ]]; then
        pass "$name: $backend: every step's loss and the per-rank peak ($peak_out B) equal the threads'"
      else
        fail "$name: $backend differs from threads:"$'\n'"$(diff <(steps "$ref") <(steps "$out"))"$'\n'"peak $peak_out vs $peak_ref"
      fi
    fi
  done
}

compare "2 ranks, FullShard" yes 2 --steps 4
compare "2 ranks, bf16" yes 2 --steps 3 --precision bf16
compare "4 ranks, FullShard" no 4 --steps 4
compare "4 ranks, HybridShard 2x2 (split across processes)" no 4 --steps 3 --strategy hybrid_shard --mesh 2x2

# Bad flags are refused before any process starts.
if out=$("$train" --backend tcp --nproc 2 --mesh 3x3 2>&1); then fail "--backend tcp --mesh 3x3 was accepted"
elif grep -q "needs 9 ranks" <<<"$out"; then pass "--backend tcp --nproc 2 --mesh 3x3 is refused: $out"
else fail "--mesh 3x3: unexpected message: $out"; fi

[[ $failures -eq 0 ]] && echo "all cases as expected" || { echo "$failures case(s) wrong"; exit 1; }
