#pragma once
// RingSender: the sending half of one rank's ring. TcpRing (the receiving half, on the
// communicator's I/O thread) hands it each collective's plan; it writes frame i to the
// right neighbour as soon as the receive that frame forwards has arrived, and meanwhile
// watches the same socket for an ABORT coming back.
//
// It runs on the I/O thread too, or on a thread of its own (own_thread). Its own thread
// lets the kernel copies of sending and receiving run on two cores at once (one thread
// doing both is bounded by one core) and a write waiting for the right neighbour never
// delays a read; it costs a cross-thread wake-up per ring step where the sender waits
// for a frame to forward, which is what small collectives pay for, and it only pays
// where cores are to spare.
//
// The halves share monotonic frame counters (RingCounters). A half wakes the other only
// after the other said it waits (it raises its flag, then reads the counter again; with
// sequentially consistent atomics one of the two always sees the other), so a stream of
// frames costs no cross-thread wake-ups.
//
// With a shared-memory link to the right (shm_link.hpp) a frame's payload is copied into
// the shared ring and only its header is written to the socket; when the ring is full the
// next frame waits for a CREDIT frame coming back on the socket.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/write.hpp>

#include "fsdp/asio/ring.hpp"
#include "fsdp/asio/shm_link.hpp"
#include "fsdp/asio/tcp_frame.hpp"
#include "fsdp/asio/tcp_rendezvous.hpp"

namespace fsdp::detail {

// Asio's default completion condition moves at most 64 KiB per system call; a frame
// goes in as few calls as the socket buffers allow.
struct TransferWhole {
  std::size_t operator()(const boost::system::error_code& ec, std::size_t) const {
    return ec ? 0 : std::size_t{1} << 30;
  }
};

struct RingCounters {
  std::atomic<std::uint64_t> sent{0};       // frames written to the right, over all collectives
  std::atomic<std::uint64_t> received{0};   // frames from the left, processed
  std::atomic<std::uint64_t> progress{0};   // completed transfers either way, for the timeout
  std::atomic<bool> receiver_waits{false};  // the receiving half sleeps until `sent` grows
  std::atomic<bool> sender_waits{false};    // the sending half sleeps until `received` grows
};

// What happened on the link to the right, for the receiving half.
struct RightLinkEvents {
  bool closed = false;  // its reader saw the end of the stream or an error
  boost::system::error_code error;
  bool write_failed = false;
  std::optional<std::string> abort;     // the right neighbour's ABORT reason
  ErrorKind abort_kind = ErrorKind::misuse;  // and the kind it carries
  std::optional<std::string> protocol;       // a malformed frame (ErrorKind::corrupt)
  bool shut = false;                    // closed by abort() or close(): no buffer is touched any more
};

class RingSender {
  using tcp = boost::asio::ip::tcp;
  using error_code = boost::system::error_code;

 public:
  // `right` belongs to `receiver_io`, which the receiving half's thread runs.
  RingSender(tcp::socket right, std::optional<ShmLink> shm, const RingIdentity& id, RingCounters& counters,
             boost::asio::io_context& receiver_io, bool own_thread)
      : shm_(std::move(shm)), rank_(id.rank), right_rank_(id.right()), timeout_(id.timeout), counters_(counters), receiver_io_(receiver_io),
        own_io_(own_thread ? std::make_unique<boost::asio::io_context>(1) : nullptr),
        io_(own_io_ ? *own_io_ : receiver_io), right_(io_), deadline_(io_) {
    if (own_io_) {
      error_code ec;
      const auto local = right.local_endpoint(ec);
      right_.assign(ec ? tcp::v4() : local.protocol(), right.release());  // to this thread's context
      keep_running_.emplace(own_io_->get_executor());
      boost::asio::post(io_, [this] { watch(); });
      thread_ = std::thread([this] { io_.run(); });
    } else {
      right_ = std::move(right);
      watch();
    }
  }
  RingSender(const RingSender&) = delete;
  RingSender& operator=(const RingSender&) = delete;
  // With a thread of its own: stops it. Without: the receiving half's thread is no longer
  // running `receiver_io` (its owner joined it).
  ~RingSender() {
    on_my_thread([this] {
      shut_down();
      keep_running_.reset();
    });
    if (thread_.joinable()) thread_.join();
  }

  // ---- called from the receiving half's thread ----
  // The plan's sends, once every receive frame i forwards has arrived (received_base +
  // after_recv < counters.received). `call` and `plan` stay valid until the last send
  // completed or shut is reported.
  void begin(const CollectiveCall& call, const RingPlan& plan, std::uint64_t received_base) {
    on_my_thread([this, c = &call, p = &plan, received_base] {
      if (p->sends.empty() || shut_) return;
      call_ = c;
      plan_ = p;
      received_base_ = received_base;
      next_ = 0;
      pump();
    });
  }
  void wake() {
    on_my_thread([this] { pump(); });
  }
  // Finishes a frame in flight, sends ABORT with `cause` (and the kind its receivers throw)
  // and closes, within 1 s.
  void abort(const std::string& cause, ErrorKind kind) {
    on_my_thread([this, cause, kind] { start_abort(cause, kind); });
  }
  void close() {
    on_my_thread([this] { shut_down(); });
  }

  bool shared() const { return shm_.has_value(); }  // payloads go through shared memory
  bool has_events() const { return has_events_.load(); }
  RightLinkEvents events() const {
    std::lock_guard lk(events_mu_);
    return events_;
  }

 private:
  std::uint64_t received() const { return counters_.received.load() - received_base_; }

  // Runs `f` now when this half shares the caller's thread, else queues it on its own.
  template <class F>
  void on_my_thread(F&& f) {
    if (own_io_) boost::asio::post(io_, std::forward<F>(f));
    else f();
  }

  // Starts the next send if it may start now.
  void pump() {
    while (plan_ && !writing_ && !aborting_ && !shut_ && next_ < plan_->sends.size()) {
      const std::int64_t needs = plan_->sends[next_].after_recv;
      if (needs >= 0 && static_cast<std::uint64_t>(needs) >= received()) {
        counters_.sender_waits.store(true);
        if (static_cast<std::uint64_t>(needs) >= received()) return;  // the receiving half wakes us
        counters_.sender_waits.store(false);
        continue;
      }
      if (shm_ && plan_->sends[next_].bytes && !shm_->has_room_or_ask()) return;  // a CREDIT wakes us
      write(next_++);
    }
  }

  void write(std::size_t i) {
    const SendFrame& f = plan_->sends[i];
    FrameHeader::data_for(*call_, static_cast<std::uint32_t>(i), f.bytes).encode(header_.data());
    writing_ = true;
    const bool shared = shm_ && f.bytes;
    if (shared) shm_->produce(f.data, f.bytes);
    const std::array<boost::asio::const_buffer, 2> frame{boost::asio::const_buffer(header_.data(), header_.size()),
                                                         boost::asio::const_buffer(f.data, shared ? 0 : f.bytes)};
    boost::asio::async_write(right_, frame, TransferWhole{}, [this](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      writing_ = false;
      ++counters_.progress;
      if (ec) {
        // The reader decides what failed: the peer's ABORT may still be waiting on this socket.
        record([](RightLinkEvents& e) { e.write_failed = true; });
        if (aborting_) shut_down();
        return;
      }
      if (plan_ && next_ == plan_->sends.size()) {  // the last one: let go of the plan before saying so
        plan_ = nullptr;
        call_ = nullptr;
      }
      counters_.sent.fetch_add(1);
      if (counters_.receiver_waits.exchange(false)) boost::asio::post(receiver_io_, [] {});
      if (aborting_) send_abort_frame();
      else pump();
    });
  }

  // Reads the right link all the time: only an ABORT (or, on a shared-memory link, a
  // CREDIT) may come back on it.
  void watch() {
    boost::asio::async_read(right_, boost::asio::buffer(header_in_), [this](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted || shut_) return;
      ++counters_.progress;
      if (ec) return record([ec](RightLinkEvents& e) {
        e.closed = true;
        e.error = ec;
      });
      std::string problem;
      const auto h = FrameHeader::decode(header_in_.data(), problem);
      if (h && h->type == FrameType::credit && shm_) {
        pump();
        return watch();
      }
      if (h && h->type == FrameType::abort) {
        abort_in_.resize(h->bytes);
        boost::asio::async_read(right_, boost::asio::buffer(abort_in_),
                                [this, kind = h->abort_kind()](error_code ec, std::size_t) {
                                  if (ec == boost::asio::error::operation_aborted) return;
                                  record([&](RightLinkEvents& e) {
                                    e.abort = ec ? "a neighbour aborted (its reason was cut off)" : abort_in_;
                                    e.abort_kind = kind;
                                  });
                                });
        return;
      }
      const std::string who = "rank " + std::to_string(rank_) + ": rank " + std::to_string(right_rank_);
      record([&](RightLinkEvents& e) {
        e.protocol = h ? who + " sent a data or credit frame backwards (not an fsdp TcpComm ring peer?)"
                       : who + " sent a malformed frame: " + problem + " (out of step?)";
      });
    });
  }

  void start_abort(const std::string& cause, ErrorKind kind) {
    if (shut_ || aborting_) return;
    aborting_ = true;
    plan_ = nullptr;  // no new frame starts
    const std::string reason = cause.substr(0, FrameHeader::kMaxAbortBytes);
    abort_out_.assign(FrameHeader::kSize + reason.size(), '\0');
    FrameHeader::abort_with(reason.size(), kind).encode(reinterpret_cast<std::byte*>(abort_out_.data()));
    std::copy(reason.begin(), reason.end(), abort_out_.begin() + FrameHeader::kSize);
    deadline_.expires_after(std::min<std::chrono::milliseconds>(timeout_, std::chrono::seconds(1)));
    deadline_.async_wait([this](error_code ec) {
      if (!ec) shut_down();  // best effort ends here
    });
    // A data frame in flight finishes first, so the right neighbour's stream stays in frame.
    if (!writing_) send_abort_frame();
  }
  void send_abort_frame() {
    const RightLinkEvents e = events();
    if (e.closed || e.write_failed) return shut_down();
    boost::asio::async_write(right_, boost::asio::buffer(abort_out_), [this](error_code, std::size_t) { shut_down(); });
  }

  void shut_down() {
    if (shut_) return;
    shut_ = true;
    plan_ = nullptr;
    call_ = nullptr;
    deadline_.cancel();
    error_code ignored;
    right_.shutdown(tcp::socket::shutdown_both, ignored);
    right_.close(ignored);
    record([](RightLinkEvents& e) { e.shut = true; });
  }

  template <class Change>
  void record(Change&& change) {
    {
      std::lock_guard lk(events_mu_);
      change(events_);
    }
    has_events_.store(true);
    boost::asio::post(receiver_io_, [] {});  // events are rare: always wake the receiving half
  }

  std::optional<ShmLink> shm_;  // the payloads' way to the right, if shared memory
  const int rank_, right_rank_;
  const std::chrono::milliseconds timeout_;
  RingCounters& counters_;
  boost::asio::io_context& receiver_io_;

  std::unique_ptr<boost::asio::io_context> own_io_;  // with a thread of its own
  boost::asio::io_context& io_;                      // *own_io_ or receiver_io_
  std::optional<boost::asio::executor_work_guard<boost::asio::io_context::executor_type>> keep_running_;
  tcp::socket right_;
  boost::asio::steady_timer deadline_;
  std::thread thread_;

  // This thread only:
  const CollectiveCall* call_ = nullptr;
  const RingPlan* plan_ = nullptr;
  std::uint64_t received_base_ = 0;
  std::size_t next_ = 0;
  bool writing_ = false, aborting_ = false, shut_ = false;
  std::array<std::byte, FrameHeader::kSize> header_{}, header_in_{};
  std::string abort_in_, abort_out_;

  mutable std::mutex events_mu_;
  RightLinkEvents events_;
  std::atomic<bool> has_events_{false};
};

}  // namespace fsdp::detail
