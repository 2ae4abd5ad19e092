// fsdp/core/collective_tag.hpp: a tag's 8 bytes and its words; which communicators take tags
// (the backends that compare them, the wrappers that pass them on) and which do not (a
// user's own Communicator, UntaggedCommunicator); ThreadComm fails on every rank when the
// ranks' tags differ, and runs the collective when they agree; the mismatch message every
// backend shares (detail/collective_mismatch.hpp), also from gathered tags alone (NcclComm)
// and from each rank's own words (TcpComm, which may hear from only some ranks).
#include <doctest/doctest.h>

#include <string>
#include <vector>

#include <fsdp/core/detail/collective_mismatch.hpp>
#include <fsdp/fsdp.hpp>
#include <fsdp/testing/counting_communicator.hpp>
#include <fsdp/testing/untagged_communicator.hpp>

#include "test/support/errors.hpp"
#include "test/support/rank_errors.hpp"

namespace core_collective_tag_test {

namespace {

using test_support::contains;

struct Names final : fsdp::UnitNames {
  std::string unit_name(int index) const override { return "block" + std::to_string(index); }
};

// A Communicator of its own, without tagged calls: it stays a Communicator.
struct PlainComm {
  int rank() const { return 0; }
  int size() const { return 1; }
  fsdp::Work all_gather(const void*, void*, std::size_t, fsdp::DType) { return {}; }
  fsdp::Work reduce_scatter(const void*, void*, std::size_t, fsdp::DType, fsdp::ReduceOp) { return {}; }
  fsdp::Work all_reduce(const void*, void*, std::size_t, fsdp::DType, fsdp::ReduceOp) { return {}; }
  fsdp::Work broadcast(const void*, void*, std::size_t, fsdp::DType, int) { return {}; }
  fsdp::Work barrier() { return {}; }
};

}  // namespace

TEST_CASE("a tag packs into 8 nonzero bytes and back, and reads as the unit's name") {
  const Names names;
  for (auto phase : {fsdp::TagPhase::forward, fsdp::TagPhase::backward, fsdp::TagPhase::reduce, fsdp::TagPhase::summon})
    for (std::uint32_t unit : {0u, 1u, 1000u, (1u << 20) - 1})
      for (std::uint64_t step : {std::uint64_t{0}, std::uint64_t{7}, (std::uint64_t{1} << 40) - 1}) {
        const fsdp::CollectiveTag tag{unit, phase, step};
        const auto back = fsdp::CollectiveTag::unpack(tag.packed());
        CHECK(tag.packed() != 0);
        CHECK(back.unit == unit);
        CHECK(back.phase == phase);
        CHECK(back.step == step);
      }
  // Neighbours differ: unit, phase and pass each change the bytes.
  const fsdp::CollectiveTag a{3, fsdp::TagPhase::forward, 5};
  CHECK(a.packed() != fsdp::CollectiveTag{4, fsdp::TagPhase::forward, 5}.packed());
  CHECK(a.packed() != fsdp::CollectiveTag{3, fsdp::TagPhase::backward, 5}.packed());
  CHECK(a.packed() != fsdp::CollectiveTag{3, fsdp::TagPhase::forward, 6}.packed());
  CHECK(fsdp::CollectiveTag{2, fsdp::TagPhase::reduce, 9, &names}.describe() == "unit 'block2' (gradient reduction, pass 9)");
  CHECK(fsdp::CollectiveTag{2, fsdp::TagPhase::summon, 9}.describe() == "unit #2 (summon, pass 9)");
}

TEST_CASE("which communicators take tags") {
  using Thread = fsdp::ThreadComm;
  static_assert(fsdp::TaggedCommunicator<Thread>);
  static_assert(fsdp::TaggedCommunicator<fsdp::CountingCommunicator<Thread>>);
  static_assert(fsdp::TaggedCommunicator<fsdp::AsyncCommunicator<Thread>>);
  static_assert(fsdp::TaggedCommunicator<fsdp::StagedCommunicator<Thread, fsdp::HostDevice>>);
  static_assert(fsdp::Communicator<PlainComm> && !fsdp::TaggedCommunicator<PlainComm>);
  static_assert(!fsdp::TaggedCommunicator<fsdp::CountingCommunicator<PlainComm>>);
  static_assert(!fsdp::TaggedCommunicator<fsdp::UntaggedCommunicator<Thread>>);
  static_assert(fsdp::Communicator<fsdp::UntaggedCommunicator<Thread>>);
  PlainComm plain;
  fsdp::UntaggedCommunicator<PlainComm> untagged(plain);
  CHECK_FALSE(fsdp::detail::CommRef(plain).checks_tags());
  CHECK_FALSE(fsdp::detail::CommRef(untagged).checks_tags());
  fsdp::ThreadGroup(1).run([](fsdp::ThreadComm& comm) { CHECK(fsdp::detail::CommRef(comm).checks_tags()); });
}

TEST_CASE("ThreadComm: different tags fail on every rank naming each rank's unit; equal tags gather") {
  const Names names;
  const auto errors = test_support::errors_per_rank(3, [&](fsdp::ThreadComm& comm) {
    std::vector<float> mine(2, static_cast<float>(comm.rank())), all(6);
    const fsdp::CollectiveTag same{4, fsdp::TagPhase::forward, 1, &names};
    comm.all_gather(mine.data(), all.data(), 2, fsdp::DType::f32, same).wait();
    if (all != std::vector<float>{0, 0, 1, 1, 2, 2}) throw fsdp::Error("wrong gather");
    const fsdp::CollectiveTag mine_tag{static_cast<std::uint32_t>(comm.rank() == 2 ? 5 : 4), fsdp::TagPhase::backward, 1,
                                       &names};
    comm.reduce_scatter(all.data(), mine.data(), 2, fsdp::DType::f32, fsdp::ReduceOp::sum, mine_tag).wait();
  });
  for (int r = 0; r < 3; ++r) {
    CAPTURE(errors[r]);
    CHECK(contains(errors[r], "collective mismatch"));
    CHECK(contains(errors[r], "rank 0 called reduce_scatter(count=2, dtype=f32, op=sum) of unit 'block4' (backward, pass 1)"));
    CHECK(contains(errors[r], "rank 1 called reduce_scatter(count=2, dtype=f32, op=sum) of unit 'block4' (backward, pass 1)"));
    CHECK(contains(errors[r], "rank 2 called reduce_scatter(count=2, dtype=f32, op=sum) of unit 'block5' (backward, pass 1)"));
  }
}

// An all_gather of 101 f32 values, collective #`seq`, tagged as unit `unit`'s in forward.
fsdp::detail::CollectiveCall unit_gather(const Names& names, std::uint32_t unit, std::uint64_t seq) {
  fsdp::detail::CollectiveCall c{fsdp::detail::CollectiveKind::all_gather, nullptr, nullptr, 101, fsdp::DType::f32};
  c.seq = seq;
  c.tag = fsdp::CollectiveTag{unit, fsdp::TagPhase::forward, 1}.packed();
  c.names = &names;
  return c;
}

TEST_CASE("the mismatch message of a backend that gathers only tags (NcclComm) names every rank's unit") {
  const Names names;
  const auto mine = unit_gather(names, 0, 20);
  const std::uint64_t other = fsdp::CollectiveTag{1, fsdp::TagPhase::forward, 1}.packed();
  const std::vector<std::uint64_t> same{mine.tag, mine.tag, mine.tag};
  CHECK(fsdp::detail::tag_mismatch(mine, same, 1).empty());
  const std::vector<std::uint64_t> one_differs{mine.tag, other, mine.tag};
  const std::string m = fsdp::detail::tag_mismatch(mine, one_differs, 2);
  CAPTURE(m);
  CHECK(m ==
        "collective mismatch:"
        " rank 0 called all_gather(count=101, dtype=f32) of unit 'block0' (forward, pass 1) as collective #20,"
        " rank 1 called all_gather(count=101, dtype=f32) of unit 'block1' (forward, pass 1) as collective #20,"
        " rank 2 called all_gather(count=101, dtype=f32) of unit 'block0' (forward, pass 1) as collective #20"
        " (seen on rank 2)");
  // A rank whose call is untagged (a user's own collective where the library tagged one) differs too.
  const std::vector<std::uint64_t> untagged_peer{mine.tag, 0};
  CHECK(contains(fsdp::detail::tag_mismatch(mine, untagged_peer, 0),
                 "rank 1 called all_gather(count=101, dtype=f32) as collective #20"));
}

TEST_CASE("gathered tags with a peer's abort_step: that rank is the root, its note quoted where brought") {
  fsdp::detail::CollectiveCall mine{fsdp::detail::CollectiveKind::all_reduce, nullptr, nullptr, 1, fsdp::DType::i32,
                                    fsdp::ReduceOp::min};
  mine.tag = fsdp::CollectiveTag{2, fsdp::TagPhase::forward, 1}.packed();
  const std::uint64_t abort = fsdp::CollectiveTag{0, fsdp::TagPhase::abort_step, 0}.packed();
  // Ranks 1 and 3 abort; rank 0 and 2 compute: the lowest aborting rank is the root.
  const std::vector<std::uint64_t> tags{mine.tag, abort, mine.tag, abort};
  CHECK(fsdp::detail::abort_root(tags, 0) == 1);
  CHECK(fsdp::detail::abort_root(tags, 2) == 1);
  CHECK(fsdp::detail::abort_root(tags, 3) == -1);  // it aborted too: its error is its own
  CHECK(fsdp::detail::abort_root(std::vector<std::uint64_t>{mine.tag, 0, mine.tag}, 0) == -1);  // untagged: no root
  const auto note = std::make_shared<const std::string>("engine kernel failed");
  const std::string quoted = fsdp::detail::tag_mismatch(mine, tags, 0, 1, note);
  CAPTURE(quoted);
  CHECK(contains(quoted, "rank 1 called all_reduce(count=1, dtype=i32, op=min) of abort_step (the step was left by an "
                         "exception: \"engine kernel failed\")"));
  CHECK(contains(quoted, "rank 3 called all_reduce(count=1, dtype=i32, op=min) of abort_step (the step was left by an "
                         "exception) as collective #0"));  // its note was not brought
  CHECK_FALSE(contains(fsdp::detail::tag_mismatch(mine, tags, 0), "engine kernel failed"));
}

TEST_CASE("gathered tags: a peer's agreement is shown with the agreement's shape, not with this rank's") {
  const Names names;
  const auto gather = unit_gather(names, 1, 7);
  const std::uint64_t abort = fsdp::CollectiveTag{0, fsdp::TagPhase::abort_step, 0}.packed();
  // Rank 0 gathers a unit; rank 1 issued abort_step's agreement (an all_reduce of one i32).
  const std::string seen_by_gatherer = fsdp::detail::tag_mismatch(gather, std::vector<std::uint64_t>{gather.tag, abort}, 0);
  CAPTURE(seen_by_gatherer);
  CHECK(contains(seen_by_gatherer, "rank 0 called all_gather(count=101, dtype=f32) of unit 'block1' (forward, pass 1) "
                                   "as collective #7"));
  CHECK(contains(seen_by_gatherer, "rank 1 called all_reduce(count=1, dtype=i32, op=min) of abort_step"));
  CHECK_FALSE(contains(seen_by_gatherer, "rank 1 called all_gather"));
  // The take-over's agreement is one too; a unit's collective is not.
  CHECK(fsdp::detail::is_agreement_tag(fsdp::CollectiveTag{0, fsdp::TagPhase::take_over, 0}.packed()));
  CHECK_FALSE(fsdp::detail::is_agreement_tag(gather.tag));
  CHECK_FALSE(fsdp::detail::is_agreement_tag(0));
}

TEST_CASE("whole calls that differ in shape are a mismatch too; ranks of a split group are named as in the world") {
  using fsdp::detail::CollectiveCall;
  using fsdp::detail::CollectiveKind;
  const std::vector<CollectiveCall> same(2, CollectiveCall{CollectiveKind::all_reduce, nullptr, nullptr, 4, fsdp::DType::f32});
  CHECK(fsdp::detail::collective_mismatch(same, 0).empty());
  std::vector<CollectiveCall> counts = same;
  counts[1].count = 8;
  const std::vector<int> world{3, 5};
  const std::string m = fsdp::detail::collective_mismatch(counts, 0, world);
  CAPTURE(m);
  CHECK(m ==
        "collective mismatch: rank 3 called all_reduce(count=4, dtype=f32, op=sum) as collective #0,"
        " rank 5 called all_reduce(count=8, dtype=f32, op=sum) as collective #0 (seen on rank 3)");
}

TEST_CASE("the mismatch message from each rank's words: listed in rank order; on large worlds only the ranks that differ") {
  const std::vector<std::string> three{"called barrier as collective #4", "did not report", "called barrier as collective #5"};
  CHECK(fsdp::detail::mismatch_message(three, 2) ==
        "collective mismatch: rank 0 called barrier as collective #4, rank 1 did not report,"
        " rank 2 called barrier as collective #5 (seen on rank 2)");
  // 100 ranks, two of them elsewhere: those two, then the rest in one phrase.
  std::vector<std::string> hundred(100, "called barrier as collective #7");
  hundred[17] = "did not report";
  hundred[80] = "called barrier as collective #8";
  const std::string m = fsdp::detail::mismatch_message(hundred, 80);
  CAPTURE(m);
  CHECK(m ==
        "collective mismatch: rank 17 did not report, rank 80 called barrier as collective #8,"
        " and the other 98 ranks called barrier as collective #7 (seen on rank 80)");
  // More ranks that differ than are listed: counted, and the message stays short.
  std::vector<std::string> many(1000, "called barrier as collective #1");
  for (std::size_t r = 0; r < 300; ++r) many[r] = "did not report";
  const std::string capped = fsdp::detail::mismatch_message(many, 999);
  CAPTURE(capped);
  CHECK(contains(capped, "rank 63 did not report, 236 more ranks that differ, and the other 700 ranks called barrier"));
  CHECK(!contains(capped, "rank 64 did not report"));
  CHECK(capped.size() < 2000);
}

}  // namespace core_collective_tag_test
