// torch::optim state in the library's checkpoints (fsdp::torch::OptimizerState): a libtorch
// model trained on 2 ranks, saved with its AdamW (or SGD momentum) state, loaded on 3 ranks
// (the shards cut the parameters elsewhere) and trained on, matches unsharded libtorch
// trained through the same batches without a break. Also what the bridge refuses.
#include "test/torch/torch_doctest.hpp"  // first: see there

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <fsdp/checkpoint/sharded_checkpoint.hpp>
#include <fsdp/fsdp.hpp>
#include "fsdp/torch/sharded_module.hpp"
#include "test/torch/torch_model.hpp"

namespace torch_optimizer_state_test {

using torch_test::batch;
using torch_test::make_net;

using torch_test::make_optimizer;
using torch_test::Opt;

// Unsharded: steps [0, steps), step s over the batches of world_at(s) ranks.
std::vector<std::pair<std::string, torch::Tensor>> reference(Opt o, int steps, const std::function<int(int)>& world_at) {
  auto net = make_net();
  auto opt = make_optimizer(o, net->parameters());
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    std::vector<torch::Tensor> xs, ys;
    for (int rank = 0; rank < world_at(step); ++rank) {
      auto [x, y] = batch(step, rank);
      xs.push_back(x), ys.push_back(y);
    }
    torch::mse_loss(net->forward(torch::cat(xs)), torch::cat(ys)).backward();
    opt->step();
  }
  return torch_test::values(*net);
}

// Sharded over `world` ranks: load `from` (if not empty; the optimizer's state too unless
// `model_only`), train steps [first, last), save to `to` (if not empty); the full
// parameters at the end.
std::vector<std::pair<std::string, torch::Tensor>> train(Opt o, int world, int first, int last,
                                                         const std::filesystem::path& from,
                                                         const std::filesystem::path& to, bool model_only = false) {
  std::vector<torch_test::Net> nets;
  for (int r = 0; r < world; ++r) nets.push_back(make_net());
  std::vector<std::pair<std::string, torch::Tensor>> out;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    torch_test::Net& net = nets[comm.rank()];
    fsdp::HostDevice device;
    auto model = fsdp::torch::shard<fsdp::FullShard>(net, comm, device, fsdp::torch::wrap_type<torch_test::BlockImpl>());
    auto opt = make_optimizer(o, model.parameters());
    auto state = model.optimizer_state(*opt);
    if (!from.empty()) fsdp::load_sharded_checkpoint(from, model.sharded(), model_only ? nullptr : &state);
    for (int step = first; step < last; ++step) {
      opt->zero_grad();
      auto [x, y] = batch(step, comm.rank());
      torch::mse_loss(model.forward(x), y).backward();
      opt->step();
    }
    if (!to.empty()) fsdp::save_sharded_checkpoint(to, model.sharded(), &state);
    auto summon = model.sharded().summon_full_params();
    if (comm.rank() == 0) out = torch_test::values(*net);
  });
  return out;
}

void check_same(const std::vector<std::pair<std::string, torch::Tensor>>& got,
                const std::vector<std::pair<std::string, torch::Tensor>>& want) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(got[i].first);
    CHECK(got[i].first == want[i].first);
    CHECK((got[i].second - want[i].second).abs().max().item<double>() <= 1e-10);
  }
}

std::filesystem::path scratch(const std::string& name) {
  const char* base = std::getenv("TEST_TMPDIR");
  auto dir = std::filesystem::path(base ? base : std::filesystem::temp_directory_path().string()) / name;
  std::filesystem::remove_all(dir);
  return dir;
}

TEST_CASE("AdamW and SGD momentum state saved on 2 ranks and loaded on 3 continue as one unsharded run") {
  torch::set_num_threads(1);
  auto world_at = [](int step) { return step < 3 ? 2 : 3; };
  for (Opt o : {Opt::adamw, Opt::sgd}) {
    CAPTURE(o == Opt::sgd ? "SGD" : "AdamW");
    const auto dir = scratch(o == Opt::sgd ? "sgd_ckpt" : "adamw_ckpt");
    train(o, 2, 0, 3, {}, dir);
    check_same(train(o, 3, 3, 5, dir, {}), reference(o, 5, world_at));
  }
}

TEST_CASE("without the optimizer's state the continued run differs (what the test above would miss)") {
  torch::set_num_threads(1);
  const auto dir = scratch("adamw_no_state");
  train(Opt::adamw, 2, 0, 3, {}, dir);
  auto got = train(Opt::adamw, 3, 3, 5, dir, {}, /*model_only=*/true);
  auto want = reference(Opt::adamw, 5, [](int step) { return step < 3 ? 2 : 3; });
  double worst = 0;
  for (std::size_t i = 0; i < got.size(); ++i)
    worst = std::max(worst, (got[i].second - want[i].second).abs().max().item<double>());
  CHECK(worst > 1e-4);
}

TEST_CASE("the bridge refuses an optimizer over other tensors, an unknown optimizer, and another optimizer's state") {
  torch::set_num_threads(1);
  const auto dir = scratch("refusals");
  train(Opt::adamw, 1, 0, 1, {}, dir);
  std::vector<torch_test::Net> nets{make_net()};
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    fsdp::HostDevice device;
    auto model = fsdp::torch::shard<fsdp::FullShard>(nets[0], comm, device, fsdp::torch::wrap_type<torch_test::BlockImpl>());
    auto params = model.parameters();
    params.push_back(torch::zeros({3}));
    torch::optim::SGD other(params, torch::optim::SGDOptions(0.1));
    CHECK_THROWS_WITH_AS(model.optimizer_state(other), doctest::Contains("not one of ShardedModule::parameters()"),
                         fsdp::Error);
    torch::optim::RMSprop rms(model.parameters(), torch::optim::RMSpropOptions(0.1));
    CHECK_THROWS_WITH_AS(model.optimizer_state(rms), doctest::Contains("not a torch::optim::AdamW, Adam or SGD"),
                         fsdp::Error);
    torch::optim::SGD damped(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9).dampening(0.5));
    CHECK_THROWS_WITH_AS(model.optimizer_state(damped), doctest::Contains("dampening"), fsdp::Error);
    // SGD finds no momentum_buffer in an AdamW checkpoint; Adam finds AdamW's moments, and
    // the kind the checkpoint names.
    torch::optim::SGD sgd(model.parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
    auto sgd_state = model.optimizer_state(sgd);
    CHECK_THROWS_WITH_AS(fsdp::load_sharded_checkpoint(dir, model.sharded(), &sgd_state),
                         doctest::Contains("optimizer state 'momentum_buffer' of 'input.weight' is missing"), fsdp::Error);
    torch::optim::Adam adam(model.parameters(), torch::optim::AdamOptions(0.1));
    auto adam_state = model.optimizer_state(adam);
    const auto before = model.parameters()[0].clone();
    CHECK_THROWS_WITH_AS(fsdp::load_sharded_checkpoint(dir, model.sharded(), &adam_state),
                         doctest::Contains("AdamW's, not Adam's"), fsdp::Error);
    CHECK(torch::equal(model.parameters()[0], before));  // refused before anything was loaded
  });
}

}  // namespace torch_optimizer_state_test
