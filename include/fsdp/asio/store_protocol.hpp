#pragma once
// The rendezvous store's wire format, shared by TcpStoreServer and TcpStore. Pure byte
// handling with no sockets, so a fuzzer can drive it directly.
//
// A frame is a little-endian u32 payload length followed by the payload. A request
// payload is a u8 verb and that verb's fields; a reply payload is a u8 status and the
// fields that the request's verb and the status call for. A string is a u32 length and
// its bytes; integers are little-endian. Decoding checks each length against the limits
// before it allocates and rejects unknown verbs or statuses, flags other than 0 and 1 and
// trailing bytes, so a valid frame has exactly one encoding (the fuzzer checks that
// encode(decode(frame)) == frame). A malformed frame is an fsdp::Error, never UB.
#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/error.hpp"

namespace fsdp::store_wire {

// Opens every connection's first frame, so a stray client of another protocol is told
// apart from a store client with a bad token.
inline constexpr std::uint32_t magic = 0x53445346;  // "FSDS" on the wire
// 2: the hello carries the client's job and generation (Request::job, ::generation).
inline constexpr std::uint8_t version = 2;
inline constexpr std::size_t max_token_bytes = 1024;
inline constexpr std::size_t max_job_bytes = 256;
inline constexpr std::uint32_t max_timeout_ms = 24u * 60 * 60 * 1000;

enum class Verb : std::uint8_t { hello = 1, set, get, try_get, wait, add, compare_set, delete_key, num_keys };
enum class Status : std::uint8_t { ok = 0, timeout = 1, error = 2 };

inline const char* name_of(Verb v) {
  switch (v) {
    case Verb::hello: return "hello";
    case Verb::set: return "set";
    case Verb::get: return "get";
    case Verb::try_get: return "try_get";
    case Verb::wait: return "wait";
    case Verb::add: return "add";
    case Verb::compare_set: return "compare_set";
    case Verb::delete_key: return "delete_key";
    case Verb::num_keys: return "num_keys";
  }
  return "?";
}

// Sizes a server accepts. The largest request is a compare_set (a key and two values);
// a reply is never larger than the request it answers, plus its status.
struct Limits {
  std::size_t max_key_bytes = 4096;
  std::size_t max_value_bytes = std::size_t{64} << 20;

  std::size_t max_frame_bytes() const { return 1 + (4 + max_key_bytes) + 2 * (4 + max_value_bytes); }
  // Before the handshake a client may send only a hello, so a stranger can make the
  // server allocate no more than this.
  static constexpr std::size_t max_hello_bytes() { return 1 + 4 + 1 + 8 + 4 + max_job_bytes + 4 + max_token_bytes; }

  // Frames carry u32 lengths, and a value past 1 GiB is not rendezvous data.
  void check() const {
    if (max_key_bytes < 1 || max_key_bytes > (std::size_t{1} << 20))
      detail::fail("store: max key size must be in [1, 1 MiB], got ", max_key_bytes, " bytes");
    if (max_value_bytes < 1 || max_value_bytes > (std::size_t{1} << 30))
      detail::fail("store: max value size must be in [1, 1 GiB], got ", max_value_bytes, " bytes");
  }
};

// Fields a verb does not use stay at their defaults (and must, for a frame to have one
// encoding).
struct Request {
  Verb verb = Verb::num_keys;
  std::vector<std::string> keys;  // one for keyed verbs; any number for wait
  std::string value;              // set: the value; compare_set: the desired value
  std::string expected;           // compare_set
  std::int64_t delta = 0;         // add
  std::uint32_t timeout_ms = 0;   // get, wait: in (0, 24 h]
  std::string token;              // hello
  // hello: the start of the job the client belongs to (TORCHELASTIC_RESTART_COUNT), and
  // the job (TORCHELASTIC_RUN_ID; empty when unset) (TcpStoreServer, "Generations").
  std::uint64_t generation = 0;
  std::string job;
  bool operator==(const Request&) const = default;
};

struct Reply {
  Status status = Status::ok;
  std::string value;               // get, compare_set; status error: the message
  std::int64_t number = 0;         // add, num_keys
  bool flag = false;               // try_get: found; delete_key: existed
  std::vector<std::string> keys;   // status timeout: the keys still missing
  Limits limits;                   // hello: the server's limits
  bool operator==(const Reply& o) const {
    return status == o.status && value == o.value && number == o.number && flag == o.flag && keys == o.keys &&
           limits.max_key_bytes == o.limits.max_key_bytes && limits.max_value_bytes == o.limits.max_value_bytes;
  }
};

namespace detail {

class Writer {
 public:
  Writer() { out_.resize(4); }  // room for the length
  void u8(std::uint8_t v) { out_.push_back(static_cast<char>(v)); }
  void u32(std::uint32_t v) { little_endian(v, 4); }
  void u64(std::uint64_t v) { little_endian(v, 8); }
  void i64(std::int64_t v) { u64(static_cast<std::uint64_t>(v)); }
  void str(std::string_view s) {
    u32(static_cast<std::uint32_t>(s.size()));
    out_.append(s);
  }
  void strs(const std::vector<std::string>& v) {
    u32(static_cast<std::uint32_t>(v.size()));
    for (const auto& s : v) str(s);
  }
  std::string frame() && {
    const auto n = static_cast<std::uint32_t>(out_.size() - 4);
    for (int i = 0; i < 4; ++i) out_[i] = static_cast<char>((n >> (8 * i)) & 0xff);
    return std::move(out_);
  }

 private:
  void little_endian(std::uint64_t v, int bytes) {
    for (int i = 0; i < bytes; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

class Reader {
 public:
  explicit Reader(std::string_view payload) : in_(payload) {}
  std::uint8_t u8() { return static_cast<std::uint8_t>(little_endian(1, "a byte")); }
  std::uint32_t u32() { return static_cast<std::uint32_t>(little_endian(4, "a length")); }
  std::uint64_t u64() { return little_endian(8, "an integer"); }
  std::int64_t i64() { return static_cast<std::int64_t>(u64()); }
  bool flag() {
    const auto b = u8();
    if (b > 1) fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: flag byte is ", int(b), ", not 0 or 1");
    return b == 1;
  }
  std::string str(std::size_t max, const char* what) {
    const std::uint32_t n = u32();
    if (n > max)
      fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: ", what, " of ", n, " bytes exceeds the limit of ", max,
                            " bytes");
    need(n, what);
    std::string s(in_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  // A count is checked against the bytes left (each string takes at least 4) before the
  // vector grows, so a forged count cannot make us allocate.
  std::vector<std::string> strs(std::size_t max_each, const char* what) {
    const std::uint32_t n = u32();
    if (n > (in_.size() - pos_) / 4)
      fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: ", n, " ", what, "s cannot fit in the frame");
    std::vector<std::string> v;
    v.reserve(n);
    for (std::uint32_t i = 0; i < n; ++i) v.push_back(str(max_each, what));
    return v;
  }
  void finish() const {
    if (pos_ != in_.size())
      fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: ", in_.size() - pos_, " unexpected bytes at the end");
  }

 private:
  void need(std::size_t n, const char* what) const {
    if (in_.size() - pos_ < n) fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: truncated in ", what);
  }
  std::uint64_t little_endian(int bytes, const char* what) {
    need(static_cast<std::size_t>(bytes), what);
    std::uint64_t v = 0;
    for (int i = 0; i < bytes; ++i) v |= std::uint64_t(static_cast<unsigned char>(in_[pos_ + i])) << (8 * i);
    pos_ += static_cast<std::size_t>(bytes);
    return v;
  }
  std::string_view in_;
  std::size_t pos_ = 0;
};

inline bool keyed(Verb v) { return v != Verb::hello && v != Verb::wait && v != Verb::num_keys; }
inline bool waits(Verb v) { return v == Verb::get || v == Verb::wait; }

}  // namespace detail

// The payload length from a frame's 4-byte header, checked against `max_payload` before
// anyone allocates for it.
inline std::size_t frame_length(const unsigned char* header, std::size_t max_payload) {
  const std::size_t n = std::size_t(header[0]) | std::size_t(header[1]) << 8 | std::size_t(header[2]) << 16 |
                        std::size_t(header[3]) << 24;
  if (n == 0) fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: empty payload");
  if (n > max_payload)
    fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: payload of ", n, " bytes exceeds the limit of ",
                          max_payload, " bytes");
  return n;
}

// Assembles one frame at a time from a byte stream that arrives in pieces of any size,
// for the server: a stranger that announces a large frame and sends nothing more must
// not make it allocate. The announced length is checked against the limit as soon as
// the 4 header bytes are in, and the payload buffer then grows only as the bytes arrive:
// it starts at `first_chunk` bytes and at most doubles what has arrived, so it never
// holds more than max(first_chunk, 2 * bytes received) (held()). buffer() never reaches
// past the current frame, so a reader never takes bytes of the next one.
class FrameReader {
 public:
  explicit FrameReader(std::size_t max_payload, std::size_t first_chunk = std::size_t{64} << 10)
      : max_payload_(max_payload), first_chunk_(first_chunk < 1 ? 1 : first_chunk) {}

  // The limit for frames whose header has not arrived yet (a hello's, then any verb's).
  void set_limit(std::size_t max_payload) { max_payload_ = max_payload; }

  // Where the next bytes go, and how many the current frame can still take (never 0
  // before complete()).
  char* buffer() {
    if (header_got_ < 4) return reinterpret_cast<char*>(header_) + header_got_;
    if (got_ == payload_.size() && got_ < length_)
      payload_.resize(std::min(length_, std::max(first_chunk_, 2 * got_)));
    return payload_.data() + got_;
  }
  std::size_t room() const {
    if (header_got_ < 4) return 4 - header_got_;
    return (got_ == payload_.size() ? std::min(length_, std::max(first_chunk_, 2 * got_)) : payload_.size()) - got_;
  }

  // `n` bytes (at most room()) were written to buffer(). Returns true once the frame is
  // complete; throws an fsdp::Error (corrupt) for an empty or oversized announced length.
  bool received(std::size_t n) {
    if (header_got_ < 4) {
      header_got_ += n;
      if (header_got_ == 4) length_ = frame_length(header_, max_payload_);
    } else {
      got_ += n;
    }
    return complete();
  }

  bool started() const { return header_got_ > 0; }  // some bytes of a frame are in
  bool complete() const { return header_got_ == 4 && got_ == length_; }
  std::size_t announced() const { return length_; }  // 0 until the header is in
  std::size_t held() const { return payload_.size(); }
  std::string_view payload() const { return {payload_.data(), got_}; }

  // Ready for the next frame; a buffer grown past 1 MiB is given back.
  void next() {
    header_got_ = got_ = length_ = 0;
    if (payload_.capacity() > (std::size_t{1} << 20)) payload_ = std::string();
    payload_.clear();
  }

 private:
  std::size_t max_payload_, first_chunk_;
  unsigned char header_[4] = {};
  std::size_t header_got_ = 0, got_ = 0, length_ = 0;
  std::string payload_;
};

// The whole frame, header included.
inline std::string encode(const Request& r) {
  detail::Writer w;
  w.u8(static_cast<std::uint8_t>(r.verb));
  if (r.verb == Verb::hello) {
    w.u32(magic);
    w.u8(version);
    w.u64(r.generation);
    w.str(r.job);
    w.str(r.token);
  } else if (r.verb == Verb::wait) {
    w.strs(r.keys);
  } else if (detail::keyed(r.verb)) {
    w.str(r.keys.empty() ? std::string_view() : std::string_view(r.keys.front()));
  }
  if (r.verb == Verb::set) w.str(r.value);
  if (r.verb == Verb::compare_set) {
    w.str(r.expected);
    w.str(r.value);
  }
  if (r.verb == Verb::add) w.i64(r.delta);
  if (detail::waits(r.verb)) w.u32(r.timeout_ms);
  return std::move(w).frame();
}

// `payload` is a frame without its header.
inline Request decode_request(std::string_view payload, const Limits& limits) {
  detail::Reader in(payload);
  Request r;
  const std::uint8_t verb = in.u8();
  if (verb < std::uint8_t(Verb::hello) || verb > std::uint8_t(Verb::num_keys))
    fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: unknown verb ", int(verb));
  r.verb = Verb(verb);
  if (r.verb == Verb::hello) {
    if (in.u32() != magic)
      fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: not an fsdp store client (bad magic)");
    const std::uint8_t v = in.u8();
    if (v != version)
      fsdp::detail::fail_as(ErrorKind::mismatch, "store frame: protocol version ", int(v), ", this store speaks ",
                            int(version));
    r.generation = in.u64();
    r.job = in.str(max_job_bytes, "job id");
    r.token = in.str(max_token_bytes, "token");
  } else if (r.verb == Verb::wait) {
    r.keys = in.strs(limits.max_key_bytes, "key");
  } else if (detail::keyed(r.verb)) {
    r.keys.push_back(in.str(limits.max_key_bytes, "key"));
  }
  if (r.verb == Verb::set) r.value = in.str(limits.max_value_bytes, "value");
  if (r.verb == Verb::compare_set) {
    r.expected = in.str(limits.max_value_bytes, "expected value");
    r.value = in.str(limits.max_value_bytes, "desired value");
  }
  if (r.verb == Verb::add) r.delta = in.i64();
  if (detail::waits(r.verb)) {
    r.timeout_ms = in.u32();
    if (r.timeout_ms == 0 || r.timeout_ms > max_timeout_ms)
      fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: ", name_of(r.verb), " timeout of ", r.timeout_ms,
                            " ms is outside (0 ms, 24 h]");
  }
  in.finish();
  return r;
}

// A reply to a request of verb `to`.
inline std::string encode(Verb to, const Reply& r) {
  detail::Writer w;
  w.u8(static_cast<std::uint8_t>(r.status));
  if (r.status == Status::error) {
    w.str(r.value);
  } else if (r.status == Status::timeout) {
    w.strs(r.keys);
  } else if (to == Verb::hello) {
    w.u32(static_cast<std::uint32_t>(r.limits.max_key_bytes));
    w.u64(r.limits.max_value_bytes);
  } else if (to == Verb::get || to == Verb::compare_set) {
    w.str(r.value);
  } else if (to == Verb::try_get) {
    w.u8(r.flag);
    if (r.flag) w.str(r.value);
  } else if (to == Verb::delete_key) {
    w.u8(r.flag);
  } else if (to == Verb::add || to == Verb::num_keys) {
    w.i64(r.number);
  }
  return std::move(w).frame();
}

// Replies are bounded by the limits the client learned in the handshake (by the
// defaults, for the hello reply itself).
inline Reply decode_reply(Verb to, std::string_view payload, const Limits& limits) {
  detail::Reader in(payload);
  Reply r;
  const std::uint8_t status = in.u8();
  if (status > std::uint8_t(Status::error))
    fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: unknown reply status ", int(status));
  r.status = Status(status);
  if (r.status == Status::error) {
    r.value = in.str(limits.max_frame_bytes(), "error message");
  } else if (r.status == Status::timeout) {
    if (!detail::waits(to)) fsdp::detail::fail_as(ErrorKind::corrupt, "store frame: a timeout reply to ", name_of(to));
    r.keys = in.strs(limits.max_key_bytes, "key");
  } else if (to == Verb::hello) {
    r.limits.max_key_bytes = in.u32();
    r.limits.max_value_bytes = static_cast<std::size_t>(in.u64());
    r.limits.check();
  } else if (to == Verb::get || to == Verb::compare_set) {
    r.value = in.str(limits.max_value_bytes, "value");
  } else if (to == Verb::try_get) {
    r.flag = in.flag();
    if (r.flag) r.value = in.str(limits.max_value_bytes, "value");
  } else if (to == Verb::delete_key) {
    r.flag = in.flag();
  } else if (to == Verb::add || to == Verb::num_keys) {
    r.number = in.i64();
  }
  in.finish();
  return r;
}

}  // namespace fsdp::store_wire
