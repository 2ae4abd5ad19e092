#pragma once
// One rule for every timeout the library takes: positive and at most a day. Zero, a
// negative value or an absurd one is a bug in the caller's units, not a wish to wait
// forever; the message names the setting and the value in ms.
#include <chrono>
#include <utility>

#include "fsdp/core/error.hpp"

namespace fsdp::detail {

// `what` names the setting, e.g. ("TcpComm on rank ", 3, ": timeout").
template <class... What>
void check_timeout(std::chrono::milliseconds t, What&&... what) {
  if (t.count() <= 0 || t > std::chrono::hours(24))
    fail(std::forward<What>(what)..., " must be in (0 ms, 24 h], got ", t.count(), " ms");
}

}  // namespace fsdp::detail
