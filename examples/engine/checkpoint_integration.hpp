#pragma once
// How the reference engine's AdamW shows its state to fsdp checkpoints: the two moments
// per flat shard (exp_avg, exp_avg_sq, in f32, next to the shards) and the step count.
#include <string>
#include <vector>

#include <fsdp/checkpoint/optimizer_state.hpp>
#include <fsdp/model/sharded_model.hpp>

#include "examples/engine/optim.hpp"

namespace engine {

class AdamWState final : public fsdp::OptimizerState {
 public:
  AdamWState(AdamW& opt, const fsdp::ShardedModel& model) : opt_(opt) {
    for (const auto& v : model.shards()) numels_.push_back(v.numel);
  }
  std::vector<std::string> state_names() const override { return {"exp_avg", "exp_avg_sq"}; }
  fsdp::DType state_dtype(std::string_view) const override { return fsdp::DType::f32; }
  void* state(std::string_view name, std::size_t shard, std::int64_t numel) override {
    if (shard >= numels_.size() || numel != numels_[shard])
      throw fsdp::Error("AdamWState: no shard " + std::to_string(shard) + " of " + std::to_string(numel) + " elements");
    return opt_.moment(name == "exp_avg" ? 0 : 1, shard, numels_);
  }
  std::map<std::string, std::string> scalars() const override { return {{"step", std::to_string(opt_.step_count())}}; }
  void load_scalars(const std::map<std::string, std::string>& s) override {
    auto it = s.find("step");
    if (it == s.end()) throw fsdp::Error("AdamWState: the checkpoint has no optimizer scalar 'step'");
    opt_.set_step_count(std::stol(it->second));
  }

 private:
  AdamW& opt_;
  std::vector<std::int64_t> numels_;
};

}  // namespace engine
