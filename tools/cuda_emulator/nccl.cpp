// The emulated NCCL (see emulator.hpp): the NCCL calls fsdp::NcclComm makes, for ranks that
// are separate processes (each its own emulated GPU) or several communicators of one
// process (one per emulated GPU, as NcclComm::create makes them).
//
// The ranks of a communicator meet through files in one directory, which the unique id
// names: a rank joins by writing join-<rank>; it contributes to its k-th collective by
// writing c<k>-<rank> (the call's arguments and its send bytes, written whole and then
// renamed, so a reader never sees half of one). A collective is a pending operation of the
// emulated runtime (state.hpp) on its stream: it takes its send bytes once everything before
// it on the stream has completed, and completes, writing its receive buffer, once every
// rank's contribution is there. Until then the stream is held: a query of it or of an event
// recorded after it reports cudaErrorNotReady, as on a GPU. As NCCL does:
//   - a peer that never calls (dead, stopped, or calling something else) holds the
//     collective forever; calls whose arguments differ between ranks are not checked (they
//     hang, as they may on a GPU): the library's watchdog and collective tags must catch
//     both;
//   - ncclCommAbort ends the communicator's collectives without writing their results, so
//     its streams drain;
//   - nonblocking communicators (ncclConfig_t::blocking = 0) return ncclInProgress from
//     their creation and split until every rank has joined, and ncclCommGetAsyncError says
//     when; cuda_emulator::nccl_fail_async makes it report an asynchronous error. A split
//     of a nonblocking communicator writes the new communicator only once it is complete,
//     and the parent's ncclCommGetAsyncError says when (NCCL 2.28 leaves *newcomm null
//     until then: its own thread writes it).
// The directory (in /dev/shm, else /tmp) is removed when its last rank has destroyed or
// aborted its communicator.
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include <unistd.h>

#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/core/dtype.hpp"
#include "tools/cuda_emulator/capture.hpp"
#include "tools/cuda_emulator/entry.hpp"

namespace cuda_emulator::detail {
namespace {

namespace fs = std::filesystem;

constexpr char kIdMagic[] = "fsdp-nccl-emulator:";

thread_local std::string nccl_last_error;  // ncclGetLastError's text
thread_local int group_depth = 0;

enum class Kind : std::uint8_t { all_gather = 1, reduce_scatter, all_reduce, broadcast, split };

const char* kind_name(Kind k) {
  switch (k) {
    case Kind::all_gather: return "ncclAllGather";
    case Kind::reduce_scatter: return "ncclReduceScatter";
    case Kind::all_reduce: return "ncclAllReduce";
    case Kind::broadcast: return "ncclBroadcast";
    case Kind::split: return "ncclCommSplit";
  }
  return "?";
}

// What one rank contributes to one collective: its arguments, then its send bytes.
struct Header {
  std::uint32_t magic = 0x4e43434c;  // "NCCL"
  Kind kind{};
  std::int32_t dtype = 0, op = 0, root = 0;  // split: color, key
  std::uint64_t count = 0;
  std::uint64_t bytes = 0;  // that follow
};

std::size_t type_size(int t) {
  switch (t) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

// The fsdp::DType of an NCCL type, where there is one (the library's reductions are reused).
bool fsdp_type(int t, fsdp::DType& out) {
  switch (t) {
    case ncclInt8: out = fsdp::DType::i8; return true;
    case ncclUint8: out = fsdp::DType::u8; return true;
    case ncclInt32: out = fsdp::DType::i32; return true;
    case ncclInt64: out = fsdp::DType::i64; return true;
    case ncclFloat16: out = fsdp::DType::f16; return true;
    case ncclBfloat16: out = fsdp::DType::bf16; return true;
    case ncclFloat32: out = fsdp::DType::f32; return true;
    case ncclFloat64: out = fsdp::DType::f64; return true;
    case ncclFloat8e4m3: out = fsdp::DType::f8e4m3; return true;
    case ncclFloat8e5m2: out = fsdp::DType::f8e5m2; return true;
    default: return false;
  }
}

fsdp::ReduceOp fsdp_op(int op) {
  switch (op) {
    case ncclMax: return fsdp::ReduceOp::max;
    case ncclMin: return fsdp::ReduceOp::min;
    default: return fsdp::ReduceOp::sum;  // sum, and avg's sum
  }
}

// acc[i] = acc[i] (op) x[i] for the types fsdp::DType lacks (u32 and u64).
void combine_other(int t, std::byte* acc, const std::byte* x, std::size_t n, int op) {
  auto pick = [op](auto a, auto b) {
    return op == ncclMax ? std::max(a, b) : op == ncclMin ? std::min(a, b) : static_cast<decltype(a)>(a + b);
  };
  auto ints = [&](auto* tag) {
    using T = std::remove_pointer_t<decltype(tag)>;
    for (std::size_t i = 0; i < n; ++i) {
      T a, b;
      std::memcpy(&a, acc + i * sizeof(T), sizeof(T));
      std::memcpy(&b, x + i * sizeof(T), sizeof(T));
      a = pick(a, b);
      std::memcpy(acc + i * sizeof(T), &a, sizeof(T));
    }
  };
  if (t == ncclUint32) ints(static_cast<std::uint32_t*>(nullptr));
  else ints(static_cast<std::uint64_t*>(nullptr));
}

bool is_float_type(int t) {
  return t == ncclFloat16 || t == ncclBfloat16 || t == ncclFloat32 || t == ncclFloat64 || t == ncclFloat8e4m3 ||
         t == ncclFloat8e5m2;
}

// out = the reduction over ranks (in rank order, each step rounded to the type) of `n`
// elements starting at element `first` of each input. ncclAvg: floats are each multiplied
// by 1/ranks first, integers summed and then divided, truncating (NCCL's rule).
void reduce(int t, int op, const std::vector<const std::byte*>& in, std::size_t first, std::size_t n, std::byte* out) {
  const std::size_t es = type_size(t);
  const int ranks = static_cast<int>(in.size());
  fsdp::DType dt{};
  const bool known = fsdp_type(t, dt);
  std::vector<std::byte> term(n * es);
  for (int r = 0; r < ranks; ++r) {
    std::byte* dst = r == 0 ? out : term.data();
    std::memcpy(dst, in[static_cast<std::size_t>(r)] + first * es, n * es);
    if (op == ncclAvg && is_float_type(t)) fsdp::detail::host_scale(dst, n, dt, 1.0 / ranks);  // every float type is known
    if (r == 0) continue;
    if (known) fsdp::detail::host_combine(out, term.data(), n, dt, fsdp_op(op));
    else combine_other(t, out, term.data(), n, op);
  }
  if (op == ncclAvg && !is_float_type(t)) {
    if (known) {
      fsdp::detail::finish_avg(out, n, dt, ranks);
    } else {
      for (std::size_t i = 0; i < n; ++i) {
        if (t == ncclUint32) {
          std::uint32_t v;
          std::memcpy(&v, out + i * 4, 4);
          v /= static_cast<std::uint32_t>(ranks);
          std::memcpy(out + i * 4, &v, 4);
        } else {
          std::uint64_t v;
          std::memcpy(&v, out + i * 8, 8);
          v /= static_cast<std::uint64_t>(ranks);
          std::memcpy(out + i * 8, &v, 8);
        }
      }
    }
  }
}

void write_whole(const fs::path& path, const Header& h, const void* bytes) {
  const fs::path tmp = path.parent_path() / (".tmp-" + path.filename().string());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    f.write(reinterpret_cast<const char*>(&h), sizeof h);
    if (h.bytes) f.write(static_cast<const char*>(bytes), static_cast<std::streamsize>(h.bytes));
    if (!f) {
      std::fprintf(stderr, "cuda_emulator (NCCL): cannot write %s\n", tmp.c_str());
      std::abort();
    }
  }
  fs::rename(tmp, path);
}

bool read_whole(const fs::path& path, Header& h, std::vector<std::byte>& bytes) {
  std::ifstream f(path, std::ios::binary);
  if (!f || !f.read(reinterpret_cast<char*>(&h), sizeof h) || h.magic != Header{}.magic) return false;
  bytes.resize(h.bytes);
  return h.bytes == 0 || static_cast<bool>(f.read(reinterpret_cast<char*>(bytes.data()), static_cast<std::streamsize>(h.bytes)));
}

fs::path contribution(const fs::path& dir, std::uint64_t seq, int rank) {
  return dir / ("c" + std::to_string(seq) + "-" + std::to_string(rank));
}

bool all_there(const fs::path& dir, const std::string& prefix, int size) {
  for (int r = 0; r < size; ++r)
    if (!fs::exists(dir / (prefix + std::to_string(r)))) return false;
  return true;
}

struct CommState {
  enum class Phase { splitting, joining, ready, aborted, gone };
  fs::path dir;
  int rank = 0, size = 0, device = 0;
  bool blocking = true;
  Phase phase = Phase::joining;
  std::uint64_t next_seq = 0;
  int in_flight = 0;  // collectives queued and not done
  bool finalizing = false;
  ncclResult_t async_error = ncclSuccess;
  std::string async_text;
  // Collectives this rank has completed (its files may go once every rank has): all
  // below `low`, and those in `done_above`; its own contributions still on disk.
  std::uint64_t low = 0;
  std::set<std::uint64_t> done_above, own_files;
  // A communicator made by ncclCommSplit, until the parent's ranks have all said their color.
  fs::path parent_dir;
  int parent_size = 0, parent_rank = 0;
  std::uint64_t split_seq = 0;
  int color = 0;
  // Splits of this nonblocking communicator not complete yet: the new communicator's state
  // and where ncclCommSplit's caller wants it written once it is.
  struct PendingSplit {
    std::shared_ptr<CommState> child;
    ncclComm_t* out = nullptr;
  };
  std::vector<PendingSplit> pending_splits;
};

std::vector<std::weak_ptr<CommState>>& live_comms() {
  static auto* v = new std::vector<std::weak_ptr<CommState>>;
  return *v;
}

// Blocking communicators created or split by this thread inside an open group.
std::vector<std::weak_ptr<CommState>>& group_made() {
  thread_local std::vector<std::weak_ptr<CommState>> made;
  return made;
}

void track(const std::shared_ptr<CommState>& c) {
  std::erase_if(live_comms(), [](const std::weak_ptr<CommState>& w) { return w.expired(); });
  live_comms().push_back(c);
}

}  // namespace
}  // namespace cuda_emulator::detail

struct ncclComm {
  std::shared_ptr<cuda_emulator::detail::CommState> s;
};

namespace cuda_emulator::detail {
namespace {

ncclResult_t nccl_fail(ncclResult_t r, std::string text) {
  nccl_last_error = "(NCCL emulator) " + std::move(text);
  return r;
}

// Collective `seq` is done on this rank (every rank's part read, or ended by an abort):
// advances `low`, publishes it (low-<rank>), and removes this rank's contributions that
// every rank has done with, so a long run keeps only what is in flight on disk. Not once
// the communicator was aborted: its directory may be gone (the last rank out removes it)
// while a collective queued behind a held stream still ends.
void completed(CommState& c, std::uint64_t seq) {
  c.done_above.insert(seq);
  const std::uint64_t before = c.low;
  while (c.done_above.count(c.low)) c.done_above.erase(c.low++);
  if (c.low == before || c.dir.empty() || c.phase != CommState::Phase::ready) return;
  Header h;
  h.count = c.low;
  write_whole(c.dir / ("low-" + std::to_string(c.rank)), h, nullptr);
  std::uint64_t all = c.low;
  for (int r = 0; r < c.size && all > 0; ++r) {
    Header theirs;
    std::vector<std::byte> none;
    if (!read_whole(c.dir / ("low-" + std::to_string(r)), theirs, none)) return;  // not yet published
    all = std::min<std::uint64_t>(all, theirs.count);
  }
  std::error_code ec;
  while (!c.own_files.empty() && *c.own_files.begin() < all) {
    fs::remove(contribution(c.dir, *c.own_files.begin(), c.rank), ec);
    c.own_files.erase(c.own_files.begin());
  }
}

void join(CommState& c) {
  fs::create_directories(c.dir);
  write_whole(c.dir / ("join-" + std::to_string(c.rank)), Header{}, nullptr);
}

// Moves a communicator that is being made on: a split learns its group once the parent's
// ranks have all said their color; a joining one is ready once its ranks have all joined.
void advance(CommState& c) {
  if (c.phase == CommState::Phase::splitting) {
    std::vector<std::pair<int, int>> members;  // (key, parent rank) of my color
    for (int r = 0; r < c.parent_size; ++r) {
      Header h;
      std::vector<std::byte> bytes;
      if (!read_whole(contribution(c.parent_dir, c.split_seq, r), h, bytes)) return;
      if (h.kind != Kind::split) return;  // a mismatched call: hangs, as NCCL does
      if (h.dtype == c.color) members.emplace_back(h.op, r);
    }
    std::sort(members.begin(), members.end());
    c.size = static_cast<int>(members.size());
    for (int i = 0; i < c.size; ++i)
      if (members[static_cast<std::size_t>(i)].second == c.parent_rank) c.rank = i;
    c.dir = c.parent_dir.string() + "-s" + std::to_string(c.split_seq) + "c" + std::to_string(c.color);
    c.phase = CommState::Phase::joining;
    join(c);
  }
  if (c.phase == CommState::Phase::joining && all_there(c.dir, "join-", c.size)) c.phase = CommState::Phase::ready;
}

// Waits (the runtime's mutex released meanwhile) until `done()`, bounded like the runtime's
// waits. Returns false past the bound.
template <class Done>
bool wait_until(Done done) {
  const auto deadline = std::chrono::steady_clock::now() + hang_bound();
  for (int spins = 0;; ++spins) {
    rt().progress();
    if (done()) return true;
    if (std::chrono::steady_clock::now() > deadline) return false;
    rt().mutex.unlock();
    std::this_thread::sleep_for(std::chrono::microseconds(spins < 100 ? 20 : 500));
    rt().mutex.lock();
  }
}

// The rank leaves: its collectives end unwritten (its streams drain) and the last rank out
// removes the directory.
void leave(CommState& c) {
  if (c.phase == CommState::Phase::gone) return;
  for (auto& p : std::exchange(c.pending_splits, {})) leave(*p.child);  // never written: NCCL's abort ends them
  c.phase = CommState::Phase::aborted;
  rt().progress();
  c.phase = CommState::Phase::gone;
  if (c.dir.empty()) return;  // a split that never learned its group
  std::ofstream(c.dir / ("gone-" + std::to_string(c.rank)));
  std::error_code ec;
  if (all_there(c.dir, "gone-", c.size)) fs::remove_all(c.dir, ec);
}

ncclResult_t check_comm(ncclComm_t comm, const char* call) {
  if (!comm || !comm->s) return nccl_fail(ncclInvalidArgument, std::string(call) + ": null communicator");
  CommState& c = *comm->s;
  advance(c);
  if (c.phase == CommState::Phase::aborted || c.phase == CommState::Phase::gone)
    return nccl_fail(ncclInvalidUsage, std::string(call) + ": the communicator was aborted or destroyed");
  if (c.phase != CommState::Phase::ready)
    return nccl_fail(ncclInvalidUsage, std::string(call) + ": the communicator is not initialized yet (ncclInProgress)");
  return ncclSuccess;
}

ncclResult_t collective(Call call, Kind kind, const void* send, void* recv, std::size_t count, ncclDataType_t type,
                        int op, int root, ncclComm_t comm, cudaStream_t stream) {
  Entry entry(call);
  const char* name = kind_name(kind);
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, std::string(name) + ": injected by cuda_emulator::fail_next");
  if (ncclResult_t r = check_comm(comm, name); r != ncclSuccess) return r;
  const std::shared_ptr<CommState> c = comm->s;
  const std::size_t es = type_size(type);
  if (es == 0) return nccl_fail(ncclInvalidArgument, std::string(name) + ": unknown datatype " + std::to_string(type));
  if (kind == Kind::reduce_scatter || kind == Kind::all_reduce) {
    if (op < ncclSum || op > ncclAvg) return nccl_fail(ncclInvalidArgument, std::string(name) + ": unknown reduction");
    if (op == ncclProd) return nccl_fail(ncclInvalidArgument, std::string(name) + ": ncclProd is not emulated");
  }
  if (kind == Kind::broadcast && (root < 0 || root >= c->size))
    return nccl_fail(ncclInvalidArgument, std::string(name) + ": root " + std::to_string(root) + " is not a rank");
  Stream* s = rt().resolve(stream, current_device);
  if (!s) return nccl_fail(ncclInvalidArgument, std::string(name) + ": unknown stream");
  if (s->device != c->device)
    return nccl_fail(ncclInvalidUsage, std::string(name) + ": a stream of cuda:" + std::to_string(s->device) +
                                           " for a communicator on cuda:" + std::to_string(c->device));
  if (s->capture) {  // queued again at each launch of the graph, through this entry point
    const cudaError_t e = capture_op(entry, *s, name, [=](cudaStream_t on) {
      ncclResult_t r = ncclSuccess;
      switch (kind) {
        case Kind::all_gather: r = ncclAllGather(send, recv, count, type, comm, on); break;
        case Kind::reduce_scatter: r = ncclReduceScatter(send, recv, count, type, static_cast<ncclRedOp_t>(op), comm, on); break;
        case Kind::all_reduce: r = ncclAllReduce(send, recv, count, type, static_cast<ncclRedOp_t>(op), comm, on); break;
        case Kind::broadcast: r = ncclBroadcast(send, recv, count, type, root, comm, on); break;
        case Kind::split: break;
      }
      if (r == ncclSuccess) return cudaSuccess;
      detail_code = last_error = cudaErrorUnknown;  // NCCL's words, for cudaGraphLaunch's error
      last_detail = nccl_last_error;
      return cudaErrorUnknown;
    });
    return e == cudaSuccess ? ncclSuccess : nccl_fail(ncclInvalidUsage, last_detail);
  }
  const std::size_t n = count, world = static_cast<std::size_t>(c->size);
  const std::size_t in_bytes = (kind == Kind::reduce_scatter ? n * world : n) * es;
  const std::size_t out_bytes = (kind == Kind::all_gather ? n * world : n) * es;
  const bool sends = kind != Kind::broadcast || root == c->rank;
  const std::uint64_t t = rt().queue_op(*s);  // its point on the stream (nothing runs if it is refused)
  std::string error;
  if ((sends && !rt().check_access(*s, t, send, in_bytes, false, true, name, error)) ||
      !rt().check_access(*s, t, recv, out_bytes, true, true, name, error))
    return nccl_fail(ncclInvalidArgument, error);
  const std::uint64_t seq = c->next_seq++;
  ++c->in_flight;
  Header h;
  h.kind = kind;
  h.dtype = type;
  h.op = op;
  h.root = root;
  h.count = n;
  h.bytes = sends ? in_bytes : 0;
  const std::string what = std::string(name) + " #" + std::to_string(seq) + " of rank " + std::to_string(c->rank) +
                           " of " + std::to_string(c->size);
  rt().add_pending(*s, t, what, [c, h, send, recv, seq, posted = false](Pending& p) mutable {
    auto finish = [&] {
      p.done = true;
      --c->in_flight;
      completed(*c, seq);
    };
    if (c->phase != CommState::Phase::ready) return finish();  // aborted or destroyed: nothing written
    if (!posted) {  // everything before it on its stream has completed: its send bytes are final
      write_whole(contribution(c->dir, seq, c->rank), h, send);
      c->own_files.insert(seq);
      posted = true;
    }
    if (!all_there(c->dir, "c" + std::to_string(seq) + "-", c->size)) return;
    std::vector<std::vector<std::byte>> parts(static_cast<std::size_t>(c->size));
    std::vector<const std::byte*> in;
    for (int r = 0; r < c->size; ++r) {
      Header theirs;
      if (!read_whole(contribution(c->dir, seq, r), theirs, parts[static_cast<std::size_t>(r)])) return;
      if (theirs.kind != h.kind || theirs.dtype != h.dtype || theirs.op != h.op || theirs.root != h.root ||
          theirs.count != h.count)
        return;  // ranks called different collectives: NCCL may hang or corrupt; here it hangs
      in.push_back(parts[static_cast<std::size_t>(r)].data());
    }
    // Written even when a free queued after it has run (its bookkeeping runs when queued):
    // the runtime keeps freed memory while anything is pending, so it is still there.
    auto* out = static_cast<std::byte*>(recv);
    const std::size_t es = type_size(h.dtype), cnt = h.count;
    switch (h.kind) {
      case Kind::all_gather:
        for (std::size_t r = 0; r < in.size(); ++r) std::memcpy(out + r * cnt * es, in[r], cnt * es);
        break;
      case Kind::broadcast:
        std::memcpy(out, in[static_cast<std::size_t>(h.root)], cnt * es);
        break;
      case Kind::all_reduce:
        reduce(h.dtype, h.op, in, 0, cnt, out);
        break;
      case Kind::reduce_scatter:
        reduce(h.dtype, h.op, in, static_cast<std::size_t>(c->rank) * cnt, cnt, out);
        break;
      case Kind::split:  // not queued here: ncclCommSplit writes its header itself
        break;
    }
    finish();
  });
  return ncclSuccess;
}

// ncclCommCount, ncclCommUserRank, ncclCommCuDevice: one field of the communicator.
ncclResult_t comm_field(Call call, const char* name, ncclComm_t comm, int* out, int CommState::*field) {
  Entry entry(call);
  if (entry.injected() != cudaSuccess) return nccl_fail(ncclSystemError, std::string(name) + ": injected by cuda_emulator::fail_next");
  if (!comm || !comm->s || !out) return nccl_fail(ncclInvalidArgument, std::string(name) + ": null argument");
  *out = (*comm->s).*field;
  return ncclSuccess;
}

// The end of ncclCommInitRankConfig and ncclCommSplit once the communicator is made: ready,
// in progress (nonblocking), left to ncclGroupEnd, or waited for here.
ncclResult_t finish_creation(const std::shared_ptr<CommState>& c, const char* call, const char* others) {
  advance(*c);
  if (c->phase == CommState::Phase::ready) return ncclSuccess;
  if (!c->blocking) return ncclInProgress;
  if (group_depth > 0) {  // ncclGroupEnd waits
    group_made().push_back(c);
    return ncclSuccess;
  }
  if (!wait_until([&] { return advance(*c), c->phase == CommState::Phase::ready; }))
    return nccl_fail(ncclSystemError, std::string(call) + ": the other ranks did not " + others +
                                          " within FSDP_CUDA_EMULATOR_HANG_S");
  return ncclSuccess;
}

}  // namespace
}  // namespace cuda_emulator::detail

namespace cuda_emulator {
void nccl_fail_async(int result, std::string_view text) {
  std::lock_guard lock(detail::rt().mutex);
  for (auto& w : detail::live_comms())
    if (auto c = w.lock()) {
      c->async_error = static_cast<ncclResult_t>(result);
      c->async_text = std::string(text);
    }
}
}  // namespace cuda_emulator

using namespace cuda_emulator;          // NOLINT: the entry points below are the C API
using namespace cuda_emulator::detail;  // NOLINT

extern "C" {

const char* ncclGetErrorString(ncclResult_t r) {
  switch (r) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t) { return nccl_last_error.c_str(); }

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  Entry entry(Call::ncclGetUniqueId);
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, "ncclGetUniqueId: injected by cuda_emulator::fail_next");
  if (!id) return nccl_fail(ncclInvalidArgument, "ncclGetUniqueId: null id");
  // Short and the same for every process of the job (a test's TMPDIR may be too long for
  // the id's 128 bytes): memory-backed where there is /dev/shm.
  const char* base = access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp";
  // What jobs killed before their last rank left behind: removed a day later (a live job's
  // directory changes with every collective).
  std::error_code ec;
  for (const auto& entry_ : fs::directory_iterator(base, ec)) {
    const std::string name = entry_.path().filename().string();
    if (name.rfind("fsdp-nccl-emu-", 0) != 0) continue;
    const auto age = fs::file_time_type::clock::now() - fs::last_write_time(entry_.path(), ec);
    if (!ec && age > std::chrono::hours(24)) fs::remove_all(entry_.path(), ec);
  }
  std::string pattern = std::string(base) + "/fsdp-nccl-emu-XXXXXX";
  if (!mkdtemp(pattern.data())) return nccl_fail(ncclSystemError, "ncclGetUniqueId: mkdtemp in " + std::string(base));
  const std::string text = kIdMagic + pattern;
  if (text.size() >= sizeof id->internal) return nccl_fail(ncclSystemError, "ncclGetUniqueId: the directory's path is too long");
  std::memset(id->internal, 0, sizeof id->internal);
  std::memcpy(id->internal, text.data(), text.size());
  return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
  Entry entry(Call::ncclCommInitRankConfig);
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, "ncclCommInitRankConfig: injected by cuda_emulator::fail_next");
  if (!comm) return nccl_fail(ncclInvalidArgument, "ncclCommInitRankConfig: null result pointer");
  *comm = nullptr;
  if (nranks < 1 || rank < 0 || rank >= nranks)
    return nccl_fail(ncclInvalidArgument, "ncclCommInitRankConfig: rank " + std::to_string(rank) + " of " + std::to_string(nranks));
  const std::string text(id.internal, strnlen(id.internal, sizeof id.internal));
  if (text.rfind(kIdMagic, 0) != 0)
    return nccl_fail(ncclInvalidArgument, "ncclCommInitRankConfig: not a unique id of the emulated NCCL");
  if (!valid_device(current_device)) return nccl_fail(ncclUnhandledCudaError, "ncclCommInitRankConfig: no current device");
  auto c = std::make_shared<CommState>();
  c->dir = text.substr(sizeof kIdMagic - 1);
  c->rank = rank;
  c->size = nranks;
  c->device = current_device;
  c->blocking = !config || config->blocking != 0;  // NCCL_CONFIG_UNDEF_INT (unset) is blocking
  join(*c);
  track(c);
  *comm = new ncclComm{c};
  return finish_creation(c, "ncclCommInitRankConfig", "join");
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
  Entry entry(Call::ncclCommSplit);
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, "ncclCommSplit: injected by cuda_emulator::fail_next");
  if (ncclResult_t r = check_comm(comm, "ncclCommSplit"); r != ncclSuccess) return r;
  if (!newcomm) return nccl_fail(ncclInvalidArgument, "ncclCommSplit: null result pointer");
  *newcomm = nullptr;
  if (color < 0 && color != NCCL_SPLIT_NOCOLOR) return nccl_fail(ncclInvalidArgument, "ncclCommSplit: negative color");
  CommState& parent = *comm->s;
  const std::uint64_t seq = parent.next_seq++;
  Header h;
  h.kind = Kind::split;
  h.dtype = color;
  h.op = key;
  write_whole(contribution(parent.dir, seq, parent.rank), h, nullptr);  // kept: a peer may read it late
  completed(parent, seq);
  if (color == NCCL_SPLIT_NOCOLOR) return ncclSuccess;
  auto c = std::make_shared<CommState>();
  c->phase = CommState::Phase::splitting;
  c->parent_dir = parent.dir;
  c->parent_size = parent.size;
  c->parent_rank = parent.rank;
  c->split_seq = seq;
  c->color = color;
  c->device = parent.device;
  // Unset (NCCL_CONFIG_UNDEF_INT), the parent's blocking mode, as NCCL does.
  c->blocking = config && config->blocking != NCCL_CONFIG_UNDEF_INT ? config->blocking != 0 : parent.blocking;
  track(c);
  if (!parent.blocking) {  // written when complete; the parent's ncclCommGetAsyncError says when
    advance(*c);
    parent.pending_splits.push_back({c, newcomm});
    return ncclInProgress;
  }
  *newcomm = new ncclComm{c};
  return finish_creation(c, "ncclCommSplit", "split");
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* state) {
  Entry entry(Call::ncclCommGetAsyncError);
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, "ncclCommGetAsyncError: injected by cuda_emulator::fail_next");
  if (!comm || !comm->s || !state) return nccl_fail(ncclInvalidArgument, "ncclCommGetAsyncError: null argument");
  CommState& c = *comm->s;
  rt().progress();
  advance(c);
  std::erase_if(c.pending_splits, [](CommState::PendingSplit& p) {
    advance(*p.child);
    if (p.child->phase != CommState::Phase::ready) return false;
    *p.out = new ncclComm{p.child};
    return true;
  });
  if (c.async_error != ncclSuccess) {
    nccl_last_error = "(NCCL emulator) " + c.async_text;
    *state = c.async_error;
  } else if (c.phase == CommState::Phase::splitting || c.phase == CommState::Phase::joining ||
             !c.pending_splits.empty() || (c.finalizing && c.in_flight > 0)) {
    *state = ncclInProgress;
  } else {
    *state = ncclSuccess;
  }
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  return comm_field(Call::ncclCommCount, "ncclCommCount", comm, count, &CommState::size);
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  return comm_field(Call::ncclCommUserRank, "ncclCommUserRank", comm, rank, &CommState::rank);
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  return comm_field(Call::ncclCommCuDevice, "ncclCommCuDevice", comm, device, &CommState::device);
}

ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  Entry entry(Call::ncclCommFinalize);
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, "ncclCommFinalize: injected by cuda_emulator::fail_next");
  if (ncclResult_t r = check_comm(comm, "ncclCommFinalize"); r != ncclSuccess) return r;
  CommState& c = *comm->s;
  c.finalizing = true;
  rt().progress();
  if (c.in_flight == 0) return ncclSuccess;
  if (!c.blocking) return ncclInProgress;
  if (!wait_until([&] { return c.in_flight == 0; }))
    return nccl_fail(ncclSystemError, "ncclCommFinalize: its collectives did not complete within FSDP_CUDA_EMULATOR_HANG_S");
  return ncclSuccess;
}

// A destroy first lets the communicator's collectives complete, as NCCL's does (bounded:
// one that cannot is reported as a hang and ended); an abort ends them unwritten. Both
// leave its directory.
ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  Entry entry(Call::ncclCommDestroy);
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, "ncclCommDestroy: injected by cuda_emulator::fail_next");
  if (!comm) return ncclSuccess;
  if (comm->s) {
    CommState& c = *comm->s;
    if (c.phase == CommState::Phase::ready && c.in_flight > 0 && !wait_until([&] { return c.in_flight == 0; }))
      rt().violation("hang: ncclCommDestroy waited " + std::to_string(hang_bound().count()) +
                     " s (FSDP_CUDA_EMULATOR_HANG_S) for the communicator's collectives to complete");
    leave(c);
  }
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  Entry entry(Call::ncclCommAbort);
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, "ncclCommAbort: injected by cuda_emulator::fail_next");
  if (!comm) return ncclSuccess;
  if (comm->s) leave(*comm->s);
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclGroupStart() {
  Entry entry(Call::ncclGroupStart);
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, "ncclGroupStart: injected by cuda_emulator::fail_next");
  ++group_depth;
  return ncclSuccess;
}

// Collectives are queued when called (their data moves once every rank's are there), so a
// group's end only waits, for a blocking communicator created inside it, for its ranks.
ncclResult_t ncclGroupEnd() {
  Entry entry(Call::ncclGroupEnd);
  if (group_depth == 0) return nccl_fail(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  --group_depth;  // even when it fails: the group is over
  if (entry.injected() != cudaSuccess)
    return nccl_fail(ncclSystemError, "ncclGroupEnd: injected by cuda_emulator::fail_next");
  if (group_depth > 0) return ncclSuccess;
  // Blocking communicators this thread created or split inside the group: made now.
  std::vector<std::weak_ptr<CommState>> made = std::exchange(group_made(), {});
  const bool ok = wait_until([&] {
    for (auto& w : made)
      if (auto c = w.lock()) {
        advance(*c);
        if (c->phase == CommState::Phase::joining || c->phase == CommState::Phase::splitting) return false;
      }
    return true;
  });
  return ok ? ncclSuccess : nccl_fail(ncclSystemError, "ncclGroupEnd: the other ranks did not join within FSDP_CUDA_EMULATOR_HANG_S");
}

ncclResult_t ncclAllGather(const void* send, void* recv, size_t count, ncclDataType_t type, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective(Call::ncclAllGather, Kind::all_gather, send, recv, count, type, 0, 0, comm, stream);
}

ncclResult_t ncclReduceScatter(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                               ncclComm_t comm, cudaStream_t stream) {
  return collective(Call::ncclReduceScatter, Kind::reduce_scatter, send, recv, count, type, op, 0, comm, stream);
}

ncclResult_t ncclAllReduce(const void* send, void* recv, size_t count, ncclDataType_t type, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
  return collective(Call::ncclAllReduce, Kind::all_reduce, send, recv, count, type, op, 0, comm, stream);
}

ncclResult_t ncclBroadcast(const void* send, void* recv, size_t count, ncclDataType_t type, int root, ncclComm_t comm,
                           cudaStream_t stream) {
  return collective(Call::ncclBroadcast, Kind::broadcast, send, recv, count, type, 0, root, comm, stream);
}

}  // extern "C"
