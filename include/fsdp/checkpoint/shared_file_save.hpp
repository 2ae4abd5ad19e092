#pragma once
// A full checkpoint written by every rank at once, where the ranks share a file system (one
// host, or a cluster file system): rank 0 creates the files at their final size with their
// headers; every rank writes the slices it saves (the parameters and optimizer states of
// its shards; rank 0 also the buffers) at their offsets; rank 0 then publishes both files
// together as the gathering save does (publish_full_files: one commit, journaled). Nothing is
// gathered: each byte is copied once, by the rank that holds it, and the ranks write in
// parallel. The files are byte for byte those the gathering save writes.
//
// Whether the file system is shared is found out, not assumed: the temporary names carry a
// random token that rank 0 draws and every rank learns; a rank that cannot open them (its
// own disk on another host) makes every rank give up before a byte of data is written, and
// the caller gathers to rank 0 instead.
#include <fcntl.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "fsdp/checkpoint/checkpoint_collective.hpp"
#include "fsdp/checkpoint/file_io.hpp"
#include "fsdp/checkpoint/full_save.hpp"
#include "fsdp/checkpoint/save_id.hpp"
#include "fsdp/checkpoint/state_dict.hpp"

namespace fsdp::detail {

// This rank's run of the data section's chunks (DataChecksums::owner), hashed from the
// file (`fd`, open for reading and writing) and written over their zero digits in the
// header's placeholder (at `digits_at` in the file): every rank fills in its own, so the
// digests need no collective.
inline void write_my_digests(int fd, const std::filesystem::path& file, std::uint64_t data_begin, std::uint64_t data_bytes,
                             std::uint64_t digits_at, const Unit& unit) {
  const auto chunks = checkpoint::DataChecksums::placeholder(data_bytes);
  const auto read = [&](std::byte* dst, std::uint64_t n, std::uint64_t at) {
    if (checkpoint::detail::pread_up_to(fd, dst, n, data_begin + at, file) != n)
      fail_as(ErrorKind::io, "'", file.string(), "' is shorter than the data written into it");
  };
  checkpoint::hash_owned_chunks(chunks, data_bytes, fsdp::detail::internals(unit).rank(), fsdp::detail::internals(unit).world_size(), read,
                                [&](std::size_t c, std::uint64_t digest) {
                                  const std::string hex = checkpoint::xxh64_hex(digest);
                                  checkpoint::detail::pwrite_all(fd, hex.data(), hex.size(), digits_at + chunks.digits_at(c), file);
                                });
}

// A collective. false: the shards are not in host memory, or some rank cannot open rank 0's
// files; nothing was written and nothing is left. true: the checkpoint is committed, and
// rank 0's `recovered` (if given) says what its commit found of interrupted saves.
// Throws on every rank when the save fails; the target files are then untouched.
inline bool save_full_shared(const FullSave& save, ShardedModel& model, OptimizerState* optimizer,
                             std::vector<std::string>* recovered = nullptr) {
  if (model.size() == 0) return false;
  const bool root = fsdp::detail::internals(model[0]).rank() == 0;
  bool host = true;
  for (auto& u : model) host = host && fsdp::detail::internals(*u).device_id().kind == DeviceKind::cpu;
  if (!fsdp::detail::internals(model[0]).all_ranks_agree(host)) return false;

  struct File {
    std::filesystem::path target, temp;
    checkpoint::SafetensorsWriter layout;
    std::string header;  // rank 0's (only its header has the optimizer's scalars)
    std::uint64_t header_bytes = 0;  // its size, on every rank
    std::uint64_t digests_at = 0;    // where its data checksums' value starts, on every rank
    std::map<std::string, std::uint64_t, std::less<>> offset;  // of each tensor's first byte in the file
    checkpoint::detail::UniqueFd fd;
  };
  std::vector<File> files(save.saves_optimizer() ? 2 : 1);  // the model's, then the optimizer's
  checkpoint::SafetensorsWriter unused;
  save.describe(files.size() == 2 ? files[1].layout : unused, files[0].layout);
  files[0].target = save.file();
  if (files.size() == 2) files[1].target = optimizer_file_of(save.file());

  // new_save_id: random, mixed with the clock and the pid, in [1, 2^63).
  const std::int64_t token = fsdp::detail::internals(model[0]).max_over_ranks(
      root ? static_cast<std::int64_t>(checkpoint::new_save_id()) : 0);
  for (File& f : files) {
    f.temp = checkpoint::detail::temp_path_for(f.target, "shared-" + std::to_string(token));
    if (root) f.header = f.layout.header();
    f.header_bytes = static_cast<std::uint64_t>(fsdp::detail::internals(model[0]).max_over_ranks(root ? std::int64_t(f.header.size()) : 0));
    f.digests_at = static_cast<std::uint64_t>(fsdp::detail::internals(model[0]).max_over_ranks(
        root ? std::int64_t(checkpoint::data_checksums_offset(f.header, f.layout.data_bytes(), f.temp.string())) : 0));
    for (const auto& t : f.layout.layout()) f.offset[t.name] = 8 + f.header_bytes + t.begin;
  }
  std::vector<checkpoint::StagedFile> staged;  // rank 0's temporary files: removed unless committed
  const std::string what = "save_full_checkpoint '" + save.file().string() + "'";
  run_agreed(model, what, [&] {  // rank 0 creates the files at their size, headers in place
    if (!root) return;
    for (File& f : files) {
      f.fd = checkpoint::detail::open_fd(f.temp, O_RDWR | O_CREAT | O_EXCL, "to write a temporary file");
      staged.emplace_back(f.temp, f.target, checkpoint::detail::hold_file_lock(f.fd.get()));
      checkpoint::detail::check_still_linked(f.fd.get(), f.temp);  // not removed before it was locked
      const std::uint64_t n = f.header.size();
      checkpoint::detail::pwrite_all(f.fd.get(), &n, sizeof n, 0, f.temp);
      checkpoint::detail::pwrite_all(f.fd.get(), f.header.data(), n, 8, f.temp);
      if (::ftruncate(f.fd.get(), static_cast<off_t>(8 + n + f.layout.data_bytes())) != 0)
        fail_as(ErrorKind::io, "cannot size '", f.temp.string(), "': ", checkpoint::detail::errno_text(errno));
    }
  }, "; nothing was saved");
  bool opened = true;
  if (!root)
    for (File& f : files) {
      const int fd = ::open(f.temp.c_str(), O_RDWR | O_CLOEXEC);  // read too: the data checksums
      opened = opened && fd >= 0;
      f.fd = checkpoint::detail::UniqueFd(fd);
    }
  if (!fsdp::detail::internals(model[0]).all_ranks_agree(opened)) return false;  // not one file system: gather instead

  run_agreed(model, what, [&] {  // every rank writes what it saves
    for (const SliceSource& s : sharded_slice_sources(model, optimizer)) {
      if (s.count == 0) continue;
      File& f = files[s.id.kind == StateKind::optim ? 1 : 0];
      const std::uint64_t at = f.offset.at(full_file_key(s.id)) + static_cast<std::uint64_t>(s.begin) * size_of(s.dtype);
      checkpoint::detail::pwrite_all(f.fd.get(), s.src, s.bytes(), at, f.temp);
    }
  }, "; nothing was saved");

  run_agreed(model, what, [&] {  // once every byte is in: each rank its data checksums
    for (File& f : files) {
      write_my_digests(f.fd.get(), f.temp, 8 + f.header_bytes, f.layout.data_bytes(), f.digests_at, model[0]);
      checkpoint::detail::fsync_fd(f.fd.get(), f.temp);
      f.fd.close_checked(f.temp);
    }
  }, "; nothing was saved");

  run_agreed(model, what, [&] {  // rank 0 publishes both together, as the gathering save does
    if (!root) return;
    std::vector<checkpoint::StagedFile> in_order;  // the optimizer file first
    for (std::size_t i = staged.size(); i-- > 0;) in_order.push_back(std::move(staged[i]));
    auto found = publish_full_files(save.file(), in_order, save.saves_optimizer(), save.save_id());
    if (recovered) *recovered = std::move(found);
  });
  return true;
}

}  // namespace fsdp::detail
