// Setup agreement (fsdp/unit/unit_setup.hpp): ranks that build a unit with another policy,
// option or buffer fail on every rank with an fsdp::Error naming the unit, the setting and
// each rank's value, before any collective of training could pair up wrong buffers; and
// ranks that agree pay no collective for it beyond the unit's one hash all-gather.
#include <doctest/doctest.h>

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "fsdp/testing/counting_communicator.hpp"
#include "fsdp/model/deferred_init.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/host/thread_group.hpp"
#include "fsdp/model/shard.hpp"
#include "test/support/rank_errors.hpp"
#include <fsdp/unit/sharded.hpp>  // fsdp::Sharded: units built by hand

namespace faults_unit_setup_test {

namespace {

// A host tensor that can be shown in another dtype (MixedPrecision needs it).
struct Cell {
  std::vector<std::int64_t> shape;
  fsdp::DType dtype = fsdp::DType::f32;
  std::vector<std::byte> owned;
  void* data = nullptr;
  Cell(std::vector<std::int64_t> s, fsdp::DType t = fsdp::DType::f32) : shape(std::move(s)), dtype(t) {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    owned.assign(static_cast<std::size_t>(n) * fsdp::size_of(t), std::byte{0});
    data = owned.empty() ? nullptr : owned.data();
  }
};

struct Layer {
  Cell w{{4, 3}}, g{{4, 3}};
  std::vector<Cell> buffers;
  std::vector<std::string> buffer_names;
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
  template <class F> void visit_buffers(F&& f) {
    for (std::size_t i = 0; i < buffers.size(); ++i) f(buffer_names[i], buffers[i]);
  }
};

struct Net {
  Layer a, b;
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) { f("a", a), f("b", b); }
};

using fsdp::ThreadComm;
using test_support::contains;
using test_support::errors_per_rank;

// Every rank's message names the unit and the setting, with rank 0's and rank 1's values.
void check_named(const std::vector<std::string>& msgs, const std::string& unit, const std::string& setting) {
  for (std::size_t r = 0; r < msgs.size(); ++r) {
    CAPTURE(r);
    CAPTURE(msgs[r]);
    CHECK(contains(msgs[r], "fsdp: unit '" + unit + "': ranks differ in the " + setting));
  }
}

}  // namespace

}  // namespace faults_unit_setup_test

// (Outside this file's namespace: fsdp::tensor_traits is specialized at namespace scope.)
template <>
struct fsdp::tensor_traits<faults_unit_setup_test::Cell> {
  using Cell = faults_unit_setup_test::Cell;
  static DType dtype(const Cell& t) { return t.dtype; }
  static std::span<const std::int64_t> shape(const Cell& t) { return t.shape; }
  static void* data(Cell& t) { return t.data; }
  static DeviceId device(const Cell&) { return {}; }
  static void rebind(Cell& t, void* p) { t.owned.clear(), t.data = p; }
  static void rebind(Cell& t, void* p, DType d) { rebind(t, p), t.dtype = d; }
};

namespace faults_unit_setup_test {

namespace {

// Shards Net on every rank with policies Ps on rank 0 and Qs elsewhere.
template <class... Ps>
struct On0 {
  template <class... Qs>
  struct Else {
    template <class... Options>
    static std::vector<std::string> run(int world, const Options&... options) {
      return errors_per_rank(world, [&](ThreadComm& comm) {
        Net net;
        fsdp::HostDevice device;
        if (comm.rank() == 0) fsdp::shard<Ps...>(net, comm, device, fsdp::wrap_types<Layer>{}, options...);
        else fsdp::shard<Qs...>(net, comm, device, fsdp::wrap_types<Layer>{}, options...);
      });
    }
  };
};

}  // namespace

TEST_CASE("the sharding strategy: FullShard against ShardGradOp (same groups, so the unit hash alone agreed)") {
  const auto msgs = On0<fsdp::FullShard>::Else<fsdp::ShardGradOp>::run(3);
  check_named(msgs, "<root>", "sharding strategy: rank 0 FullShard, rank 1 ShardGradOp");
}

TEST_CASE("the mixed precision") {
  const auto msgs = On0<fsdp::MixedPrecision<fsdp::bf16>>::Else<fsdp::FullPrecision>::run(2);
  check_named(msgs, "<root>", "mixed precision: rank 0 MixedPrecision<bf16, bf16, bf16, false>, rank 1 FullPrecision");
  // Reduce and buffer dtypes count too.
  const auto reduce = On0<fsdp::MixedPrecision<fsdp::bf16, float>>::Else<fsdp::MixedPrecision<fsdp::bf16>>::run(2);
  check_named(reduce, "<root>", "mixed precision: rank 0 MixedPrecision<bf16, float, bf16, false>, rank 1 MixedPrecision<bf16, bf16, bf16, false>");
}

TEST_CASE("the communication precision") {
  const auto msgs = On0<fsdp::FullCommPrecision>::Else<fsdp::CommPrecision<fsdp::bf16>>::run(2);
  check_named(msgs, "<root>", "communication precision: rank 0 FullCommPrecision, rank 1 CommPrecision<bf16, bf16>");
}

TEST_CASE("the backward prefetch policy") {
  const auto msgs = On0<fsdp::BackwardPre>::Else<fsdp::BackwardPost>::run(2);
  check_named(msgs, "<root>", "backward prefetch: rank 0 BackwardPre, rank 1 BackwardPost");
}

TEST_CASE("the forward prefetch policy") {
  const auto msgs = On0<>::Else<fsdp::ForwardPrefetch>::run(2);
  check_named(msgs, "<root>", "forward prefetch: rank 0 NoForwardPrefetch, rank 1 ForwardPrefetch");
}

TEST_CASE("cpu offload") {
  const auto msgs = On0<fsdp::OffloadParams>::Else<fsdp::NoOffload>::run(2);
  check_named(msgs, "<root>", "cpu offload: rank 0 OffloadParams, rank 1 NoOffload");
}

// Shards Net on 2 ranks with ShardOptions that `set(options, rank)` fills in.
template <class Set>
std::vector<std::string> run_with_options(Set set) {
  return errors_per_rank(2, [&](ThreadComm& comm) {
    Net net;
    fsdp::HostDevice device;
    fsdp::ShardOptions o;
    set(o, comm.rank());
    fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{}, o);
  });
}

TEST_CASE("ShardOptions: sync_module_states and persistence_threshold") {
  SUBCASE("sync_module_states") {
    const auto msgs = run_with_options([](fsdp::ShardOptions& o, int rank) { o.sync_module_states = rank == 1; });
    check_named(msgs, "<root>", "sync_module_states: rank 0 false, rank 1 true");
  }
  SUBCASE("persistence_threshold (each rank would keep other units unsharded)") {
    const auto msgs = run_with_options([](fsdp::ShardOptions& o, int rank) { o.persistence_threshold = rank == 1 ? 100 : 0; });
    check_named(msgs, "<root>", "persistence_threshold: rank 0 0, rank 1 100");
  }
}

TEST_CASE("deferred init checked on some ranks only (its per-parameter all-gathers would run on those alone)") {
  const auto msgs = errors_per_rank(2, [](ThreadComm& comm) {
    Net net;
    fsdp::HostDevice device;
    auto init = [](auto&, std::string_view) {};
    if (comm.rank() == 0) fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{}, fsdp::deferred_init(init));
    else fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{}, fsdp::deferred_init(init, fsdp::InitCheck::none));
  });
  check_named(msgs, "<root>", "deferred init: rank 0 on, values compared, rank 1 on, not compared");
}

TEST_CASE("ShardOptions of a unit built by hand") {
  const auto msgs = errors_per_rank(2, [](ThreadComm& comm) {
    Layer layer;
    fsdp::HostDevice device;
    fsdp::ShardOptions o;
    o.persistence_threshold = comm.rank() == 0 ? 0 : 5;
    fsdp::Sharded<Layer> unit(layer, comm, device, "blocks.2", o);
  });
  check_named(msgs, "blocks.2", "persistence_threshold: rank 0 0, rank 1 5");
}

TEST_CASE("buffers: a shape with the same element count, a dtype, a buffer one rank lacks") {
  SUBCASE("same count, other shape, under sync_module_states (which broadcasts by count)") {
    const auto msgs = errors_per_rank(3, [](ThreadComm& comm) {
      Net net;
      net.b.buffer_names = {"running_mean"};
      net.b.buffers.emplace_back(comm.rank() == 2 ? std::vector<std::int64_t>{8} : std::vector<std::int64_t>{4, 2});
      fsdp::HostDevice device;
      fsdp::ShardOptions o;
      o.sync_module_states = true;
      fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{}, o);
    });
    check_named(msgs, "b", "buffer 'b.running_mean': rank 0 [4, 2] f32, rank 2 [8] f32");
  }
  SUBCASE("dtype") {
    const auto msgs = errors_per_rank(2, [](ThreadComm& comm) {
      Net net;
      net.a.buffer_names = {"steps"};
      net.a.buffers.emplace_back(std::vector<std::int64_t>{1}, comm.rank() == 0 ? fsdp::DType::i64 : fsdp::DType::f32);
      fsdp::HostDevice device;
      fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{});
    });
    check_named(msgs, "a", "buffer 'a.steps': rank 0 [1] i64, rank 1 [1] f32");
  }
  SUBCASE("a buffer on rank 1 only") {
    const auto msgs = errors_per_rank(2, [](ThreadComm& comm) {
      Net net;
      if (comm.rank() == 1) {
        net.a.buffer_names = {"extra"};
        net.a.buffers.emplace_back(std::vector<std::int64_t>{3});
      }
      fsdp::HostDevice device;
      fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{});
    });
    check_named(msgs, "a", "buffer 'a.extra': rank 1 has it ([3] f32), rank 0 not");
  }
}

TEST_CASE("a parameter difference still shows both ranks' parameters") {
  const auto msgs = errors_per_rank(2, [](ThreadComm& comm) {
    Net net;
    if (comm.rank() == 1) net.b.w = Cell({6, 2}), net.b.g = Cell({6, 2});
    fsdp::HostDevice device;
    fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{});
  });
  for (const auto& m : msgs) {
    CAPTURE(m);
    CHECK(contains(m, "unit 'b' differs across ranks"));
    CHECK(contains(m, "rank 0 has 1 parameters, 12 elements: b.w [4, 3] f32 (shard group of 2 ranks"));
    CHECK(contains(m, "rank 1 has 1 parameters, 12 elements: b.w [6, 2] f32"));
  }
}

TEST_CASE("ranks that agree: one 8-byte all-gather per unit and one for the set of units, one 4-byte all-reduce "
          "for the take-over (all ranks or none), nothing else") {
  fsdp::ThreadGroup(2).run([](ThreadComm& comm) {
    fsdp::CountingCommunicator<ThreadComm> counted(comm);
    Net net;
    net.a.buffer_names = {"running_mean"};
    net.a.buffers.emplace_back(std::vector<std::int64_t>{4});
    fsdp::HostDevice device;
    auto model = fsdp::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>, fsdp::BackwardPost>(
        net, counted, device, fsdp::wrap_types<Layer>{});
    const auto c = counted.counts();
    CHECK(model.size() == 3);
    CHECK(c[fsdp::Collective::all_gather].calls == 4);
    CHECK(c[fsdp::Collective::all_gather].bytes == 4 * 2 * 8);
    CHECK(c[fsdp::Collective::all_reduce].calls == 1);
    CHECK(c[fsdp::Collective::all_reduce].bytes == 4);
    CHECK(c[fsdp::Collective::broadcast].calls == 0);
  });
}

namespace {

// Rank r's values: its parameters hold r + 1, its buffers 10 * (r + 1).
void fill(Cell& c, float v) {
  auto* p = static_cast<float*>(c.data);
  for (std::size_t i = 0; i < c.owned.size() / sizeof(float); ++i) p[i] = v;
}
bool all_equal(const Cell& c, float v) {
  if (c.data == nullptr || c.dtype != fsdp::DType::f32) return false;
  const auto* p = static_cast<const float*>(c.data);
  for (std::size_t i = 0; i < c.owned.size() / sizeof(float); ++i)
    if (p[i] != v) return false;
  return true;
}

// Net with a running_mean buffer in `a`; unit `b` differs on rank 1, so shard() fails there
// after unit `a` was built (and synchronised from rank 0).
template <class... Ps>
void check_failed_sync_keeps_values() {
  fsdp::ThreadGroup(2).run([](ThreadComm& comm) {
    const float mine = static_cast<float>(comm.rank() + 1);
    Net net;
    net.a.buffer_names = {"running_mean"};
    net.a.buffers.emplace_back(std::vector<std::int64_t>{4});
    if (comm.rank() == 1) net.b.w = Cell({6, 2}), net.b.g = Cell({6, 2});
    fill(net.a.w, mine), fill(net.a.buffers[0], 10 * mine), fill(net.b.w, mine);
    fsdp::HostDevice device;
    fsdp::ShardOptions o;
    o.sync_module_states = true;
    CHECK_THROWS_WITH_AS(fsdp::shard<Ps...>(net, comm, device, fsdp::wrap_types<Layer>{}, o),
                         doctest::Contains("unit 'b' differs across ranks"), fsdp::Error);
    CHECK(all_equal(net.a.w, mine));
    CHECK(all_equal(net.a.buffers[0], 10 * mine));
    CHECK(all_equal(net.b.w, mine));
    CHECK(device.stats(fsdp::MemorySpace::device).live_bytes == 0);
  });
}

}  // namespace

TEST_CASE("sync_module_states and a shard() that fails at a later unit: every rank keeps its own values") {
  SUBCASE("FullShard") { check_failed_sync_keeps_values<fsdp::FullShard>(); }
  SUBCASE("MixedPrecision<bf16> (buffers copied and cast)") {
    check_failed_sync_keeps_values<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16>>();
  }
  SUBCASE("NoShard") { check_failed_sync_keeps_values<fsdp::NoShard>(); }
}

TEST_CASE("sync_module_states that succeeds: rank 0's values in every rank's parameters and buffers") {
  fsdp::ThreadGroup(2).run([](ThreadComm& comm) {
    const float mine = static_cast<float>(comm.rank() + 1);
    Net net;
    net.a.buffer_names = {"running_mean"};
    net.a.buffers.emplace_back(std::vector<std::int64_t>{4});
    fill(net.a.w, mine), fill(net.a.buffers[0], 10 * mine), fill(net.b.w, mine);
    fsdp::HostDevice device;
    fsdp::ShardOptions o;
    o.sync_module_states = true;
    auto model = fsdp::shard<fsdp::FullShard>(net, comm, device, fsdp::wrap_types<Layer>{}, o);
    CHECK(all_equal(net.a.buffers[0], 10.0f));  // the engine's buffer, written at the take-over
    {
      auto summon = model.summon_full_params();
      CHECK(all_equal(net.a.w, 1.0f));
      CHECK(all_equal(net.b.w, 1.0f));
    }
  });
}

}  // namespace faults_unit_setup_test
