// A tensor_traits<T>::rebind that throws while units take over the engine's tensors
// (fsdp/unit/detail/take_over.hpp): fsdp::shard fails with an fsdp::Error naming the unit and
// the tensor; no tensor is left viewing the library's memory; the library frees all it
// allocated; the engine's storage is freed once at most and none leaks. For a tensor type
// with keep/restore, every tensor of every unit keeps its storage, dtype and values (ties
// and a keep that throws included); for one without, every tensor the library had not
// rebound yet (the thrower included) does. A rebind that throws on one rank undoes the
// take-over on every rank, and the others' errors name that rank and quote it. A
// ShardedModel's take-over retried after a failure completes, and leaves the units taken
// over before it alone.
#include <doctest/doctest.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <span>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "examples/engine/tensor.hpp"
#include "fsdp/core/detail/echoed_error.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/host/host_tensor.hpp"
#include "fsdp/host/thread_group.hpp"
#include "fsdp/model/shard.hpp"
#include "test/support/errors.hpp"
#include <fsdp/unit/sharded.hpp>  // fsdp::Sharded: units built by hand

namespace faults_take_over_test {

namespace {

// When the rebind of one rank's tensors throws: at its `throw_at`-th call (1-based; 0: never).
struct RebindFaults {
  int calls = 0;
  int throw_at = 0;
  bool foreign = false;      // throw something that is not a std::exception
  std::string thrower;       // the tensor whose rebind threw
  std::int64_t live_bytes = 0;  // the engine's own storage
  int keeps = 0;
  int keep_throw_at = 0;  // the keep call (1-based) that throws; 0: never
};

struct Foreign {};

// An engine tensor that owns storage until rebound (then releases it, as the Tensor
// contract asks). With Keeps, its traits have keep/restore.
template <bool Keeps>
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
  // A view of `of`'s storage (a tie through another tensor object): owns nothing.
  Owned(RebindFaults& f, std::string l, Owned& of)
      : label(std::move(l)), shape(of.shape), data(of.data), faults(&f), first(of.first) {}
  Owned(const Owned&) = delete;
  ~Owned() { release(); }
  void release() { free_storage(faults, std::exchange(storage, nullptr)); }
  static void free_storage(RebindFaults* f, std::vector<float>* s) {
    if (!s) return;
    f->live_bytes -= static_cast<std::int64_t>(s->size() * 4);
    delete s;
  }

  // What keep hands out: the storage, freed when this is destroyed unless restored.
  struct Kept {
    RebindFaults* faults;
    std::vector<float>* storage;
    void* data;
    fsdp::DType dtype;
    Kept(Kept&& o) noexcept : faults(o.faults), storage(std::exchange(o.storage, nullptr)), data(o.data), dtype(o.dtype) {}
    Kept(RebindFaults* f, std::vector<float>* s, void* d, fsdp::DType t) : faults(f), storage(s), data(d), dtype(t) {}
    ~Kept() { free_storage(faults, storage); }
  };
};

template <bool Keeps>
struct Layer {
  Owned<Keeps> w, bias, gw, gbias, mean;
  Layer(RebindFaults& f, const std::string& name, float base)
      : w(f, name + ".w", {4, 3}, base), bias(f, name + ".bias", {3}, base + 50),
        gw(f, name + ".w#grad", {4, 3}, 0), gbias(f, name + ".bias#grad", {3}, 0), mean(f, name + ".mean", {3}, base + 70) {}
  template <class F> void visit_parameters(F&& f) { f("w", w, gw), f("bias", bias, gbias); }
  template <class F> void visit_buffers(F&& f) { f("mean", mean); }
};

template <bool Keeps>
struct Net {
  Owned<Keeps> gain, ggain;
  Layer<Keeps> a, b;
  // `base` shifts every value (ranks built differently, for sync_module_states).
  explicit Net(RebindFaults& f, float base = 0)
      : gain(f, "gain", {5}, base + 1000), ggain(f, "gain#grad", {5}, 0), a(f, "a", base + 100), b(f, "b", base + 200) {}
  template <class F> void visit_parameters(F&& f) { f("gain", gain, ggain); }
  template <class F> void visit_children(F&& f) { f("a", a), f("b", b); }
  std::vector<Owned<Keeps>*> tensors() {
    return {&gain, &ggain, &a.w, &a.bias, &a.gw, &a.gbias, &a.mean, &b.w, &b.bias, &b.gw, &b.gbias, &b.mean};
  }
};

}  // namespace

}  // namespace faults_take_over_test

// (Outside this file's namespace: fsdp::tensor_traits is specialized at namespace scope.)
template <bool Keeps>
struct fsdp::tensor_traits<faults_take_over_test::Owned<Keeps>> {
  using T = faults_take_over_test::Owned<Keeps>;
  static DType dtype(const T& t) { return t.dtype; }
  static std::span<const std::int64_t> shape(const T& t) { return t.shape; }
  static void* data(T& t) { return t.data; }
  static DeviceId device(const T&) { return {}; }
  static void rebind(T& t, void* p) { rebind(t, p, t.dtype); }
  static void rebind(T& t, void* p, DType d) {
    if (++t.faults->calls == t.faults->throw_at) {  // before anything changes, as a failing rebind should
      t.faults->thrower = t.label;
      if (t.faults->foreign) throw faults_take_over_test::Foreign{};
      throw std::runtime_error("no room for another view");
    }
    t.release();
    t.data = p;
    t.dtype = d;
    if (t.rebinds++ == 0) t.first_call = t.faults->calls;
  }
  static typename T::Kept keep(T& t)
    requires Keeps
  {
    if (++t.faults->keeps == t.faults->keep_throw_at) throw std::runtime_error("no memory to keep it");
    return {t.faults, std::exchange(t.storage, nullptr), t.data, t.dtype};
  }
  static void restore(T& t, typename T::Kept&& k) noexcept
    requires Keeps
  {
    t.release();
    t.storage = std::exchange(k.storage, nullptr);
    t.data = k.data;
    t.dtype = k.dtype;
  }
};

namespace faults_take_over_test {

static_assert(fsdp::KeepsStorage<Owned<true>> && !fsdp::KeepsStorage<Owned<false>>);

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

// `t` owns and shows the storage, dtype and values it was built with.
template <bool Keeps>
void check_as_built(const Owned<Keeps>& t) {
  CAPTURE(t.label);
  REQUIRE(t.storage);
  CHECK(t.data == t.storage->data());
  CHECK(t.dtype == fsdp::DType::f32);
  for (std::size_t i = 0; i < t.storage->size(); ++i) CHECK((*t.storage)[i] == t.first + static_cast<float>(i));
}

// After a failed shard. With keep/restore: every tensor has its storage, dtype and values,
// and the engine holds all it held. Without: every tensor the library rebound has no
// storage and its own dtype; every other keeps its storage and values (none is rebound
// after the throw, by cleanup, unless the take-over had reached it); the engine holds
// exactly those bytes.
template <bool Keeps>
void check_model_after_failure(Net<Keeps>& net, const RebindFaults& f, std::int64_t built_bytes) {
  std::int64_t kept = 0;
  for (Owned<Keeps>* t : net.tensors()) {
    CAPTURE(t->label);
    CHECK(t->dtype == fsdp::DType::f32);
    if (t->rebinds > 0) CHECK(t->first_call < f.throw_at);
    if (Keeps || t->rebinds == 0) {
      check_as_built(*t);
      kept += static_cast<std::int64_t>(t->storage->size() * 4);
    } else {
      CHECK(t->storage == nullptr);
      CHECK(t->data == nullptr);  // never a view of memory the library freed
    }
  }
  CHECK(f.live_bytes == kept);
  if (Keeps) CHECK(kept == built_bytes);
}

template <bool Keeps>
std::string expected_outcome(Net<Keeps>& net) {
  int lost = 0;
  for (Owned<Keeps>* t : net.tensors()) lost += !Keeps && t->rebinds > 0;
  if (lost == 0) return "; nothing was taken over, and every tensor keeps its storage and values";
  return "; nothing was taken over, but " + std::to_string(lost) +
         (lost == 1 ? " tensor rebound before it is" : " tensors rebound before it are") + " left without storage";
}

// The error of fsdp::shard<Ps...> over `net`, its layers wrapped.
template <class... Ps, bool Keeps>
std::string shard_error(Net<Keeps>& net, fsdp::ThreadComm& comm, fsdp::HostDevice& device,
                        const fsdp::ShardOptions& options = {}) {
  return test_support::error_of([&] { fsdp::shard<Ps...>(net, comm, device, fsdp::wrap_types<Layer<Keeps>>{}, options); });
}

struct Calls {
  int take_over = 0;            // rebind calls of a successful fsdp::shard
  std::int64_t engine_bytes = 0;  // what the engine still holds after it
};

// What a successful fsdp::shard does to the engine's tensors.
template <bool Keeps, class... Ps>
Calls successful_shard() {
  Calls calls;
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    RebindFaults f;
    {
      Net<Keeps> net(f);
      fsdp::HostDevice device;
      auto model = fsdp::shard<Ps...>(net, comm, device, fsdp::wrap_types<Layer<Keeps>>{});
      calls = {f.calls, f.live_bytes};
    }
    CHECK(f.live_bytes == 0);
  });
  return calls;
}

// For every call N of the take-over: that rebind throws on every rank of `world`.
template <bool Keeps, class... Ps>
void fail_at_every_call(int world, const fsdp::ShardOptions& options = {}) {
  const Calls good = successful_shard<Keeps, Ps...>();
  REQUIRE(good.take_over >= 10);  // 5 parameters and their gradients at least
  // The engine's storage goes when the take-over is committed, kept or not.
  CHECK(good.engine_bytes == successful_shard<!Keeps, Ps...>().engine_bytes);
  for (int n = 1; n <= good.take_over; ++n) {
    CAPTURE(n);
    fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
      RebindFaults f;
      f.throw_at = n;
      Net<Keeps> net(f, 10.0f * static_cast<float>(comm.rank()));
      const std::int64_t built_bytes = f.live_bytes;
      fsdp::HostDevice device;
      const std::string msg = shard_error<Ps...>(net, comm, device, options);
      CAPTURE(msg);
      REQUIRE(!f.thrower.empty());
      CHECK(contains(msg, "fsdp: unit '" + unit_of(f.thrower) + "' on rank " + std::to_string(comm.rank()) +
                              ": tensor_traits<T>::rebind threw while the unit took over " + named(f.thrower) +
                              ": no room for another view" + expected_outcome(net)));
      check_model_after_failure(net, f, built_bytes);
      CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
      CHECK(device.stats(fsdp::MemorySpace::host).live_bytes == 0);
    });
  }
}

}  // namespace

TEST_CASE_TEMPLATE("FullShard on 2 ranks: a rebind throwing at any call of the take-over, in any unit", Keeps,
                   std::true_type, std::false_type) {
  fail_at_every_call<Keeps::value, fsdp::FullShard>(2);
}

TEST_CASE_TEMPLATE("NoShard: parameters already pointed at the replicated storage are handed back", Keeps,
                   std::true_type, std::false_type) {
  fail_at_every_call<Keeps::value, fsdp::NoShard>(1);
}

TEST_CASE_TEMPLATE("MixedPrecision: buffers already shown in bf16 get their own dtype back", Keeps, std::true_type,
                   std::false_type) {
  CHECK(successful_shard<Keeps::value, fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>().take_over ==
        successful_shard<Keeps::value, fsdp::FullShard>().take_over + 2);
  fail_at_every_call<Keeps::value, fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>(2);
}

TEST_CASE_TEMPLATE("CpuOffload: the host-space shards are freed too", Keeps, std::true_type, std::false_type) {
  fail_at_every_call<Keeps::value, fsdp::FullShard, fsdp::OffloadParams>(2);
}

TEST_CASE_TEMPLATE("sync_module_states: rank 0's values reach no engine tensor of a failed take-over", Keeps,
                   std::true_type, std::false_type) {
  fsdp::ShardOptions o;
  o.sync_module_states = true;  // ranks were built with different values (Net's base)
  fail_at_every_call<Keeps::value, fsdp::FullShard>(2, o);
  fail_at_every_call<Keeps::value, fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>(2, o);
}

TEST_CASE("a rebind throwing something that is not a std::exception is an fsdp::Error too") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    RebindFaults f;
    f.throw_at = 4;
    f.foreign = true;
    Net<false> net(f);
    const std::int64_t built_bytes = f.live_bytes;
    fsdp::HostDevice device;
    const std::string msg = shard_error<fsdp::FullShard>(net, comm, device);
    CHECK(contains(msg, "took over " + named(f.thrower) + ": an exception that is not a std::exception"));
    check_model_after_failure(net, f, built_bytes);
  });
}

TEST_CASE_TEMPLATE("only one rank's rebind throws: no rank takes over, and the other's error quotes that rank", Keeps,
                   std::true_type, std::false_type) {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    RebindFaults f;
    f.throw_at = comm.rank() == 1 ? 7 : 0;
    Net<Keeps::value> net(f);
    const std::int64_t built_bytes = f.live_bytes;
    fsdp::HostDevice device;
    std::string echo_kind;
    const std::string msg = test_support::error_of([&] {
      try {
        fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer<Keeps::value>>{});
      } catch (const fsdp::Error& e) {
        echo_kind = fsdp::detail::is_echo(std::current_exception()) ? "echo" : "own";
        throw;
      }
    });
    CAPTURE(msg);
    if (comm.rank() == 1) {
      CHECK(echo_kind == "own");
      CHECK(contains(msg, "fsdp: unit '" + unit_of(f.thrower) + "' on rank 1: tensor_traits<T>::rebind threw while the "
                          "unit took over " + named(f.thrower)));
      check_model_after_failure(net, f, built_bytes);
    } else {
      // Rank 0 took over every tensor, then gave each back when the ranks agreed that one failed.
      CHECK(echo_kind == "echo");
      CHECK(contains(msg, "fsdp: setup on rank 0: the take-over of the engine's tensors failed on rank 1, so no rank "
                          "takes over; rank 1 says: unit '"));
      CHECK(contains(msg, "' on rank 1: tensor_traits<T>::rebind threw while the unit took over "));
      std::int64_t kept = 0;
      int lost = 0;
      for (Owned<Keeps::value>* t : net.tensors()) {
        CAPTURE(t->label);
        if (Keeps::value || t->rebinds == 0) {  // buffers are not rebound without MixedPrecision
          check_as_built(*t);
          kept += static_cast<std::int64_t>(t->storage->size() * 4);
        } else {
          CHECK(t->storage == nullptr);
          CHECK(t->data == nullptr);
          ++lost;
        }
      }
      CHECK(f.live_bytes == kept);
      CHECK(f.calls >= 10);  // rank 0 took over every parameter and gradient before the agreement
      if (Keeps::value) {
        CHECK(kept == built_bytes);
        CHECK(contains(msg, "; nothing was taken over here either, and every tensor keeps its storage and values"));
      } else {
        CHECK(contains(msg, "; nothing was taken over here either, but " + std::to_string(lost) +
                                " tensors rebound here are left without storage"));
      }
    }
    CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
    CHECK(device.stats(fsdp::MemorySpace::host).live_bytes == 0);
  });
}

TEST_CASE("a unit built alone (its constructor takes over): a throwing rebind gives its tensors back") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    for (int n = 1; n <= 4; ++n) {  // the unit's two gradients, then its two parameters
      CAPTURE(n);
      RebindFaults f;
      f.throw_at = n;
      Layer<true> layer(f, "a", 100);
      const std::int64_t built_bytes = f.live_bytes;
      fsdp::HostDevice device;
      CHECK(contains(test_support::error_of([&] { fsdp::Sharded<Layer<true>> unit(layer, comm, device); }),
                     "; nothing was taken over, and every tensor keeps its storage and values"));
      for (auto* t : {&layer.w, &layer.bias, &layer.gw, &layer.gbias, &layer.mean}) check_as_built(*t);
      CHECK(f.live_bytes == built_bytes);
      CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
    }
  });
}

namespace {

// The engine's memory, counted.
struct CountingAllocator final : engine::Allocator {
  std::int64_t live = 0;
  void* allocate(std::size_t bytes) override {
    live += static_cast<std::int64_t>(bytes);
    return bytes ? ::operator new(bytes) : nullptr;
  }
  void deallocate(void* p, std::size_t bytes) override {
    live -= static_cast<std::int64_t>(bytes);
    ::operator delete(p);
  }
};

// The library's reference tensors (HostTensor, the example engine's Tensor) in the root and
// unit `a`; unit `b` holds tensors whose rebind throws and that have no keep/restore.
struct EngineLayer {
  engine::Tensor w, gw;
  explicit EngineLayer(CountingAllocator& alloc) : w({3, 2}, alloc), gw({3, 2}, alloc) {
    for (int i = 0; i < 6; ++i) w[i] = 100.0f + static_cast<float>(i);
  }
  template <class F> void visit_parameters(F&& f) { f("w", w, gw); }
};
struct ThrowingLayer {
  Owned<false> w, bias, gw, gbias;
  explicit ThrowingLayer(RebindFaults& f) : w(f, "b.w", {2}, 7), bias(f, "b.bias", {2}, 9), gw(f, "b.w#grad", {2}, 0), gbias(f, "b.bias#grad", {2}, 0) {}
  template <class F> void visit_parameters(F&& f) { f("w", w, gw), f("bias", bias, gbias); }
};
struct MixedNet {
  fsdp::HostTensor gain{{4}}, ggain{{4}};
  EngineLayer a;
  ThrowingLayer b;
  MixedNet(CountingAllocator& alloc, RebindFaults& f) : a(alloc), b(f) {
    for (int i = 0; i < 4; ++i) gain.as<float>()[i] = 1000.0f + static_cast<float>(i);
  }
  template <class F> void visit_parameters(F&& f) { f("gain", gain, ggain); }
  template <class F> void visit_children(F&& f) { f("a", a), f("b", b); }
};

}  // namespace

TEST_CASE("HostTensor and the example engine's Tensor get storage and values back from a later unit's failure") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    for (int n = 1; n <= 2; ++n) {  // b.w's gradient throws; then b.bias's, after b.w's was rebound
      CAPTURE(n);
      CountingAllocator alloc;
      RebindFaults f;
      f.throw_at = n;
      {
        MixedNet net(alloc, f);
        const std::int64_t engine_bytes = alloc.live;
        fsdp::HostDevice device;
        const std::string msg = test_support::error_of([&] {
          fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_modules(net.a, net.b));
        });
        CAPTURE(msg);
        CHECK(contains(msg, "unit 'b' on rank " + std::to_string(comm.rank()) + ": tensor_traits<T>::rebind threw"));
        CHECK(contains(msg, n == 1 ? "nothing was taken over, and every tensor keeps its storage and values"
                                   : "nothing was taken over, but 1 tensor rebound before it is left without storage"));
        REQUIRE(net.gain.owns_storage());
        REQUIRE(net.ggain.owns_storage());
        for (int i = 0; i < 4; ++i) CHECK(net.gain.as<float>()[i] == 1000.0f + static_cast<float>(i));
        REQUIRE(net.a.w.raw());
        REQUIRE(net.a.gw.raw());
        for (int i = 0; i < 6; ++i) CHECK(net.a.w[i] == 100.0f + static_cast<float>(i));
        CHECK(alloc.live == engine_bytes);  // nothing the engine allocated was freed
        CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
      }
      CHECK(alloc.live == 0);  // and nothing leaked
    }
  });
}

TEST_CASE("HostTensor and the example engine's Tensor: a committed take-over frees their storage") {
  fsdp::ThreadGroup(2).run([](fsdp::ThreadComm& comm) {
    CountingAllocator alloc;
    RebindFaults f;
    MixedNet net(alloc, f);
    fsdp::HostDevice device;
    auto model = fsdp::shard<fsdp::FullShard>(net, comm, device,
                                              fsdp::wrap_modules(net.a, net.b));
    CHECK(model.size() == 3);
    CHECK(alloc.live == 0);
    CHECK(!net.gain.owns_storage());
    CHECK(net.gain.data() == nullptr);
    CHECK(net.a.w.raw() == nullptr);
  });
}

namespace {

// Ties, for a type with keep/restore: `w` and `w_tied` are two tensor objects on one
// storage (as are their gradients); `u` is one object visited under two names.
struct TiedLayer {
  Owned<true> w, gw, w_tied, gw_tied, u, gu;
  explicit TiedLayer(RebindFaults& f)
      : w(f, "t.w", {3}, 300), gw(f, "t.w#grad", {3}, 0), w_tied(f, "t.w_tied", w), gw_tied(f, "t.w_tied#grad", gw),
        u(f, "t.u", {2}, 400), gu(f, "t.u#grad", {2}, 0) {}
  template <class F> void visit_parameters(F&& f) {
    f("w", w, gw), f("u", u, gu), f("w_tied", w_tied, gw_tied), f("u_again", u, gu);
  }
};
struct TiedNet {
  Owned<true> gain, ggain;
  TiedLayer t;
  explicit TiedNet(RebindFaults& f) : gain(f, "gain", {5}, 1000), ggain(f, "gain#grad", {5}, 0), t(f) {}
  template <class F> void visit_parameters(F&& f) { f("gain", gain, ggain); }
  template <class F> void visit_children(F&& f) { f("t", t); }
  std::vector<Owned<true>*> tensors() { return {&gain, &ggain, &t.w, &t.gw, &t.w_tied, &t.gw_tied, &t.u, &t.gu}; }
};

}  // namespace

TEST_CASE_TEMPLATE("ties (two objects on one storage, one object under two names) come back whole", Strategy,
                   fsdp::FullShard, fsdp::NoShard) {
  int calls = 0;
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    RebindFaults f;
    TiedNet net(f);
    fsdp::HostDevice device;
    auto model = fsdp::shard<Strategy>(net, comm, device, fsdp::wrap_types<TiedLayer>{});
    CHECK(model.parameters().size() == 3);  // gain, t.w, t.u: the tied names are aliases
    calls = f.calls;
  });
  REQUIRE(calls == 10);  // every tensor object once, `u` and `gu` twice
  for (int n = 1; n <= calls; ++n) {
    CAPTURE(n);
    fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
      RebindFaults f;
      f.throw_at = n;
      TiedNet net(f);
      std::vector<std::pair<void*, std::vector<float>*>> built;
      for (auto* t : net.tensors()) built.emplace_back(t->data, t->storage);
      const std::int64_t built_bytes = f.live_bytes;
      fsdp::HostDevice device;
      const std::string msg = test_support::error_of(
          [&] { fsdp::shard<Strategy>(net, comm, device, fsdp::wrap_types<TiedLayer>{}); });
      CHECK(contains(msg, "; nothing was taken over, and every tensor keeps its storage and values"));
      const auto tensors = net.tensors();
      for (std::size_t k = 0; k < tensors.size(); ++k) {
        const Owned<true>& t = *tensors[k];
        CAPTURE(t.label);
        CHECK(t.data == built[k].first);  // views too: restored newest first, each to what it showed
        CHECK(t.storage == built[k].second);
        CHECK(t.dtype == fsdp::DType::f32);
        const auto* values = static_cast<const float*>(t.data);
        for (std::int64_t i = 0; i < t.shape[0]; ++i) CHECK(values[i] == t.first + static_cast<float>(i));
      }
      CHECK(f.live_bytes == built_bytes);
      CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
    });
  }
}

TEST_CASE("a keep that throws: an fsdp::Error naming keep, and every tensor as it was") {
  for (int n = 1; n <= 10; ++n) {  // 5 parameters and their gradients
    CAPTURE(n);
    fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
      RebindFaults f;
      f.keep_throw_at = n;
      Net<true> net(f);
      const std::int64_t built_bytes = f.live_bytes;
      fsdp::HostDevice device;
      const std::string msg = shard_error<fsdp::FullShard>(net, comm, device);
      CHECK(contains(msg, ": tensor_traits<T>::keep threw while the unit took over "));
      CHECK(contains(msg, ": no memory to keep it; nothing was taken over, and every tensor keeps its storage and values"));
      for (auto* t : net.tensors()) check_as_built(*t);
      CHECK(f.live_bytes == built_bytes);
      CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
    });
  }
}

TEST_CASE("ShardedModel::take_over after a failed one: it takes over, and units taken over before stay so") {
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) {
    RebindFaults f;
    Net<true> net(f);
    const std::int64_t built_bytes = f.live_bytes;
    fsdp::HostDevice device;
    {
      fsdp::ShardedModel model;
      model.emplace<fsdp::Sharded<Layer<true>, fsdp::NoShard>>(net.a, comm, device, "a");  // takes over now
      model.emplace<fsdp::Sharded<Layer<true>>>(net.b, comm, device, "b", fsdp::ShardOptions{.defer_take_over = true});
      const void* a_storage = net.a.w.data;  // NoShard: the unit's replicated storage, for good
      CHECK(a_storage != nullptr);
      CHECK(net.a.w.storage == nullptr);
      REQUIRE(net.b.w.storage);
      f.throw_at = f.calls + 2;  // in b
      CHECK(contains(test_support::error_of([&] { model.take_over(); }), "unit 'b' on rank 0: tensor_traits<T>::rebind threw"));
      CHECK(net.a.w.data == a_storage);  // a stays taken over: it was not part of the failed take-over
      CHECK(model[0].parameters().size() == 2);
      CHECK(model[1].parameters().empty());  // b took over nothing
      CHECK(net.b.w.data == net.b.w.storage->data());
      f.throw_at = 0;
      model.take_over();
      model.take_over();  // nothing left to do
      CHECK(net.b.w.data == nullptr);
      CHECK(net.b.w.storage == nullptr);
      {
        auto summoned = model[1].summon_full_params();  // b's values made it into its shards
        for (int i = 0; i < 12; ++i) CHECK(static_cast<const float*>(net.b.w.data)[i] == 200.0f + static_cast<float>(i));
      }
    }
    CHECK(net.a.w.data == nullptr);  // a's unit, destroyed, left no view of its storage
    // The units gave the tensors back empty: only the buffers (never taken) hold storage.
    std::int64_t buffers = 0;
    for (auto* t : net.tensors()) buffers += t->storage ? static_cast<std::int64_t>(t->storage->size() * 4) : 0;
    CHECK(buffers == 2 * 3 * 4 + 5 * 4 * 2);  // a.mean, b.mean; gain and its gradient were never sharded
    CHECK(f.live_bytes == buffers);
    CHECK(built_bytes - buffers == 2 * (12 + 3) * 4 * 2);  // a's and b's parameters and gradients, freed
  });
}

}  // namespace faults_take_over_test
