#pragma once
// fsdp::launch: start the ranks of a job on this node, torchrun-style, and supervise them.
//
//   run(options, {"./train", "--steps", "10"})  starts options.nproc copies of ./train with
//   MASTER_ADDR, MASTER_PORT, RANK (node_rank * nproc + i), WORLD_SIZE (nnodes * nproc),
//   LOCAL_RANK (i) and LOCAL_WORLD_SIZE (nproc) set, as fsdp/core/dist_env.hpp reads them.
//
// The store (options.store, fsdp_run --store; FSDP_STORE_HOST tells the ranks): by default
// fsdp_run hosts the job's rendezvous store itself (node 0's fsdp_run, with several nodes),
// listening before any rank starts and until the job ends, so it outlives every rank and
// restart. It listens on loopback, or on master_addr with several nodes or a master
// address that is not loopback (FSDP_STORE_BIND, if set, overrides). `--store rank0`
// leaves it to rank 0 as before (with FSDP_STORE_BIND=<master_addr> where it must listen
// beyond loopback); `--store external` to a tools/fsdp_store the user runs. Every job has an
// FSDP_STORE_TOKEN, the secret the store demands: the one in the environment if set, else
// (single node) a random one that only this job's processes learn, through their
// environment. With several nodes each node would draw a different one, so the user must
// export the same FSDP_STORE_TOKEN on every node; run() refuses to start without it.
//
// Output: each line a rank writes becomes "[rank R] line" on the same stream (stdout or
// stderr) of the launcher. Failure: when a rank exits non-zero or by a signal, the launcher
// prints "fsdp_run: rank R exited with status S (signal NAME); stopping the other ranks",
// sends SIGTERM to the others, SIGKILL after `grace`, and returns that rank's status (exit
// code, or 128 + signal); ranks it finds failed at once are all named, one killed by a
// signal first (the likelier cause). A rank that exits with fsdp::kEchoExitStatus (86:
// its error only echoes another rank's failure; fsdp/core/exit_status.hpp) does not stop
// the job at once: for up to `echo_wait` the launcher waits for a rank that fails on its
// own account, which it then names first and whose status it returns. SIGINT, SIGTERM and
// SIGHUP sent to the launcher go to every rank (a second one kills them); run() then
// returns 128 + that signal. All ranks exiting 0 returns 0. Errors before the ranks run
// (bad options, a program that cannot start) and a reached `timeout` (of one start) throw
// fsdp::Error.
//
// Restarts (`max_restarts`, torchrun's --max-restarts): after a failure every rank is
// stopped as above and the whole job started again, with its restart count in
// TORCHELASTIC_RESTART_COUNT, until it succeeds or the restarts run out (the status is the
// last start's). Each start is a new generation of the store: fsdp_run's own store begins
// it before the ranks start (every key of the failed start is dropped, and a process left
// from it is refused; TcpStoreServer, "Generations"). A signal to the launcher ends the job
// without a restart.
//
// Restarts of one rank (`restart_scope` rank, fsdp_run --restart-scope rank; for in-memory
// recovery): a failed rank is replaced and the others go on, untouched, keeping what they
// hold in memory; they rebuild their communicator with the replacement
// (fsdp::TcpProcessGroup::rejoin). The launcher prints "fsdp_run: rank R exited with
// status S (signal NAME); starting a replacement for rank R (restart k of N); the other
// ranks go on", kills what the failed rank left in its process group, then, in its own
// store (one generation for the whole job), deletes the rank's claim (fsdp::claim_key) so
// the replacement can claim it again and adds 1 to fsdp/job/epoch, giving e; only then
// does it start the replacement, with the original's environment except
// TORCHELASTIC_RESTART_COUNT=k (the job's replacements so far, this one included) and
// FSDP_COMM_EPOCH=e. Ranks that fail within 100 ms of the first failure are replaced together,
// under one epoch (e grows by their number, so e = k for every replacement and the store's
// generation, k - e, stays 0), so that the survivors and every replacement meet in one
// ring. `max_restarts` counts replacements in all. A failure with none left stops the job
// as above, and so does a failure once every other rank has exited (a replacement would
// find nobody to rejoin); `timeout` bounds the whole job. A rank exiting
// fsdp::kNoReplacementExitStatus (87: the ranks found no copy to restore a lost rank from)
// is not replaced either: the job is stopped, and, while restarts are left, started again
// whole, as in scope job ("fsdp_run: in-memory recovery is not possible; restarting every
// rank (restart k of N)"), its ranks counting the replacements before in
// TORCHELASTIC_RESTART_COUNT, without FSDP_COMM_EPOCH: the program falls back to what it
// saved on disk. Those whole starts count against `max_restarts` too, and `timeout` bounds
// them all together.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fsdp/asio/tcp_store.hpp"
#include "fsdp/asio/tcp_store_server.hpp"
#include "fsdp/core/dist_env.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/exit_status.hpp"
#include "tools/launcher/options.hpp"
#include "tools/launcher/rank_process.hpp"
#include "tools/launcher/signals.hpp"

namespace fsdp::launch {

// A TCP port free on 127.0.0.1 right now (the kernel's pick for port 0). Another process
// may take it before the job binds it, as with torchrun's choice; the store then fails
// naming the address.
inline int find_free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0)
    fsdp::detail::fail_as(fsdp::ErrorKind::io,
                          "launch: cannot create a socket to find a free port: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0 &&
                  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok)
    fsdp::detail::fail_as(fsdp::ErrorKind::io,
                          "launch: cannot bind 127.0.0.1:0 to find a free port: ", std::strerror(err));
  return ntohs(addr.sin_port);
}

namespace detail {

// 128 random bits as 32 hex digits.
inline std::string random_token() {
  std::random_device device;
  std::string token;
  for (int i = 0; i < 4; ++i) {
    char word[9];
    std::snprintf(word, sizeof word, "%08x", static_cast<unsigned>(device()));
    token += word;
  }
  return token;
}

// The token to add to the ranks' environment; empty when the user already set one.
inline std::string token_to_add(const Options& o) {
  const char* set = std::getenv(kTokenVariable);
  if ((set && *set) || std::any_of(o.env.begin(), o.env.end(), [](auto& kv) { return kv.first == kTokenVariable; }))
    return "";
  if (o.nnodes > 1)
    fsdp::detail::fail("launch: --nnodes ", o.nnodes, " needs ", kTokenVariable,
                       " set to the same secret on every node (e.g. export ", kTokenVariable,
                       "=$(od -An -tx1 -N16 /dev/urandom | tr -d ' \\n')); one drawn per node would differ");
  return random_token();
}

// The token the ranks will present: the one fsdp_run's environment or --env gives, else
// `drawn`.
inline std::string job_token(const Options& o, const std::string& drawn) {
  for (const auto& [key, value] : o.env)
    if (key == kTokenVariable) return value;
  const char* set = std::getenv(kTokenVariable);
  return set && *set ? std::string(set) : drawn;
}

// How one start's ranks reach the store.
struct StoreAccess {
  int port = 0;
  std::string token;  // FSDP_STORE_TOKEN to add (empty: the environment's, if any)
};

// The job's store, hosted by fsdp_run (StoreHost::launcher, on node 0): listening before
// any rank starts, for the whole job. A port already taken fails here, before any rank
// runs, naming it. What the server closes and why goes to fsdp_run's stderr.
inline std::unique_ptr<fsdp::TcpStoreServer> host_store(const Options& o, const std::string& token) {
  fsdp::TcpStoreServerOptions server;
  if (auto bind = store_bind_address(o)) server.host = *bind;
  if (const char* bind = std::getenv(kBindVariable); bind && *bind) server.host = bind;
  for (const auto& [key, value] : o.env)
    if (key == kBindVariable && !value.empty()) server.host = value;
  server.port = static_cast<std::uint16_t>(o.master_port);
  server.token = job_token(o, token);
  // Room for every rank's two connections (its client, and the bounded one a TcpComm's join
  // and failure reports use), and as many before their hello: the ranks connect at once.
  const std::size_t per_job = 2 * static_cast<std::size_t>(o.nnodes) * static_cast<std::size_t>(o.nproc);
  server.max_clients = std::max(server.max_clients, per_job);
  server.max_pending = std::max(server.max_pending, per_job);
  // One job's: only fsdp_run begins its generations (one per start), and any other is refused.
  server.host_begins_generations = true;
  server.log = [](const std::string& line) { write_all(2, "fsdp_run: " + line + "\n"); };
  // The store's thread never takes the signals the launcher handles (a rank's SIGCHLD, the
  // ones it forwards): their handler writes to a pipe that each start's SignalGuard makes
  // and closes on the supervising thread, so it must run there, not race with it. The
  // thread inherits the mask it is created with.
  sigset_t launcher_signals, before;
  sigemptyset(&launcher_signals);
  for (int sig : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGPIPE}) sigaddset(&launcher_signals, sig);
  ::pthread_sigmask(SIG_BLOCK, &launcher_signals, &before);
  struct RestoreMask {
    const sigset_t& mask;
    ~RestoreMask() { ::pthread_sigmask(SIG_SETMASK, &mask, nullptr); }
  } restore{before};
  try {
    return std::make_unique<fsdp::TcpStoreServer>(std::move(server));
  } catch (const fsdp::Error& e) {
    std::string_view why = e.what();
    if (why.substr(0, 6) == "fsdp: ") why.remove_prefix(6);
    fsdp::detail::fail_as(e.kind(), "launch: cannot host the job's store (--store launcher): ", why);
  }
}

// One node's ranks, from start to the last one reaped.
class Job {
 public:
  using Clock = std::chrono::steady_clock;
  // After the last rank exits, its pipes are read until EOF for at most this long (a
  // process it left behind may hold them open).
  static constexpr std::chrono::milliseconds kDrainAfterExit{500};
  // Upper bound on one poll, should a wake-up ever be lost.
  static constexpr std::chrono::milliseconds kMaxPoll{250};
  // RestartScope::rank: how long after a failure fsdp_run waits for others before it
  // replaces them all under one epoch.
  static constexpr std::chrono::milliseconds kReplaceSettle{100};

  // `store`: where the ranks find the store (port, token to add, whether it is external);
  // `hosted`: fsdp_run's own store, if it hosts one (RestartScope::rank needs it).
  Job(const Options& o, std::string program, bool search_path, std::vector<std::string> argv, const StoreAccess& store,
      int restart = 0, std::string run_id = {}, fsdp::TcpStoreServer* hosted = nullptr)
      : options_(o), hosted_(hosted) {
    validate(o);
    if (o.restart_scope == RestartScope::rank && !hosted)
      fsdp::detail::fail("launch: --restart-scope rank needs the store fsdp_run hosts, and this fsdp_run hosts none");
    LaunchSpec& spec = spec_;
    spec.program = std::move(program);
    spec.search_path = search_path;
    spec.argv = std::move(argv);
    spec.restart = restart;
    restarts_ = restart;
    spec.run_id = std::move(run_id);
    spec.port = store.port;
    spec.token = store.token;
    spec.store = o.store;
    spec.reset_sigpipe = !signals_.sigpipe_was_ignored();
    for (int i = 0; i < o.nproc; ++i) {
      ranks_.push_back(std::make_unique<RankProcess>(o.node_rank * o.nproc + i, i));
      ranks_.back()->start(o, spec);
    }
  }

  // Whether the launcher itself was told to stop (SIGINT, SIGTERM, SIGHUP): no restart then.
  bool interrupted() const { return interrupted_; }
  // The restarts so far: the `restart` it was started with, and the replacements it started.
  int restarts() const { return restarts_; }
  // Whether it ended because a rank said no replacement can mend it (RestartScope::rank).
  bool unmendable() const { return unmendable_; }

  // Runs until every rank has exited; returns the job's status (see the top of the file).
  int supervise() {
    const auto started = Clock::now();
    std::optional<Clock::time_point> drain_until;
    for (;;) {
      reap();
      const auto now = Clock::now();
      if (!replace_at_ && std::all_of(ranks_.begin(), ranks_.end(), [](auto& r) { return r->exited(); })) {
        if (stopping_ && !killed_) kill_all();  // what the stopped ranks left behind goes with them
        if (!drain_until) drain_until = now + kDrainAfterExit;
        if (!any_stream_open() || now >= *drain_until) break;
      }
      // Once every rank has exited (draining their pipes), the timeout has nothing to stop.
      const bool timing = !stopping_ && !drain_until && options_.timeout.count() > 0;
      if (timing && now >= started + options_.timeout && !failed_.empty()) {  // echoes waiting for their cause: report them now
        echo_deadline_ = now;
        timeout_reached_ = true;  // and failures waiting for their replacement
        reap();
        continue;
      }
      if (timing && now >= started + options_.timeout) {
        timed_out_ = still_running();
        say("fsdp_run: timeout of " + std::to_string(options_.timeout.count()) + " ms reached with ranks " +
            timed_out_ + " still running; stopping them");
        stop(SIGTERM);
      }
      if (stopping_ && !killed_ && now >= kill_at_) kill_all();
      auto next = now + kMaxPoll;
      if (drain_until) next = std::min(next, *drain_until);
      if (stopping_ && !killed_) next = std::min(next, kill_at_);
      if (timing && !stopping_) next = std::min(next, started + options_.timeout);
      if (echo_deadline_ && !stopping_) next = std::min(next, *echo_deadline_);
      if (replace_at_) next = std::min(next, *replace_at_);
      wait_for_events(std::chrono::duration_cast<std::chrono::milliseconds>(next - now));
    }
    for (auto& r : ranks_) {
      finish_stream(r->out());
      finish_stream(r->err());
    }
    if (!timed_out_.empty())
      fsdp::detail::fail_as(fsdp::ErrorKind::timeout, "launch: ranks ", timed_out_, " were still running after the ",
                            options_.timeout.count(), " ms timeout; they were stopped");
    return result_.value_or(0);
  }

 private:
  static bool echoed(const RankProcess* r) { return !r->killed_by_signal() && r->status() == fsdp::kEchoExitStatus; }
  static bool unmendable(const RankProcess* r) { return !r->killed_by_signal() && r->status() == fsdp::kNoReplacementExitStatus; }

  void reap() {
    const std::size_t before = failed_.size();  // exited non-zero before the job was stopped
    for (auto& r : ranks_)
      if (!r->exited() && r->try_reap() && !stopping_ && r->status() != 0) failed_.push_back(r.get());
    // RestartScope::rank: the failed ranks are replaced, all at once, while restarts are
    // left; a rank that says a replacement cannot mend it (fsdp::kNoReplacementExitStatus)
    // stops the job instead (run_with_restarts then starts it again whole, while restarts
    // and the job's timeout are left). An echo (fsdp::kEchoExitStatus) is a failure like any other
    // here: that process is gone all the same, and only a replacement lets the others go on.
    // Failures within kReplaceSettle of the first are replaced together (ranks lost with
    // one machine, or one signal, exit a few milliseconds apart).
    // Not when every other rank has exited (a replacement would wait for a ring nobody
    // joins), nor once the job's timeout is reached.
    if (options_.restart_scope == RestartScope::rank && !stopping_ && !failed_.empty() && !timeout_reached_ &&
        !still_running().empty() &&
        std::none_of(failed_.begin(), failed_.end(), [](auto* r) { return unmendable(r); }) &&
        restarts_ + static_cast<int>(failed_.size()) <= options_.max_restarts) {
      if (!replace_at_) replace_at_ = Clock::now() + kReplaceSettle;
      if (Clock::now() < *replace_at_) return;
      replace_at_.reset();
      replace(failed_);
      failed_.clear();
    }
    replace_at_.reset();
    if (stopping_ || failed_.empty()) return;
    const bool own = std::any_of(failed_.begin(), failed_.end(), [](auto* r) { return !echoed(r); });
    if (!own) {  // only echoes so far: the rank they echo may still be on its way out
      if (failed_.size() > before && !echo_deadline_) echo_deadline_ = Clock::now() + options_.echo_wait;
      if (Clock::now() < *echo_deadline_ && !still_running().empty()) return;
    }
    // Several failures seen at once (the launcher was slow to wake, or waited for the
    // cause of an echo) have lost their order. A rank killed by a signal is the likelier
    // cause (its peers fail because it vanished), then one that failed on its own account.
    std::stable_partition(failed_.begin(), failed_.end(), [](auto* r) { return !echoed(r); });
    std::stable_partition(failed_.begin(), failed_.end(), [](auto* r) { return r->killed_by_signal(); });
    // The failure: its last output first, then the line saying what happened.
    std::string line;
    for (auto* r : failed_) {
      drain_stream(r->out());
      drain_stream(r->err());
      line += (line.empty() ? "fsdp_run: rank " : "; rank ") + std::to_string(r->rank()) + " exited with status " +
              std::to_string(r->status());
      if (r->killed_by_signal()) line += " (signal " + signal_name(r->status() - 128) + ")";
      if (unmendable(r) && options_.restart_scope == RestartScope::rank) {
        line += " (a replacement cannot mend it)";
        unmendable_ = true;
      }
      if (echoed(r))
        line += own                      ? " (an echo of that failure)"
                : still_running().empty() ? " (an echo of another rank's failure; every rank has exited, none with a "
                                            "failure of its own)"
                                          : " (an echo of another rank's failure; no rank reported a failure of its own "
                                            "within " + std::to_string(options_.echo_wait.count()) + " ms)";
      if (r != failed_.front()) line += " too";
    }
    result_ = failed_.front()->status();
    if (!still_running().empty()) line += "; stopping the other ranks";
    say(line);
    stop(SIGTERM);
  }

  // Starts a replacement for each failed rank in its place (RestartScope::rank; see the top
  // of the file): their last output, a line for each, what they left behind killed, the
  // store told (every claim given back, then one epoch for all of them, so that the
  // survivors and every replacement meet in the same ring), then the new processes.
  void replace(const std::vector<RankProcess*>& failed) {
    for (std::size_t i = 0; i < failed.size(); ++i) {
      RankProcess* r = failed[i];
      drain_stream(r->out());
      drain_stream(r->err());
      const std::string rank = std::to_string(r->rank());
      std::string line = "fsdp_run: rank " + rank + " exited with status " + std::to_string(r->status());
      if (r->killed_by_signal()) line += " (signal " + signal_name(r->status() - 128) + ")";
      say(line + "; starting a replacement for rank " + rank + " (restart " +
          std::to_string(restarts_ + 1 + static_cast<int>(i)) + " of " + std::to_string(options_.max_restarts) +
          "); the other ranks go on");
      r->signal(SIGKILL);  // its group: nothing it started may touch the store once the replacement is announced
      finish_stream(r->out());
      finish_stream(r->err());
    }
    restarts_ += static_cast<int>(failed.size());
    LaunchSpec spec = spec_;
    spec.restart = restarts_;  // TORCHELASTIC_RESTART_COUNT - FSDP_COMM_EPOCH: the store's generation, unchanged
    spec.comm_epoch = announce_replacements(failed);
    for (RankProcess* r : failed) {
      auto fresh = std::make_unique<RankProcess>(r->rank(), r->local_rank());
      fresh->start(options_, spec);
      for (auto& slot : ranks_)
        if (slot.get() == r) slot = std::move(fresh);  // the failed one is reaped as it goes
    }
  }

  // In fsdp_run's store: gives each failed rank's claim back, so that its replacement can
  // claim it (fsdp::claim_place), then adds their number to fsdp::kEpochKey in one step (the
  // epoch counts the replacements started). Returns the new epoch.
  std::int64_t announce_replacements(const std::vector<RankProcess*>& failed) {
    for (RankProcess* r : failed) {
      store_wire::Request release;
      release.verb = store_wire::Verb::delete_key;
      release.keys = {fsdp::claim_key(r->rank())};
      hosted_->apply(release);
    }
    store_wire::Request count;
    count.verb = store_wire::Verb::add;
    count.keys = {fsdp::kEpochKey};
    count.delta = static_cast<std::int64_t>(failed.size());
    const store_wire::Reply epoch = hosted_->apply(count);
    if (epoch.status != store_wire::Status::ok)
      fsdp::detail::fail("launch: cannot announce the replacement of rank ", failed.front()->rank(), " in the job's store: ", epoch.value);
    return epoch.number;
  }

  // Sends `sig` to every rank still running; SIGKILL follows after the grace period.
  void stop(int sig) {
    stopping_ = true;
    kill_at_ = Clock::now() + options_.grace;
    for (auto& r : ranks_) r->signal(sig);
  }

  void kill_all() {
    killed_ = true;
    for (auto& r : ranks_) r->signal(SIGKILL);
  }

  void on_signal(int sig) {
    if (sig == SIGCHLD) return;  // reap() runs next
    interrupted_ = true;
    if (!stopping_) {
      say("fsdp_run: received " + signal_name(sig) + "; forwarding it to the ranks");
      result_ = 128 + sig;
      stop(sig);
    } else if (!killed_) {
      say("fsdp_run: received " + signal_name(sig) + " again; killing the ranks");
      kill_all();
    }
  }

  // Sleeps until a signal or rank output arrives, or `timeout` passes; handles them.
  void wait_for_events(std::chrono::milliseconds timeout) {
    std::vector<pollfd> fds{{signals_.fd(), POLLIN, 0}};
    std::vector<RankProcess::Stream*> streams;
    for (auto& r : ranks_)
      for (auto* s : {&r->out(), &r->err()})
        if (s->fd >= 0) {
          fds.push_back({s->fd, POLLIN, 0});
          streams.push_back(s);
        }
    const int ready = ::poll(fds.data(), fds.size(), static_cast<int>(std::max<long long>(timeout.count(), 0)));
    if (ready <= 0) return;  // timeout, or EINTR: the loop checks everything again
    if (fds[0].revents) {
      for (int sig : signals_.take()) on_signal(sig);
    }
    for (std::size_t i = 0; i < streams.size(); ++i)
      if (fds[i + 1].revents) read_once(*streams[i]);
  }

  // One read of what is there; false when nothing more is (now or ever).
  static bool read_once(RankProcess::Stream& s) {
    char buf[1 << 16];
    const ssize_t n = ::read(s.fd, buf, sizeof buf);
    if (n > 0) {
      s.prefixer->feed(std::string_view(buf, static_cast<std::size_t>(n)));
      return true;
    }
    if (n < 0 && (errno == EAGAIN || errno == EINTR)) return false;
    finish_stream(s);  // EOF, or an error that ends the stream
    return false;
  }

  // Reads what an exited rank left in its pipe: at most 1 MiB, as a process it started may
  // still be writing.
  static void drain_stream(RankProcess::Stream& s) {
    for (int reads = 0; reads < 16 && s.fd >= 0 && read_once(s); ++reads) {
    }
  }

  static void finish_stream(RankProcess::Stream& s) {
    if (s.prefixer) s.prefixer->finish();
    RankProcess::close_stream(s);
  }

  bool any_stream_open() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](auto& r) { return r->out().fd >= 0 || r->err().fd >= 0; });
  }

  // "1, 3" for the ranks that have not exited.
  std::string still_running() const {
    std::string list;
    for (auto& r : ranks_)
      if (!r->exited()) list += (list.empty() ? "" : ", ") + std::to_string(r->rank());
    return list;
  }

  static void say(const std::string& line) { write_all(2, line + "\n"); }

  Options options_;
  fsdp::TcpStoreServer* hosted_;  // fsdp_run's store, or null
  LaunchSpec spec_;               // what every rank was started with
  int restarts_ = 0;              // restarts so far: the start's, then each replacement (RestartScope::rank)
  bool unmendable_ = false;       // a rank exited kNoReplacementExitStatus (RestartScope::rank)
  std::optional<Clock::time_point> replace_at_;  // failed ranks wait for their replacement until then
  bool timeout_reached_ = false;                 // no replacement after the job's timeout
  SignalGuard signals_;  // before ranks_: installed before the first start, restored after the last reap
  std::vector<std::unique_ptr<RankProcess>> ranks_;
  std::optional<int> result_;
  std::vector<RankProcess*> failed_;  // the ranks that failed before the job was stopped, in the order seen
  std::optional<Clock::time_point> echo_deadline_;  // only echoes failed so far: when to stop waiting for their cause
  bool stopping_ = false, killed_ = false, interrupted_ = false;
  Clock::time_point kill_at_{};
  std::string timed_out_;  // the ranks a reached timeout stopped
};

// The job, started again after a failure up to options.max_restarts times. Each Job has
// reaped every rank (and killed what they left) before it returns, so a restart never
// meets a rank of the attempt before. What else could meet it, a process the ranks
// started, is kept out of the store by its generation (the restart count; fsdp_run's own
// store begins each one before the ranks start), or, when rank 0 hosts the store, by the
// fresh port and token of each start.
inline int run_with_restarts(const Options& options, const std::string& program, bool search_path,
                             const std::vector<std::string>& argv) {
  validate(options);
  // One for every start. An inherited id is kept (a cluster's job id), but not torchrun's
  // default "none", which every job shares.
  const char* given = std::getenv(kRunIdVariable);
  const std::string run_id = given && *given && std::string_view(given) != "none" ? given : random_token();
  // A store that outlives the ranks serves every start, under one port and token.
  StoreAccess store;
  std::unique_ptr<fsdp::TcpStoreServer> hosted;
  if (options.store != StoreHost::rank0) {
    store.port = options.master_port;
    if (options.store == StoreHost::launcher) {
      store.token = token_to_add(options);
      if (options.node_rank == 0) {
        hosted = host_store(options, store.token);
        store.port = hosted->port();
      }
    }
  }
  // `restart`: the restarts before this start (under RestartScope::rank the replacements
  // too), its TORCHELASTIC_RESTART_COUNT and its store generation.
  // RestartScope::rank: `timeout` bounds the whole job, the starts after a fallback included.
  const bool rank_scope = options.restart_scope == RestartScope::rank;
  const auto deadline = std::chrono::steady_clock::now() + options.timeout;
  for (int restart = 0;;) {
    Options start = options;
    if (rank_scope && options.timeout.count() > 0)
      start.timeout = std::max(std::chrono::milliseconds(1), std::chrono::duration_cast<std::chrono::milliseconds>(
                                                                  deadline - std::chrono::steady_clock::now()));
    if (hosted) hosted->begin_generation(static_cast<std::uint64_t>(restart));
    if (options.store == StoreHost::rank0)
      store = {options.master_port ? options.master_port : find_free_port(), token_to_add(options)};
    Job job(start, program, search_path, argv, store, restart, run_id, hosted.get());
    const int status = job.supervise();
    restart = job.restarts();
    // RestartScope::rank: one start replaces failed ranks until none is left; it is
    // started again whole only when a rank found that no replacement can mend it, and
    // the job's timeout has not passed.
    const bool expired = rank_scope && options.timeout.count() > 0 && std::chrono::steady_clock::now() >= deadline;
    if (status == 0 || job.interrupted() || (rank_scope && (!job.unmendable() || expired)) || restart >= options.max_restarts) {
      if (status != 0 && options.max_restarts > 0 && !job.interrupted())
        write_all(2, "fsdp_run: no restart left (--max-restarts " + std::to_string(options.max_restarts) +
                         "); the job failed with status " + std::to_string(status) + "\n");
      return status;
    }
    ++restart;
    write_all(2, std::string(rank_scope ? "fsdp_run: in-memory recovery is not possible; " : "fsdp_run: ") +
                     "restarting every rank (restart " + std::to_string(restart) + " of " + std::to_string(options.max_restarts) +
                     ")\n");
  }
}

}  // namespace detail

// Starts options.nproc ranks of argv (argv[0] is looked up in PATH) on this node and
// supervises them until all have exited. Returns 0, or the status of the first rank that
// failed (of the last start, with restarts), or 128 + a signal the launcher received. Not
// for two threads at once.
inline int run(const Options& options, const std::vector<std::string>& argv) {
  if (argv.empty() || argv[0].empty()) fsdp::detail::fail("launch: missing the program to run");
  return detail::run_with_restarts(options, argv[0], true, argv);
}

// Runs this very program (/proc/self/exe) as the job's ranks, with the same arguments:
// `train --backend tcp` calls it when DistEnv::launched() is false, and each copy, seeing
// RANK set, trains as one rank. Refuses to run inside a launched process (no recursion).
inline int relaunch_self(const Options& options, int argc, const char* const* argv) {
  if (fsdp::DistEnv::launched())
    fsdp::detail::fail("launch: relaunch_self: this process already is rank ", std::getenv("RANK"),
                       " of a launched job (RANK and WORLD_SIZE are set); run as that rank instead");
  if (argc < 1 || !argv || !argv[0]) fsdp::detail::fail("launch: relaunch_self needs argv[0]");
  std::vector<std::string> args(argv, argv + argc);
  return detail::run_with_restarts(options, "/proc/self/exe", false, args);
}

}  // namespace fsdp::launch
