#pragma once
// fsdp::PeerCheckpoint: a checkpoint in host memory, with its copies on other ranks, so that
// a job that loses a rank does not go back to the checkpoint on disk. After the optimizer
// step every rank calls refresh(): it copies its own state (its shards, their optimizer
// states, the optimizer's scalars, the buffers, and the engine's own state as text:
// `metadata`, as a sharded checkpoint on disk keeps it) into host memory. Where the model keeps
// replicas (HybridShard's replicate groups, NoShard), that is all: the same state is
// already on the ranks of the rank's replicate group, and refresh() checks, by checksum,
// that they hold it byte for byte. Otherwise, or where a replica's bytes differ (buffers
// each rank computes from its own data), it sends the copy to rank + 1 in one ring_shift,
// receiving rank - 1's. When a rank is replaced (its process restarted, its memory gone),
// every rank calls restore(): the replacement receives its state from a replica or from the
// rank that holds its copy, the survivors take their own copy back, and all are at the same
// step, which restore() returns: the engine redoes the steps from there with the same data.
//
// Why a copy of one's own state as well: an optimizer step cannot be undone. The lost
// rank's copy is of the last refresh, and a survivor may have stepped past it (a rank dies
// after the others' last collective of a step, before its own optimizer step), so the
// survivors go back to the refresh, not forward.
//
// Why the commit: refresh() makes the new copies, then agrees that every rank has them
// (the checksums' all_gather; after a ring_shift, an all_reduce), and only then drops the
// previous copies. A rank lost in between leaves some ranks with the new copies and some
// with only the previous ones; restore() picks the newest step that every rank can be
// brought to, from what each reports, and says so when there is none (two neighbours lost
// at once: the copy of the first was on the second; every replica of a shard lost). Every
// copy carries its rank, the world size, its step and XXH64 checksums, checked before
// anything is loaded.
//
// Host memory: one copy of this rank's share of the state with replicas, two otherwise
// (its own and its neighbour's), and as many again, kept for the next refresh
// (PeerCheckpointOptions::reuse_buffers) or only while a refresh is being committed.
// Collectives run on `comm`, the world communicator the model was sharded over (a
// RingShiftCommunicator: ThreadComm, TcpComm, MpiComm). See
// docs/failures.md#in-memory-recovery.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "fsdp/checkpoint/checksum.hpp"
#include "fsdp/checkpoint/load_state.hpp"
#include "fsdp/checkpoint/optimizer_state.hpp"
#include "fsdp/checkpoint/state_dict.hpp"
#include "fsdp/checkpoint/state_source.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/root_cause.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/model/sharded_model.hpp"

namespace fsdp {

// What restore() did.
struct PeerRestore {
  std::int64_t step = 0;          // the step every rank is at now: redo the steps from here
  // What the engine passed to refresh() with this rank's state at `step` (a loss scaler's
  // state, a data loader's position): load it as the model's state was loaded.
  std::map<std::string, std::string> metadata;
  std::vector<int> replaced;      // ranks that received their state from another rank
  std::vector<int> sources;       // for each of `replaced`, the rank it came from
  std::vector<char> from_replica; // for each of `replaced`: 1 from a replica, 0 from rank + 1's copy
  std::size_t bytes_received = 0; // of state this rank received (0 on a survivor)
};

namespace detail {

// One rank's state as bytes: a header, then every slice and scalar. Both ends are the same
// build of the same program, so fields are in host order.
// The payload has a checksum of its own: replicas' payloads are the same bytes under
// different headers, so refresh() compares payload checksums, and a copy received from a
// replica is relabelled (a new header) without reading its payload again.
struct PeerStateHeader {
  std::uint64_t magic = 0x4650445345455046ull;  // "FPEESDPF"
  std::uint64_t checksum = 0;                   // header_checksum: this header, its checksum field 0
  std::uint64_t payload_checksum = 0;           // XXH64 of the payload
  std::int64_t rank = 0, world = 0, step = 0;
  std::uint64_t slices = 0, scalars = 0, metadata = 0, payload = 0;  // payload: bytes after the header
};

inline std::uint64_t header_checksum(PeerStateHeader h) {
  h.checksum = 0;
  return checkpoint::Xxh64::of(&h, sizeof h);
}

inline PeerStateHeader header_of(const std::byte* copy) {
  PeerStateHeader h;
  std::memcpy(&h, copy, sizeof h);
  return h;
}

// Gives a checked copy another rank's name (a replica's state, received by the rank it
// restores): the header rewritten, the payload as it is.
inline void relabel_peer_state(std::byte* copy, int rank) {
  PeerStateHeader h = header_of(copy);
  h.rank = rank;
  h.checksum = header_checksum(h);
  std::memcpy(copy, &h, sizeof h);
}

// Host bytes that are not zeroed first (a vector's resize would write every byte once
// more, and a copy is written whole right after).
// A moved-from one is empty (size 0), as its pointer is.
struct PeerBytes {
  std::unique_ptr<std::byte[]> data;
  std::size_t size = 0;
  PeerBytes() = default;
  PeerBytes(std::unique_ptr<std::byte[]> d, std::size_t n) : data(std::move(d)), size(n) {}
  PeerBytes(PeerBytes&& o) noexcept : data(std::move(o.data)), size(std::exchange(o.size, 0)) {}
  PeerBytes& operator=(PeerBytes&& o) noexcept {
    data = std::move(o.data);
    size = std::exchange(o.size, 0);
    return *this;
  }
  static PeerBytes of_size(std::size_t n) { return {std::unique_ptr<std::byte[]>(new std::byte[n]), n}; }
  std::span<const std::byte> view() const { return {data.get(), size}; }
};

// Calls f(key, dtype, shape, begin, count, unit, src) for each slice of this rank's own
// state: what a sharded state dict holds, but from every rank's own shards (under
// HybridShard a replica's too: each rank is restored from its own copy) and with the
// buffers on every rank.
template <class F>
void for_each_peer_slice(ShardedModel& model, OptimizerState* optimizer, F&& f) {
  const auto names = optimizer ? optimizer->state_names() : std::vector<std::string>{};
  for_each_param(model, [&](Unit& u, const ParamView& p, std::size_t shard) {
    f(StateKey::param(std::string(p.fqn)), p.dtype, p.shape, p.param_begin, p.count, u, p.param);
    for (const auto& name : names) {
      const DType t = optimizer->state_dtype(name);
      const auto* base = static_cast<const std::byte*>(optimizer->state(name, shard, model.shards()[shard].numel));
      f(StateKey::optim(std::string(p.fqn), name), t, p.shape, p.param_begin, p.count, u, base + p.shard_offset * size_of(t));
    }
  });
  for (auto& u : model)
    for (std::size_t i = 0; i < u->buffers().size(); ++i) {
      const auto& b = u->buffers()[i];
      f(StateKey::buffer(std::string(b.fqn)), b.dtype, std::span<const std::int64_t>(b.shape), std::int64_t{0}, b.numel, *u,
        static_cast<const void*>(fsdp::detail::internals(*u).buffer_data(i)));
    }
}

// This rank's state as one copy, in two passes: the size (so every rank can agree on the
// largest before anything is written), then the bytes, into `size` bytes at least.
class PeerStateWriter {
 public:
  PeerStateWriter(ShardedModel& model, OptimizerState* optimizer, const std::map<std::string, std::string>& metadata = {})
      : model_(model),
        optimizer_(optimizer),
        scalars_(optimizer ? optimizer->scalars() : std::map<std::string, std::string>{}),
        metadata_(metadata) {
    std::size_t n = sizeof(PeerStateHeader);
    for_each_peer_slice(model_, optimizer_, [&](const StateKey& key, DType t, std::span<const std::int64_t> shape, std::int64_t,
                                                std::int64_t count, const Unit&, const void*) {
      n += 1 + 8 + key.state.size() + 8 + key.fqn.size() + 1 + 8 + 8 * shape.size() + 8 + 8 + static_cast<std::size_t>(count) * size_of(t);
    });
    for (const auto& [k, v] : scalars_) n += 16 + k.size() + v.size();
    for (const auto& [k, v] : metadata_) n += 16 + k.size() + v.size();
    size_ = n;
  }
  std::size_t size() const { return size_; }

  // Writes the copy into the first size() bytes of `out`; the rest is left as it is.
  void write(std::byte* out, int rank, int world, std::int64_t step) const {
    std::byte* at = out + sizeof(PeerStateHeader);
    auto put = [&](const void* p, std::size_t n) {
      if (n) std::memcpy(at, p, n);
      at += n;
    };
    auto put_value = [&](const auto& v) { put(&v, sizeof v); };
    auto put_string = [&](const std::string& s) {
      put_value(static_cast<std::uint64_t>(s.size()));
      put(s.data(), s.size());
    };
    PeerStateHeader h;
    h.rank = rank, h.world = world, h.step = step;
    for_each_peer_slice(model_, optimizer_, [&](const StateKey& key, DType t, std::span<const std::int64_t> shape, std::int64_t begin,
                                                std::int64_t count, const Unit& u, const void* src) {
      put_value(static_cast<std::uint8_t>(key.kind));
      put_string(key.state);
      put_string(key.fqn);
      put_value(static_cast<std::uint8_t>(t));
      put_value(static_cast<std::uint64_t>(shape.size()));
      for (const std::int64_t d : shape) put_value(d);
      put_value(begin);
      put_value(count);
      const std::size_t n = static_cast<std::size_t>(count) * size_of(t);
      if (n) fsdp::detail::internals(u).copy_bytes(at, src, n);
      at += n;
      ++h.slices;
    });
    for (const auto& [k, v] : scalars_) {
      put_string(k);
      put_string(v);
      ++h.scalars;
    }
    for (const auto& [k, v] : metadata_) {
      put_string(k);
      put_string(v);
      ++h.metadata;
    }
    h.payload = static_cast<std::uint64_t>(at - out) - sizeof h;
    if (h.payload + sizeof h != size_)
      fail("PeerCheckpoint on rank ", rank, ": the state changed while it was copied (", size_, " bytes measured, ",
           h.payload + sizeof h, " written)");
    h.payload_checksum = checkpoint::Xxh64::of(out + sizeof h, h.payload);
    h.checksum = header_checksum(h);
    std::memcpy(out, &h, sizeof h);
  }

 private:
  ShardedModel& model_;
  OptimizerState* optimizer_;
  std::map<std::string, std::string> scalars_;
  std::map<std::string, std::string> metadata_;  // a copy: the writer may outlive a temporary map
  std::size_t size_ = 0;
};

// Reads a copy's fields, each checked to lie inside it.
class PeerStateReader {
 public:
  PeerStateReader(std::span<const std::byte> in, std::string what) : in_(in), what_(std::move(what)) {}
  void get(void* p, std::size_t n) {
    if (n > in_.size() - at_) fail_as(ErrorKind::corrupt, what_, ": the copy ends early (", n, " bytes wanted at ", at_, " of ", in_.size(), ")");
    if (n) std::memcpy(p, in_.data() + at_, n);
    at_ += n;
  }
  template <class T>
  T get() {
    T v{};
    get(&v, sizeof v);
    return v;
  }
  std::string get_string() {
    const auto n = get<std::uint64_t>();
    if (n > in_.size() - at_) fail_as(ErrorKind::corrupt, what_, ": a name of ", n, " bytes runs past the copy's end");
    std::string s(reinterpret_cast<const char*>(in_.data() + at_), n);
    at_ += n;
    return s;
  }

 private:
  std::span<const std::byte> in_;
  std::size_t at_ = 0;
  std::string what_;
};

// The state in `bytes` (at least the copy's own length: a received copy may be padded),
// checked to be whole and to be rank `rank`'s of `world` ranks at `step` (a replica's
// copy: that replica's rank); its metadata into `metadata`, if given.
inline ShardedStateDict parse_peer_state(std::span<const std::byte> bytes, int rank, int world, std::int64_t step,
                                         const std::string& what, std::map<std::string, std::string>* metadata = nullptr) {
  PeerStateHeader h;
  if (bytes.size() < sizeof h) fail_as(ErrorKind::corrupt, what, ": ", bytes.size(), " bytes, shorter than a copy's header");
  h = header_of(bytes.data());
  if (h.magic != PeerStateHeader{}.magic) fail_as(ErrorKind::corrupt, what, ": not a peer checkpoint's copy (its first bytes are wrong)");
  if (header_checksum(h) != h.checksum) fail_as(ErrorKind::corrupt, what, ": the copy's header checksum does not match its header (damaged in memory or on the way)");
  if (h.payload > bytes.size() - sizeof h)
    fail_as(ErrorKind::corrupt, what, ": the copy says it holds ", h.payload, " bytes, but ", bytes.size() - sizeof h, " arrived");
  const auto payload = bytes.subspan(sizeof h, h.payload);
  if (checkpoint::Xxh64::of(payload.data(), payload.size()) != h.payload_checksum)
    fail_as(ErrorKind::corrupt, what, ": the copy's checksum does not match its bytes (damaged in memory or on the way)");
  if (h.rank != rank || h.world != world || h.step != step)
    fail_as(ErrorKind::mismatch, what, ": the copy is rank ", h.rank, "'s of ", h.world, " ranks at step ", h.step, ", not rank ", rank,
            "'s of ", world, " at step ", step);
  ShardedStateDict out;
  out.rank = rank, out.world = world;
  PeerStateReader r(payload, what);
  for (std::uint64_t i = 0; i < h.slices; ++i) {
    StateSlice s;
    const auto kind = r.get<std::uint8_t>();
    if (kind > static_cast<std::uint8_t>(StateKind::optim)) fail_as(ErrorKind::corrupt, what, ": slice ", i, " has kind code ", int(kind));
    s.id.kind = static_cast<StateKind>(kind);
    s.id.state = r.get_string();
    s.id.fqn = r.get_string();
    const auto dtype = r.get<std::uint8_t>();
    if (!is_dtype_code(dtype)) fail_as(ErrorKind::corrupt, what, ": ", s.id.describe(), " has dtype code ", int(dtype));
    s.dtype = static_cast<DType>(dtype);
    const auto dims = r.get<std::uint64_t>();
    if (dims > 64) fail_as(ErrorKind::corrupt, what, ": ", s.id.describe(), " has ", dims, " dimensions");
    for (std::uint64_t d = 0; d < dims; ++d) s.shape.push_back(r.get<std::int64_t>());
    s.begin = r.get<std::int64_t>();
    s.count = r.get<std::int64_t>();
    if (s.count < 0 || static_cast<std::uint64_t>(s.count) > payload.size())
      fail_as(ErrorKind::corrupt, what, ": ", s.id.describe(), " has ", s.count, " elements");
    s.data.resize(static_cast<std::size_t>(s.count) * size_of(s.dtype));
    r.get(s.data.data(), s.data.size());
    out.slices.push_back(std::move(s));
  }
  for (std::uint64_t i = 0; i < h.scalars; ++i) {
    std::string k = r.get_string();
    out.optim_scalars[std::move(k)] = r.get_string();
  }
  for (std::uint64_t i = 0; i < h.metadata; ++i) {
    std::string k = r.get_string();
    std::string v = r.get_string();
    if (metadata) (*metadata)[std::move(k)] = std::move(v);
  }
  return out;
}

// One rank's report at restore(): what it holds, as i64 fields (all_gather'd).
struct PeerHoldings {
  static constexpr std::size_t kFields = 10;
  std::int64_t step = -1, own = 0, held = 0;                  // committed: step, bytes of each copy
  std::int64_t pending_step = -1, pending_own = 0, pending_held = 0;  // a refresh not yet committed
  // The step of a refresh that found every rank's copy equal to its replicas' (by
  // checksum) and sent no copy to rank + 1 (the step of this rank's committed copy; -1 if
  // not): at that step a replica's own copy, committed or pending, is a lost rank's state.
  std::int64_t shared_step = -1;
  std::int64_t stride = 0;  // the ranks of a shard group (replicas: r mod stride); 0: no replicas
  // Whether this rank's committed and pending copies equal those of its replicate group:
  // its own check of that refresh completed, or (set by restore()) a survivor's did, whose
  // all_gather held this rank's checksum of the same bytes. Then a lost replica's state is
  // the same.
  std::int64_t own_replicated = 0, pending_replicated = 0;
  bool lost() const { return step < 0 && pending_step < 0; }
  // Bytes of this rank's own state at `s`, or of its left neighbour's; 0: none.
  // (A refresh at the committed step, as restore() runs, may hold a copy only pending.)
  std::int64_t own_at(std::int64_t s) const { return s == step && own > 0 ? own : s == pending_step ? pending_own : 0; }
  std::int64_t held_at(std::int64_t s) const { return s == step && held > 0 ? held : s == pending_step ? pending_held : 0; }
  bool replicated_at(std::int64_t s) const {
    return s == step && own > 0 ? own_replicated != 0 : s == pending_step && pending_replicated != 0;
  }
};

// Where a lost rank's state at a step comes from.
struct PeerSource {
  int rank = -1;
  bool replica = false;  // its own copy (a replica's state), else its copy of rank - 1's
  std::int64_t bytes = 0;
};

// The ranks that hold rank r's state under a mesh whose shard groups are `stride` ranks
// (0: no replicas): r's replicate group, r itself left out.
inline std::vector<int> peer_replicas(int r, int n, int stride) {
  std::vector<int> out;
  if (stride > 0)
    for (int q = r % stride; q < n; q += stride)
      if (q != r) out.push_back(q);
  return out;
}

// Lost rank r's state at step s: from a surviving replica where a survivor saw, at s, that
// r's copy equalled its replicas' (every copy did, or those of r's group), else from its
// right neighbour's copy; nullopt, and why, if none.
inline std::optional<PeerSource> peer_source(const std::vector<PeerHoldings>& ranks, int stride, int r, std::int64_t s,
                                             std::ostream& why) {
  const int n = static_cast<int>(ranks.size());
  const auto at = [&](int q) -> const PeerHoldings& { return ranks[static_cast<std::size_t>(q)]; };
  bool shared = false;  // no copy was sent to rank + 1 at s: the replicas are the only copies
  for (const auto& h : ranks) shared = shared || (!h.lost() && h.shared_step == s);
  const auto replicas = peer_replicas(r, n, stride);
  for (const int q : replicas)
    if (!at(q).lost() && at(q).replicated_at(s)) return PeerSource{q, true, at(q).own_at(s)};
  if (shared) {
    std::vector<int> alive;
    for (const int q : replicas) {
      if (!at(q).lost() && at(q).own_at(s) > 0) return PeerSource{q, true, at(q).own_at(s)};
      if (!at(q).lost()) alive.push_back(q);
    }
    std::ostringstream list;
    for (std::size_t i = 0; i < replicas.size(); ++i) list << (i ? ", " : "") << replicas[i];
    if (!alive.empty()) {
      why << "lost rank " << r << "'s replicas that survived (rank";
      for (std::size_t i = 0; i < alive.size(); ++i) why << (i ? ", " : alive.size() == 1 ? " " : "s ") << alive[i];
      why << ") hold no copy of step " << s;
    } else
      why << "rank " << r << " was lost and so " << (replicas.size() == 1 ? "was its replica, rank " : "were its replicas, ranks ")
          << list.str() << ", which held the same state";
    return std::nullopt;
  }
  const int right = (r + 1) % n;
  if (n == 1)
    why << "rank 0 was lost and is the only rank";
  else if (at(right).lost())
    why << "rank " << r << " was lost and so was rank " << right << ", which held its copy";
  else if (at(right).held_at(s) <= 0)
    why << "rank " << right << " holds no copy of lost rank " << r << "'s state at step " << s;
  else
    return PeerSource{right, false, at(right).held_at(s)};
  return std::nullopt;
}

// The newest step every rank can be brought to: each survivor has its own copy at it and
// each lost rank has a source (peer_source). nullopt: none, and `why` says what is missing
// at the newest step anyone holds.
inline std::optional<std::int64_t> peer_restore_step(const std::vector<PeerHoldings>& ranks, std::string& why) {
  const int n = static_cast<int>(ranks.size());
  std::vector<std::int64_t> steps;
  std::int64_t stride = 0;  // the same on every rank that refreshed (one model)
  for (const auto& r : ranks) {
    stride = std::max(stride, r.stride);
    for (const auto s : {r.step, r.pending_step})
      if (s >= 0) steps.push_back(s);
  }
  std::sort(steps.rbegin(), steps.rend());
  steps.erase(std::unique(steps.begin(), steps.end()), steps.end());
  if (steps.empty()) {
    why = "no rank holds a copy: refresh() has not completed on any rank";
    return std::nullopt;
  }
  for (const auto s : steps) {
    std::ostringstream missing;
    for (int r = 0; r < n && missing.tellp() == 0; ++r) {
      const auto& me = ranks[static_cast<std::size_t>(r)];
      if (!me.lost() && me.own_at(s) <= 0)
        missing << "rank " << r << " holds no copy of its own state at step " << s;
      else if (me.lost())
        (void)peer_source(ranks, static_cast<int>(stride), r, s, missing);
    }
    if (missing.tellp() == 0) return s;
    if (why.empty()) why = missing.str();
  }
  return std::nullopt;
}

}  // namespace detail

struct PeerCheckpointOptions {
  // Where the model keeps replicas (HybridShard, NoShard), use them as the copies: no
  // copy is sent to rank + 1 when every rank's copy equals its replicas', byte for byte
  // (checked at every refresh). Off: every rank's copy goes to rank + 1 all the same.
  bool use_replicas = true;
  // Keep the previous copies' buffers for the next refresh instead of freeing them: four
  // buffers of a copy's size stay allocated (two otherwise; two and one where replicas
  // hold the copies), and a refresh writes into memory already mapped. Fresh buffers cost their page faults on every refresh (the
  // kernel zeroes each page): on the 2-core development machine, 4 thread ranks with 9.5 MB
  // copies, 44 ms per refresh against 25 ms with this on.
  bool reuse_buffers = true;
};

class PeerCheckpoint {
 public:
  PeerCheckpoint() = default;
  explicit PeerCheckpoint(PeerCheckpointOptions options) : options_(options) {}

  // Copies this rank's state into host memory; where replicas hold the same bytes, checks
  // that they do, else sends the copy to rank + 1 and receives rank - 1's; and agrees that
  // every rank has its copies before dropping the previous ones. `step`: the number the
  // engine gives the state (the next step to run), the same on every rank. `metadata`:
  // the engine's own state, kept with this rank's and given back by restore() (a loss
  // scaler's, a data loader's position). A collective over `comm`, the world communicator
  // the model was sharded over; call it with every unit idle (after the optimizer step).
  template <RingShiftCommunicator C>
  void refresh(C& comm, ShardedModel& model, OptimizerState* optimizer, std::int64_t step,
               const std::map<std::string, std::string>& metadata = {}) {
    const int rank = static_cast<int>(comm.rank()), world = static_cast<int>(comm.size());
    check_model(comm, model, "refresh");
    const detail::PeerStateWriter writer(model, optimizer, metadata);
    // One all_reduce(max) agrees on the largest copy (the ring_shift's size) and checks the
    // step and the replicas' use (which collectives follow), the same on every rank.
    const int stride = replica_stride(model);
    std::int64_t agreed[5] = {static_cast<std::int64_t>(writer.size()), step, -step, stride, -stride};
    comm.all_reduce(agreed, agreed, 5, DType::i64, ReduceOp::max).wait();
    if (agreed[1] != step || -agreed[2] != step)
      detail::fail_as(ErrorKind::mismatch, where(rank, "refresh"), ": this rank's step is ", step,
                      ", but the ranks passed steps from ", -agreed[2], " to ", agreed[1], "; every rank must pass the same");
    if (agreed[3] != stride || -agreed[4] != stride)
      detail::fail_as(ErrorKind::mismatch, where(rank, "refresh"), ": this rank ", stride > 0 ? "uses" : "does not use",
                      " replicas as copies (shard groups of ", stride, " ranks; 0: none), but the ranks range from ", -agreed[4],
                      " to ", agreed[3], "; every rank must pass the same PeerCheckpointOptions::use_replicas and model");
    // Every rank sends as many bytes: the smaller copies padded, to whole 8-byte words (an
    // MPI count of words reaches 16 GiB where one of bytes stops at 2).
    const auto n = (static_cast<std::size_t>(agreed[0]) + 7) / 8 * 8;
    pending_held_ = Copy{};
    pending_own_ = Copy{};
    auto own = take_spare(spare_own_, n);
    writer.write(own.data.get(), rank, world, step);
    std::memset(own.data.get() + writer.size(), 0, n - writer.size());
    pending_own_ = Copy{std::move(own), step};  // whole: restore() may pick it
    stride_ = stride;
    if (stride > 0) {
      // Every rank's payload checksum, in one all_gather: which copies equal their
      // replicas'. When all do, the replicas are the copies, nothing is sent, and this is
      // the commit; otherwise the ring below runs too, and this rank's replicas still
      // serve for it where its group's copies agreed.
      const auto mine = static_cast<std::int64_t>(detail::header_of(pending_own_.bytes.data.get()).payload_checksum);
      std::vector<std::int64_t> sums(static_cast<std::size_t>(world));
      comm.all_gather(&mine, sums.data(), 1, DType::i64).wait();
      bool all = true, group = true;
      for (int r = 0; r < world; ++r) {
        const bool equal = sums[static_cast<std::size_t>(r)] == sums[static_cast<std::size_t>(r % stride)];
        all = all && equal;
        if (r % stride == rank % stride) group = group && equal;
      }
      pending_own_.replicated = group;
      if (all) {
        spare_own_ = options_.reuse_buffers ? std::move(own_.bytes) : detail::PeerBytes{};
        spare_held_ = detail::PeerBytes{};
        own_ = std::move(pending_own_);
        own_.shared = true;
        held_ = Copy{};
        pending_own_ = Copy{};
        return;
      }
    }
    auto held = take_spare(spare_held_, n);
    comm.ring_shift(pending_own_.bytes.data.get(), held.data.get(), n / 8, DType::i64).wait();
    pending_held_ = Copy{std::move(held), step};
    std::int32_t received = 1;  // every rank got its neighbour's copy: the previous ones may go
    comm.all_reduce(&received, &received, 1, DType::i32, ReduceOp::min).wait();
    if (options_.reuse_buffers) {
      spare_own_ = std::move(own_.bytes);
      spare_held_ = std::move(held_.bytes);
    }
    own_ = std::move(pending_own_);
    held_ = std::move(pending_held_);
    pending_own_ = Copy{};
    pending_held_ = Copy{};
  }

  // Brings every rank to the newest step all can reach: a rank with no copies (a
  // replacement, whose PeerCheckpoint is new) receives its state from a replica or from
  // rank + 1; the others load their own copy. Then refreshes, so that every rank's state
  // has its copies again.
  // A collective over `comm`; checks every copy before anything is loaded, and fails on
  // every rank alike, loading nothing, when a rank's state has no copy left.
  template <RingShiftCommunicator C>
  PeerRestore restore(C& comm, ShardedModel& model, OptimizerState* optimizer) {
    const int rank = static_cast<int>(comm.rank()), world = static_cast<int>(comm.size());
    check_model(comm, model, "restore");
    const std::string at = where(rank, "restore");
    const std::vector<detail::PeerHoldings> ranks = holdings(comm);
    std::string why;
    const auto step = detail::peer_restore_step(ranks, why);
    std::int64_t stride = 0;  // as peer_restore_step
    for (const auto& h : ranks) stride = std::max(stride, h.stride);
    if (!step)
      detail::fail_as(ErrorKind::peer_lost, at, ": no step that every rank can be restored to: ", why,
                      ". Nothing was loaded; resume from the last checkpoint on disk");
    PeerRestore report;
    report.step = *step;
    // The lost ranks' copies, each broadcast from its source (every rank takes part).
    detail::PeerBytes received;
    int source = -1;
    bool from_replica = false;
    for (int lost = 0; lost < world; ++lost) {
      if (!ranks[static_cast<std::size_t>(lost)].lost()) continue;
      std::ostringstream ignored;
      const detail::PeerSource from = *detail::peer_source(ranks, static_cast<int>(stride), lost, *step, ignored);
      report.replaced.push_back(lost);
      report.sources.push_back(from.rank);
      report.from_replica.push_back(from.replica ? 1 : 0);
      auto buffer = detail::PeerBytes::of_size(static_cast<std::size_t>(from.bytes));
      if (rank == from.rank) {  // as PeerHoldings::own_at and held_at
        const Copy& c = from.replica ? (own_.step == *step && own_.bytes.size ? own_ : pending_own_)
                                     : (held_.step == *step && held_.bytes.size ? held_ : pending_held_);
        std::memcpy(buffer.data.get(), c.bytes.data.get(), buffer.size);
      }
      comm.broadcast(buffer.data.get(), buffer.data.get(), buffer.size / 8, DType::i64, from.rank).wait();  // whole words (refresh)
      if (rank == lost) received = std::move(buffer), report.bytes_received = received.size, source = from.rank, from_replica = from.replica;
    }
    // Every rank checks its state before any rank loads.
    std::optional<ShardedStateDict> state;
    std::string bad;
    ErrorKind bad_kind = ErrorKind::corrupt;
    try {
      const bool replaced = ranks[static_cast<std::size_t>(rank)].lost();
      const detail::PeerBytes& bytes = replaced ? received : own_.step == *step ? own_.bytes : pending_own_.bytes;
      const std::string what = at + (!replaced      ? ": its own copy"
                                     : from_replica ? ": the state received from rank " + std::to_string(source) + ", its replica"
                                                    : ": the copy received from rank " + std::to_string(source));
      state = detail::parse_peer_state(bytes.view(), from_replica ? source : rank, world, *step, what, &report.metadata);
      state->rank = rank;
      if (from_replica) detail::relabel_peer_state(received.data.get(), rank);  // this rank's own copy from now on
    } catch (const std::exception& e) {
      bad = detail::message_of(e), bad_kind = kind_of(e, ErrorKind::corrupt);
    }
    std::int32_t ok = bad.empty() ? 1 : 0;
    comm.all_reduce(&ok, &ok, 1, DType::i32, ReduceOp::min).wait();
    if (!bad.empty()) detail::fail_as(bad_kind, bad, "; nothing was loaded on any rank");
    if (!ok) detail::fail_as(ErrorKind::corrupt, at, ": another rank's copy failed its checks (that rank says which); nothing was loaded");
    const std::vector<ShardedStateDict> dicts{std::move(*state)};
    load_state(model, ShardedStateDictsSource(dicts), optimizer);
    // The copies of the chosen step become the committed ones before the refresh below: a
    // rank lost during it must still find them (a holder's pending copy of a lost rank's
    // state included), not lose them to that refresh's start.
    Copy own = ranks[static_cast<std::size_t>(rank)].lost() ? Copy{std::move(received), *step}
               : own_.step == *step                          ? std::move(own_)
                                                             : std::move(pending_own_);
    Copy held = held_.step == *step && held_.bytes.size ? std::move(held_)
                : pending_held_.step == *step                ? std::move(pending_held_)
                                                             : Copy{};
    own_ = std::move(own);
    held_ = std::move(held);
    pending_own_ = Copy{};
    pending_held_ = Copy{};
    // What the survivors knew of the chosen step's replicas holds on for these copies (a
    // refresh below that fails leaves them the committed ones).
    const auto known = [&](int r) {
      const auto& h = ranks[static_cast<std::size_t>(r)];
      return !h.lost() && (h.shared_step == *step || h.replicated_at(*step));
    };
    own_.shared = std::any_of(ranks.begin(), ranks.end(), [&](const auto& h) { return !h.lost() && h.shared_step == *step; });
    own_.replicated = own_.shared || known(rank);
    for (const int q : detail::peer_replicas(rank, world, static_cast<int>(stride))) own_.replicated = own_.replicated || known(q);
    own_.replicated = own_.replicated && stride > 0;
    refresh(comm, model, optimizer, *step, report.metadata);
    return report;
  }

  // The step restore() would bring every rank to, or nullopt, with what is missing in
  // `why`, when no rank can be restored (two neighbours lost, nothing refreshed yet). A
  // collective over `comm`: ask it first to tell a state that is gone (fall back to the
  // checkpoint on disk) from a restore() whose collectives fail (a peer lost again).
  template <Communicator C>
  std::optional<std::int64_t> restorable_step(C& comm, std::string* why = nullptr) const {
    std::string missing;
    const auto step = detail::peer_restore_step(holdings(comm), missing);
    if (why) *why = missing;
    return step;
  }

  // The step of the committed copies; nullopt before the first refresh (and on a
  // replacement until its restore).
  std::optional<std::int64_t> step() const { return own_.step < 0 ? std::nullopt : std::optional(own_.step); }
  // Whether the committed copies are replicas' (the last refresh found every rank's copy
  // equal to its replicas' and sent none to rank + 1).
  bool on_replicas() const { return own_.step >= 0 && own_.shared; }
  // Host memory the copies hold now, the buffers kept for the next refresh included.
  std::size_t host_bytes() const {
    return own_.bytes.size + held_.bytes.size + pending_own_.bytes.size + pending_held_.bytes.size + spare_own_.size +
           spare_held_.size;
  }

 private:
  struct Copy {
    detail::PeerBytes bytes;
    std::int64_t step = -1;
    bool replicated = false;  // its replicate group's copies equal it (PeerHoldings::own_replicated)
    bool shared = false;      // every rank's did, and no copy went to rank + 1 (PeerHoldings::shared_step)
  };
  static std::int64_t size_of(const Copy& c) { return c.step < 0 ? 0 : static_cast<std::int64_t>(c.bytes.size); }
  // What every rank holds (an all_gather).
  template <class C>
  std::vector<detail::PeerHoldings> holdings(C& comm) const {
    const int world = static_cast<int>(comm.size());
    const std::int64_t fields[detail::PeerHoldings::kFields] = {
        own_.step,         size_of(own_),        size_of(held_),        pending_own_.step, size_of(pending_own_),
        size_of(pending_held_), own_.shared ? own_.step : -1, stride_, own_.replicated, pending_own_.replicated};
    std::vector<std::int64_t> all(detail::PeerHoldings::kFields * static_cast<std::size_t>(world));
    comm.all_gather(fields, all.data(), detail::PeerHoldings::kFields, DType::i64).wait();
    std::vector<detail::PeerHoldings> ranks;
    for (int r = 0; r < world; ++r) {
      const std::int64_t* f = all.data() + detail::PeerHoldings::kFields * static_cast<std::size_t>(r);
      ranks.push_back({f[0], f[1], f[2], f[3], f[4], f[5], f[6], f[7], f[8], f[9]});
    }
    return ranks;
  }
  static std::string where(int rank, const char* call) { return "PeerCheckpoint::" + std::string(call) + " on rank " + std::to_string(rank); }

  template <class C>
  static void check_model(C& comm, ShardedModel& model, const char* call) {
    const int rank = static_cast<int>(comm.rank());
    if (model.size() == 0) detail::fail(where(rank, call), ": the model has no units");
    const auto& in = fsdp::detail::internals(model[0]);
    if (in.rank() != rank || in.world_size() != static_cast<int>(comm.size()))
      detail::fail(where(rank, call), ": the communicator is rank ", rank, " of ", comm.size(), ", but the model was sharded as rank ",
                   in.rank(), " of ", in.world_size(), "; pass the world communicator the model was sharded over");
    for (auto& u : model)
      if (u->state() != TrainingState::IDLE)
        detail::fail(where(rank, call), ": unit '", detail::display_name(u->fqn()), "' is ", name_of(u->state()),
                     "; call it between steps, with every unit IDLE (abort_step() first after a failure)");
  }

  // The size of the model's shard groups when it keeps replicas (rank r's state is also on
  // ranks r mod stride + k stride: DeviceMesh's layout), 0 if it keeps none or they are not
  // to be used. A guess that refresh() checks: a replica whose bytes differ is no copy.
  int replica_stride(ShardedModel& model) const {
    const MeshShape mesh = fsdp::detail::internals(model[0]).mesh_shape();
    return options_.use_replicas && mesh.replicate > 1 ? mesh.shard : 0;
  }

  static detail::PeerBytes take_spare(detail::PeerBytes& spare, std::size_t n) {
    if (spare.size == n) return std::move(spare);
    spare = detail::PeerBytes{};  // the copies changed size: this one fits no more
    return detail::PeerBytes::of_size(n);
  }
  PeerCheckpointOptions options_;
  detail::PeerBytes spare_own_, spare_held_;  // reuse_buffers: the copies before the last commit
  Copy own_, held_;                  // committed: this rank's state and rank - 1's, at one step
  Copy pending_own_, pending_held_;  // a refresh in flight, kept when it fails before its commit
  int stride_ = 0;                   // replica_stride at the last refresh
};

}  // namespace fsdp
