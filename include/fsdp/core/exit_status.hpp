#pragma once
// fsdp::exit_status: what a rank's main returns for the exception that ended it, so that a
// launcher that sees only exit statuses can still put the root cause first.
//
// When one rank fails, the others fail too, and their errors are echoes: "another rank
// failed; rank 0 says: ..." (a checkpoint step), "aborted: rank 0 failed: ..." (a
// ThreadComm collective), an ABORT frame or a closed link on TcpComm. Each echo names the
// failed rank, but a launcher (fsdp_run, torchrun) reads none of it: it reports whichever
// rank exits first, often an echo, since the failed rank may still be writing its message.
// Returning kEchoExitStatus for an echo tells fsdp_run to wait a moment for a rank that
// fails on its own account and to report that one first (tools/launcher/launcher.hpp).
//
//   } catch (const std::exception& e) {
//     std::cerr << e.what() << '\n';
//     return fsdp::exit_status(e);   // 1, or kEchoExitStatus for an echo
//   }
#include <exception>

#include "fsdp/core/detail/echoed_error.hpp"

namespace fsdp {

// The exit status of a rank whose error only echoes another rank's failure. Any status
// other than 0 and this one is a failure of the rank's own.
inline constexpr int kEchoExitStatus = 86;

// The exit status of a rank that a replacement cannot mend: under fsdp_run
// --restart-scope rank, the ranks found no copy to restore a lost rank from
// (fsdp::PeerCheckpoint::restore), so replacing this one would start a rank with nothing
// to restore either. fsdp_run then stops the job instead of replacing it, and starts every
// rank again while restarts are left, as --restart-scope job does: the program falls back
// to what it saved on disk.
inline constexpr int kNoReplacementExitStatus = 87;

// `own` for an error of this rank's own (a programming error, a bad file, a refused
// allocation), kEchoExitStatus for an echo of another rank's failure.
inline int exit_status(const std::exception& e, int own = 1) noexcept {
  return dynamic_cast<const detail::EchoedError*>(&e) ? kEchoExitStatus : own;
}
// The same for a stored exception; `own` for a null one or one that is no std::exception.
inline int exit_status(const std::exception_ptr& e, int own = 1) noexcept {
  return detail::is_echo(e) ? kEchoExitStatus : own;
}

}  // namespace fsdp
