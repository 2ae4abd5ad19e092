#pragma once
// Output: one JSON object per row (--json), or a table per (op, world) with a column per
// backend and the TCP/Gloo and TCP/MPI ratios, then the goals checked.
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "measure.hpp"
#include "plan.hpp"

namespace bench {

inline nlohmann::json to_json(const Row& r) {
  return {{"backend", r.backend},       {"op", r.op},           {"world", r.world},
          {"bytes_per_rank", r.bytes_per_rank}, {"iters", r.iters}, {"time_us", r.time_us},
          {"algbw_GBps", r.algbw_GBps}, {"busbw_GBps", r.busbw_GBps}, {"verified", r.verified}};
}

inline Row row_from_json(const nlohmann::json& j) {
  Row r;
  r.backend = j.at("backend");
  r.op = j.at("op");
  r.world = j.at("world");
  r.bytes_per_rank = j.at("bytes_per_rank");
  r.iters = j.at("iters");
  r.time_us = j.at("time_us");
  r.algbw_GBps = j.at("algbw_GBps");
  r.busbw_GBps = j.at("busbw_GBps");
  r.verified = j.at("verified");
  return r;
}

// Rows by (op, world, bytes, backend).
class Results {
 public:
  explicit Results(const std::vector<Row>& rows) {
    for (const auto& r : rows) by_key_[{r.op, r.world, r.bytes_per_rank, r.backend}] = r;
  }
  const Row* find(const std::string& op, int world, std::size_t bytes, const std::string& backend) const {
    auto it = by_key_.find({op, world, bytes, backend});
    return it == by_key_.end() ? nullptr : &it->second;
  }
  // TCP's bandwidth over `baseline`'s for the same row (the inverse of the time ratio).
  std::optional<double> tcp_over(const Row& r, const std::string& baseline) const {
    const Row* tcp = find(r.op, r.world, r.bytes_per_rank, "tcp");
    const Row* base = find(r.op, r.world, r.bytes_per_rank, baseline);
    if (!tcp || !base || tcp->time_us <= 0) return std::nullopt;
    return base->time_us / tcp->time_us;
  }
  std::vector<std::size_t> sizes(const std::string& op, int world) const {
    std::vector<std::size_t> out;
    for (const auto& [k, r] : by_key_)
      if (std::get<0>(k) == op && std::get<1>(k) == world && (out.empty() || out.back() != r.bytes_per_rank))
        out.push_back(r.bytes_per_rank);
    return out;
  }

 private:
  std::map<std::tuple<std::string, int, std::size_t, std::string>, Row> by_key_;
};

// The --json lines: each row, whether its ranks outnumbered the cores, and on TCP's rows
// the ratios to the baselines.
inline std::string json_lines(const std::vector<Row>& rows, unsigned cores) {
  const Results res(rows);
  std::string out;
  for (const auto& r : rows) {
    auto j = to_json(r);
    j["oversubscribed"] = r.world > static_cast<int>(cores);
    if (r.backend == "tcp") {
      if (auto x = res.tcp_over(r, "gloo")) j["tcp_over_gloo"] = *x;
      if (auto x = res.tcp_over(r, "mpi")) j["tcp_over_mpi"] = *x;
    }
    out += j.dump() + "\n";
  }
  return out;
}

inline std::string format_time(double us) {
  return us < 1000 ? fmt::format("{:.0f} us", us) : fmt::format("{:.1f} ms", us / 1000);
}

inline void print_tables(const std::vector<Row>& rows, const std::vector<std::string>& backends,
                         const std::vector<int>& worlds) {
  const Results res(rows);
  const auto uses = [&](const char* b) { return std::count(backends.begin(), backends.end(), b) > 0; };
  const bool vs_gloo = uses("tcp") && uses("gloo"), vs_mpi = uses("tcp") && uses("mpi");
  for (const char* op : {"all_gather", "reduce_scatter"}) {
    for (int world : worlds) {
      const auto sizes = res.sizes(op, world);
      if (sizes.empty()) continue;
      fmt::print("\n{}, {} ranks: busbw GB/s (time per call)\n\n| bytes/rank |", op, world);
      for (const auto& b : backends) fmt::print(" {} |", b);
      if (vs_gloo) fmt::print(" tcp/gloo |");
      if (vs_mpi) fmt::print(" tcp/mpi |");
      fmt::print("\n|---:|");
      for (std::size_t i = 0; i < backends.size() + vs_gloo + vs_mpi; ++i) fmt::print("---:|");
      fmt::print("\n");
      for (std::size_t bytes : sizes) {
        fmt::print("| {} |", format_bytes(bytes));
        const Row* any = nullptr;
        for (const auto& b : backends) {
          const Row* r = res.find(op, world, bytes, b);
          if (r) any = r;
          fmt::print(" {} |", r ? fmt::format("{:.3f} ({})", r->busbw_GBps, format_time(r->time_us)) : "-");
        }
        auto ratio = [&](const char* base) {
          auto x = any ? res.tcp_over(*any, base) : std::nullopt;
          fmt::print(" {} |", x ? fmt::format("{:.2f}x", *x) : "-");
        };
        if (vs_gloo) ratio("gloo");
        if (vs_mpi) ratio("mpi");
        fmt::print("\n");
      }
    }
  }
}

// The goals, from the rows of this run: TCP >= 1.0x Gloo from 64 KiB up (both
// ops, every world); stretch: all_gather TCP >= MPI.
inline void print_goals(const std::vector<Row>& rows) {
  const Results res(rows);
  auto worst = [&](const char* baseline, const char* only_op) {
    std::optional<std::pair<double, const Row*>> w;
    for (const auto& r : rows) {
      if (r.backend != "tcp" || r.bytes_per_rank < 64 * KiB || (only_op && r.op != only_op)) continue;
      if (auto x = res.tcp_over(r, baseline); x && (!w || *x < w->first)) w = {{*x, &r}};
    }
    return w;
  };
  auto line = [](const char* what, const std::optional<std::pair<double, const Row*>>& w) {
    if (!w) return fmt::print("{}: not measured (needs tcp and its baseline, sizes >= 64 KiB)\n", what);
    fmt::print("{}: {} (lowest {:.2f}x: {}, {}, {} ranks)\n", what, w->first >= 1.0 ? "MET" : "MISSED", w->first,
               w->second->op, format_bytes(w->second->bytes_per_rank), w->second->world);
  };
  fmt::print("\n");
  line("goal TCP >= 1.0x Gloo from 64 KiB up", worst("gloo", nullptr));
  line("stretch all_gather TCP >= OpenMPI (shared memory) from 64 KiB up", worst("mpi", "all_gather"));
}

}  // namespace bench
