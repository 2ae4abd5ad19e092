#pragma once
// Training steps of the reference engine over a FaultyComm, on any backend, recording every
// value the engine was shown: a unit's full parameters as each pre_forward / pre_backward
// returned, the gradient shards as finish_backward returned, the parameter shards after
// each optimizer step. "No wrong value computed first" is then checkable: a run with a
// fault must have shown each rank a prefix of what a clean run showed it, and applied no
// optimizer step from the one its fault fell in.
#include <doctest/doctest.h>

#include <cstdint>
#include <map>
#include <string>
#include <type_traits>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "test/faults/faulty_comm.hpp"

namespace test_support {

// What one rank went through.
struct RankRun {
  std::vector<std::string> shown;       // "<what> <unit> <fingerprint>", as each hook returned
  std::vector<long> issued_after_step;  // this rank's collectives so far, after each step
  int steps = 0;                        // optimizer steps applied
  std::size_t live_after = 0;           // the Device's live bytes once the model was gone
};

// Every rank's fsdp::Error message ("" if none) and what it went through, in one run.
struct Outcome {
  std::vector<std::string> errors;
  std::vector<RankRun> runs;
};

// The model the fault tests train: the reference engine's, with two blocks.
inline engine::ModelConfig two_blocks() {
  engine::ModelConfig c;
  c.blocks = 2;
  return c;
}

template <class... Ps>
constexpr bool hybrid = (std::is_same_v<Ps, fsdp::HybridShard> || ...) || (std::is_same_v<Ps, fsdp::HybridShardZero2> || ...);

// FNV-1a over the bytes: equal values, equal fingerprints; anything else differs (almost surely).
inline std::uint64_t fingerprint(const void* data, std::size_t bytes, std::uint64_t h = 14695981039346656037ull) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) h = (h ^ p[i]) * 1099511628211ull;
  return h;
}

// engine::UnitHooks, noting the unit's full parameters (the model's tensors, as the engine
// computes with them) each time pre_forward or pre_backward returns.
struct RecordingHooks {
  fsdp::ShardedModel& sm;
  std::map<std::string, engine::Tensor*, std::less<>> by_fqn;
  std::vector<std::string>& shown;

  RecordingHooks(engine::Model& model, fsdp::ShardedModel& s, std::vector<std::string>& out) : sm(s), shown(out) {
    for (auto& p : engine::named_parameters(model)) by_fqn[p.fqn] = p.param;
  }
  template <class M> void before_forward(const M* m) { if (auto* u = sm.find_unit_for(*m)) u->pre_forward(), note("pre_forward", *u); }
  template <class M> void after_forward(const M* m) { if (auto* u = sm.find_unit_for(*m)) u->post_forward(); }
  template <class M> void before_backward(const M* m) { if (auto* u = sm.find_unit_for(*m)) u->pre_backward(), note("pre_backward", *u); }
  template <class M> void after_backward(const M* m) { if (auto* u = sm.find_unit_for(*m)) u->post_backward(); }

  void note(const char* hook, const fsdp::Unit& u) {
    std::uint64_t h = fingerprint(nullptr, 0);
    for (const auto& p : u.parameters()) {
      const engine::Tensor& t = *by_fqn.find(p.fqn)->second;
      h = fingerprint(t.raw(), static_cast<std::size_t>(t.numel()) * fsdp::size_of(t.dtype()), h);
    }
    shown.push_back(std::string(hook) + " " + std::string(fsdp::detail::display_name(u.fqn())) + " " + std::to_string(h));
  }
};

// The fingerprint of this rank's shards: their gradients, or their parameters.
inline std::string shards_fingerprint(const fsdp::ShardedModel& sm, bool grads) {
  std::uint64_t h = fingerprint(nullptr, 0);
  for (const auto& v : sm.shards())
    h = fingerprint(grads ? v.grad : v.param, static_cast<std::size_t>(v.numel) * fsdp::size_of(grads ? v.grad_dtype : v.dtype), h);
  return std::to_string(h);
}

// `steps` SGD steps of the reference model built from `config`, sharded with Ps... over
// FaultyComm(comm, fault) (a 2x2 DeviceMesh of it for the hybrid strategies), each rank on
// its sample of step s; then a barrier over the world, as a job's end meets every rank (on
// a mesh, a fault in one group's last collective is otherwise news to the other group's
// ranks only at their next collective). Fills `run`, and rethrows what ended the run.
template <class... Ps, class Comm>
void train_with_fault(Comm& comm, Fault fault, const engine::ModelConfig& config, int steps, RankRun& run) {
  fsdp::HostDevice device;
  FaultyComm<Comm> faulty(comm, fault);
  engine::Model model(config);
  engine::Sgd sgd(0.05f);
  auto train = [&](auto& group) {
    auto sm = fsdp::shard<Ps...>(model, group, device, engine::Wrap{});
    RecordingHooks hooks(model, sm, run.shown);
    for (int s = 0; s < steps; ++s) {
      const engine::Batch batch = engine::make_batch(config, s, comm.rank(), 1);
      sm.zero_grad();
      engine::Mat dout;
      engine::mse(model.forward(batch.x, hooks), batch.y, dout);
      model.backward(dout, hooks);
      sm.finish_backward();
      run.shown.push_back("gradients " + shards_fingerprint(sm, true));
      sgd.step(engine::slots(sm));
      ++run.steps;
      run.shown.push_back("step " + std::to_string(s) + " " + shards_fingerprint(sm, false));
      run.issued_after_step.push_back(faulty.issued());
    }
  };
  auto live = [&] {
    return device.stats(fsdp::MemorySpace::device).live_bytes + device.stats(fsdp::MemorySpace::host).live_bytes;
  };
  try {
    if constexpr (hybrid<Ps...>) {
      fsdp::DeviceMesh mesh(faulty, fsdp::MeshShape{2, 2});
      train(mesh);
    } else {
      train(faulty);
    }
    faulty.barrier().wait();
  } catch (...) {
    run.live_after = live();
    throw;
  }
  run.live_after = live();
}

// "" if `faulty` is a prefix of `clean`, else the first entry that differs, with both values.
inline std::string first_wrong_value(const std::vector<std::string>& faulty, const std::vector<std::string>& clean) {
  for (std::size_t i = 0; i < faulty.size(); ++i)
    if (i >= clean.size() || faulty[i] != clean[i])
      return "entry " + std::to_string(i) + ": shown '" + faulty[i] + "' where a clean run showed '" +
             (i < clean.size() ? clean[i] : std::string("nothing")) + "'";
  return "";
}

// The step (from 0) in which this rank's collective `at` falls, from a clean run's counts.
inline int step_of(long at, const std::vector<long>& issued_after_step) {
  int s = 0;
  while (s < static_cast<int>(issued_after_step.size()) && issued_after_step[static_cast<std::size_t>(s)] < at) ++s;
  return s;
}

// One rank of a run with a fault (`clean`: the same rank in a run without): it failed, was
// shown nothing a clean run did not show it, applied no step from `fault_step` on (when
// `step_check`), and freed everything.
inline void check_faulty_rank(const std::string& error, const RankRun& run, const RankRun& clean, int fault_step,
                              bool step_check = true) {
  CAPTURE(error);
  CHECK(!error.empty());  // an error, and the run returned: no hang
  CHECK(first_wrong_value(run.shown, clean.shown) == "");
  if (step_check) CHECK(run.steps <= fault_step);
  CHECK(run.live_after == 0);  // everything the units allocated was freed
}

}  // namespace test_support
