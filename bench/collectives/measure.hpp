#pragma once
// Timing and verification of one (backend, op, size) row, the same for every backend.
//
// A Runner wraps one rank of a backend with f32-sum collectives:
//   int rank(), int size()
//   void all_gather(const float* send, float* recv, size_t count)
//   const float* reduce_scatter(float* send, float* recv, size_t count)  // where the result is;
//       a backend may reduce in place and clobber `send` (Gloo's halving-doubling does)
//   void barrier()
//   void all_gather_f64(const double* send, double* recv, size_t count)  // for the timings
//
// Each iteration is barrier, start clock, collective, stop clock; an iteration's time is
// the slowest rank's, the row's time the median over iterations (robust to a descheduled
// rank when processes outnumber cores). Bandwidths follow NCCL-tests: algbw = bytes of
// the gathered (all_gather) or reduced (reduce_scatter) buffer / time, busbw = algbw *
// (n-1)/n. Before timing, one call on fresh buffers is checked element by element; it
// also warms up, and rows whose calls take long get fewer iterations (kRowBudgetSeconds).
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"
#include "pattern.hpp"

namespace bench {

enum class Op { all_gather, reduce_scatter };
inline const char* name_of(Op op) { return op == Op::all_gather ? "all_gather" : "reduce_scatter"; }

struct Row {
  std::string backend, op;
  int world = 0;
  std::size_t bytes_per_rank = 0;
  int iters = 0;
  double time_us = 0, algbw_GBps = 0, busbw_GBps = 0;
  bool verified = false;
};

namespace detail {

// Every rank learns whether every rank's check passed, so all of them fail together
// instead of the good ones waiting for a peer that left; returns the slowest rank's
// `seconds`.
template <class Runner>
double agree_on_check(Runner& r, const std::string& mine, double seconds, const Row& row) {
  const int n = r.size();
  const double report[2] = {mine.empty() ? 1.0 : 0.0, seconds};
  std::vector<double> all(2 * static_cast<std::size_t>(n));
  r.all_gather_f64(report, all.data(), 2);
  if (!mine.empty()) fsdp::detail::fail(mine);
  double slowest = 0;
  for (int q = 0; q < n; ++q) {
    if (all[2 * q] != 1.0)
      fsdp::detail::fail("collectives bench: ", row.backend, " ", row.op, " of ", row.bytes_per_rank, " bytes per rank on ",
                         n, " ranks: rank ", q, " got a wrong result (its own message names the element)");
    slowest = std::max(slowest, all[2 * q + 1]);
  }
  return slowest;
}

template <class Runner>
std::string check_result(Runner& r, Op op, const float* got, std::size_t count, const Row& row) {
  const int n = r.size(), me = r.rank();
  std::optional<std::size_t> bad;
  Period want;
  if (op == Op::all_gather) {  // chunk q is rank q's input
    for (int q = 0; q < n && !bad; ++q) {
      want = input_period(q);
      if (auto i = first_mismatch(got + q * count, count, want)) bad = q * count + *i;
    }
  } else {  // the sum over ranks of chunk `me`
    want = sum_period(n);
    bad = first_mismatch(got, count, want, me * count);
  }
  if (!bad) return {};
  const std::size_t start = op == Op::all_gather ? 0 : me * count;
  const std::size_t within = op == Op::all_gather ? *bad % count : *bad;
  return "collectives bench: " + row.backend + " " + row.op + " of " + std::to_string(row.bytes_per_rank) +
         " bytes per rank on " + std::to_string(n) + " ranks, rank " + std::to_string(me) + ": element " +
         std::to_string(*bad) + " is " + std::to_string(got[*bad]) + ", expected " +
         std::to_string(want[(start + within) % kPeriod]);
}

// Runs `iters` barrier-separated calls; returns each call's time on the slowest rank (us).
template <class Runner, class Call>
std::vector<double> slowest_rank_times(Runner& r, Call&& call, int iters) {
  using Clock = std::chrono::steady_clock;
  const std::size_t k = static_cast<std::size_t>(iters);
  std::vector<double> mine(k);
  for (std::size_t i = 0; i < k; ++i) {
    r.barrier();
    const auto start = Clock::now();
    call();
    mine[i] = std::chrono::duration<double, std::micro>(Clock::now() - start).count();
  }
  std::vector<double> all(k * static_cast<std::size_t>(r.size()));
  r.all_gather_f64(mine.data(), all.data(), k);
  std::vector<double> slowest(k, 0.0);
  for (int q = 0; q < r.size(); ++q)
    for (std::size_t i = 0; i < k; ++i) slowest[i] = std::max(slowest[i], all[q * k + i]);
  return slowest;
}

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : (v[m - 1] + v[m]) / 2;
}

}  // namespace detail

// A row's timed iterations stop at about this much time (at least one runs): at 256 MiB
// per rank on 4 oversubscribed ranks one call takes seconds, and its noise is then small.
constexpr double kRowBudgetSeconds = 1.5;

// Measures one row with up to `max_iters` timed iterations; every rank returns the same Row.
template <class Runner>
Row measure(Runner& r, const std::string& backend, Op op, std::size_t bytes_per_rank, int max_iters, int warmup) {
  using Clock = std::chrono::steady_clock;
  const int n = r.size();
  const std::size_t count = bytes_per_rank / sizeof(float);
  if (count == 0) fsdp::detail::fail("collectives bench: ", bytes_per_rank, " bytes per rank is less than one f32");
  if (max_iters < 1) fsdp::detail::fail("collectives bench: iterations must be at least 1, got ", max_iters);
  Row row{backend, name_of(op), n, count * sizeof(float)};

  // Not value-initialized: each buffer is written once, by the fill below.
  const std::size_t full = count * static_cast<std::size_t>(n);
  const std::size_t send_n = op == Op::all_gather ? count : full, recv_n = op == Op::all_gather ? full : count;
  auto send = std::make_unique_for_overwrite<float[]>(send_n);
  auto recv = std::make_unique_for_overwrite<float[]>(recv_n);
  fill_periodic(send.get(), send_n, input_period(r.rank()));
  std::fill_n(recv.get(), recv_n, -1.0f);  // never a right answer
  auto run_once = [&]() -> const float* {
    if (op == Op::all_gather) {
      r.all_gather(send.get(), recv.get(), count);
      return recv.get();
    }
    return r.reduce_scatter(send.get(), recv.get(), count);
  };

  // The checked call also warms up (connections, pages, Gloo's algorithm) and sizes the row.
  r.barrier();
  const auto t0 = Clock::now();
  const float* result = run_once();
  const double first = std::chrono::duration<double>(Clock::now() - t0).count();
  const double slowest_first = detail::agree_on_check(r, detail::check_result(r, op, result, count, row), first, row);
  row.verified = true;
  const int iters = std::clamp(static_cast<int>(kRowBudgetSeconds / std::max(slowest_first, 1e-9)), 1, max_iters);
  row.iters = iters;
  if (slowest_first > 0.1) warmup = 0;
  for (int i = 0; i < warmup; ++i) run_once();

  row.time_us = detail::median(detail::slowest_rank_times(r, run_once, iters));
  const double moved = static_cast<double>(full * sizeof(float));
  row.algbw_GBps = moved / (row.time_us * 1e-6) / 1e9;
  row.busbw_GBps = row.algbw_GBps * (n - 1) / n;
  return row;
}

}  // namespace bench
