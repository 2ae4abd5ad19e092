#pragma once
// Shared by the state-dict and checkpoint tests: AdamW training of the reference engine on
// N ranks with a hook before and after the steps (a save, a load), a resume on M ranks from
// a fresh model, and a load on 2 ranks that is expected to fail.
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "examples/engine/checkpoint_integration.hpp"
#include "examples/engine/fsdp_integration.hpp"
#include "fsdp/checkpoint/checkpoint_directory.hpp"
#include "test/checkpoint/checkpoint_test_support.hpp"
#include "test/support/errors.hpp"
#include "test/support/reference_training.hpp"

namespace test_support {

using Hook = std::function<void(fsdp::ShardedModel&, engine::AdamWState&, int rank)>;

inline engine::ModelConfig resume_config(std::uint64_t seed = 1) {
  engine::ModelConfig c;
  c.blocks = 3;
  c.seed = seed;
  return c;
}

inline constexpr int kGlobalBatch = 12;  // divisible by 1, 2, 3, 4

// Rank 0's full parameters after uninterrupted training of steps [0, steps).
inline Params uninterrupted_params(int steps) { return reference_params(resume_config(), steps, kGlobalBatch); }

// Steps [first, last) of AdamW training on `world` ranks after `before` on each rank, then
// `after`. Returns rank 0's full parameters.
template <class Strategy>
Params train(int world, int first, int last, std::uint64_t seed, const Hook& before, const Hook& after) {
  const auto c = resume_config(seed);
  std::vector<Params> out(static_cast<std::size_t>(world));
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(c);
    fsdp::HostDevice device;
    auto sm = fsdp::shard<Strategy>(model, comm, device, engine::Wrap{});
    engine::DeviceAllocator<fsdp::HostDevice> alloc(device);
    engine::AdamW opt({}, alloc);
    engine::AdamWState state(opt, sm);
    if (before) before(sm, state, comm.rank());
    const int local = kGlobalBatch / world;
    for (int s = first; s < last; ++s) engine::sharded_step(model, sm, opt, engine::make_batch(c, s, comm.rank() * local, local));
    if (after) after(sm, state, comm.rank());
    out[static_cast<std::size_t>(comm.rank())] = engine::gather_full_parameters(model, sm);
  });
  return out[0];
}

// Steps [3, 6) on m ranks after `load`, with ShardGradOp on odd m and FullShard on even m.
// Seed 7: the fresh model starts elsewhere, so only the load can bring it back.
inline Params resume(int m, const Hook& load) {
  return m % 2 ? train<fsdp::ShardGradOp>(m, 3, 6, 7, load, nullptr) : train<fsdp::FullShard>(m, 3, 6, 7, load, nullptr);
}

// Every rank's error and whether its parameters and optimizer stayed as they were, for a
// load on 2 ranks.
struct FailedLoad {
  std::vector<std::string> errors = std::vector<std::string>(2);
  std::vector<char> untouched = std::vector<char>(2);  // not vector<bool>: ranks write apart
};

inline FailedLoad load_expecting_failure(const Hook& load) {
  FailedLoad out;
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    const auto r = static_cast<std::size_t>(comm.rank());
    engine::Model model(resume_config(7));
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::AdamW opt({});
    engine::AdamWState st(opt, sm);
    const Params before = engine::gather_full_parameters(model, sm);
    out.errors[r] = error_of([&] { load(sm, st, comm.rank()); });
    out.untouched[r] = engine::gather_full_parameters(model, sm) == before && opt.step_count() == 0;
  });
  return out;
}

// Sets the checkpoint commit hook (a failure injected at a commit step) for its lifetime.
struct CommitHookFor {
  explicit CommitHookFor(std::function<void(fsdp::checkpoint::CommitStep, const std::filesystem::path&)> hook) {
    fsdp::checkpoint::detail::commit_hook() = std::move(hook);
  }
  ~CommitHookFor() { fsdp::checkpoint::detail::commit_hook() = nullptr; }
  CommitHookFor(const CommitHookFor&) = delete;
  CommitHookFor& operator=(const CommitHookFor&) = delete;
};

// Whether any of `lines` (a SaveReport's, say) contains `what`.
inline bool mentions(const std::vector<std::string>& lines, const std::string& what) {
  for (const auto& l : lines)
    if (contains(l, what)) return true;
  return false;
}

// A checkpoint file's bytes with its save id and header checksum (which covers the id)
// zeroed: two saves of the same state compare equal.
inline std::string bytes_without_save_id(const std::filesystem::path& file) {
  std::string bytes = read_bytes(file);
  for (const std::string key : {"\"fsdp.save_id\":\"", "\"fsdp.header_xxh64\":\""}) {
    const auto at = bytes.find(key);
    REQUIRE(at != std::string::npos);
    bytes.replace(at + key.size(), 16, std::string(16, '0'));
  }
  return bytes;
}

}  // namespace test_support
