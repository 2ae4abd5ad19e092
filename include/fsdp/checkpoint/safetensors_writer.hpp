#pragma once
// SafetensorsWriter: collects tensors (names, dtypes, shapes and where their bytes come
// from) and writes one safetensors file atomically. A tensor's bytes come either from host
// memory that stays valid until write() returns, or from a fill function called during
// write(): that lets a caller produce one tensor at a time (gather it, copy it to host,
// drop it) so a full checkpoint never needs the whole model in memory at once.
//
// The file is deterministic: the same adds and metadata give the same bytes. Tensors are
// laid out in the order they were added; the header lists them in that order after
// "__metadata__" (sorted by key). A checkpoint file is marked as fsdp's (mark_fsdp_file):
// its header then carries its own checksum, the format version and the save id.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "fsdp/checkpoint/atomic_file.hpp"
#include "fsdp/checkpoint/data_checksums.hpp"
#include "fsdp/checkpoint/fsdp_metadata.hpp"
#include "fsdp/checkpoint/host_arena.hpp"
#include "fsdp/checkpoint/safetensors_header.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

class SafetensorsWriter {
 public:
  // Called once per tensor during write(), in the order the tensors were added, with a
  // host buffer of exactly that tensor's bytes (empty for a tensor with no elements) to
  // fill completely. The buffer is reused for the next tensor; its bytes are what is
  // written. An exception from it fails the write (no file is left).
  using Fill = std::function<void(std::span<std::byte> out)>;

  // Adds a tensor whose bytes are at `host_data` (not copied: it must stay valid and
  // unchanged until write() returns; may be null only for a tensor with no elements).
  void add(std::string name, DType dtype, Shape shape, const void* host_data) {
    const std::uint64_t bytes = checked_new_bytes(name, dtype, shape);
    if (host_data == nullptr && bytes != 0) fail_tensor(name, "host data is null");
    push(std::move(name), dtype, std::move(shape), bytes).data = host_data;
  }
  void add(std::string name, DType dtype, Shape shape, Fill fill) {
    const std::uint64_t bytes = checked_new_bytes(name, dtype, shape);
    if (!fill) fail_tensor(name, "the fill function is empty");
    push(std::move(name), dtype, std::move(shape), bytes).fill = std::move(fill);
  }

  // Tensors laid out one after another whose bytes one call of `fill` produces together
  // (their concatenation): for example the parameters of one gathered flat parameter.
  struct Spec {
    std::string name;
    DType dtype = DType::f32;
    Shape shape;
  };
  void add_together(std::vector<Spec> specs, Fill fill) {
    if (specs.empty()) return;
    if (!fill) fail_tensor(specs.front().name, "the fill function is empty");
    const std::size_t first = tensors_.size();
    for (Spec& t : specs) push(t.name, t.dtype, t.shape, checked_new_bytes(t.name, t.dtype, t.shape));
    tensors_[first].fill = std::move(fill);
    tensors_[first].together = specs.size();
  }

  // A "__metadata__" entry; setting a key again replaces its value.
  void set_metadata(std::string key, std::string value) {
    try {
      detail::json_string(key);
      detail::json_string(value);
    } catch (const nlohmann::json::exception&) {
      detail::fail("safetensors writer: metadata '", key, "' is not valid UTF-8");
    }
    metadata_[std::move(key)] = std::move(value);
  }

  // Also write the data section's chunk checksums into "__metadata__" (data_checksums.hpp):
  // what full checkpoints do, so that a load finds a damaged file.
  void checksum_data(std::uint64_t chunk_bytes = data_checksum_chunk_bytes) {
    if (chunk_bytes == 0) detail::fail("safetensors writer: a data checksum chunk of 0 bytes");
    checksum_chunk_ = chunk_bytes;
  }

  // Marks the file as one of fsdp's checkpoint files, of save `save_id` (save_id.hpp):
  // "__metadata__" then also holds the format version, the save id and the header's
  // checksum (fsdp_metadata.hpp), and no other "fsdp." key may be set but fsdp.slices.
  void mark_fsdp_file(std::uint64_t save_id) {
    if (save_id == 0) detail::fail("safetensors writer: save id 0 (draw one with checkpoint::new_save_id())");
    save_id_ = save_id;
  }

  std::size_t size() const { return tensors_.size(); }
  // Every tensor added, in file order; begin/end are offsets into the data section.
  std::vector<TensorInfo> layout() const {
    std::vector<TensorInfo> out;
    for (const Pending& p : tensors_) out.push_back(p.info);
    return out;
  }
  std::uint64_t data_bytes() const { return data_bytes_; }
  // The header JSON, padded (see format_safetensors_header).
  std::string header() const {
    if (!checksum_chunk_ && !save_id_) return format_safetensors_header(layout(), metadata_);
    if (!save_id_)  // an "fsdp." key without the rest would be refused by every reader
      detail::fail("safetensors writer: data checksums are for fsdp's checkpoint files: call mark_fsdp_file too");
    auto with = metadata_;
    if (save_id_) {
      for (const auto& [key, value] : metadata_)
        if (is_fsdp_key(key) && key != slices_key)
          detail::fail("safetensors writer: metadata key '", key, "' is reserved: keys starting with '",
                       fsdp_key_prefix, "' are the library's own");
      with[std::string(format_version_key)] = std::to_string(checkpoint_format_version);
      with[std::string(save_id_key)] = format_save_id(save_id_);
    }
    if (checksum_chunk_)
      with[std::string(data_checksums_key)] = DataChecksums::placeholder(data_bytes_, checksum_chunk_).format();
    const std::vector<TensorInfo> tensors = layout();
    if (save_id_) with[std::string(header_checksum_key)] = xxh64_hex(header_xxh64(tensors, with));
    return format_safetensors_header(tensors, with);
  }

  // Fills smaller than this are written on the calling thread: for them a thread costs
  // more than the overlap saves.
  static constexpr std::uint64_t pipelined_fill_bytes = std::uint64_t{1} << 20;

  // Streams the whole file into `sink`: length, header, then each tensor's bytes. The
  // bytes of a large fill go to the sink on a second thread while the next fill runs on
  // this one (two buffers of the largest fill), so producing them (a gather) overlaps
  // writing them; small fills are written in place.
  void write_to(FileSink& sink) const {
    const std::string h = header();
    const std::uint64_t n = h.size();
    sink.write(&n, sizeof n);  // little-endian (asserted in safetensors_header.hpp)
    sink.write(h);
    std::optional<ChunkHasher> hasher;
    if (checksum_chunk_) hasher.emplace(checksum_chunk_);
    auto data_out = [&](const void* data, std::size_t bytes) {  // in file order, one at a time
      if (hasher) hasher->update(data, bytes);
      sink.write(data, bytes);
    };
    auto fill_bytes = [&](std::size_t i) {  // of tensor i's fill, which may cover the next ones too
      return tensors_[i + tensors_[i].together - 1].info.end - tensors_[i].info.begin;
    };
    std::uint64_t largest = 0;
    std::size_t fills = 0;
    for (std::size_t i = 0; i < tensors_.size(); i += tensors_[i].fill ? tensors_[i].together : 1)
      if (tensors_[i].fill) largest = std::max(largest, fill_bytes(i)), ++fills;
    const bool pipelines = fills > 1 && largest >= pipelined_fill_bytes;  // else one buffer serves every fill
    const HostArena buffers[2] = {HostArena(static_cast<std::size_t>(largest)),
                                  HostArena(pipelines ? static_cast<std::size_t>(largest) : 0)};
    std::future<void> writing;  // the previous fill's bytes into the sink
    auto written = [&] {        // waits for it; rethrows its error
      if (writing.valid()) writing.get();
    };
    struct Drain {  // however this ends, no write still uses a buffer or the sink
      std::future<void>& w;
      ~Drain() {
        if (w.valid()) w.wait();
      }
    } drain{writing};
    int next = 0;
    for (std::size_t i = 0; i < tensors_.size();) {
      const Pending& p = tensors_[i];
      if (p.data != nullptr || !p.fill) {
        written();
        data_out(p.data, p.info.bytes());
        ++i;
        continue;
      }
      const std::span<std::byte> out(buffers[next].data(), static_cast<std::size_t>(fill_bytes(i)));
      try {
        p.fill(out);
      } catch (const std::exception& e) {
        fail_tensor_as(kind_of(e), p.info.name, "producing its bytes failed: ", detail::message_of(e));
      }
      written();
      i += p.together;
      if (out.size() < pipelined_fill_bytes) {
        data_out(out.data(), out.size());  // done with this buffer: the next fill reuses it
        continue;
      }
      writing = std::async(std::launch::async, [&data_out, out] { data_out(out.data(), out.size()); });
      next ^= 1;
    }
    written();
    if (hasher) {  // the placeholder's digits, now known
      const std::string value = hasher->finish().format();
      sink.overwrite(data_checksums_offset(h, data_bytes_, sink.path().string(), checksum_chunk_), value.data(),
                     value.size());
    }
  }

  // With checksum_data(), the whole-file XXH64 is not computed (0): the digests are.
  WriteResult write(const std::filesystem::path& path) const {
    return write_file_atomically(path, [this](FileSink& sink) { write_to(sink); },
                                 checksum_chunk_ ? Hashing::none : Hashing::whole_file);
  }

 private:
  struct Pending {
    TensorInfo info;
    const void* data = nullptr;
    Fill fill;
    std::size_t together = 1;  // tensors the fill produces: this one and the ones after it
  };

  template <class... Parts>
  [[noreturn]] static void fail_tensor(const std::string& name, Parts&&... parts) {
    fail_tensor_as(ErrorKind::misuse, name, std::forward<Parts>(parts)...);
  }
  template <class... Parts>
  [[noreturn]] static void fail_tensor_as(ErrorKind kind, const std::string& name, Parts&&... parts) {
    fsdp::detail::fail_as(kind, "safetensors writer: tensor '", name, "': ", std::forward<Parts>(parts)...);
  }

  // The bytes of a tensor that may be added; throws naming it if it may not.
  std::uint64_t checked_new_bytes(const std::string& name, DType dtype, const Shape& shape) const {
    if (name.empty()) fail_tensor(name, "the name is empty");
    if (name.rfind("__", 0) == 0) fail_tensor(name, "names starting with \"__\" are reserved by the format");
    try {
      detail::json_string(name);
    } catch (const nlohmann::json::exception&) {
      fail_tensor(name, "the name is not valid UTF-8");
    }
    if (names_.count(name) != 0) fail_tensor(name, "added twice");
    for (std::int64_t d : shape)
      if (d < 0) fail_tensor(name, "shape ", detail::format_shape(shape), " has a negative dimension");
    const auto bytes = detail::checked_bytes(shape, dtype);
    std::uint64_t end;
    if (!bytes || __builtin_add_overflow(data_bytes_, *bytes, &end))
      fail_tensor(name, "shape ", detail::format_shape(shape), " of ", safetensors_dtype_name(dtype),
                  " overflows 64-bit byte offsets");
    return *bytes;
  }

  Pending& push(std::string name, DType dtype, Shape shape, std::uint64_t bytes) {
    names_.insert(name);
    tensors_.push_back({TensorInfo{std::move(name), dtype, std::move(shape), data_bytes_, data_bytes_ + bytes}, nullptr, {}, 1});
    data_bytes_ += bytes;
    return tensors_.back();
  }

  std::vector<Pending> tensors_;
  std::set<std::string, std::less<>> names_;
  std::map<std::string, std::string, std::less<>> metadata_;
  std::uint64_t data_bytes_ = 0;
  std::uint64_t checksum_chunk_ = 0;  // 0: no data checksums
  std::uint64_t save_id_ = 0;         // 0: not marked as fsdp's (mark_fsdp_file)
};

}  // namespace fsdp::checkpoint
