#pragma once
// fsdp::Error: the one exception type the library throws. Messages name what is wrong
// and where (unit, FQN, rank) so that a failure on rank 5 of 8 can be read in isolation.
// Its kind() says what sort of failure it is, so that a caller can tell a lost peer (which
// a fault-tolerant loop may survive) from a bug in its own code (which it must not retry):
// see docs/reliability.md, "Error kinds".
#include <cstddef>
#include <cstdint>
#include <exception>
#include <new>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>

namespace fsdp {

enum class ErrorKind : std::uint8_t {
  misuse,         // the caller's bug: a call in the wrong state, a bad argument, options that conflict
  mismatch,       // the ranks disagree: units or collectives in different orders, settings that differ
  timeout,        // a wait ran past its deadline
  peer_lost,      // a peer closed its connection, died or was aborted
  io,             // a file or socket operation failed
  corrupt,        // data that fails its checksum or its format (checkpoint file, index, frame)
  out_of_memory,  // an allocation the device or host refused
};

inline constexpr std::string_view to_string(ErrorKind k) {
  switch (k) {
    case ErrorKind::misuse: return "misuse";
    case ErrorKind::mismatch: return "mismatch";
    case ErrorKind::timeout: return "timeout";
    case ErrorKind::peer_lost: return "peer_lost";
    case ErrorKind::io: return "io";
    case ErrorKind::corrupt: return "corrupt";
    case ErrorKind::out_of_memory: return "out_of_memory";
  }
  return "unknown";  // not an ErrorKind (a value cast from a wider integer)
}

inline std::ostream& operator<<(std::ostream& os, ErrorKind k) { return os << to_string(k); }

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : Error(ErrorKind::misuse, what) {}
  Error(ErrorKind kind, const std::string& what) : std::runtime_error("fsdp: " + what), kind_(kind) {}

  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

// The kind of a caught exception, for a site that re-raises it as an fsdp::Error of its own
// (another message, another rank, another thread): an fsdp::Error's kind, out_of_memory for
// std::bad_alloc, io for a std::system_error (std::filesystem's errors too), else `otherwise`.
inline ErrorKind kind_of(const std::exception& e, ErrorKind otherwise = ErrorKind::misuse) {
  if (const auto* fe = dynamic_cast<const Error*>(&e)) return fe->kind();
  if (dynamic_cast<const std::bad_alloc*>(&e)) return ErrorKind::out_of_memory;
  if (dynamic_cast<const std::system_error*>(&e)) return ErrorKind::io;
  return otherwise;
}
// The same for a stored exception; `otherwise` also for one that is no std::exception.
inline ErrorKind kind_of(const std::exception_ptr& e, ErrorKind otherwise = ErrorKind::misuse) {
  try {
    if (e) std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return kind_of(x, otherwise);
  } catch (...) {
  }
  return otherwise;
}

namespace detail {
// Builds a message from streamable parts: fail("unit '", fqn, "' on rank ", r, ...).
// fail_as only decays char arrays (string literals: each length is a type of its own) to
// const char*, so the body, throw_built, compiles once per list of part types, not once
// per call.
template <class T>
const T& message_part(const T& part) {
  return part;
}
template <std::size_t N>
const char* message_part(const char (&part)[N]) {
  return part;
}
template <class... Parts>
[[noreturn]] void throw_built(ErrorKind kind, const Parts&... parts) {
  std::ostringstream os;
  (os << ... << parts);
  throw Error(kind, os.str());
}
template <class... Parts>
[[noreturn]] void fail_as(ErrorKind kind, const Parts&... parts) {
  throw_built(kind, message_part(parts)...);
}

// fail_as(ErrorKind::misuse, ...): the caller's bug.
template <class... Parts>
[[noreturn]] void fail(const Parts&... parts) {
  throw_built(ErrorKind::misuse, message_part(parts)...);
}
}  // namespace detail

}  // namespace fsdp
