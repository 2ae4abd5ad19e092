// The store's wire format: every request and reply survives encode -> decode, and every
// kind of malformed frame is an fsdp::Error naming what is wrong.
#include <doctest/doctest.h>

#include <algorithm>
#include <string>
#include <vector>

#include <fsdp/asio/store_protocol.hpp>

#include "store_test_support.hpp"

namespace asio_store_protocol_test {

using store_test::contains;
using store_test::error_of;

namespace {

namespace wire = fsdp::store_wire;
using wire::Verb;

std::string payload_of(const std::string& frame) {
  const auto n = wire::frame_length(reinterpret_cast<const unsigned char*>(frame.data()), frame.size());
  REQUIRE(n == frame.size() - 4);
  return frame.substr(4);
}

// One request of every verb, with every field the verb carries set to something.
std::vector<wire::Request> every_request() {
  auto make = [](Verb v) {
    wire::Request r;
    r.verb = v;
    if (v == Verb::wait) r.keys = {"a", "", std::string(300, 'k')};
    else if (v != Verb::hello && v != Verb::num_keys) r.keys = {"rank/3"};
    if (v == Verb::set || v == Verb::compare_set) r.value = std::string("v\0w", 3);
    if (v == Verb::compare_set) r.expected = "old";
    if (v == Verb::add) r.delta = -(std::int64_t{1} << 40);
    if (v == Verb::get || v == Verb::wait) r.timeout_ms = 1500;
    if (v == Verb::hello) r.token = "secret";
    return r;
  };
  std::vector<wire::Request> out;
  for (int v = int(Verb::hello); v <= int(Verb::num_keys); ++v) out.push_back(make(Verb(v)));
  return out;
}

}  // namespace

TEST_CASE("every request round-trips, and its frame is canonical") {
  const wire::Limits limits;
  for (const auto& r : every_request()) {
    CAPTURE(std::string(wire::name_of(r.verb)));
    const std::string frame = wire::encode(r);
    const auto back = wire::decode_request(payload_of(frame), limits);
    CHECK(back == r);
    CHECK(wire::encode(back) == frame);
  }
}

TEST_CASE("every reply round-trips for the verb it answers") {
  const wire::Limits limits;
  for (const auto& req : every_request()) {
    const Verb v = req.verb;
    CAPTURE(std::string(wire::name_of(v)));
    std::vector<wire::Reply> replies(3);
    replies[0].value = (v == Verb::get || v == Verb::compare_set || v == Verb::try_get) ? "value" : "";
    replies[0].number = (v == Verb::add || v == Verb::num_keys) ? -42 : 0;
    replies[0].flag = (v == Verb::try_get || v == Verb::delete_key);
    if (v == Verb::hello) replies[0].limits = {100, 2000};
    replies[1].flag = false;  // try_get: not found; delete_key: did not exist
    replies[2].status = wire::Status::error;
    replies[2].value = "add to key 'x': its value 'y' is not a 64-bit integer";
    if (v == Verb::get || v == Verb::wait) {
      replies.emplace_back().status = wire::Status::timeout;
      replies.back().keys = {"missing/1", "missing/2"};
    }
    for (const auto& reply : replies) {
      if (v == Verb::hello && reply.status == wire::Status::ok && reply.limits.max_key_bytes != 100) continue;
      const std::string frame = wire::encode(v, reply);
      const auto back = wire::decode_reply(v, payload_of(frame), limits);
      CHECK(back == reply);
      CHECK(wire::encode(v, back) == frame);
    }
  }
}

TEST_CASE("frame length: empty and oversized payloads are refused before any allocation") {
  const unsigned char empty[4] = {0, 0, 0, 0};
  CHECK(contains(error_of([&] { wire::frame_length(empty, 100); }), "store frame: empty payload"));
  const unsigned char huge[4] = {0xff, 0xff, 0xff, 0xff};
  CHECK(contains(error_of([&] { wire::frame_length(huge, 100); }), "payload of 4294967295 bytes exceeds the limit of 100 bytes"));
  const unsigned char exact[4] = {100, 0, 0, 0};
  CHECK(wire::frame_length(exact, 100) == 100);
}

TEST_CASE("every truncation of every request is refused") {
  const wire::Limits limits;
  for (const auto& r : every_request()) {
    const std::string payload = payload_of(wire::encode(r));
    for (std::size_t n = 0; n < payload.size(); ++n) {
      CAPTURE(std::string(wire::name_of(r.verb)));
      CAPTURE(n);
      const auto e = error_of([&] { wire::decode_request(payload.substr(0, n), limits); });
      // A cut wait frame may first be too short for the key count it announces.
      CHECK((contains(e, "store frame: truncated in") || contains(e, "keys cannot fit in the frame")));
    }
    CHECK(contains(error_of([&] { wire::decode_request(payload + "x", limits); }), "1 unexpected bytes at the end"));
    try {  // a frame that fails its format is corrupt, not the caller's misuse
      wire::decode_request(payload + "x", limits);
      FAIL("expected fsdp::Error");
    } catch (const fsdp::Error& e) {
      CHECK(e.kind() == fsdp::ErrorKind::corrupt);
    }
  }
}

TEST_CASE("malformed requests name what is wrong") {
  const wire::Limits limits{8, 16};
  auto request_error = [&](const std::string& payload) { return error_of([&] { wire::decode_request(payload, limits); }); };
  CHECK(contains(request_error(std::string(1, '\0')), "unknown verb 0"));
  CHECK(contains(request_error(std::string(1, char(10))), "unknown verb 10"));
  CHECK(contains(request_error("GET / HTTP/1.1"), "unknown verb 71"));

  wire::Request hello;
  hello.verb = Verb::hello;
  std::string p = payload_of(wire::encode(hello));
  p[1] ^= 1;
  CHECK(contains(request_error(p), "not an fsdp store client (bad magic)"));
  p = payload_of(wire::encode(hello));
  p[5] = 7;
  CHECK(contains(request_error(p), "protocol version 7, this store speaks 2"));
  try {  // a client of another version is a mismatch between builds, not damaged data
    wire::decode_request(p, limits);
    FAIL("expected fsdp::Error");
  } catch (const fsdp::Error& e) {
    CHECK(e.kind() == fsdp::ErrorKind::mismatch);
  }
  hello.token = std::string(wire::max_token_bytes + 1, 't');
  CHECK(contains(request_error(payload_of(wire::encode(hello))), "token of 1025 bytes exceeds the limit of 1024 bytes"));

  wire::Request set;
  set.verb = Verb::set;
  set.keys = {"123456789"};
  CHECK(contains(request_error(payload_of(wire::encode(set))), "key of 9 bytes exceeds the limit of 8 bytes"));
  set.keys = {"k"};
  set.value = std::string(17, 'v');
  CHECK(contains(request_error(payload_of(wire::encode(set))), "value of 17 bytes exceeds the limit of 16 bytes"));

  wire::Request cas;
  cas.verb = Verb::compare_set;
  cas.keys = {"k"};
  cas.expected = std::string(17, 'e');
  CHECK(contains(request_error(payload_of(wire::encode(cas))), "expected value of 17 bytes"));

  // A forged key count: refused from the bytes left, not by trying to reserve 4 G strings.
  std::string forged{char(Verb::wait), '\xff', '\xff', '\xff', '\xff'};
  CHECK(contains(request_error(forged), "4294967295 keys cannot fit in the frame"));

  wire::Request get;
  get.verb = Verb::get;
  get.keys = {"k"};
  get.timeout_ms = 0;
  CHECK(contains(request_error(payload_of(wire::encode(get))), "get timeout of 0 ms is outside (0 ms, 24 h]"));
  get.timeout_ms = wire::max_timeout_ms + 1;
  CHECK(contains(request_error(payload_of(wire::encode(get))), "is outside (0 ms, 24 h]"));
  get.timeout_ms = wire::max_timeout_ms;
  CHECK(wire::decode_request(payload_of(wire::encode(get)), limits) == get);
}

TEST_CASE("malformed replies name what is wrong") {
  const wire::Limits limits{8, 16};
  auto reply_error = [&](Verb to, const std::string& payload) {
    return error_of([&] { wire::decode_reply(to, payload, limits); });
  };
  CHECK(contains(reply_error(Verb::set, std::string(1, char(3))), "unknown reply status 3"));
  CHECK(contains(reply_error(Verb::set, std::string(1, char(wire::Status::timeout)) + std::string(4, '\0')),
                 "a timeout reply to set"));
  CHECK(contains(reply_error(Verb::delete_key, std::string{0, 2}), "flag byte is 2, not 0 or 1"));
  // A not-found try_get carries no value: extra bytes make a second encoding, refused.
  CHECK(contains(reply_error(Verb::try_get, std::string{0, 0, 0, 0, 0, 0}), "4 unexpected bytes at the end"));
  wire::Reply big;
  big.value = std::string(17, 'v');
  CHECK(contains(reply_error(Verb::get, payload_of(wire::encode(Verb::get, big))), "value of 17 bytes exceeds"));
  wire::Reply hello;
  hello.limits = {0, 16};
  CHECK(contains(reply_error(Verb::hello, payload_of(wire::encode(Verb::hello, hello))), "max key size must be in [1, 1 MiB]"));
}

TEST_CASE("limits: the handshake bound fits the longest hello; nonsense limits are refused") {
  wire::Request hello;
  hello.verb = Verb::hello;
  hello.token = std::string(wire::max_token_bytes, 't');
  hello.job = std::string(wire::max_job_bytes, 'j');
  CHECK(wire::encode(hello).size() - 4 == wire::Limits::max_hello_bytes());
  hello.job.push_back('j');  // one byte past the longest job id: refused
  CHECK(contains(error_of([&] { wire::decode_request(payload_of(wire::encode(hello)), wire::Limits{}); }),
                 "store frame: job id of 257 bytes exceeds the limit of 256"));

  wire::Request cas;
  cas.verb = Verb::compare_set;
  const wire::Limits limits{8, 16};
  cas.keys = {std::string(8, 'k')};
  cas.expected = cas.value = std::string(16, 'v');
  CHECK(wire::encode(cas).size() - 4 == limits.max_frame_bytes());

  CHECK(contains(error_of([] { wire::Limits{0, 1}.check(); }), "max key size must be in [1, 1 MiB], got 0 bytes"));
  CHECK(contains(error_of([] { wire::Limits{1, (std::size_t{1} << 30) + 1}.check(); }), "max value size must be in [1, 1 GiB]"));
  CHECK(error_of([] { wire::Limits{}.check(); }).empty());
}

TEST_CASE("FrameReader: a large announced frame costs only what arrived; frames split anywhere come out whole") {
  namespace wire = fsdp::store_wire;
  const wire::Limits limits;
  wire::FrameReader reader(limits.max_frame_bytes());
  const auto announced = static_cast<std::uint32_t>(limits.max_frame_bytes());
  const std::string header{char(announced & 0xff), char((announced >> 8) & 0xff), char((announced >> 16) & 0xff),
                           char(announced >> 24)};
  auto feed = [&](std::string_view bytes) {
    bool complete = false;
    while (!bytes.empty()) {
      const std::size_t n = std::min(reader.room(), bytes.size());
      std::copy_n(bytes.data(), n, reader.buffer());
      complete = reader.received(n);
      bytes.remove_prefix(n);
    }
    return complete;
  };
  CHECK_FALSE(feed(header + std::string(100, 'x')));
  CHECK(reader.announced() == announced);
  CHECK(reader.held() == std::size_t{64} << 10);  // not 128 MiB
  CHECK_FALSE(feed(std::string(std::size_t{1} << 20, 'x')));
  CHECK(reader.held() <= 2 * ((std::size_t{1} << 20) + 100));

  reader.next();
  CHECK(reader.held() == 0);
  wire::Request set;
  set.verb = wire::Verb::set;
  set.keys = {"k"};
  set.value = "value";
  const std::string frame = wire::encode(set);
  for (std::size_t split = 1; split < frame.size(); ++split) {
    CAPTURE(split);
    CHECK_FALSE(feed(frame.substr(0, split)));
    REQUIRE(feed(frame.substr(split)));
    CHECK(wire::decode_request(reader.payload(), limits) == set);
    reader.next();
  }
  reader.set_limit(wire::Limits::max_hello_bytes());
  CHECK(contains(error_of([&] { feed(header); }), "exceeds the limit of " + std::to_string(wire::Limits::max_hello_bytes())));
}

}  // namespace asio_store_protocol_test
