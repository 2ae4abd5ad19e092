#pragma once
// A collective call as every backend describes it: which collective, its shape, and its
// per-rank sequence number, so that messages read "all_gather(count=4, dtype=f32) as
// collective #7" on every backend. Also what backends share about calls: the Communicator
// entry points that turn arguments into a CollectiveCall, what avg means, and how
// split() orders the ranks of a new group.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "fsdp/core/collective_tag.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/config.hpp"
#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp::detail {

// ring_shift last: TcpFrame's header check takes every code up to barrier's as a kind it
// knows, and ring_shift's only where the frame's peer can send one (any TcpComm can).
enum class CollectiveKind : std::uint8_t { all_gather, reduce_scatter, all_reduce, broadcast, barrier, ring_shift };

inline std::string_view name_of(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::all_gather: return "all_gather";
    case CollectiveKind::reduce_scatter: return "reduce_scatter";
    case CollectiveKind::all_reduce: return "all_reduce";
    case CollectiveKind::broadcast: return "broadcast";
    case CollectiveKind::barrier: return "barrier";
    case CollectiveKind::ring_shift: return "ring_shift";
  }
  return "?";
}

struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::barrier;
  const void* send = nullptr;
  void* recv = nullptr;
  std::size_t count = 0;
  DType dtype = DType::f32;
  ReduceOp op = ReduceOp::sum;
  int root = 0;
  std::uint64_t seq = 0;  // per-rank call number, for messages
  std::uint64_t tag = 0;  // CollectiveTag::packed(), or 0: untagged
  const UnitNames* names = nullptr;  // names the tag's unit in messages (never sent)
  std::shared_ptr<const std::string> note{};  // CollectiveTag::note: this rank's own, never another's (never sent)

  // The tag too: two ranks gathering different units of the same size are a mismatch.
  bool same_shape(const CollectiveCall& o) const {
    return kind == o.kind && count == o.count && dtype == o.dtype && op == o.op && root == o.root && tag == o.tag;
  }
  // `with_note`: abort_step's note too (CollectiveTag::describe), in a mismatch's list.
  std::string describe(bool with_note = false) const {
    std::ostringstream os;
    os << name_of(kind);
    if (kind != CollectiveKind::barrier) os << "(count=" << count << ", dtype=" << fsdp::name_of(dtype);
    if (kind == CollectiveKind::reduce_scatter || kind == CollectiveKind::all_reduce) os << ", op=" << fsdp::name_of(op);
    if (kind == CollectiveKind::broadcast) os << ", root=" << root;
    if (kind != CollectiveKind::barrier) os << ")";
    if (tag) os << " of " << CollectiveTag::unpack(tag, names, note).describe(with_note);
    os << " as collective #" << seq;
    return os.str();
  }
};

// The model's own agreements (detail::all_ranks_agree in fingerprint.hpp: the take-over at
// setup, abort_step) are all one call: an all_reduce of one i32 with min. Their tags say
// so, so a backend that gathers only its peers' tags (NcclComm) knows what such a peer called.
inline constexpr std::size_t kAgreementCount = 1;
inline constexpr DType kAgreementDType = DType::i32;
inline constexpr ReduceOp kAgreementOp = ReduceOp::min;
inline bool is_agreement_tag(std::uint64_t tag) {
  if (!tag) return false;
  const TagPhase p = CollectiveTag::unpack(tag).phase;
  return p == TagPhase::abort_step || p == TagPhase::take_over;
}
// `c` (its number, tag and note kept) with the agreement's shape.
inline CollectiveCall as_agreement(CollectiveCall c) {
  c.kind = CollectiveKind::all_reduce;
  c.send = c.recv = nullptr;
  c.count = kAgreementCount;
  c.dtype = kAgreementDType;
  c.op = kAgreementOp;
  c.root = 0;
  return c;
}

// "<where>: <call>" for messages, formatted only when one is written (cuda_check and fail
// stream it): backends pass it on every call without building a string.
struct CallAt {
  const std::string& where;
  const CollectiveCall& call;
  std::string text() const { return where + ": " + call.describe(); }
  friend std::ostream& operator<<(std::ostream& os, const CallAt& a) { return os << a.text(); }
};

// The last step of ReduceOp::avg on the sum of `ranks` contributions: floats are
// multiplied by 1/ranks (rounded in the dtype, as a kernel would); integers are divided by
// ranks, truncating, as NCCL's ncclAvg does (a factor 1/ranks would truncate to 0). In the
// mode's namespace (fsdp/core/config.hpp), as host_scale, which it calls: a header-only
// file and a separately compiled one must not share one name for two definitions.
inline namespace FSDP_MODE_NAMESPACE {
inline void finish_avg(void* sum, std::size_t n, DType t, int ranks) {
  if (is_floating(t)) {
    host_scale(sum, n, t, 1.0 / ranks);
    return;
  }
  for_each_typed(t, [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    auto* a = static_cast<T*>(sum);
    for (std::size_t i = 0; i < n; ++i) a[i] = static_cast<T>(a[i] / ranks);
  });
}
}  // inline namespace FSDP_MODE_NAMESPACE

template <class Backend>
concept backend_checks_tags = requires { requires Backend::checks_tags; };
// A backend that carries out CollectiveKind::ring_shift declares
// `static constexpr bool shifts_ring = true` and gets ring_shift() (RingShiftCommunicator).
template <class Backend>
concept backend_shifts_ring = requires { requires Backend::shifts_ring; };

// The five collectives of the Communicator concept for a backend that runs every call
// through one private `Work issue(CollectiveCall)` (made visible with
// `friend class detail::CollectiveCalls<Backend>;`). A backend whose issue() compares the
// ranks' tags (same_shape does) declares `static constexpr bool checks_tags = true` and
// gets the tagged calls of TaggedCommunicator too.
template <class Backend>
class CollectiveCalls {
 public:
  Work all_gather(const void* send, void* recv, std::size_t count, DType t) {
    return self().issue({CollectiveKind::all_gather, send, recv, count, t});
  }
  Work reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
    check_reduction("reduce_scatter", t, op);
    return self().issue({CollectiveKind::reduce_scatter, send, recv, count, t, op});
  }
  Work all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op) {
    check_reduction("all_reduce", t, op);
    return self().issue({CollectiveKind::all_reduce, send, recv, count, t, op});
  }
  Work broadcast(const void* send, void* recv, std::size_t count, DType t, int root) {
    if (root < 0 || root >= self().size())
      fail("rank ", self().rank(), ": broadcast root ", root, " is outside [0, ", self().size(), ")");
    return self().issue({CollectiveKind::broadcast, send, recv, count, t, ReduceOp::sum, root});
  }
  Work barrier() { return self().issue({CollectiveKind::barrier}); }
  // RingShiftCommunicator (fsdp/core/communicator.hpp): `count` elements to rank + 1,
  // rank - 1's into `recv`. A template for the reason the tagged calls below are.
  template <class Self = Backend>
    requires backend_shifts_ring<Self>
  Work ring_shift(const void* send, void* recv, std::size_t count, DType t) {
    const std::size_t bytes = count * size_of(t);
    const auto* s = static_cast<const std::byte*>(send);
    auto* r = static_cast<std::byte*>(recv);
    if (bytes && s < r + bytes && r < s + bytes && !(self().size() == 1 && s == r))  // one rank: in place copies nothing
      fail("rank ", self().rank(), ": ring_shift(count=", count, ", dtype=", name_of(t),
           "): its send and recv buffers overlap; give it two buffers");
    return self().issue({CollectiveKind::ring_shift, send, recv, count, t});
  }

  // The tagged calls are templates so that their constraint is checked where they are
  // called, on the complete Backend. A constraint on Backend itself is checked by clang 14
  // as this base is instantiated, before the Backend declares checks_tags, and its `false`
  // is kept: the tagged calls would silently not exist (self() asserts they do).
  template <class Self = Backend>
    requires backend_checks_tags<Self>
  Work all_gather(const void* send, void* recv, std::size_t count, DType t, const CollectiveTag& tag) {
    return self().issue(tagged({CollectiveKind::all_gather, send, recv, count, t}, tag));
  }
  template <class Self = Backend>
    requires backend_checks_tags<Self>
  Work reduce_scatter(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, const CollectiveTag& tag) {
    check_reduction("reduce_scatter", t, op);
    return self().issue(tagged({CollectiveKind::reduce_scatter, send, recv, count, t, op}, tag));
  }
  template <class Self = Backend>
    requires backend_checks_tags<Self>
  Work all_reduce(const void* send, void* recv, std::size_t count, DType t, ReduceOp op, const CollectiveTag& tag) {
    check_reduction("all_reduce", t, op);
    return self().issue(tagged({CollectiveKind::all_reduce, send, recv, count, t, op}, tag));
  }

 private:
  // e8m0 holds power-of-two scales: a sum of them means nothing (and a backend that sums
  // bytes would silently sum their bit patterns); max and min order as the values do.
  void check_reduction(const char* call, DType t, ReduceOp op) {
    if (t == DType::e8m0 && op != ReduceOp::max && op != ReduceOp::min)
      fail("rank ", self().rank(), ": ", call, "(op=", name_of(op),
           ") of e8m0 (power-of-two scales): only max and min reduce it");
  }

  static CollectiveCall tagged(CollectiveCall c, const CollectiveTag& tag) {
    c.tag = tag.packed();
    c.names = tag.names;
    c.note = tag.note;
    return c;
  }
  Backend& self() {
    // Checked where every call passes, on the complete Backend: a backend that compares
    // tags but whose tagged calls a compiler dropped would run untagged without a word.
    // (Not through backend_checks_tags<Backend>: clang 14 kept that one false.)
    static_assert(!requires { requires Backend::checks_tags; } || TaggedCommunicator<Backend>,
                  "a backend with checks_tags = true must satisfy fsdp::TaggedCommunicator");
    return static_cast<Backend&>(*this);
  }
};

// MPI_Comm_split's new group for `color`, from every rank's (color, key) gathered in rank
// order ([color0, key0, color1, key1, ...]): its ranks ordered by (key, rank).
inline std::vector<int> split_members(const std::vector<std::int32_t>& color_key, int color) {
  std::vector<std::pair<std::int32_t, int>> members;  // (key, rank)
  for (std::size_t r = 0; 2 * r < color_key.size(); ++r)
    if (color_key[2 * r] == color) members.push_back({color_key[2 * r + 1], static_cast<int>(r)});
  std::sort(members.begin(), members.end());
  std::vector<int> ranks;
  for (const auto& m : members) ranks.push_back(m.second);
  return ranks;
}

}  // namespace fsdp::detail
