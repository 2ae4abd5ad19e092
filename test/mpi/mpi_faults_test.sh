#!/usr/bin/env bash
# mpi_faults_test.cpp's binary under mpirun: its order cases in one job at -np 2 and 4, then
# each "job-ending" case (a collective that fails or stalls on rank 1; the others time out
# and the MpiSession aborts the job) in a job of its own at -np 2 and 4: each must end in
# MPI_Abort with every rank reporting its case passed; then the "own job" case, which may end
# either way, every rank reporting it passed. Exits non-zero if any run failed.
#
# Usage: mpi_faults_test.sh TEST_BINARY
set -u
bin="$1"
# mpirun's environment, fail, run and the job checks: beside this script, or in Bazel's
# runfiles (the cwd).
env_sh="$(dirname "${BASH_SOURCE[0]}")/mpirun_env.sh"
[[ -f $env_sh ]] || env_sh=test/mpi/mpirun_env.sh
source "$env_sh"

for np in 2 4; do
  passing_job "$np" --test-case-exclude='job-ending*,own job*'
  for case in 'first collective fails' 'middle collective fails' 'last collective fails' 'stalls'; do
    per_rank_job "$np" abort "job-ending: *$case*"
  done
  per_rank_job "$np" any 'own job: *aborts its step*'
  # A rank that only echoes rank 0's failure lets rank 0 abort first and aborts with
  # errorcode 86 (fsdp::kEchoExitStatus): where the job ended in MPI_Abort, mpirun's status is
  # rank 0's own 1 or the echo's 86, every other rank that says it aborts says it echoes, and
  # the abort mpirun names is rank 0's own (errorcode 1) or says it is an echo, never an echo
  # posing as a cause. (That banner is Open MPI's words, which its show_help may fail to print
  # under load, "ORTE_ERROR_LOG: Out of resource": then fsdp's own lines decide.)
  if [[ $job_rc != 0 ]]; then
    [[ $job_rc == 1 || $job_rc == 86 ]] ||
      fail "own job (np=$np): mpirun exited with $job_rc, neither rank 0's MPI_Abort (1) nor an echo's (86)"
    if grep -q 'MPI_ABORT was invoked' <<<"$job_out"; then
      grep -A1 'MPI_ABORT was invoked' <<<"$job_out" | head -2 | tr '\n' ' ' |
        grep -Eq 'invoked on rank 0 in communicator MPI_COMM_WORLD *with errorcode 1\.|with errorcode 86\.' ||
        fail "own job (np=$np): mpirun named an abort that is neither rank 0's nor marked as an echo"
    else
      echo "own job (np=$np): Open MPI printed no MPI_ABORT banner; fsdp's own lines decide"
    fi
    grep -E 'fsdp: world rank [1-9][0-9]*: aborting the MPI job' <<<"$job_out" | grep -vq 'an echo of world rank 0' &&
      fail "own job (np=$np): a rank other than 0 aborted the job without saying it echoes rank 0"
    grep -Eq 'fsdp: world rank [0-9]+: aborting the MPI job' <<<"$job_out" ||
      fail "own job (np=$np): the job ended non-zero with no rank saying why it aborted"
  fi
done
finish
