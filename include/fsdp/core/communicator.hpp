#pragma once
// The Communicator concept: a process group with NCCL-shaped asynchronous collectives.
// Counts are elements; all_gather's and reduce_scatter's `count` is the per-rank chunk
// (NCCL's sendcount / recvcount). In-place calls follow NCCL: all_gather with
// send == recv + rank*count, reduce_scatter with recv == send + rank*count.
#include <concepts>
#include <cstddef>
#include <string_view>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/work.hpp"

namespace fsdp {

enum class ReduceOp : std::uint8_t { sum, avg, max, min };

constexpr std::string_view name_of(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return "sum";
    case ReduceOp::avg: return "avg";
    case ReduceOp::max: return "max";
    case ReduceOp::min: return "min";
  }
  return "?";
}

template <class C>
concept Communicator = requires(C& c, const void* send, void* recv, std::size_t count, DType t,
                                ReduceOp op, int root) {
  { c.rank() } -> std::convertible_to<int>;
  { c.size() } -> std::convertible_to<int>;
  { c.all_gather(send, recv, count, t) } -> std::convertible_to<Work>;
  { c.reduce_scatter(send, recv, count, t, op) } -> std::convertible_to<Work>;
  { c.all_reduce(send, recv, count, t, op) } -> std::convertible_to<Work>;
  { c.broadcast(send, recv, count, t, root) } -> std::convertible_to<Work>;
  { c.barrier() } -> std::convertible_to<Work>;
};

// An optional collective, for what needs one peer, not all of them: each rank sends `count`
// elements to rank + 1 and receives rank - 1's (mod size), with separate buffers; on one
// rank it copies. Every link carries one chunk, so a copy of every rank's state on its
// neighbour costs one state per link (an all_gather would cost size - 1 of them), and
// holds one. fsdp::PeerCheckpoint uses it; ThreadComm, TcpComm and MpiComm have it.
template <class C>
concept RingShiftCommunicator = Communicator<C> && requires(C& c, const void* send, void* recv, std::size_t count, DType t) {
  { c.ring_shift(send, recv, count, t) } -> std::convertible_to<Work>;
};

// Readable failure for a type that does not fit, used at the library's entry points.
template <class C>
constexpr void check_communicator() {
  static_assert(Communicator<C>,
                "fsdp: this type is not an fsdp::Communicator. It needs rank(), size(), and "
                "all_gather(send, recv, count, dtype), reduce_scatter(send, recv, count, dtype, op), "
                "all_reduce(send, recv, count, dtype, op), broadcast(send, recv, count, dtype, root), "
                "barrier(), each returning fsdp::Work. See docs/concepts.md#communicator.");
}

}  // namespace fsdp
