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
done
finish
