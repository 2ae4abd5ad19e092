#pragma once
// Environment variables set (or unset) for a scope and put back as they were when it ends,
// also when a check throws: later cases, and the other test files of a binary
// (fsdp_test_group), share the process and must not see them.
#include <cstdlib>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace test_support {

class ScopedEnv {
 public:
  ScopedEnv() = default;
  ScopedEnv(const std::string& name, std::optional<std::string> value) { set(name, std::move(value)); }
  ScopedEnv(const ScopedEnv&) = delete;
  ScopedEnv& operator=(const ScopedEnv&) = delete;
  ~ScopedEnv() {
    for (auto it = saved_.rbegin(); it != saved_.rend(); ++it) apply(it->first, it->second);
  }

  // Sets `name` to `value` (nullopt: unsets it); its value before the scope's first change
  // of it is what the destructor restores.
  ScopedEnv& set(const std::string& name, std::optional<std::string> value) {
    bool saved = false;
    for (const auto& entry : saved_) saved = saved || entry.first == name;
    if (!saved) {
      const char* before = std::getenv(name.c_str());
      saved_.emplace_back(name, before ? std::optional<std::string>(before) : std::nullopt);
    }
    apply(name, value);
    return *this;
  }

 private:
  static void apply(const std::string& name, const std::optional<std::string>& value) {
    if (value) ::setenv(name.c_str(), value->c_str(), 1);
    else ::unsetenv(name.c_str());
  }

  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

}  // namespace test_support
