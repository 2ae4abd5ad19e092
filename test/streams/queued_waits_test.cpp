// Where the library waits for collectives on a QueuedDevice (fsdp/core/device.hpp) whose
// communicator's Work can be waited on by the device (Work::wait_on): the CUDA path's
// dispatch, checked on the host. A recording communicator wraps ThreadComm: each of its
// Work logs whether it was waited on the device queue or on the host; a recording device
// wraps HostDevice, logs its frees, and hands out a queue. A training step must then wait
// for every all-gather and reduction on the device queue, free every buffer a collective
// wrote only after that wait, and leave the host waits to finish_backward, where a failed
// collective becomes an fsdp::Error. Parameters must equal plain host training bit for bit.
// The same with HostDevice (no queue) keeps every wait on the host.
#include <doctest/doctest.h>

#include <algorithm>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <vector>

#include "fsdp/fsdp.hpp"
#include "fsdp/unit/detail/flat_param_storage.hpp"  // detail::TracedWait, wait_for_use, settle_before_free
#include "test/support/device_training.hpp"
#include "test/support/errors.hpp"
#include "test/support/queued_host.hpp"

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using fsdp::Work;

using test_support::Event;
using test_support::Log;
using test_support::QueuedHostDevice;
using test_support::RecordingComm;
using test_support::RecordingPending;

constexpr int kWorld = 2;
const test_support::DeviceTrainingConfig kConfig{.width = 12, .layers = 3, .batch = 2, .steps = 2, .lr = 0.05f};

// Trains kConfig.steps steps on kWorld thread ranks with devices made by make_device(log)
// and RecordingComm; per rank, `check(log, step)` sees the log of one step's forward and
// backward (before finish_backward) and `after(log, mark)` that log continued through
// finish_backward, which began at events[mark]. Returns rank 0's parameters.
template <class Strategy, class MakeDevice, class Check, class After>
test_support::Params train(MakeDevice make_device, Check check, After after) {
  test_support::Params out;
  std::mutex mu;
  fsdp::ThreadGroup(kWorld).run([&](fsdp::ThreadComm& tc) {
    Log log;
    auto dev = make_device(log);
    using D = std::remove_cvref_t<decltype(*dev)>;
    void* queue = nullptr;
    if constexpr (fsdp::QueuedDevice<D>) queue = dev->queue().handle;
    RecordingComm comm(tc, log, queue);
    test_support::Net<D> net(*dev, kConfig);
    auto sm = fsdp::shard<Strategy>(net, comm, *dev, fsdp::wrap_types<test_support::Layer>{});
    for (int step = 0; step < kConfig.steps; ++step) {
      sm.zero_grad();
      log.clear();
      test_support::forward_backward(*dev, net, sm, kConfig, tc.rank(), step, 1.0);
      check(log, step);
      const std::size_t mark = log.events.size();
      sm.finish_backward();
      after(log, mark);
      test_support::sgd_step(*dev, sm.shards(), kConfig.lr);
    }
    auto params = test_support::full_parameters(*dev, net, sm);
    std::lock_guard lk(mu);
    if (tc.rank() == 0) out = params;
  });
  return out;
}

test_support::Params host_reference_of(auto strategy) {
  using S = decltype(strategy);
  return train<S>([](Log&) { return std::make_unique<fsdp::HostDevice>(); }, [](const Log&, int) {}, [](const Log&, std::size_t) {});
}

// Index of the first event matching, from `from` on; events.size() if none.
std::size_t find_event(const Log& log, Event::Kind k, const void* buffer, std::size_t from = 0) {
  for (std::size_t i = from; i < log.events.size(); ++i)
    if (log.events[i].kind == k && log.events[i].buffer == buffer) return i;
  return log.events.size();
}

}  // namespace

TEST_CASE_TEMPLATE("on a queued device, forward and backward wait for collectives on the device queue only", S,
                   fsdp::FullShard, fsdp::ShardGradOp, fsdp::NoShard) {
  std::mutex mu;  // CHECK from several rank threads
  const auto params = train<S>(
      [](Log& log) { return std::make_unique<QueuedHostDevice>(log); },
      [&](const Log& log, int step) {
        std::lock_guard lk(mu);
        CAPTURE(step);
        CHECK(!log.issued.empty());
        for (const auto& e : log.events) {
          CAPTURE(e.collective);
          if (e.on_device) CHECK(e.kind != Event::host_wait);  // the host never blocked on a unit's collective
          // The library's agreements run on the first step only: from then on, nothing.
          if (step > 0) CHECK(e.kind != Event::host_wait);
        }
        const std::size_t gathers = static_cast<std::size_t>(std::count_if(
            log.issued.begin(), log.issued.end(), [](auto& c) { return c.collective == "all_gather" && c.on_device; }));
        if constexpr (std::is_same_v<S, fsdp::NoShard>) CHECK(gathers == 0);
        else CHECK(gathers > 0);
        CHECK(log.count(Event::device_wait, "all_gather") == gathers);
        // Every buffer an all-gather wrote is freed only after the device queue waited for it
        // (a stream-ordered free behind the collective's event).
        for (const auto& [what, recv, on_device, at] : log.issued) {
          if (what != "all_gather" || !on_device) continue;
          const std::size_t waited = find_event(log, Event::device_wait, recv, at);
          CHECK(waited < log.events.size());
          const std::size_t freed = find_event(log, Event::free, recv, at);
          if (freed < log.events.size()) CHECK(freed > waited);
        }
      },
      [&](const Log& log, std::size_t mark) {
        // finish_backward: one host-side check of each reduction waited for on the device
        // this step (some of them inside finish_backward itself), and no other host wait.
        std::lock_guard lk(mu);
        std::size_t reductions_on_device = 0, host_checks = 0;
        for (std::size_t i = 0; i < log.events.size(); ++i) {
          const auto& e = log.events[i];
          const bool reduction = e.on_device && (e.collective == "reduce_scatter" || e.collective == "all_reduce");
          if (e.kind == Event::device_wait && reduction) ++reductions_on_device;
          if (e.kind == Event::host_wait && e.on_device) {
            CHECK(reduction);
            CHECK(i >= mark);
            ++host_checks;
          }
          if (reduction) CHECK(e.kind != Event::dropped_after_device_wait);
        }
        CHECK(reductions_on_device > 0);
        CHECK(host_checks == reductions_on_device);
      });
  CHECK(test_support::bitwise_equal(params, host_reference_of(S{})));
}

TEST_CASE("on HostDevice (no queue) every wait stays on the host, as before") {
  std::mutex mu;
  const auto params = train<fsdp::FullShard>(
      [](Log&) { return std::make_unique<fsdp::HostDevice>(); },
      [&](const Log& log, int) {
        std::lock_guard lk(mu);
        for (const auto& e : log.events) CHECK(e.kind != Event::device_wait);
        CHECK(log.count(Event::host_wait, "all_gather", false) > 0);  // HostDevice's buffers are not logged
      },
      [](const Log&, std::size_t) {});
  CHECK(test_support::bitwise_equal(params, host_reference_of(fsdp::FullShard{})));
}

TEST_CASE("a reduction that fails after a device-side wait is an fsdp::Error at finish_backward") {
  std::vector<std::string> errors(kWorld);
  fsdp::ThreadGroup(kWorld).run([&](fsdp::ThreadComm& tc) {
    Log log;
    QueuedHostDevice dev(log);
    RecordingComm comm(tc, log, &dev);
    test_support::Net<QueuedHostDevice> net(dev, kConfig);
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, dev, fsdp::wrap_types<test_support::Layer>{});
    sm.zero_grad();
    log.fail_reductions_on_host = true;  // the device-side waits succeed; the host check fails
    test_support::forward_backward(dev, net, sm, kConfig, tc.rank(), 0, 1.0);  // no throw before the host check
    errors[static_cast<std::size_t>(tc.rank())] = test_support::error_of([&] { sm.finish_backward(); });
    log.fail_reductions_on_host = false;
    sm.abort_step();
  });
  for (const auto& e : errors) {
    CHECK(test_support::contains(e, "reduce_scatter failed on a peer (injected)"));
  }
}

TEST_CASE("Work::wait_on: a backend without device waits leaves the wait to the host") {
  Log log;
  fsdp::HostDevice host;
  const fsdp::detail::DeviceRef host_ref(host);
  CHECK(host_ref.queue().handle == nullptr);
  QueuedHostDevice queued(log);
  const fsdp::detail::DeviceRef queued_ref(queued);
  CHECK(queued_ref.queue().handle == &queued);

  CHECK(Work{}.wait_on(queued_ref.queue()));  // complete: nothing to wait for
  struct HostOnly final : Work::Pending {
    int* waits;
    explicit HostOnly(int* w) : waits(w) {}
    void wait() override { ++*waits; }
    bool ready() override { return true; }
  };
  int waits = 0;
  {
    Work w(std::make_unique<HostOnly>(&waits));
    CHECK_FALSE(w.wait_on(queued_ref.queue()));  // the default: no device waits
    CHECK_FALSE(w.waited_on_device());
    CHECK(waits == 0);
  }
  CHECK(waits == 1);  // dropped: waited on the host, as always

  fsdp::detail::TracedWait traced;
  {
    Work w(std::make_unique<RecordingPending>(Work{}, log, "all_gather", nullptr, &queued));
    CHECK(fsdp::detail::wait_for_use(w, queued_ref, traced, "wait"));
    CHECK(w.waited_on_device());
    CHECK(log.count(Event::device_wait, "all_gather", false) == 1);
    w.wait();  // the host-side check still runs after a device-side wait
    CHECK(log.count(Event::host_wait, "all_gather", false) == 1);
  }
  log.clear();
  {
    Work w(std::make_unique<RecordingPending>(Work{}, log, "all_gather", nullptr, &queued));
    CHECK_FALSE(fsdp::detail::wait_for_use(w, host_ref, traced, "wait"));  // a device without a queue
    CHECK(log.count(Event::host_wait, "all_gather", false) == 1);
  }
  log.clear();
  {
    Work w(std::make_unique<RecordingPending>(Work{}, log, "all_gather", nullptr, &queued));
    fsdp::detail::settle_before_free(w, queued_ref);  // before a free: device wait, then dropped
    CHECK(w.completed_inline());
  }
  CHECK(log.count(Event::device_wait, "all_gather", false) == 1);
  CHECK(log.count(Event::dropped_after_device_wait, "all_gather", false) == 1);  // no host wait after it
  CHECK(log.count(Event::host_wait, "all_gather", false) == 0);
}
