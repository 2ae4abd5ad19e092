#pragma once
// A small sharded checkpoint written the way save_sharded_checkpoint writes one: N
// "ranks" each write a slice of every tensor (FSDP-style contiguous ranges, so the last
// ranks may own nothing and write a count-0 slice) into their own file in a staging
// directory, then the index goes next to them and the directory is committed. Values
// encode (generation, tensor, element), so a reader can check every element it gets.
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include <fsdp/checkpoint/checkpoint_directory.hpp>
#include <fsdp/checkpoint/checkpoint_index.hpp>
#include <fsdp/checkpoint/safetensors.hpp>
#include <fsdp/checkpoint/sharded_checkpoint_reader.hpp>

namespace test_support {

struct FixtureTensor {
  fsdp::StateKey id;
  fsdp::DType dtype;
  fsdp::checkpoint::Shape shape;
};

inline std::vector<FixtureTensor> fixture_tensors() {
  using fsdp::DType;
  using fsdp::StateKey;
  return {{StateKey::param("fc.weight"), DType::f32, {37}},
          {StateKey::buffer("bn.mean"), DType::f64, {5}},
          {StateKey::optim("fc.weight", "exp_avg"), DType::f32, {37}},
          {StateKey::optim("fc.weight", "step"), DType::i64, {}},
          {StateKey::param("empty"), DType::bf16, {0}}};
}

// Element i of tensor t in generation g, exactly representable in each dtype used here.
inline double fixture_value(int g, std::size_t t, std::uint64_t i) {
  return static_cast<double>(g * 1000 + static_cast<int>(t) * 100) + static_cast<double>(i);
}

inline std::uint64_t fixture_numel(const FixtureTensor& t) {
  return static_cast<std::uint64_t>(fsdp::checked_numel(t.shape, {}));
}

// [begin, count) of rank r of n over `numel` elements: ceil(numel / n) each.
inline std::pair<std::uint64_t, std::uint64_t> fixture_range(std::uint64_t numel, int n, int r) {
  const std::uint64_t shard = (numel + n - 1) / n;
  const std::uint64_t begin = std::min(numel, shard * r);
  return {begin, std::min(numel, begin + shard) - begin};
}

inline std::string fixture_key(const fsdp::StateKey& id) {
  return id.kind == fsdp::StateKind::optim ? id.fqn + "." + id.state : id.fqn;
}

// Writes generation g from n ranks into the staging directory of `dir`. `on_tensor` runs
// before each tensor's bytes are produced (a hook for kill tests).
inline void write_fixture(const fsdp::checkpoint::CheckpointDirectory& dir, int n, int g,
                          const std::function<void()>& on_tensor = {}) {
  using namespace fsdp::checkpoint;
  const auto tensors = fixture_tensors();
  CheckpointIndex index;
  index.world_size = n;
  index.save_id = new_save_id();
  index.metadata = {{"generation", std::to_string(g)}, {"step", std::to_string(10 * g)}};
  for (const auto& t : tensors) index.entries.push_back({t.id, t.dtype, t.shape});
  for (int r = 0; r < n; ++r) {
    SafetensorsWriter writer;
    writer.mark_fsdp_file(index.save_id);  // as fsdp's rank files are: header checksum, save id
    nlohmann::json places = nlohmann::json::object();  // fsdp.slices, which the reader checks against the index
    for (std::size_t ti = 0; ti < tensors.size(); ++ti) {
      const FixtureTensor& t = tensors[ti];
      const auto range = fixture_range(fixture_numel(t), n, r);  // not bound: the lambda captures both
      const auto begin = range.first, count = range.second;
      writer.add(fixture_key(t.id), t.dtype, {static_cast<std::int64_t>(count)},
                 [=, &on_tensor](std::span<std::byte> out) {
                   if (on_tensor) on_tensor();
                   for (std::uint64_t i = 0; i < count; ++i)
                     fsdp::store_from_double(out.data(), i, t.dtype, fixture_value(g, ti, begin + i));
                 });
      index.slices.push_back({t.id, rank_file_name(r), fixture_key(t.id), begin, count});
      places[fixture_key(t.id)] = {{"kind", fsdp::name_of(t.id.kind)}, {"state", t.id.state}, {"fqn", t.id.fqn},
                                   {"dtype", safetensors_dtype_name(t.dtype)}, {"shape", t.shape},
                                   {"begin", begin}, {"count", count}};
    }
    writer.set_metadata(std::string(slices_key), places.dump());
    const WriteResult written = writer.write(dir.file(rank_file_name(r)));
    index.files.push_back({rank_file_name(r), written.bytes, written.xxh64});
  }
  index.save(dir.file(std::string(index_file_name)));
}

// A committed checkpoint of generation g from n ranks at `dir`.
inline void save_fixture(const std::filesystem::path& dir, int n, int g) {
  fsdp::checkpoint::CheckpointDirectory d = fsdp::checkpoint::CheckpointDirectory::begin(dir);
  write_fixture(d, n, g);
  d.commit();
}

// Reads the whole checkpoint as m ranks would and checks every element against
// generation g. Returns g as the index's metadata says.
inline int check_fixture(const std::filesystem::path& dir, int m) {
  using namespace fsdp::checkpoint;
  const ShardedCheckpointReader reader(dir);
  const int g = std::stoi(reader.index().metadata.at("generation"));
  const auto tensors = fixture_tensors();
  for (std::size_t ti = 0; ti < tensors.size(); ++ti) {
    const FixtureTensor& t = tensors[ti];
    for (int r = 0; r < m; ++r) {
      const auto [begin, count] = fixture_range(fixture_numel(t), m, r);
      std::vector<std::byte> out(count * fsdp::size_of(t.dtype));
      reader.read(t.id, begin, count, out.data(), out.size());
      for (std::uint64_t i = 0; i < count; ++i)
        if (fsdp::load_as_double(out.data(), i, t.dtype) != fixture_value(g, ti, begin + i))
          throw std::runtime_error("element " + std::to_string(begin + i) + " of " + t.id.describe() + " is wrong");
    }
  }
  return g;
}

}  // namespace test_support
