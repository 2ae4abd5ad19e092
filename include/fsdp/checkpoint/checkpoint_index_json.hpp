#pragma once
// CheckpointIndex as JSON (the format is shown in checkpoint_index_types.hpp): writing, and
// reading with a check of every field, so a damaged or foreign index is an error that
// names the index file and the field or tensor, never a wrong load.
#include <cstdint>
#include <filesystem>
#include <initializer_list>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "fsdp/checkpoint/atomic_file.hpp"
#include "fsdp/checkpoint/checkpoint_index_types.hpp"
#include "fsdp/checkpoint/checksum.hpp"
#include "fsdp/checkpoint/file_io.hpp"
#include "fsdp/checkpoint/json_checks.hpp"
#include "fsdp/checkpoint/safetensors_header.hpp"
#include "fsdp/checkpoint/save_id.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

namespace detail {

inline void put_id(nlohmann::ordered_json& j, const StateKey& id) {
  j["fqn"] = id.fqn;
  j["kind"] = name_of(id.kind);
  if (id.kind == StateKind::optim) j["state"] = id.state;
}

// Reads fields with messages "checkpoint index '<source>': <where>: ...".
class IndexJsonReader {
 public:
  explicit IndexJsonReader(const std::string& source) : source_(source) {}

  template <class... Parts>
  [[noreturn]] void fail_at(const std::string& where, Parts&&... parts) const {
    fail_as(ErrorKind::corrupt, "checkpoint index '", source_, "': ", where, ": ", std::forward<Parts>(parts)...);
  }

  // `j` must be an object with every `required` field and no field outside both lists.
  void check_fields(const nlohmann::json& j, const std::string& where, std::initializer_list<const char*> required,
                    std::initializer_list<const char*> optional = {}) const {
    if (!j.is_object()) fail_at(where, "expected an object, got ", json_text(j));
    for (const char* f : required)
      if (!j.contains(f)) fail_at(where, "the field '", f, "' is missing");
    for (auto& [key, v] : j.items()) {
      bool known = false;
      for (auto list : {required, optional})
        for (const char* f : list) known = known || key == f;
      if (!known) fail_at(where, "unknown field '", key, "'");
    }
  }
  std::string string_field(const nlohmann::json& j, const char* f, const std::string& where) const {
    if (!j.at(f).is_string()) fail_at(where, "'", f, "' must be a string, got ", json_text(j.at(f)));
    return j.at(f).get<std::string>();
  }
  std::uint64_t u64_field(const nlohmann::json& j, const char* f, const std::string& where) const {
    std::uint64_t v = 0;
    if (!json_to_u64(j.at(f), UINT64_MAX, v)) fail_at(where, "'", f, "' must be an integer >= 0, got ", json_text(j.at(f)));
    return v;
  }
  const nlohmann::json& array_field(const nlohmann::json& j, const char* f, const std::string& where) const {
    if (!j.at(f).is_array()) fail_at(where, "'", f, "' must be an array, got ", json_text(j.at(f)));
    return j.at(f);
  }
  StateKey id(const nlohmann::json& j, const std::string& where) const {
    StateKey id;
    id.fqn = string_field(j, "fqn", where);
    const auto kind = state_kind_from_name(string_field(j, "kind", where));
    if (!kind) fail_at(where + " ('" + id.fqn + "')", "kind ", json_text(j["kind"]), " is not \"param\", \"buffer\" or \"optim\"");
    id.kind = *kind;
    if (j.contains("state")) id.state = string_field(j, "state", where + " ('" + id.fqn + "')");
    return id;
  }

 private:
  const std::string& source_;
};

}  // namespace detail

namespace detail {

inline nlohmann::ordered_json index_content(const CheckpointIndex& ix) {
  nlohmann::ordered_json j;
  j["format"] = CheckpointIndex::format_name;
  j["version"] = CheckpointIndex::format_version;
  j["world_size"] = ix.world_size;
  j["save_id"] = format_save_id(ix.save_id);
  const auto& metadata = ix.metadata;
  const auto& files = ix.files;
  const auto& entries = ix.entries;
  const auto& slices = ix.slices;
  j["metadata"] = nlohmann::ordered_json::object();
  for (const auto& [k, v] : metadata) j["metadata"][k] = v;
  j["files"] = nlohmann::ordered_json::array();
  for (const IndexFile& f : files) j["files"].push_back({{"name", f.name}, {"bytes", f.bytes}, {"xxh64", xxh64_hex(f.xxh64)}});
  j["entries"] = nlohmann::ordered_json::array();
  for (const IndexEntry& e : entries) {
    nlohmann::ordered_json o;
    detail::put_id(o, e.id);
    o["dtype"] = safetensors_dtype_name(e.dtype);
    o["shape"] = e.shape;
    j["entries"].push_back(std::move(o));
  }
  j["slices"] = nlohmann::ordered_json::array();
  for (const IndexSlice& s : slices) {
    nlohmann::ordered_json o;
    detail::put_id(o, s.id);
    o["file"] = s.file;
    o["key"] = s.key;
    o["begin"] = s.begin;
    o["count"] = s.count;
    j["slices"].push_back(std::move(o));
  }
  return j;
}

inline std::uint64_t xxh64_of_text(const std::string& text) {
  Xxh64 h;
  h.update(text.data(), text.size());
  return h.digest();
}

}  // namespace detail

inline std::uint64_t CheckpointIndex::content_xxh64() const { return detail::xxh64_of_text(detail::index_content(*this).dump()); }

inline nlohmann::ordered_json CheckpointIndex::to_json() const {
  nlohmann::ordered_json j = detail::index_content(*this);
  j["xxh64"] = xxh64_hex(detail::xxh64_of_text(j.dump()));
  return j;
}

inline std::string CheckpointIndex::dump() const {
  const nlohmann::ordered_json j = to_json();
  std::string text = "{";
  for (const auto& [key, value] : j.items()) {
    text += (text.size() > 1 ? ",\n " : "\n ") + nlohmann::json(key).dump() + ": ";
    if (!value.is_array() || value.empty()) {
      text += value.dump();
      continue;
    }
    text += "[";
    for (std::size_t i = 0; i < value.size(); ++i) text += (i ? ",\n  " : "\n  ") + value[i].dump();
    text += "\n ]";
  }
  return text + "\n}\n";
}

inline CheckpointIndex CheckpointIndex::from_json(const nlohmann::json& j, std::string source) {
  CheckpointIndex ix;
  ix.source = std::move(source);
  const detail::IndexJsonReader r(ix.source);
  const std::string top = "top level";
  if (!j.is_object()) r.fail_at(top, "expected an object, got ", detail::json_text(j));
  for (const char* f : {"format", "version"})  // first: another version may have other fields
    if (!j.contains(f)) r.fail_at(top, "the field '", f, "' is missing");
  if (!j["format"].is_string() || j["format"].get<std::string>() != format_name)
    r.fail_at(top, "format ", detail::json_text(j["format"]), " is not \"", format_name, "\" (not an fsdp sharded checkpoint index)");
  if (const std::uint64_t v = r.u64_field(j, "version", top); v != format_version)
    r.fail_at(top, "checkpoint format version ", v, ", but this build reads version ", format_version,
              v > format_version ? " (a newer fsdp wrote it)" : " (an older fsdp wrote it, before indexes were checksummed)");
  r.check_fields(j, top, {"format", "version", "world_size", "save_id", "metadata", "files", "entries", "slices", "xxh64"});
  const std::uint64_t world = r.u64_field(j, "world_size", top);
  if (world < 1 || world > 1u << 30) r.fail_at(top, "world_size ", world, " is not in [1, 2^30]");
  ix.world_size = static_cast<int>(world);
  const auto id = parse_save_id(r.string_field(j, "save_id", top));
  if (!id) r.fail_at(top, "save_id ", detail::json_text(j["save_id"]), " is not 16 hex digits");
  ix.save_id = *id;
  const auto stored = parse_xxh64_hex(r.string_field(j, "xxh64", top));
  if (!stored) r.fail_at(top, "xxh64 ", detail::json_text(j["xxh64"]), " is not 16 hex digits");
  if (!j["metadata"].is_object()) r.fail_at(top, "'metadata' must be an object, got ", detail::json_text(j["metadata"]));
  for (auto& [k, v] : j["metadata"].items()) {
    if (!v.is_string()) r.fail_at("metadata '" + k + "'", "the value must be a string, got ", detail::json_text(v));
    ix.metadata.emplace(k, v.get<std::string>());
  }
  for (const auto& f : r.array_field(j, "files", top)) {
    const std::string where = "files[" + std::to_string(ix.files.size()) + "]";
    r.check_fields(f, where, {"name", "bytes", "xxh64"});
    IndexFile file{r.string_field(f, "name", where), r.u64_field(f, "bytes", where), 0};
    const auto h = parse_xxh64_hex(r.string_field(f, "xxh64", where));
    if (!h) r.fail_at(where + " ('" + file.name + "')", "xxh64 ", detail::json_text(f["xxh64"]), " is not 16 hex digits");
    file.xxh64 = *h;
    ix.files.push_back(std::move(file));
  }
  for (const auto& e : r.array_field(j, "entries", top)) {
    const std::string where = "entries[" + std::to_string(ix.entries.size()) + "]";
    r.check_fields(e, where, {"fqn", "kind", "dtype", "shape"}, {"state"});
    IndexEntry entry;
    entry.id = r.id(e, where);
    const std::string named = where + " (" + entry.id.describe() + ")";
    const auto dtype = dtype_from_safetensors(r.string_field(e, "dtype", named));
    if (!dtype) r.fail_at(named, "dtype ", detail::json_text(e["dtype"]), " is not supported");
    entry.dtype = *dtype;
    for (const auto& d : r.array_field(e, "shape", named)) {
      std::uint64_t dim = 0;
      if (!detail::json_to_u64(d, INT64_MAX, dim))
        r.fail_at(named, "shape ", detail::json_text(e["shape"]), " has a dimension that is not an integer in [0, 2^63)");
      entry.shape.push_back(static_cast<std::int64_t>(dim));
    }
    ix.entries.push_back(std::move(entry));
  }
  for (const auto& s : r.array_field(j, "slices", top)) {
    const std::string where = "slices[" + std::to_string(ix.slices.size()) + "]";
    r.check_fields(s, where, {"fqn", "kind", "file", "key", "begin", "count"}, {"state"});
    IndexSlice slice;
    slice.id = r.id(s, where);
    const std::string named = where + " (" + slice.id.describe() + ")";
    slice.file = r.string_field(s, "file", named);
    slice.key = r.string_field(s, "key", named);
    slice.begin = r.u64_field(s, "begin", named);
    slice.count = r.u64_field(s, "count", named);
    ix.slices.push_back(std::move(slice));
  }
  ix.check_complete();
  // Last, so that the checks above name what is malformed; this one catches the rest (two
  // slices' keys or begins swapped, a size, a shape, a name: any field changed).
  if (const std::uint64_t computed = ix.content_xxh64(); computed != *stored)
    r.fail_at(top, "its content does not match its checksum (xxh64 ", xxh64_hex(*stored), ", computed ",
              xxh64_hex(computed), "): the index was changed or damaged after the save");
  return ix;
}

inline CheckpointIndex CheckpointIndex::load(const std::filesystem::path& path) {
  detail::UniqueFd fd = detail::open_fd(path, O_RDONLY, "to read a checkpoint index");
  const std::uint64_t size = detail::file_size_of(fd.get(), path);
  std::string text(size, '\0');
  if (detail::pread_up_to(fd.get(), text.data(), size, 0, path) != size)
    detail::fail_as(ErrorKind::io, "checkpoint index '", path.string(), "' shrank while it was read");
  detail::JsonChecker checker;
  if (!nlohmann::json::sax_parse(text, &checker)) {
    if (checker.too_deep)
      detail::fail_as(ErrorKind::corrupt, "checkpoint index '", path.string(), "' nests deeper than ",
                      detail::JsonChecker::max_depth, " levels");
    detail::fail_as(ErrorKind::corrupt, "checkpoint index '", path.string(), "' is not valid JSON: ", checker.error);
  }
  if (!checker.duplicate.empty())
    detail::fail_as(ErrorKind::corrupt, "checkpoint index '", path.string(), "' has the key '", checker.duplicate,
                    "' twice in one object");
  return from_json(nlohmann::json::parse(text), path.string());
}

inline WriteResult CheckpointIndex::save(const std::filesystem::path& path) const {
  check_complete();
  const std::string text = dump();
  return write_file_atomically(path, [&](FileSink& sink) { sink.write(text); });
}

}  // namespace fsdp::checkpoint
