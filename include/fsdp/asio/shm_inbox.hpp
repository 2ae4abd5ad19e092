#pragma once
// ShmInbox: TcpRing's receiving end of a shared-memory link from the left (shm_link.hpp).
// When a DATA header arrives on the socket its payload is copied out of the shared ring;
// when the left neighbour's sending half waits for room (the ring was full), a CREDIT
// frame goes back on the same socket. CREDITs are coalesced while one is still being
// written, and stop for good once the ring aborts or closes (the ABORT frame must not be
// mixed into a CREDIT: one write at a time on the socket).
#include <array>
#include <cstddef>
#include <optional>
#include <utility>

#include <boost/asio/buffer.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/write.hpp>

#include "fsdp/asio/shm_link.hpp"
#include "fsdp/asio/tcp_frame.hpp"

namespace fsdp::detail {

class ShmInbox {
  using tcp = boost::asio::ip::tcp;

 public:
  // `left` is the link's socket; the inbox is inactive (payloads on the socket) without `link`.
  ShmInbox(tcp::socket& left, std::optional<ShmLink> link) : left_(left), link_(std::move(link)) {}
  ShmInbox(const ShmInbox&) = delete;
  ShmInbox& operator=(const ShmInbox&) = delete;

  bool active() const { return link_.has_value(); }

  // Copies the next payload (`bytes`) to `dest`, and sends a CREDIT if the sender waits.
  // False if the sender wrote no payload for the header that arrived (out of step).
  bool take(void* dest, std::size_t bytes) {
    bool credit = false;
    if (!link_->consume(dest, bytes, credit)) return false;
    if (credit) send_credit();
    return true;
  }

  // No CREDIT starts from now on (the ring aborts or closes its left link).
  void stop() { stopped_ = true; }
  // A CREDIT is still being written on the socket.
  bool writing() const { return writing_; }

 private:
  void send_credit() {
    if (stopped_) return;
    if (writing_) {
      again_ = true;
      return;
    }
    writing_ = true;
    FrameHeader::credit().encode(bytes_.data());
    boost::asio::async_write(left_, boost::asio::buffer(bytes_), [this](boost::system::error_code ec, std::size_t) {
      writing_ = false;
      if (ec || !again_) return;  // a write error: the reader of this link reports the loss
      again_ = false;
      send_credit();
    });
  }

  tcp::socket& left_;
  std::optional<ShmLink> link_;
  std::array<std::byte, FrameHeader::kSize> bytes_{};
  bool writing_ = false, again_ = false, stopped_ = false;
};

}  // namespace fsdp::detail
