#pragma once
// The agreement step every checkpoint collective shares: each rank runs its part, catching
// its own error; then all ranks agree, so a rank that failed makes every rank fail and
// nothing waits on a rank that gave up. The cause reaches every rank: a rank that failed
// throws its own error, and every other rank's error names the lowest rank that failed,
// quotes its message and keeps its kind (a missing directory on rank 0 reads as such on
// rank 7's console, not as "some rank failed"). Those are echoes (detail::EchoedError), so
// ThreadGroup::run reports the failed rank's own error, whichever rank threw first.
#include <cstdint>
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include "fsdp/checkpoint/atomic_file.hpp"
#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/detail/root_cause.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/model/sharded_model.hpp"

namespace fsdp::detail {

// Runs f; what it throws, for a later run_agreed (or another thread) to rethrow.
template <class F>
std::exception_ptr captured(F&& f) noexcept {
  try {
    f();
    return nullptr;
  } catch (...) {
    return std::current_exception();
  }
}

// What the lowest rank that failed says (fsdp/core/detail/root_cause.hpp), agreed through
// the model's first unit.
inline RootCause agreed_root_cause(const Unit& unit, const std::string& message, std::optional<ErrorKind> kind) {
  const auto& in = fsdp::detail::internals(unit);
  return agreed_root_cause(in.world_size(), in.rank(), [&](std::int64_t v) { return in.max_over_ranks(v); }, message,
                           kind);
}

// Runs `part` on this rank, then agrees with every rank; throws on every rank if any failed.
// `outcome` ends both messages (e.g. "; nothing was loaded"). Whatever `part` throws, the
// agreement runs (else the other ranks would wait in it until a timeout); an exception that
// is no std::exception is rethrown as it is after it, for a caller that catches its type.
// A rank that failed throws its own error with its kind (an fsdp::Error's; io for a
// std::system_error, out_of_memory for std::bad_alloc); the others throw an EchoedError
// "... on rank R: another rank failed; rank F says: <its message>" with rank F's kind, F
// being the lowest rank that failed.
template <class F>
void run_agreed(ShardedModel& model, const std::string& what, F&& part, const char* outcome = "") {
  if (model.size() == 0) fail(what, ": the model has no units (no communicator to agree through)");
  const std::exception_ptr failure = captured(std::forward<F>(part));
  OwnFailure own = own_failure(failure);  // its message is quoted below under this rank's own "fsdp: "
  std::string& error = own.message;
  if (fsdp::detail::internals(model[0]).all_ranks_agree(!failure)) return;
  // The part's error often starts with what `what` ends with (the checkpoint it names): say it once.
  for (std::size_t space = what.find(' '); space != std::string::npos; space = what.find(' ', space + 1)) {
    const std::string_view subject = std::string_view(what).substr(space + 1);
    if (error.size() > subject.size() + 2 && error.compare(0, subject.size(), subject) == 0 &&
        error.compare(subject.size(), 2, ": ") == 0) {
      error.erase(0, subject.size() + 2);
      break;
    }
  }
  const RootCause root = agreed_root_cause(model[0], error, own.kind);
  if (own.foreign) std::rethrow_exception(failure);
  const int rank = fsdp::detail::internals(model[0]).rank();
  if (failure) fail_as(*own.kind, what, " on rank ", rank, ": ", error, outcome);
  fail_echo(root.kind, root.rank, what, " on rank ", rank, ": another rank failed; rank ", root.rank, " says: ",
            root.message, outcome);
}

}  // namespace fsdp::detail
