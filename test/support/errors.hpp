#pragma once
// Reading errors in tests: the fsdp::Error message a call throws, and substring checks.
#include <optional>
#include <string>

#include <fsdp/core/detail/echoed_error.hpp>
#include <fsdp/core/error.hpp>

namespace test_support {

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// The fsdp::Error message `fn` throws, "" if it throws none.
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const fsdp::Error& e) {
    return e.what();
  }
  return "";
}

// The fsdp::Error `fn` throws, as its message, its kind and, for an echo of another rank's
// failure (detail::EchoedError), that rank; "", nullopt and -1 if it throws none.
struct Thrown {
  std::string message;
  std::optional<fsdp::ErrorKind> kind;
  int echo_of = -1;  // -1: not an echo (or no error)
};
template <class Fn>
Thrown thrown_by(Fn&& fn) {
  try {
    fn();
  } catch (const fsdp::detail::EchoedError& e) {
    return {e.what(), e.kind(), e.failed_rank()};
  } catch (const fsdp::Error& e) {
    return {e.what(), e.kind()};
  }
  return {};
}

}  // namespace test_support
