#pragma once
// Collective cases run on a TcpWorld (threads with their own TcpComm): every rank issues
// them in the same order, and the outputs are checked against the ring-order reference.
#include <doctest/doctest.h>

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string>
#include <vector>

#include "collective_cases.hpp"
#include "test/asio/tcp_world.hpp"

namespace test_support {

using K = fsdp::detail::CollectiveKind;

template <class C>
inline fsdp::Work issue(C& comm, const fsdp::detail::CollectiveCall& c) {
  switch (c.kind) {
    case K::all_gather: return comm.all_gather(c.send, c.recv, c.count, c.dtype);
    case K::reduce_scatter: return comm.reduce_scatter(c.send, c.recv, c.count, c.dtype, c.op);
    case K::all_reduce: return comm.all_reduce(c.send, c.recv, c.count, c.dtype, c.op);
    case K::broadcast: return comm.broadcast(c.send, c.recv, c.count, c.dtype, c.root);
    case K::barrier: return comm.barrier();
    case K::ring_shift:
      if constexpr (fsdp::RingShiftCommunicator<C>) return comm.ring_shift(c.send, c.recv, c.count, c.dtype);
      break;
  }
  throw fsdp::Error("test issue(): this communicator has no " + std::string(fsdp::detail::name_of(c.kind)));
}

// Every kind, each count in place or not, sums whose result depends on the order.
inline std::vector<Case> every_kind_cases(int n, std::initializer_list<std::size_t> counts) {
  std::vector<Case> cases;
  for (std::size_t count : counts)
    for (bool in_place : {false, true}) {
      cases.push_back({K::all_gather, n, count, fsdp::DType::f32, fsdp::ReduceOp::sum, 0, in_place});
      cases.push_back({K::reduce_scatter, n, count, fsdp::DType::bf16, fsdp::ReduceOp::sum, 0, in_place});
      cases.push_back({K::all_reduce, n, count, fsdp::DType::f16, fsdp::ReduceOp::avg, 0, in_place});
      cases.push_back({K::broadcast, n, count, fsdp::DType::f64, fsdp::ReduceOp::sum, n - 1, in_place});
    }
  cases.push_back({K::barrier, n, 0});
  return cases;
}

// Which of the communicator's links use shared memory, as "LR" ("11": both).
inline std::string link_text(const fsdp::TcpComm& comm) {
  return std::string(comm.links().from_left ? "1" : "0") + (comm.links().to_right ? "1" : "0");
}

// Runs every case on `world` (all ranks issue them in the same order, each waited before
// the next) and returns outputs[case][rank]. `before_each(rank)`, if set, runs on each rank
// before it issues a case (e.g. to make some ranks late).
inline std::vector<std::vector<Bytes>> run_cases(TcpWorld& world, const std::vector<Case>& cases, std::uint32_t seed,
                                                 const std::function<void(int)>& before_each = {}) {
  std::vector<std::vector<Bytes>> out(cases.size(), std::vector<Bytes>(world.size()));
  const auto errors = world.each([&](fsdp::TcpComm& comm, int r) {
    for (std::size_t i = 0; i < cases.size(); ++i) {
      test_support::RankBuffers b(cases[i], test_support::random_input(cases[i], r, seed + i), r);
      if (before_each) before_each(r);
      issue(comm, b.call(cases[i])).wait();
      out[i][r] = b.result(cases[i]);
    }
  });
  for (int r = 0; r < world.size(); ++r) REQUIRE_MESSAGE(errors[r].empty(), "rank ", r, ": ", errors[r]);
  return out;
}

inline void check_against_reference(TcpWorld& world, const std::vector<Case>& cases, std::uint32_t seed = 1,
                                    const std::function<void(int)>& before_each = {}) {
  const auto out = run_cases(world, cases, seed, before_each);
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    const auto inputs = test_support::inputs_for(c, seed + static_cast<std::uint32_t>(i));
    Bytes expected;
    for (int r = 0; r < c.ranks; ++r) {
      CAPTURE(c.str());
      CAPTURE(r);
      // Only reduce_scatter's and ring_shift's results differ from rank to rank.
      if (r == 0 || c.kind == K::reduce_scatter || c.kind == K::ring_shift)
        expected = test_support::ring_expected(c.kind, inputs, r, c.count, c.dtype, c.op, c.root);
      CHECK(out[i][r] == expected);
    }
  }
}

}  // namespace test_support
