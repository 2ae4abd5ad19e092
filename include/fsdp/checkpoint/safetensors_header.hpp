#pragma once
// The safetensors header (https://github.com/huggingface/safetensors, "Format"): a file is
// an 8-byte little-endian u64 N, N bytes of UTF-8 JSON, then the data buffer. The JSON
// maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} (byte offsets
// into the data buffer) plus an optional "__metadata__" object of strings. This header
// formats one and parses one with every check a reader must make before it trusts the
// offsets: the tensors must cover the data buffer exactly, each with exactly the bytes its
// dtype and shape need. A header written by fsdp must also match its own checksum
// (fsdp_metadata.hpp), checked before its offsets are: two tensors' data_offsets swapped
// (same sizes, so every other check passes) would otherwise load each into the other.
#include <algorithm>
#include <bit>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint/fsdp_metadata.hpp"
#include "fsdp/checkpoint/json_checks.hpp"
#include "fsdp/core/tensor.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

static_assert(std::endian::native == std::endian::little,
              "safetensors data is little-endian; fsdp reads and writes it as host memory");

using Shape = std::vector<std::int64_t>;

namespace detail {
using fsdp::detail::fail;
using fsdp::detail::fail_as;
}

// The reference implementation refuses larger headers too (a guard against a corrupt N).
inline constexpr std::uint64_t max_safetensors_header_bytes = 100'000'000;

inline constexpr std::string_view safetensors_dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "F32";
    case DType::f64: return "F64";
    case DType::f16: return "F16";
    case DType::bf16: return "BF16";
    case DType::i8: return "I8";
    case DType::u8: return "U8";
    case DType::i32: return "I32";
    case DType::i64: return "I64";
    case DType::f8e4m3: return "F8_E4M3";
    case DType::f8e5m2: return "F8_E5M2";
    case DType::e8m0: return "F8_E8M0";  // safetensors' name for the MX scale
  }
  return "?";
}

inline std::optional<DType> dtype_from_safetensors(std::string_view s) {
  for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16, DType::i8, DType::u8, DType::i32, DType::i64,
                  DType::f8e4m3, DType::f8e5m2, DType::e8m0})
    if (safetensors_dtype_name(t) == s) return t;
  return std::nullopt;
}

// One tensor of a file: [begin, end) are byte offsets into the data buffer.
struct TensorInfo {
  std::string name;
  DType dtype = DType::f32;
  Shape shape;
  std::uint64_t begin = 0;
  std::uint64_t end = 0;

  std::uint64_t bytes() const { return end - begin; }
  std::uint64_t numel() const { return bytes() / size_of(dtype); }
};

namespace detail {

// Product of the dims, nullopt if one is negative or the product overflows u64.
inline std::optional<std::uint64_t> checked_numel(const Shape& shape) {
  std::uint64_t n = 1;
  for (std::int64_t d : shape) {
    if (d < 0 || __builtin_mul_overflow(n, static_cast<std::uint64_t>(d), &n)) return std::nullopt;
  }
  return n;
}

inline std::optional<std::uint64_t> checked_bytes(const Shape& shape, DType t) {
  const auto n = checked_numel(shape);
  std::uint64_t bytes;
  if (!n || __builtin_mul_overflow(*n, static_cast<std::uint64_t>(size_of(t)), &bytes)) return std::nullopt;
  return bytes;
}

using fsdp::detail::format_shape;

}  // namespace detail

// A parsed, validated header. Tensors are in data order (by begin offset).
struct SafetensorsHeader {
  std::vector<TensorInfo> tensors;
  std::map<std::string, std::string, std::less<>> metadata;
};

// The JSON of a header for `tensors` (in the given order) padded with spaces so that
// 8 + its length is a multiple of 8, which aligns the data buffer as the reference
// writer does. Names and metadata must be valid UTF-8.
inline std::string format_safetensors_header(const std::vector<TensorInfo>& tensors,
                                             const std::map<std::string, std::string, std::less<>>& metadata) {
  std::string s = "{";
  if (!metadata.empty()) s += "\"__metadata__\":" + nlohmann::ordered_json(metadata).dump();
  for (const TensorInfo& t : tensors) {
    if (s.size() > 1) s += ',';
    s += detail::json_string(t.name) + ":{\"dtype\":\"" + std::string(safetensors_dtype_name(t.dtype)) +
         "\",\"shape\":" + nlohmann::json(t.shape).dump() + ",\"data_offsets\":[" + std::to_string(t.begin) + "," +
         std::to_string(t.end) + "]}";
  }
  s += '}';
  s.resize((s.size() + 7) / 8 * 8, ' ');
  return s;
}

// The canonical checksum of the header of `tensors` with `metadata` (fsdp_metadata.hpp):
// what a writer puts in fsdp.header_xxh64 (the parser computes it from the JSON it read).
inline std::uint64_t header_xxh64(const std::vector<TensorInfo>& tensors,
                                  const std::map<std::string, std::string, std::less<>>& metadata) {
  nlohmann::json root = nlohmann::json::object();
  if (!metadata.empty()) root["__metadata__"] = metadata;
  for (const TensorInfo& t : tensors)
    root[t.name] = {{"dtype", safetensors_dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {t.begin, t.end}}};
  return canonical_header_xxh64(root);
}

namespace detail {

class HeaderParser {
 public:
  HeaderParser(const std::string& file, std::uint64_t data_bytes) : file_(file), data_bytes_(data_bytes) {}

  SafetensorsHeader parse(std::string_view text) {
    nlohmann::json root = parse_json(text);
    if (!root.is_object())
      fail_as(ErrorKind::corrupt, "safetensors file '", file_, "': the header is not a JSON object but ",
              json_text(root));
    SafetensorsHeader h;
    for (auto& [key, value] : root.items()) {
      if (key == "__metadata__") h.metadata = parse_metadata(value);
      else h.tensors.push_back(parse_tensor(key, value));
    }
    check_fsdp_metadata(file_, h.metadata, [&] { return canonical_header_xxh64(root); });  // before the offsets
    check_coverage(h.tensors);
    return h;
  }

 private:
  template <class... Parts>
  [[noreturn]] void fail_tensor(const std::string& key, Parts&&... parts) const {
    fail_as(ErrorKind::corrupt, "safetensors file '", file_, "': tensor '", key, "': ", std::forward<Parts>(parts)...);
  }

  // A first pass over the text without building anything (JsonChecker), then the tree.
  nlohmann::json parse_json(std::string_view text) const {
    // Valid JSON has none (a string's control characters are escaped), but nlohmann's
    // parser stops at one as at the end of its input: a NUL in the padding would pass.
    if (const auto nul = text.find('\0'); nul != std::string_view::npos)
      fail_as(ErrorKind::corrupt, "safetensors file '", file_, "': the header has a NUL byte at offset ", nul,
              " (not valid JSON)");
    detail::JsonChecker checker;
    if (!nlohmann::json::sax_parse(text.begin(), text.end(), &checker)) {
      if (checker.too_deep)
        fail_as(ErrorKind::corrupt, "safetensors file '", file_, "': the header nests deeper than ",
                detail::JsonChecker::max_depth, " levels");
      fail_as(ErrorKind::corrupt, "safetensors file '", file_, "': the header is not valid JSON: ", checker.error);
    }
    if (!checker.duplicate.empty())
      fail_as(ErrorKind::corrupt, "safetensors file '", file_, "': the header has the key '", checker.duplicate,
              "' twice");
    return nlohmann::json::parse(text.begin(), text.end());
  }

  std::map<std::string, std::string, std::less<>> parse_metadata(const nlohmann::json& j) const {
    if (!j.is_object())
      fail_as(ErrorKind::corrupt, "safetensors file '", file_, "': __metadata__ is not an object but ", json_text(j));
    std::map<std::string, std::string, std::less<>> m;
    for (auto& [k, v] : j.items()) {
      if (!v.is_string())
        fail_as(ErrorKind::corrupt, "safetensors file '", file_, "': __metadata__ value of '", k,
                "' is not a string but ", json_text(v));
      m.emplace(k, v.get<std::string>());
    }
    return m;
  }

  TensorInfo parse_tensor(const std::string& key, const nlohmann::json& j) const {
    if (!j.is_object()) fail_tensor(key, "its entry is not an object but ", json_text(j));
    for (auto& [field, v] : j.items())
      if (field != "dtype" && field != "shape" && field != "data_offsets") fail_tensor(key, "unknown field '", field, "'");
    for (const char* field : {"dtype", "shape", "data_offsets"})
      if (!j.contains(field)) fail_tensor(key, "the field '", field, "' is missing");
    TensorInfo t;
    t.name = key;
    const auto& dtype = j["dtype"];
    const auto parsed = dtype.is_string() ? dtype_from_safetensors(dtype.get<std::string>()) : std::nullopt;
    if (!parsed)
      fail_tensor(key, "dtype ", json_text(dtype), " is not supported (supported: F32, F64, F16, BF16, I8, U8, I32, I64)");
    t.dtype = *parsed;
    const auto& shape = j["shape"];
    if (!shape.is_array()) fail_tensor(key, "shape ", json_text(shape), " is not an array");
    for (const auto& d : shape) {
      std::uint64_t v = 0;
      if (!json_to_u64(d, INT64_MAX, v))
        fail_tensor(key, "shape ", json_text(shape), " has a dimension that is not an integer in [0, 2^63)");
      t.shape.push_back(static_cast<std::int64_t>(v));
    }
    const auto bytes = checked_bytes(t.shape, t.dtype);
    if (!bytes) fail_tensor(key, "shape ", format_shape(t.shape), " of ", safetensors_dtype_name(t.dtype), " overflows 64 bits");
    const auto& offsets = j["data_offsets"];
    const bool pair = offsets.is_array() && offsets.size() == 2;
    if (!pair || !json_to_u64(offsets[0], UINT64_MAX, t.begin) || !json_to_u64(offsets[1], UINT64_MAX, t.end) ||
        t.begin > t.end)
      fail_tensor(key, "data_offsets ", json_text(offsets), " is not [begin, end] with 0 <= begin <= end");
    if (t.bytes() != *bytes)
      fail_tensor(key, "data_offsets ", json_text(offsets), " span ", t.bytes(), " bytes but shape ",
                  format_shape(t.shape), " of ", safetensors_dtype_name(t.dtype), " needs ", *bytes);
    return t;
  }

  // Sorted by offset, each tensor must start where the previous one ended and the last
  // must end where the data buffer does: no overlap, no hole, nothing missing or extra.
  void check_coverage(std::vector<TensorInfo>& tensors) const {
    std::sort(tensors.begin(), tensors.end(), [](const TensorInfo& a, const TensorInfo& b) {
      return a.begin != b.begin ? a.begin < b.begin : a.end != b.end ? a.end < b.end : a.name < b.name;
    });
    std::uint64_t at = 0;
    const TensorInfo* prev = nullptr;
    for (const TensorInfo& t : tensors) {
      if (t.begin < at)
        fail_tensor(t.name, "data_offsets [", t.begin, ", ", t.end, "] overlap tensor '", prev->name, "' [",
                    prev->begin, ", ", prev->end, "]");
      if (t.begin > at)
        fail_tensor(t.name, "data_offsets [", t.begin, ", ", t.end, "] leave bytes [", at, ", ", t.begin,
                    ") of the data buffer unused");
      at = t.end;
      prev = &t;
    }
    if (at > data_bytes_)
      fail_tensor(prev->name, "data_offsets [", prev->begin, ", ", prev->end, "] end past the data buffer, which has ",
                  data_bytes_, " bytes (the file is truncated)");
    if (at < data_bytes_)
      fail_as(ErrorKind::corrupt, "safetensors file '", file_, "': the data buffer has ", data_bytes_ - at,
              " bytes after the last tensor's end (byte ", at, " of ", data_bytes_,
              "; extra bytes or a missing tensor)");
  }

  const std::string& file_;
  std::uint64_t data_bytes_;
};

}  // namespace detail

// Parses and validates the header of the file named `file` (for messages) whose data
// buffer has `data_bytes` bytes (file size - 8 - N).
inline SafetensorsHeader parse_safetensors_header(std::string_view json, std::uint64_t data_bytes,
                                                  const std::string& file) {
  return detail::HeaderParser(file, data_bytes).parse(json);
}

}  // namespace fsdp::checkpoint
