// fsdp/mpi/mpi_types.hpp: the MPI datatypes and ops fsdp's dtypes map to. f16 and bf16 are
// reduced by user ops that must round like detail::host_combine (float, then nearest even);
// checked on random bits with MPI_Reduce_local, on ties whose rounding tells nearest-even
// from truncation and from ties-away, and in all_reduce on random values, where every rank
// must get the same bits, close to the exact sum, and for two ranks the rank-order sum.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "test/mpi/mpi_test_support.hpp"

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using test_mpi::Bytes;

TEST_CASE("datatypes: one MPI datatype per dtype, of the dtype's size; f16 and bf16 are named 2-byte types") {
  auto& s = test_mpi::session();
  for (DType t : test_mpi::kAllDTypes) {
    int size = 0;
    MPI_Type_size(s.datatype(t), &size);
    CHECK_MESSAGE(size == static_cast<int>(fsdp::size_of(t)), fsdp::name_of(t));
  }
  char name[MPI_MAX_OBJECT_NAME];
  int len = 0;
  MPI_Type_get_name(s.datatype(DType::bf16), name, &len);
  CHECK(std::string(name, len) == "fsdp_bf16");
  CHECK(s.datatype(DType::f16) != s.datatype(DType::bf16));
  CHECK(s.op(DType::f32, ReduceOp::sum) == MPI_SUM);
  CHECK(s.op(DType::i8, ReduceOp::min) == MPI_MIN);
  CHECK(s.op(DType::bf16, ReduceOp::sum) != MPI_SUM);
  CHECK(test_mpi::contains(test_mpi::error_of([&] { s.op(DType::f32, ReduceOp::avg); }), "avg has no MPI_Op"));
}

TEST_CASE("the 8-bit floats move as bytes; their reductions are refused, e8m0's max and min are byte-wise") {
  auto& s = test_mpi::session();
  for (DType t : {DType::f8e4m3, DType::f8e5m2, DType::e8m0}) CHECK(s.datatype(t) == MPI_UINT8_T);
  for (DType t : {DType::f8e4m3, DType::f8e5m2})
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
      CAPTURE(fsdp::name_of(t));
      CAPTURE(fsdp::name_of(op));
      CHECK(test_mpi::contains(test_mpi::error_of([&] { s.op(t, op); }),
                               "MPI adapter: " + std::string(fsdp::name_of(op)) + " of " + std::string(fsdp::name_of(t)) +
                                   ": MpiComm has no 8-bit float arithmetic"));
    }
  CHECK(s.op(DType::e8m0, ReduceOp::max) == MPI_MAX);  // the patterns order as the values do
  CHECK(s.op(DType::e8m0, ReduceOp::min) == MPI_MIN);
}

TEST_CASE("mpi_error_text: MPI's own words for an error code") {
  CHECK(fsdp::detail::mpi_error_text(MPI_ERR_TRUNCATE) == "MPI_ERR_TRUNCATE: message truncated");
  CHECK(test_mpi::contains(fsdp::detail::mpi_error_text(MPI_ERR_COUNT), "MPI_ERR_COUNT"));
}

TEST_CASE("f16 and bf16 ops: bitwise detail::host_combine on random values (MPI_Reduce_local)") {
  auto& s = test_mpi::session();
  std::mt19937 rng(42);
  std::uniform_int_distribution<int> bits(0, 0xffff);
  for (DType t : {DType::f16, DType::bf16}) {
    const unsigned exponent_mask = t == DType::f16 ? 0x7c00u : 0x7f80u;
    for (ReduceOp op : {ReduceOp::sum, ReduceOp::max, ReduceOp::min}) {
      std::vector<std::uint16_t> in(1000), inout(1000);
      for (auto* v : {&in, &inout})
        for (auto& x : *v) do x = static_cast<std::uint16_t>(bits(rng)); while ((x & exponent_mask) == exponent_mask);
      auto want = inout;
      fsdp::detail::host_combine(want.data(), in.data(), want.size(), t, op);
      MPI_Reduce_local(in.data(), inout.data(), static_cast<int>(in.size()), s.datatype(t), s.op(t, op));
      CHECK_MESSAGE(inout == want, fsdp::name_of(t), " ", fsdp::name_of(op));
    }
  }
}

TEST_CASE("f16 and bf16 sums round ties to even, in MPI_Reduce_local and in all_reduce") {
  // x + y lies exactly halfway between two neighbours: nearest-even picks the even one,
  // truncation would give `low` both times, ties-away `high` both times.
  struct Tie { DType t; std::uint16_t x, y, even; };
  const Tie ties[] = {
      {DType::bf16, 0x3f80, 0x3b80, 0x3f80},  // 1 + 2^-8 -> 1
      {DType::bf16, 0x3f81, 0x3b80, 0x3f82},  // (1 + 2^-7) + 2^-8 -> 1 + 2^-6
      {DType::f16, 0x3c00, 0x1000, 0x3c00},   // 1 + 2^-11 -> 1
      {DType::f16, 0x3c01, 0x1000, 0x3c02},   // (1 + 2^-10) + 2^-11 -> 1 + 2^-9
  };
  auto& s = test_mpi::session();
  auto comm = test_mpi::world();
  for (const Tie& tie : ties) {
    std::uint16_t inout = tie.x;
    MPI_Reduce_local(&tie.y, &inout, 1, s.datatype(tie.t), s.op(tie.t, ReduceOp::sum));
    CHECK(inout == tie.even);
    if (comm.size() < 2) continue;
    // Rank 0 holds x, rank 1 holds y, the others zeros: one rounding, whatever the grouping.
    std::uint16_t mine = comm.rank() == 0 ? tie.x : comm.rank() == 1 ? tie.y : 0, sum = 0;
    comm.all_reduce(&mine, &sum, 1, tie.t, ReduceOp::sum).wait();
    CHECK_MESSAGE(sum == tie.even, fsdp::name_of(tie.t), " ", tie.x, " + ", tie.y);
  }
}

// Rank r's random values in [-1, 1], rounded to `t`.
Bytes random_input(int r, std::size_t n, DType t) {
  std::mt19937 rng(1000 + r);
  std::uniform_real_distribution<double> v(-1, 1);
  Bytes b(n * fsdp::size_of(t));
  for (std::size_t i = 0; i < n; ++i) fsdp::store_from_double(b.data(), i, t, v(rng));
  return b;
}

double epsilon(DType t) {
  switch (t) {
    case DType::f16: return std::ldexp(1.0, -10);
    case DType::bf16: return std::ldexp(1.0, -7);
    case DType::f64: return std::ldexp(1.0, -52);
    default: return std::ldexp(1.0, -23);
  }
}

TEST_CASE("random float sums: same bits on every rank, within rounding of the exact sum, rank order for 2 ranks") {
  auto comm = test_mpi::world();
  const int n = comm.size();
  const std::size_t count = 257;
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
    const std::size_t es = fsdp::size_of(t);
    std::vector<Bytes> inputs;
    for (int r = 0; r < n; ++r) inputs.push_back(random_input(r, count, t));
    Bytes rank_order = inputs[0];
    for (int r = 1; r < n; ++r) fsdp::detail::host_combine(rank_order.data(), inputs[r].data(), count, t, ReduceOp::sum);

    Bytes sum(count * es), everyone(count * es * n), scattered(es);
    comm.all_reduce(inputs[comm.rank()].data(), sum.data(), count, t, ReduceOp::sum).wait();
    comm.all_gather(sum.data(), everyone.data(), count, t).wait();
    for (int r = 0; r < n; ++r)
      CHECK_MESSAGE(test_mpi::difference(everyone.data() + r * count * es, sum.data(), count, t) == "",
                    fsdp::name_of(t), ": rank ", r, " got other bits than rank ", comm.rank());
    // Elements 0..n-1 reduced and scattered, one per rank: this rank's is element rank().
    comm.reduce_scatter(inputs[comm.rank()].data(), scattered.data(), 1, t, ReduceOp::sum).wait();

    // n - 1 roundings, each at most half an ulp of a partial sum of magnitude <= n.
    const double tolerance = n * n * epsilon(t);
    auto exact = [&](std::size_t i) {
      double e = 0;
      for (int r = 0; r < n; ++r) e += fsdp::load_as_double(inputs[r].data(), i, t);
      return e;
    };
    for (std::size_t i = 0; i < count; ++i)
      CHECK_MESSAGE(std::abs(fsdp::load_as_double(sum.data(), i, t) - exact(i)) <= tolerance, fsdp::name_of(t),
                    " element ", i);
    const auto mine = static_cast<std::size_t>(comm.rank());
    CHECK(std::abs(fsdp::load_as_double(scattered.data(), 0, t) - exact(mine)) <= tolerance);
    if (n <= 2) {  // a + b is the only grouping of two terms
      CHECK_MESSAGE(test_mpi::difference(sum.data(), rank_order.data(), count, t) == "", fsdp::name_of(t));
      CHECK(test_mpi::difference(scattered.data(), rank_order.data() + mine * es, 1, t) == "");
    }
  }
}

}  // namespace
