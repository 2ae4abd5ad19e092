// fsdp/asio/shm_link.hpp, shm_handshake.hpp: TcpComm's shared-memory links, with ranks as
// threads of this process (one host, one /dev/shm). Which links choose shared memory (by
// default, with the option or FSDP_TCP_SHM=0 off, mixed rings); results bit for bit equal
// to the socket path and the reference, also when the shared ring fills up and the sender
// waits for CREDITs; a stalled rank still times out; ShmLink's own checks (the nonce
// proof, unlinking, the full and the empty ring). Processes: tcp_shm_process_test.cpp.
#include <doctest/doctest.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "fsdp/asio/shm_link.hpp"
#include "tcp_cases.hpp"
#include "test/asio/tcp_world.hpp"
#include "test/support/scoped_env.hpp"

namespace asio_tcp_shm_test {

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using fsdp::TcpComm;
using test_support::K;
using test_support::TcpWorld;
using namespace std::chrono_literals;

fsdp::TcpCommOptions socket_only(fsdp::TcpCommOptions o) {
  o.shared_memory = false;
  return o;
}

// Which links of each rank use shared memory, as "LR" flags per rank ("11" both).
std::vector<std::string> link_flags(TcpWorld& world) {
  std::vector<std::string> flags;
  for (int r = 0; r < world.size(); ++r) flags.push_back(test_support::link_text(world.comm(r)));
  return flags;
}

bool in_dev_shm(const std::string& name) { return std::filesystem::exists("/dev/shm/" + name); }

}  // namespace

TEST_CASE("same-host ranks use shared memory on every link; results equal the socket path and the reference, bit for bit") {
  for (int n : {2, 3, 4})
    for (int io : test_support::kIoThreads) {
      CAPTURE(n);
      CAPTURE(io);
      const auto options = test_support::ok_options(64, io);  // many frames per step
      const auto cases = test_support::every_kind_cases(n, {0, 1, 7, 1003});
      TcpWorld shm(n, options);
      CHECK(link_flags(shm) == std::vector<std::string>(n, "11"));
      const auto via_shm = test_support::run_cases(shm, cases, 3);
      TcpWorld sockets(n, socket_only(options));
      CHECK(link_flags(sockets) == std::vector<std::string>(n, "00"));
      const auto via_sockets = test_support::run_cases(sockets, cases, 3);
      for (std::size_t i = 0; i < cases.size(); ++i) {
        CAPTURE(cases[i].str());
        CHECK(via_shm[i] == via_sockets[i]);
      }
      test_support::check_against_reference(shm, cases, 3);
    }
}

TEST_CASE("a shared ring of two slots: the sender waits for CREDITs, results still exact") {
  for (int io : test_support::kIoThreads) {
    CAPTURE(io);
    auto options = test_support::ok_options(4096, io);
    options.shared_memory_bytes = 2 * 4096;  // two slots
    TcpWorld world(3, options);
    CHECK(link_flags(world) == std::vector<std::string>(3, "11"));
    const std::size_t count = 100003;  // ~100 frames per step and link
    // Every rank but 1 starts late, so rank 1 (the broadcast root, and the first to send
    // in the rings) fills its shared ring and must wait for CREDITs.
    test_support::check_against_reference(world,
                                          {{K::broadcast, 3, count, DType::f32, ReduceOp::sum, 1},
                                           {K::all_gather, 3, count},
                                           {K::reduce_scatter, 3, count, DType::f32, ReduceOp::sum, 0, true},
                                           {K::all_reduce, 3, count, DType::bf16, ReduceOp::sum}},
                                          1, [](int r) {
                                            if (r != 1) std::this_thread::sleep_for(20ms);
                                          });
  }
}

TEST_CASE("a rank with shared memory off: its two links use TCP, the rest of the ring shared memory") {
  constexpr int n = 4, plain = 2;
  TcpWorld world(n, [](int r) {
    auto o = test_support::ok_options(256);
    o.shared_memory = r != plain;
    return o;
  });
  CHECK(link_flags(world) == std::vector<std::string>{"11", "10", "00", "01"});
  // The same cases on a world of sockets only: equal outputs on every rank.
  const auto cases = test_support::every_kind_cases(n, {0, 1, 7, 1003});
  const auto mixed = test_support::run_cases(world, cases, 11);
  TcpWorld sockets(n, socket_only(test_support::ok_options(256)));
  const auto via_sockets = test_support::run_cases(sockets, cases, 11);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    CAPTURE(cases[i].str());
    CHECK(mixed[i] == via_sockets[i]);
  }
}

TEST_CASE("FSDP_TCP_SHM=0 (or false, no, off) keeps every link on TCP; 1 or true leave it on; anything else is refused") {
  test_support::ScopedEnv env_vars("FSDP_TCP_SHM", "0");
  std::vector<std::string> off;
  {
    TcpWorld world(2);
    off = link_flags(world);
    test_support::check_against_reference(world, {{K::all_reduce, 2, 999, DType::f32, ReduceOp::sum}});
  }
  CHECK(off == std::vector<std::string>(2, "00"));
  for (const char* value : {"false", "no", "OFF"}) {
    CAPTURE(value);
    env_vars.set("FSDP_TCP_SHM", value);
    TcpWorld world(2);
    CHECK(link_flags(world) == std::vector<std::string>(2, "00"));
  }
  for (const char* value : {"1", "true"}) {
    CAPTURE(value);
    env_vars.set("FSDP_TCP_SHM", value);
    TcpWorld world(2);
    CHECK(link_flags(world) == std::vector<std::string>(2, "11"));
  }
  env_vars.set("FSDP_TCP_SHM", "fasle");
  std::string refused;
  try {
    TcpWorld world(2);
  } catch (const fsdp::Error& e) {
    refused = e.what();
  }
  CHECK(refused.find("environment variable FSDP_TCP_SHM: 'fasle' is not a boolean") != std::string::npos);
}

TEST_CASE("a stalled rank over shared memory: the others time out naming it") {
  auto options = test_support::ok_options(1024);
  options.timeout = 1s;
  TcpWorld world(3, options);
  REQUIRE(link_flags(world) == std::vector<std::string>(3, "11"));
  const auto errors = world.each([&](TcpComm& comm, int r) {
    std::vector<float> x(5000, 1.0f), y(5000);
    comm.all_reduce(x.data(), y.data(), x.size(), DType::f32, ReduceOp::sum).wait();
    if (r == 1) {
      std::this_thread::sleep_for(3s);  // stuck "computing" past the others' timeout
      return;
    }
    comm.all_reduce(x.data(), y.data(), x.size(), DType::f32, ReduceOp::sum).wait();
  });
  for (int r : {0, 2}) {
    CAPTURE(errors[r]);
    CHECK(test_support::contains(errors[r], "timed out"));
    CHECK(test_support::contains(errors[r], "rank 1"));
    CHECK(test_support::contains(errors[r], "all_reduce"));
  }
}

TEST_CASE("ShmLink: the nonce proves the segment, names never stay in /dev/shm, the ring holds `slots` frames") {
  const std::string name = "fsdp.test." + std::to_string(getpid());
  std::string why;
  auto producer = fsdp::detail::ShmLink::create(name, 42, 2, 16, why);
  REQUIRE_MESSAGE(producer, why);
  CHECK(in_dev_shm(name));

  SUBCASE("a wrong nonce is refused, and the name is gone") {
    CHECK_FALSE(fsdp::detail::ShmLink::open(name, 43, 2, 16, why));
    CHECK(test_support::contains(why, "not the one"));
    CHECK_FALSE(in_dev_shm(name));
    CHECK_FALSE(fsdp::detail::ShmLink::open(name, 42, 2, 16, why));  // nothing to open any more
  }
  SUBCASE("the right nonce: frames in order, a full ring asks for a credit") {
    auto consumer = fsdp::detail::ShmLink::open(name, 42, 2, 16, why);
    REQUIRE_MESSAGE(consumer, why);
    CHECK_FALSE(in_dev_shm(name));
    char out[16] = {};
    bool credit = true;
    CHECK_FALSE(consumer->consume(out, 4, credit));  // nothing produced yet: out of step
    CHECK(producer->has_room_or_ask());
    producer->produce("abcd", 4);
    CHECK(producer->has_room_or_ask());
    producer->produce("efgh", 4);
    CHECK_FALSE(producer->has_room_or_ask());  // two slots in use: the producer now waits
    CHECK(consumer->consume(out, 4, credit));
    CHECK(std::string(out, 4) == "abcd");
    CHECK(credit);  // it waited: a CREDIT is due
    CHECK(consumer->consume(out, 4, credit));
    CHECK(std::string(out, 4) == "efgh");
    CHECK_FALSE(credit);  // only once
    CHECK(producer->has_room_or_ask());
    producer->produce("ijkl", 4);
    CHECK_FALSE(consumer->consume(out, 32, credit));  // larger than a slot: refused
    CHECK(consumer->consume(out, 4, credit));
  }
  fsdp::detail::ShmLink::unlink(name);
  CHECK_FALSE(in_dev_shm(name));
}

}  // namespace asio_tcp_shm_test
