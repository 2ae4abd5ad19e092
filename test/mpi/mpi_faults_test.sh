#!/usr/bin/env bash
# mpi_faults_test.cpp's binary under mpirun: its order cases in one job at -np 2 and 4, then
# each "job-ending" case (a collective that fails or stalls on rank 1; the others time out
# and the MpiSession aborts the job) in a job of its own at -np 2 and 4: each must end in
# MPI_Abort with every rank reporting its case passed. Exits non-zero if any run failed.
#
# Usage: mpi_faults_test.sh TEST_BINARY
set -u
bin="$1"
# fail, run, mpirun's environment: beside this script, or in Bazel's runfiles (the cwd).
env_sh="$(dirname "${BASH_SOURCE[0]}")/mpirun_env.sh"
[[ -f $env_sh ]] || env_sh=test/mpi/mpirun_env.sh
source "$env_sh"

for np in 2 4; do
  start=$SECONDS
  out=$(run "$np" --test-case-exclude='job-ending*')
  rc=$?
  echo "$out"
  echo "np=$np: exit $rc after $((SECONDS - start)) s"
  [[ $rc == 0 ]] || fail "np=$np: mpirun exited with $rc"
  grep -q '\[doctest\] test cases: [1-9][0-9]* | [0-9]* passed | 0 failed' <<<"$out" ||
    fail "np=$np: no passing summary from rank 0"

  for case in 'first collective fails' 'middle collective fails' 'last collective fails' 'stalls'; do
    start=$SECONDS
    out=$(run "$np" --test-case="job-ending: *$case*")
    rc=$?
    echo "$out"
    echo "np=$np, $case: exit $rc after $((SECONDS - start)) s"
    [[ $rc != 0 && $rc != 124 && $rc != 137 ]] || fail "np=$np, $case: mpirun exited with $rc, expected MPI_Abort's status"
    passed=$(grep -c '\[mpi\] rank [0-9]* (its MPI job failed: no totals across ranks): test cases: 1 | 1 passed | 0 failed' <<<"$out")
    [[ $passed == "$np" ]] || fail "np=$np, $case: the case passed on $passed of $np ranks"
  done
done

[[ $failures == 0 ]] && echo "PASS: every run" || echo "FAILED: $failures check(s)"
exit $((failures > 0))
