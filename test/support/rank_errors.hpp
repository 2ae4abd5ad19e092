#pragma once
// Runs a function on every rank of a ThreadGroup with a short collective timeout and
// returns each rank's fsdp::Error message ("" if it threw none). Returning at all is the
// no-hang check; any other exception escaping a rank fails the test.
#include <doctest/doctest.h>

#include <chrono>
#include <string>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "test/support/errors.hpp"

namespace test_support {

template <class Fn>
std::vector<std::string> errors_per_rank(int world, Fn fn, std::chrono::milliseconds timeout = std::chrono::milliseconds(2000)) {
  std::vector<std::string> msgs(world);
  try {
    fsdp::ThreadGroup(world, fsdp::ThreadGroupOptions{timeout}).run([&](fsdp::ThreadComm& comm) {
      try {
        fn(comm);
      } catch (const fsdp::Error& e) {
        msgs[comm.rank()] = e.what();
      }
    });
  } catch (const std::exception& e) {
    FAIL("a rank escaped with a non-fsdp error: ", e.what());
  }
  return msgs;
}

}  // namespace test_support
