// fsdp/nccl/nccl_comm.hpp. The mapping, validation and no-device cases run everywhere; the
// cases that need a GPU (two GPUs for the multi-process one) report as skipped without
// one. Cases that may crash or stall by design (the watchdog's) run in a child process.
// Collective tags: on one rank, tagged calls give the untagged values (tags gathered on
// one rank for the test, the ring of tag slots wrapping around many times); over two
// processes, tags that differ fail on both ranks.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

// The multi-process case needs Boost.Asio (the TcpStore); tools/gpu_proof.sh builds this
// file with g++ where Boost may be missing, and then compiles that case out.
#if __has_include(<boost/asio.hpp>)
#define FSDP_NCCL_TEST_TCP 1
#include "fsdp/asio/tcp_store.hpp"
#endif
#include "fsdp/testing/counting_communicator.hpp"
#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/nccl/nccl_comm.hpp"
#include "fsdp/core/store.hpp"
#include "fsdp/testing/untagged_communicator.hpp"
#include "test/support/errors.hpp"
#include "test/support/gpu.hpp"
#include "test/tools/child_process.hpp"

namespace {

using fsdp::DType;
using fsdp::NcclComm;
using fsdp::ReduceOp;
using test_support::contains;
using test_support::error_of;
using test_support::no_gpu;

constexpr DType kAll[] = {DType::f32, DType::f64, DType::f16, DType::bf16,
                          DType::i8,  DType::u8,  DType::i32, DType::i64};

const bool fewer_than_two_gpus = fsdp::cuda_device_count() < 2;

// The multi-process case's world sizes: test_support::test_worlds(); a child learns its
// own from FSDP_NCCL_TEST_WORLD.
using test_support::test_worlds;
int test_world() { return std::atoi(std::getenv("FSDP_NCCL_TEST_WORLD")); }
const bool too_few_gpus = test_support::too_few_gpus_for_test_worlds();

std::string role() {
  const char* r = std::getenv("FSDP_NCCL_TEST_ROLE");
  return r ? r : "";
}

// Rank r's element i: small integers, so every dtype holds them and their sums exactly.
double value(int rank, std::size_t i) { return static_cast<double>(rank + 1 + static_cast<int>(i % 5)); }

std::vector<unsigned char> encode(DType t, const std::vector<double>& v) {
  std::vector<unsigned char> out(v.size() * fsdp::size_of(t));
  for (std::size_t i = 0; i < v.size(); ++i) fsdp::store_from_double(out.data(), i, t, v[i]);
  return out;
}

std::vector<double> decode(DType t, const std::vector<unsigned char>& bytes) {
  std::vector<double> out(bytes.size() / fsdp::size_of(t));
  for (std::size_t i = 0; i < out.size(); ++i) out[i] = fsdp::load_as_double(bytes.data(), i, t);
  return out;
}

// A device buffer filled from / read back to host values of one dtype.
struct GpuBuffer {
  DType t;
  std::size_t n;
  void* p = nullptr;
  GpuBuffer(DType type, std::size_t count) : t(type), n(count) {
    REQUIRE(cudaMalloc(&p, n * fsdp::size_of(t)) == cudaSuccess);
    REQUIRE(cudaMemset(p, 0, n * fsdp::size_of(t)) == cudaSuccess);
  }
  ~GpuBuffer() { cudaFree(p); }
  GpuBuffer(const GpuBuffer&) = delete;
  GpuBuffer& operator=(const GpuBuffer&) = delete;
  void set(const std::vector<double>& v, std::size_t offset = 0) {
    const auto bytes = encode(t, v);
    REQUIRE(cudaMemcpy(static_cast<char*>(p) + offset * fsdp::size_of(t), bytes.data(), bytes.size(),
                       cudaMemcpyHostToDevice) == cudaSuccess);
  }
  std::vector<double> get() const {
    std::vector<unsigned char> bytes(n * fsdp::size_of(t));
    REQUIRE(cudaMemcpy(bytes.data(), p, bytes.size(), cudaMemcpyDeviceToHost) == cudaSuccess);
    return decode(t, bytes);
  }
  void* at(std::size_t i) const { return static_cast<char*>(p) + i * fsdp::size_of(t); }
};

std::vector<double> rank_values(int rank, std::size_t n) {
  std::vector<double> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = value(rank, i);
  return v;
}

// Every collective of `comm` against host-computed expectations over `world` ranks whose
// inputs are rank_values(r, ...). Returns failures as text (empty: all correct).
std::string check_collectives(NcclComm& comm, int world) {
  std::string failures;
  auto expect = [&](bool ok, const std::string& what) {
    if (!ok) failures += "  " + what + "\n";
  };
  const int me = comm.rank();
  constexpr std::size_t n = 12;  // per rank
  for (DType t : kAll) {
    const std::string dt(fsdp::name_of(t));
    {  // all_gather
      GpuBuffer send(t, n), recv(t, n * world);
      send.set(rank_values(me, n));
      comm.all_gather(send.p, recv.p, n, t).wait();
      const auto got = recv.get();
      for (int r = 0; r < world; ++r)
        for (std::size_t i = 0; i < n; ++i) expect(got[r * n + i] == value(r, i), "all_gather " + dt);
    }
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min}) {
      if (op == ReduceOp::avg && world != 1 && world != 2) continue;  // exact only for powers of two
      auto reduced = [&](std::size_t i) {
        double s = 0, hi = value(0, i), lo = value(0, i);
        for (int r = 0; r < world; ++r) s += value(r, i), hi = std::max(hi, value(r, i)), lo = std::min(lo, value(r, i));
        if (op == ReduceOp::sum) return s;
        if (op == ReduceOp::max) return hi;
        if (op == ReduceOp::min) return lo;
        return fsdp::is_floating(t) ? s / world : static_cast<double>(static_cast<long long>(s) / world);
      };
      const std::string what = std::string(fsdp::name_of(op)) + " " + dt;
      GpuBuffer all(t, n * world), chunk(t, n), out(t, n * world);
      for (int r = 0; r < world; ++r) all.set(rank_values(me, n), r * n);
      comm.reduce_scatter(all.p, chunk.p, n, t, op).wait();
      const auto rs = chunk.get();
      for (std::size_t i = 0; i < n; ++i) expect(rs[i] == reduced(i), "reduce_scatter " + what);
      comm.all_reduce(all.p, out.p, n, t, op).wait();  // first n elements of each rank's buffer
      const auto ar = out.get();
      for (std::size_t i = 0; i < n; ++i) expect(ar[i] == reduced(i), "all_reduce " + what);
      comm.all_reduce(all.p, all.p, n, t, op).wait();  // in place
      const auto in_place = all.get();
      for (std::size_t i = 0; i < n; ++i) expect(in_place[i] == reduced(i), "in-place all_reduce " + what);
    }
    {  // broadcast from the last rank, in place on the root
      GpuBuffer buf(t, n);
      buf.set(rank_values(me, n));
      comm.broadcast(buf.p, buf.p, n, t, world - 1).wait();
      const auto got = buf.get();
      for (std::size_t i = 0; i < n; ++i) expect(got[i] == value(world - 1, i), "broadcast " + dt);
    }
  }
  comm.barrier().wait();
  return failures;
}

}  // namespace

TEST_CASE("every fsdp::DType has the NCCL datatype of its kind and width") {
  CHECK(fsdp::detail::nccl_dtype(DType::f32) == ncclFloat32);
  CHECK(fsdp::detail::nccl_dtype(DType::f64) == ncclFloat64);
  CHECK(fsdp::detail::nccl_dtype(DType::f16) == ncclFloat16);
  CHECK(fsdp::detail::nccl_dtype(DType::bf16) == ncclBfloat16);
  CHECK(fsdp::detail::nccl_dtype(DType::i8) == ncclInt8);
  CHECK(fsdp::detail::nccl_dtype(DType::u8) == ncclUint8);
  CHECK(fsdp::detail::nccl_dtype(DType::i32) == ncclInt32);
  CHECK(fsdp::detail::nccl_dtype(DType::i64) == ncclInt64);
  const auto bad = error_of([] { fsdp::detail::nccl_dtype(static_cast<DType>(42)); });
  CHECK(contains(bad, "dtype code 42"));
}

TEST_CASE("reduce ops are NCCL's, avg is ncclAvg") {
  CHECK(fsdp::detail::nccl_op(ReduceOp::sum) == ncclSum);
  CHECK(fsdp::detail::nccl_op(ReduceOp::avg) == ncclAvg);
  CHECK(fsdp::detail::nccl_op(ReduceOp::max) == ncclMax);
  CHECK(fsdp::detail::nccl_op(ReduceOp::min) == ncclMin);
  CHECK(contains(error_of([] { fsdp::detail::nccl_op(static_cast<ReduceOp>(9)); }), "reduce op code 9"));
}

TEST_CASE("the unique id survives the store as hex; malformed values name the key") {
  ncclUniqueId id;
  for (std::size_t i = 0; i < sizeof id.internal; ++i) id.internal[i] = static_cast<char>(i * 37 + 5);
  const std::string hex = fsdp::detail::nccl_unique_id_to_hex(id);
  CHECK(hex.size() == 2 * sizeof id.internal);
  const ncclUniqueId back = fsdp::detail::nccl_unique_id_from_hex(hex, "k");
  CHECK(std::memcmp(back.internal, id.internal, sizeof id.internal) == 0);
  CHECK(contains(error_of([] { fsdp::detail::nccl_unique_id_from_hex("abc", "job/nccl"); }), "store key 'job/nccl' holds 3"));
  std::string bad = hex;
  bad[7] = 'x';
  CHECK(contains(error_of([&] { fsdp::detail::nccl_unique_id_from_hex(bad, "job/nccl"); }), "'x', not a lowercase hex"));
}

TEST_CASE("arguments and options are refused before CUDA or the store is touched") {
  fsdp::HashStore store;
  auto from = [&](int rank, int world, fsdp::NcclCommOptions o) {
    return error_of([&] { NcclComm::from_store(store, rank, world, 0, o); });
  };
  CHECK(contains(from(0, 0, {}), "world size must be at least 1"));
  CHECK(contains(from(2, 2, {}), "rank 2 of 2: rank is outside [0, 2)"));
  fsdp::NcclCommOptions zero;
  zero.timeout = std::chrono::milliseconds(0);
  CHECK(contains(from(0, 1, zero), "NcclCommOptions::timeout must be in (0 ms, 24 h], got 0 ms"));
  fsdp::NcclCommOptions no_setup;
  no_setup.setup_timeout = std::chrono::milliseconds(-1);
  CHECK(contains(from(0, 1, no_setup), "NcclCommOptions::setup_timeout must be in (0 ms, 24 h], got -1 ms"));
  fsdp::NcclCommOptions slow_watchdog;
  slow_watchdog.timeout = std::chrono::milliseconds(100);
  slow_watchdog.watchdog_interval = std::chrono::milliseconds(200);
  CHECK(contains(from(0, 1, slow_watchdog), "watchdog_interval (200 ms) is longer than the timeout (100 ms)"));
  fsdp::NcclCommOptions no_key;
  no_key.store_key.clear();
  CHECK(contains(from(0, 1, no_key), "store_key is empty"));
  CHECK(store.num_keys() == 0);
  CHECK(contains(error_of([] { NcclComm::create({}); }), "no devices given"));
  CHECK(contains(error_of([] { NcclComm::create({0, 1, 0}); }), "ranks 0 and 2 are both on cuda:0"));
}

TEST_CASE("a GPU that is not there is an fsdp::Error naming it, not a crash") {
  const int count = fsdp::cuda_device_count();
  fsdp::HashStore store;
  const auto e = error_of([&] { NcclComm::from_store(store, 0, 1, count); });
  CHECK(contains(e, "NcclComm 'world' rank 0 of 1: "));
  CHECK(contains(e, "cuda:" + std::to_string(count)));
  CHECK(contains(e, count == 0 ? "no CUDA device is visible" : "no such CUDA device"));
  CHECK(store.num_keys() == 0);  // refused before rank 0 published an id
  CHECK(contains(error_of([&] { NcclComm::create({count}); }), "cuda:" + std::to_string(count)));
}

TEST_CASE("one rank: every collective and dtype against the host, also split and in a one-rank mesh" * doctest::skip(no_gpu)) {
  auto comms = NcclComm::create({0});
  REQUIRE(comms.size() == 1);
  NcclComm& comm = comms[0];
  CHECK(comm.rank() == 0);
  CHECK(comm.size() == 1);
  CHECK(comm.device() == 0);
  const std::string failures = check_collectives(comm, 1);
  CHECK_MESSAGE(failures.empty(), failures);
  CHECK(!comm.broken());
  // A split of one rank, and the two of a one-rank mesh (what a one-GPU run of a sharded
  // model makes): NCCL writes a split's communicator only once the split is complete.
  NcclComm alone = comm.split(0, 0);
  CHECK(alone.rank() == 0);
  CHECK(alone.size() == 1);
  const std::string split_failures = check_collectives(alone, 1);
  CHECK_MESSAGE(split_failures.empty(), split_failures);
  fsdp::DeviceMesh<NcclComm> mesh(comm, fsdp::MeshShape{1, 1});
  CHECK(mesh.shard_group().size() == 1);
  CHECK(mesh.replicate_group().size() == 1);
  const std::string mesh_failures = check_collectives(mesh.shard_group(), 1) + check_collectives(mesh.replicate_group(), 1);
  CHECK_MESSAGE(mesh_failures.empty(), mesh_failures);
  CHECK(!comm.broken());
}

namespace {

struct Names final : fsdp::UnitNames {
  std::string unit_name(int index) const override { return "block" + std::to_string(index); }
};

}  // namespace

TEST_CASE("NcclComm takes collective tags, so the library's pass check does not run over it") {
  static_assert(NcclComm::checks_tags);
  static_assert(fsdp::TaggedCommunicator<NcclComm>);
  static_assert(fsdp::TaggedCommunicator<fsdp::CountingCommunicator<NcclComm>>);
  static_assert(!fsdp::TaggedCommunicator<fsdp::UntaggedCommunicator<NcclComm>>);
}

TEST_CASE("one rank: tagged all_gather, reduce_scatter and all_reduce give the untagged values" * doctest::skip(no_gpu)) {
  fsdp::detail::nccl_tags_on_one_rank = true;  // gather the tags although one rank has nothing to compare
  auto comms = NcclComm::create({0});
  fsdp::detail::nccl_tags_on_one_rank = false;
  NcclComm& comm = comms[0];
  CHECK(fsdp::detail::CommRef(comm).checks_tags());
  const Names names;
  constexpr std::size_t n = 12;
  for (DType t : {DType::f32, DType::bf16, DType::i64}) {
    CAPTURE(fsdp::name_of(t));
    const fsdp::CollectiveTag tag{3, fsdp::TagPhase::forward, 7, &names};
    GpuBuffer send(t, n), plain(t, n), tagged(t, n);
    send.set(rank_values(0, n));
    comm.all_gather(send.p, plain.p, n, t).wait();
    comm.all_gather(send.p, tagged.p, n, t, tag).wait();
    CHECK(tagged.get() == plain.get());
    CHECK(plain.get() == rank_values(0, n));
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::avg, ReduceOp::max}) {
      comm.reduce_scatter(send.p, plain.p, n, t, op).wait();
      comm.reduce_scatter(send.p, tagged.p, n, t, op, {3, fsdp::TagPhase::reduce, 7, &names}).wait();
      CHECK(tagged.get() == plain.get());
      comm.all_reduce(send.p, plain.p, n, t, op).wait();
      comm.all_reduce(send.p, tagged.p, n, t, op, {3, fsdp::TagPhase::reduce, 7, &names}).wait();
      CHECK(tagged.get() == plain.get());
      CHECK(plain.get() == rank_values(0, n));
    }
  }
  // Many times round the ring of tag slots (256), most collectives not waited for: a slot
  // is reused once its last collective has completed, and every tag still matches.
  GpuBuffer acc(DType::f32, n);
  acc.set(rank_values(0, n));
  std::vector<fsdp::Work> works;
  for (int i = 0; i < 3 * 256 + 5; ++i)
    works.push_back(comm.all_reduce(acc.p, acc.p, n, DType::f32, ReduceOp::sum,
                                    {static_cast<std::uint32_t>(i % 40), fsdp::TagPhase::reduce, 9, &names}));
  works.back().wait();
  for (auto& w : works) w.wait();
  CHECK(acc.get() == rank_values(0, n));  // one rank: a sum is its own input
  CHECK(!comm.broken());
  // Inside an nccl_group too: launched with the group, with its tag.
  GpuBuffer grouped(DType::f32, n);
  fsdp::Work in_group;
  fsdp::nccl_group([&] { in_group = comm.all_gather(acc.p, grouped.p, n, DType::f32, {1, fsdp::TagPhase::summon, 7, &names}); });
  in_group.wait();
  CHECK(grouped.get() == rank_values(0, n));
  CHECK(!comm.broken());
}

TEST_CASE("collectives wait for NcclCommOptions::after, e.g. CudaDevice's stream" * doctest::skip(no_gpu)) {
  fsdp::CudaDevice dev(0);
  fsdp::NcclCommOptions o;
  o.after = dev.stream();
  auto comms = NcclComm::create({0}, o);
  constexpr std::size_t n = 1 << 20;
  std::vector<float> host(n);
  for (std::size_t i = 0; i < n; ++i) host[i] = static_cast<float>(i % 1000);
  void* src = dev.allocate(n * 4);
  void* dst = dev.allocate(n * 4);
  dev.copy(src, host.data(), n * 4);  // queued on the device's stream; not waited for
  comms[0].all_reduce(src, dst, n, DType::f32, ReduceOp::sum).wait();
  std::vector<float> got(n);
  dev.copy(got.data(), dst, n * 4);
  dev.synchronize();
  CHECK(got == host);
  dev.deallocate(src, n * 4);
  dev.deallocate(dst, n * 4);
  dev.synchronize();
}

TEST_CASE("host buffers, null buffers and a bad root are refused naming the call" * doctest::skip(no_gpu)) {
  auto comms = NcclComm::create({0});
  std::vector<float> host(4);
  GpuBuffer dev(DType::f32, 4);
  const auto e = error_of([&] { comms[0].all_reduce(host.data(), dev.p, 4, DType::f32, ReduceOp::sum); });
  CHECK(contains(e, "NcclComm 'world' rank 0 of 1 (cuda:0): all_reduce(count=4, dtype=f32, op=sum) as collective #0"));
  CHECK(contains(e, "send buffer"));
  CHECK(contains(e, "not GPU or pinned host memory"));
  CHECK(contains(error_of([&] { comms[0].all_gather(nullptr, dev.p, 4, DType::f32); }), "#1: the send buffer is null"));
  CHECK(contains(error_of([&] { comms[0].broadcast(dev.p, dev.p, 4, DType::f32, 1); }), "root 1 is outside [0, 1)"));
  CHECK(!comms[0].broken());  // refused calls never reached NCCL
  comms[0].all_reduce(dev.p, dev.p, 4, DType::f32, ReduceOp::sum).wait();
}

TEST_CASE("the library's small agreements in ordinary host memory are staged through the GPU" * doctest::skip(no_gpu)) {
  auto comms = NcclComm::create({0});
  NcclComm& comm = comms[0];
  const std::int64_t mine = 41;
  std::int64_t sum = 0;
  comm.all_reduce(&mine, &sum, 1, DType::i64, ReduceOp::sum).wait();
  CHECK(sum == 41);
  std::vector<std::int32_t> gathered(2, -1);
  const std::int32_t two[2] = {7, 9};
  comm.all_gather(two, gathered.data(), 2, DType::i32).wait();
  CHECK(gathered == std::vector<std::int32_t>{7, 9});
  std::int32_t in_place = 5;
  comm.all_reduce(&in_place, &in_place, 1, DType::i32, ReduceOp::max).wait();
  CHECK(in_place == 5);
  std::vector<float> big(1 << 19), out(1 << 19);  // 4 MiB in all: too large to stage
  CHECK(contains(error_of([&] { comm.all_reduce(big.data(), out.data(), big.size(), DType::f32, ReduceOp::sum); }),
                 "stage large ones with fsdp::StagedCommunicator"));
  CHECK(!comm.broken());
}

TEST_CASE("several ranks in one process, launched in an nccl_group" * doctest::skip(fewer_than_two_gpus)) {
  auto comms = NcclComm::create({0, 1});
  constexpr std::size_t n = 64;
  std::vector<std::unique_ptr<GpuBuffer>> send, recv;
  for (int r = 0; r < 2; ++r) {
    REQUIRE(cudaSetDevice(r) == cudaSuccess);
    send.push_back(std::make_unique<GpuBuffer>(DType::f32, n));
    recv.push_back(std::make_unique<GpuBuffer>(DType::f32, n));
    send[r]->set(rank_values(r, n));
  }
  std::vector<fsdp::Work> works;
  fsdp::nccl_group([&] {
    for (int r = 0; r < 2; ++r) works.push_back(comms[r].all_reduce(send[r]->p, recv[r]->p, n, DType::f32, ReduceOp::sum));
    CHECK(contains(error_of([&] { works[0].wait(); }), "inside an nccl_group"));
  });
  for (auto& w : works) w.wait();
  for (int r = 0; r < 2; ++r) {
    REQUIRE(cudaSetDevice(r) == cudaSuccess);
    const auto got = recv[r]->get();
    for (std::size_t i = 0; i < n; ++i) CHECK(got[i] == value(0, i) + value(1, i));
  }
  // abort_step's note between ranks of one process (the communicators share an in-process
  // store for it): rank 1's error quotes rank 0's exception and echoes rank 0.
  const Names names;
  const auto note = std::make_shared<const std::string>("engine kernel failed");
  std::vector<fsdp::Work> agreement;
  fsdp::nccl_group([&] {
    // abort_step's agreement is an all_reduce of one i32 with min (detail::all_ranks_agree).
    agreement.push_back(comms[0].all_reduce(send[0]->p, recv[0]->p, 1, DType::i32, ReduceOp::min,
                                            fsdp::CollectiveTag{0, fsdp::TagPhase::abort_step, 0, nullptr, note}));
    agreement.push_back(comms[1].all_reduce(send[1]->p, recv[1]->p, 1, DType::i32, ReduceOp::min,
                                            fsdp::CollectiveTag{2, fsdp::TagPhase::forward, 1, &names}));
  });
  const auto own = test_support::thrown_by([&] { agreement[0].wait(); });
  const auto echo = test_support::thrown_by([&] { agreement[1].wait(); });
  CAPTURE(echo.message);
  CHECK(own.echo_of == -1);
  CHECK(echo.echo_of == 0);
  CHECK(contains(echo.message, "rank 0 called all_reduce(count=1, dtype=i32, op=min) of abort_step (the step was left "
                               "by an exception: \"engine kernel failed\") as collective #1, rank 1 called "
                               "all_reduce(count=1, dtype=i32, op=min) of unit 'block2' (forward, pass 1)"));
}

// ---- cases run in child processes --------------------------------------------------

namespace {

// This test binary again, as a fresh process (CUDA cannot be used in a forked copy of one
// that initialized it) that runs only the child-process case, in role `env`.
std::unique_ptr<test_tools::ChildProcess> spawn_child(const std::vector<std::string>& env) {
  return std::make_unique<test_tools::ChildProcess>(
      std::vector<std::string>{"/proc/self/exe", "--test-case=nccl child process", "--no-version"}, env);
}

// Watchdog child: the collective's stream is held back by a host function, so the
// collective cannot complete; the watchdog must turn that into an Error. Exits with
// _Exit so that nothing waits on the still-held stream.
void watchdog_child() {
  cudaStream_t held = nullptr;
  if (cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking) != cudaSuccess) std::_Exit(3);
  fsdp::NcclCommOptions o;
  o.timeout = std::chrono::milliseconds(500);
  o.watchdog_interval = std::chrono::milliseconds(5);
  o.after = held;
  auto comms = NcclComm::create({0}, o);
  // Held only now: NCCL's initialization synchronizes the device, so a stream held before
  // it would have had to drain first (observed on an H200: the collective then ran at once).
  static std::atomic<bool> release{false};
  cudaLaunchHostFunc(held, [](void*) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!release && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }, nullptr);
  GpuBuffer buf(DType::f32, 4);
  const auto start = std::chrono::steady_clock::now();
  const auto e = error_of([&] { comms[0].all_reduce(buf.p, buf.p, 4, DType::f32, ReduceOp::sum).wait(); });
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
  std::printf("WATCHDOG_ERROR: %s\nWATCHDOG_MS: %lld\n", e.c_str(), static_cast<long long>(ms.count()));
  std::printf("AFTER_ERROR: %s\n", error_of([&] { comms[0].barrier(); }).c_str());
  std::printf("BROKEN: %d\nWATCHDOG-DONE\n", comms[0].broken() ? 1 : 0);
  std::fflush(stdout);
  std::_Exit(0);
}

#ifdef FSDP_NCCL_TEST_TCP
// One of test_world() processes, rank r on GPU r, meeting through the parent's TcpStore.
void rank_child() {
  const int rank = std::atoi(std::getenv("FSDP_NCCL_TEST_RANK"));
  const int world = test_world();
  const auto port = static_cast<std::uint16_t>(std::atoi(std::getenv("FSDP_NCCL_TEST_PORT")));
  fsdp::TcpStore store("127.0.0.1", port);
  fsdp::NcclCommOptions o;
  o.timeout = std::chrono::seconds(30);
  NcclComm comm = NcclComm::from_store(store, rank, world, rank, o);
  std::string failures = check_collectives(comm, world);
  // Even and odd ranks apart, each group ordered by descending rank (the key): of 2 ranks,
  // two groups of one; of 4, ranks 2, 0 and 3, 1.
  NcclComm half = comm.split(rank % 2, -rank);
  if (half.size() != world / 2 || half.rank() != world / 2 - 1 - rank / 2)
    failures += "  split: rank " + std::to_string(half.rank()) + " of " + std::to_string(half.size()) + "\n";
  failures += check_collectives(half, world / 2);
  std::printf("%s%s\n", failures.c_str(), failures.empty() ? "COLLECTIVES-OK" : "COLLECTIVES-FAILED");
  {  // Collective tags: equal ones pass; rank 1 gathering another unit fails on both ranks.
    const Names names;
    REQUIRE(cudaSetDevice(rank) == cudaSuccess);
    GpuBuffer send(DType::f32, 4), recv(DType::f32, 4 * static_cast<std::size_t>(world));
    fsdp::NcclCommOptions o2 = o;
    o2.store_key = "tags";
    NcclComm tagged = NcclComm::from_store(store, rank, world, rank, o2);
    tagged.all_gather(send.p, recv.p, 4, DType::f32, {2, fsdp::TagPhase::forward, 1, &names}).wait();
    std::printf("TAGS-EQUAL: %s\n", tagged.broken() ? "broken" : "ok");
    const fsdp::CollectiveTag mine{rank == 1 ? 3u : 2u, fsdp::TagPhase::forward, 1, &names};
    // Waited for on a stream only, as the library's all-gathers are: the watchdog finds it.
    cudaStream_t s = nullptr;
    cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
    // The watchdog may find the mismatch before wait_on is called: wait_on then throws it.
    (void)error_of([&] {
      tagged.all_gather(send.p, recv.p, 4, DType::f32, mine).wait_on({fsdp::DeviceId{fsdp::DeviceKind::cuda, rank}, s});
    });
    cudaStreamSynchronize(s);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!tagged.broken() && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    std::printf("TAG_ERROR: %s\n", tagged.broken_by().c_str());
    std::printf("TAG_NEXT: %s\n", error_of([&] { tagged.barrier(); }).c_str());
  }
  {  // A tagged all_gather captured into a CUDA graph: each replay is tracked as one
     // collective and its tags compared once it completes; rank 1 replaying a graph of
     // another unit fails that replay's wait on every rank, naming both units.
    const Names names;
    REQUIRE(cudaSetDevice(rank) == cudaSuccess);
    cudaStream_t s = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking) == cudaSuccess);
    fsdp::NcclCommOptions o3 = o;
    o3.store_key = "captured";
    o3.after = s;  // its collectives follow the captured stream, so they join the capture
    NcclComm cap = NcclComm::from_store(store, rank, world, rank, o3);
    GpuBuffer send(DType::f32, 4), recv(DType::f32, 4 * static_cast<std::size_t>(world));
    send.set(rank_values(rank, 4));
    auto capture = [&](std::uint32_t unit) {
      cap.begin_capture(s, 8);
      REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal) == cudaSuccess);
      cap.all_gather(send.p, recv.p, 4, DType::f32, {unit, fsdp::TagPhase::forward, 1, &names})
          .wait_on({fsdp::DeviceId{fsdp::DeviceKind::cuda, rank}, s});
      cudaGraph_t graph = nullptr;
      REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
      auto captured = cap.end_capture();
      cudaGraphExec_t exec = nullptr;
      REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
      cudaGraphDestroy(graph);
      return std::make_pair(exec, captured);
    };
    const auto same = capture(2);  // (no structured binding: clang 14 cannot capture one in a lambda)
    std::string replays_ok = recv.get() == std::vector<double>(recv.n, 0.0) ? "ok" : "ran at capture";
    for (std::uint64_t replay = 1; replay <= 2; ++replay) {
      REQUIRE(cudaGraphLaunch(same.first, s) == cudaSuccess);
      cap.track_replay(s, same.second, replay).wait();
      const auto got = recv.get();
      for (int r = 0; r < world; ++r)
        for (std::size_t i = 0; i < 4; ++i)
          if (got[static_cast<std::size_t>(r) * 4 + i] != value(r, i)) replays_ok = "wrong values";
    }
    std::printf("CAPTURED-REPLAYS: %s %s\n", replays_ok.c_str(), cap.broken() ? "broken" : "healthy");
    const auto other = capture(rank == 1 ? 3u : 2u);
    REQUIRE(cudaGraphLaunch(other.first, s) == cudaSuccess);
    std::printf("CAPTURED_TAG_ERROR: %s\n", error_of([&] { cap.track_replay(s, other.second, 3).wait(); }).c_str());
    cudaStreamSynchronize(s);
    cudaGraphExecDestroy(same.first), cudaGraphExecDestroy(other.first);
  }
  {  // abort_step's note (issue 35): rank 0 left its step by an exception and agrees on the
     // abort, its agreement carrying that exception's message, while the others gather a
     // unit; NCCL gathers only the tags, the note comes through the store. Every other rank's
     // error quotes it and is an echo of rank 0; rank 0's is its own. Then the same on a
     // communicator split from it (ranks 0 and 1 of each color: the note keys are its own).
    const Names names;
    REQUIRE(cudaSetDevice(rank) == cudaSuccess);
    fsdp::NcclCommOptions o4 = o;
    o4.store_key = "aborting";
    NcclComm ab = NcclComm::from_store(store, rank, world, rank, o4);
    NcclComm pair = ab.split(rank / 2, rank);  // of 2 ranks one pair, of 4 two
    const auto note = std::make_shared<const std::string>("engine kernel failed on rank " + std::to_string(rank));
    auto agree_or_gather = [&](NcclComm& c) {
      GpuBuffer buf(DType::i32, 1);
      fsdp::CollectiveTag tag{2, fsdp::TagPhase::forward, 1, &names};
      if (c.rank() == 0) tag = fsdp::CollectiveTag{0, fsdp::TagPhase::abort_step, 0, nullptr, note};
      const auto t = test_support::thrown_by([&] { c.all_reduce(buf.p, buf.p, 1, DType::i32, ReduceOp::min, tag).wait(); });
      return t.message + "\nECHO_OF: " + std::to_string(t.echo_of);
    };
    std::printf("NOTE_ERROR: %s\n", agree_or_gather(ab).c_str());
    std::printf("SPLIT_NOTE_ERROR: %s\n", agree_or_gather(pair).c_str());
    // As in a real step: the others gather a unit (another shape), which NCCL never
    // completes against the agreement, so no tag is ever compared. The watchdog finds rank
    // 0's word in the store once the gather is 1 s old, well before the 4 s timeout, and
    // leaves word that it left, which ends rank 0's agreement as soon.
    fsdp::NcclCommOptions o5 = o;
    o5.store_key = "shapes";
    o5.timeout = std::chrono::seconds(4);
    NcclComm shapes = NcclComm::from_store(store, rank, world, rank, o5);
    GpuBuffer send4(DType::f32, 4), recv4(DType::f32, 4 * static_cast<std::size_t>(world));
    const auto start = std::chrono::steady_clock::now();
    const auto t = test_support::thrown_by([&] {
      std::int32_t ok = 1;  // in ordinary host memory, as the library's agreements: staged through the GPU
      if (rank == 0)
        shapes.all_reduce(&ok, &ok, 1, DType::i32, ReduceOp::min,
                          fsdp::CollectiveTag{0, fsdp::TagPhase::abort_step, 0, nullptr, note}).wait();
      else
        shapes.all_gather(send4.p, recv4.p, 4, DType::f32, {2, fsdp::TagPhase::forward, 1, &names}).wait();
    });
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start);
    std::printf("SHAPES_ERROR: %s\nSHAPES_ECHO_OF: %d\nSHAPES_MS: %lld\n", t.message.c_str(), t.echo_of,
                static_cast<long long>(ms.count()));
  }
  // A stalled peer: rank 1 joins a second communicator and then issues nothing.
  fsdp::NcclCommOptions quick;
  quick.timeout = std::chrono::milliseconds(1500);
  quick.store_key = "stall";
  NcclComm stall = NcclComm::from_store(store, rank, world, rank, quick);
  if (rank == 0) {
    GpuBuffer buf(DType::f32, 4);
    std::printf("STALL_ERROR: %s\n", error_of([&] { stall.all_reduce(buf.p, buf.p, 4, DType::f32, ReduceOp::sum).wait(); }).c_str());
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(4));
  }
  std::printf("RANK-DONE\n");
  std::fflush(stdout);
  std::_Exit(0);
}
#endif

}  // namespace

TEST_CASE("nccl child process" * doctest::skip(role().empty())) {
  if (role() == "watchdog") watchdog_child();
#ifdef FSDP_NCCL_TEST_TCP
  if (role() == "rank") rank_child();
#endif
  FAIL("unknown FSDP_NCCL_TEST_ROLE ", role());
}

TEST_CASE("the watchdog turns a collective that cannot complete into an Error" * doctest::skip(no_gpu)) {
  const auto child = spawn_child({"FSDP_NCCL_TEST_ROLE=watchdog"});
  const auto r = child->wait(std::chrono::seconds(60));  // fails the case if it runs longer
  INFO("child stdout:\n", r.out, "\nstderr:\n", r.err);
  CHECK(r.status == 0);
  CHECK(contains(r.out, "WATCHDOG-DONE"));
  CHECK(contains(r.out, "WATCHDOG_ERROR: fsdp: "));
  CHECK(contains(r.out, "rank 0 of 1 (cuda:0): all_reduce(count=4, dtype=f32, op=sum) as collective #0"));
  CHECK(contains(r.out, "did not complete within 500 ms"));
  CHECK(contains(r.out, "ncclCommAbort"));
  CHECK(contains(r.out, "AFTER_ERROR: fsdp: "));
  CHECK(contains(r.out, "barrier as collective #1 not started: the communicator broke earlier"));
  CHECK(contains(r.out, "BROKEN: 1"));
}

#ifdef FSDP_NCCL_TEST_TCP
TEST_CASE("processes through a TcpStore: collectives, split, collective tags, a stalled peer" * doctest::skip(too_few_gpus)) {
  for (const int world : test_worlds()) {
  CAPTURE(world);
  fsdp::TcpStoreServer server;
  std::vector<std::unique_ptr<test_tools::ChildProcess>> children;
  for (int r = 0; r < world; ++r)
    children.push_back(spawn_child({"FSDP_NCCL_TEST_ROLE=rank", "FSDP_NCCL_TEST_RANK=" + std::to_string(r),
                                    "FSDP_NCCL_TEST_WORLD=" + std::to_string(world),
                                    "FSDP_NCCL_TEST_PORT=" + std::to_string(server.port())}));
  for (int r = 0; r < world; ++r) {
    const auto result = children[r]->wait(std::chrono::seconds(120));
    INFO("rank ", r, " stdout:\n", result.out, "\nstderr:\n", result.err);
    CHECK(result.status == 0);
    CHECK(contains(result.out, "COLLECTIVES-OK"));
    CHECK(contains(result.out, "RANK-DONE"));
    CHECK(contains(result.out, "TAGS-EQUAL: ok"));
    std::string calls;  // every rank's call, rank 1's the odd one
    for (int q = 0; q < world; ++q)
      calls += (q ? ", rank " : "rank ") + std::to_string(q) + " called all_gather(count=4, dtype=f32) of unit 'block" +
               (q == 1 ? "3" : "2") + "' (forward, pass 1) as collective #1";
    CHECK(contains(result.out, "TAG_ERROR: watchdog: NcclComm 'world' rank " + std::to_string(r) + " of " +
                                   std::to_string(world) + " (cuda:" + std::to_string(r) + "): collective mismatch: " +
                                   calls + " (seen on rank " + std::to_string(r) + ")"));
    CHECK(contains(result.out, "TAG_NEXT: fsdp: "));
    CHECK(contains(result.out, "CAPTURED-REPLAYS: ok healthy"));
    std::string captured_calls;  // the replay's captured all_gather on every rank, rank 1's the odd one
    for (int q = 0; q < world; ++q)
      captured_calls += (q ? ", rank " : "rank ") + std::to_string(q) + " called all_gather(count=4, dtype=f32) of unit 'block" +
                        (q == 1 ? "3" : "2") + "' (forward, pass 1) as collective #3";
    CHECK(contains(result.out, "CAPTURED_TAG_ERROR: fsdp: "));  // the watchdog or the wait sees it first
    CHECK(contains(result.out, "NcclComm 'world' rank " + std::to_string(r) + " of " +
                                   std::to_string(world) + " (cuda:" + std::to_string(r) +
                                   "): in replay 3 of a captured step (1 collective, #3 when captured) as collective #4: "
                                   "collective mismatch: " + captured_calls + " (seen on rank " + std::to_string(r) + ")"));
    CHECK(contains(result.out, "barrier as collective #2 not started: the communicator broke earlier"));
    // abort_step's note: quoted on every rank, in the rank list every rank builds alike;
    // the others' errors are echoes of rank 0 (fsdp::exit_status: 86).
    const std::string quoted = "rank 0 called all_reduce(count=1, dtype=i32, op=min) of abort_step (the step was left "
                               "by an exception: \"engine kernel failed on rank ";
    const auto after = [&](const std::string& marker) {
      const auto at = result.out.find(marker);
      return at == std::string::npos ? std::string() : result.out.substr(at, result.out.find("ECHO_OF", at) + 12 - at);
    };
    const std::string note_error = after("NOTE_ERROR: "), split_error = after("SPLIT_NOTE_ERROR: ");
    CAPTURE(note_error);
    CAPTURE(split_error);
    CHECK(contains(note_error, quoted + "0\")"));
    // (rank 0's list names the units by its own tag's names: it passed none)
    CHECK(contains(note_error, std::string("rank 1 called all_reduce(count=1, dtype=i32, op=min) of unit ") +
                                   (r == 0 ? "#2" : "'block2'") + " (forward, pass 1)"));
    CHECK(contains(note_error, r == 0 ? "ECHO_OF: -1" : "ECHO_OF: 0"));
    // Rank 0 of each pair is world rank 0 or 2: its own note, not world rank 0's.
    CHECK(contains(split_error, "/split#0(color " + std::to_string(r / 2) + ")"));
    CHECK(contains(split_error, quoted + std::to_string(r / 2 * 2) + "\")"));
    CHECK(contains(split_error, r % 2 == 0 ? "ECHO_OF: -1" : "ECHO_OF: 0"));
    // Calls of different shapes: the word in the store, not the tags, names rank 0.
    if (r == 0) {  // its own error: a peer left the collective the agreement waited for
      CHECK(contains(result.out, "SHAPES_ERROR: fsdp: watchdog: NcclComm 'world' rank 0 of " + std::to_string(world) +
                                     " (cuda:0): all_reduce(count=1, dtype=i32, op=min) of abort_step (the step was left "
                                     "by an exception) as collective #0 cannot complete: rank "));
      CHECK(contains(result.out, " left all_gather(count=4, dtype=f32) of unit 'block2' (forward, pass 1) as collective "
                                 "#0 in its place, which NCCL does not complete against this one"));
      CHECK(contains(result.out, "SHAPES_ECHO_OF: -1"));
    } else {
      CHECK(contains(result.out, "all_gather(count=4, dtype=f32) of unit 'block2' (forward, pass 1) as collective #0 "
                                 "cannot complete: rank 0 issued abort_step's agreement as this collective instead "
                                 "(the step was left by an exception: \"engine kernel failed on rank 0\")"));
      CHECK(contains(result.out, "SHAPES_ECHO_OF: 0"));
    }
    // Within 3.5 s of a 4 s timeout: the word at 1 s (2 s if the first look came early).
    const auto at = result.out.find("SHAPES_MS: ");
    REQUIRE(at != std::string::npos);
    CHECK(std::atoll(result.out.c_str() + at + 11) < 3500);
    if (r == 0) {
      // The watchdog thread or the waiting call may see the timeout first; the error names
      // the collective either way ("watchdog: " says which saw it).
      const std::string stalled = "NcclComm 'world' rank 0 of " + std::to_string(world) + " (cuda:0): all_reduce(";
      CHECK((contains(result.out, "STALL_ERROR: fsdp: " + stalled) ||
             contains(result.out, "STALL_ERROR: fsdp: watchdog: " + stalled)));
      CHECK(contains(result.out, "did not complete within 1500 ms of being issued"));
      CHECK(contains(result.out, "as collective #0"));
      CHECK(contains(result.out, "ncclCommAbort"));
    }
  }
  }
}
#endif
