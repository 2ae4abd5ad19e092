// fsdp_run: start the ranks of a job on this node, torchrun-style.
//   fsdp_run --nproc 4 ./train --steps 10
// Exit status: 0 when every rank exits 0; else the first failing rank's status (exit code,
// or 128 + signal), or 128 + a signal fsdp_run received; 2 for a bad command line; 1 when
// the job cannot start or its --timeout-ms is reached. See tools/launcher/launcher.hpp.
#include <cstdio>

#include "tools/launcher/cli.hpp"
#include "tools/launcher/launcher.hpp"

int main(int argc, char** argv) {
  fsdp::launch::Command command;
  try {
    command = fsdp::launch::parse(argc, argv);
  } catch (const fsdp::Error& e) {
    std::fprintf(stderr, "%s\nRun 'fsdp_run --help' for usage.\n", e.what());
    return 2;
  }
  if (!command.help.empty()) {
    std::fputs(command.help.c_str(), stdout);
    return 0;
  }
  try {
    return fsdp::launch::run(command.options, command.argv);
  } catch (const fsdp::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
}
