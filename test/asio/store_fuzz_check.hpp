#pragma once
// What the store's frame parser must do with any bytes, shared by the libFuzzer target
// (store_protocol_fuzz.cpp) and the corpus replay test: read the input as a stream of
// frames the way the server does; every frame is either refused with an fsdp::Error or
// decodes to a request (and, as a reply, to a reply) whose encoding is exactly the
// frame. Anything else (another exception, a crash, a sanitizer report) is a bug, thrown
// as std::logic_error.
//
// The same stream is also fed to a store_wire::FrameReader (what the server reads with)
// in pieces: one byte at a time (the slowest client), and in pieces of sizes drawn from
// the input (a client whose frames arrive split anywhere). It must give exactly the
// frames the whole-stream parse gives, refuse at the same frame, never take a byte past
// the frame in progress, and never hold more than max(first chunk, 2 x bytes received)
// for a frame still arriving, whatever length its header announced.
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <algorithm>
#include <string>
#include <string_view>
#include <vector>

#include <fsdp/asio/store_protocol.hpp>

namespace store_fuzz {

namespace wire = fsdp::store_wire;

inline void require(bool ok, const char* invariant) {
  if (!ok) throw std::logic_error(std::string("store frame invariant broken: ") + invariant);
}

// What the stream holds, read whole: the payloads of its complete frames, and whether the
// frame after them was refused by its header (rather than cut short).
struct Frames {
  std::vector<std::string> payloads;
  bool refused = false;
};

// Feeds `stream` to a FrameReader in pieces of size piece(i) (i counts the pieces, from
// 0), checking the reader's invariants as it goes.
template <class Piece>
Frames read_in_pieces(std::string_view stream, std::size_t max_payload, Piece piece) {
  constexpr std::size_t first_chunk = 8;  // small, so that short inputs reach the growth
  wire::FrameReader reader(max_payload, first_chunk);
  Frames out;
  std::size_t at = 0, payload_in = 0;
  for (std::size_t i = 0; at < stream.size(); ++i) {
    const std::size_t room = reader.room();
    require(room > 0, "room() > 0 while a frame is incomplete");
    char* into = reader.buffer();
    require(reader.room() == room, "buffer() leaves room() as it said");
    const std::size_t n = std::min({room, piece(i), stream.size() - at});
    std::copy_n(stream.data() + at, n, into);
    at += n;
    const bool header_done = reader.announced() > 0;
    bool complete = false;
    try {
      complete = reader.received(n);
    } catch (const fsdp::Error&) {
      out.refused = true;
      return out;
    }
    if (header_done) payload_in += n;
    require(reader.held() <= std::max(first_chunk, 2 * payload_in), "held() <= max(first chunk, 2 x received)");
    require(reader.held() <= reader.announced(), "held() <= the announced length");
    if (complete) {
      out.payloads.emplace_back(reader.payload());
      reader.next();
      require(!reader.started() && reader.held() == 0, "next() starts afresh");
      payload_in = 0;
    }
  }
  return out;
}

// The first input byte picks the limits (small ones reach the bound checks with short
// inputs) and the verb the frames are read as replies to; the rest is the stream.
inline void check_frames(const std::uint8_t* data, std::size_t size) {
  if (size == 0) return;
  const wire::Limits limits = (data[0] & 1) ? wire::Limits{8, 32} : wire::Limits{};
  const auto reply_to = wire::Verb(1 + (data[0] >> 1) % 9);
  const std::string_view stream(reinterpret_cast<const char*>(data) + 1, size - 1);
  std::string_view in = stream;
  Frames whole;
  while (in.size() >= 4) {
    std::size_t n = 0;
    try {
      n = wire::frame_length(reinterpret_cast<const unsigned char*>(in.data()), limits.max_frame_bytes());
    } catch (const fsdp::Error&) {
      whole.refused = true;
      break;  // the server closes the connection here
    }
    if (n > in.size() - 4) break;  // the rest of the frame never came
    const std::string_view frame = in.substr(0, 4 + n), payload = in.substr(4, n);
    whole.payloads.emplace_back(payload);
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
  // The same stream as the server reads it, piece by piece.
  const auto one_byte = read_in_pieces(stream, limits.max_frame_bytes(), [](std::size_t) { return std::size_t{1}; });
  const auto split = read_in_pieces(stream, limits.max_frame_bytes(), [&](std::size_t i) {
    return std::size_t{1} + static_cast<unsigned char>(stream[(i * 7) % stream.size()]) % 13;
  });
  for (const auto* pieces : {&one_byte, &split}) {
    require(pieces->payloads == whole.payloads, "FrameReader gives the frames the whole-stream parse gives");
    require(pieces->refused == whole.refused, "FrameReader refuses where the whole-stream parse does");
  }
}

}  // namespace store_fuzz
