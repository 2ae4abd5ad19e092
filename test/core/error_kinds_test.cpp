// fsdp::ErrorKind (fsdp/core/error.hpp): each kind as a real failure produces it, not as an
// Error constructed by hand: a hook in the wrong state (misuse), thread ranks entering units
// in different orders (mismatch), a collective whose peer never comes (timeout), a TCP peer
// that closes its connection (peer_lost, also on the ranks that hear of it only through the
// ring's ABORT frames), a checkpoint file with a flipped byte (corrupt, on every rank), a
// missing checkpoint directory and an unwritable path (io), a host allocation the system
// refuses (out_of_memory). Also to_string and the stream operator, and that an error raised
// on one rank keeps its kind on the others where the library re-raises it.
#include <doctest/doctest.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <optional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fsdp/checkpoint/checkpoint.hpp>
#include <fsdp/asio/tcp_frame.hpp>
#include <fsdp/core/error.hpp>
#include <fsdp/host/host_device.hpp>
#include <fsdp/host/thread_group.hpp>

#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"
#include "test/asio/tcp_world.hpp"
#include "test/support/errors.hpp"

namespace core_error_kinds_test {

namespace {

using fsdp::ErrorKind;
using test_support::contains;
using test_support::Thrown;
using test_support::thrown_by;
using namespace std::chrono_literals;

// fn(comm) on every rank of a ThreadGroup with a short timeout: what each rank threw.
template <class Fn>
std::vector<Thrown> per_rank(int world, Fn fn, std::chrono::milliseconds timeout = 2000ms) {
  std::vector<Thrown> out(static_cast<std::size_t>(world));
  fsdp::ThreadGroup(world, fsdp::ThreadGroupOptions{timeout}).run([&](fsdp::ThreadComm& comm) {
    out[static_cast<std::size_t>(comm.rank())] = thrown_by([&] { fn(comm); });
  });
  return out;
}

// A directory of its own under the test's temporary directory, removed at the end.
struct TempDir {
  std::filesystem::path path;
  explicit TempDir(const std::string& name) {
    const char* base = std::getenv("TEST_TMPDIR");
    path = std::filesystem::path(base ? base : "/tmp") /
           ("fsdp_error_kinds_" + name + "_" +
            std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ignored;
    std::filesystem::remove_all(path, ignored);
  }
};

std::string read_bytes(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}
void write_bytes(const std::filesystem::path& p, const std::string& bytes) {
  std::ofstream(p, std::ios::binary | std::ios::trunc) << bytes;
}

engine::ModelConfig small_model() {
  engine::ModelConfig c;
  c.blocks = 2;
  return c;
}

}  // namespace

TEST_CASE("every kind has a name, printed by to_string and operator<<; Error(std::string) is misuse") {
  const std::array<std::pair<ErrorKind, const char*>, 7> names = {{{ErrorKind::misuse, "misuse"},
                                                                   {ErrorKind::mismatch, "mismatch"},
                                                                   {ErrorKind::timeout, "timeout"},
                                                                   {ErrorKind::peer_lost, "peer_lost"},
                                                                   {ErrorKind::io, "io"},
                                                                   {ErrorKind::corrupt, "corrupt"},
                                                                   {ErrorKind::out_of_memory, "out_of_memory"}}};
  for (const auto& [kind, name] : names) {
    CHECK(fsdp::to_string(kind) == name);
    std::ostringstream os;
    os << kind;
    CHECK(os.str() == name);
  }
  CHECK(fsdp::Error("x").kind() == ErrorKind::misuse);
  const Thrown t = thrown_by([] { fsdp::detail::fail_as(ErrorKind::io, "cannot read '", "f", "'"); });
  CHECK(t.message == "fsdp: cannot read 'f'");
  CHECK(t.kind == ErrorKind::io);
}

TEST_CASE("a TCP ABORT frame carries its kind; one from a sender that states none reads as peer_lost") {
  using fsdp::detail::FrameHeader;
  std::array<std::byte, FrameHeader::kSize> wire{};
  std::string problem;
  for (ErrorKind k : {ErrorKind::misuse, ErrorKind::mismatch, ErrorKind::timeout, ErrorKind::peer_lost, ErrorKind::io,
                      ErrorKind::corrupt, ErrorKind::out_of_memory}) {
    CAPTURE(fsdp::to_string(k));
    FrameHeader::abort_with(5, k).encode(wire.data());
    const auto h = FrameHeader::decode(wire.data(), problem);
    REQUIRE(h.has_value());
    CHECK(h->abort_kind() == k);
  }
  // A sender built before kinds leaves count at 0: its rank failed, which is not the
  // receiver's misuse.
  FrameHeader old;
  old.type = fsdp::detail::FrameType::abort;
  old.bytes = 5;
  old.encode(wire.data());
  const auto h = FrameHeader::decode(wire.data(), problem);
  REQUIRE(h.has_value());
  CHECK(h->abort_kind() == ErrorKind::peer_lost);
}

TEST_CASE("misuse: a hook called in the wrong state") {
  const auto thrown = per_rank(2, [](fsdp::ThreadComm& comm) {
    engine::Model model(small_model());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    sm.unit("blocks.1").post_forward();  // never entered forward
  });
  for (const auto& t : thrown) {
    CAPTURE(t.message);
    CHECK(contains(t.message, "post_forward called in state IDLE; expected FORWARD"));
    CHECK(t.kind == ErrorKind::misuse);
  }
}

TEST_CASE("mismatch: thread ranks that enter units in different orders") {
  const auto thrown = per_rank(3, [](fsdp::ThreadComm& comm) {
    engine::Model model(small_model());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    sm.unit(comm.rank() == 1 ? "blocks.1" : "blocks.0").pre_forward();
  });
  for (const auto& t : thrown) {
    CAPTURE(t.message);
    CHECK(contains(t.message, "ranks run units in different orders"));
    CHECK(t.kind == ErrorKind::mismatch);
  }
}

TEST_CASE("mismatch: ranks that call different collectives on a ThreadComm") {
  const auto thrown = per_rank(2, [](fsdp::ThreadComm& comm) {
    std::vector<float> in(4, 1.0f), out(8);
    if (comm.rank() == 0)
      comm.all_gather(in.data(), out.data(), 4, fsdp::DType::f32).wait();
    else
      comm.all_reduce(in.data(), out.data(), 4, fsdp::DType::f32, fsdp::ReduceOp::sum).wait();
  });
  for (const auto& t : thrown) {
    CAPTURE(t.message);
    CHECK(contains(t.message, "collective mismatch"));
    CHECK(t.kind == ErrorKind::mismatch);
  }
}

TEST_CASE("timeout: a collective whose peer does not come within the timeout, on both ranks") {
  const auto thrown = per_rank(
      2,
      [](fsdp::ThreadComm& comm) {
        if (comm.rank() == 1) std::this_thread::sleep_for(600ms);  // busy elsewhere, then comes late
        comm.barrier().wait();
      },
      200ms);
  CAPTURE(thrown[0].message);
  CAPTURE(thrown[1].message);
  CHECK(contains(thrown[0].message, "timed out after 200 ms; ranks that never arrived: 1"));
  CHECK(contains(thrown[1].message, "not started: rank 0: barrier"));  // it hears of rank 0's timeout
  for (const auto& t : thrown) CHECK(t.kind == ErrorKind::timeout);
}

TEST_CASE("peer_lost: a thread rank that fails is a lost peer to the ranks that wait for it") {
  Thrown waiting;  // rank 0's
  const Thrown first = thrown_by([&] {
    fsdp::ThreadGroup(2, fsdp::ThreadGroupOptions{2000ms}).run([&](fsdp::ThreadComm& comm) {
      if (comm.rank() == 1) fsdp::detail::fail_as(ErrorKind::io, "rank 1 could not read its batch");
      waiting = thrown_by([&] { comm.barrier().wait(); });
    });
  });
  CAPTURE(waiting.message);
  CHECK(contains(waiting.message, "rank 1 failed: rank 1 could not read its batch"));
  CHECK(waiting.kind == ErrorKind::peer_lost);
  CHECK(first.message == "fsdp: rank 1 could not read its batch");  // ThreadGroup::run rethrows it as it was
  CHECK(first.kind == ErrorKind::io);
}

TEST_CASE("peer_lost: a TCP peer that closes its connection, seen directly and through ABORT frames") {
  test_support::TcpWorld world(4, [](int) {
    auto o = test_support::ok_options();
    o.timeout = 5s;
    return o;
  });
  std::vector<Thrown> thrown(4);
  test_support::on_threads(4, [&](int r) {
    thrown[static_cast<std::size_t>(r)] = thrown_by([&] {
      fsdp::TcpComm& comm = world.comm(r);
      std::vector<float> in(1 << 16, 1.0f), out(1 << 16);
      comm.all_reduce(in.data(), out.data(), in.size(), fsdp::DType::f32, fsdp::ReduceOp::sum).wait();
      if (r == 2) return world.destroy(2);
      comm.all_reduce(in.data(), out.data(), in.size(), fsdp::DType::f32, fsdp::ReduceOp::sum).wait();
    });
  });
  CHECK(!thrown[2].kind);
  // Ranks 1 and 3 are rank 2's neighbours; rank 0 hears of it only in the ABORT frames
  // that its neighbours pass on, which carry the kind.
  for (int r : {0, 1, 3}) {
    const Thrown& t = thrown[static_cast<std::size_t>(r)];
    CAPTURE(r);
    CAPTURE(t.message);
    CHECK(contains(t.message, "peer rank 2 closed the connection"));
    CHECK(t.kind == ErrorKind::peer_lost);
  }
  // The communicator stays broken, and says so with the same kind.
  const Thrown later = thrown_by([&] { world.comm(0).barrier().wait(); });
  CHECK(contains(later.message, "aborted: "));
  CHECK(later.kind == ErrorKind::peer_lost);
}

TEST_CASE("corrupt: a checkpoint file with a flipped byte fails the load on every rank") {
  TempDir tmp("corrupt");
  const auto dir = tmp.path / "ckpt";
  per_rank(2, [&](fsdp::ThreadComm& comm) {
    engine::Model model(small_model());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    fsdp::save_sharded_checkpoint(dir, sm);
  });
  const auto victim = dir / fsdp::checkpoint::rank_file_name(1);
  std::string bytes = read_bytes(victim);
  REQUIRE(bytes.size() > 16);
  bytes[bytes.size() - 5] ^= 0x40;  // in the data, not the header: only the checksum sees it
  write_bytes(victim, bytes);
  for (const bool staged : {false, true}) {
    CAPTURE(staged);
    const auto thrown = per_rank(2, [&](fsdp::ThreadComm& comm) {
      engine::Model model(small_model());
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
      fsdp::LoadOptions options;
      options.stage_in_host_memory = staged;
      fsdp::load_sharded_checkpoint(dir, sm, nullptr, options);
    });
    for (const auto& t : thrown) {
      CAPTURE(t.message);
      CHECK(contains(t.message, "XXH64"));
      CHECK(t.kind == ErrorKind::corrupt);
    }
  }
}

TEST_CASE("io: a checkpoint directory that does not exist, and a save where no directory can be made") {
  TempDir tmp("io");
  const auto missing = per_rank(2, [&](fsdp::ThreadComm& comm) {
    engine::Model model(small_model());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    fsdp::load_sharded_checkpoint(tmp.path / "never_saved", sm);
  });
  for (const auto& t : missing) {
    CAPTURE(t.message);
    CHECK(contains(t.message, "No such file or directory"));
    CHECK(t.kind == ErrorKind::io);
  }
  const auto unwritable = per_rank(2, [&](fsdp::ThreadComm& comm) {
    engine::Model model(small_model());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    fsdp::save_sharded_checkpoint(tmp.path / "no_parent" / "ckpt", sm);
  });
  // Rank 0 makes the staging directory and says why it cannot; rank 1 hears of it in the
  // agreement, with its kind.
  CAPTURE(unwritable[0].message);
  CAPTURE(unwritable[1].message);
  CHECK(contains(unwritable[0].message,
                 "its parent directory '" + (tmp.path / "no_parent").string() + "' does not exist"));
  CHECK(contains(unwritable[1].message, "another rank failed"));
  for (const auto& t : unwritable) CHECK(t.kind == ErrorKind::io);
}

// ASan and TSan report an allocation this large as a bug (allocation-size-too-big) instead
// of failing it, so the case runs only without them (g++ says so with __SANITIZE_ADDRESS__
// and __SANITIZE_THREAD__, clang 14 with __has_feature).
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define FSDP_TEST_UNDER_SANITIZER 1
#endif
#endif
#if !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__) && !defined(FSDP_TEST_UNDER_SANITIZER)
TEST_CASE("out_of_memory: a HostDevice allocation the system refuses") {
  fsdp::HostDevice device;
  const std::size_t huge = std::numeric_limits<std::size_t>::max() / 2;  // more than any address space
  const Thrown t = thrown_by([&] { device.allocate(huge); });
  CAPTURE(t.message);
  CHECK(contains(t.message, "HostDevice: out of memory allocating"));
  CHECK(t.kind == ErrorKind::out_of_memory);
  CHECK(device.stats().live_bytes == 0);
}
#endif

TEST_CASE("a failure re-raised on other ranks keeps its kind: checkpoint agreement") {
  // fsdp::detail::run_agreed: the rank that failed throws its own error; the others learn
  // its kind through the agreement (here corrupt, on rank 1 only).
  const auto thrown = per_rank(2, [](fsdp::ThreadComm& comm) {
    engine::Model model(small_model());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    fsdp::detail::run_agreed(sm, "test part", [&] {
      if (comm.rank() == 1) fsdp::detail::fail_as(ErrorKind::corrupt, "rank 1's part found a bad frame");
    });
  });
  CAPTURE(thrown[0].message);
  CAPTURE(thrown[1].message);
  CHECK(contains(thrown[0].message, "another rank failed"));
  CHECK(contains(thrown[1].message, "rank 1's part found a bad frame"));
  for (const auto& t : thrown) CHECK(t.kind == ErrorKind::corrupt);
}

}  // namespace core_error_kinds_test
