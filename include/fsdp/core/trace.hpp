#pragma once
// fsdp::Trace: one rank's timeline of named, timed spans on two lanes (compute and
// communication), for seeing whether communication overlaps compute. Recording is
// thread-safe: the compute thread and a communication stream's worker record into the same
// Trace. Only the standard library and fsdp::Error are used here; fsdp/core/trace_json.hpp
// writes a Trace as Chrome trace / Perfetto JSON.
//
//   fsdp::Trace trace(comm.rank());
//   { auto s = trace.span("forward", "compute"); model.forward(...); }   // recorded here
//   fsdp::MaybeSpan s(trace_or_null, "backward", "compute");              // free if null
#include <chrono>
#include <cstddef>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/error.hpp"

namespace fsdp {

// One counter track for a trace file (fsdp/core/trace_json.hpp writes it as "ph": "C"
// events): `points` (x in microseconds, value) under `name`, in a process of its own named
// `process` (pid `pid`), so that it does not read as part of a rank's timeline.
struct CounterTrack {
  std::string process;
  int pid = 0;
  std::string name;
  std::vector<std::pair<double, double>> points;
};

class Trace {
 public:
  using Clock = std::chrono::steady_clock;
  // The lane is the Chrome trace "tid": spans on one lane are drawn on one row.
  enum class Lane : int { compute = 0, communication = 1 };
  struct Event {
    std::string name, category;
    Lane lane;
    Clock::time_point begin, end;
  };

  // `rank` is the Chrome trace "pid". Timestamps are exported relative to the origin: the
  // construction time, or one passed in, so that the traces of ranks in one process (the
  // thread backend) share a time axis and can be laid side by side.
  explicit Trace(int rank) : Trace(rank, Clock::now()) {}
  Trace(int rank, Clock::time_point origin) : rank_(rank), origin_(origin) {}
  Trace(const Trace&) = delete;  // spans and communicators hold a pointer to it
  Trace& operator=(const Trace&) = delete;

  int rank() const { return rank_; }
  Clock::time_point origin() const { return origin_; }

  // Records a finished span. Throws fsdp::Error (misuse) if it ends before it begins (a
  // caller's mix-up that would otherwise export a negative duration).
  void add(std::string name, std::string category, Lane lane, Clock::time_point begin, Clock::time_point end) {
    if (end < begin) throw Error("Trace::add: span '" + name + "' ends before it begins");
    std::lock_guard lk(mu_);
    events_.push_back(Event{std::move(name), std::move(category), lane, begin, end});
  }

  // RAII span: begins at construction, recorded at destruction (or at end(), once).
  class Span {
   public:
    Span(Span&& o) noexcept
        : trace_(std::exchange(o.trace_, nullptr)), name_(std::move(o.name_)), category_(std::move(o.category_)),
          lane_(o.lane_), begin_(o.begin_) {}
    Span& operator=(Span&& o) noexcept {
      if (this != &o) {
        end();  // the span this one held is over; it is recorded, not lost
        trace_ = std::exchange(o.trace_, nullptr);
        name_ = std::move(o.name_);
        category_ = std::move(o.category_);
        lane_ = o.lane_;
        begin_ = o.begin_;
      }
      return *this;
    }
    Span(const Span&) = delete;
    Span& operator=(const Span&) = delete;
    ~Span() { end(); }

    // Records the span now instead of at destruction; later calls do nothing.
    void end() noexcept {
      if (!trace_) return;
      Trace* t = std::exchange(trace_, nullptr);
      // A lost event (out of memory) must not terminate the program from a destructor.
      try { t->add(std::move(name_), std::move(category_), lane_, begin_, Clock::now()); } catch (...) {}
    }

   private:
    friend class Trace;
    Span(Trace* t, std::string name, std::string category, Lane lane)
        : trace_(t), name_(std::move(name)), category_(std::move(category)), lane_(lane), begin_(Clock::now()) {}

    Trace* trace_;
    std::string name_, category_;
    Lane lane_;
    Clock::time_point begin_;
  };

  [[nodiscard]] Span span(std::string name, std::string category, Lane lane = Lane::compute) {
    return Span(this, std::move(name), std::move(category), lane);
  }

  // A copy, in recording order (the order spans ended, so an inner span precedes the
  // span it nests in).
  std::vector<Event> events() const {
    std::lock_guard lk(mu_);
    return events_;
  }
  std::size_t size() const {
    std::lock_guard lk(mu_);
    return events_.size();
  }
  void clear() {  // the origin stays: later events keep the same time axis
    std::lock_guard lk(mu_);
    events_.clear();
  }

 private:
  const int rank_;
  const Clock::time_point origin_;
  mutable std::mutex mu_;
  std::vector<Event> events_;
};

// A span for code that is usually not traced: with a null trace it costs one pointer test
// at each end and builds no string. `name` and `category` are not copied until the span is
// recorded, so they must outlive it (string literals, typically).
class MaybeSpan {
 public:
  MaybeSpan(Trace* t, const char* name, const char* category, Trace::Lane lane = Trace::Lane::compute) noexcept
      : trace_(t), name_(name), category_(category), lane_(lane) {
    if (trace_) begin_ = Trace::Clock::now();
  }
  MaybeSpan(const MaybeSpan&) = delete;
  MaybeSpan& operator=(const MaybeSpan&) = delete;
  ~MaybeSpan() {
    if (!trace_) return;
    try { trace_->add(name_, category_, lane_, begin_, Trace::Clock::now()); } catch (...) {}  // as Span::end
  }

 private:
  Trace* trace_;
  const char* name_;
  const char* category_;
  Trace::Lane lane_;
  Trace::Clock::time_point begin_{};
};

}  // namespace fsdp
