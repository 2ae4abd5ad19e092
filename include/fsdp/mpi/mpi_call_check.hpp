#pragma once
// MpiComm's comparison of the ranks' calls: before each collective every rank starts a
// small MPI_Iallgather of its call's descriptor (kind, count, dtype, op, root, tag) on the
// same communicator; wait() completes it first and compares before the result is used.
//
// Started before the collective itself, the descriptor exchanges of two ranks always pair
// with each other (MPI matches a communicator's collectives in issue order, and every
// descriptor has the same size), whatever collectives the ranks then issue behind them. So
// when the collectives differ, every rank holds every rank's call by the time its own
// collective completes, fails with an MPI error (MPI_ERR_TRUNCATE) or times out, and can
// name them all instead of quoting MPI or a bare timeout.
//
// The descriptor is exact, 16 bytes: the tag in one word, and kind (3 bits), dtype (4),
// op (2), count (31: MpiComm refuses counts past INT_MAX) and root (24) in the other; a
// communicator of more than 2^24 ranks sends the root in a third word (every rank knows the
// size, so every rank sends the same width).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/detail/collective_mismatch.hpp"
#include "fsdp/mpi/mpi_types.hpp"

namespace fsdp::detail {

struct MpiCallDescriptor {
  static constexpr int kCountBits = 31, kRootBits = 24;

  // 2 words; 3 where a root may not fit in kRootBits.
  static int words(int group_size) { return group_size > (1 << kRootBits) ? 3 : 2; }

  // `call.count` must be at most INT_MAX (MpiComm checks before it packs).
  static void pack(const CollectiveCall& call, std::uint64_t* out, int words) {
    const auto root = static_cast<std::uint64_t>(static_cast<std::uint32_t>(call.root));
    out[0] = call.tag;
    out[1] = std::uint64_t(call.kind) | std::uint64_t(call.dtype) << 3 | std::uint64_t(call.op) << 7 |
             (std::uint64_t(call.count) & ((std::uint64_t(1) << kCountBits) - 1)) << 9 |
             (words == 3 ? 0 : root << (9 + kCountBits));
    if (words == 3) out[2] = root;
  }

  // Another rank's call, as `mine` would name it (its sequence number, its unit names).
  static CollectiveCall unpack(const std::uint64_t* in, int words, const CollectiveCall& mine) {
    CollectiveCall c;
    c.tag = in[0];
    c.kind = static_cast<CollectiveKind>(in[1] & 7);
    c.dtype = static_cast<DType>(in[1] >> 3 & 15);
    c.op = static_cast<ReduceOp>(in[1] >> 7 & 3);
    c.count = static_cast<std::size_t>(in[1] >> 9 & ((std::uint64_t(1) << kCountBits) - 1));
    c.root = static_cast<int>(words == 3 ? in[2] : in[1] >> (9 + kCountBits));
    c.seq = mine.seq;
    c.names = mine.names;
    return c;
  }
};

// One collective's descriptor exchange, held by its Work. MPI reads and writes `buffer_`'s
// heap block until the request completes (moving the object keeps that block): every
// rank's descriptor, then this rank's own.
class MpiCallCheck {
 public:
  MpiCallCheck(const CollectiveCall& call, int group_size)
      : words_(MpiCallDescriptor::words(group_size)),
        size_(group_size),
        buffer_(static_cast<std::size_t>(words_) * (static_cast<std::size_t>(group_size) + 1)) {
    MpiCallDescriptor::pack(call, mine(), words_);
  }

  // Starts the exchange (under the caller's MPI lock), the communicator's `number`-th:
  // MPI pairs a communicator's collectives in issue order, so the ranks' exchanges of one
  // number are the same collective (MpiPending::share_note numbers its messages by it).
  int start(MPI_Comm comm, std::uint64_t number) {
    number_ = number;
    return MPI_Iallgather(mine(), words_, MPI_UINT64_T, buffer_.data(), words_, MPI_UINT64_T, comm, &req);
  }
  std::uint64_t number() const { return number_; }

  // Every rank's call (valid once `req` completed).
  std::vector<CollectiveCall> calls(const CollectiveCall& self) const {
    std::vector<CollectiveCall> all;
    all.reserve(static_cast<std::size_t>(size_));
    for (int r = 0; r < size_; ++r)
      all.push_back(MpiCallDescriptor::unpack(buffer_.data() + static_cast<std::size_t>(r) * words_, words_, self));
    return all;
  }

  // "" when every rank's call is `self`'s; else collective_mismatch's message. Matching
  // descriptors (every call that goes well) are compared as words, with nothing allocated.
  // `note` (may be null): rank `note_rank`'s abort_step note, which MpiPending brought
  // from it (notes are not in the descriptors); this rank's own is self.note.
  std::string mismatch(const CollectiveCall& self, int rank, std::span<const int> world_ranks, int note_rank = -1,
                       std::shared_ptr<const std::string> note = nullptr) {
    const std::uint64_t* own = mine();
    bool same = true;
    for (int r = 0; r < size_ && same; ++r)
      same = std::equal(own, own + words_, buffer_.data() + static_cast<std::size_t>(r) * words_);
    if (same) return {};
    auto all = calls(self);
    all[static_cast<std::size_t>(rank)].note = self.note;  // this rank's own; a peer's only as brought
    if (note_rank >= 0 && note_rank < size_ && note_rank != rank) all[static_cast<std::size_t>(note_rank)].note = std::move(note);
    all_same_but_tag_ = std::all_of(all.begin(), all.end(), [&](CollectiveCall c) {
      c.tag = self.tag;
      return c.same_shape(self);
    });
    return collective_mismatch(all, static_cast<std::size_t>(rank), world_ranks);
  }
  // After a mismatch: the ranks differed in their tags only, so MPI ran one collective
  // alike on every rank and the communicator is still in step.
  bool tags_only() const { return all_same_but_tag_; }
  // After a mismatch: the lowest rank whose call is abort_step's agreement (the rank whose
  // note every rank quotes), or -1. The same on every rank, which holds every descriptor
  // (unless check_calls = false paired a descriptor with another collective).
  int abort_root() const {
    for (int r = 0; r < size_; ++r)
      if (CollectiveTag::unpack(buffer_[static_cast<std::size_t>(r) * static_cast<std::size_t>(words_)]).phase ==
          TagPhase::abort_step)
        return r;
    return -1;
  }

  MPI_Request req = MPI_REQUEST_NULL;

 private:
  std::uint64_t* mine() { return buffer_.data() + static_cast<std::size_t>(words_) * static_cast<std::size_t>(size_); }

  int words_;
  int size_;
  std::uint64_t number_ = 0;
  std::vector<std::uint64_t> buffer_;
  bool all_same_but_tag_ = true;
};

}  // namespace fsdp::detail
