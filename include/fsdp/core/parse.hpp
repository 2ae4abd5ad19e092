#pragma once
// Strict parsing of what a user types: flags, environment variables, option values. A value
// is read whole or refused: "2abc" is not 2, "nan" is not a number, "false" is not "on", a
// product of sizes that overflows is not a size. Every refusal is an fsdp::Error
// (ErrorKind::misuse) naming the input (`what`: a flag, a variable, an option) and its text,
// so that a typo stops the job at the door instead of running something else.
#include <cctype>
#include <charconv>
#include <cmath>
#include <concepts>
#include <cstdlib>
#include <limits>
#include <optional>
#include <string>
#include <string_view>
#include <system_error>

#include "fsdp/core/error.hpp"

namespace fsdp::detail {

// An integer in [lo, hi], written in decimal with an optional leading '-' and nothing else
// (no spaces, no '+', no suffix).
template <std::integral T>
T parse_integer(std::string_view text, std::string_view what, T lo = std::numeric_limits<T>::min(),
                T hi = std::numeric_limits<T>::max()) {
  T value{};
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, value);
  if (text.empty() || ec == std::errc::invalid_argument || p != end)
    fail(what, ": '", text, "' is not an integer");
  if (ec == std::errc::result_out_of_range || value < lo || value > hi)
    fail(what, ": ", text, " is out of range; it must be in [", +lo, ", ", +hi, "]");
  return value;
}

// A finite real number in [lo, hi]: "nan", "inf" and anything with trailing text refused.
inline double parse_real(std::string_view text, std::string_view what, double lo = -std::numeric_limits<double>::max(),
                         double hi = std::numeric_limits<double>::max()) {
  // from_chars, not strtod: strtod reads the decimal point of the C locale, so a host
  // program that set a comma-decimal locale would refuse "0.5". from_chars takes no
  // leading spaces, no '+' and (in the general format) no hex; "nan" and "inf" are refused
  // here, and anything left after the number.
  double value = 0.0;
  const char* end = text.data() + text.size();
  const auto [p, ec] = std::from_chars(text.data(), end, value, std::chars_format::general);
  if (text.empty() || ec == std::errc::invalid_argument || p != end ||
      text.find_first_of("xXnNiI") != std::string_view::npos)
    fail(what, ": '", text, "' is not a finite number");
  if (ec == std::errc::result_out_of_range || !std::isfinite(value) || value < lo || value > hi)
    fail(what, ": ", text, " is out of range; it must be in [", lo, ", ", hi, "]");
  return value;
}

// The boolean `text` spells: 1/0, true/false, yes/no, on/off (any letter case); nullopt for
// anything else (for a value that is either a boolean or something else, such as a path).
inline std::optional<bool> as_bool(std::string_view text) {
  std::string lower(text);
  for (char& c : lower) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (lower == "1" || lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "0" || lower == "false" || lower == "no" || lower == "off") return false;
  return std::nullopt;
}

// A boolean as as_bool reads it; anything else refused.
inline bool parse_bool(std::string_view text, std::string_view what) {
  if (const auto b = as_bool(text)) return *b;
  fail(what, ": '", text, "' is not a boolean; write 1/0, true/false, yes/no or on/off");
}

// An environment variable read strictly: nullopt when unset or empty, else parsed whole.
inline std::optional<bool> env_bool(const char* name) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return parse_bool(v, std::string("environment variable ") + name);
}
template <std::integral T>
std::optional<T> env_integer(const char* name, T lo = std::numeric_limits<T>::min(),
                             T hi = std::numeric_limits<T>::max()) {
  const char* v = std::getenv(name);
  if (!v || !*v) return std::nullopt;
  return parse_integer<T>(v, std::string("environment variable ") + name, lo, hi);
}

// a * b for sizes a user gave, refused (naming `what`) when the product overflows T.
template <std::integral T>
T checked_product(T a, T b, std::string_view what) {
  T out{};
  if (__builtin_mul_overflow(a, b, &out))
    fail(what, ": ", +a, " x ", +b, " overflows (the most is ", +std::numeric_limits<T>::max(), ")");
  return out;
}

// a + b for sizes a user gave, refused (naming `what`) when the sum overflows T.
template <std::integral T>
T checked_sum(T a, T b, std::string_view what) {
  T out{};
  if (__builtin_add_overflow(a, b, &out))
    fail(what, ": ", +a, " + ", +b, " overflows (the most is ", +std::numeric_limits<T>::max(), ")");
  return out;
}

}  // namespace fsdp::detail
