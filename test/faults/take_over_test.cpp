// A tensor_traits<T>::rebind that throws while units take over the engine's tensors
// (fsdp/detail/take_over.hpp): fsdp::shard fails with an fsdp::Error naming the unit and
// the tensor; no tensor is left viewing the library's memory; every tensor the library had
// not rebound yet (the thrower included) keeps its storage, dtype and values; the library
// frees all it allocated; the engine's storage is freed once at most and none leaks.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

#include "fsdp/host/host_device.hpp"
#include "fsdp/host/thread_group.hpp"
#include "fsdp/shard.hpp"
#include "test/support/errors.hpp"

namespace {

// When the rebind of one rank's tensors throws: at its `throw_at`-th call (1-based; 0: never).
struct RebindFaults {
  int calls = 0;
  int throw_at = 0;
  bool foreign = false;      // throw something that is not a std::exception
  std::string thrower;       // the tensor whose rebind threw
  std::int64_t live_bytes = 0;  // the engine's own storage
};

struct Foreign {};

// An engine tensor that owns storage until rebound (then releases it, as the Tensor contract asks).
struct Owned {
  std::string label;
  std::vector<std::int64_t> shape;
  fsdp::DType dtype = fsdp::DType::f32;
  std::vector<float>* storage = nullptr;  // owned
  void* data = nullptr;
  int rebinds = 0;
  int first_call = 0;  // the rebind call (counted over the rank's tensors) that first changed it
  RebindFaults* faults = nullptr;
  float first;  // element i was built as first + i

  Owned(RebindFaults& f, std::string l, std::vector<std::int64_t> s, float first_value)
      : label(std::move(l)), shape(std::move(s)), faults(&f), first(first_value) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    storage = new std::vector<float>(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < storage->size(); ++i) (*storage)[i] = first + static_cast<float>(i);
    data = storage->empty() ? nullptr : storage->data();
    f.live_bytes += n * 4;
  }
  Owned(const Owned&) = delete;
  ~Owned() { release(); }
  void release() {
    if (!storage) return;
    faults->live_bytes -= static_cast<std::int64_t>(storage->size() * 4);
    delete storage;
    storage = nullptr;
  }
};

struct Layer {
  Owned w, bias, gw, gbias, mean;
  Layer(RebindFaults& f, const std::string& name, float base)
      : w(f, name + ".w", {4, 3}, base), bias(f, name + ".bias", {3}, base + 50),
        gw(f, name + ".w#grad", {4, 3}, 0), gbias(f, name + ".bias#grad", {3}, 0), mean(f, name + ".mean", {3}, base + 70) {}
  template <class F> void visit_parameters(F&& f) { f("w", w, gw), f("bias", bias, gbias); }
  template <class F> void visit_buffers(F&& f) { f("mean", mean); }
};

struct Net {
  Owned gain, ggain;
  Layer a, b;
  explicit Net(RebindFaults& f) : gain(f, "gain", {5}, 1000), ggain(f, "gain#grad", {5}, 0), a(f, "a", 100), b(f, "b", 200) {}
  template <class F> void visit_parameters(F&& f) { f("gain", gain, ggain); }
  template <class F> void visit_children(F&& f) { f("a", a), f("b", b); }
  std::vector<Owned*> tensors() {
    return {&gain, &ggain, &a.w, &a.bias, &a.gw, &a.gbias, &a.mean, &b.w, &b.bias, &b.gw, &b.gbias, &b.mean};
  }
};

}  // namespace

template <>
struct fsdp::tensor_traits<Owned> {
  static DType dtype(const Owned& t) { return t.dtype; }
  static std::span<const std::int64_t> shape(const Owned& t) { return t.shape; }
  static void* data(Owned& t) { return t.data; }
  static DeviceId device(const Owned&) { return {}; }
  static void rebind(Owned& t, void* p) { rebind(t, p, t.dtype); }
  static void rebind(Owned& t, void* p, DType d) {
    if (++t.faults->calls == t.faults->throw_at) {  // before anything changes, as a failing rebind should
      t.faults->thrower = t.label;
      if (t.faults->foreign) throw Foreign{};
      throw std::runtime_error("no room for another view");
    }
    t.release();
    t.data = p;
    t.dtype = d;
    if (t.rebinds++ == 0) t.first_call = t.faults->calls;
  }
};

namespace {

using test_support::contains;

// How the thrower is named: "parameter 'a.w'", "the gradient of parameter 'a.w'", "buffer 'a.mean'".
std::string named(const std::string& label) {
  if (auto at = label.find("#grad"); at != std::string::npos) return "the gradient of parameter '" + label.substr(0, at) + "'";
  if (label.size() > 5 && label.substr(label.size() - 5) == ".mean") return "buffer '" + label + "'";
  return "parameter '" + label + "'";
}
std::string unit_of(const std::string& label) {
  return label.rfind("gain", 0) == 0 ? "<root>" : label.substr(0, label.find('.'));
}

// After a failed shard: every tensor the library rebound has no storage and its own dtype;
// every other keeps its storage and values (none is rebound after the throw, by cleanup,
// unless the take-over had reached it); the engine holds exactly those bytes.
void check_model_after_failure(Net& net, const RebindFaults& f) {
  std::int64_t kept = 0;
  for (Owned* t : net.tensors()) {
    CAPTURE(t->label);
    CHECK(t->dtype == fsdp::DType::f32);
    if (t->rebinds > 0) CHECK(t->first_call < f.throw_at);
    if (t->rebinds == 0) {
      REQUIRE(t->storage);
      CHECK(t->data == t->storage->data());
      for (std::size_t i = 0; i < t->storage->size(); ++i) CHECK((*t->storage)[i] == t->first + static_cast<float>(i));
      kept += static_cast<std::int64_t>(t->storage->size() * 4);
    } else {
      CHECK(t->storage == nullptr);
      CHECK(t->data == nullptr);  // never a view of memory the library freed
    }
  }
  CHECK(f.live_bytes == kept);
}

// Calls to rebind that a successful fsdp::shard makes (the take-over).
template <class... Ps>
int take_over_calls() {
  int calls = 0;
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    RebindFaults f;
    {
      Net net(f);
      fsdp::HostDevice device;
      auto model = fsdp::shard<Ps...>(net, comm, device, fsdp::wrap_types<Layer>{});
      calls = f.calls;
    }
    CHECK(f.live_bytes == 0);
  });
  return calls;
}

// For every call N of the take-over: that rebind throws on every rank of `world`.
template <class... Ps>
void fail_at_every_call(int world) {
  const int calls = take_over_calls<Ps...>();
  REQUIRE(calls >= 10);  // 5 parameters and their gradients at least
  for (int n = 1; n <= calls; ++n) {
    CAPTURE(n);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      RebindFaults f;
      f.throw_at = n;
      Net net(f);
      fsdp::HostDevice device;
      const std::string msg = test_support::error_of([&] { fsdp::shard<Ps...>(net, comm, device, fsdp::wrap_types<Layer>{}); });
      CAPTURE(msg);
      REQUIRE(!f.thrower.empty());
      CHECK(contains(msg, "fsdp: unit '" + unit_of(f.thrower) + "' on rank " + std::to_string(comm.rank()) +
                              ": tensor_traits<T>::rebind threw while the unit took over " + named(f.thrower) +
                              ": no room for another view"));
      check_model_after_failure(net, f);
      CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
      CHECK(device.stats(fsdp::MemorySpace::host).live_bytes == 0);
    });
  }
}

}  // namespace

TEST_CASE("FullShard on 2 ranks: a rebind throwing at any call of the take-over, in any unit") {
  fail_at_every_call<fsdp::FullShard>(2);
}

TEST_CASE("NoShard: parameters already pointed at the replicated storage are handed back without it") {
  fail_at_every_call<fsdp::NoShard>(1);
}

TEST_CASE("MixedPrecision: buffers already shown in bf16 get their own dtype back, without storage") {
  CHECK(take_over_calls<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>() == take_over_calls<fsdp::FullShard>() + 2);
  fail_at_every_call<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>(2);
}

TEST_CASE("CpuOffload: the host-space shards are freed too") {
  fail_at_every_call<fsdp::FullShard, fsdp::OffloadParams>(2);
}

TEST_CASE("a rebind throwing something that is not a std::exception is an fsdp::Error too") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    RebindFaults f;
    f.throw_at = 4;
    f.foreign = true;
    Net net(f);
    fsdp::HostDevice device;
    const std::string msg = test_support::error_of([&] { fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{}); });
    CHECK(contains(msg, "took over " + named(f.thrower) + ": an exception that is not a std::exception"));
    check_model_after_failure(net, f);
  });
}

TEST_CASE("only one rank's rebind throws: that rank fails, the other's model works and is freed") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    RebindFaults f;
    f.throw_at = comm.rank() == 1 ? 7 : 0;
    Net net(f);
    fsdp::HostDevice device;
    if (comm.rank() == 1) {
      CHECK(contains(test_support::error_of([&] { fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{}); }),
                     "tensor_traits<T>::rebind threw"));
      check_model_after_failure(net, f);
      CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
    } else {
      auto model = fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{});
      CHECK(model.size() == 3);
    }
  });
}
