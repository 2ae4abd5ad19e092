#pragma once
// fsdp::Error: the one exception type the library throws. Messages name what is wrong
// and where (unit, FQN, rank) so that a failure on rank 5 of 8 can be read in isolation.
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace fsdp {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error("fsdp: " + what) {}
};

namespace detail {
// Builds a message from streamable parts: fail("unit '", fqn, "' on rank ", r, ...).
template <class... Parts>
[[noreturn]] void fail(Parts&&... parts) {
  std::ostringstream os;
  (os << ... << std::forward<Parts>(parts));
  throw Error(os.str());
}
}  // namespace detail

}  // namespace fsdp
