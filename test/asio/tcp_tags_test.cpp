// TcpComm carries each collective's tag (fsdp/collective_tag.hpp) in its frame header
// (fsdp/asio/tcp_frame.hpp) and compares it with the receiver's before it touches the
// payload: ranks gathering different units of the same size fail on every rank, naming
// both units, and a model whose ranks swap two units from iteration 2 on never shows the
// engine the other unit's parameters. Ranks are threads over loopback sockets.
#include <doctest/doctest.h>

#include <algorithm>
#include <array>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "fsdp/asio/tcp_comm.hpp"
#include "tcp_world.hpp"
#include "test/faults/unit_order_driver.hpp"

namespace {

using test_support::contains;
using test_support::TcpWorld;

struct Names final : fsdp::UnitNames {
  std::string unit_name(int index) const override { return "layer" + std::to_string(index); }
};

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

TEST_CASE("a rank that swaps two units from iteration 2 on: an error on every rank, nothing shown") {
  TcpWorld world(2);
  std::vector<std::vector<std::string>> logs(2);
  const auto errors = world.each([&](fsdp::TcpComm& comm, int r) {
    engine::ModelConfig config;
    config.blocks = 3;
    engine::Model model(config);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard, fsdp::BackwardPre>(model, comm, device, engine::Wrap{});
    test_support::iteration(sm, test_support::usual);
    test_support::iteration(sm, r == 1 ? test_support::swapped : test_support::usual, logs[r]);
  });
  for (int r = 0; r < 2; ++r) {
    CAPTURE(errors[r]);
    CHECK(contains(errors[r], "of unit 'blocks.0' (forward"));
    CHECK(contains(errors[r], "of unit 'blocks.1' (forward"));
    for (const char* shown : {"pre_forward blocks.0", "pre_forward blocks.1"})
      CHECK(std::find(logs[r].begin(), logs[r].end(), shown) == logs[r].end());
  }
}
