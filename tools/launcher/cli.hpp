#pragma once
// fsdp_run's command line: options first, then the program and its arguments, which are
// passed on untouched (an option after the program is the program's):
//   fsdp_run --nproc 4 ./train --steps 10
//   fsdp_run --nnodes 2 --node-rank 1 --nproc 8 --master-addr 10.0.0.1 --master-port 29500 -- ./train
#include <CLI/CLI.hpp>

#include <string>
#include <vector>

#include "fsdp/core/error.hpp"
#include "tools/launcher/options.hpp"

namespace fsdp::launch {

struct Command {
  Options options;
  std::vector<std::string> argv;  // the program and its arguments
  std::string help;               // set when --help was asked for: print it, exit 0
};

// Throws fsdp::Error naming the flag and the value for anything it cannot run.
inline Command parse(int argc, const char* const* argv) {
  Command c;
  Options& o = c.options;
  long long grace_ms = o.grace.count(), timeout_ms = o.timeout.count(), echo_wait_ms = o.echo_wait.count();
  std::vector<std::string> env;
  CLI::App app{"Starts --nproc ranks of PROGRAM on this node with torchrun's environment (MASTER_ADDR, "
               "MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), prefixes their output with "
               "[rank R], and stops them all when one fails, exiting with its status.",
               "fsdp_run"};
  app.add_option("--nproc,--nproc-per-node,--nproc_per_node", o.nproc, "ranks on this node (default 1)");
  app.add_option("--nnodes", o.nnodes, "nodes in the job (default 1)");
  app.add_option("--node-rank,--node_rank", o.node_rank, "this node's index in [0, nnodes) (default 0)");
  app.add_option("--master-addr,--master_addr", o.master_addr, "address of the job's store (default 127.0.0.1)");
  app.add_option("--master-port,--master_port", o.master_port,
                 "port of the job's store (default: a free one; required with --nnodes > 1 or --store external)");
  std::string store = name_of(o.store);
  app.add_option("--store", store,
                 "who serves the job's rendezvous store: launcher (fsdp_run itself, node 0's: it outlives every "
                 "rank and restart), rank0 (rank 0's process), or external (a tools/fsdp_store at --master-addr and "
                 "--master-port) (default launcher)")
      ->check(CLI::IsMember({"launcher", "rank0", "external"}));
  bool no_prefix = false;
  app.add_flag("--no-prefix", no_prefix, "write the ranks' output as it is, without [rank R]");
  app.add_option("--grace-ms", grace_ms, "after a failure: SIGTERM, then SIGKILL this much later (default 3000)");
  app.add_option("--echo-wait-ms", echo_wait_ms,
                 "after a rank exits with status " + std::to_string(fsdp::kEchoExitStatus) +
                     " (its error echoes another rank's failure): wait this long for a rank that fails on its own "
                     "account, to report it first (default 2000; 0: stop at once)");
  app.add_option("--max-restarts,--max_restarts", o.max_restarts,
                 "when a rank fails, stop every rank and start the whole job again, up to this many times; each start "
                 "sees its number in TORCHELASTIC_RESTART_COUNT (default 0). With --restart-scope rank: start a "
                 "replacement for the failed rank, up to this many in all");
  std::string restart_scope = name_of(o.restart_scope);
  app.add_option("--restart-scope", restart_scope,
                 "job (default): stop every rank and start the job again; rank: start a replacement for the failed "
                 "rank only, the others go on (they must rebuild their communicator: fsdp::TcpProcessGroup::rejoin); a "
                 "rank exiting 87 (no copy to restore from) makes it stop and start every rank again")
      ->check(CLI::IsMember({"job", "rank"}));
  app.add_option("--timeout-ms", timeout_ms,
                 "stop the job and fail after this long, each start of it with --max-restarts (the whole job with "
                 "--restart-scope rank) (default 0: no limit)");
  app.add_option("--env", env, "KEY=VALUE for every rank (repeatable)")->allow_extra_args(false);
  app.footer("Then PROGRAM [ARGS...]: everything from the first word that is not an option above (or after "
             "'--') is the program's.");
  app.prefix_command();  // the first word that is not one of ours starts the program

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    c.help = app.help();
    return c;
  } catch (const CLI::ParseError& e) {
    fsdp::detail::fail("launch: ", e.what());
  }
  std::vector<std::string> rest = app.remaining();
  const bool separated = !rest.empty() && rest.front() == "--";
  if (separated) rest.erase(rest.begin());
  if (rest.empty()) fsdp::detail::fail("launch: missing the program to run (usage: fsdp_run [options] PROGRAM [ARGS...])");
  if (!separated && rest.front().size() > 1 && rest.front()[0] == '-')
    fsdp::detail::fail("launch: unknown option '", rest.front(), "' (put '--' before a program whose name starts with '-')");

  for (const auto& entry : env) {
    const auto eq = entry.find('=');
    if (eq == std::string::npos || eq == 0) fsdp::detail::fail("launch: --env '", entry, "' is not KEY=VALUE");
    o.env.emplace_back(entry.substr(0, eq), entry.substr(eq + 1));
  }
  o.restart_scope = restart_scope == "rank" ? RestartScope::rank : RestartScope::job;
  o.store = store == "rank0" ? StoreHost::rank0 : store == "external" ? StoreHost::external : StoreHost::launcher;
  o.prefix_output = !no_prefix;
  o.grace = std::chrono::milliseconds(grace_ms);
  o.timeout = std::chrono::milliseconds(timeout_ms);
  o.echo_wait = std::chrono::milliseconds(echo_wait_ms);
  validate(o);
  c.argv = std::move(rest);
  return c;
}

}  // namespace fsdp::launch
