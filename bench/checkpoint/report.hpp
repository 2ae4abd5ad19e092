#pragma once
// bench/checkpoint's rows: repeated wall times of one operation over a known byte count,
// their best and median, the ratio of a checkpoint row to its baseline, and how each is
// printed (a Markdown table) and written (one JSON object per line).
#include <algorithm>
#include <cstdint>
#include <fstream>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

namespace bench {

inline constexpr double kGoalRatio = 0.8;  // a checkpoint row's target, relative to its plain-file baseline

inline double median_of(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

inline double best_of(const std::vector<double>& v) { return v.empty() ? 0 : *std::min_element(v.begin(), v.end()); }

struct ThroughputRow {
  std::string name;       // e.g. "save_sharded_checkpoint"
  std::string direction;  // "write" or "read"
  bool baseline = false;
  bool has_goal = true;       // checkpoint rows the goal applies to (not an option's row)
  int files = 1;              // files written or read concurrently
  std::uint64_t bytes = 0;    // per run, all files together
  std::vector<double> seconds;  // one wall time per repeat

  double best_s() const { return best_of(seconds); }
  double median_s() const { return median_of(seconds); }
  double best_gbps() const { return best_s() > 0 ? double(bytes) / best_s() / 1e9 : 0; }
  double median_gbps() const { return median_s() > 0 ? double(bytes) / median_s() / 1e9 : 0; }
};

// A checkpoint row against the baselines of its direction: the sequential one-file
// baseline decides the goal; the N-files baseline (what N ranks writing their own files get)
// is shown next to it.
struct Comparison {
  const ThroughputRow* one_file = nullptr;
  const ThroughputRow* n_files = nullptr;
};

inline double ratio(const ThroughputRow& row, const ThroughputRow* base, bool best = false) {
  if (!base) return 0;
  const double b = best ? base->best_gbps() : base->median_gbps();
  return b > 0 ? (best ? row.best_gbps() : row.median_gbps()) / b : 0;
}

inline void print_table_header() {
  fmt::print("| row | files | bytes | best s | median s | best GB/s | median GB/s | vs 1-file baseline (median; best) "
             "| vs N-files baseline (median) | goal >= {:.1f}x |\n",
             kGoalRatio);
  fmt::print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
}

inline void print_row(const ThroughputRow& r, const Comparison& c = {}) {
  std::string vs1 = "-", vsn = "-", goal = "-";
  if (!r.baseline) {
    vs1 = fmt::format("{:.2f}x; {:.2f}x", ratio(r, c.one_file), ratio(r, c.one_file, true));
    if (c.n_files) vsn = fmt::format("{:.2f}x", ratio(r, c.n_files));
    if (r.has_goal) goal = ratio(r, c.one_file) >= kGoalRatio ? "met" : "NOT met";
  }
  fmt::print("| {} | {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {} | {} | {} |\n", r.name, r.files, r.bytes,
             r.best_s(), r.median_s(), r.best_gbps(), r.median_gbps(), vs1, vsn, goal);
}

inline nlohmann::json row_json(const ThroughputRow& r, const Comparison& c = {}) {
  nlohmann::json j{{"row", r.name},           {"kind", r.baseline ? "baseline" : "checkpoint"},
                   {"direction", r.direction}, {"files", r.files},
                   {"bytes", r.bytes},         {"repeat", r.seconds.size()},
                   {"seconds", r.seconds},     {"best_s", r.best_s()},
                   {"median_s", r.median_s()}, {"best_GBps", r.best_gbps()},
                   {"median_GBps", r.median_gbps()}};
  if (!r.baseline) {
    j["ratio_vs_1_file"] = ratio(r, c.one_file);
    j["best_ratio_vs_1_file"] = ratio(r, c.one_file, true);
    if (c.n_files) j["ratio_vs_n_files"] = ratio(r, c.n_files);
    if (r.has_goal) {
      j["goal_ratio"] = kGoalRatio;
      j["goal_met"] = ratio(r, c.one_file) >= kGoalRatio;
    }
  }
  return j;
}

// JSON Lines: one object per row, written as the rows are reported.
class JsonRows {
 public:
  explicit JsonRows(const std::string& path) {
    if (!path.empty()) out_.emplace(path);
  }
  bool good() const { return !out_ || out_->good(); }
  void add(const nlohmann::json& row) {
    if (out_) *out_ << row.dump() << "\n" << std::flush;
  }

 private:
  std::optional<std::ofstream> out_;
};

}  // namespace bench
