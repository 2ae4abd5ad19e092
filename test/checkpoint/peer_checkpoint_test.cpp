// fsdp::PeerCheckpoint: a rank whose memory is gone gets its state back from its neighbour
// (from a replica under HybridShard), the survivors go back to their own copy, and training
// goes on to the parameters of a run without the failure, bit for bit. Losses it cannot
// recover from fail on every rank alike and load nothing.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/peer_checkpoint.hpp"
#include "test/checkpoint/resume_training.hpp"

namespace checkpoint_peer_checkpoint_test {

namespace {

using test_support::contains;
using test_support::Params;

constexpr int kSteps = 6;

// One rank's copy alone, exactly its size (refresh() writes it into a padded buffer).
fsdp::detail::PeerBytes serialize(fsdp::ShardedModel& model, fsdp::OptimizerState* optimizer, int rank, int world,
                                  std::int64_t step) {
  const fsdp::detail::PeerStateWriter w(model, optimizer);
  auto out = fsdp::detail::PeerBytes::of_size(w.size());
  w.write(out.data.get(), rank, world, step);
  return out;
}

// What happens to the run between steps: after step `after` (0-based) has run, before its
// refresh, ranks `lost` lose their memory (parameters, optimizer state and PeerCheckpoint
// replaced by garbage and a new one), and every rank calls restore().
struct Loss {
  int after = 3;
  std::vector<int> lost;
  bool restore = true;  // false: the lost ranks go on with the garbage (the test's control)
};

struct Outcome {
  Params params;                          // rank 0's full parameters at the end
  std::vector<fsdp::PeerRestore> reports; // every rank's restore()
  std::vector<test_support::Thrown> errors;  // every rank's restore() failure
  std::vector<char> untouched;            // whether a failed restore left the rank's state as it was
  std::vector<char> on_replicas;          // every rank's PeerCheckpoint::on_replicas() at the end
  std::vector<std::size_t> host_bytes;    // and its host_bytes()
  std::vector<float> gain_scale;          // and the first element of its buffer gain.scale
  std::vector<float> restored_gain_scale; // that element right after its restore()
};

// One rank's reference engine sharded with Strategy (the hybrid ones over a mesh of
// replicate groups of world/2 ranks and shard groups of 2: ranks r and r + 2 hold the same
// shards), its AdamW and the AdamW's state.
template <class Strategy = fsdp::FullShard>
struct Trainer {
  engine::Model model;
  fsdp::HostDevice device;
  std::unique_ptr<fsdp::DeviceMesh<fsdp::ThreadComm>> mesh;
  fsdp::ShardedModel sm;
  engine::DeviceAllocator<fsdp::HostDevice> alloc{device};
  engine::AdamW opt{{}, alloc};
  engine::AdamWState st{opt, sm};
  explicit Trainer(fsdp::ThreadComm& comm, std::uint64_t seed = 1)
      : model(test_support::resume_config(seed)),
        mesh(Strategy::hybrid ? std::make_unique<fsdp::DeviceMesh<fsdp::ThreadComm>>(comm, fsdp::MeshShape{comm.size() / 2, 2}) : nullptr),
        sm(make(comm)) {}
  fsdp::ShardedModel make(fsdp::ThreadComm& comm) {
    if constexpr (Strategy::hybrid) return fsdp::shard<Strategy>(model, *mesh, device, engine::Wrap{});
    else return fsdp::shard<Strategy>(model, comm, device, engine::Wrap{});
  }
};

// Overwrites this rank's shards and optimizer state, as a replacement process starts with
// other values: seed 7's initialisation would do, garbage makes a missed restore obvious.
void scramble(fsdp::ShardedModel& sm, engine::AdamWState& st, engine::AdamW& opt) {
  for (std::size_t k = 0; k < sm.shards().size(); ++k) {
    const auto& v = sm.shards()[k];
    std::fill_n(static_cast<float*>(v.param), v.numel, 12345.0f);
    for (const auto& name : st.state_names()) std::fill_n(static_cast<float*>(st.state(name, k, v.numel)), v.numel, -7.0f);
  }
  opt.set_step_count(999);
}

// Every parameter shard and optimizer moment of this rank, as bytes.
std::vector<float> local_state(fsdp::ShardedModel& sm, engine::AdamWState& st) {
  std::vector<float> out;
  for (std::size_t k = 0; k < sm.shards().size(); ++k) {
    const auto& v = sm.shards()[k];
    const auto* p = static_cast<const float*>(v.param);
    out.insert(out.end(), p, p + v.numel);
    for (const auto& name : st.state_names()) {
      const auto* m = static_cast<const float*>(st.state(name, k, v.numel));
      out.insert(out.end(), m, m + v.numel);
    }
  }
  return out;
}

// Trains kSteps steps with a refresh after each, its metadata the step ("engine.step");
// `distinct`: before each refresh, rank 0's buffer gain.scale takes a value no other rank
// has (a buffer each rank computes from its own data), and its metadata also holds its rank
// ("engine.rank"), so that rank 0's copy differs from its replica rank 2's.
template <class Strategy>
Outcome run(int world, std::optional<Loss> loss, fsdp::PeerCheckpointOptions options = {}, bool distinct = false) {
  const auto c = test_support::resume_config();
  Outcome out;
  std::vector<Params> params(static_cast<std::size_t>(world));
  out.reports.resize(static_cast<std::size_t>(world));
  out.errors.resize(static_cast<std::size_t>(world));
  out.untouched.resize(static_cast<std::size_t>(world));
  out.on_replicas.resize(static_cast<std::size_t>(world));
  out.host_bytes.resize(static_cast<std::size_t>(world));
  out.gain_scale.resize(static_cast<std::size_t>(world));
  out.restored_gain_scale.resize(static_cast<std::size_t>(world));
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    Trainer<Strategy> t(comm);
    auto& model = t.model;
    auto& sm = t.sm;
    auto& opt = t.opt;
    auto& st = t.st;
    auto peer = std::make_unique<fsdp::PeerCheckpoint>(options);
    const int local = test_support::kGlobalBatch / world;
    bool failed = false;
    for (int s = 0; s < kSteps;) {
      engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank() * local, local));
      ++s;
      if (loss && !failed && s == loss->after + 1) {
        failed = true;
        if (std::count(loss->lost.begin(), loss->lost.end(), comm.rank())) {
          scramble(sm, st, opt);
          model.gain.scale.data()[0] = -1.0f;
          peer = std::make_unique<fsdp::PeerCheckpoint>(options);
        }
        if (!loss->restore) continue;
        const auto before = local_state(sm, st);
        const long steps_before = opt.step_count();
        out.errors[r] = test_support::thrown_by([&] { out.reports[r] = peer->restore(comm, sm, &st); });
        if (out.errors[r].kind) {
          out.untouched[r] = local_state(sm, st) == before && opt.step_count() == steps_before;
          return;
        }
        out.restored_gain_scale[r] = model.gain.scale.data()[0];
        s = static_cast<int>(out.reports[r].step);
        continue;
      }
      if (distinct && comm.rank() == 0) model.gain.scale.data()[0] = 1000.0f + static_cast<float>(s);
      std::map<std::string, std::string> metadata{{"engine.step", std::to_string(s)}};
      if (distinct && comm.rank() == 0) metadata["engine.rank"] = "0";
      peer->refresh(comm, sm, &st, s, metadata);
    }
    out.on_replicas[r] = peer->on_replicas();
    out.host_bytes[r] = peer->host_bytes();
    out.gain_scale[r] = model.gain.scale.data()[0];
    params[r] = engine::gather_full_parameters(model, sm);
  });
  out.params = params[0];
  return out;
}

}  // namespace

TEST_CASE("a rank that lost its memory is restored from its neighbour's copy, and training ends where it would have") {
  const Params expected = run<fsdp::FullShard>(4, std::nullopt).params;
  for (const int lost : {2, 3}) {  // 3: its copy is on rank 0 (the ring wraps)
    CAPTURE(lost);
    const Outcome o = run<fsdp::FullShard>(4, Loss{3, {lost}});
    CHECK(o.params == expected);  // bit for bit
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const auto& rep = o.reports[static_cast<std::size_t>(r)];
      CHECK(rep.step == 3);  // the refresh after step 2: step 3 is redone
      CHECK(rep.metadata == std::map<std::string, std::string>{{"engine.step", "3"}});  // the engine's, of that step
      CHECK(rep.replaced == std::vector<int>{lost});
      CHECK((rep.bytes_received > 0) == (r == lost));
    }
  }
  // The control: without restore() the scrambled rank ends elsewhere.
  CHECK(run<fsdp::FullShard>(4, Loss{3, {2}, false}).params != expected);
}

TEST_CASE("restore() without a lost rank takes every rank back to the last refresh") {
  const Params expected = run<fsdp::ShardGradOp>(2, std::nullopt).params;
  const Outcome o = run<fsdp::ShardGradOp>(2, Loss{1, {}});
  CHECK(o.params == expected);
  CHECK(o.reports[0].step == 1);
  CHECK(o.reports[0].replaced.empty());
  CHECK(o.reports[1].bytes_received == 0);
}

TEST_CASE("rank 0 lost on two ranks: its copy comes from rank 1") {
  const Params expected = run<fsdp::ShardGradOp>(2, std::nullopt).params;
  const Outcome o = run<fsdp::ShardGradOp>(2, Loss{4, {0}});
  CHECK(o.params == expected);
  CHECK(o.reports[1].step == 4);
  CHECK(o.reports[0].bytes_received > 0);
}

TEST_CASE("two neighbours lost at once: every rank fails alike and nothing is loaded") {
  const Outcome o = run<fsdp::FullShard>(4, Loss{3, {1, 2}});
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const auto& e = o.errors[static_cast<std::size_t>(r)];
    REQUIRE(e.kind);
    CHECK(*e.kind == fsdp::ErrorKind::peer_lost);
    CHECK(contains(e.message, "PeerCheckpoint::restore on rank " + std::to_string(r)));
    CHECK(contains(e.message, "rank 1 was lost and so was rank 2, which held its copy"));
    CHECK(contains(e.message, "Nothing was loaded; resume from the last checkpoint on disk"));
    CHECK(o.untouched[static_cast<std::size_t>(r)]);
  }
}

TEST_CASE("under HybridShard a lost rank's state comes from its replica, and nothing is sent to rank + 1") {
  const Params expected = run<fsdp::HybridShard>(4, std::nullopt).params;
  fsdp::PeerCheckpointOptions neighbours;
  neighbours.use_replicas = false;
  const Outcome ring = run<fsdp::HybridShard>(4, std::nullopt, neighbours);
  CHECK(ring.params == expected);  // the copies change nothing
  for (const int lost : {1, 2}) {  // their replicas: ranks 3 and 0
    CAPTURE(lost);
    const Outcome o = run<fsdp::HybridShard>(4, Loss{3, {lost}});
    CHECK(o.params == expected);  // bit for bit
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      const auto& rep = o.reports[static_cast<std::size_t>(r)];
      CHECK(rep.step == 3);
      CHECK(rep.replaced == std::vector<int>{lost});
      CHECK(rep.sources == std::vector<int>{(lost + 2) % 4});
      CHECK(rep.from_replica == std::vector<char>{1});
      CHECK(o.on_replicas[static_cast<std::size_t>(r)]);
      // One copy and one kept for the next refresh, against four: no neighbour's copy.
      CHECK(o.host_bytes[static_cast<std::size_t>(r)] * 2 == ring.host_bytes[static_cast<std::size_t>(r)]);
      CHECK_FALSE(ring.on_replicas[static_cast<std::size_t>(r)]);
    }
  }
  // Without replicas the copy comes from rank + 1, as under FullShard.
  const Outcome o = run<fsdp::HybridShard>(4, Loss{3, {1}}, neighbours);
  CHECK(o.params == expected);
  CHECK(o.reports[0].sources == std::vector<int>{2});
  CHECK(o.reports[0].from_replica == std::vector<char>{0});
}

TEST_CASE("under HybridShard two neighbours lost are restored from their replicas; a shard whose every replica is lost is not") {
  const Params expected = run<fsdp::HybridShard>(4, std::nullopt).params;
  const Outcome o = run<fsdp::HybridShard>(4, Loss{3, {1, 2}});
  CHECK(o.params == expected);
  CHECK(o.reports[0].replaced == std::vector<int>{1, 2});
  CHECK(o.reports[0].sources == std::vector<int>{3, 0});
  const Outcome both = run<fsdp::HybridShard>(4, Loss{3, {1, 3}});  // ranks 1 and 3 hold the same shards
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    const auto& e = both.errors[static_cast<std::size_t>(r)];
    REQUIRE(e.kind);
    CHECK(*e.kind == fsdp::ErrorKind::peer_lost);
    CHECK(contains(e.message, "rank 1 was lost and so was its replica, rank 3, which held the same state"));
    CHECK(both.untouched[static_cast<std::size_t>(r)]);
  }
  // The same two lost without replicas: rank 1's copy is on rank 2 and rank 3's on rank 0.
  fsdp::PeerCheckpointOptions neighbours;
  neighbours.use_replicas = false;
  CHECK(run<fsdp::HybridShard>(4, Loss{3, {1, 3}}, neighbours).params == expected);
}

TEST_CASE("a replica whose bytes differ is no copy: refresh() sends every copy to rank + 1, and the lost rank gets its own state back") {
  const Outcome expected = run<fsdp::HybridShard>(4, std::nullopt, {}, true);
  const Outcome o = run<fsdp::HybridShard>(4, Loss{3, {0}}, {}, true);
  CHECK(o.params == expected.params);
  CHECK(o.reports[1].sources == std::vector<int>{1});  // rank 0's copy, from rank 1, not rank 2's state
  CHECK(o.reports[1].from_replica == std::vector<char>{0});
  CHECK(o.restored_gain_scale[0] == 1003.0f);  // its own buffer of step 3 (scrambled to -1 before the restore)
  CHECK(o.restored_gain_scale[2] != 1003.0f);
  CHECK(o.reports[0].metadata.at("engine.rank") == "0");  // rank 0's own metadata, from rank 1's copy
  CHECK(o.reports[2].metadata.count("engine.rank") == 0);
  for (int r = 0; r < 4; ++r) CHECK_FALSE(o.on_replicas[static_cast<std::size_t>(r)]);
}

TEST_CASE("where one replicate group's copies differ, the other group's still serve: two neighbours lost, both restored") {
  // Rank 0's buffer differs from its replica rank 2's: every refresh sends its copy to
  // rank + 1, and ranks 1 and 3 still agree. Rank 1 comes from its replica, rank 2 from
  // rank 3's copy.
  const Outcome expected = run<fsdp::HybridShard>(4, std::nullopt, {}, true);
  const Outcome o = run<fsdp::HybridShard>(4, Loss{3, {1, 2}}, {}, true);
  CHECK(o.params == expected.params);
  CHECK(o.reports[0].replaced == std::vector<int>{1, 2});
  CHECK(o.reports[0].sources == std::vector<int>{3, 3});
  CHECK(o.reports[0].from_replica == std::vector<char>{1, 0});
}

TEST_CASE("refresh() refuses ranks that disagree on using replicas") {
  std::vector<test_support::Thrown> errors(4);
  fsdp::ThreadGroup(4).run([&](fsdp::ThreadComm& comm) {
    Trainer<fsdp::HybridShard> t(comm);
    fsdp::PeerCheckpointOptions options;
    options.use_replicas = comm.rank() != 1;
    fsdp::PeerCheckpoint peer(options);
    errors[static_cast<std::size_t>(comm.rank())] = test_support::thrown_by([&] { peer.refresh(comm, t.sm, &t.st, 1); });
    CHECK_FALSE(peer.step());
  });
  for (std::size_t r = 0; r < 4; ++r) {
    CAPTURE(r);
    REQUIRE(errors[r].kind);
    CHECK(*errors[r].kind == fsdp::ErrorKind::mismatch);
    CHECK(contains(errors[r].message, "PeerCheckpoint::refresh on rank " + std::to_string(r) + ": this rank " +
                                          (r == 1 ? "does not use replicas as copies (shard groups of 0" : "uses replicas as copies (shard groups of 2")));
    CHECK(contains(errors[r].message, "but the ranks range from 0 to 2; every rank must pass the same PeerCheckpointOptions::use_replicas"));
  }
}

TEST_CASE("restore() before any refresh fails on every rank") {
  const Outcome o = run<fsdp::FullShard>(2, Loss{0, {}});
  for (const auto& e : o.errors) {
    REQUIRE(e.kind);
    CHECK(*e.kind == fsdp::ErrorKind::peer_lost);
    CHECK(contains(e.message, "refresh() has not completed on any rank"));
  }
  CHECK(o.untouched == std::vector<char>{1, 1});
}

TEST_CASE("refresh() refuses ranks that pass different steps, and a communicator that is not the model's") {
  std::vector<test_support::Thrown> step_errors(2), comm_errors(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    Trainer t(comm);
    auto& sm = t.sm;
    auto& st = t.st;
    fsdp::PeerCheckpoint peer;
    step_errors[r] = test_support::thrown_by([&] { peer.refresh(comm, sm, &st, 5 + comm.rank()); });
    CHECK_FALSE(peer.step());  // nothing committed
    auto alone = comm.split(comm.rank(), 0);  // a group of one
    comm_errors[r] = test_support::thrown_by([&] { peer.refresh(alone, sm, &st, 1); });
  });
  for (std::size_t r = 0; r < 2; ++r) {
    CAPTURE(r);
    REQUIRE(step_errors[r].kind);
    CHECK(*step_errors[r].kind == fsdp::ErrorKind::mismatch);
    CHECK(contains(step_errors[r].message, "this rank's step is " + std::to_string(5 + r) + ", but the ranks passed steps from 5 to 6"));
    REQUIRE(comm_errors[r].kind);
    CHECK(contains(comm_errors[r].message, "the communicator is rank 0 of 1, but the model was sharded as rank " + std::to_string(r) + " of 2"));
  }
}

TEST_CASE("a copy is checked before it is loaded: its checksum, its rank, world and step") {
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    Trainer t(comm);
    auto& model = t.model;
    auto& sm = t.sm;
    auto& st = t.st;
    auto bytes = serialize(sm, &st, 0, 1, 4);
    auto view = [&] { return bytes.view(); };
    const auto dict = fsdp::detail::parse_peer_state(view(), 0, 1, 4, "copy");
    CHECK(dict.optim_scalars.at("step") == "0");
    std::size_t buffers = 0;
    for (auto& u : sm) buffers += u->buffers().size();
    CHECK(buffers > 0);  // on every rank's copy, not only rank 0's
    CHECK(dict.slices.size() == 3 * engine::named_parameters(model).size() + buffers);  // each parameter, its two moments
    using test_support::thrown_by;
    const auto wrong_step = thrown_by([&] { fsdp::detail::parse_peer_state(view(), 0, 1, 5, "copy"); });
    CHECK(wrong_step.kind == fsdp::ErrorKind::mismatch);
    CHECK(contains(wrong_step.message, "copy: the copy is rank 0's of 1 ranks at step 4, not rank 0's of 1 at step 5"));
    fsdp::detail::relabel_peer_state(bytes.data.get(), 3);  // another rank's name, its payload the same
    CHECK(fsdp::detail::parse_peer_state(view(), 3, 1, 4, "copy").slices.size() == dict.slices.size());
    bytes.data[8 * 3] ^= std::byte{1};  // the header's rank field
    const auto header = thrown_by([&] { fsdp::detail::parse_peer_state(view(), 3, 1, 4, "copy"); });
    CHECK(header.kind == fsdp::ErrorKind::corrupt);
    CHECK(contains(header.message, "copy: the copy's header checksum does not match its header"));
    bytes.data[8 * 3] ^= std::byte{1};
    bytes.data[bytes.size / 2] ^= std::byte{1};
    const auto damaged = thrown_by([&] { fsdp::detail::parse_peer_state(view(), 0, 1, 4, "copy"); });
    CHECK(damaged.kind == fsdp::ErrorKind::corrupt);
    CHECK(contains(damaged.message, "checksum does not match"));
    bytes.size /= 2;  // cut short
    const auto cut = thrown_by([&] { fsdp::detail::parse_peer_state(view(), 0, 1, 4, "copy"); });
    CHECK(cut.kind == fsdp::ErrorKind::corrupt);
    CHECK(contains(cut.message, "copy: the copy says it holds "));
  });
}

// A refresh cut short: rank 2 fails in refresh(4)'s collective number `failing` (1: the
// agreement on the size, 2: the ring_shift, 3: the commit), every rank's group aborts, and
// the job goes on as the example does: a new group, every model built again, rank 2 with a
// new PeerCheckpoint, the survivors with theirs, and every rank restores. Returns the step
// restored and rank 0's parameters after training to the end.
std::pair<std::int64_t, Params> refresh_cut_short(int failing) {
  const auto c = test_support::resume_config();
  constexpr int world = 4, lost = 2;
  const int local = test_support::kGlobalBatch / world;
  std::vector<std::unique_ptr<fsdp::PeerCheckpoint>> peers(world);
  std::atomic<int> armed{0};  // rank 2's collectives left before it fails, once armed
  fsdp::ThreadGroup::Options options;
  options.fault_hook = [&](const fsdp::CollectivePoint& p) {
    if (p.rank == lost && p.stage == fsdp::CollectiveStage::posted && armed.load() > 0 && --armed == 0)
      throw fsdp::Error(fsdp::ErrorKind::peer_lost, "rank 2 is gone (injected)");
  };
  fsdp::ThreadGroup(world, options).run([&](fsdp::ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    Trainer t(comm);
    auto& model = t.model;
    auto& sm = t.sm;
    auto& opt = t.opt;
    auto& st = t.st;
    peers[r] = std::make_unique<fsdp::PeerCheckpoint>();
    for (int s = 0; s < 4; ++s) {
      engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank() * local, local));
      if (s == 3 && comm.rank() == lost) armed = failing;
      const auto failed = test_support::thrown_by([&] { peers[r]->refresh(comm, sm, &st, s + 1); });
      CHECK(static_cast<bool>(failed.kind) == (s == 3));
    }
  });
  peers[lost] = std::make_unique<fsdp::PeerCheckpoint>();  // its memory is gone
  std::vector<std::int64_t> restored(world, -1);
  std::vector<Params> params(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    Trainer t(comm, 7);  // starts elsewhere: only the restore brings it back
    auto& model = t.model;
    auto& sm = t.sm;
    auto& opt = t.opt;
    auto& st = t.st;
    CHECK(peers[r]->restorable_step(comm).has_value());
    restored[r] = peers[r]->restore(comm, sm, &st).step;
    for (int s = static_cast<int>(restored[r]); s < kSteps; ++s) {
      engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank() * local, local));
      peers[r]->refresh(comm, sm, &st, s + 1);
    }
    params[r] = engine::gather_full_parameters(model, sm);
  });
  for (const auto s : restored) CHECK(s == restored[0]);
  return {restored[0], params[0]};
}

TEST_CASE("a refresh cut short by a lost rank: restore() takes the newest step every rank holds, and training ends where it would have") {
  const Params expected = run<fsdp::FullShard>(4, std::nullopt).params;
  // Lost in the agreement on the size or in the ring_shift: rank 3 never received rank 2's
  // copy of step 4, so every rank goes back to step 3.
  for (const int failing : {1, 2}) {
    CAPTURE(failing);
    const auto [step, params] = refresh_cut_short(failing);
    CHECK(step == 3);
    CHECK(params == expected);
  }
  // Lost in the commit: every copy of step 4 had arrived (the holder's still pending), so
  // step 4 it is, and nothing is redone.
  const auto [step, params] = refresh_cut_short(3);
  CHECK(step == 4);
  CHECK(params == expected);
}

// A ThreadComm whose rank, once armed, fails right after a refresh's checksum all_gather
// (count 1) has completed on it, before it could act on it: what a rank lost then leaves
// (ThreadComm's fault hook fails a collective on every rank alike, never on some only).
struct FailsAfterCheck {
  fsdp::ThreadComm& comm;
  bool armed = false;
  int rank() const { return comm.rank(); }
  int size() const { return comm.size(); }
  fsdp::Work all_gather(const void* send, void* recv, std::size_t n, fsdp::DType t) {
    comm.all_gather(send, recv, n, t).wait();
    if (armed && n == 1) {
      armed = false;
      throw fsdp::Error(fsdp::ErrorKind::peer_lost, "lost after the replicas' check (injected)");
    }
    return fsdp::Work{};
  }
  fsdp::Work all_reduce(const void* send, void* recv, std::size_t n, fsdp::DType t, fsdp::ReduceOp op) { return comm.all_reduce(send, recv, n, t, op); }
  fsdp::Work reduce_scatter(const void* send, void* recv, std::size_t n, fsdp::DType t, fsdp::ReduceOp op) {
    return comm.reduce_scatter(send, recv, n, t, op);
  }
  fsdp::Work broadcast(const void* send, void* recv, std::size_t n, fsdp::DType t, int root) { return comm.broadcast(send, recv, n, t, root); }
  fsdp::Work barrier() { return comm.barrier(); }
  fsdp::Work ring_shift(const void* send, void* recv, std::size_t n, fsdp::DType t) { return comm.ring_shift(send, recv, n, t); }
};

// HybridShard 2x2: refresh(4) fails on ranks `cut` right after the replicas' check, so they
// hold step 4 pending while the others committed it; then rank `lost` loses its memory and
// every rank restores. Returns rank 0's report and its parameters after training to the end.
std::pair<fsdp::PeerRestore, Params> replicas_checked_on_some(const std::vector<int>& cut, int lost) {
  const auto c = test_support::resume_config();
  constexpr int world = 4;
  const int local = test_support::kGlobalBatch / world;
  std::vector<std::unique_ptr<fsdp::PeerCheckpoint>> peers(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    Trainer<fsdp::HybridShard> t(comm);
    peers[r] = std::make_unique<fsdp::PeerCheckpoint>();
    FailsAfterCheck failing{comm};
    for (int s = 0; s < 4; ++s) {
      engine::sharded_step(t.model, t.sm, t.opt, engine::make_batch(c, s, comm.rank() * local, local));
      failing.armed = s == 3 && std::count(cut.begin(), cut.end(), comm.rank());
      const auto failed = test_support::thrown_by([&] { peers[r]->refresh(failing, t.sm, &t.st, s + 1); });
      CHECK(static_cast<bool>(failed.kind) == (s == 3 && std::count(cut.begin(), cut.end(), comm.rank()) > 0));
    }
  });
  peers[static_cast<std::size_t>(lost)] = std::make_unique<fsdp::PeerCheckpoint>();
  std::vector<fsdp::PeerRestore> reports(world);
  std::vector<Params> params(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    Trainer<fsdp::HybridShard> t(comm, 7);  // starts elsewhere: only the restore brings it back
    reports[r] = peers[r]->restore(comm, t.sm, &t.st);
    for (int s = static_cast<int>(reports[r].step); s < kSteps; ++s) {
      engine::sharded_step(t.model, t.sm, t.opt, engine::make_batch(c, s, comm.rank() * local, local));
      peers[r]->refresh(comm, t.sm, &t.st, s + 1);
    }
    params[r] = engine::gather_full_parameters(t.model, t.sm);
  });
  return {reports[0], params[0]};
}

TEST_CASE("a replicas' check that completed on some ranks only: restore() takes its step, from what the survivors saw") {
  const Params expected = run<fsdp::HybridShard>(4, std::nullopt).params;
  // Ranks 2 and 3 hold step 4 pending; ranks 0 and 1 committed it.
  // Rank 2 lost: its replica rank 0 saw its group agree at step 4.
  const auto [lost2, params2] = replicas_checked_on_some({2, 3}, 2);
  CHECK(lost2.step == 4);
  CHECK(lost2.sources == std::vector<int>{0});
  CHECK(lost2.from_replica == std::vector<char>{1});
  CHECK(params2 == expected);
  // Rank 0 lost: its replica rank 2 never learnt the check's outcome, but rank 1 did (every
  // copy agreed): rank 2's pending copy of step 4 serves.
  const auto [lost0, params0] = replicas_checked_on_some({2, 3}, 0);
  CHECK(lost0.step == 4);
  CHECK(lost0.sources == std::vector<int>{2});
  CHECK(params0 == expected);
}

TEST_CASE("restorable_step() tells a state that is gone from one that can be restored, on every rank") {
  std::vector<std::string> why(2);
  std::vector<char> restorable(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    Trainer t(comm);
    auto& sm = t.sm;
    auto& st = t.st;
    fsdp::PeerCheckpoint peer;
    restorable[r] = peer.restorable_step(comm, &why[r]).has_value();  // nothing refreshed yet
    peer.refresh(comm, sm, &st, 0);
    if (r == 0) peer = fsdp::PeerCheckpoint();  // rank 0 lost; rank 1 holds its copy
    std::string ignored;
    CHECK(peer.restorable_step(comm, &ignored) == 0);
  });
  CHECK(restorable == std::vector<char>{0, 0});
  for (const auto& w : why) CHECK(contains(w, "refresh() has not completed on any rank"));
}

TEST_CASE("the step restore() picks when a refresh was cut short") {
  using H = fsdp::detail::PeerHoldings;
  std::string why;
  // Every rank committed step 5; rank 2 is lost: step 5, from rank 3's copy.
  CHECK(fsdp::detail::peer_restore_step({{5, 10, 10}, {5, 10, 10}, {}, {5, 10, 10}}, why) == 5);
  // A refresh to 6 was sent and received everywhere, and committed on rank 0 only (it
  // dropped 5): every rank can reach 6.
  const H committed6{6, 10, 10}, pending6{5, 10, 10, 6, 10, 10};
  CHECK(fsdp::detail::peer_restore_step({committed6, pending6, {}, pending6}, why) == 6);
  // Rank 2 was lost in the ring_shift to 6: rank 3 never received its copy at 6, so every
  // rank goes back to 5, which each still holds.
  const H sent_not_received{5, 10, 10, 6, 10, 0};
  CHECK(fsdp::detail::peer_restore_step({pending6, pending6, {}, sent_not_received}, why) == 5);
  // Nothing at a step common to all: said, with the rank that lacks it.
  why.clear();
  CHECK_FALSE(fsdp::detail::peer_restore_step({committed6, {5, 10, 10}, {5, 10, 10}}, why));
  CHECK(contains(why, "rank 1 holds no copy of its own state at step 6"));
  why.clear();
  CHECK_FALSE(fsdp::detail::peer_restore_step({{}}, why));
  CHECK(contains(why, "refresh() has not completed on any rank"));
  // restore() refreshes at the step it restored: a holder whose committed copy of its
  // neighbour is gone (a replacement) may hold the new one only pending.
  CHECK(fsdp::detail::peer_restore_step({{5, 10, 10}, {}, {5, 10, 0, 5, 10, 10}, {5, 10, 10}}, why) == 5);
  // Two ranks, rank 1 lost: rank 0 holds its copy (the ring's two links are one pair).
  CHECK(fsdp::detail::peer_restore_step({{5, 10, 10}, {}}, why) == 5);
}

TEST_CASE("the step restore() picks where replicas hold the copies (shard groups of 2 in 4 ranks)") {
  using H = fsdp::detail::PeerHoldings;
  std::string why;
  const H shared5{5, 10, 0, -1, 0, 0, 5, 2};
  // Rank 1 lost: its replica rank 3 holds step 5 (no neighbour's copy anywhere).
  CHECK(fsdp::detail::peer_restore_step({shared5, {}, shared5, shared5}, why) == 5);
  // A refresh to 6 whose check of the replicas completed on rank 0 only: the others hold 6
  // pending, and rank 3's pending copy is rank 1's state at 6 (rank 0 saw their checksums agree).
  const H shared6{6, 10, 0, -1, 0, 0, 6, 2}, pending6{5, 10, 0, 6, 10, 0, 5, 2};
  CHECK(fsdp::detail::peer_restore_step({shared6, {}, pending6, pending6}, why) == 6);
  // No rank saw the check of 6 complete: step 5, from rank 3's committed copy.
  CHECK(fsdp::detail::peer_restore_step({pending6, {}, pending6, pending6}, why) == 5);
  // Rank 1 and its replica rank 3 lost.
  why.clear();
  CHECK_FALSE(fsdp::detail::peer_restore_step({shared5, {}, shared5, {}}, why));
  CHECK(contains(why, "rank 1 was lost and so was its replica, rank 3, which held the same state"));
  // A step whose replicas differed (no shared step): rank + 1's copy, as without replicas.
  CHECK(fsdp::detail::peer_restore_step({{5, 10, 10}, {}, {5, 10, 10}, {5, 10, 10}}, why) == 5);
}

}  // namespace checkpoint_peer_checkpoint_test
