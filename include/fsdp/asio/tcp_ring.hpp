#pragma once
// TcpRing: one rank's ring links. It carries out a RingPlan (ring.hpp): the receiving half
// (here, on the communicator's I/O thread) reads frame i from the left as soon as its
// destination is free, checks its header, reduces it; the sending half (RingSender, on the
// same thread or its own) writes frame i to the right as soon as what it forwards has
// arrived.
//
// On a shared-memory link from the left a payload is copied out of the shared ring when its
// header arrives (shm_inbox.hpp).
// Both links are read all the time, also between collectives: the left one for the next
// frame header, the right one for an ABORT coming back. So a neighbour's failure is seen
// (and passed on around the ring) even while this rank is idle.
//
// Failures. A header that does not match the local call (the observer first learns every
// rank's call, for the message), a peer that closes its socket (EOF or reset) while
// frames are still due on that link, or no progress for `timeout`: this rank sends ABORT
// with the reason to both neighbours (best effort, at most 1 s), closes both links, and
// the collective fails. A rank that receives ABORT does the same with the same reason, so
// it travels around the ring to every rank. The ABORT frame carries the failure's
// fsdp::ErrorKind (timeout, mismatch, peer_lost, corrupt for a malformed frame; peer_lost
// for a rank that failed of its own, which the others lost), and every rank throws it.
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
#include "fsdp/asio/shm_handshake.hpp"
#include "fsdp/asio/shm_inbox.hpp"
#include "fsdp/asio/tcp_frame.hpp"
#include "fsdp/asio/tcp_rendezvous.hpp"
#include "fsdp/asio/tcp_ring_sender.hpp"

namespace fsdp::detail {

// How the ring tells its owner what went wrong, and asks what to say (TcpComm asks the
// other ranks through the store where they are, see tcp_rank_report.hpp).
struct RingObserver {
  virtual ~RingObserver() = default;
  // No progress for a while (called every ring_poll_interval while stalled).
  virtual void stalled(const CollectiveCall& call, const std::string& state) = 0;
  // No progress for the whole timeout: the failure message.
  virtual std::string timed_out(const CollectiveCall& call, const std::string& state) = 0;
  // The left neighbour's frame says it called `left_call` where this rank called `call`
  // (before any payload is used): the failure message, sent on in ABORT frames.
  virtual std::string mismatched(const CollectiveCall& call, const CollectiveCall& left_call, int left_rank) = 0;
};

// How often a stalled collective tells its observer: timeout/4, within [10 ms, 1 s].
inline std::chrono::steady_clock::duration ring_poll_interval(std::chrono::milliseconds timeout) {
  return std::clamp<std::chrono::steady_clock::duration>(timeout / 4, std::chrono::milliseconds(10), std::chrono::seconds(1));
}

struct RingFailure {
  std::string message;     // this rank's error for the collective that failed
  std::string cause;       // the original reason, sent on in ABORT frames
  bool link_lost = false;  // a neighbour closed: a moment is left for its ABORT to arrive
  ErrorKind kind = ErrorKind::misuse;  // of the error, on this rank and (in ABORT frames) on the others
  // Another rank's failure reached this one (its ABORT, or its link closed): this rank's
  // error is an echo (detail::EchoedError; fsdp::exit_status).
  bool echo = false;
};

class TcpRing {
  using tcp = boost::asio::ip::tcp;
  using error_code = boost::system::error_code;
  using Clock = std::chrono::steady_clock;

 public:
  // `io` is run by the calling thread from now on (the communicator's I/O thread).
  TcpRing(boost::asio::io_context& io, RingSockets links, ShmLinks shm, const RingIdentity& id)
      : io_(io), left_(std::move(links.left)), left_shm_(left_, std::move(shm.from_left)), rank_(id.rank),
        size_(id.size), left_rank_(id.left()), right_rank_(id.right()), timeout_(id.timeout),
        sender_(std::move(links.right), std::move(shm.to_right), id, counters_, io, id.sender_thread) {
    read_left_header();
  }

  // Carries out `plan` for `call` on the thread that runs `io`, running `io` meanwhile.
  // Returns once no buffer of the call is touched any more. On failure the links are
  // closed and stay closed.
  std::optional<RingFailure> run(const CollectiveCall& call, const RingPlan& plan, RingObserver& observer) {
    call_ = &call;
    plan_ = &plan;
    observer_ = &observer;
    recvs_done_ = local_index_ = local_offset_ = 0;
    sent_base_ = counters_.sent.load();
    sender_.begin(call, plan, counters_.received.load());
    const Clock::duration poll_every = ring_poll_interval(timeout_);
    auto last_progress = counters_.progress.load();
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
        if (Clock::now() >= *lost_at + kLostGrace) break;
        failure.reset();
      }
      if (failure || (frames_done() && local_index_ == plan.local.size())) break;
      if (local_index_ < plan.local.size()) {
        // This rank's own part (all_gather's own chunk, the broadcast root's copy) is
        // copied piece by piece between transfers instead of delaying the first frame.
        copy_local_piece();
        io_.poll();
        last_progress_at = Clock::now();
        continue;
      }
      if (!sleep_until_sender_moves()) continue;
      const auto deadline = last_progress_at + timeout_;
      const bool woken = io_.run_one_until(std::min({deadline, next_poll, lost_at ? *lost_at + kLostGrace : deadline})) > 0;
      counters_.receiver_waits.store(false);
      const auto now = Clock::now();
      const bool progressed = counters_.progress.load() != last_progress;
      if (progressed) {
        last_progress = counters_.progress.load();
        last_progress_at = now;
      } else if (now >= deadline) {
        const std::string msg = observer.timed_out(call, state());
        failure = RingFailure{msg, msg, false, ErrorKind::timeout, false};
        break;
      }
      if (now >= next_poll && !(progressed && woken)) {
        // Nothing reached this thread for a whole interval (a sending half on a thread of
        // its own progresses without waking it): stalled, as far as this half can see.
        observer.stalled(call, state());
        next_poll = Clock::now() + poll_every;  // the observer may have waited for the store
      } else if (progressed) {
        next_poll = now + poll_every;
      }
    }
    if (failure) abort_and_close(failure->cause, failure->kind);
    call_ = nullptr;
    plan_ = nullptr;
    observer_ = nullptr;
    return failure;
  }

  // Between collectives: a neighbour's ABORT or a malformed frame that arrived meanwhile,
  // passed on and turned into this ring's end (`kind` set to its kind, `echo` to whether it
  // was an ABORT). Empty if the ring is fine.
  std::optional<std::string> idle_failure(ErrorKind& kind, bool& echo) {
    std::optional<std::string> cause = peer_abort_ ? peer_abort_ : protocol_;
    kind = peer_abort_ ? peer_abort_kind_ : ErrorKind::corrupt;
    echo = peer_abort_.has_value();
    if (!cause && sender_.has_events()) {
      const RightLinkEvents e = sender_.events();
      cause = e.abort ? e.abort : e.protocol;
      kind = e.abort ? e.abort_kind : ErrorKind::corrupt;
      echo = e.abort.has_value();
    }
    if (cause) abort_and_close(*cause, kind);
    return cause;
  }

  // Which links carry their payloads through shared memory.
  bool shm_from_left() const { return left_shm_.active(); }
  bool shm_to_right() const { return sender_.shared(); }

  // Sends ABORT with `cause` and `kind` (what the neighbours throw) to both neighbours (at
  // most 1 s), then closes both links.
  void abort_and_close(const std::string& cause, ErrorKind kind) {
    if (closed_) return;
    sender_.abort(cause, kind);
    const std::string reason = cause.substr(0, FrameHeader::kMaxAbortBytes);
    abort_frame_.assign(FrameHeader::kSize + reason.size(), '\0');
    FrameHeader::abort_with(reason.size(), kind).encode(reinterpret_cast<std::byte*>(abort_frame_.data()));
    std::copy(reason.begin(), reason.end(), abort_frame_.begin() + FrameHeader::kSize);
    bool sent = false, started = false;
    left_shm_.stop();
    auto write_abort = [&] {  // one write at a time on the socket: not while a CREDIT is
      if (started || left_shm_.writing()) return;
      started = true;
      boost::asio::async_write(left_, boost::asio::buffer(abort_frame_), [&sent](error_code, std::size_t) { sent = true; });
    };
    write_abort();
    // The sending half ends by its own 1 s deadline; this one is a backstop.
    const auto deadline = Clock::now() + std::min<Clock::duration>(timeout_, std::chrono::seconds(1));
    const auto backstop = Clock::now() + std::chrono::seconds(10);
    while (!sender_.events().shut && io_.run_one_until(backstop)) {
    }
    while (left_shm_.writing() && io_.run_one_until(deadline)) {
    }
    write_abort();
    if (!started) sent = true;  // best effort: no ABORT rather than one mixed into a CREDIT
    while (!sent && io_.run_one_until(deadline)) {
    }
    close_left();  // cancels the ABORT write if it is still pending: `sent` is set before returning
  }

  // Closes both links (neighbours that still expect frames see the connection close).
  void close() {
    sender_.close();
    close_left();
  }

 private:
  enum class Left { reading_header, header_ready, reading_payload, closed };
  using HeaderBytes = std::array<std::byte, FrameHeader::kSize>;

  static constexpr std::chrono::milliseconds kLostGrace{100};

  std::string who(int r) const { return "rank " + std::to_string(r); }
  std::string where() const { return who(rank_) + ": "; }

  std::size_t sends_done() const { return counters_.sent.load() - sent_base_; }
  bool frames_done() const { return recvs_done_ == plan_->recvs.size() && sends_done() == plan_->sends.size(); }

  // Before sleeping when only the sending half can unblock this one (a destination still
  // being sent from, or nothing left but sends): ask it for a wake-up. False if it moved
  // meanwhile (no sleep needed).
  bool sleep_until_sender_moves() {
    const auto& recvs = plan_->recvs;
    const std::size_t sent = sends_done();
    const bool blocked = recvs_done_ == recvs.size() ? sent < plan_->sends.size()
                                                     : left_state_ == Left::header_ready &&
                                                           recvs[recvs_done_].after_send >= std::int64_t(sent);
    if (!blocked) return true;
    counters_.receiver_waits.store(true);
    if (sends_done() == sent) return true;
    counters_.receiver_waits.store(false);
    return false;
  }

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

  // Starts every receive that may start now.
  void pump() {
    const auto& recvs = plan_->recvs;
    while (!local_failure_ && left_state_ == Left::header_ready && recvs_done_ < recvs.size() &&
           recvs[recvs_done_].after_send < std::int64_t(sends_done())) {
      if (!accept_header(recvs[recvs_done_])) return;
      if (!read_payload(recvs[recvs_done_])) return;
    }
  }

  // Compares the waiting header with the frame this rank expects next.
  bool accept_header(const RecvFrame& f) {
    const FrameHeader& h = left_header_;
    if (!h.matches(*call_)) {
      local_failure_ = observer_->mismatched(*call_, h.call(call_->names), left_rank_);  // blocks briefly, bounded
      local_failure_kind_ = ErrorKind::mismatch;
    } else if (h.index != recvs_done_ || h.bytes != f.bytes) {
      std::ostringstream os;
      os << where() << "frame " << h.index << " (" << h.bytes << " bytes) from rank " << left_rank_ << " in "
         << call_->describe() << " is not the expected frame " << recvs_done_ << " (" << f.bytes << " bytes)";
      local_failure_ = os.str();
      local_failure_kind_ = ErrorKind::mismatch;
    }
    return !local_failure_;
  }

  // True if the frame completed at once (no payload).
  bool read_payload(const RecvFrame& f) {
    if (f.bytes == 0) {
      complete_recv();
      return true;
    }
    if (left_shm_.active()) {
      ++counters_.progress;
      if (!left_shm_.take(f.dest, f.bytes)) {
        local_failure_ = where() + "rank " + std::to_string(left_rank_) + " sent the header of frame " +
                         std::to_string(recvs_done_) + " of " + call_->describe() + " without its shared-memory payload";
        local_failure_kind_ = ErrorKind::corrupt;
        return false;
      }
      complete_recv();
      return true;
    }
    left_state_ = Left::reading_payload;
    auto done = [this](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      ++counters_.progress;
      if (ec) return left_lost(ec);
      complete_recv();
    };
    boost::asio::async_read(left_, boost::asio::buffer(f.dest, f.bytes), TransferWhole{}, done);
    return false;
  }

  void complete_recv() {
    finish_recv(plan_->recvs[recvs_done_], call_->dtype, call_->op, size_);
    ++recvs_done_;
    counters_.received.fetch_add(1);
    if (counters_.sender_waits.exchange(false)) sender_.wake();
    read_left_header();
  }

  // Reads the left link all the time: the next frame's header waits for its collective.
  void read_left_header() {
    left_state_ = Left::reading_header;
    boost::asio::async_read(left_, boost::asio::buffer(left_bytes_), [this](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      ++counters_.progress;
      if (ec) return left_lost(ec);
      std::string problem;
      const auto h = FrameHeader::decode(left_bytes_.data(), problem);
      if (!h) {
        protocol_ = where() + "malformed frame from " + who(left_rank_) + ": " + problem + " (out of step?)";
        left_state_ = Left::closed;
      } else if (h->type == FrameType::abort) {
        read_abort(h->bytes, h->abort_kind());
      } else if (h->type == FrameType::credit) {
        protocol_ = where() + who(left_rank_) + " sent a credit frame forwards (out of step?)";
        left_state_ = Left::closed;
      } else {
        left_header_ = *h;
        left_state_ = Left::header_ready;
      }
    });
  }
  void read_abort(std::size_t bytes, ErrorKind kind) {
    left_abort_.resize(bytes);
    boost::asio::async_read(left_, boost::asio::buffer(left_abort_), [this, kind](error_code ec, std::size_t) {
      if (ec == boost::asio::error::operation_aborted) return;
      ++counters_.progress;
      if (peer_abort_) return;
      peer_abort_ = ec ? std::string("a neighbour aborted (its reason was cut off)") : left_abort_;
      peer_abort_kind_ = kind;
    });
  }

  void left_lost(error_code ec) {
    left_state_ = Left::closed;
    left_error_ = ec;
  }
  void close_left() {
    if (closed_) return;
    closed_ = true;
    left_shm_.stop();
    error_code ignored;
    left_.shutdown(tcp::socket::shutdown_both, ignored);
    left_.close(ignored);
    io_.poll();  // the cancelled operations' handlers run now, touching no buffer again
  }

  // ---- what went wrong, if anything, for the current call ----
  std::optional<RingFailure> check() const {
    if (local_failure_) return RingFailure{*local_failure_, *local_failure_, false, local_failure_kind_, false};
    std::optional<std::string> abort = peer_abort_, protocol = protocol_;
    ErrorKind abort_kind = peer_abort_kind_;
    RightLinkEvents right;
    if (sender_.has_events()) {
      right = sender_.events();
      if (!abort) {
        abort = right.abort;
        abort_kind = right.abort_kind;
      }
      if (!protocol) protocol = right.protocol;
    }
    if (abort) return RingFailure{where() + call_->describe() + " aborted: " + *abort, *abort, false, abort_kind, true};
    if (protocol) return RingFailure{*protocol + " during " + call_->describe(), *protocol, false, ErrorKind::corrupt, false};
    if (left_state_ == Left::closed && recvs_done_ < plan_->recvs.size()) return lost(left_rank_, left_error_);
    if ((right.closed || right.shut) && sends_done() < plan_->sends.size()) return lost(right_rank_, right.error);
    return std::nullopt;
  }
  RingFailure lost(int peer, error_code ec) const {
    const bool closed = ec == boost::asio::error::eof || ec == boost::asio::error::connection_reset ||
                        ec == boost::asio::error::broken_pipe || !ec;
    const std::string what = closed ? " closed the connection" : " is unreachable (" + ec.message() + ")";
    std::string msg = where() + "peer " + who(peer) + what + " during " + call_->describe() + " (did its process exit?)";
    return {msg, msg, true, ErrorKind::peer_lost, true};
  }

  std::string state() const {
    std::ostringstream os;
    os << "sent " << sends_done() << " of " << plan_->sends.size() << " frames to rank " << right_rank_
       << ", received " << recvs_done_ << " of " << plan_->recvs.size() << " from rank " << left_rank_;
    return os.str();
  }

  boost::asio::io_context& io_;
  tcp::socket left_;
  ShmInbox left_shm_;  // the payloads' way from the left, if shared memory
  const int rank_, size_, left_rank_, right_rank_;
  const std::chrono::milliseconds timeout_;
  RingCounters counters_;
  RingSender sender_;  // after counters_: it uses them until it is gone

  const CollectiveCall* call_ = nullptr;
  const RingPlan* plan_ = nullptr;
  RingObserver* observer_ = nullptr;
  std::uint64_t sent_base_ = 0;  // counters_.sent when the current collective began
  std::size_t recvs_done_ = 0;
  std::size_t local_index_ = 0, local_offset_ = 0;  // LocalCopy in progress

  Left left_state_ = Left::closed;
  FrameHeader left_header_;
  HeaderBytes left_bytes_{};
  error_code left_error_;
  std::optional<std::string> local_failure_, peer_abort_, protocol_;
  ErrorKind local_failure_kind_ = ErrorKind::misuse, peer_abort_kind_ = ErrorKind::misuse;
  std::string left_abort_, abort_frame_;
  bool closed_ = false;
};

}  // namespace fsdp::detail
