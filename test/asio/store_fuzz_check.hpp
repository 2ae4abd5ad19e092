#pragma once
// What the store's frame parser must do with any bytes, shared by the libFuzzer target
// (store_protocol_fuzz.cpp) and the corpus replay test: read the input as a stream of
// frames the way the server does; every frame is either refused with an fsdp::Error or
// decodes to a request (and, as a reply, to a reply) whose encoding is exactly the
// frame. Anything else (another exception, a crash, a sanitizer report) is a bug, thrown
// as std::logic_error.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include <fsdp/asio/store_protocol.hpp>

namespace store_fuzz {

namespace wire = fsdp::store_wire;

inline void require(bool ok, const char* invariant) {
  if (!ok) throw std::logic_error(std::string("store frame invariant broken: ") + invariant);
}

// The first input byte picks the limits (small ones reach the bound checks with short
// inputs) and the verb the frames are read as replies to; the rest is the stream.
inline void check_frames(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return;
  const wire::Limits limits = (data[0] & 1) ? wire::Limits{8, 32} : wire::Limits{};
  const auto reply_to = wire::Verb(1 + (data[0] >> 1) % 9);
  std::string_view in(reinterpret_cast<const char*>(data) + 1, size - 1);
  while (in.size() >= 4) {
    std::size_t n = 0;
    try {
      n = wire::frame_length(reinterpret_cast<const unsigned char*>(in.data()), limits.max_frame_bytes());
    } catch (const fsdp::Error&) {
      return;  // the server closes the connection here
    }
    if (n > in.size() - 4) return;  // the rest of the frame never came
    const std::string_view frame = in.substr(0, 4 + n), payload = in.substr(4, n);
    in.remove_prefix(4 + n);
    try {
      const wire::Request r = wire::decode_request(payload, limits);
      require(wire::encode(r) == frame, "encode(decode_request(frame)) == frame");
      require(wire::decode_request(payload, limits) == r, "decode_request is deterministic");
    } catch (const fsdp::Error&) {
    }
    try {
      const wire::Reply r = wire::decode_reply(reply_to, payload, limits);
      require(wire::encode(reply_to, r) == frame, "encode(decode_reply(frame)) == frame");
    } catch (const fsdp::Error&) {
    }
  }
}

}  // namespace store_fuzz
