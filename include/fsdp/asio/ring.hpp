#pragma once
// Ring schedules for TcpComm: which frames one rank sends to its right neighbour
// (rank + 1), which it receives from its left one (rank - 1), and what it does with each.
// Pure bookkeeping, no sockets: TcpRing (tcp_ring.hpp) carries the plan out.
//
// Every byte crosses every link once (the bandwidth optimum of Gloo's and NCCL's rings):
//   all_gather      N-1 steps; at step s rank r forwards chunk r-s and receives chunk r-s-1.
//   reduce_scatter  N-1 steps; at step s rank r sends its partial sum of chunk r-1-s and
//                   receives the partial of chunk r-2-s, which it combines with its own.
//   all_reduce      reduce_scatter then all_gather (2N-2 steps) over N near-equal chunks
//                   of `count` (the first count % N chunks hold one element more).
//   broadcast       a chain root -> root+1 -> ... -> root-1, after one empty frame per link.
//   barrier         all_gather of nothing: N-1 empty frames.
//   ring_shift      one step: rank r sends its whole buffer to r+1 and receives r-1's into
//                   recv (never the same memory), at least one frame (empty for count 0).
// Steps are cut into segments of at most segment_bytes; frames go out segment-major in a
// wavefront (step s of segment j at time j + 2s), so a rank forwards segment j while the
// next ones are still arriving, and a reduction overlaps the transfers around it.
//
// Reduction order (fixed, so results are bitwise reproducible from run to run): the
// partial for chunk c starts at rank c+1 and travels the ring, each rank combining
// `partial = partial (op) own` on arrival, so chunk c is
//   ((x[c+1] op x[c+2]) op x[c+3]) ... op x[c]      (ranks mod N),
// and avg is that sum finished once by rank c (detail::finish_avg) before it is gathered.
//
// Every collective sends at least one frame on every link before it waits for anything,
// so ranks that call different collectives always meet a frame that tells them so. A rank
// whose own frames all match may still finish its call (the root of a broadcast, a
// ring_shift rank whose left neighbour shifted too); the ABORT of the ranks that met the
// mismatch then fails its next collective.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::detail {

struct SendFrame {
  const std::byte* data;
  std::size_t bytes;
  std::int64_t after_recv;  // -1, or the receive whose (reduced) payload this frame forwards
};

struct RecvFrame {
  std::byte* dest;
  std::size_t bytes;
  const std::byte* combine_with = nullptr;  // if set: dest = dest (op) combine_with
  std::byte* copy_to = nullptr;             // if set: then copy dest here
  bool finish_avg = false;                  // then finish avg where the result lies
  std::int64_t after_send = -1;             // dest may be written once this send completed
};

struct LocalCopy {  // done before any frame moves
  const std::byte* from;
  std::byte* to;
  std::size_t bytes;
  bool finish_avg;  // world size 1: the copy is the whole reduction
};

struct RingPlan {
  std::vector<LocalCopy> local;
  std::vector<SendFrame> sends;  // in order on the link to the right
  std::vector<RecvFrame> recvs;  // in order on the link from the left
};

// What a rank does with a frame once its payload is in f.dest.
inline void finish_recv(const RecvFrame& f, DType t, ReduceOp op, int ranks) {
  const std::size_t n = f.bytes / size_of(t);
  if (f.combine_with) host_combine(f.dest, f.combine_with, n, t, op == ReduceOp::avg ? ReduceOp::sum : op);
  std::byte* result = f.dest;
  if (f.copy_to) {
    if (f.bytes) std::memcpy(f.copy_to, f.dest, f.bytes);
    result = f.copy_to;
  }
  if (f.finish_avg) finish_avg(result, n, t, ranks);
}

inline void run_local(const LocalCopy& l, DType t, int ranks) {
  if (l.from != l.to && l.bytes) std::memcpy(l.to, l.from, l.bytes);
  if (l.finish_avg) finish_avg(l.to, l.bytes / size_of(t), t, ranks);
}

class RingPlanner {
 public:
  RingPlanner(int rank, int size, std::size_t segment_bytes) : rank_(rank), n_(size), segment_bytes_(segment_bytes) {}

  // The plan for `c` on this rank. Valid until the next call (it points into scratch).
  const RingPlan& plan(const CollectiveCall& c) {
    plan_.local.clear();
    plan_.sends.clear();
    plan_.recvs.clear();
    esize_ = size_of(c.dtype);
    seg_elems_ = std::max<std::size_t>(1, segment_bytes_ / esize_);
    auto* send = static_cast<const std::byte*>(c.send);
    auto* recv = static_cast<std::byte*>(c.recv);
    const bool avg = c.op == ReduceOp::avg;
    const std::size_t bytes = c.count * esize_;
    switch (c.kind) {
      case CollectiveKind::all_gather:
        chunks(c.count, false);
        add_local(send, recv + rank_ * bytes, bytes, false);
        // Step 0 sends chunk `rank` from `send`; everything lands in `recv`.
        if (n_ > 1) ring_pass({send, own_begin()}, {recv, 0}, nullptr, 0, n_ - 1, false);
        break;
      case CollectiveKind::reduce_scatter:
        chunks(c.count, false);
        // Only chunk `rank` of the output exists: `recv`.
        if (n_ == 1) add_local(send, recv, bytes, avg);
        else ring_pass({send, 0}, {recv, own_begin()}, send, n_ - 1, 0, avg);
        break;
      case CollectiveKind::all_reduce:
        chunks(c.count, true);
        if (n_ == 1) add_local(send, recv, bytes, avg);
        else ring_pass({send, 0}, {recv, 0}, send, n_ - 1, n_ - 1, avg);
        break;
      case CollectiveKind::broadcast:
        chain(c.root, send, recv, bytes);
        break;
      case CollectiveKind::barrier:
        chunks(0, false);
        if (n_ > 1) ring_pass({nullptr, 0}, {nullptr, 0}, nullptr, 0, n_ - 1, false);
        break;
      case CollectiveKind::ring_shift:
        if (n_ == 1) add_local(send, recv, bytes, false);
        else shift(send, recv, bytes);
        break;
    }
    if (plan_.sends.size() > std::numeric_limits<std::uint32_t>::max())
      fail("rank ", rank_, ": ", c.describe(), " needs ", plan_.sends.size(), " frames with segment_bytes=", segment_bytes_,
           "; use larger segments");
    return plan_;
  }

  static int mod(int a, int n) { return ((a % n) + n) % n; }

 private:
  // A frame is forwarded kLag wavefronts after it arrived: slack for a rank that was
  // descheduled for a moment, paid for in scratch slots of reduce-scatter.
  static constexpr std::size_t kLag = 2;

  // A buffer that holds the chunk layout from byte `origin` on (a whole layout, or only
  // chunk `rank` of it); null for collectives without data.
  template <class Byte>
  struct Span {
    Byte* base;
    std::size_t origin;
    Byte* at(std::size_t offset) const { return base ? base + (offset - origin) : nullptr; }
  };

  // N chunks of `count` elements each, or (near_equal) N chunks that split `count`, the
  // first count % N of them one element longer.
  void chunks(std::size_t count, bool near_equal) {
    chunk_off_.assign(n_, 0);
    chunk_len_.assign(n_, count);
    if (near_equal)
      for (int c = 0; c < n_; ++c) chunk_len_[c] = count / n_ + (static_cast<std::size_t>(c) < count % n_ ? 1 : 0);
    for (int c = 1; c < n_; ++c) chunk_off_[c] = chunk_off_[c - 1] + chunk_len_[c - 1];
  }
  std::size_t own_begin() const { return chunk_off_[rank_] * esize_; }
  void add_local(const std::byte* from, std::byte* to, std::size_t bytes, bool avg) {
    if (from != to || avg) plan_.local.push_back({from, to, bytes, avg});
  }

  // Segment j of chunk c, in bytes from the layout's start (empty past the chunk's end).
  std::size_t seg_begin(int c, std::size_t j) const {
    return (chunk_off_[c] + std::min(j * seg_elems_, chunk_len_[c])) * esize_;
  }
  std::size_t seg_bytes(int c, std::size_t j) const {
    const std::size_t b = std::min(j * seg_elems_, chunk_len_[c]);
    return (std::min(b + seg_elems_, chunk_len_[c]) - b) * esize_;
  }

  // `reduce_steps` reduce-scatter steps, then `gather_steps` all-gather steps. `first` is
  // what step 0 sends from, `out` where results land, `local` the input combined on
  // arrival (the whole layout).
  void ring_pass(Span<const std::byte> first, Span<std::byte> out, const std::byte* local, int reduce_steps,
                 int gather_steps, bool avg) {
    const int steps = reduce_steps + gather_steps;
    nseg_ = 1;
    for (int c = 0; c < n_; ++c) nseg_ = std::max(nseg_, (chunk_len_[c] + seg_elems_ - 1) / seg_elems_);
    const bool in_place = reduce_steps > 0 && out.at(own_begin()) == local + own_begin();
    prepare_slots(reduce_steps, in_place);
    recv_index_.assign(static_cast<std::size_t>(steps) * nseg_, -1);
    send_index_.assign(static_cast<std::size_t>(steps) * nseg_, -1);
    forwarder_.clear();
    slot_users_.clear();
    for (std::size_t t = 0; t < nseg_ + (steps - 1) * kLag; ++t) {  // wavefront t: step s of segment t - s*kLag
      for (int s = 0; s < steps && s * kLag <= t; ++s) {
        const std::size_t j = t - s * kLag;
        if (j >= nseg_) continue;
        const bool reducing = s < reduce_steps;
        const int g = s - reduce_steps;
        const int send_chunk = mod(reducing ? rank_ - 1 - s : rank_ - g, n_);
        const int recv_chunk = mod(reducing ? rank_ - 2 - s : rank_ - g - 1, n_);
        add_send(s, j, send_chunk, first);
        add_recv(s, j, recv_chunk, out, local, reduce_steps, in_place, avg);
      }
    }
    // A slot is refilled only after the frame forwarding its previous contents went out.
    for (const auto& [recv, previous] : slot_users_) {
      if (previous >= 0 && forwarder_[previous] >= 0) {
        auto& r = plan_.recvs[recv];
        r.after_send = std::max(r.after_send, forwarder_[previous]);
      }
    }
  }

  void add_send(int s, std::size_t j, int chunk, Span<const std::byte> first) {
    const std::size_t at = static_cast<std::size_t>(s) * nseg_ + j;
    SendFrame f{nullptr, seg_bytes(chunk, j), -1};
    if (s == 0) {
      f.data = first.at(seg_begin(chunk, j));
    } else {  // forwards what arrived at the previous step
      const std::int64_t prev = recv_index_[at - nseg_];
      const RecvFrame& r = plan_.recvs[prev];
      f.data = r.copy_to ? r.copy_to : r.dest;
      f.after_recv = prev;
      forwarder_[prev] = static_cast<std::int64_t>(plan_.sends.size());
    }
    send_index_[at] = static_cast<std::int64_t>(plan_.sends.size());
    plan_.sends.push_back(f);
  }

  void add_recv(int s, std::size_t j, int chunk, Span<std::byte> out, const std::byte* local, int reduce_steps, bool in_place,
                bool avg) {
    const std::size_t at = static_cast<std::size_t>(s) * nseg_ + j;
    const auto index = static_cast<std::int64_t>(plan_.recvs.size());
    RecvFrame f{nullptr, seg_bytes(chunk, j)};
    if (s < reduce_steps) {
      f.combine_with = local + seg_begin(chunk, j);
      const bool last = s == reduce_steps - 1;  // chunk == rank: the result
      if (last && !in_place) f.dest = out.at(seg_begin(chunk, j));
      else f.dest = take_slot(index);
      if (last && in_place) f.copy_to = out.at(seg_begin(chunk, j));
      f.finish_avg = last && avg;
    } else {
      f.dest = out.at(seg_begin(chunk, j));
      // In place, chunk rank-1 left at step 0 straight from the buffer this overwrites.
      if (s == reduce_steps && in_place) f.after_send = send_index_[j];
    }
    recv_index_[at] = index;
    forwarder_.push_back(-1);
    plan_.recvs.push_back(f);
  }

  // Scratch for partial sums in flight. At most n-1 frames per wavefront use a slot and
  // each is forwarded kLag wavefronts after it arrived, so with 2 * kLag * n slots a frame
  // waits for its slot only when this rank's sends lag far behind its receives. More than
  // n slots never deadlock: the send that frees a slot depends only on earlier frames.
  void prepare_slots(int reduce_steps, bool in_place) {
    std::size_t longest = 0;
    for (auto len : chunk_len_) longest = std::max(longest, len);
    slot_bytes_ = std::min(seg_elems_, std::max<std::size_t>(longest, 1)) * esize_;
    const std::size_t users = (static_cast<std::size_t>(std::max(reduce_steps - 1, 0)) + (in_place ? 1 : 0)) * nseg_;
    slots_ = std::min<std::size_t>(users, 2 * kLag * static_cast<std::size_t>(n_));
    if (scratch_.size() < slots_ * slot_bytes_) scratch_.resize(slots_ * slot_bytes_);
    next_slot_ = 0;
    slot_last_user_.assign(slots_, -1);
  }
  std::byte* take_slot(std::int64_t recv) {
    const std::size_t k = next_slot_++ % slots_;
    slot_users_.push_back({recv, slot_last_user_[k]});
    slot_last_user_[k] = recv;
    return scratch_.data() + k * slot_bytes_;
  }

  void chain(int root, const std::byte* send, std::byte* recv, std::size_t bytes) {
    const int pos = mod(rank_ - root, n_);
    if (pos == 0) add_local(send, recv, bytes, false);
    if (n_ == 1) return;
    // One empty frame on every link first: each rank checks its left neighbour's call
    // even where the chain never reaches it (ranks that disagree on the root).
    plan_.sends.push_back({nullptr, 0, -1});
    plan_.recvs.push_back({nullptr, 0});
    const std::size_t seg = seg_elems_ * esize_;
    for (std::size_t b = 0; b < bytes; b += seg) {
      const std::size_t len = std::min(seg, bytes - b);
      if (pos == 0) {
        plan_.sends.push_back({send + b, len, -1});
        continue;
      }
      plan_.recvs.push_back({recv + b, len});
      if (pos != n_ - 1) plan_.sends.push_back({recv + b, len, static_cast<std::int64_t>(plan_.recvs.size()) - 1});
    }
  }

  // ring_shift: `send` goes right and the left neighbour's buffer lands in `recv`, segment
  // by segment. No frame waits for another (the buffers are separate), and there is at
  // least one frame, empty for 0 bytes, so a neighbour's other collective is met.
  void shift(const std::byte* send, std::byte* recv, std::size_t bytes) {
    const std::size_t seg = seg_elems_ * esize_;
    std::size_t b = 0;
    do {
      const std::size_t len = std::min(seg, bytes - b);
      plan_.sends.push_back({send + b, len, -1});
      plan_.recvs.push_back({recv + b, len});
      b += len;
    } while (b < bytes);
  }

  const int rank_, n_;
  const std::size_t segment_bytes_;
  std::size_t esize_ = 4, seg_elems_ = 1, nseg_ = 1;
  std::vector<std::size_t> chunk_off_, chunk_len_;  // elements
  std::vector<std::int64_t> recv_index_, send_index_;  // by step * nseg + segment
  std::vector<std::int64_t> forwarder_;  // by receive: the send that forwards its payload
  std::vector<std::pair<std::int64_t, std::int64_t>> slot_users_;  // (receive, previous receive in its slot)
  std::vector<std::int64_t> slot_last_user_;
  std::vector<std::byte> scratch_;
  std::size_t slot_bytes_ = 0, slots_ = 0, next_slot_ = 0;
  RingPlan plan_;
};

}  // namespace fsdp::detail
