// Visitors that hand the library tensor objects that do not last (fsdp/detail/
// param_collection.hpp, check_visits_agree): the library keeps a tensor's address and
// rebinds it at every gather, so a temporary would be rebound in vain while the engine
// computes with its real tensor. Found at setup, before anything is copied or taken.
#include <doctest/doctest.h>

#include <deque>
#include <memory>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"
#include <fsdp/unit/sharded.hpp>  // fsdp::Sharded: units built by hand

namespace faults_visitor_test {

namespace {

using test_support::contains;
using test_support::error_of;

// Builds a fresh handle on the stack for each parameter, viewing the module's storage: one
// stack slot holds w, then b, so two parameters arrive in one tensor object.
struct StackHandles {
  std::vector<float> w = std::vector<float>(6, 1.0f), b = std::vector<float>(2, 2.0f);
  template <class F>
  void visit_parameters(F&& f) {
    for (auto* storage : {&w, &b}) {
      fsdp::HostTensor t({static_cast<std::int64_t>(storage->size())}), g({static_cast<std::int64_t>(storage->size())});
      t.rebind(storage->data());
      f(storage == &w ? "w" : "b", t, g);
    }
  }
};

// Builds fresh handles on the heap at every visit: the same names come as other objects.
struct HeapHandles {
  std::vector<float> w = std::vector<float>(6, 1.0f);
  std::deque<std::unique_ptr<fsdp::HostTensor>> handles;  // kept alive, but new ones each visit
  template <class F>
  void visit_parameters(F&& f) {
    auto& t = *handles.emplace_back(std::make_unique<fsdp::HostTensor>(std::vector<std::int64_t>{6}));
    auto& g = *handles.emplace_back(std::make_unique<fsdp::HostTensor>(std::vector<std::int64_t>{6}));
    t.rebind(w.data());
    f("w", t, g);
  }
};

// The same, for a buffer.
struct HeapBuffer {
  fsdp::HostTensor w{{4}}, g{{4}};
  std::deque<std::unique_ptr<fsdp::HostTensor>> handles;
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
  template <class F>
  void visit_buffers(F&& f) {
    f("running_mean", *handles.emplace_back(std::make_unique<fsdp::HostTensor>(std::vector<std::int64_t>{3})));
  }
};

// A well-behaved module with a tie through one handle under two names: accepted.
struct TiedByHandle {
  fsdp::HostTensor w{{4}}, g{{4}};
  template <class F> void visit_parameters(F&& f) { f("embed", w, g); f("head", w, g); }
};

template <class M>
std::string shard_error(M& m) {
  return error_of([&] {
    fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
      fsdp::HostDevice device;
      fsdp::Sharded<M> unit(m, comm, device);
    });
  });
}

}  // namespace

TEST_CASE("a visitor that builds handles on the stack: two parameters in one tensor object") {
  StackHandles m;
  const auto msg = shard_error(m);
  CAPTURE(msg);
  // Usually one stack slot holds both; where the compiler gives each its own slot (as under
  // AddressSanitizer), the second visit finds other objects.
  CHECK((contains(msg, "unit '<root>' on rank 0: the module's visitor handed over parameter 'b' in the same tensor "
                       "object as 'w' but with other storage") ||
         contains(msg, "unit '<root>' on rank 0: the module's visitor handed over parameter 'w' as another tensor object")));
  CHECK(contains(msg, "not temporaries"));
  CHECK(m.w[0] == 1.0f);  // nothing was copied or taken
}

TEST_CASE("a visitor that builds handles on the heap at every visit: another object on the second visit") {
  HeapHandles m;
  CHECK(contains(shard_error(m), "handed over parameter 'w' as another tensor object on a second visit"));
  HeapBuffer mb;
  CHECK(contains(shard_error(mb), "handed over buffer 'running_mean' as another tensor object on a second visit"));
}

TEST_CASE("lasting handles, and a tie through one handle, are accepted") {
  TiedByHandle m;
  CHECK(shard_error(m).empty());
}

namespace {

// Two leaves under a root: the root is one unit with both parameters.
struct Leaf {
  fsdp::HostTensor w{{3}}, g{{3}};
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
};
struct Root {
  Leaf a, b;
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) { f("a", a); f("b", b); }
};

}  // namespace

TEST_CASE("a tensor whose storage the engine replaced is an error at the next hook, not lost values") {
  const auto msgs = test_support::errors_per_rank(2, [](fsdp::ThreadComm& comm) {
    Root m;
    fsdp::HostDevice device;
    fsdp::Sharded<Root> unit(m, comm, device);
    unit.pre_forward();
    unit.post_forward();
    std::vector<float> replacement(3, 7.0f);
    m.b.w.rebind(replacement.data());  // the engine "loads" values by swapping the storage
    unit.pre_forward();
  });
  for (int r = 0; r < 2; ++r)
    CHECK(contains(msgs[r], "unit '<root>' on rank " + std::to_string(r) + ": at pre_forward, parameter 'b.w' no longer "
                            "views the storage fsdp bound it to"));
}

TEST_CASE("inside a summon with writeback: the edits in replaced storage are refused, nothing is written back") {
  std::vector<float> after(3);
  const auto msgs = test_support::errors_per_rank(1, [&](fsdp::ThreadComm& comm) {
    Root m;
    m.a.w.as<float>()[0] = 1.5f;
    fsdp::HostDevice device;
    fsdp::Sharded<Root> unit(m, comm, device);
    std::vector<float> replacement(3, 7.0f);
    try {
      auto scope = unit.summon_full_params(true);
      m.a.w.rebind(replacement.data());
    } catch (const fsdp::Error&) {
      CHECK(unit.state() == fsdp::TrainingState::IDLE);
      auto scope = unit.summon_full_params(false);
      std::copy_n(m.a.w.as<float>(), 3, after.begin());
      throw;
    }
  });
  CHECK(contains(msgs[0], "at the end of summon_full_params(writeback), parameter 'a.w' no longer views the storage"));
  CHECK(after[0] == 1.5f);  // the old value: nothing was written back
  CHECK(after[1] == 0.0f);
}

}  // namespace faults_visitor_test
