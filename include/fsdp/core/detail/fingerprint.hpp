#pragma once
// Cross-rank agreement check used at setup: every rank must build the same units with the
// same parameters and settings, or the collectives that follow would pair up wrong buffers.
// Ranks all-gather a hash; on a mismatch they also all-gather a readable description so
// that every rank throws the same message naming the first rank that differs from rank 0
// (and, for named settings, the setting and both values).
// Also the one-value agreements a unit offers checkpoints (did every rank succeed? the
// largest value).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/config.hpp"
#include "fsdp/core/detail/backend_ref.hpp"
#include "fsdp/core/detail/collective_call.hpp"
#include "fsdp/core/error.hpp"

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

// Named settings every rank must share (a policy, an option, a buffer's shape), in words.
// They go into the same hash as what they belong to; on a mismatch they lead the exchanged
// description, so that the message can name the one that differs and each rank's value.
class Settings {
 public:
  void add(std::string name, std::string value) { items_.push_back({std::move(name), std::move(value)}); }
  void add_to(Fingerprint& f) const {
    f.add_count(items_.size());
    for (const auto& i : items_) f.add(i.name), f.add(i.value);
  }
  // Each setting as name, unit separator, value, record separator; then a group separator.
  std::string encode() const {
    std::string s;
    for (const auto& i : items_) s.append(i.name).append(1, kValue).append(i.value).append(1, kEnd);
    return s.append(1, kDone);
  }
  static std::string_view rest(std::string_view encoded) {  // what follows the settings
    const auto at = encoded.find(kDone);
    return at == std::string_view::npos ? std::string_view() : encoded.substr(at + 1);
  }
  // "the <setting>: rank a <value>, rank b <value>" for the first setting whose name or value
  // differs between two encoded descriptions, or "" when they list the same settings.
  static std::string first_difference(std::string_view a, int rank_a, std::string_view b, int rank_b);

 private:
  struct Item { std::string name, value; };
  static constexpr char kValue = '\x1f', kEnd = '\x1e', kDone = '\x1d';
  static std::vector<Item> decode(std::string_view s);  // a cut-off last setting is left out
  std::vector<Item> items_;
};

// `what` and `describe` return the message's subject and this rank's description; they are
// called only on a mismatch, so agreeing ranks build no text. `settings`, when given, must
// be in `fp` already: a difference among them is named first. Not a template (it runs at
// setup and at the end of a summon, where a std::function costs nothing): one copy serves
// every caller.
inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void check_same_across_ranks(const CommRef& comm, const Fingerprint& fp, const std::function<std::string()>& what,
                                       const std::function<std::string()>& describe, const Settings* settings = nullptr);
}

inline bool all_ranks_agree(const CommRef& comm, bool ok, const CollectiveTag* tag = nullptr) {
  if (comm.size() == 1) return ok;
  static_assert(kAgreementDType == DType::i32 && kAgreementCount == 1);
  std::int32_t mine = ok ? 1 : 0, all = 0;
  comm.all_reduce(&mine, &all, kAgreementCount, kAgreementDType, kAgreementOp, tag).wait();
  return all == 1;
}

inline std::int64_t max_over_ranks(const CommRef& comm, std::int64_t v) {
  if (comm.size() == 1) return v;
  std::int64_t all = 0;
  comm.all_reduce(&v, &all, 1, DType::i64, ReduceOp::max).wait();
  return all;
}

#if FSDP_DEFINES_IMPLEMENTATION  // compiled once under FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp)
FSDP_DECL std::string Settings::first_difference(std::string_view a, int rank_a, std::string_view b, int rank_b) {
  const auto xs = decode(a), ys = decode(b);
  const std::string ra = "rank " + std::to_string(rank_a), rb = "rank " + std::to_string(rank_b);
  for (std::size_t i = 0; i < std::max(xs.size(), ys.size()); ++i) {
    if (i >= xs.size()) return "the " + ys[i].name + ": " + rb + " has it (" + ys[i].value + "), " + ra + " not";
    if (i >= ys.size()) return "the " + xs[i].name + ": " + ra + " has it (" + xs[i].value + "), " + rb + " not";
    if (xs[i].name != ys[i].name)
      return "the settings they list: " + ra + " has the " + xs[i].name + " (" + xs[i].value + ") where " + rb +
             " has the " + ys[i].name + " (" + ys[i].value + ")";
    if (xs[i].value != ys[i].value) return "the " + xs[i].name + ": " + ra + " " + xs[i].value + ", " + rb + " " + ys[i].value;
  }
  return "";
}

FSDP_DECL std::vector<Settings::Item> Settings::decode(std::string_view s) {  // a cut-off last setting is left out
  std::vector<Item> out;
  s = s.substr(0, std::min(s.find(kDone), s.size()));
  for (std::size_t end; (end = s.find(kEnd)) != std::string_view::npos; s.remove_prefix(end + 1)) {
    const std::string_view item = s.substr(0, end);
    const auto v = std::min(item.find(kValue), item.size());
    out.push_back({std::string(item.substr(0, v)), std::string(item.substr(std::min(v + 1, item.size())))});
  }
  return out;
}

inline namespace FSDP_MODE_NAMESPACE {
FSDP_DECL void check_same_across_ranks(const CommRef& comm, const Fingerprint& fp, const std::function<std::string()>& what,
                                       const std::function<std::string()>& describe, const Settings* settings) {
  const int n = comm.size();
  const int rank = comm.rank();
  if (n == 1) return;
  std::uint64_t mine = fp.value();
  std::vector<std::uint64_t> all(n);
  comm.all_gather(&mine, all.data(), 1, DType::i64).wait();
  if (std::all_of(all.begin(), all.end(), [&](std::uint64_t h) { return h == all[0]; })) return;

  // Slow path, taken by every rank together: exchange descriptions for the message.
  constexpr std::size_t cap = 8192;
  std::string desc = (settings ? settings->encode() : std::string()) + describe();
  desc.resize(std::min(desc.size(), cap));
  desc.resize(cap, '\0');
  std::vector<char> descs(cap * n);
  comm.all_gather(desc.data(), descs.data(), cap, DType::u8).wait();
  auto text = [&](int r) { return std::string(descs.data() + r * cap, strnlen(descs.data() + r * cap, cap)); };
  int other = 1;
  while (all[other] == all[0]) ++other;
  std::string mine_text = text(0), other_text = text(other);
  if (settings) {
    if (auto differ = Settings::first_difference(mine_text, 0, other_text, other); !differ.empty())
      fail_as(ErrorKind::mismatch, what(), ": ranks differ in ", differ, " (seen on rank ", rank, ")");
    mine_text = Settings::rest(mine_text), other_text = Settings::rest(other_text);
  }
  fail_as(ErrorKind::mismatch, what(), " differs across ranks (seen on rank ", rank, "): rank 0 has ", mine_text,
          "; rank ", other, " has ", other_text);
}
}  // inline namespace FSDP_MODE_NAMESPACE
#endif  // FSDP_DEFINES_IMPLEMENTATION

}  // namespace fsdp::detail
