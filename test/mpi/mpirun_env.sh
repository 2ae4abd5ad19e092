# Sourced by the MPI sh_tests: mpirun's environment, `fail`, `run NP ARGS...`, the job
# checks and `finish`.
#
# mpirun as root (containers, CI), on one host with no ssh, over shared memory and loopback
# only. vader's single-copy mechanism (CMA) needs ptrace rights a sandbox may not grant.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export OMPI_MCA_plm=isolated
export OMPI_MCA_btl=self,vader
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_oob_tcp_if_include=lo
# Per-test session directory and shared-memory files: in a PID namespace (Bazel's sandbox,
# containers) concurrent mpiruns get equal PIDs, hence equal job ids, and would otherwise
# map each other's segments in /dev/shm.
export TMPDIR="${TEST_TMPDIR:-${TMPDIR:-/tmp}}"
export OMPI_MCA_btl_vader_backing_directory="$TMPDIR"

failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

# run NP ARGS...: mpirun of "$bin" with a hard limit (a hang fails the run, never the
# suite's time).
run() {
  local np="$1"
  shift
  timeout -k 5 40 mpirun -np "$np" --oversubscribe --tag-output "$bin" "$@" 2>&1
}

# passing_job NP ARGS...: a job that must exit 0 with rank 0's passing doctest summary (a
# case passes there if it passed on every rank).
passing_job() {
  local np="$1" start=$SECONDS out rc
  shift
  out=$(run "$np" "$@")
  rc=$?
  echo "$out"
  echo "np=$np: exit $rc after $((SECONDS - start)) s"
  [[ $rc == 0 ]] || fail "np=$np: mpirun exited with $rc"
  grep -q '\[doctest\] test cases: [1-9][0-9]* | [0-9]* passed | 0 failed' <<<"$out" ||
    fail "np=$np: no passing summary from rank 0"
}

# per_rank_job NP END CASE: a job of the one test case CASE (a doctest pattern) in which
# ranks fail, so every rank prints its own verdict (FSDP_MPI_TEST_PER_RANK) and each must
# have passed. END=abort: the job must end in MPI_Abort's status; END=any: any end but a hang.
# The job's output and exit status stay in job_out and job_rc for further checks.
per_rank_job() {
  local np="$1" end="$2" label="$3" start=$SECONDS out rc passed
  out=$(FSDP_MPI_TEST_PER_RANK=1 run "$np" --test-case="$label")
  rc=$?
  job_out=$out job_rc=$rc
  echo "$out"
  echo "$label (np=$np): exit $rc after $((SECONDS - start)) s"
  if [[ $rc == 124 || $rc == 137 ]]; then
    fail "$label (np=$np): mpirun hung"
  elif [[ $end == abort && $rc == 0 ]]; then
    fail "$label (np=$np): mpirun exited with 0, expected MPI_Abort's status"
  fi
  passed=$(grep -c '\[mpi\] rank [0-9]* ([^)]*): test cases: 1 | 1 passed | 0 failed' <<<"$out")
  [[ $passed == "$np" ]] || fail "$label (np=$np): the case passed on $passed of $np ranks"
}

# The last line and the exit status of every MPI sh_test.
finish() {
  [[ $failures == 0 ]] && echo "PASS: every run" || echo "FAILED: $failures check(s)"
  exit $((failures > 0))
}
