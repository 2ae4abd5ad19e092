#pragma once
// Choosing shared memory for a ring link, right after RingJoiner connected it. On each
// link the sending side (the left rank) offers a segment it created: its name, a random
// nonce and its host key (shm_link.hpp); the receiving side opens it only if the host
// keys match and shared memory is on here too, and accepts only if the segment holds
// that nonce, which proves both processes map the same memory. Anything else (another
// host, another /dev/shm, shared memory off on either side, no room for the segment)
// keeps that link on TCP; every link decides for itself, so rings may mix both.
#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdio>
#include <cstdint>
#include <optional>
#include <random>
#include <string>

#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>

#include "fsdp/asio/shm_link.hpp"
#include "fsdp/asio/tcp_frame.hpp"
#include "fsdp/asio/tcp_rendezvous.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

struct ShmLinks {
  std::optional<ShmLink> from_left;  // consumer side of the link rank-1 -> rank
  std::optional<ShmLink> to_right;   // producer side of the link rank -> rank+1
};

class ShmHandshake {
  using error_code = boost::system::error_code;
  using Clock = std::chrono::steady_clock;
  static constexpr std::uint32_t kOfferMagic = 0x4f4d4853;   // "SHMO"
  static constexpr std::uint32_t kAnswerMagic = 0x414d4853;  // "SHMA"
  static constexpr std::size_t kOfferFixed = 32, kMaxText = 1024;

 public:
  // Runs on `io` (which nothing else runs meanwhile) until both links decided, at most
  // id.timeout; a neighbour that closes or garbles the handshake fails construction.
  static ShmLinks negotiate(boost::asio::io_context& io, RingSockets& links, const RingIdentity& id) {
    ShmHandshake h(io, links, id);
    return h.run();
  }

 private:
  ShmHandshake(boost::asio::io_context& io, RingSockets& links, const RingIdentity& id)
      : io_(io), links_(links), id_(id), host_(shm_host_key()),
        slots_(ShmLink::slots_for(id.shared_memory_bytes, id.segment_bytes)) {}

  ShmLinks run() {
    make_offer();
    boost::asio::async_write(links_.right, boost::asio::buffer(offer_out_), [this](error_code ec, std::size_t) {
      if (ec) return broke(id_.right(), ec);
      boost::asio::async_read(links_.right, boost::asio::buffer(answer_in_), [this](error_code ec, std::size_t) {
        if (ec) return broke(id_.right(), ec);
        if (get_le<std::uint32_t>(answer_in_.data()) != kAnswerMagic) return garbled(id_.right());
        if (get_le<std::uint32_t>(answer_in_.data() + 4) != 1) out_.to_right.reset();
        right_done_ = true;
      });
    });
    boost::asio::async_read(links_.left, boost::asio::buffer(offer_in_), [this](error_code ec, std::size_t) {
      if (ec) return broke(id_.left(), ec);
      const auto name_bytes = get_le<std::uint16_t>(offer_in_.data() + 28);
      const auto host_bytes = get_le<std::uint16_t>(offer_in_.data() + 30);
      if (get_le<std::uint32_t>(offer_in_.data()) != kOfferMagic || name_bytes > kMaxText || host_bytes > kMaxText)
        return garbled(id_.left());
      text_in_.resize(std::size_t{name_bytes} + host_bytes);
      boost::asio::async_read(links_.left, boost::asio::buffer(text_in_), [this, name_bytes](error_code ec, std::size_t) {
        if (ec) return broke(id_.left(), ec);
        accept_or_refuse(text_in_.substr(0, name_bytes), text_in_.substr(name_bytes));
      });
    });
    const auto deadline = Clock::now() + id_.timeout;
    while (!(left_done_ && right_done_) && !failure_ && io_.run_one_until(deadline)) {
    }
    if (!offered_name_.empty()) ShmLink::unlink(offered_name_);  // accepted, refused or no answer
    if (!(left_done_ && right_done_)) {
      error_code ignored;
      links_.left.cancel(ignored);
      links_.right.cancel(ignored);
      while (io_.poll()) {  // the cancelled handlers finish here: none outlives this call
      }
      fail_as(failure_ ? failure_kind_ : ErrorKind::timeout,
              failure_ ? *failure_
                       : id_.where() + "the shared-memory handshake with its ring neighbours in communicator " +
                             id_.prefix + " did not finish within " + std::to_string(id_.timeout.count()) + " ms");
    }
    return std::move(out_);
  }

  // Offer: magic, nonce (u64), slot bytes (u64), slots (u64), name length, host length
  // (u16 each); name, host.
  // An empty name offers nothing (shared memory off, or no segment could be made).
  void make_offer() {
    std::random_device random;
    nonce_ = (std::uint64_t{random()} << 32) ^ random() ^ static_cast<std::uint64_t>(getpid()) << 20;
    if (id_.shared_memory) {
      char name[96];
      std::snprintf(name, sizeof name, "fsdp.%d.%016llx.%d-%d", static_cast<int>(getpid()),
                    static_cast<unsigned long long>(nonce_), id_.rank, id_.right());
      std::string why;
      out_.to_right = ShmLink::create(name, nonce_, slots_, id_.segment_bytes, why);
      if (out_.to_right) offered_name_ = name;
    }
    const std::string host = offered_name_.empty() ? std::string() : host_;
    offer_out_.assign(kOfferFixed + offered_name_.size() + host.size(), '\0');
    auto* p = reinterpret_cast<std::byte*>(offer_out_.data());
    put_le(p, kOfferMagic);
    put_le(p + 4, nonce_);
    put_le(p + 12, static_cast<std::uint64_t>(id_.segment_bytes));
    put_le(p + 20, static_cast<std::uint64_t>(slots_));
    put_le(p + 28, static_cast<std::uint16_t>(offered_name_.size()));
    put_le(p + 30, static_cast<std::uint16_t>(host.size()));
    offered_name_.copy(offer_out_.data() + kOfferFixed, offered_name_.size());
    host.copy(offer_out_.data() + kOfferFixed + offered_name_.size(), host.size());
  }

  void accept_or_refuse(const std::string& name, const std::string& host) {
    const auto nonce = get_le<std::uint64_t>(offer_in_.data() + 4);
    const auto slot_bytes = get_le<std::uint64_t>(offer_in_.data() + 12);
    const auto slots = get_le<std::uint64_t>(offer_in_.data() + 20);
    if (id_.shared_memory && !name.empty() && host == host_ && slot_bytes == id_.segment_bytes) {
      std::string why;
      out_.from_left = ShmLink::open(name, nonce, slots, slot_bytes, why);
    }
    put_le(answer_out_.data(), kAnswerMagic);
    put_le(answer_out_.data() + 4, std::uint32_t{out_.from_left ? 1u : 0u});
    boost::asio::async_write(links_.left, boost::asio::buffer(answer_out_), [this](error_code ec, std::size_t) {
      if (ec) return broke(id_.left(), ec);
      left_done_ = true;
    });
  }

  void broke(int peer, error_code ec) {
    if (ec == boost::asio::error::operation_aborted || failure_) return;
    failure_ = id_.where() + "rank " + std::to_string(peer) + " left during the shared-memory handshake of communicator " +
               id_.prefix + " (" + ec.message() + ")";
    failure_kind_ = ErrorKind::peer_lost;
  }
  void garbled(int peer) {
    if (failure_) return;
    failure_ = id_.where() + "rank " + std::to_string(peer) + " sent a malformed shared-memory handshake in communicator " +
               id_.prefix + " (not an fsdp TcpComm of this version?)";
    failure_kind_ = ErrorKind::corrupt;
  }

  boost::asio::io_context& io_;
  RingSockets& links_;
  const RingIdentity& id_;
  const std::string host_;
  const std::size_t slots_;  // of the ring this rank offers (the receiver takes the sender's)
  std::uint64_t nonce_ = 0;
  std::string offered_name_, offer_out_, text_in_;
  std::array<std::byte, kOfferFixed> offer_in_{};
  std::array<std::byte, 8> answer_in_{}, answer_out_{};
  ShmLinks out_;
  bool left_done_ = false, right_done_ = false;
  std::optional<std::string> failure_;
  ErrorKind failure_kind_ = ErrorKind::misuse;  // of failure_
};

}  // namespace fsdp::detail
