#pragma once
// fsdp::MpiSession: MPI's lifetime in this process (MPI_Init_thread .. MPI_Finalize), plus
// what every MpiComm shares: the thread level, the f16 / bf16 datatypes and reduction
// ops, and whether a collective has failed.
//
//   int main(int argc, char** argv) {
//     fsdp::MpiSession mpi(argc, argv);
//     fsdp::MpiComm world = fsdp::MpiComm::world(mpi);
//     ...
//   }
//
// MPI is finalized when the session and every MpiComm made from it are gone (communicators
// keep it alive, so no MPI call can follow MPI_Finalize). MPI can be initialized only once
// per process: a second session while one is alive joins it; one after MPI_Finalize is an
// fsdp::Error. If something else initialized MPI first, the session uses it and leaves
// MPI_Finalize to its owner. A session that initializes MPI sets MPI_ERRORS_RETURN on
// MPI_COMM_WORLD and MPI_COMM_SELF (see MpiRuntime); an owner of MPI should too, or an MPI
// error inside an MpiComm collective ends the job with MPI's message.
//
// Failure: after a collective failed or timed out, its request may still be active inside
// MPI, writing into buffers the caller is free to release, and the peers may be waiting in
// it; MPI offers no way to cancel a collective. Such a job must be torn down, so instead of
// MPI_Finalize (which could wait forever for those peers) the end of the session then
// calls MPI_Abort, which makes mpirun end every rank. abort() does it earlier. mpirun names
// the rank whose MPI_Abort came first: a rank whose failure only echoes a peer's abort_step
// (detail::EchoedError) therefore gives that peer up to kEchoAbortDelay to abort first, and
// aborts with fsdp::kEchoExitStatus, so the job's report leads with the root cause.
#include <atomic>
#include <chrono>
#include <concepts>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>

#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/exit_status.hpp"
#include "fsdp/mpi/mpi_types.hpp"

namespace fsdp {

namespace detail {

// How long a rank whose failure echoes a peer's waits, at its session's end, before its own
// MPI_Abort (see the top of this file). The root cause is printed by then on its rank.
inline constexpr std::chrono::milliseconds kEchoAbortDelay{1500};

// State shared by a session and its communicators.
struct MpiRuntime {
  MpiRuntime(int* argc, char*** argv) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (finalized)
      fail("MpiSession: MPI was already finalized in this process, and MPI cannot be initialized twice");
    if (initialized) {
      MPI_Query_thread(&thread_level);
    } else {
      const int rc = MPI_Init_thread(argc, argv, MPI_THREAD_MULTIPLE, &thread_level);
      if (rc != MPI_SUCCESS) fail("MpiSession: MPI_Init_thread failed: ", mpi_error_text(rc));
      owns_mpi = true;
      // OpenMPI raises an error inside a nonblocking collective (MPI_ERR_TRUNCATE when the
      // ranks' calls differ) on MPI_COMM_WORLD (4.x) or MPI_COMM_SELF (5.x), not on the
      // collective's communicator: returned, it becomes MpiComm's fsdp::Error instead of
      // ending the job with MPI's own message.
      MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
      MPI_Comm_set_errhandler(MPI_COMM_SELF, MPI_ERRORS_RETURN);
    }
    // Below MPI_THREAD_MULTIPLE, MPI may not be entered by two threads at once (a caller's
    // thread and an AsyncCommunicator's worker, say), so every MPI call the adapter makes
    // then holds `mpi_mutex`: MPI_THREAD_SERIALIZED's rule. SINGLE and FUNNELED strictly
    // allow the main thread only; serialized calls are the most an adapter can promise there.
    serialize = thread_level < MPI_THREAD_MULTIPLE;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world_size);
    types.create();
  }
  MpiRuntime(const MpiRuntime&) = delete;
  MpiRuntime& operator=(const MpiRuntime&) = delete;

  ~MpiRuntime() {
    if (has_failed()) {
      const int echo_of = failure_echo_of();
      const bool echo = echo_of >= 0;
      // An echo says so on its own line too: mpirun's banner naming the first MPI_Abort is
      // Open MPI's words, which it may fail to print (show_help "Out of resource").
      if (echo)
        std::fprintf(stderr,
                     "fsdp: world rank %d: aborting the MPI job after a failed collective, an echo of world rank "
                     "%d's abort_step (exit status %d): %s\n",
                     world_rank, echo_of, kEchoExitStatus, failure().c_str());
      else
        std::fprintf(stderr, "fsdp: world rank %d: aborting the MPI job after a failed collective: %s\n", world_rank,
                     failure().c_str());
      std::fflush(stderr);
      if (echo) std::this_thread::sleep_for(kEchoAbortDelay);  // the root's abort first; mpirun may end us sooner
      MPI_Abort(MPI_COMM_WORLD, echo ? kEchoExitStatus : 1);
    }
    int finalized = 0;
    MPI_Finalized(&finalized);  // by MPI's owner, when that is not this session
    if (finalized) return;
    types.free();
    if (owns_mpi) MPI_Finalize();
  }

  // Holds the MPI lock when the thread level asks for it; an empty lock otherwise.
  std::unique_lock<std::mutex> lock() {
    return serialize ? std::unique_lock<std::mutex>(mpi_mutex) : std::unique_lock<std::mutex>();
  }

  // The lock for an MPI call, refused once the job has failed: any MPI call could progress
  // a timed-out collective, which may still write into buffers that its caller freed
  // while unwinding. After a failure fsdp makes no MPI call but MPI_Abort.
  std::unique_lock<std::mutex> lock_for_call(const std::string& where) {
    if (has_failed())
      fail_echo_if(failure_echo_of(), failure_kind(), where, ": not started: the MPI job already failed (", failure(),
              "); fsdp makes no further MPI calls, since a timed-out collective could still write into freed "
              "buffers. End the job (the MpiSession aborts it when it ends)");
    return lock();
  }
  // The same with `where()` built only to refuse: no string per collective.
  template <std::invocable F>
  std::unique_lock<std::mutex> lock_for_call(F&& where) {
    if (has_failed()) lock_for_call(std::string(where()));  // throws
    return lock();
  }

  // Records the first failure that leaves MPI in an unknown state.
  // `echo_of`: the rank whose abort_step it follows (an echo), or -1.
  void mark_failed(const std::string& reason, ErrorKind kind, int echo_of = -1) {
    std::lock_guard lk(failure_mutex);
    if (failed.exchange(true)) return;
    first_failure = reason;
    first_failure_kind = kind;
    first_failure_echo_of = echo_of;
  }
  bool has_failed() const { return failed.load(); }
  std::string failure() const {
    std::lock_guard lk(failure_mutex);
    return first_failure;
  }
  ErrorKind failure_kind() const {
    std::lock_guard lk(failure_mutex);
    return first_failure_kind;
  }
  int failure_echo_of() const {
    std::lock_guard lk(failure_mutex);
    return first_failure_echo_of;
  }

  // The process's runtime: the live one if a session or communicator still holds it,
  // else a new one (which initializes MPI).
  static std::shared_ptr<MpiRuntime> acquire(int* argc, char*** argv) {
    static std::mutex mu;
    static std::weak_ptr<MpiRuntime> current;
    std::lock_guard lk(mu);
    auto rt = current.lock();
    if (!rt) {
      rt = std::make_shared<MpiRuntime>(argc, argv);
      current = rt;
    }
    return rt;
  }

  bool owns_mpi = false;
  int thread_level = MPI_THREAD_SINGLE;
  bool serialize = true;
  int world_rank = 0;
  int world_size = 1;
  std::mutex mpi_mutex;
  MpiTypes types;
  std::atomic<bool> failed{false};
  mutable std::mutex failure_mutex;
  std::string first_failure;
  ErrorKind first_failure_kind = ErrorKind::misuse;
  int first_failure_echo_of = -1;
};

}  // namespace detail

class MpiSession {
 public:
  // MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, ...).
  MpiSession() : MpiSession(nullptr, nullptr) {}
  // Lets MPI see and strip its own command-line arguments.
  MpiSession(int& argc, char**& argv) : MpiSession(&argc, &argv) {}
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;

  // The thread level MPI provides (MPI_THREAD_MULTIPLE unless the library is built
  // without it); below MULTIPLE, the adapter's MPI calls are serialized behind a mutex.
  int thread_level() const { return rt_->thread_level; }
  bool serialized() const { return rt_->serialize; }
  int world_rank() const { return rt_->world_rank; }
  int world_size() const { return rt_->world_size; }

  // True once a collective failed or timed out; the session's end then aborts the job.
  bool failed() const { return rt_->has_failed(); }
  std::string failure() const { return rt_->failure(); }

  // Ends every rank of the job now (MPI_Abort on MPI_COMM_WORLD), after printing `reason`.
  [[noreturn]] void abort(std::string_view reason, int exit_code = 1) const {
    std::fprintf(stderr, "fsdp: world rank %d: aborting the MPI job: %.*s\n", rt_->world_rank,
                 static_cast<int>(reason.size()), reason.data());
    std::fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::abort();  // MPI_Abort does not return; this tells the compiler so
  }

  // The MPI datatype fsdp uses for `t` (a 2-byte type for f16 and bf16), and the MPI_Op for
  // `op` on it (for f16 / bf16 a user op that rounds to the dtype after each step, as
  // detail::host_combine does). avg has no MPI_Op: MpiComm sums and then scales.
  MPI_Datatype datatype(DType t) const { return rt_->types.datatype(t); }
  MPI_Op op(DType t, ReduceOp op) const { return rt_->types.op(t, op); }

 private:
  friend class MpiComm;
  MpiSession(int* argc, char*** argv) : rt_(detail::MpiRuntime::acquire(argc, argv)) {}
  std::shared_ptr<detail::MpiRuntime> rt_;
};

}  // namespace fsdp
