// bench/compile_cost.sh compiles this file twice: with -DWITH_FSDP, an engine's training
// file on fsdp (fsdp/fsdp.hpp, the reference engine's integration header,
// fsdp::shard<fsdp::FullShard> on its model over thread ranks, one sharded training step);
// without, the same engine alone (its model and optimizer, the same standard headers, one
// unsharded step), the baseline the cost of including the library is measured against.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "examples/engine/model.hpp"
#include "examples/engine/optim.hpp"
#ifdef WITH_FSDP
#include <fsdp/fsdp.hpp>

#include "examples/engine/fsdp_integration.hpp"
#endif

namespace {
const engine::ModelConfig kConfig{.in = 4, .dim = 8, .hidden = 16, .out = 2, .blocks = 2, .seed = 1};
}

int main() {
  double loss = 0;
#ifdef WITH_FSDP
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(kConfig);
    fsdp::HostDevice device;
    auto sharded = fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{});
    engine::Sgd sgd(0.1f);
    const double l = engine::sharded_step(model, sharded, sgd, engine::make_batch(kConfig, 0, comm.rank() * 2, 2));
    if (comm.rank() == 0) loss = l;
  });
#else
  engine::Model model(kConfig);
  engine::Sgd sgd(0.1f);
  const engine::Batch batch = engine::make_batch(kConfig, 0, 0, 4);
  engine::Mat dout;
  loss = engine::mse(model.forward(batch.x), batch.y, dout);
  model.backward(dout);
  std::vector<engine::Slot> slots;
  for (auto& p : engine::named_parameters(model)) slots.push_back({p.param->data(), p.grad->data(), p.param->numel()});
  sgd.step(slots);
#endif
  return loss > 0 ? 0 : 1;
}
