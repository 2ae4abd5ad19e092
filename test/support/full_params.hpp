#pragma once
// Full parameters by FQN, as the training tests collect them, and their exact comparison.
#include <cstring>
#include <string>
#include <utility>
#include <vector>

namespace test_support {

using Params = std::vector<std::pair<std::string, std::vector<float>>>;  // FQN -> values

// Same names, same sizes, every element bitwise equal (NaN payloads included).
inline bool bitwise_equal(const Params& a, const Params& b) {
  if (a.size() != b.size()) return false;
  for (std::size_t i = 0; i < a.size(); ++i)
    if (a[i].first != b[i].first || a[i].second.size() != b[i].second.size() ||
        (!a[i].second.empty() &&  // an empty vector's data() may be null: not for memcmp
         std::memcmp(a[i].second.data(), b[i].second.data(), 4 * a[i].second.size()) != 0))
      return false;
  return true;
}

}  // namespace test_support
