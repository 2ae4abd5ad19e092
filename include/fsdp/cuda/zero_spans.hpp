#pragma once
// Zeroing many buffers with one kernel launch (CudaDevice::fill_zero_batch): ShardedModel's
// zero_grad zeroes every unit's sharded gradients with one launch instead of one
// cudaMemsetAsync per unit, each a few microseconds of host time.
//
// The kernel's table and per-block code are written once, in FSDP_ZERO_SPANS_CODE below:
// compiled here as plain C++ (the host builds the table with the same struct, and
// test/cuda/zero_spans_test.cpp runs the block code for every block and thread on the
// CPU, so its indexing is tested where there is no GPU) and, as text, by NVRTC into the
// kernel (fsdp/cuda/cuda_kernels.hpp). No preprocessor lines may appear inside it.
#include <algorithm>
#include <cstddef>
#include <span>
#include <string_view>

#include "fsdp/core/device.hpp"

// Host: plain inline functions. NVRTC's program defines FSDP_ZERO_SPANS_FN itself.
#define FSDP_ZERO_SPANS_FN inline
#define FSDP_ZERO_SPANS_TEXT(...)            \
  __VA_ARGS__                                \
  inline constexpr std::string_view zero_spans_source = #__VA_ARGS__;

namespace fsdp::detail {

FSDP_ZERO_SPANS_TEXT(
    // Up to 128 spans per launch: the table is a kernel argument (3,096 bytes, below the
    // 4 KiB every CUDA version takes). Span i is zeroed by blocks first_block[i] to
    // first_block[i + 1] - 1, `chunk` bytes each (the last one the rest).
    struct ZeroSpans {
      unsigned long long count;
      unsigned long long chunk;
      unsigned long long first_block[129];
      unsigned char* data[128];
      unsigned long long bytes[128];
    };

    struct alignas(16) ZeroQuad { unsigned long long lo, hi; };

    // Thread t of `threads` zeroes its part of block b: bytes up to the first 16-byte
    // boundary one by one, then 16 at a time, then the tail. Threads share nothing, so
    // running them one after another (the CPU test) computes what the GPU does.
    FSDP_ZERO_SPANS_FN void zero_spans_block(const ZeroSpans& s, unsigned long long b, unsigned t, unsigned threads) {
      unsigned long long lo = 0, hi = s.count - 1;
      while (lo < hi) {  // the last span whose first block is at or before b
        const unsigned long long mid = (lo + hi + 1) / 2;
        if (s.first_block[mid] <= b) lo = mid;
        else hi = mid - 1;
      }
      unsigned char* p = s.data[lo];
      const unsigned long long begin = (b - s.first_block[lo]) * s.chunk;
      const unsigned long long left = s.bytes[lo] - begin;
      const unsigned long long end = begin + (left < s.chunk ? left : s.chunk);
      const unsigned long long misaligned = (unsigned long long)(p + begin) & 15ull;
      unsigned long long body = begin + (misaligned ? 16 - misaligned : 0);
      if (body > end) body = end;
      const unsigned long long quads = (end - body) / 16;
      for (unsigned long long i = begin + t; i < body; i += threads) p[i] = 0;
      ZeroQuad* q = (ZeroQuad*)(p + body);
      for (unsigned long long i = t; i < quads; i += threads) q[i] = ZeroQuad{0, 0};
      for (unsigned long long i = body + quads * 16 + t; i < end; i += threads) p[i] = 0;
    }

    // A grid of `stride` blocks covers all of the table's: block `first` takes blocks
    // first, first + stride, ... (a grid-stride loop; the kernels pass their block index).
    FSDP_ZERO_SPANS_FN void zero_spans_blocks(const ZeroSpans& s, unsigned long long first, unsigned long long stride,
                                              unsigned t, unsigned threads) {
      for (unsigned long long b = first; b < s.first_block[s.count]; b += stride) zero_spans_block(s, b, t, threads);
    })

inline constexpr std::size_t zero_spans_capacity = 128;
inline constexpr std::size_t zero_spans_chunk = 32 * 1024;  // bytes per block: 8 stores of 16 per thread of 256
static_assert(sizeof(ZeroSpans) == 3096 && std::size(ZeroSpans{}.data) == zero_spans_capacity);

// Fills `table` with the first spans of `spans` that fit (empty ones skipped, also after
// the last that fits); returns how many of `spans` it took: all of them when the table
// holds every non-empty one. table.first_block[table.count] is the launch's block count.
inline std::size_t fill_zero_spans_table(std::span<const ZeroSpan> spans, ZeroSpans& table,
                                         std::size_t chunk = zero_spans_chunk) {
  table.count = 0;
  table.chunk = chunk;
  table.first_block[0] = 0;
  std::size_t taken = 0;
  for (; taken < spans.size(); ++taken) {
    const ZeroSpan& s = spans[taken];
    if (s.bytes == 0) continue;
    if (table.count == zero_spans_capacity) break;
    const auto i = table.count++;
    table.data[i] = static_cast<unsigned char*>(s.data);
    table.bytes[i] = s.bytes;
    table.first_block[i + 1] = table.first_block[i] + (s.bytes + chunk - 1) / chunk;
  }
  return taken;
}

}  // namespace fsdp::detail

#undef FSDP_ZERO_SPANS_TEXT
#undef FSDP_ZERO_SPANS_FN
