#pragma once
// TcpRing: one rank's two ring links, driven by its communicator's I/O thread. It carries
// out a RingPlan (ring.hpp) with one frame in flight each way: frame i goes to the right
// as soon as what it forwards has arrived, frame i from the left is read as soon as its
// destination is free, and each arrival is reduced before the next one is read (the
// socket buffers keep the peers streaming meanwhile).
//
// Both links are read all the time, also between collectives: the left one for the next
// frame header, the right one for an ABORT coming back. So a neighbour's failure is seen
// (and passed on around the ring) even while this rank is idle.
//
// Failures. A header that does not match the local call, a peer that closes its socket
// (EOF or reset) while frames are still due on that link, or no progress for `timeout`:
// this rank sends ABORT with the reason to both neighbours (best effort, at most 1 s),
// closes both links, and the collective fails. A rank that receives ABORT does the same
// with the same reason, so it travels around the ring to every rank.
#include <algorithm>
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <sstream>
#include <string>

#include <boost/asio/buffer.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include "fsdp/asio/ring.hpp"
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

// How the ring tells its owner that a collective is stalled, and asks what to say when it
// gives up (TcpComm asks the other ranks through the store where they are).
struct StallObserver {
  virtual ~StallObserver() = default;
  // No progress for a while (called about every timeout/4, at most every second).
  virtual void stalled(const CollectiveCall& call, const std::string& state) = 0;
  // No progress for the whole timeout: the failure message.
  virtual std::string timed_out(const CollectiveCall& call, const std::string& state) = 0;
};

struct RingFailure {
  std::string message;  // this rank's error for the collective that failed
  std::string cause;    // the original reason, sent on in ABORT frames
  bool link_lost = false;  // a neighbour closed: a moment is left for its ABORT to arrive
};

class TcpRing {
  using tcp = boost::asio::ip::tcp;
  using error_code = boost::system::error_code;
  using Clock = std::chrono::steady_clock;

 public:
  TcpRing(boost::asio::io_context& io, RingSockets links, const RingIdentity& id)
      : io_(io), left_(std::move(links.left)), right_(std::move(links.right)), rank_(id.rank), size_(id.size),
        left_rank_(id.left()), right_rank_(id.right()), timeout_(id.timeout) {}

  // Starts reading both links; call on the thread that runs `io`.
  void start() {
    read_left_header();
    watch_right();
  }

  // Carries out `plan` for `call` on the thread that runs `io`, running `io` meanwhile.
  // On failure the links are closed and stay closed.
  std::optional<RingFailure> run(const CollectiveCall& call, const RingPlan& plan, StallObserver& observer) {
    call_ = &call;
    plan_ = &plan;
    next_send_ = sends_done_ = recvs_done_ = 0;
    local_index_ = local_offset_ = 0;
    const Clock::duration poll_every = std::clamp<Clock::duration>(timeout_ / 4, kPollMin, std::chrono::seconds(1));
    auto last_progress = progress_;
    auto last_progress_at = Clock::now();
    auto next_poll = last_progress_at + poll_every;
    std::optional<Clock::time_point> lost_at;
    std::optional<RingFailure> failure;
    for (;;) {
      pump();
      failure = check();
      if (failure && failure->link_lost) {
        // The neighbours that abort close their links right after sending ABORT, so the
        // closed link may be seen before the reason arrives on the other one.
        if (!lost_at) lost_at = Clock::now();
        if (Clock::now() < *lost_at + kLostGrace) failure.reset();
        else break;
      }
      const bool frames_done = sends_done_ == plan.sends.size() && recvs_done_ == plan.recvs.size();
      if (failure || (frames_done && local_index_ == plan.local.size())) break;
      if (local_index_ < plan.local.size()) {
        // This rank's own part (all_gather's own chunk, the broadcast root's copy) is
        // copied piece by piece between transfers instead of delaying the first frame.
        copy_local_piece();
        io_.poll();
        last_progress_at = Clock::now();
        continue;
      }
      const auto deadline = last_progress_at + timeout_;
      io_.run_one_until(std::min({deadline, next_poll, lost_at ? *lost_at + kLostGrace : deadline}));
      const auto now = Clock::now();
      if (progress_ != last_progress) {
        last_progress = progress_;
        last_progress_at = now;
        next_poll = now + poll_every;
      } else if (now >= deadline) {
        const std::string msg = observer.timed_out(call, state());
        failure = RingFailure{msg, msg};
        break;
      } else if (now >= next_poll) {
        observer.stalled(call, state());
        next_poll = now + poll_every;
      }
    }
    if (failure) abort_and_close(failure->cause);
    call_ = nullptr;
    plan_ = nullptr;
    return failure;
  }

  // Between collectives: a neighbour's ABORT or a malformed frame that arrived meanwhile,
  // passed on and turned into this ring's end. Empty if the ring is fine.
  std::optional<std::string> idle_failure() {
    std::optional<std::string> cause = peer_abort_ ? peer_abort_ : protocol_;
    if (cause) abort_and_close(*cause);
    return cause;
  }

  bool closed() const { return closed_; }

  // Sends ABORT with `cause` to both neighbours (at most 1 s), then closes both links.
  void abort_and_close(const std::string& cause) {
    if (closed_) return;
    const auto deadline = Clock::now() + std::min<Clock::duration>(timeout_, std::chrono::seconds(1));
    // A data frame in flight is finished first, so the right neighbour's stream stays in frame.
    while (writing_ && io_.run_one_until(deadline)) {
    }
    const std::string reason = cause.substr(0, FrameHeader::kMaxAbortBytes);
    abort_frame_.assign(FrameHeader::kSize + reason.size(), '\0');
    FrameHeader::abort_with(reason.size()).encode(reinterpret_cast<std::byte*>(abort_frame_.data()));
    std::copy(reason.begin(), reason.end(), abort_frame_.begin() + FrameHeader::kSize);
    if (!writing_ && !right_closed_ && !right_write_failed_) send_abort(right_);
    send_abort(left_);
    while (aborts_in_flight_ > 0 && io_.run_one_until(deadline)) {
    }
    close();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    error_code ignored;
    left_.shutdown(tcp::socket::shutdown_both, ignored);
    right_.shutdown(tcp::socket::shutdown_both, ignored);
    left_.close(ignored);
    right_.close(ignored);
    io_.poll();  // the cancelled operations' handlers run now, touching no buffer again
  }

 private:
  enum class Left { reading_header, header_ready, reading_payload, closed };
  using HeaderBytes = std::array<std::byte, FrameHeader::kSize>;

  static constexpr std::chrono::milliseconds kLostGrace{100};
  static constexpr std::chrono::milliseconds kPollMin{10};

  std::string who(int r) const { return "rank " + std::to_string(r); }
  std::string where() const { return who(rank_) + ": "; }

  void copy_local_piece() {
    constexpr std::size_t kPiece = 256 * 1024;
    const LocalCopy& l = plan_->local[local_index_];
    const std::size_t n = std::min(kPiece, l.bytes - local_offset_);
    if (n) run_local({l.from + local_offset_, l.to + local_offset_, n, l.finish_avg}, call_->dtype, size_);
    local_offset_ += n;
    if (local_offset_ == l.bytes) {
      ++local_index_;
      local_offset_ = 0;
    }
  }

  // Starts every frame that may start now.
  void pump() {
    for (bool moved = true; moved && !local_failure_;) {
      moved = false;
      const auto& sends = plan_->sends;
      const bool can_write = !writing_ && !right_closed_ && !right_write_failed_;
      if (can_write && next_send_ < sends.size() && sends[next_send_].after_recv < std::int64_t(recvs_done_)) {
        write_frame(next_send_++);
        moved = true;
      }
      const auto& recvs = plan_->recvs;
      if (left_state_ == Left::header_ready && recvs_done_ < recvs.size() &&
          recvs[recvs_done_].after_send < std::int64_t(sends_done_)) {
        if (!accept_header(recvs[recvs_done_])) return;
        moved = read_payload(recvs[recvs_done_]);
      }
    }
  }

  // Compares the waiting header with the frame this rank expects next.
  bool accept_header(const RecvFrame& f) {
    const FrameHeader& h = left_header_;
    if (!h.matches(*call_)) {
      local_failure_ = "collective mismatch: rank " + std::to_string(rank_) + " called " + call_->describe() + " but rank " +
                       std::to_string(left_rank_) + " called " + h.call().describe();
    } else if (h.index != recvs_done_ || h.bytes != f.bytes) {
      std::ostringstream os;
      os << where() << "frame " << h.index << " (" << h.bytes << " bytes) from rank " << left_rank_ << " in "
         << call_->describe() << " is not the expected frame " << recvs_done_ << " (" << f.bytes << " bytes)";
      local_failure_ = os.str();
    }
    return !local_failure_;
  }

  // True if the frame completed at once (no payload).
  bool read_payload(const RecvFrame& f) {
    if (f.bytes == 0) {
      complete_recv();
      return true;
    }
    left_state_ = Left::reading_payload;
    auto done = [this](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      ++progress_;
      if (ec) return left_lost(ec);
      complete_recv();
    };
    boost::asio::async_read(left_, boost::asio::buffer(f.dest, f.bytes), TransferWhole{}, done);
    return false;
  }

  void complete_recv() {
    finish_recv(plan_->recvs[recvs_done_], call_->dtype, call_->op, size_);
    ++recvs_done_;
    read_left_header();
  }

  void write_frame(std::size_t i) {
    const SendFrame& f = plan_->sends[i];
    FrameHeader::data_for(*call_, static_cast<std::uint32_t>(i), f.bytes).encode(out_header_.data());
    writing_ = true;
    const std::array<boost::asio::const_buffer, 2> frame{boost::asio::const_buffer(out_header_.data(), out_header_.size()),
                                                         boost::asio::const_buffer(f.data, f.bytes)};
    boost::asio::async_write(right_, frame, TransferWhole{}, [this](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      writing_ = false;
      ++progress_;
      // The peer's ABORT may still be waiting on this socket: the watcher reads it (or
      // the end of the stream) and decides what failed.
      if (ec) right_write_failed_ = true;
      else ++sends_done_;
    });
  }

  // ---- the readers that run all the time ----
  void read_left_header() {
    left_state_ = Left::reading_header;
    boost::asio::async_read(left_, boost::asio::buffer(left_bytes_), [this](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      ++progress_;
      if (ec) return left_lost(ec);
      if (auto h = decode(left_bytes_, left_rank_, "")) {
        if (h->type == FrameType::abort) return read_abort(left_, *h, left_abort_);
        left_header_ = *h;
        left_state_ = Left::header_ready;
      } else {
        left_state_ = Left::closed;
      }
    });
  }
  void watch_right() {
    boost::asio::async_read(right_, boost::asio::buffer(right_bytes_), [this](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      if (ec) return right_lost(ec);
      if (auto h = decode(right_bytes_, right_rank_, " on the link it only receives on")) {
        if (h->type == FrameType::abort) return read_abort(right_, *h, right_abort_);
        protocol_ = where() + who(right_rank_) + " sent a data frame backwards (not an fsdp TcpComm ring peer?)";
      }
    });
  }
  std::optional<FrameHeader> decode(const HeaderBytes& bytes, int from, const char* context) {
    std::string problem;
    auto h = FrameHeader::decode(bytes.data(), problem);
    if (!h) protocol_ = where() + "malformed frame from " + who(from) + context + ": " + problem + " (out of step?)";
    return h;
  }
  void read_abort(tcp::socket& s, const FrameHeader& h, std::string& text) {
    text.resize(h.bytes);
    boost::asio::async_read(s, boost::asio::buffer(text), [this, &text](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      ++progress_;
      if (!peer_abort_) peer_abort_ = ec ? std::string("a neighbour aborted (its reason was cut off)") : text;
    });
  }
  void send_abort(tcp::socket& s) {
    ++aborts_in_flight_;
    boost::asio::async_write(s, boost::asio::buffer(abort_frame_),
                             [this](error_code, std::size_t) { --aborts_in_flight_; });
  }

  void left_lost(error_code ec) {
    left_state_ = Left::closed;
    left_error_ = ec;
  }
  void right_lost(error_code ec) {
    right_closed_ = true;
    right_error_ = ec;
  }

  // ---- what went wrong, if anything, for the current call ----
  std::optional<RingFailure> check() const {
    if (local_failure_) return RingFailure{*local_failure_, *local_failure_};
    if (peer_abort_) return RingFailure{where() + call_->describe() + " aborted: " + *peer_abort_, *peer_abort_};
    if (protocol_) return RingFailure{*protocol_ + " during " + call_->describe(), *protocol_};
    if (left_state_ == Left::closed && recvs_done_ < plan_->recvs.size()) return lost(left_rank_, left_error_);
    if (right_closed_ && !writing_ && sends_done_ < plan_->sends.size()) return lost(right_rank_, right_error_);
    return std::nullopt;
  }
  RingFailure lost(int peer, error_code ec) const {
    const bool closed = ec == boost::asio::error::eof || ec == boost::asio::error::connection_reset ||
                        ec == boost::asio::error::broken_pipe || !ec;
    const std::string what = closed ? " closed the connection" : " is unreachable (" + ec.message() + ")";
    std::string msg = where() + "peer " + who(peer) + what + " during " + call_->describe() + " (did its process exit?)";
    return {msg, msg, true};
  }

  std::string state() const {
    std::ostringstream os;
    os << "sent " << sends_done_ << " of " << plan_->sends.size() << " frames to rank " << right_rank_ << ", received "
       << recvs_done_ << " of " << plan_->recvs.size() << " from rank " << left_rank_;
    return os.str();
  }

  boost::asio::io_context& io_;
  tcp::socket left_, right_;
  const int rank_, size_, left_rank_, right_rank_;
  const std::chrono::milliseconds timeout_;

  const CollectiveCall* call_ = nullptr;
  const RingPlan* plan_ = nullptr;
  std::size_t next_send_ = 0, sends_done_ = 0, recvs_done_ = 0;
  std::size_t local_index_ = 0, local_offset_ = 0;  // LocalCopy in progress
  std::uint64_t progress_ = 0;  // completed transfers, for the timeout
  bool writing_ = false;
  std::array<std::byte, FrameHeader::kSize> out_header_{};

  Left left_state_ = Left::closed;
  FrameHeader left_header_;
  HeaderBytes left_bytes_{}, right_bytes_{};
  error_code left_error_, right_error_;
  bool right_closed_ = false, right_write_failed_ = false;

  std::optional<std::string> local_failure_, peer_abort_, protocol_;
  std::string left_abort_, right_abort_, abort_frame_;
  int aborts_in_flight_ = 0;
  bool closed_ = false;
};

}  // namespace fsdp::detail
