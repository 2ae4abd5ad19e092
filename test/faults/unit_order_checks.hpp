#pragma once
// What the order-check tests assert after ranks ran units in different orders
// (unit_order_driver.hpp), on any backend: each rank's unit named in every rank's error,
// and nothing of the swapped units shown to the engine.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "test/faults/unit_order_driver.hpp"
#include "test/support/errors.hpp"

namespace test_support {

// Each rank's error and what its hooks had shown the engine when it came.
struct OrderOutcome {
  std::vector<std::string> errors;
  std::vector<std::vector<std::string>> logs;
};

// What a collective-mismatch message says rank `rank` called: from "rank <rank> called"
// to its " as collective #" ("" if it names no call of that rank), wherever the message
// lists it (by rank in detail::mismatch_message; TcpComm's fallback, when the store cannot
// be asked, names the reporting rank first).
inline std::string call_of(const std::string& error, int rank) {
  const std::string from = "rank " + std::to_string(rank) + " called ";
  const auto begin = error.find(from);
  if (begin == std::string::npos) return "";
  const auto end = error.find(" as collective #", begin);
  return error.substr(begin, end == std::string::npos ? std::string::npos : end - begin);
}

// Rank 0 ran `unit0` where rank 1 ran `unit1`, both named on every rank.
inline void check_named(const OrderOutcome& o, const std::string& phase, const std::string& unit0 = "blocks.0",
                        const std::string& unit1 = "blocks.1") {
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CAPTURE(o.errors[r]);
    CHECK(contains(o.errors[r], "collective mismatch"));
    CHECK(contains(call_of(o.errors[r], 0), "of unit '" + unit0 + "' (" + phase));
    CHECK(contains(call_of(o.errors[r], 1), "of unit '" + unit1 + "' (" + phase));
  }
}

// Nothing of the swapped units was shown to the engine on `ranks` (`hooks`: which hooks'
// return count), and no rank finished its backward.
inline void check_not_shown(const OrderOutcome& o, const std::vector<std::string>& hooks,
                            const std::vector<int>& ranks = {0, 1}) {
  for (int r : ranks)
    for (const auto& h : hooks)
      for (const char* unit : {"blocks.0", "blocks.1"}) {
        CAPTURE(r);
        CHECK(std::find(o.logs[r].begin(), o.logs[r].end(), h + " " + unit) == o.logs[r].end());
      }
  for (const auto& log : o.logs) CHECK(std::find(log.begin(), log.end(), "finish_backward") == log.end());
}

}  // namespace test_support
