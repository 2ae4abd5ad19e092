#pragma once
// JSON helpers for the checkpoint readers: a first pass that checks untrusted JSON text
// before nlohmann builds a tree from it, integer fields read with their range checked, and
// short quotes of values for error messages.
#include <cstddef>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace fsdp::checkpoint::detail {

// A JSON value for a message: at most 3 levels and about 80 characters, so a corrupt
// header can neither flood the message nor (nlohmann's dump recurses) the stack.
inline void append_json_text(std::string& out, const nlohmann::json& j, int depth) {
  if (!j.is_structured()) {
    out += j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    return;
  }
  out += j.is_array() ? '[' : '{';
  bool first = true;
  for (auto it = j.begin(); it != j.end(); ++it) {
    if (!first) out += ',';
    first = false;
    if (depth == 0 || out.size() > 80) {
      out += "...";
      break;
    }
    if (j.is_object()) out += nlohmann::json(it.key()).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + ':';
    append_json_text(out, *it, depth - 1);
  }
  out += j.is_array() ? ']' : '}';
}

inline std::string json_text(const nlohmann::json& j) {
  std::string s;
  append_json_text(s, j, 3);
  return s.size() > 80 ? s.substr(0, 77) + "..." : s;
}

// A JSON integer in [0, max] into `out`; false for anything else (negative, fractional,
// not a number). Parsed text gives unsigned values, JSON built in code signed ones.
inline bool json_to_u64(const nlohmann::json& j, std::uint64_t max, std::uint64_t& out) {
  if (j.is_number_unsigned()) out = j.get<std::uint64_t>();
  else if (j.is_number_integer() && j.get<std::int64_t>() >= 0) out = static_cast<std::uint64_t>(j.get<std::int64_t>());
  else return false;
  return out <= max;
}

// Throws unless `s` can go into JSON (valid UTF-8).
inline std::string json_string(const std::string& s) { return nlohmann::json(s).dump(); }

// Checks the JSON before a tree is built: its syntax; its depth (a valid header is 3
// deep; 50 million nested arrays would be a tree of gigabytes); duplicate keys, which
// nlohmann resolves silently by keeping the last one (a reader keeping the first would
// see another tensor). Linear, unlike nlohmann's parse callback on large objects.
struct JsonChecker : nlohmann::json_sax<nlohmann::json> {
  static constexpr std::size_t max_depth = 16;
  std::vector<std::set<std::string>> keys;  // of each open object
  std::size_t depth = 0;
  bool too_deep = false;
  std::string duplicate;
  std::string error;
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    keys.emplace_back();
    return enter();
  }
  bool key(string_t& k) override {
    if (!keys.back().insert(k).second && duplicate.empty()) duplicate = k;
    return true;
  }
  bool end_object() override {
    keys.pop_back();
    --depth;
    return true;
  }
  bool start_array(std::size_t) override { return enter(); }
  bool end_array() override {
    --depth;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::json::exception& e) override {
    error = e.what();  // nlohmann quotes the offending token, which may be huge
    if (error.size() > 200) error = error.substr(0, 197) + "...";
    return false;
  }
  bool enter() {
    too_deep = ++depth > max_depth;
    return !too_deep;
  }
};

}  // namespace fsdp::checkpoint::detail
