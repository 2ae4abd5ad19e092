#pragma once
// OptimizerState: what checkpoints need from the engine's optimizer, which stays the
// engine's. Its per-element state (AdamW's moments) lives next to the model's flat shards,
// one array per ShardView with the same element count; the library converts it to
// per-FQN form and back through the ParamViews, so it reshards with the parameters.
// Scalars (the step count) travel as strings.
#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/core/dtype.hpp"

namespace fsdp {

class OptimizerState {
 public:
  virtual ~OptimizerState() = default;
  // The per-element states, e.g. {"exp_avg", "exp_avg_sq"}; none for plain SGD.
  virtual std::vector<std::string> state_names() const = 0;
  virtual DType state_dtype(std::string_view name) const = 0;
  // The array of state `name` for the model's shards()[shard] (`numel` valid elements, in
  // the shard's memory space), created zeroed if the optimizer has not stepped yet.
  virtual void* state(std::string_view name, std::size_t shard, std::int64_t numel) = 0;
  virtual std::map<std::string, std::string> scalars() const = 0;
  virtual void load_scalars(const std::map<std::string, std::string>& scalars) = 0;
  // Called before a load writes anything, with the scalars load_scalars will get: throw to
  // refuse state that is not this optimizer's (another kind of optimizer), so that nothing
  // is loaded. The default accepts everything.
  virtual void check_scalars(const std::map<std::string, std::string>& /*scalars*/) const {}
};

}  // namespace fsdp
