# Sourced by the MPI sh_tests: mpirun's environment, `fail`, and `run NP ARGS...`.
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
