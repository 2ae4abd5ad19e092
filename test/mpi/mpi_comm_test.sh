#!/usr/bin/env bash
# MpiComm's doctest binary under mpirun, as 1, 2, 3, 4 and 8 processes on this host, then a
# teardown run in which a timed-out collective must end the whole job (and nothing hangs),
# and the "fatal:" runs, in which ranks call different collectives.
# Each run's rank 0 prints the run's doctest summary (a case passes if it passed on every
# rank), so the log holds one summary line per run. Exits non-zero if any run failed.
#
# Usage: mpi_comm_test.sh TEST_BINARY
set -u
bin="$1"
# mpirun's environment, fail, run and the job checks: beside this script, or in Bazel's
# runfiles (the cwd).
env_sh="$(dirname "${BASH_SOURCE[0]}")/mpirun_env.sh"
[[ -f $env_sh ]] || env_sh=test/mpi/mpirun_env.sh
source "$env_sh"

for np in 1 2 3 4 8; do
  passing_job "$np" --test-case-exclude='teardown*,fatal*'
done

# Rank 0 skips a barrier; the others time out after 500 ms, still pass their checks, and
# their MpiSession then aborts the job instead of finalizing beside the dead collective.
start=$SECONDS
out=$(run 3 --test-case='teardown*')
rc=$?
echo "$out"
echo "teardown: exit $rc after $((SECONDS - start)) s"
[[ $rc != 0 && $rc != 124 && $rc != 137 ]] || fail "teardown: mpirun exited with $rc, expected MPI_Abort's status"
[[ $(grep -c '\[mpi\] rank [12] (its MPI job failed: no totals across ranks): test cases: 1 | 1 passed | 0 failed' <<<"$out") == 2 ]] ||
  fail "teardown: its test case did not pass on ranks 1 and 2"
grep -q 'aborting the MPI job after a failed collective: world rank [12]: MpiComm .world.: MPI_Comm_idup' <<<"$out" ||
  fail "teardown: no rank aborted the job"

# Calls MPI pairs although they differ: each rank's collective completes, fails or times
# out (500 ms), and every rank's error must name every rank's call. Ranks whose job failed
# end it; every rank prints its own verdict first.
per_rank_job 2 any 'fatal: all_reduce counts*'
per_rank_job 3 any 'fatal: all_reduce counts*'
per_rank_job 3 any 'fatal: all_gather against all_reduce*'
per_rank_job 2 any 'fatal: broadcast roots*'
per_rank_job 3 any 'fatal: a known mismatch ends*'

finish
