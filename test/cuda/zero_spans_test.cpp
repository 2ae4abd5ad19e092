// fsdp/cuda/zero_spans.hpp: the table CudaDevice::fill_zero_batch launches with, and the
// kernel's per-block code itself (the same text NVRTC compiles), run here on the CPU for
// every block and thread, so its indexing is checked on machines without a GPU: every byte
// of every span zeroed, and not one byte outside them.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

#include "fsdp/cuda/zero_spans.hpp"

namespace cuda_zero_spans_test {

namespace {

using fsdp::ZeroSpan;
using fsdp::detail::ZeroSpans;

// What the GPU runs for one launch of fsdp_zero_spans on a grid of at most `max_grid`
// blocks (CudaDevice caps it at 32 per SM; beyond, each block loops over the table's
// blocks): each grid block, each of `threads` threads (they share nothing, so one after
// another gives the same bytes).
void run_on_cpu(const ZeroSpans& table, unsigned threads, unsigned long long max_grid) {
  const unsigned long long grid = std::min<unsigned long long>(table.first_block[table.count], max_grid);
  for (unsigned long long g = 0; g < grid; ++g)
    for (unsigned t = 0; t < threads; ++t) fsdp::detail::zero_spans_blocks(table, g, grid, t, threads);
}

// As CudaDevice::fill_zero_batch: tables of up to 128 spans until all are taken.
int zero_all(std::vector<ZeroSpan> spans, std::size_t chunk, unsigned threads, unsigned long long max_grid) {
  int launches = 0;
  std::span<const ZeroSpan> rest(spans);
  ZeroSpans table;
  while (!rest.empty()) {
    rest = rest.subspan(fsdp::detail::fill_zero_spans_table(rest, table, chunk));
    if (table.count == 0) continue;
    run_on_cpu(table, threads, max_grid);
    ++launches;
  }
  return launches;
}

}  // namespace

TEST_CASE("the table: blocks per span, empty spans skipped, at most 128 spans a launch") {
  std::vector<unsigned char> buf(1000);
  const std::vector<ZeroSpan> spans{{buf.data(), 100}, {buf.data() + 100, 0}, {buf.data() + 200, 64}, {buf.data() + 300, 65}};
  ZeroSpans table;
  CHECK(fsdp::detail::fill_zero_spans_table(spans, table, 64) == 4);
  REQUIRE(table.count == 3);
  CHECK(table.chunk == 64);
  CHECK(table.first_block[0] == 0);
  CHECK(table.first_block[1] == 2);  // 100 bytes: 64 + 36
  CHECK(table.first_block[2] == 3);  // 64: one block
  CHECK(table.first_block[3] == 5);  // 65: 64 + 1
  CHECK(table.data[1] == buf.data() + 200);
  CHECK(table.bytes[2] == 65);

  std::vector<ZeroSpan> many(300, ZeroSpan{buf.data(), 1});
  CHECK(fsdp::detail::fill_zero_spans_table(many, table) == 128);
  CHECK(table.count == 128);
  CHECK(table.first_block[128] == 128);
  many.resize(128);
  many.resize(140, ZeroSpan{buf.data(), 0});  // 128 that fit, then only empty ones: all taken
  CHECK(fsdp::detail::fill_zero_spans_table(many, table) == 140);
  CHECK(table.count == 128);
  std::vector<ZeroSpan> empty(5, ZeroSpan{buf.data(), 0});
  CHECK(fsdp::detail::fill_zero_spans_table(empty, table) == 5);  // all taken, nothing to launch
  CHECK(table.count == 0);
}

TEST_CASE("the kernel's block code zeroes every span exactly: odd sizes and alignments, several launches") {
  std::mt19937 rng(11);
  for (const std::size_t chunk : {std::size_t{64}, std::size_t{4096}, fsdp::detail::zero_spans_chunk}) {
    for (const auto& launch : {std::pair{256u, ~0ull}, std::pair{7u, 3ull}, std::pair{1u, ~0ull}}) {
      const unsigned threads = launch.first;  // not bound: CAPTURE captures them
      const unsigned long long max_grid = launch.second;
      CAPTURE(chunk);
      CAPTURE(threads);
      CAPTURE(max_grid);  // 3: a grid-stride loop over many blocks per grid block
      // Spans of awkward sizes around the chunk and 16-byte boundaries, at random offsets,
      // with gaps between them that must keep their bytes.
      std::vector<std::size_t> sizes{1, 15, 16, 17, 31, 33, chunk - 1, chunk, chunk + 1, 3 * chunk + 5};
      for (int i = 0; i < 290; ++i) sizes.push_back(1 + rng() % 300);  // over two launches of 128
      std::size_t total = 0;
      for (auto n : sizes) total += n + 40;
      std::vector<unsigned char> buf(total + 64, 0xAB);
      std::vector<char> inside(buf.size(), 0);
      std::vector<ZeroSpan> spans;
      std::size_t at = 3;
      for (auto n : sizes) {
        at += rng() % 23;  // misaligned starts
        spans.push_back({buf.data() + at, n});
        for (std::size_t k = at; k < at + n; ++k) inside[k] = 1;
        at += n + 1 + rng() % 9;
      }
      REQUIRE(at <= buf.size());
      spans.push_back({buf.data() + at, 0});  // empty: not a span of the table
      CHECK(zero_all(spans, chunk, threads, max_grid) == 3);
      std::size_t wrong = 0;
      for (std::size_t k = 0; k < buf.size(); ++k) wrong += buf[k] != (inside[k] ? 0 : 0xAB);
      CHECK(wrong == 0);
    }
  }
}

}  // namespace cuda_zero_spans_test
