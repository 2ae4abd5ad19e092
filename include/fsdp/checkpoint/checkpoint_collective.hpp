#pragma once
// The agreement step every checkpoint collective shares: each rank runs its part, catching
// its own error; then all ranks agree, so a rank that failed makes every rank fail and
// nothing waits on a rank that gave up. The cause reaches every rank: a rank that failed
// throws its own error, and every other rank's error names the lowest rank that failed,
// quotes its message and keeps its kind (a missing directory on rank 0 reads as such on
// rank 7's console, not as "some rank failed"). Those are echoes (detail::EchoedError), so
// ThreadGroup::run reports the failed rank's own error, whichever rank threw first.
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <optional>
#include <string>
#include <string_view>

#include "fsdp/checkpoint/atomic_file.hpp"
#include "fsdp/core/detail/echoed_error.hpp"
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

// What the lowest rank that failed says, once ranks agreed that some failed: every rank
// calls it, a failed one with its message and kind, the others with nullopt. One all-reduce
// finds that rank, its kind and its message's length; then one per 8 bytes of the message
// (at most kMaxQuoted bytes: 64 more, on the failure path only) brings the text to all.
struct RootCause {
  int rank = -1;
  ErrorKind kind = ErrorKind::misuse;
  std::string message;
};
inline constexpr std::size_t kMaxQuoted = 512;

inline RootCause agreed_root_cause(const Unit& unit, const std::string& message, std::optional<ErrorKind> kind) {
  const auto& in = fsdp::detail::internals(unit);
  const std::int64_t world = in.world_size(), rank = in.rank();
  const std::size_t len = std::min(message.size(), kMaxQuoted);
  const bool cut = message.size() > kMaxQuoted;
  // The max over ranks of (world - rank, kind, cut, length): the lowest failed rank's. Ranks
  // that did not fail offer 0, below any failed rank's key (world - rank >= 1). Bits: 15 for
  // the length (kMaxQuoted < 2^15), 1 for cut, 8 for the kind, and above them world - rank,
  // at most 2^31 (an int): 55 bits, no overflow for any world size.
  static_assert(kMaxQuoted < (std::size_t{1} << 15));
  const std::int64_t key = kind ? ((world - rank) << 24) | (std::int64_t{static_cast<std::uint8_t>(*kind)} << 16) |
                                      (std::int64_t{cut} << 15) | static_cast<std::int64_t>(len)
                                : 0;
  const std::int64_t most = in.max_over_ranks(key);
  RootCause root;
  if (most <= 0) return root;  // no rank failed: cannot happen after a failed agreement
  root.rank = static_cast<int>(world - (most >> 24));
  const int kind_code = static_cast<int>((most >> 16) & 0xff);
  root.kind = kind_code <= static_cast<int>(ErrorKind::out_of_memory) ? static_cast<ErrorKind>(kind_code) : ErrorKind::misuse;
  const bool root_cut = (most >> 15) & 1;
  const std::size_t quoted = static_cast<std::size_t>(most & 0x7fff);
  root.message.resize(quoted);
  for (std::size_t at = 0; at < quoted; at += 8) {  // quoted <= kMaxQuoted: kMaxQuoted / 8 rounds at most
    std::int64_t word = std::numeric_limits<std::int64_t>::min();      // below anything the root rank offers
    if (rank == root.rank) {
      std::uint64_t bits = 0;
      std::memcpy(&bits, message.data() + at, std::min<std::size_t>(8, quoted - at));
      std::memcpy(&word, &bits, sizeof word);
    }
    const std::int64_t got = in.max_over_ranks(word);
    std::memcpy(root.message.data() + at, &got, std::min<std::size_t>(8, quoted - at));
  }
  if (root_cut) root.message += " [...]";  // the rest of a longer message was left out
  return root;
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
  // The part's error often starts with what `what` ends with (the checkpoint it names): say it once.
  for (std::size_t space = what.find(' '); space != std::string::npos; space = what.find(' ', space + 1)) {
    const std::string_view subject = std::string_view(what).substr(space + 1);
    if (error.size() > subject.size() + 2 && error.compare(0, subject.size(), subject) == 0 &&
        error.compare(subject.size(), 2, ": ") == 0) {
      error.erase(0, subject.size() + 2);
      break;
    }
  }
  const RootCause root = agreed_root_cause(model[0], error, kind);
  if (foreign) std::rethrow_exception(foreign);
  const int rank = fsdp::detail::internals(model[0]).rank();
  if (!error.empty()) fail_as(*kind, what, " on rank ", rank, ": ", error, outcome);
  fail_echo(root.kind, root.rank, what, " on rank ", rank, ": another rank failed; rank ", root.rank, " says: ",
            root.message, outcome);
}

}  // namespace fsdp::detail
