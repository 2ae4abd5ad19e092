// CudaDevice's kernels on the CPU: fsdp::HostDevice's arithmetic (which the GPU kernels
// match bit for bit, docs/cuda.md) and the zero-spans block code itself, over the grid the
// launch asked for, so a grid too small to cover the work leaves it undone here as on a GPU.
#include "tools/cuda_emulator/kernels.hpp"

#include <algorithm>
#include <iterator>

#include "fsdp/cuda/zero_spans.hpp"
#include "fsdp/core/detail/host_math.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/quantize.hpp"

namespace cuda_emulator::detail {

namespace {

using u64 = unsigned long long;
using fsdp::DType;
using fsdp::detail::ZeroSpans;

std::size_t bytes_of(u64 n, int t) { return static_cast<std::size_t>(n) * fsdp::size_of(static_cast<DType>(t)); }

// Elements [i, i + block) are block (i / block) % blocks's in a grid-stride loop over
// `blocks` blocks; only blocks below `present` exist.
template <class F>
void for_each_present_chunk(u64 n, unsigned block, u64 blocks, u64 present, F&& f) {
  for (u64 c = 0; c * block < n; ++c)
    if (c % blocks < present) f(c * block, std::min<u64>(block, n - c * block));
}

void cast_part(void* dst, int to, const void* src, int from, u64 n, unsigned block, u64 blocks, u64 present) {
  const std::size_t out = fsdp::size_of(static_cast<DType>(to)), in = fsdp::size_of(static_cast<DType>(from));
  for_each_present_chunk(n, block, blocks, present, [&](u64 first, u64 count) {
    fsdp::detail::host_cast(static_cast<char*>(dst) + first * out, static_cast<DType>(to),
                            static_cast<const char*>(src) + first * in, static_cast<DType>(from), count);
  });
}

void zero_part(const ZeroSpans& z, u64 grid, unsigned threads) {
  for (u64 g = 0; g < grid; ++g)
    for (unsigned t = 0; t < threads; ++t) fsdp::detail::zero_spans_blocks(z, g, grid, t, threads);
}

void span_ranges(const ZeroSpans& z, std::vector<Range>& out) {
  for (u64 i = 0; i < z.count && i < fsdp::detail::zero_spans_capacity; ++i) out.push_back({z.data[i], z.bytes[i], true});
}

// fsdp_quantize and fsdp_dequantize: the host's block quantization (fsdp/core/quantize.hpp)
// as a device does it: a block holding an inf or NaN is written as a NaN block and the
// lowest such index goes to *first_bad, as the GPU kernel does.
void quantize_run(const KernelArgs& a) {
  const auto format = static_cast<fsdp::QuantFormat>(a.get<int>(4));
  const auto bad = fsdp::detail::quantize_poisoning_nonfinite(format, a.get<const float*>(2), a.get<u64>(3),
                                                             a.get<void*>(0), a.get<void*>(1), a.get<u64>(5));
  auto* first_bad = a.get<u64*>(6);
  if (bad) *first_bad = std::min<u64>(*first_bad, *bad);
}

void dequantize_run(const KernelArgs& a) {
  fsdp::detail::dequantize_any(static_cast<fsdp::QuantFormat>(a.get<int>(4)), a.get<const void*>(1),
                               a.get<const void*>(2), a.get<u64>(3), a.get<float*>(0), a.get<u64>(5));
}

const Kernel kKernels[] = {
    {"fsdp_scale",
     [](const KernelArgs& a, std::vector<Range>& r) { r.push_back({a.get<void*>(0), bytes_of(a.get<u64>(1), a.get<int>(2)), true}); },
     [](const KernelArgs& a) {
       fsdp::detail::host_scale(a.get<void*>(0), a.get<u64>(1), static_cast<DType>(a.get<int>(2)), a.get<double>(3));
     },
     {8, 8, 4, 8}},
    {"fsdp_accumulate",
     [](const KernelArgs& a, std::vector<Range>& r) {
       const std::size_t b = bytes_of(a.get<u64>(2), a.get<int>(3));
       r.push_back({a.get<const void*>(1), b, false});
       r.push_back({a.get<void*>(0), b, true});
     },
     [](const KernelArgs& a) {
       fsdp::detail::host_combine(a.get<void*>(0), a.get<const void*>(1), a.get<u64>(2), static_cast<DType>(a.get<int>(3)),
                                  fsdp::ReduceOp::sum);
     },
     {8, 8, 8, 4}},
    {"fsdp_cast",
     [](const KernelArgs& a, std::vector<Range>& r) {
       r.push_back({a.get<const void*>(2), bytes_of(a.get<u64>(4), a.get<int>(3)), false});
       r.push_back({a.get<void*>(0), bytes_of(a.get<u64>(4), a.get<int>(1)), true});
     },
     [](const KernelArgs& a) {
       cast_part(a.get<void*>(0), a.get<int>(1), a.get<const void*>(2), a.get<int>(3), a.get<u64>(4), a.block, a.grid, a.grid);
     },
     {8, 4, 8, 4, 8}},
    {"fsdp_unscale",
     [](const KernelArgs& a, std::vector<Range>& r) {
       r.push_back({a.get<void*>(0), bytes_of(a.get<u64>(1), a.get<int>(2)), true});
       r.push_back({a.get<void*>(4), sizeof(unsigned), true});
     },
     [](const KernelArgs& a) {
       if (fsdp::detail::host_unscale(a.get<void*>(0), a.get<u64>(1), static_cast<DType>(a.get<int>(2)), a.get<double>(3)))
         *a.get<unsigned*>(4) = 1u;
     },
     {8, 8, 4, 8, 8}},
    {"fsdp_zero_spans",
     [](const KernelArgs& a, std::vector<Range>& r) { span_ranges(*static_cast<const ZeroSpans*>(a.args[0]), r); },
     [](const KernelArgs& a) { zero_part(*static_cast<const ZeroSpans*>(a.args[0]), a.grid, a.block); },
     {sizeof(ZeroSpans)}},
    {"fsdp_cast_zero",
     [](const KernelArgs& a, std::vector<Range>& r) {
       r.push_back({a.get<const void*>(2), bytes_of(a.get<u64>(4), a.get<int>(3)), false});
       r.push_back({a.get<void*>(0), bytes_of(a.get<u64>(4), a.get<int>(1)), true});
       span_ranges(*static_cast<const ZeroSpans*>(a.args[6]), r);
     },
     [](const KernelArgs& a) {
       const unsigned cast_grid = a.get<unsigned>(5);
       if (cast_grid > 0)
         cast_part(a.get<void*>(0), a.get<int>(1), a.get<const void*>(2), a.get<int>(3), a.get<u64>(4), a.block, cast_grid,
                   std::min<u64>(cast_grid, a.grid));
       if (a.grid > cast_grid) zero_part(*static_cast<const ZeroSpans*>(a.args[6]), a.grid - cast_grid, a.block);
     },
     {8, 4, 8, 4, 8, 4, sizeof(ZeroSpans)}},
    {"fsdp_quantize",
     [](const KernelArgs& a, std::vector<Range>& r) {
       const u64 n = a.get<u64>(3);
       const auto format = static_cast<fsdp::QuantFormat>(a.get<int>(4));
       r.push_back({a.get<const void*>(2), static_cast<std::size_t>(n) * sizeof(float), false});
       r.push_back({a.get<void*>(0), static_cast<std::size_t>(n), true});
       r.push_back({a.get<void*>(1), fsdp::detail::block_count(n, a.get<u64>(5)) * fsdp::scale_bytes(format), true});
       r.push_back({a.get<void*>(6), sizeof(u64), true});
     },
     quantize_run, {8, 8, 8, 8, 4, 8, 8}},
    {"fsdp_dequantize",
     [](const KernelArgs& a, std::vector<Range>& r) {
       const u64 n = a.get<u64>(3);
       const auto format = static_cast<fsdp::QuantFormat>(a.get<int>(4));
       r.push_back({a.get<const void*>(1), static_cast<std::size_t>(n), false});
       r.push_back({a.get<const void*>(2), fsdp::detail::block_count(n, a.get<u64>(5)) * fsdp::scale_bytes(format), false});
       r.push_back({a.get<void*>(0), static_cast<std::size_t>(n) * sizeof(float), true});
     },
     dequantize_run, {8, 8, 8, 8, 4, 8}},
    // Per-tensor scaling: fsdp/core/quantize.hpp's helpers, the amax read from (emulated)
    // device memory as the GPU kernels read it. abs_max runs whole: the max its blocks fold
    // into the zeroed *out.
    {"fsdp_abs_max",
     [](const KernelArgs& a, std::vector<Range>& r) {
       r.push_back({a.get<const void*>(0), static_cast<std::size_t>(a.get<u64>(1)) * sizeof(float), false});
       r.push_back({a.get<void*>(2), sizeof(float), true});
     },
     [](const KernelArgs& a) {
       *a.get<float*>(2) = fsdp::detail::abs_max_or_inf(a.get<const float*>(0), a.get<u64>(1));
     },
     {8, 8, 8}},
    {"fsdp_max_over_rows",
     [](const KernelArgs& a, std::vector<Range>& r) {
       const u64 rows = a.get<u64>(2), n = a.get<u64>(3);
       r.push_back({a.get<const void*>(1), static_cast<std::size_t>(rows * n) * sizeof(float), false});
       r.push_back({a.get<void*>(0), static_cast<std::size_t>(n) * sizeof(float), true});
     },
     [](const KernelArgs& a) {
       fsdp::detail::max_over_rows(a.get<const float*>(1), a.get<u64>(2), a.get<u64>(3), a.get<float*>(0));
     },
     {8, 8, 8, 8}},
    {"fsdp_quantize_tensor",
     [](const KernelArgs& a, std::vector<Range>& r) {
       const u64 n = a.get<u64>(2);
       r.push_back({a.get<const void*>(1), static_cast<std::size_t>(n) * sizeof(float), false});
       r.push_back({a.get<const void*>(4), sizeof(float), false});
       r.push_back({a.get<void*>(0), static_cast<std::size_t>(n), true});
     },
     [](const KernelArgs& a) {
       fsdp::detail::quantize_tensor_with_amax(static_cast<fsdp::QuantFormat>(a.get<int>(3)), a.get<const float*>(1),
                                               a.get<u64>(2), a.get<std::uint8_t*>(0), *a.get<const float*>(4));
     },
     {8, 8, 8, 4, 8}},
    {"fsdp_dequantize_tensor",
     [](const KernelArgs& a, std::vector<Range>& r) {
       const u64 n = a.get<u64>(2);
       r.push_back({a.get<const void*>(1), static_cast<std::size_t>(n), false});
       r.push_back({a.get<const void*>(4), sizeof(float), false});
       r.push_back({a.get<void*>(0), static_cast<std::size_t>(n) * sizeof(float), true});
     },
     [](const KernelArgs& a) {
       fsdp::detail::dequantize_tensor_with_amax(static_cast<fsdp::QuantFormat>(a.get<int>(3)),
                                                 a.get<const std::uint8_t*>(1), a.get<u64>(2), *a.get<const float*>(4),
                                                 a.get<float*>(0));
     },
     {8, 8, 8, 4, 8}},
};

}  // namespace

const Kernel* kernel_named(std::string_view name) {
  for (const Kernel& k : kKernels)
    if (name == k.name) return &k;
  return nullptr;
}

const Kernel* kernel_of(const void* handle) {
  for (const Kernel& k : kKernels)
    if (handle == &k) return &k;
  return nullptr;
}

}  // namespace cuda_emulator::detail
