#pragma once
// Reading errors in tests: the fsdp::Error message a call throws, and substring checks.
#include <optional>
#include <string>

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

// The fsdp::Error `fn` throws, as its message and its kind; "" and nullopt if it throws none.
struct Thrown {
  std::string message;
  std::optional<fsdp::ErrorKind> kind;
};
template <class Fn>
Thrown thrown_by(Fn&& fn) {
  try {
    fn();
  } catch (const fsdp::Error& e) {
    return {e.what(), e.kind()};
  }
  return {};
}

}  // namespace test_support
