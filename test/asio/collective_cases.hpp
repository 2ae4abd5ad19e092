#pragma once
// One collective call made on every rank, with the buffers each rank passes (separate or
// NCCL-style in place), deterministic inputs and the expected output (ring_reference.hpp).
// Shared by the planner simulation (ring_test) and the socket tests (tcp_comm_test).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/core/detail/collective_call.hpp"
#include "ring_reference.hpp"

namespace test_support {

struct Case {
  fsdp::detail::CollectiveKind kind;
  int ranks;
  std::size_t count;
  fsdp::DType dtype = fsdp::DType::f32;
  fsdp::ReduceOp op = fsdp::ReduceOp::sum;
  int root = 0;
  bool in_place = false;

  std::string str() const {
    std::ostringstream os;
    fsdp::detail::CollectiveCall c{kind, nullptr, nullptr, count, dtype, op, root};
    os << c.describe() << " on " << ranks << " ranks" << (in_place ? ", in place" : "");
    return os.str();
  }
  std::size_t esize() const { return fsdp::size_of(dtype); }
  std::size_t input_elems() const { return kind == fsdp::detail::CollectiveKind::reduce_scatter ? count * ranks : count; }
  std::size_t output_elems() const { return kind == fsdp::detail::CollectiveKind::all_gather ? count * ranks : count; }
};

// Values that are exact in every dtype (small integers and eighths, of both signs for the
// signed types), so sums of a few never overflow an i8 / u8 yet depend on the order for
// the 16-bit floats (rounding). Drawn from a table of 4096 encoded values, which keeps
// multi-MiB inputs quick to make in unoptimised builds.
inline Bytes random_input(const Case& c, int rank, std::uint32_t seed) {
  constexpr std::size_t kTable = 4096;
  const std::size_t es = c.esize();
  std::mt19937 rng(seed * 1000003u + static_cast<std::uint32_t>(rank));
  const bool small = c.dtype == fsdp::DType::i8 || c.dtype == fsdp::DType::u8;
  std::uniform_int_distribution<int> v(small ? 0 : -3000, small ? 15 : 3000);
  Bytes table(kTable * es);
  for (std::size_t i = 0; i < kTable; ++i) {
    double x = v(rng);
    if (fsdp::is_floating(c.dtype)) x = x / 8 + (i % 3) * 1e-3;
    if (c.dtype == fsdp::DType::f8e4m3 || c.dtype == fsdp::DType::f8e5m2) x /= 4;  // sums of a few stay below E4M3's 448
    fsdp::store_from_double(table.data(), i, c.dtype, x);
  }
  Bytes b(c.input_elems() * es);
  std::uint32_t state = rng();
  for (std::size_t i = 0; i < c.input_elems(); ++i) {
    state = state * 1664525u + 1013904223u;  // an LCG picks the entries
    std::memcpy(b.data() + i * es, table.data() + (state >> 20) * es, es);
  }
  return b;
}

// One rank's buffers for a case, set up as the caller of a collective would.
struct RankBuffers {
  Bytes send, recv;  // in place: everything is in `recv`
  const void* send_ptr = nullptr;
  void* recv_ptr = nullptr;
  std::size_t out_offset = 0;  // where the result starts in `recv` (bytes)

  RankBuffers(const Case& c, const Bytes& input, int rank) {
    using K = fsdp::detail::CollectiveKind;
    const std::size_t es = c.esize(), in_bytes = c.input_elems() * es, out_bytes = c.output_elems() * es;
    if (!c.in_place) {
      send = input;
      recv.assign(out_bytes, std::byte{0xcd});
      send_ptr = send.data();
      recv_ptr = recv.data();
      return;
    }
    switch (c.kind) {
      case K::all_gather:  // send == recv + rank * count
        recv.assign(out_bytes, std::byte{0xcd});
        std::copy(input.begin(), input.end(), recv.begin() + rank * in_bytes);
        send_ptr = recv.data() + rank * in_bytes;
        break;
      case K::reduce_scatter:  // recv == send + rank * count
        recv = input;
        send_ptr = recv.data();
        out_offset = rank * out_bytes;
        break;
      default:  // send == recv
        recv = input;
        if (c.kind == K::broadcast && rank != c.root) std::fill(recv.begin(), recv.end(), std::byte{0xcd});
        send_ptr = recv.data();
        break;
    }
    recv_ptr = recv.data() + out_offset;
  }
  Bytes result(const Case& c) const {
    auto first = recv.begin() + out_offset;
    return Bytes(first, first + c.output_elems() * c.esize());
  }
  fsdp::detail::CollectiveCall call(const Case& c, std::uint64_t seq = 0) const {
    return {c.kind, send_ptr, recv_ptr, c.count, c.dtype, c.op, c.root, seq};
  }
};

inline std::vector<Bytes> inputs_for(const Case& c, std::uint32_t seed) {
  std::vector<Bytes> in;
  for (int r = 0; r < c.ranks; ++r) in.push_back(random_input(c, r, seed));
  return in;
}

}  // namespace test_support
