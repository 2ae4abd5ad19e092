#pragma once
// SafetensorsFile: reads a safetensors file through positioned reads on one descriptor.
// open() validates the whole header against the file's size before any tensor is read
// (see safetensors_header.hpp), so a truncated, padded or corrupt file is refused with an
// error naming the file and the key instead of yielding garbage. Reads are bounded: a file
// that shrinks after open() is an error, never a hang or stale bytes.
//
// Thread safety: const member functions may be called concurrently (pread has no shared
// file position).
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/checkpoint/file_io.hpp"
#include "fsdp/checkpoint/safetensors_header.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp::checkpoint {

class SafetensorsFile {
 public:
  static SafetensorsFile open(const std::filesystem::path& path) {
    SafetensorsFile f;
    f.path_ = path;
    f.fd_ = detail::open_fd(path, O_RDONLY, "to read a safetensors file");
    f.file_bytes_ = detail::file_size_of(f.fd_.get(), path);
    const std::string name = path.string();
    if (f.file_bytes_ < 8)
      detail::fail_as(ErrorKind::corrupt, "safetensors file '", name, "': ", f.file_bytes_,
                      " bytes is too short to hold the 8-byte header length");
    std::uint64_t n = 0;
    f.read_at(&n, 8, 0, "the header length");
    if (n == 0) detail::fail_as(ErrorKind::corrupt, "safetensors file '", name, "': the header length is 0");
    if (n > max_safetensors_header_bytes)
      detail::fail_as(ErrorKind::corrupt, "safetensors file '", name, "': the header length ", n,
                      " is over the limit of ", max_safetensors_header_bytes, " bytes (corrupt length?)");
    if (n > f.file_bytes_ - 8)
      detail::fail_as(ErrorKind::corrupt, "safetensors file '", name, "': the header length ", n,
                      " runs past the end of the file (", f.file_bytes_, " bytes; truncated?)");
    std::string json(n, '\0');
    f.read_at(json.data(), n, 8, "the header");
    f.header_bytes_ = n;
    SafetensorsHeader h = parse_safetensors_header(json, f.file_bytes_ - 8 - n, name);
    f.tensors_ = std::move(h.tensors);
    f.metadata_ = std::move(h.metadata);
    for (std::size_t i = 0; i < f.tensors_.size(); ++i) f.by_name_.emplace(f.tensors_[i].name, i);
    return f;
  }

  const std::filesystem::path& path() const { return path_; }
  // In data order (by byte offset).
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const std::map<std::string, std::string, std::less<>>& metadata() const { return metadata_; }
  std::uint64_t header_bytes() const { return header_bytes_; }      // N
  std::uint64_t data_offset() const { return 8 + header_bytes_; }   // where the data buffer starts
  std::uint64_t file_bytes() const { return file_bytes_; }          // size when opened

  // nullptr if the file has no tensor `name`.
  const TensorInfo* find(std::string_view name) const {
    auto it = by_name_.find(name);
    return it == by_name_.end() ? nullptr : &tensors_[it->second];
  }
  // The tensor `name`; an error naming the file and the key if there is none.
  const TensorInfo& at(std::string_view name) const {
    if (const TensorInfo* t = find(name)) return *t;
    detail::fail("safetensors file '", path_.string(), "': no tensor '", name, "'");
  }

  // The whole tensor into dst, which must have exactly its bytes.
  void read(std::string_view name, void* dst, std::uint64_t dst_bytes) const {
    const TensorInfo& t = at(name);
    if (dst_bytes != t.bytes())
      detail::fail("safetensors file '", path_.string(), "': tensor '", name, "' has ", t.bytes(),
                   " bytes but the destination has ", dst_bytes);
    read_bytes(name, 0, dst_bytes, dst);
  }

  // Bytes [byte_offset, byte_offset + n) of the tensor into dst (partial reads for
  // resharding).
  void read_bytes(std::string_view name, std::uint64_t byte_offset, std::uint64_t n, void* dst) const {
    const TensorInfo& t = at(name);
    if (byte_offset > t.bytes() || n > t.bytes() - byte_offset)
      detail::fail("safetensors file '", path_.string(), "': tensor '", name, "': bytes [", byte_offset, ", +", n,
                   ") are outside its ", t.bytes(), " bytes");
    read_at(dst, n, data_offset() + t.begin + byte_offset, "tensor '" + t.name + "'");
  }

  // Elements [element_offset, element_offset + count) of the tensor, in its own dtype.
  void read_elements(std::string_view name, std::uint64_t element_offset, std::uint64_t count, void* dst) const {
    const TensorInfo& t = at(name);
    const std::uint64_t numel = t.numel();
    if (element_offset > numel || count > numel - element_offset)
      detail::fail("safetensors file '", path_.string(), "': tensor '", name, "': elements [", element_offset, ", +",
                   count, ") are outside its ", numel, " elements");
    read_bytes(name, element_offset * size_of(t.dtype), count * size_of(t.dtype), dst);
  }

  // Bytes [offset, offset + n) of the file itself (header included), for readers that
  // stream a whole file; an error naming the file if they are not all there.
  void read_file_bytes(void* dst, std::uint64_t n, std::uint64_t offset) const {
    if (offset > file_bytes_ || n > file_bytes_ - offset)
      detail::fail("safetensors file '", path_.string(), "': bytes [", offset, ", +", n, ") are outside its ", file_bytes_, " bytes");
    read_at(dst, n, offset, "bytes at " + std::to_string(offset));
  }
  // Where tensor `name`'s element `element_offset` is in the file; an error if outside it.
  std::uint64_t file_offset_of(std::string_view name, std::uint64_t element_offset, std::uint64_t count) const {
    const TensorInfo& t = at(name);
    if (element_offset > t.numel() || count > t.numel() - element_offset)
      detail::fail("safetensors file '", path_.string(), "': tensor '", name, "': elements [", element_offset, ", +",
                   count, ") are outside its ", t.numel(), " elements");
    return data_offset() + t.begin + element_offset * size_of(t.dtype);
  }

  // XXH64 of the whole file (all file_bytes()), read now; compare with an index's checksum.
  std::uint64_t xxh64() const { return detail::xxh64_of_fd(fd_.get(), file_bytes_, path_); }

 private:
  SafetensorsFile() = default;

  void read_at(void* dst, std::uint64_t n, std::uint64_t offset, const std::string& what) const {
    const std::uint64_t got = detail::pread_up_to(fd_.get(), dst, n, offset, path_);
    if (got != n)
      detail::fail_as(ErrorKind::corrupt, "safetensors file '", path_.string(), "': reading ", what,
                      " hit the end of the file at byte ", offset + got, " (it had ", file_bytes_,
                      " bytes when opened; truncated since?)");
  }

  std::filesystem::path path_;
  detail::UniqueFd fd_;
  std::uint64_t file_bytes_ = 0;
  std::uint64_t header_bytes_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, std::string, std::less<>> metadata_;
  std::map<std::string, std::size_t, std::less<>> by_name_;
};

}  // namespace fsdp::checkpoint
