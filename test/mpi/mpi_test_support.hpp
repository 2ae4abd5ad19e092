#pragma once
// Shared by the MpiComm tests, which run as every rank of an mpirun job (mpi_test_main.cpp
// owns the MpiSession). Every rank runs every test case in the same order and asserts on
// what it received itself; the main totals the cases over the ranks.
#include <doctest/doctest.h>

#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/mpi/mpi_comm.hpp"
#include "test/support/errors.hpp"

namespace test_mpi {

using Bytes = std::vector<std::byte>;

fsdp::MpiSession& session();  // defined in mpi_test_main.cpp

// A fresh duplicate of MPI_COMM_WORLD per test case, so one case's broken communicator
// cannot fail the next. The timeout turns a hang into a failure well within the test's.
inline fsdp::MpiComm world(std::chrono::milliseconds timeout = std::chrono::seconds(20)) {
  return fsdp::MpiComm::world(session(), fsdp::MpiCommOptions{timeout});
}

constexpr fsdp::DType kAllDTypes[] = {fsdp::DType::f32, fsdp::DType::f64, fsdp::DType::f16, fsdp::DType::bf16,
                                      fsdp::DType::i8,  fsdp::DType::u8,  fsdp::DType::i32, fsdp::DType::i64};
constexpr fsdp::ReduceOp kAllOps[] = {fsdp::ReduceOp::sum, fsdp::ReduceOp::avg, fsdp::ReduceOp::max,
                                      fsdp::ReduceOp::min};
// 0, 1, and counts that are not multiples of any world size the tests run with (but 1).
constexpr std::size_t kCounts[] = {0, 1, 5, 13};

// Element i of rank r's input: a small integer (a quarter of one for floats), so that every
// partial sum over up to 8 ranks is exact in every dtype and MPI's grouping cannot show.
inline double input_value(int r, std::size_t i, fsdp::DType t) {
  const int v = static_cast<int>((static_cast<std::size_t>(r) * 7 + i * 3) % 11);
  if (t == fsdp::DType::u8) return v;
  return fsdp::is_floating(t) ? (v - 5) * 0.25 : v - 5;
}

inline Bytes input(int r, std::size_t n, fsdp::DType t) {
  Bytes b(n * fsdp::size_of(t));
  for (std::size_t i = 0; i < n; ++i) fsdp::store_from_double(b.data(), i, t, input_value(r, i, t));
  return b;
}

// The reduction of elements [offset, offset + count) of every rank's input, in rank order,
// with avg as ThreadComm defines it: the sum scaled by 1/N in the dtype for floats, the sum
// divided by N and truncated for integers.
inline Bytes reference_reduce(int world, std::size_t offset, std::size_t count, std::size_t total, fsdp::DType t,
                              fsdp::ReduceOp op) {
  const std::size_t es = fsdp::size_of(t);
  Bytes acc(count * es);
  for (int r = 0; r < world; ++r) {
    const Bytes in = input(r, total, t);
    if (r == 0) {
      if (count) std::memcpy(acc.data(), in.data() + offset * es, count * es);
    } else {
      fsdp::detail::host_combine(acc.data(), in.data() + offset * es, count, t,
                                 op == fsdp::ReduceOp::avg ? fsdp::ReduceOp::sum : op);
    }
  }
  if (op == fsdp::ReduceOp::avg) {
    if (fsdp::is_floating(t)) {
      fsdp::detail::host_scale(acc.data(), count, t, 1.0 / world);
    } else {
      for (std::size_t i = 0; i < count; ++i)
        fsdp::store_from_double(acc.data(), i, t, std::trunc(fsdp::load_as_double(acc.data(), i, t) / world));
    }
  }
  return acc;
}

// "" if the first `n` elements agree bitwise, else where and how they differ.
inline std::string difference(const void* got, const void* want, std::size_t n, fsdp::DType t) {
  const std::size_t es = fsdp::size_of(t);
  for (std::size_t i = 0; i < n; ++i) {
    if (std::memcmp(static_cast<const std::byte*>(got) + i * es, static_cast<const std::byte*>(want) + i * es, es)) {
      std::ostringstream os;
      os << "element " << i << " of " << n << ": got " << fsdp::load_as_double(got, i, t) << ", expected "
         << fsdp::load_as_double(want, i, t);
      return os.str();
    }
  }
  return "";
}

// Names a case in assertion messages: "all_reduce f16 avg count=5 in place on rank 2 of 4".
inline std::string label(const fsdp::MpiComm& comm, const char* what, fsdp::DType t, std::size_t count,
                         bool in_place) {
  std::ostringstream os;
  os << what << ' ' << fsdp::name_of(t) << " count=" << count << (in_place ? " in place" : " out of place")
     << " on rank " << comm.rank() << " of " << comm.size();
  return os.str();
}

using test_support::contains;
using test_support::error_of;

}  // namespace test_mpi
