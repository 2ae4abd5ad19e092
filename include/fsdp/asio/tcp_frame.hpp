#pragma once
// The bytes TcpComm puts on the wire: a fixed 48-byte header before every payload, and the
// handshake that opens each ring connection.
//
// Every DATA frame repeats the sender's call (sequence number, kind, count, dtype, op,
// root, and the library's CollectiveTag: which unit, phase and pass) and its position in
// the collective (frame index, payload bytes; on a shared-memory link the payload is in the
// shared ring instead of after the header). The receiver
// compares them with its own call before it touches the payload, so ranks that issue
// different collectives fail naming both calls instead of mixing their bytes. An ABORT
// frame carries a failure's message (UTF-8, at most kMaxAbortBytes) to a neighbour.
//
// Integers are little-endian, at fixed offsets (no struct padding on the wire).
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <string_view>

#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

static_assert(std::endian::native == std::endian::little, "fsdp TcpComm frames assume a little-endian host");

template <class T>
void put_le(std::byte* out, T v) { std::memcpy(out, &v, sizeof v); }
template <class T>
T get_le(const std::byte* in) {
  T v;
  std::memcpy(&v, in, sizeof v);
  return v;
}

// CREDIT goes backwards on a shared-memory link: a slot was freed (shm_link.hpp).
enum class FrameType : std::uint8_t { data = 1, abort = 2, credit = 3 };

struct FrameHeader {
  static constexpr std::uint32_t kMagic = 0x46534450;  // "PDSF" in memory: fsdp data frame
  static constexpr std::size_t kSize = 48;
  static constexpr std::size_t kMaxAbortBytes = 64 * 1024;

  FrameType type = FrameType::data;
  CollectiveKind kind = CollectiveKind::barrier;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  std::int32_t root = 0;
  std::uint32_t index = 0;  // frame number within the collective on this link
  std::uint64_t seq = 0;
  std::uint64_t count = 0;
  std::uint64_t bytes = 0;  // payload that follows
  std::uint64_t tag = 0;    // CollectiveCall::tag (0: untagged)

  static FrameHeader data_for(const CollectiveCall& c, std::uint32_t index, std::uint64_t bytes) {
    return {FrameType::data, c.kind, c.dtype, c.op, c.root, index, c.seq, c.count, bytes, c.tag};
  }
  static FrameHeader credit() {
    FrameHeader h;
    h.type = FrameType::credit;
    return h;
  }
  // An ABORT carries the fsdp::ErrorKind its receivers throw in `count` (unused otherwise),
  // as kind + 1: 0 is a sender that states none (one built before kinds), whose abort means
  // that its rank failed, so it reads as peer_lost, not as the receiver's misuse.
  static FrameHeader abort_with(std::size_t reason_bytes, ErrorKind error_kind) {
    FrameHeader h;
    h.type = FrameType::abort;
    h.bytes = reason_bytes;
    h.count = static_cast<std::uint64_t>(error_kind) + 1;
    return h;
  }
  ErrorKind abort_kind() const {
    if (count == 0 || count > static_cast<std::uint64_t>(ErrorKind::out_of_memory) + 1) return ErrorKind::peer_lost;
    return static_cast<ErrorKind>(count - 1);
  }

  // The call this frame says its sender made (pointers left null; `names` names the
  // tag's unit in messages: the receiver's, as every rank's model has the same units).
  CollectiveCall call(const UnitNames* names = nullptr) const {
    CollectiveCall c;
    c.kind = kind;
    c.dtype = dtype;
    c.op = op;
    c.root = root;
    c.count = count;
    c.seq = seq;
    c.tag = tag;
    c.names = names;
    return c;
  }
  bool matches(const CollectiveCall& c) const { return call().same_shape(c) && seq == c.seq; }

  void encode(std::byte* out) const {
    put_le(out, kMagic);
    out[4] = static_cast<std::byte>(type);
    out[5] = static_cast<std::byte>(kind);
    out[6] = static_cast<std::byte>(dtype);
    out[7] = static_cast<std::byte>(op);
    put_le(out + 8, root);
    put_le(out + 12, index);
    put_le(out + 16, seq);
    put_le(out + 24, count);
    put_le(out + 32, bytes);
    put_le(out + 40, tag);
  }

  // The header in `in`, or what is wrong with it.
  static std::optional<FrameHeader> decode(const std::byte* in, std::string& problem) {
    FrameHeader h;
    const auto magic = get_le<std::uint32_t>(in);
    const auto type = static_cast<std::uint8_t>(in[4]);
    const auto kind = static_cast<std::uint8_t>(in[5]);
    const auto dtype = static_cast<std::uint8_t>(in[6]);
    const auto op = static_cast<std::uint8_t>(in[7]);
    if (magic != kMagic) {
      problem = "bad frame magic " + std::to_string(magic);
    } else if (type < static_cast<std::uint8_t>(FrameType::data) || type > static_cast<std::uint8_t>(FrameType::credit)) {
      problem = "unknown frame type " + std::to_string(type);
    } else if (kind > static_cast<std::uint8_t>(CollectiveKind::ring_shift) || !is_dtype_code(dtype) ||
               op > static_cast<std::uint8_t>(ReduceOp::min)) {
      problem = "frame names an unknown collective, dtype or op";
    } else {
      h.type = static_cast<FrameType>(type);
      h.kind = static_cast<CollectiveKind>(kind);
      h.dtype = static_cast<DType>(dtype);
      h.op = static_cast<ReduceOp>(op);
      h.root = get_le<std::int32_t>(in + 8);
      h.index = get_le<std::uint32_t>(in + 12);
      h.seq = get_le<std::uint64_t>(in + 16);
      h.count = get_le<std::uint64_t>(in + 24);
      h.bytes = get_le<std::uint64_t>(in + 32);
      h.tag = get_le<std::uint64_t>(in + 40);
      if (h.type != FrameType::abort || h.bytes <= kMaxAbortBytes) return h;
      problem = "abort frame of " + std::to_string(h.bytes) + " bytes";
    }
    return std::nullopt;
  }
};

// First bytes on a new ring connection, from the rank that connects (the left one) to the
// rank that accepts: who it is, which communicator it means, and the settings both sides
// must share. The acceptor answers with a HelloReply.
struct Hello {
  static constexpr std::uint32_t kMagic = 0x48534446;  // "FDSH"
  static constexpr std::uint32_t kVersion = 3;  // 2: the shared-memory handshake; 3: frames carry the tag
  static constexpr std::size_t kFixedSize = 32;
  static constexpr std::size_t kMaxPrefix = 4096;

  std::int32_t from_rank = 0;
  std::int32_t to_rank = 0;
  std::int32_t size = 0;
  std::uint64_t segment_bytes = 0;
  std::string prefix;

  std::string encode() const {
    std::string out(kFixedSize + prefix.size(), '\0');
    auto* p = reinterpret_cast<std::byte*>(out.data());
    put_le(p, kMagic);
    put_le(p + 4, kVersion);
    put_le(p + 8, from_rank);
    put_le(p + 12, to_rank);
    put_le(p + 16, size);
    put_le(p + 20, static_cast<std::uint32_t>(prefix.size()));
    put_le(p + 24, segment_bytes);
    std::memcpy(out.data() + kFixedSize, prefix.data(), prefix.size());
    return out;
  }
  // Decodes the fixed part; the prefix (prefix_bytes long) follows. Empty on garbage.
  static std::optional<Hello> decode_fixed(const std::byte* in, std::size_t& prefix_bytes) {
    if (get_le<std::uint32_t>(in) != kMagic || get_le<std::uint32_t>(in + 4) != kVersion) return std::nullopt;
    Hello h;
    h.from_rank = get_le<std::int32_t>(in + 8);
    h.to_rank = get_le<std::int32_t>(in + 12);
    h.size = get_le<std::int32_t>(in + 16);
    prefix_bytes = get_le<std::uint32_t>(in + 20);
    h.segment_bytes = get_le<std::uint64_t>(in + 24);
    if (prefix_bytes > kMaxPrefix) return std::nullopt;
    return h;
  }
};

// The acceptor's answer: empty `refusal` accepts the connection.
struct HelloReply {
  static constexpr std::uint32_t kMagic = 0x41534446;  // "FDSA"
  static constexpr std::size_t kFixedSize = 8;
  static constexpr std::size_t kMaxRefusal = 4096;

  static std::string encode(std::string_view refusal) {
    refusal = refusal.substr(0, kMaxRefusal);
    std::string out(kFixedSize + refusal.size(), '\0');
    auto* p = reinterpret_cast<std::byte*>(out.data());
    put_le(p, kMagic);
    put_le(p + 4, static_cast<std::uint32_t>(refusal.size()));
    std::memcpy(out.data() + kFixedSize, refusal.data(), refusal.size());
    return out;
  }
  // The length of the refusal that follows, or empty on garbage.
  static std::optional<std::size_t> decode_fixed(const std::byte* in) {
    if (get_le<std::uint32_t>(in) != kMagic) return std::nullopt;
    const auto n = get_le<std::uint32_t>(in + 4);
    if (n > kMaxRefusal) return std::nullopt;
    return n;
  }
};

}  // namespace fsdp::detail
