#pragma once
// Checkpoints on disk, saved by N ranks and loaded by any M:
//  - sharded: a directory of per-rank safetensors files plus index.json, committed
//    atomically (fsdp/checkpoint/sharded_checkpoint.hpp);
//  - full: one plain safetensors file of whole tensors under their FQNs, the optimizer's
//    state in a sibling file (fsdp/checkpoint/full_checkpoint.hpp);
//  - either, written on a background thread while training goes on
//    (fsdp/checkpoint/async_checkpoint.hpp).
// Every save and load is a collective; a rank that fails makes every rank fail, and a load
// verifies everything before it writes into the model or the optimizer.
#include <filesystem>
#include <map>
#include <string>

#include "fsdp/checkpoint/async_checkpoint.hpp"
#include "fsdp/checkpoint/full_checkpoint.hpp"
#include "fsdp/checkpoint/peer_checkpoint.hpp"
#include "fsdp/checkpoint/sharded_checkpoint.hpp"

namespace fsdp {

// The user metadata a checkpoint was saved with: a sharded checkpoint directory's (its
// index, without the optimizer's scalars) or a full checkpoint file's __metadata__. Not a
// collective; it does not verify checksums.
inline std::map<std::string, std::string> read_checkpoint_metadata(const std::filesystem::path& path) {
  // What a load would read: the committed copy (a sharded commit interrupted between its
  // renames leaves it as <dir>.old-fsdp-<hex>; a full commit past its journal, under a temporary name).
  const auto dir = checkpoint::committed_checkpoint_dir(path);
  if (std::filesystem::is_directory(dir))
    return detail::user_metadata(checkpoint::CheckpointIndex::load(dir / std::string(checkpoint::index_file_name)).metadata);
  const auto files = checkpoint::committed_files(detail::full_checkpoint_targets(path));
  return checkpoint::without_data_checksums(checkpoint::SafetensorsFile::open(files[0] ? *files[0] : path).metadata());
}

}  // namespace fsdp
