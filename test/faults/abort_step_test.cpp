// Recovery after an exception inside a step (ShardedModel::abort_step): an engine error
// inside a unit's forward or backward, or a failed allocation inside a hook, on every rank;
// abort_step frees what the step held and the following steps train exactly the model a
// run without the failed batch trains. Without abort_step the next call says what to call;
// a rank that aborts alone ends in an error on every rank, not a hang.
#include <doctest/doctest.h>

#include <memory>
#include <new>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "fsdp/asio/tcp_comm.hpp"
#include "fsdp/comm/async_communicator.hpp"
#include "fsdp/testing/counting_communicator.hpp"
#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"
#include "test/asio/tcp_world.hpp"
#include "test/faults/failing_hooks.hpp"
#include <fsdp/unit/sharded.hpp>  // fsdp::Sharded: units built by hand

namespace faults_abort_step_test {

namespace {

using test_support::contains;
using Params = std::vector<std::pair<std::string, std::vector<float>>>;

engine::ModelConfig config() {
  engine::ModelConfig c;
  c.blocks = 3;
  return c;
}

// A HostDevice whose allocation number `fail_at` (counted from arm()) throws std::bad_alloc.
struct FailingDevice {
  fsdp::HostDevice host;
  long fail_at = -1, count = 0;
  void arm(long n) { fail_at = n, count = 0; }
  fsdp::DeviceId id() const { return host.id(); }
  void* allocate(std::size_t bytes, fsdp::MemorySpace s) {
    if (fail_at >= 0 && ++count == fail_at) throw std::bad_alloc();
    return host.allocate(bytes, s);
  }
  void deallocate(void* p, std::size_t bytes, fsdp::MemorySpace s) { host.deallocate(p, bytes, s); }
  void copy(void* d, const void* s, std::size_t n) { host.copy(d, s, n); }
  void fill_zero(void* p, std::size_t n) { host.fill_zero(p, n); }
  void scale(void* p, std::size_t n, fsdp::DType t, double f) { host.scale(p, n, t, f); }
  void accumulate(void* d, const void* s, std::size_t n, fsdp::DType t) { host.accumulate(d, s, n, t); }
  void cast(void* d, fsdp::DType to, const void* s, fsdp::DType from, std::size_t n) { host.cast(d, to, s, from, n); }
  void synchronize() {}
  fsdp::MemoryStats stats(fsdp::MemorySpace s) const { return host.stats(s); }
  void reset_peak(fsdp::MemorySpace s) { host.reset_peak(s); }
};

using test_support::FailingHooks;

enum class Fault { none, engine, allocation };

// Steps 0..4 of SGD on 2 ranks; at step `failing` the fault hits every rank at point `at`
// and the step is aborted (with `skip` = true, that step's batch is simply not run).
template <class... Ps>
Params train(int failing, Fault fault, int at, bool skip, std::vector<std::size_t>* live_around = nullptr) {
  const auto c = config();
  std::vector<Params> per_rank(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    FailingDevice device;
    auto sm = fsdp::shard<Ps...>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.05f);
    for (int s = 0; s < 5; ++s) {
      if (s == failing && skip) continue;
      const auto batch = engine::make_batch(c, s, comm.rank(), 1);
      const std::size_t live_before = device.stats(fsdp::MemorySpace::device).live_bytes;
      if (s == failing && fault != Fault::none) {
        bool failed = false;
        try {
          sm.zero_grad();
          FailingHooks hooks{{sm}, fault == Fault::engine ? at : -1};
          if (fault == Fault::allocation) device.arm(at);
          engine::Mat dout;
          engine::mse(model.forward(batch.x, hooks), batch.y, dout);
          model.backward(dout, hooks);
          sm.finish_backward();
        } catch (const std::exception&) {
          failed = true;
        }
        device.arm(-1);
        REQUIRE(failed);  // the fault point lies inside the step
        sm.abort_step();
        for (auto& u : sm) CHECK(u->state() == fsdp::TrainingState::IDLE);
        if (live_around && comm.rank() == 0)
          live_around->assign({live_before, device.stats(fsdp::MemorySpace::device).live_bytes});
        continue;
      }
      engine::sharded_step(model, sm, sgd, std::span<const engine::Batch>(&batch, 1));
    }
    per_rank[comm.rank()] = engine::gather_full_parameters(model, sm);
  });
  CHECK(per_rank[0] == per_rank[1]);
  return per_rank[0];
}

// An engine kernel that throws inside a unit's scope.
struct KernelFailed : std::runtime_error {
  KernelFailed() : std::runtime_error("engine kernel failed") {}
};

// One step driven with RAII scopes, as an engine does (test/support/device_training.hpp):
// the root's scope (if any) around the whole model, each layer unit's inside it, then the
// backward in reverse; no computation (the hooks are what is tested). The unit named `fail`
// (the root: "") throws inside its scope, in forward or in backward (`in_backward`).
void scoped_step(fsdp::ShardedModel& sm, fsdp::Unit* root, const std::vector<fsdp::Unit*>& layers,
                 std::optional<std::string> fail = std::nullopt, bool in_backward = false, bool zero = true) {
  auto maybe_fail = [&](const fsdp::Unit& u, bool backward) {
    if (fail && *fail == u.fqn() && backward == in_backward) throw KernelFailed();
  };
  if (zero) sm.zero_grad();
  {
    fsdp::Unit::ForwardScope r;
    if (root) r = root->forward_scope();
    for (fsdp::Unit* u : layers) {
      auto s = u->forward_scope();
      maybe_fail(*u, false);
    }
    if (root) maybe_fail(*root, false);
  }
  {
    fsdp::Unit::BackwardScope r;
    if (root) r = root->backward_scope();
    if (root) maybe_fail(*root, true);
    for (auto it = layers.rbegin(); it != layers.rend(); ++it) {
      auto s = (*it)->backward_scope();
      maybe_fail(**it, true);
    }
  }
  sm.finish_backward();
}

// The model's 3 blocks as units of `sm` with policies Ps, driven by hand (no root unit).
template <class... Ps, class Comm>
std::vector<fsdp::Unit*> block_units(fsdp::ShardedModel& sm, engine::Model& model, Comm& comm,
                                     fsdp::HostDevice& device) {
  std::vector<fsdp::Unit*> units;
  for (std::size_t i = 0; i < 3; ++i)
    units.push_back(&sm.emplace<fsdp::Sharded<engine::Block, Ps...>>(model.blocks[i], comm, device,
                                                                      "blocks." + std::to_string(i)));
  return units;
}

}  // namespace

TEST_CASE_TEMPLATE("an engine error inside a unit's forward or backward on every rank: abort_step, then training as if "
                   "the batch had been skipped", Strategy, fsdp::FullShard, fsdp::ShardGradOp) {
  // 5 units (root, 3 blocks, gain): 10 forward hook calls, then 10 backward ones.
  for (int failing : {0, 2}) {  // in the first iteration (the order is being recorded), and later
    const Params skipped = train<Strategy, fsdp::BackwardPre, fsdp::ForwardPrefetch>(failing, Fault::none, 0, true);
    for (int at : {1, 4, 9, 11, 14, 19}) {
      CAPTURE(failing);
      CAPTURE(at);
      std::vector<std::size_t> live;
      const Params got = train<Strategy, fsdp::BackwardPre, fsdp::ForwardPrefetch>(failing, Fault::engine, at, false, &live);
      CHECK(got == skipped);
      REQUIRE(live.size() == 2);
      CHECK(live[1] == live[0]);  // everything the step held is freed
    }
  }
  const Params plain = train<Strategy>(-1, Fault::none, 0, false);
  CHECK(plain != train<Strategy>(2, Fault::none, 0, true));  // skipping a batch changes training: the check can fail
}

TEST_CASE("a failed allocation inside a hook on every rank: abort_step, then training as if the batch had been skipped") {
  const Params skipped = train<fsdp::FullShard, fsdp::BackwardPost>(2, Fault::none, 0, true);
  for (int at : {1, 2, 5, 9, 13}) {  // all-gathers in forward, gradients and reductions in backward
    CAPTURE(at);
    CHECK(train<fsdp::FullShard, fsdp::BackwardPost>(2, Fault::allocation, at, false) == skipped);
  }
}

TEST_CASE("without abort_step the next call says what to call") {
  const auto c = config();
  SUBCASE("a hook left by an exception") {
    const auto msgs = test_support::errors_per_rank(1, [&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      FailingDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      device.arm(1);
      CHECK_THROWS_AS(sm[0].pre_forward(), std::bad_alloc);
      device.arm(-1);
      sm.zero_grad();
    });
    CHECK(contains(msgs[0], "unit '<root>' on rank 0: zero_grad called after pre_forward left by an exception, and "
                            "abort_step() was not called since; call abort_step() (ShardedModel::abort_step) on every "
                            "rank after catching it"));
  }
  SUBCASE("an engine error between hooks leaves a unit in FORWARD") {
    const auto msgs = test_support::errors_per_rank(1, [&](fsdp::ThreadComm& comm) {
      engine::Model model(c);
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      sm[0].pre_forward();
      sm.zero_grad();
    });
    CHECK(contains(msgs[0], "zero_grad called in state FORWARD; expected IDLE"));
    // The exception is unseen (no scope): the state message names abort_step as a likely cause.
    CHECK(contains(msgs[0], "an exception left the last step between hooks and abort_step() was not called: call "
                            "abort_step() (ShardedModel::abort_step) on every rank after catching it"));
  }
}

// One step on 2 ranks over `comm`, in which rank `aborting`'s engine fails at its 3rd hook
// (inside a forward) and aborts, while the other rank computes on: the aborting rank's
// agreement meets its peer's next collective.
template <class Comm>
void abort_while_peer_computes(Comm& comm, int rank, int aborting = 0) {
  const auto c = config();
  engine::Model model(c);
  fsdp::HostDevice device;
  auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
  const auto batch = engine::make_batch(c, 0, rank, 1);
  try {
    FailingHooks hooks{{sm}, rank == aborting ? 3 : -1};
    engine::Mat dout;
    engine::mse(model.forward(batch.x, hooks), batch.y, dout);
    model.backward(dout, hooks);
    sm.finish_backward();
  } catch (const std::runtime_error&) {
    sm.abort_step();
  }
}

// Issue 35: rank 1 used to read only that rank 0 "called ... abort_step (the step was left
// by an exception)"; the reason was in rank 0's output alone. The agreement's tag carries
// rank 0's message now, on the backends that compare calls in this process (ThreadComm, and
// through an AsyncCommunicator) and on TcpComm (each rank's report through the store).
// How often `part` occurs in `text`.
std::size_t occurrences(const std::string& text, const std::string& part) {
  std::size_t n = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + part.size())) ++n;
  return n;
}

void check_abort_named_and_quoted(const std::vector<std::string>& msgs) {
  for (int r = 0; r < 2; ++r) {
    CAPTURE(r);
    CAPTURE(msgs[r]);
    // Each error names rank 0's call as abort_step's, with the exception that left its
    // step, once: not again where a rank's message names its own call, nor after it as
    // "this rank called abort_step after: ..." (rank 0's own error lists it already; rank
    // 1 catches the mismatch, aborts too, and its agreement fails quoting that mismatch).
    CHECK(contains(msgs[r], "collective mismatch: rank 0 called all_reduce(count=1, dtype=i32, op=min) of abort_step "
                            "(the step was left by an exception: \"engine kernel failed\") as collective #"));
    CHECK(occurrences(msgs[r], "engine kernel failed") == 1);
    CHECK(occurrences(msgs[r], "collective mismatch") == 1);
  }
}

TEST_CASE("a rank that aborts while its peer computes: every rank's error names it and quotes why") {
  SUBCASE("ThreadComm") {
    check_abort_named_and_quoted(
        test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) { abort_while_peer_computes(comm, comm.rank()); }));
  }
  SUBCASE("ThreadGroup::run rethrows the aborting rank's error, which says why it aborted") {
    for (int aborting : {0, 1}) {
      CAPTURE(aborting);
      std::string what;
      try {
        fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) { abort_while_peer_computes(comm, comm.rank(), aborting); });
      } catch (const fsdp::Error& e) {
        what = e.what();
      }
      CAPTURE(what);
      CHECK(contains(what, "rank " + std::to_string(aborting) + " called all_reduce(count=1, dtype=i32, op=min) of "
                           "abort_step (the step was left by an exception: \"engine kernel failed\")"));
      CHECK(occurrences(what, "engine kernel failed") == 1);
    }
  }
  SUBCASE("an AsyncCommunicator over ThreadComm") {
    check_abort_named_and_quoted(test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
      fsdp::AsyncCommunicator<fsdp::ThreadComm> async(comm);
      abort_while_peer_computes(async, comm.rank());
    }));
  }
  SUBCASE("TcpComm") {
    const auto store = std::make_shared<fsdp::HashStore>();
    check_abort_named_and_quoted(test_support::on_threads(2, [&](int r) {
      fsdp::TcpComm comm(store, r, 2, test_support::ok_options());
      abort_while_peer_computes(comm, r);
    }));
  }
}

TEST_CASE("a unit outside a model: its own abort_step frees what it held and agrees across its world") {
  const auto c = config();
  const auto msgs = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    FailingDevice device;
    fsdp::Sharded<engine::Model> unit(model, comm, device);
    const std::size_t live = device.stats(fsdp::MemorySpace::device).live_bytes;
    unit.pre_forward();  // the engine fails inside the unit's forward
    CHECK(device.stats(fsdp::MemorySpace::device).live_bytes > live);
    unit.abort_step();
    CHECK(unit.state() == fsdp::TrainingState::IDLE);
    CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == live);
    unit.pre_forward();  // usable again
    unit.post_forward();
  });
  for (int r = 0; r < 2; ++r) CHECK(msgs[r].empty());
}

// Issue 35: an exception inside a unit's forward scope (forward prefetch, an asynchronous
// communicator), then the next step without abort_step, blamed a changed forward order or
// the state the unit was left in. Every rank's next call now says first that the step was
// left by an exception and names the scope, for a failure in the first iteration (the
// order being recorded) or later, in forward or backward, with or without zero_grad.
TEST_CASE("a scope left by an exception, then the next step without abort_step: the error says so on every rank") {
  const auto c = config();
  for (bool in_backward : {false, true})
    for (int failing : {0, 1})
      for (const char* fail : {"", "blocks.0", "blocks.1", "gain"})
        for (bool zero : {true, false}) {
          CAPTURE(in_backward);
          CAPTURE(failing);
          CAPTURE(fail);
          CAPTURE(zero);
          bool threw = false;
          const auto msgs = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
            fsdp::AsyncCommunicator<fsdp::ThreadComm> async(comm);
            engine::Model model(c);
            fsdp::HostDevice device;
            auto sm = fsdp::shard<fsdp::FullShard, fsdp::ForwardPrefetch, fsdp::BackwardPre>(model, async, device, engine::Wrap{});
            std::vector<fsdp::Unit*> layers;
            for (const char* name : {"blocks.0", "blocks.1", "blocks.2", "gain"}) layers.push_back(&sm.unit(name));
            for (int s = 0; s < failing; ++s) scoped_step(sm, &sm.unit(""), layers);
            try {
              scoped_step(sm, &sm.unit(""), layers, fail, in_backward);
            } catch (const KernelFailed&) {
              if (comm.rank() == 0) threw = true;
            }
            scoped_step(sm, &sm.unit(""), layers, std::nullopt, false, zero);  // no abort_step
          });
          REQUIRE(threw);
          const std::string scope = std::string(in_backward ? "backward" : "forward") + " scope";
          const std::string where = *fail ? "the " + scope + " of unit '" + fail + "'" : "its " + scope;
          for (int r = 0; r < 2; ++r) {
            CAPTURE(msgs[r]);
            CHECK(contains(msgs[r], "unit '<root>' on rank " + std::to_string(r) + ": " + (zero ? "zero_grad" : "pre_forward") +
                                        " called after " + where + " left by an exception, and abort_step() was not "
                                        "called since; call abort_step() (ShardedModel::abort_step) on every rank"));
          }
        }
}

// Units driven by hand, with no root unit around them: the units before the one whose scope
// failed are IDLE, and the first of them, entering the next step, met the forward-order
// check (it runs where the first iteration ran a later unit) before any state check. Every
// unit of the model is now failed with the scope, and after abort_step training goes on.
TEST_CASE("units without a root: a scope left by an exception fails every unit of the model until abort_step") {
  const auto c = config();
  for (int failing : {0, 1}) {
    CAPTURE(failing);
    const auto msgs = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
      fsdp::AsyncCommunicator<fsdp::ThreadComm> async(comm);
      engine::Model model(c);
      fsdp::HostDevice device;
      fsdp::ShardedModel sm;
      const auto layers = block_units<fsdp::FullShard, fsdp::ForwardPrefetch>(sm, model, async, device);
      for (int s = 0; s < failing; ++s) scoped_step(sm, nullptr, layers);
      CHECK_THROWS_AS(scoped_step(sm, nullptr, layers, "blocks.1"), KernelFailed);
      const std::string expected = "unit 'blocks.0' on rank " + std::to_string(comm.rank()) +
                                   ": pre_forward called after the forward scope of unit 'blocks.1' left by an exception, "
                                   "and abort_step() was not called since";
      CHECK(contains(test_support::error_of([&] { scoped_step(sm, nullptr, layers, std::nullopt, false, false); }), expected));
      CHECK(contains(test_support::error_of([&] { sm.finish_backward(); }), "finish_backward called after the forward scope"));
      sm.abort_step();
      for (fsdp::Unit* u : layers) CHECK(u->state() == fsdp::TrainingState::IDLE);
      for (int s = 0; s < 2; ++s) scoped_step(sm, nullptr, layers);
    });
    for (int r = 0; r < 2; ++r) CHECK(msgs[r].empty());
  }
}

// An engine error between plain hook calls (no scope): no library code sees the exception.
// When the next step starts the forward pass over mid-pass, the forward-order message says
// that the last pass never ended and what to call if an exception left it.
TEST_CASE("an engine error between hooks, then the next step without abort_step: the order check names abort_step") {
  const auto c = config();
  const auto msgs = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    fsdp::ShardedModel sm;
    const auto layers = block_units<fsdp::FullShard, fsdp::ForwardPrefetch>(sm, model, comm, device);
    scoped_step(sm, nullptr, layers);
    layers[0]->pre_forward();
    layers[0]->post_forward();  // then the engine throws, and the exception is caught
    layers[0]->pre_forward();
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(msgs[r]);
    CHECK(contains(msgs[r], "unit 'blocks.0' on rank " + std::to_string(r) + " runs at forward step #1 where the first "
                            "iteration ran 'blocks.1': the forward pass starts over before the last one ended (at step "
                            "#1); if an exception left that step, call abort_step() (ShardedModel::abort_step) on every "
                            "rank before the next one"));
    CHECK(contains(msgs[r], "prefetching follows the first iteration's order"));  // the other cause, still named
  }
}

// The same in the very first step, while the order is recorded: the units that ran before
// the error are recorded twice, and the retried step trains as usual. The second step runs
// the pass alone and parts from the record where the retried pass began (or, when the error
// came after the whole forward, ends its forward there), so the record drops the abandoned
// start: no order error, and from the third step on each step's all-gathers are those of a
// run without the error. A model whose first step records the same on purpose (a forward
// through blocks.0 that reaches no loss, before the pass, every step) keeps its record.
TEST_CASE("an engine error between hooks in the first step, retried without abort_step: the steps after it follow the "
          "pass, not its abandoned start") {
  const auto c = config();
  // Per rank, the all-gathers of each of 4 steps; `done` units ran forward before the error
  // in the first step (-1: no error); `extra_use`: every step starts with blocks.0's forward.
  auto gathers = [&](int done, bool extra_use) {
    std::vector<std::vector<std::uint64_t>> out(2);
    const auto msgs = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
      fsdp::CountingCommunicator<fsdp::ThreadComm> counted(comm);
      engine::Model model(c);
      fsdp::HostDevice device;
      fsdp::ShardedModel sm;
      const auto layers = block_units<fsdp::FullShard, fsdp::ForwardPrefetch>(sm, model, counted, device);
      for (int i = 0; i < done; ++i) {
        layers[static_cast<std::size_t>(i)]->pre_forward();
        layers[static_cast<std::size_t>(i)]->post_forward();
      }  // then the engine throws, and the exception is caught
      for (int s = 0; s < 4; ++s) {
        counted.reset();
        sm.zero_grad();
        if (extra_use) layers[0]->pre_forward(), layers[0]->post_forward();
        scoped_step(sm, nullptr, layers, std::nullopt, false, false);
        out[static_cast<std::size_t>(comm.rank())].push_back(counted.counts()[fsdp::Collective::all_gather].calls);
      }
    });
    for (int r = 0; r < 2; ++r) {
      CHECK(msgs[static_cast<std::size_t>(r)].empty());
      REQUIRE(out[static_cast<std::size_t>(r)].size() == 4);
    }
    return out;
  };
  const auto clean = gathers(-1, false);
  for (int done : {1, 2, 3}) {
    CAPTURE(done);
    const auto got = gathers(done, false);
    for (std::size_t r = 0; r < 2; ++r)
      for (std::size_t s : {2u, 3u}) CHECK(got[r][s] == clean[r][s]);
  }
  const auto legal = gathers(-1, true);  // 4 units' forwards per step, and prefetching along them
  for (int r = 0; r < 2; ++r) {
    CHECK(legal[static_cast<std::size_t>(r)][2] == clean[static_cast<std::size_t>(r)][2] + 1);
    CHECK(legal[static_cast<std::size_t>(r)][3] == legal[static_cast<std::size_t>(r)][2]);
  }
}

TEST_CASE("an engine error in the first step's backward, retried without abort_step: the next call names abort_step; "
          "after abort_step, training as usual") {
  const auto c = config();
  // Per rank: the error of the retry (empty: none), and the all-gathers of 3 steps after
  // abort_step. `bwd_done` units finished their backward before the engine threw (-1: a
  // clean run, no error and no abort_step); `zero`: the retry starts with zero_grad.
  struct Run {
    std::vector<std::string> errors;
    std::vector<std::vector<std::uint64_t>> gathers{2};
    std::vector<std::uint64_t> retry_gathers = std::vector<std::uint64_t>(2, 99);  // the retry's all-gathers
  };
  auto run = [&](int bwd_done, bool zero) {
    Run out;
    out.errors = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
      fsdp::CountingCommunicator<fsdp::ThreadComm> counted(comm);
      engine::Model model(c);
      fsdp::HostDevice device;
      fsdp::ShardedModel sm;
      const auto layers = block_units<fsdp::FullShard, fsdp::ForwardPrefetch>(sm, model, counted, device);
      std::string error;
      if (bwd_done >= 0) {
        for (fsdp::Unit* u : layers) u->pre_forward(), u->post_forward();
        for (int i = 0; i < bwd_done; ++i) {
          fsdp::Unit& u = *layers[static_cast<std::size_t>(2 - i)];
          u.pre_backward(), u.post_backward();
        }  // then the engine throws, and the exception is caught
        const std::uint64_t before = counted.counts()[fsdp::Collective::all_gather].calls;
        try {
          scoped_step(sm, nullptr, layers, std::nullopt, false, zero);  // no abort_step
        } catch (const fsdp::Error& e) {
          error = e.what();
        }
        out.retry_gathers[static_cast<std::size_t>(comm.rank())] =
            counted.counts()[fsdp::Collective::all_gather].calls - before;
        sm.abort_step();
      }
      for (int s = 0; s < 3; ++s) {
        counted.reset();
        scoped_step(sm, nullptr, layers);
        out.gathers[static_cast<std::size_t>(comm.rank())].push_back(counted.counts()[fsdp::Collective::all_gather].calls);
      }
      if (!error.empty()) throw fsdp::Error(error);  // the retry's error, reported after the steps
    });
    return out;
  };
  const Run clean = run(-1, true);
  for (int r = 0; r < 2; ++r) REQUIRE(clean.errors[static_cast<std::size_t>(r)].empty());
  for (int bwd_done : {1, 2, 3}) {
    for (bool zero : {true, false}) {
      CAPTURE(bwd_done);
      CAPTURE(zero);
      const Run got = run(bwd_done, zero);
      // The last unit whose backward ran is left in BACKWARD_POST: the retry's first call on
      // it (zero_grad, or its pre_forward: the forward reaches it last) says what to call.
      const std::string unit = "blocks." + std::to_string(3 - bwd_done);
      for (int r = 0; r < 2; ++r) {
        const std::string& e = got.errors[static_cast<std::size_t>(r)];
        CAPTURE(e);
        CHECK(contains(e, "unit '" + unit + "' on rank " + std::to_string(r) + ": " +
                              (zero ? "zero_grad" : "pre_forward") + " called in state BACKWARD_POST"));
        CHECK(contains(e, "abort_step() was not called: call abort_step() (ShardedModel::abort_step) on every rank"));
      }
      // No rank is left waiting: both ranks issued the same collectives before the error
      // (none when zero_grad found it; the forwards of the units before the one left in
      // BACKWARD_POST otherwise), and after abort_step the steps gather what a clean run
      // gathers.
      CHECK(got.retry_gathers[0] == got.retry_gathers[1]);
      if (zero || bwd_done == 3) CHECK(got.retry_gathers[0] == 0);  // the first call found it
      else CHECK(got.retry_gathers[0] > 0);
      CHECK(got.gathers == clean.gathers);
    }
  }
}

// Models whose first step records what an abandoned start would (a forward that reaches no
// loss, before the pass) and whose later steps leave it out or shorten it, on purpose.
// Step s runs forward only through extra[s], then the pass (`fwd`, then `bwd`). Per rank: its
// error (empty if none) and each step's all-gathers.
struct Varying {
  std::vector<std::string> errors;
  std::vector<std::vector<std::uint64_t>> gathers;
};
template <class... Ps>
Varying varying_steps(const std::vector<std::vector<std::size_t>>& extra, const std::vector<std::size_t>& fwd,
                      const std::vector<std::size_t>& bwd) {
  Varying out;
  out.gathers.resize(2);
  out.errors = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
    fsdp::CountingCommunicator<fsdp::ThreadComm> counted(comm);
    engine::Model model(config());
    fsdp::HostDevice device;
    fsdp::ShardedModel sm;
    const auto u = block_units<Ps...>(sm, model, counted, device);
    for (const auto& first : extra) {
      counted.reset();
      sm.zero_grad();
      for (std::size_t i : first) u[i]->pre_forward(), u[i]->post_forward();
      for (std::size_t i : fwd) u[i]->pre_forward(), u[i]->post_forward();
      for (std::size_t i : bwd) u[i]->pre_backward(), u[i]->post_backward();
      sm.finish_backward();
      const auto gathers = counted.counts()[fsdp::Collective::all_gather].calls;
      out.gathers[static_cast<std::size_t>(comm.rank())].push_back(gathers);
    }
  });
  return out;
}

TEST_CASE("a model whose later steps leave out or shorten a forward of its first that reaches no loss keeps training") {
  // blocks.0 tied (used twice per pass). Without forward prefetching the record is kept as
  // the first step made it: a record cut to the pass would end a pass inside the longer
  // steps, where the tied unit's uses would be counted wrong (it would be reduced after its
  // first backward entry and fail at its second).
  const std::vector<std::size_t> tied_fwd{0, 1, 2, 0}, tied_bwd{0, 2, 1, 0};
  for (const auto& extra : std::vector<std::vector<std::vector<std::size_t>>>{
           {{0}, {}, {0}, {0}},                         // one unit's forward first
           {{0, 1, 2, 0}, {}, {0, 1}, {0, 1, 2, 0}}}) {  // a whole forward first
    for (const auto& run :
         {varying_steps<>(extra, tied_fwd, tied_bwd),
          varying_steps<fsdp::NoBackwardPrefetch, fsdp::NoForwardPrefetch>(extra, tied_fwd, tied_bwd)})
      for (std::size_t r = 0; r < 2; ++r) CHECK(run.errors[r] == "");
  }
  // Under forward prefetching, a whole forward first and then steps without it: the second
  // step drops it from the record (its forward ends at the middle), so the third gathers
  // what a model that never ran the extra forward gathers (a record of two passes would have
  // the last unit prefetch the first again in vain); the longer fourth step runs as two passes.
  const std::vector<std::size_t> fwd{0, 1, 2}, bwd{2, 1, 0};
  const auto whole = varying_steps<fsdp::ForwardPrefetch>({{0, 1, 2}, {}, {}, {0, 1, 2}}, fwd, bwd);
  const auto plain = varying_steps<fsdp::ForwardPrefetch>({{}, {}, {}, {}}, fwd, bwd);
  for (std::size_t r = 0; r < 2; ++r) {
    CHECK(whole.errors[r] == "");
    REQUIRE(whole.gathers[r].size() == 4);
    REQUIRE(plain.gathers[r].size() == 4);
    CHECK(whole.gathers[r][2] == plain.gathers[r][2]);
  }
}

TEST_CASE("a unit outside a model: a scope left by an exception fails its next call until its abort_step") {
  const auto c = config();
  const auto msgs = test_support::errors_per_rank(2, [&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    fsdp::Sharded<engine::Model> unit(model, comm, device);
    try {
      auto s = unit.backward_scope();
      throw KernelFailed();
    } catch (const KernelFailed&) {
    }
    CHECK(contains(test_support::error_of([&] { unit.zero_grad(); }),
                   "unit '<root>' on rank " + std::to_string(comm.rank()) + ": zero_grad called after its backward scope "
                   "left by an exception, and abort_step() was not called since"));
    unit.abort_step();
    unit.zero_grad();
    { auto s = unit.forward_scope(); }
    { auto s = unit.backward_scope(); }
    unit.finish_backward();
  });
  for (int r = 0; r < 2; ++r) CHECK(msgs[r].empty());
}

// pre_backward between the backward entries of a unit used twice skips the state check; it
// still asks for abort_step after another unit's scope failed the step.
TEST_CASE("a unit between its backward entries: its next pre_backward after a failed step asks for abort_step") {
  const auto c = config();
  const auto msgs = test_support::errors_per_rank(1, [&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    auto& block = sm.unit("blocks.0");
    for (int i = 0; i < 2; ++i) block.pre_forward(), block.post_forward();  // used twice
    block.pre_backward();
    block.post_backward();  // one of its two backward entries
    try {
      auto s = sm.unit("gain").backward_scope();
      throw KernelFailed();
    } catch (const KernelFailed&) {
    }
    CHECK(contains(test_support::error_of([&] { block.pre_backward(); }),
                   "unit 'blocks.0' on rank 0: pre_backward called after the backward scope of unit 'gain' left by an "
                   "exception, and abort_step() was not called since"));
    sm.abort_step();
    engine::Sgd sgd(0.05f);
    const auto batch = engine::make_batch(c, 0, comm.rank(), 1);
    engine::sharded_step(model, sm, sgd, std::span<const engine::Batch>(&batch, 1));
  });
  CHECK(msgs[0].empty());
}

}  // namespace faults_abort_step_test
