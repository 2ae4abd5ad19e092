#pragma once
// The agreement step every checkpoint collective shares: each rank runs its part, catching
// its own error; then all ranks agree, so a rank that failed makes every rank fail (with
// its own message where it has one) and nothing waits on a rank that gave up.
#include <exception>
#include <optional>
#include <string>
#include <string_view>

#include "fsdp/checkpoint/atomic_file.hpp"
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

// After ranks agreed that some failed (every rank calls it, the failed ones with their
// error's kind, the others with nullopt): the highest kind among the failed ranks, in
// ErrorKind's order, by three more agreements (one per bit). So a rank that did not fail
// throws the kind of the failure that stopped it (a damaged file is corrupt on every rank).
inline ErrorKind agreed_kind(const Unit& unit, std::optional<ErrorKind> mine) {
  const int code = mine ? static_cast<int>(*mine) : -1;
  int most = 0;  // the highest code some rank has, found bit by bit from the top
  for (int bit = 4; bit > 0; bit >>= 1)
    if (!fsdp::detail::internals(unit).all_ranks_agree(code < (most | bit))) most |= bit;
  return most <= static_cast<int>(ErrorKind::out_of_memory) ? static_cast<ErrorKind>(most) : ErrorKind::misuse;
}

// Runs `part` on this rank, then agrees with every rank; throws on every rank if any failed.
// `outcome` ends both messages (e.g. "; nothing was loaded"). Whatever `part` throws, the
// agreement runs (else the other ranks would wait in it until a timeout); an exception that
// is no std::exception is rethrown as it is after it, for a caller that catches its type.
// The failed rank's error keeps its kind (an fsdp::Error's; io for a std::system_error,
// out_of_memory for std::bad_alloc); the others throw the kind agreed_kind finds.
template <class F>
void run_agreed(ShardedModel& model, const std::string& what, F&& part, const char* outcome = "") {
  if (model.size() == 0) fail(what, ": the model has no units (no communicator to agree through)");
  std::string error;
  std::optional<ErrorKind> kind;  // of this rank's failure
  std::exception_ptr foreign;  // not a std::exception: no message to quote
  try {
    part();
  } catch (const std::exception& e) {
    error = checkpoint::detail::message_of(e);  // quoted below under this rank's own "fsdp: "
    if (error.empty()) error = "unknown error";
    kind = kind_of(e);
  } catch (...) {
    foreign = std::current_exception();
    error = "an exception that is not a std::exception";
    kind = ErrorKind::misuse;
  }
  if (fsdp::detail::internals(model[0]).all_ranks_agree(error.empty())) return;
  const ErrorKind agreed = agreed_kind(model[0], kind);
  if (foreign) std::rethrow_exception(foreign);
  // The part's error often starts with what `what` ends with (the checkpoint it names): say it once.
  for (std::size_t space = what.find(' '); space != std::string::npos; space = what.find(' ', space + 1)) {
    const std::string_view subject = std::string_view(what).substr(space + 1);
    if (error.size() > subject.size() + 2 && error.compare(0, subject.size(), subject) == 0 &&
        error.compare(subject.size(), 2, ": ") == 0) {
      error.erase(0, subject.size() + 2);
      break;
    }
  }
  if (!error.empty()) fail_as(*kind, what, " on rank ", fsdp::detail::internals(model[0]).rank(), ": ", error, outcome);
  fail_as(agreed, what, " on rank ", fsdp::detail::internals(model[0]).rank(), ": another rank failed (its error says why)", outcome);
}

}  // namespace fsdp::detail
