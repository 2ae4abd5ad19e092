#pragma once
// The reference engine's unit hooks, failing as an engine whose kernel throws: right after
// the n-th unit hook of the step (counting before/after forward and backward), inside that
// unit's scope, with std::runtime_error("engine kernel failed"). The abort_step cases
// (test/faults/abort_step_test.cpp, test/mpi/mpi_faults_test.cpp) fail one rank's step or
// every rank's with it.
#include <stdexcept>

#include "examples/engine/fsdp_integration.hpp"

namespace test_support {

struct FailingHooks {
  engine::UnitHooks inner;
  int fail_after = -1, calls = 0;  // fail_after < 0: never
  void maybe_fail() {
    if (++calls == fail_after) throw std::runtime_error("engine kernel failed");
  }
  template <class M> void before_forward(const M* m) { inner.before_forward(m), maybe_fail(); }
  template <class M> void after_forward(const M* m) { inner.after_forward(m), maybe_fail(); }
  template <class M> void before_backward(const M* m) { inner.before_backward(m), maybe_fail(); }
  template <class M> void after_backward(const M* m) { inner.after_backward(m), maybe_fail(); }
};

}  // namespace test_support
