// TcpComm carries each collective's tag (fsdp/core/collective_tag.hpp) in its frame header
// (fsdp/asio/tcp_frame.hpp) and compares it with the receiver's before it touches the
// payload: ranks gathering different units of the same size fail on every rank, each
// naming every rank's call and unit (learned through the store, fsdp/asio/tcp_rank_report.hpp)
// in the same words, a rank in no collective is named as not reporting within a bounded
// wait, and a model whose ranks swap two units from iteration 2 on never shows the engine
// the other unit's parameters. Ranks are threads over loopback sockets.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "fsdp/asio/tcp_comm.hpp"
#include "test/asio/tcp_world.hpp"
#include "test/faults/unit_order_driver.hpp"

namespace asio_tcp_tags_test {

namespace {

using test_support::contains;
using test_support::TcpWorld;

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

struct Names final : fsdp::UnitNames {
  std::string unit_name(int index) const override { return "layer" + std::to_string(index); }
};

// The mismatch message in an error: what a detecting rank throws, and what the others
// quote after "aborted: ". Empty if there is none.
std::string verdict(const std::string& error) {
  const auto at = error.find("collective mismatch:");
  return at == std::string::npos ? "" : error.substr(at);
}

// What the mismatch message says rank r did ("called ...", "did not report"): the text
// after its "rank r " up to the next rank's entry or the end of the list.
std::string entry(const std::string& error, int r) {
  const std::string v = verdict(error);
  for (const char* before : {": rank ", ", rank "}) {
    const std::string start = before + std::to_string(r) + " ";
    auto at = v.find(start);
    if (at == std::string::npos) continue;
    at += start.size();
    return v.substr(at, std::min(v.find(", rank ", at), v.find(" (seen on rank ", at)) - at);
  }
  return "";
}

// Every rank's error carries the same mismatch message.
void check_same_verdict(const std::vector<std::string>& errors) {
  for (const auto& e : errors) {
    CAPTURE(e);
    CHECK(!verdict(e).empty());
    CHECK(verdict(e) == verdict(errors[0]));
  }
}

}  // namespace

TEST_CASE("the frame header carries the tag") {
  const Names names;
  fsdp::detail::CollectiveCall c;
  c.kind = fsdp::detail::CollectiveKind::all_gather;
  c.count = 3;
  c.tag = fsdp::CollectiveTag{7, fsdp::TagPhase::backward, 12, &names}.packed();
  const auto h = fsdp::detail::FrameHeader::data_for(c, 0, 12);
  std::array<std::byte, fsdp::detail::FrameHeader::kSize> bytes{};
  h.encode(bytes.data());
  std::string problem;
  const auto back = fsdp::detail::FrameHeader::decode(bytes.data(), problem);
  REQUIRE(back);
  CHECK(back->tag == c.tag);
  CHECK(back->matches(c));
  CHECK(contains(back->call(&names).describe(), "of unit 'layer7' (backward, pass 12)"));
  auto other = c;
  other.tag = fsdp::CollectiveTag{8, fsdp::TagPhase::backward, 12}.packed();
  CHECK_FALSE(back->matches(other));
}

TEST_CASE("the frame header carries every dtype, the 8-bit floats included, and refuses a code past them") {
  std::array<std::byte, fsdp::detail::FrameHeader::kSize> bytes{};
  std::string problem;
  for (int code = 0; code <= static_cast<int>(fsdp::DType::e8m0); ++code) {
    fsdp::detail::CollectiveCall c;
    c.kind = fsdp::detail::CollectiveKind::all_gather;
    c.count = 5;
    c.dtype = static_cast<fsdp::DType>(code);
    fsdp::detail::FrameHeader::data_for(c, 0, 5).encode(bytes.data());
    const auto back = fsdp::detail::FrameHeader::decode(bytes.data(), problem);
    CAPTURE(problem);
    REQUIRE(back);
    CHECK(back->dtype == c.dtype);
    CHECK(back->matches(c));
  }
  bytes[6] = std::byte{static_cast<unsigned char>(static_cast<int>(fsdp::DType::e8m0) + 1)};  // the dtype's byte
  CHECK_FALSE(fsdp::detail::FrameHeader::decode(bytes.data(), problem));
  CHECK(problem == "frame names an unknown collective, dtype or op");
}

TEST_CASE("all-gathers of the same size with different tags fail on every rank, naming both units") {
  const Names names;
  TcpWorld world(2);
  const auto errors = world.each([&](fsdp::TcpComm& comm, int r) {
    std::vector<float> mine(4, 1.0f), all(8);
    const fsdp::CollectiveTag tag{static_cast<std::uint32_t>(r), fsdp::TagPhase::forward, 3, &names};
    comm.all_gather(mine.data(), all.data(), 4, fsdp::DType::f32, tag).wait();
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(errors[r]);
    CHECK(contains(errors[r], "collective mismatch"));
    CHECK(contains(errors[r], "of unit 'layer0' (forward, pass 3)"));
    CHECK(contains(errors[r], "of unit 'layer1' (forward, pass 3)"));
  }
}

TEST_CASE("3 and 4 ranks, one gathering another unit: every rank's error names every rank's call and unit, alike") {
  const Names names;
  for (int n : {3, 4}) {
    for (int io : test_support::kIoThreads) {
      CAPTURE(n);
      CAPTURE(io);
      TcpWorld world(n, test_support::ok_options(1 << 20, io));
      const int odd = n - 2;  // rank 1 of 3, rank 2 of 4
      const auto t0 = Clock::now();
      const auto errors = world.each([&](fsdp::TcpComm& comm, int r) {
        std::vector<float> mine(4, 1.0f), all(4 * n);
        comm.all_gather(mine.data(), all.data(), 4, fsdp::DType::f32).wait();  // in step so far
        const fsdp::CollectiveTag tag{r == odd ? 1u : 0u, fsdp::TagPhase::forward, 3, &names};
        comm.all_gather(mine.data(), all.data(), 4, fsdp::DType::f32, tag).wait();
      });
      // Every rank is in the collective: the wait ends with the last report (each looks at
      // the store once a second while stalled), not at its 2 s bound.
      CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 1.9);
      check_same_verdict(errors);
      for (int r = 0; r < n; ++r) {
        CAPTURE(errors[r]);
        for (int named = 0; named < n; ++named) {
          const std::string unit = named == odd ? "layer1" : "layer0";
          CHECK(entry(errors[r], named) ==
                "called all_gather(count=4, dtype=f32) of unit '" + unit + "' (forward, pass 3) as collective #1");
        }
        CHECK(!contains(errors[r], "did not report"));
      }
      // The ranks that found it: odd (its left neighbour differs) and odd + 1.
      CHECK((contains(errors[0], "(seen on rank " + std::to_string(odd) + ")") ||
             contains(errors[0], "(seen on rank " + std::to_string(odd + 1) + ")")));
    }
  }
}

TEST_CASE("a rank in no collective is named as not reporting, after a bounded wait") {
  const Names names;
  auto options = test_support::ok_options();
  options.timeout = 2s;  // stalled ranks look every 500 ms; the wait for reports is 1 s
  TcpWorld world(4, options);
  std::vector<double> failed_after(4);
  const auto t0 = Clock::now();
  const auto errors = world.each([&](fsdp::TcpComm& comm, int r) {
    std::vector<float> mine(4, 1.0f), all(16);
    if (r == 3) std::this_thread::sleep_for(1500ms);  // in its own code past the wait
    const fsdp::CollectiveTag tag{r == 1 ? 1u : 0u, fsdp::TagPhase::backward, 2, &names};
    try {
      comm.all_gather(mine.data(), all.data(), 4, fsdp::DType::f32, tag).wait();
    } catch (const fsdp::Error&) {
      failed_after[r] = std::chrono::duration<double>(Clock::now() - t0).count();
      throw;
    }
  });
  check_same_verdict(errors);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(errors[r]);
    CHECK(entry(errors[r], 0) == "called all_gather(count=4, dtype=f32) of unit 'layer0' (backward, pass 2) as collective #0");
    CHECK(entry(errors[r], 1) == "called all_gather(count=4, dtype=f32) of unit 'layer1' (backward, pass 2) as collective #0");
    CHECK(entry(errors[r], 2) == "called all_gather(count=4, dtype=f32) of unit 'layer0' (backward, pass 2) as collective #0");
    CHECK(entry(errors[r], 3) == "did not report");
    CHECK(contains(errors[r], "a rank that did not report within 1000 ms is in no collective of communicator fsdp/comm"));
    CHECK(!contains(errors[r], "timed out"));
  }
  // Ranks 1 and 2 found it and waited the whole 1 s for rank 3; nobody waited for a timeout.
  for (int r = 0; r < 3; ++r) {
    CAPTURE(r);
    CHECK(failed_after[r] >= 0.95);
    CHECK(failed_after[r] < 1.8);
  }
  CHECK(contains(errors[3], "rank 3: all_gather(count=4, dtype=f32) of unit 'layer0' (backward, pass 2) as collective #0 "
                            "aborted: collective mismatch"));
}

TEST_CASE("keys left under the prefix by a communicator whose process died do not reach the next one's message") {
  const Names names;
  auto store = std::make_shared<fsdp::HashStore>();
  store->set("fsdp/comm/ask", "1");
  store->set("fsdp/comm/mismatch", "collective mismatch: stale, from an earlier communicator");
  store->set("fsdp/comm/last/2", "7\tbarrier as collective #7\tstale");
  std::vector<std::optional<fsdp::TcpComm>> comms(3);
  const auto made = test_support::on_threads(3, [&](int r) { comms[r].emplace(store, r, 3, test_support::ok_options()); });
  for (const auto& e : made) REQUIRE(e.empty());
  const auto errors = test_support::on_threads(3, [&](int r) {
    std::vector<float> mine(4, 1.0f), all(12);
    const fsdp::CollectiveTag tag{r == 1 ? 1u : 0u, fsdp::TagPhase::forward, 1, &names};
    comms[r]->all_gather(mine.data(), all.data(), 4, fsdp::DType::f32, tag).wait();
  });
  check_same_verdict(errors);
  for (int r = 0; r < 3; ++r) {
    CAPTURE(errors[r]);
    CHECK(!contains(errors[r], "stale"));
    CHECK(entry(errors[r], 2) == "called all_gather(count=4, dtype=f32) of unit 'layer0' (forward, pass 1) as collective #0");
  }
}

TEST_CASE("a rank that swaps two units from iteration 2 on: an error on every rank, nothing shown") {
  TcpWorld world(4);
  std::vector<std::vector<std::string>> logs(4);
  const auto errors = world.each([&](fsdp::TcpComm& comm, int r) {
    engine::ModelConfig config;
    config.blocks = 3;
    engine::Model model(config);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::BackwardPre>(model, comm, device, engine::Wrap{});
    test_support::iteration(sm, test_support::usual);
    test_support::iteration(sm, r == 2 ? test_support::swapped : test_support::usual, logs[r]);
  });
  check_same_verdict(errors);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(errors[r]);
    for (int named = 0; named < 4; ++named) {
      CAPTURE(named);
      CHECK(contains(entry(errors[r], named), "called all_gather("));
      CHECK(contains(entry(errors[r], named), named == 2 ? "of unit 'blocks.1' (forward" : "of unit 'blocks.0' (forward"));
    }
    for (const char* shown : {"pre_forward blocks.0", "pre_forward blocks.1"})
      CHECK(std::find(logs[r].begin(), logs[r].end(), shown) == logs[r].end());
  }
}

}  // namespace asio_tcp_tags_test
