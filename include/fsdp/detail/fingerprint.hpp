#pragma once
// Cross-rank agreement check used at setup: every rank must build the same units with the
// same parameters, or the collectives that follow would pair up wrong buffers. Ranks
// all-gather a hash; on a mismatch they also all-gather a readable description so that
// every rank throws the same message naming the first rank that differs from rank 0.
// Also the one-value agreements a unit offers checkpoints (did every rank succeed? the
// largest value).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/detail/backend_ref.hpp"
#include "fsdp/error.hpp"

namespace fsdp::detail {

class Fingerprint {  // FNV-1a, 64 bit
 public:
  void add(std::string_view s) {
    add_count(s.size());
    for (unsigned char c : s) mix(c);
  }
  void add_count(std::uint64_t v) {
    for (int i = 0; i < 8; ++i) mix(static_cast<unsigned char>(v >> (8 * i)));
  }
  void add_bytes(const void* data, std::size_t n) {
    const auto* p = static_cast<const unsigned char*>(data);
    for (std::size_t i = 0; i < n; ++i) mix(p[i]);
  }
  std::uint64_t value() const { return h_; }

 private:
  void mix(unsigned char c) { h_ = (h_ ^ c) * 0x100000001b3ull; }
  std::uint64_t h_ = 0xcbf29ce484222325ull;
};

// `what` and `describe` return the message's subject and this rank's description; they are
// called only on a mismatch, so agreeing ranks build no text.
template <class What, class Describe>
void check_same_across_ranks(const CommRef& comm, const Fingerprint& fp, What&& what, Describe&& describe) {
  const int n = comm.size();
  const int rank = comm.rank();
  if (n == 1) return;
  std::uint64_t mine = fp.value();
  std::vector<std::uint64_t> all(n);
  comm.all_gather(&mine, all.data(), 1, DType::i64).wait();
  if (std::all_of(all.begin(), all.end(), [&](std::uint64_t h) { return h == all[0]; })) return;

  // Slow path, taken by every rank together: exchange descriptions for the message.
  constexpr std::size_t cap = 4096;
  std::string desc = describe();
  desc.resize(std::min(desc.size(), cap));
  desc.resize(cap, '\0');
  std::vector<char> descs(cap * n);
  comm.all_gather(desc.data(), descs.data(), cap, DType::u8).wait();
  auto text = [&](int r) { return std::string(descs.data() + r * cap, strnlen(descs.data() + r * cap, cap)); };
  int other = 1;
  while (all[other] == all[0]) ++other;
  fail(what(), " differs across ranks (seen on rank ", rank, "): rank 0 has ", text(0), "; rank ", other, " has ",
       text(other));
}

inline bool all_ranks_agree(const CommRef& comm, bool ok) {
  if (comm.size() == 1) return ok;
  std::int32_t mine = ok ? 1 : 0, all = 0;
  comm.all_reduce(&mine, &all, 1, DType::i32, ReduceOp::min).wait();
  return all == 1;
}

inline std::int64_t max_over_ranks(const CommRef& comm, std::int64_t v) {
  if (comm.size() == 1) return v;
  std::int64_t all = 0;
  comm.all_reduce(&v, &all, 1, DType::i64, ReduceOp::max).wait();
  return all;
}

}  // namespace fsdp::detail
