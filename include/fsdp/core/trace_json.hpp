#pragma once
// Writes an fsdp::Trace as Chrome trace JSON, which chrome://tracing and ui.perfetto.dev
// open directly: {"traceEvents": [...], "displayTimeUnit": "ms"}. Each span is a complete
// event {"name", "cat", "ph": "X", "ts", "dur", "pid": rank, "tid": lane} with ts and dur
// in microseconds (ts since the trace's origin); metadata events ("ph": "M") name the
// process "rank N" and its two threads "compute" and "communication". Counter tracks
// (CounterTrack: a value over time, "ph": "C", drawn as a filled graph) may be added, each in
// a process of its own: a memory plan's live bytes, allocation by allocation.
//
// Kept apart from fsdp/core/trace.hpp so that only code that exports traces needs nlohmann/json.
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/core/error.hpp"
#include "fsdp/core/trace.hpp"

namespace fsdp {

inline std::string to_chrome_json(const Trace& trace, const std::vector<CounterTrack>& counters = {}) {
  using micros = std::chrono::duration<double, std::micro>;
  const int pid = trace.rank();
  nlohmann::json events = nlohmann::json::array();
  auto metadata = [&](const char* what, int tid, std::string name) {
    events.push_back({{"name", what}, {"ph", "M"}, {"pid", pid}, {"tid", tid}, {"args", {{"name", std::move(name)}}}});
  };
  metadata("process_name", 0, "rank " + std::to_string(pid));
  metadata("thread_name", static_cast<int>(Trace::Lane::compute), "compute");
  metadata("thread_name", static_cast<int>(Trace::Lane::communication), "communication");
  for (const Trace::Event& e : trace.events()) {
    events.push_back({{"name", e.name},
                      {"cat", e.category},
                      {"ph", "X"},
                      {"ts", micros(e.begin - trace.origin()).count()},
                      {"dur", micros(e.end - e.begin).count()},
                      {"pid", pid},
                      {"tid", static_cast<int>(e.lane)}});
  }
  std::vector<int> named;  // one process_name per pid
  for (const CounterTrack& c : counters) {
    if (std::find(named.begin(), named.end(), c.pid) == named.end()) {
      named.push_back(c.pid);
      events.push_back({{"name", "process_name"}, {"ph", "M"}, {"pid", c.pid}, {"tid", 0}, {"args", {{"name", c.process}}}});
    }
    for (const auto& [ts, value] : c.points)
      events.push_back({{"name", c.name}, {"ph", "C"}, {"ts", ts}, {"pid", c.pid}, {"args", {{"bytes", value}}}});
  }
  const nlohmann::json doc = {{"traceEvents", std::move(events)}, {"displayTimeUnit", "ms"}};
  // Names are caller strings; invalid UTF-8 in one becomes U+FFFD instead of failing the export.
  return doc.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

// Writes to `path` + ".tmp" and renames it over `path`, so a reader (a viewer reloading
// the file, a job collecting it) never sees half a trace. Throws fsdp::Error naming the
// path if it cannot be written; the temporary file is not left behind.
inline void write_chrome_json(const Trace& trace, const std::string& path, const std::vector<CounterTrack>& counters = {}) {
  const std::string text = to_chrome_json(trace, counters) + "\n";
  const std::string tmp = path + ".tmp";
  errno = 0;
  std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
  if (!out) {
    const std::string why = errno ? std::generic_category().message(errno) : "cannot open it";
    detail::fail_as(ErrorKind::io, "cannot write trace to '", path, "': opening '", tmp, "' for writing failed: ", why);
  }
  out.write(text.data(), static_cast<std::streamsize>(text.size()));
  out.close();
  std::error_code ignored;
  if (!out) {
    std::filesystem::remove(tmp, ignored);
    detail::fail_as(ErrorKind::io, "cannot write trace to '", path, "': writing '", tmp, "' failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) {
    std::filesystem::remove(tmp, ignored);
    detail::fail_as(ErrorKind::io, "cannot write trace to '", path, "': renaming '", tmp,
                    "' to it failed: ", ec.message());
  }
}

}  // namespace fsdp
