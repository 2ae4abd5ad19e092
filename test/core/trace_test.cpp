// fsdp/core/trace.hpp and fsdp/core/trace_json.hpp: spans record what they cover, from any thread,
// MaybeSpan is free when there is no trace, and the Chrome trace JSON carries every field
// a viewer needs and is written whole or not at all.
#include <fsdp/core/trace.hpp>  // first: it must compile on its own
#include <fsdp/core/trace_json.hpp>

#include <doctest/doctest.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <new>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <unistd.h>

#include <nlohmann/json.hpp>

// Counts allocations on the calling thread, to check that MaybeSpan(nullptr, ...) builds no
// string. Replacing the global operator new is the only way to see an allocation.
namespace {
thread_local std::size_t allocations = 0;
}
// Not inlined: GCC would otherwise pair the inlined malloc and free across the replaced
// functions and warn (-Wmismatched-new-delete) about a pairing that is in fact matched.
[[gnu::noinline]] void* operator new(std::size_t n) {
  ++allocations;
  if (void* p = std::malloc(n ? n : 1)) return p;
  throw std::bad_alloc();
}
[[gnu::noinline]] void operator delete(void* p) noexcept { std::free(p); }
[[gnu::noinline]] void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace {

using fsdp::Trace;
using Lane = fsdp::Trace::Lane;
using namespace std::chrono_literals;

std::filesystem::path fresh_dir(const std::string& name) {
  const char* bazel_tmp = std::getenv("TEST_TMPDIR");
  auto base = bazel_tmp ? std::filesystem::path(bazel_tmp) : std::filesystem::temp_directory_path();
  auto dir = base / ("fsdp_trace_test_" + std::to_string(::getpid()) + "_" + name);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir;
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream os;
  os << in.rdbuf();
  return os.str();
}

}  // namespace

TEST_CASE("a span covers construction to destruction; nested spans are recorded inner first") {
  Trace trace(3);
  CHECK(trace.rank() == 3);
  CHECK(trace.origin() <= Trace::Clock::now());
  const auto before = Trace::Clock::now();
  {
    auto outer = trace.span("step", "train");
    std::this_thread::sleep_for(2ms);
    {
      auto inner = trace.span("all_gather", "comm", Lane::communication);
      std::this_thread::sleep_for(2ms);
      CHECK(trace.size() == 0);  // nothing is recorded until a span ends
    }
    CHECK(trace.size() == 1);
    std::this_thread::sleep_for(1ms);
  }
  const auto after = Trace::Clock::now();
  const auto ev = trace.events();
  REQUIRE(ev.size() == 2);
  CHECK(ev[0].name == "all_gather");
  CHECK(ev[0].category == "comm");
  CHECK(ev[0].lane == Lane::communication);
  CHECK(ev[1].name == "step");
  CHECK(ev[1].category == "train");
  CHECK(ev[1].lane == Lane::compute);  // the default lane
  CHECK(before <= ev[1].begin);
  CHECK(ev[1].begin <= ev[0].begin);
  CHECK(ev[0].end <= ev[1].end);
  CHECK(ev[1].end <= after);
  CHECK(ev[0].end - ev[0].begin >= 2ms);
  CHECK(ev[1].end - ev[1].begin >= 5ms);
}

TEST_CASE("spans move without being recorded twice; end() records once, early") {
  static_assert(std::is_nothrow_move_constructible_v<Trace::Span>);
  static_assert(std::is_move_assignable_v<Trace::Span>);
  static_assert(!std::is_copy_constructible_v<Trace::Span> && !std::is_copy_assignable_v<Trace::Span>);
  Trace trace(0);
  {
    auto a = trace.span("a", "x");
    Trace::Span b = std::move(a);  // `a` is now empty: its destruction records nothing
  }
  CHECK(trace.size() == 1);
  {
    auto c = trace.span("c", "x");
    c = trace.span("d", "x");  // "c" is over: recorded now, not lost
    CHECK(trace.size() == 2);
    CHECK(trace.events().back().name == "c");
  }
  CHECK(trace.size() == 3);
  CHECK(trace.events().back().name == "d");
  {
    auto e = trace.span("e", "x");
    e.end();
    CHECK(trace.size() == 4);
    e.end();
  }
  CHECK(trace.size() == 4);
}

TEST_CASE("add records exactly what it is given, rejects a span that ends before it begins; clear keeps the origin") {
  Trace trace(1);
  const auto t0 = trace.origin() + 5ms;
  trace.add("custom", "io", Lane::communication, t0, t0 + 3ms);
  try {
    trace.add("backwards", "io", Lane::compute, t0, t0 - 1ns);
    FAIL("expected fsdp::Error");
  } catch (const fsdp::Error& e) {  // the library's one exception type: a caller's bug
    CHECK(e.kind() == fsdp::ErrorKind::misuse);
    CHECK(std::string(e.what()) == "fsdp: Trace::add: span 'backwards' ends before it begins");
  }
  auto ev = trace.events();
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].begin == t0);
  CHECK(ev[0].end == t0 + 3ms);
  const auto origin = trace.origin();
  trace.clear();
  CHECK(trace.size() == 0);
  CHECK(trace.events().empty());
  CHECK(trace.origin() == origin);
  // A shared origin puts several ranks' traces on one time axis.
  Trace other(2, origin);
  CHECK(other.origin() == origin);
}

TEST_CASE("two threads recording at once lose nothing and keep each thread's order") {
  // A compute thread and a communication worker record into one Trace. Without the mutex,
  // concurrent push_backs lose events or corrupt the vector (and -fsanitize=thread reports it).
  constexpr int kPerThread = 20000;
  Trace trace(0);
  std::atomic<bool> go{false};
  auto record = [&](Lane lane) {
    while (!go.load()) std::this_thread::yield();  // start together, to overlap for real
    for (int i = 0; i < kPerThread; ++i) {
      auto s = trace.span(std::to_string(i), "t", lane);
    }
  };
  std::thread comm(record, Lane::communication);
  std::thread compute(record, Lane::compute);
  go = true;
  comm.join();
  compute.join();
  const auto ev = trace.events();
  REQUIRE(ev.size() == 2 * kPerThread);
  int next[2] = {0, 0};
  bool in_order = true;
  for (const auto& e : ev) {
    int& n = next[static_cast<int>(e.lane)];
    in_order = in_order && e.name == std::to_string(n);
    ++n;
  }
  CHECK(in_order);
  CHECK(next[0] == kPerThread);
  CHECK(next[1] == kPerThread);
}

TEST_CASE("MaybeSpan: nothing recorded or allocated without a trace, one event with one") {
  Trace trace(0);
  const std::size_t before = allocations;
  {
    fsdp::MaybeSpan s(nullptr, "a name far too long for the small-string buffer", "category also long enough");
  }
  const std::size_t after_null = allocations;  // read before CHECK, which may allocate itself
  CHECK(after_null == before);
  CHECK(trace.size() == 0);
  {  // the counter does see allocations: a real span with the same strings allocates
    auto s = trace.span("a name far too long for the small-string buffer", "category also long enough");
  }
  const std::size_t after_span = allocations;
  CHECK(after_span > after_null);
  trace.clear();

  {
    fsdp::MaybeSpan s(&trace, "reduce_scatter", "comm", Lane::communication);
    std::this_thread::sleep_for(1ms);
    CHECK(trace.size() == 0);
  }
  const auto ev = trace.events();
  REQUIRE(ev.size() == 1);
  CHECK(ev[0].name == "reduce_scatter");
  CHECK(ev[0].category == "comm");
  CHECK(ev[0].lane == Lane::communication);
  CHECK(ev[0].end - ev[0].begin >= 1ms);
}

TEST_CASE("Chrome trace JSON: every field of every event, and the metadata naming rank and lanes") {
  Trace trace(5);
  const auto o = trace.origin();
  trace.add("forward \"unit 0\" \xc3\xa9", "compute", Lane::compute, o + 1500us, o + 1750us);
  trace.add("all_gather 48 KB", "all_gather", Lane::communication, o + 2ms, o + 3ms + 1ns);
  const auto doc = nlohmann::json::parse(fsdp::to_chrome_json(trace));
  REQUIRE(doc.is_object());
  CHECK(doc.size() == 2);
  CHECK(doc.at("displayTimeUnit") == "ms");
  const auto& ev = doc.at("traceEvents");
  REQUIRE(ev.is_array());
  REQUIRE(ev.size() == 5);

  auto check_meta = [](const nlohmann::json& m, const char* what, int tid, const char* name) {
    CHECK(m.at("ph") == "M");
    CHECK(m.at("name") == what);
    CHECK(m.at("pid") == 5);
    CHECK(m.at("tid") == tid);
    CHECK(m.at("args") == nlohmann::json{{"name", name}});
  };
  check_meta(ev[0], "process_name", 0, "rank 5");
  check_meta(ev[1], "thread_name", 0, "compute");
  check_meta(ev[2], "thread_name", 1, "communication");

  const auto& a = ev[3];
  CHECK(a.size() == 7);  // name, cat, ph, ts, dur, pid, tid and nothing else
  CHECK(a.at("name") == "forward \"unit 0\" \xc3\xa9");
  CHECK(a.at("cat") == "compute");
  CHECK(a.at("ph") == "X");
  CHECK(a.at("ts").is_number_float());
  CHECK(a.at("ts").get<double>() == 1500.0);
  CHECK(a.at("dur").get<double>() == 250.0);
  CHECK(a.at("pid") == 5);
  CHECK(a.at("tid") == 0);

  const auto& b = ev[4];
  CHECK(b.at("name") == "all_gather 48 KB");
  CHECK(b.at("cat") == "all_gather");
  CHECK(b.at("ts").get<double>() == 2000.0);
  CHECK(b.at("dur").is_number_float());
  CHECK(b.at("dur").get<double>() == doctest::Approx(1000.001).epsilon(1e-12));  // sub-microsecond kept
  CHECK(b.at("tid") == 1);
}

TEST_CASE("an empty trace still names its process and lanes; invalid UTF-8 in a name does not fail the export") {
  Trace trace(0);
  auto doc = nlohmann::json::parse(fsdp::to_chrome_json(trace));
  CHECK(doc.at("traceEvents").size() == 3);
  trace.add("bad \xff byte", "x", Lane::compute, trace.origin(), trace.origin());
  std::string text;
  CHECK_NOTHROW(text = fsdp::to_chrome_json(trace));
  doc = nlohmann::json::parse(text);
  CHECK(doc.at("traceEvents").at(3).at("name") == "bad \xef\xbf\xbd byte");  // U+FFFD
}

TEST_CASE("write_chrome_json writes the whole file through a temporary and replaces an old one") {
  const auto dir = fresh_dir("write");
  const auto path = dir / "rank0.json";
  Trace trace(0);
  { auto s = trace.span("step", "train"); }
  fsdp::write_chrome_json(trace, path.string());
  CHECK(nlohmann::json::parse(slurp(path)) == nlohmann::json::parse(fsdp::to_chrome_json(trace)));
  CHECK(!std::filesystem::exists(path.string() + ".tmp"));

  { auto s = trace.span("step 2", "train"); }
  fsdp::write_chrome_json(trace, path.string());  // over the old file
  CHECK(nlohmann::json::parse(slurp(path)).at("traceEvents").size() == 5);
  CHECK(!std::filesystem::exists(path.string() + ".tmp"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("write_chrome_json fails with fsdp::Error naming the path, and leaves no temporary behind") {
  const auto dir = fresh_dir("errors");
  Trace trace(0);
  const std::string missing = (dir / "no_such_dir" / "trace.json").string();
  CHECK_THROWS_WITH_AS(fsdp::write_chrome_json(trace, missing), doctest::Contains(("'" + missing + "'").c_str()), fsdp::Error);
  CHECK_THROWS_WITH_AS(fsdp::write_chrome_json(trace, missing), doctest::Contains("No such file or directory"), fsdp::Error);

  // The temporary can be written but not renamed over a directory.
  const auto occupied = dir / "a_directory";
  std::filesystem::create_directory(occupied);
  CHECK_THROWS_WITH_AS(fsdp::write_chrome_json(trace, occupied.string()),
                       doctest::Contains(("cannot write trace to '" + occupied.string() + "'").c_str()), fsdp::Error);
  CHECK(!std::filesystem::exists(occupied.string() + ".tmp"));
  CHECK(std::filesystem::is_directory(occupied));
  std::filesystem::remove_all(dir);
}

TEST_CASE("counter tracks: a process of their own, named, and one \"C\" event per point with its value") {
  Trace trace(2);
  const std::vector<fsdp::CounterTrack> counters{
      {"rank 2: fsdp::plan", 1002, "planned device bytes", {{0.0, 64.0}, {1.0, 192.0}, {2.0, 128.0}}},
      {"rank 2: fsdp::plan", 1002, "planned host bytes", {{0.0, 0.0}}}};
  const auto doc = nlohmann::json::parse(fsdp::to_chrome_json(trace, counters));
  const auto& ev = doc.at("traceEvents");
  REQUIRE(ev.size() == 3 + 1 + 4);  // the rank's metadata, the tracks' process named once, the points
  CHECK(ev[3].at("ph") == "M");
  CHECK(ev[3].at("pid") == 1002);
  CHECK(ev[3].at("args").at("name") == "rank 2: fsdp::plan");
  const auto& second = ev[5];
  CHECK(second.at("ph") == "C");
  CHECK(second.at("name") == "planned device bytes");
  CHECK(second.at("pid") == 1002);
  CHECK(second.at("ts").get<double>() == 1.0);
  CHECK(second.at("args") == nlohmann::json{{"bytes", 192.0}});
  CHECK(ev[7].at("name") == "planned host bytes");
  CHECK(ev[7].at("pid") == 1002);
}
