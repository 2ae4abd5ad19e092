#pragma once
// Expected results of TcpComm's collectives, computed directly from every rank's input in
// the order fsdp/asio/ring.hpp documents: the partial for chunk c starts at rank c+1 and
// each rank on the way combines `partial (op) own`; avg finishes the sum once. The element
// arithmetic (fsdp::detail::host_combine / finish_avg) is tested in thread_group_test; the
// order is what these references pin down.
#include <cstddef>
#include <cstring>
#include <vector>

#include "fsdp/core/detail/collective_call.hpp"

namespace test_support {

using Bytes = std::vector<std::byte>;

// Chunk c of a reduction over `count` elements: [offset, offset + length) in elements.
struct ChunkSpan {
  std::size_t offset, length;
};
inline ChunkSpan reduce_scatter_chunk(std::size_t count, int c) { return {c * count, count}; }
inline ChunkSpan all_reduce_chunk(std::size_t count, int n, int c) {
  const std::size_t q = count / n, extra = count % n;
  const std::size_t uc = static_cast<std::size_t>(c);
  return {uc * q + std::min(uc, extra), q + (uc < extra ? 1 : 0)};
}

// inputs[r] is rank r's send buffer; writes the reduction of `span` (elements) of every
// input in ring order for chunk c into out.
inline void ring_reduce_chunk(const std::vector<Bytes>& inputs, ChunkSpan span, int c, fsdp::DType t, fsdp::ReduceOp op,
                              std::byte* out) {
  const int n = static_cast<int>(inputs.size());
  const std::size_t es = fsdp::size_of(t), bytes = span.length * es;
  if (bytes == 0) return;
  const auto sum_op = op == fsdp::ReduceOp::avg ? fsdp::ReduceOp::sum : op;
  Bytes acc(inputs[(c + 1) % n].begin() + span.offset * es, inputs[(c + 1) % n].begin() + span.offset * es + bytes);
  for (int k = 2; k <= n; ++k)
    fsdp::detail::host_combine(acc.data(), inputs[(c + k) % n].data() + span.offset * es, span.length, t, sum_op);
  if (op == fsdp::ReduceOp::avg) fsdp::detail::finish_avg(acc.data(), span.length, t, n);
  std::memcpy(out, acc.data(), bytes);
}

// Rank r's expected recv buffer for `kind` with per-rank inputs.
inline Bytes ring_expected(fsdp::detail::CollectiveKind kind, const std::vector<Bytes>& inputs, int rank, std::size_t count,
                           fsdp::DType t, fsdp::ReduceOp op, int root) {
  using K = fsdp::detail::CollectiveKind;
  const int n = static_cast<int>(inputs.size());
  const std::size_t es = fsdp::size_of(t);
  switch (kind) {
    case K::all_gather: {
      Bytes out;
      for (const auto& in : inputs) out.insert(out.end(), in.begin(), in.begin() + count * es);
      return out;
    }
    case K::reduce_scatter: {
      Bytes out(count * es);
      ChunkSpan span = reduce_scatter_chunk(count, rank);
      ring_reduce_chunk(inputs, span, rank, t, op, out.data());
      return out;
    }
    case K::all_reduce: {
      Bytes out(count * es);
      for (int c = 0; c < n; ++c) {
        const ChunkSpan span = all_reduce_chunk(count, n, c);
        ring_reduce_chunk(inputs, span, c, t, op, out.data() + span.offset * es);
      }
      return out;
    }
    case K::broadcast:
      return Bytes(inputs[root].begin(), inputs[root].begin() + count * es);
    case K::barrier:
      return {};
    case K::ring_shift: {  // the left neighbour's buffer
      const Bytes& left = inputs[(rank + n - 1) % n];
      return Bytes(left.begin(), left.begin() + count * es);
    }
  }
  return {};
}

}  // namespace test_support
