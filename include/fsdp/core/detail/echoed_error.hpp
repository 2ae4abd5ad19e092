#pragma once
// detail::EchoedError: the error a rank throws because another rank failed, not because
// of anything of its own (a collective aborted by a peer, a checkpoint step that another
// rank could not do). It is an fsdp::Error like any other; its kind is the one its thrower
// chose: ThreadComm's echoes carry the abort's kind (peer_lost when a rank failed, since
// the others lost it; timeout or mismatch when that is what ended the collective), the
// checkpoint steps' (checkpoint_collective.hpp) the failed rank's own kind. Its message
// names that rank and quotes it; the type only marks it as an echo, so that
// whoever collects several ranks' errors (ThreadGroup::run) reports the root cause first,
// whichever rank happened to throw first.
#include <exception>
#include <sstream>
#include <string>
#include <utility>

#include "fsdp/core/error.hpp"

namespace fsdp::detail {

class EchoedError : public Error {
 public:
  EchoedError(ErrorKind kind, int failed_rank, const std::string& what) : Error(kind, what), failed_rank_(failed_rank) {}
  // The rank whose failure this error reports (-1: not known).
  int failed_rank() const noexcept { return failed_rank_; }

 private:
  int failed_rank_;
};

// fail_as for an echo of rank `failed_rank`'s failure.
template <class... Parts>
[[noreturn]] void fail_echo(ErrorKind kind, int failed_rank, Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  throw EchoedError(kind, failed_rank, os.str());
}

// fail_echo when `failed_rank` is a rank (>= 0), else fail_as: for a backend that learns
// only at run time whether its failure came from a peer.
template <class... Parts>
[[noreturn]] void fail_echo_if(int failed_rank, ErrorKind kind, const Parts&... parts) {
  if (failed_rank >= 0) fail_echo(kind, failed_rank, parts...);
  fail_as(kind, parts...);
}

// Whether `e` holds an echo of another rank's failure (false for null).
inline bool is_echo(const std::exception_ptr& e) noexcept {
  try {
    if (e) std::rethrow_exception(e);
  } catch (const EchoedError&) {
    return true;
  } catch (...) {
  }
  return false;
}

}  // namespace fsdp::detail
