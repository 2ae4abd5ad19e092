#pragma once
// The root cause of a collective step that failed on some rank, brought to every rank.
// After ranks agreed that one of them failed (an all-reduce of "ok"), the others know only
// that: agreed_root_cause finds the lowest rank that failed and brings its error's kind and
// message to all, so that every rank's error names that rank and quotes it (a missing
// directory on rank 0 reads as such on rank 7's console, not as "some rank failed"). Used
// by the unit's take-over (fsdp/unit/detail/take_over.hpp) and by every checkpoint
// collective (fsdp/checkpoint/checkpoint_collective.hpp). Failure paths only: a step that
// succeeded on every rank pays its one agreement and nothing of this. Also how abort_step's
// error keeps the exception that left the step (naming_what_left_the_step).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <exception>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

// An exception's message without fsdp::Error's "fsdp: " prefix, for quoting it under
// another error's own.
inline std::string_view message_of(const std::exception& e) {
  std::string_view m = e.what();
  if (m.substr(0, 6) == "fsdp: ") m.remove_prefix(6);
  return m;
}

// This rank's failure as agreed_root_cause takes it: the message (empty: none) and kind of
// what `failure` holds; an exception that is no std::exception has no message to quote.
struct OwnFailure {
  std::string message;
  std::optional<ErrorKind> kind;
  bool foreign = false;  // no std::exception: a caller rethrows it as it is
};
inline OwnFailure own_failure(const std::exception_ptr& failure) {
  OwnFailure out;
  if (!failure) return out;
  try {
    std::rethrow_exception(failure);
  } catch (const std::exception& e) {
    out.message = std::string(message_of(e));
    if (out.message.empty()) out.message = "unknown error";
    out.kind = kind_of(e);
  } catch (...) {
    out.message = "an exception that is not a std::exception";
    out.kind = ErrorKind::misuse;
    out.foreign = true;
  }
  return out;
}

struct RootCause {
  int rank = -1;
  ErrorKind kind = ErrorKind::misuse;
  std::string message;
};
inline constexpr std::size_t kMaxQuoted = 512;

// Runs `agree(why)`, a recovery's agreement (abort_step's). Called inside a catch (the
// engine's, for the exception that left the step), `why` is that exception's message (its
// first kMaxQuoted bytes; else null), for the agreement's tag to carry to a peer still in
// the step (CollectiveTag::note: its mismatch message quotes it). An fsdp::Error that
// `agree` throws quotes it too, unless it does already (a mismatch's list of calls), so
// the rank's first error is not lost behind the recovery's: "...; this rank called
// abort_step after: <its message>". An echo stays an echo of the same rank, a kind the
// same kind; other exceptions pass unchanged. Building the note cannot keep the rank from
// the agreement (its peers would wait for it): without memory for it, `why` is null.
template <class F>
void naming_what_left_the_step(F&& agree) {
  const std::exception_ptr left_by = std::current_exception();
  if (!left_by) return agree(nullptr);
  std::shared_ptr<const std::string> why;
  std::string whole;  // the message uncut
  try {
    whole = own_failure(left_by).message;
    why = std::make_shared<const std::string>(whole.size() > kMaxQuoted ? whole.substr(0, kMaxQuoted) + " [...]" : whole);
  } catch (...) {  // no memory for it: the agreement goes on without a note
    why = nullptr;
  }
  try {
    agree(why);
  } catch (const Error& e) {
    const std::string_view m = message_of(e);
    if (!why || m.find(*why) != std::string_view::npos || m.find(whole) != std::string_view::npos) throw;
    const std::string after = "; this rank called abort_step after: " + *why;
    if (const auto* echo = dynamic_cast<const EchoedError*>(&e)) fail_echo(e.kind(), echo->failed_rank(), message_of(e), after);
    fail_as(e.kind(), message_of(e), after);
  }
}

// Every rank calls it, once ranks agreed that some failed: a failed one with its message
// and kind, the others with nullopt. `max_over_ranks(v)` is the world's all-reduce (max) of
// one int64. One all-reduce finds the lowest failed rank, its kind and its message's
// length; then one per 8 bytes of the message (at most kMaxQuoted bytes: 64 more) brings
// the text to all.
template <class MaxOverRanks>
RootCause agreed_root_cause(std::int64_t world, std::int64_t rank, const MaxOverRanks& max_over_ranks,
                            const std::string& message, std::optional<ErrorKind> kind) {
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
  const std::int64_t most = max_over_ranks(key);
  RootCause root;
  if (most <= 0) return root;  // no rank failed: cannot happen after a failed agreement
  root.rank = static_cast<int>(world - (most >> 24));
  const int kind_code = static_cast<int>((most >> 16) & 0xff);
  root.kind = kind_code <= static_cast<int>(ErrorKind::out_of_memory) ? static_cast<ErrorKind>(kind_code) : ErrorKind::misuse;
  const bool root_cut = (most >> 15) & 1;
  const std::size_t quoted = static_cast<std::size_t>(most & 0x7fff);
  root.message.resize(quoted);
  for (std::size_t at = 0; at < quoted; at += 8) {  // quoted <= kMaxQuoted: kMaxQuoted / 8 rounds at most
    std::int64_t word = std::numeric_limits<std::int64_t>::min();  // below anything the root rank offers
    if (rank == root.rank) {
      std::uint64_t bits = 0;
      std::memcpy(&bits, message.data() + at, std::min<std::size_t>(8, quoted - at));
      std::memcpy(&word, &bits, sizeof word);
    }
    const std::int64_t got = max_over_ranks(word);
    std::memcpy(root.message.data() + at, &got, std::min<std::size_t>(8, quoted - at));
  }
  if (root_cut) root.message += " [...]";  // the rest of a longer message was left out
  return root;
}

}  // namespace fsdp::detail
