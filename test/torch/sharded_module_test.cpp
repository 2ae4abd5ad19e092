// A libtorch model sharded with fsdp::torch::shard trains as unsharded libtorch does: the
// model's own forward, loss.backward() and a torch::optim optimizer, in every strategy, with
// gradient accumulation, offload and MixedPrecision<bf16, float>. The reference is the same
// model trained unsharded on the union of the ranks' batches (the mean of equal-sized
// per-rank means is the mean over all rows), in double, so the two agree to rounding.
#include "test/torch/torch_doctest.hpp"  // first: see there

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include <torch/torch.h>

#include <fsdp/fsdp.hpp>
#include "fsdp/torch/sharded_module.hpp"
#include "test/support/errors.hpp"
#include "test/torch/torch_model.hpp"

namespace torch_sharded_module_test {

using torch_test::batch;
using torch_test::make_net;

using torch_test::make_optimizer;
using torch_test::Opt;

struct Result {
  std::vector<double> losses;  // per step, the mean over every rank's batches
  std::vector<std::pair<std::string, torch::Tensor>> params;
};

// Unsharded libtorch: `world` ranks' batches of each step, `micro` micro-batches each, as
// one: every micro-batch's loss over all ranks' rows, gradients accumulated.
Result reference(Opt o, int world, int micro, int steps) {
  auto net = make_net();
  auto opt = make_optimizer(o, net->parameters());
  Result r;
  for (int step = 0; step < steps; ++step) {
    opt->zero_grad();
    double loss_sum = 0;
    for (int m = 0; m < micro; ++m) {
      std::vector<torch::Tensor> xs, ys;
      for (int rank = 0; rank < world; ++rank) {
        auto [x, y] = batch(step, rank * micro + m);
        xs.push_back(x), ys.push_back(y);
      }
      auto loss = torch::mse_loss(net->forward(torch::cat(xs)), torch::cat(ys)) / micro;
      loss.backward();
      loss_sum += loss.item<double>();
    }
    opt->step();
    r.losses.push_back(loss_sum);
  }
  r.params = torch_test::values(*net);
  return r;
}

// The same, sharded over `world` thread ranks with policies Ps: each rank its own batches.
template <class... Ps>
Result sharded(Opt o, int world, int micro, int steps, fsdp::MeshShape mesh = {}) {
  std::vector<torch_test::Net> nets;
  for (int r = 0; r < world; ++r) nets.push_back(make_net());
  std::vector<std::vector<double>> losses(world);
  std::vector<std::vector<std::pair<std::string, torch::Tensor>>> finals(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    torch_test::Net& net = nets[comm.rank()];
    fsdp::HostDevice device;
    fsdp::DeviceMesh<fsdp::ThreadComm> m(comm, mesh.size() == world ? mesh : fsdp::MeshShape{1, world});
    auto model = fsdp::torch::shard<Ps...>(net, m, device, fsdp::torch::wrap_type<torch_test::BlockImpl>());
    auto opt = make_optimizer(o, model.parameters());
    for (int step = 0; step < steps; ++step) {
      opt->zero_grad();
      net->zero_grad();  // the model's own zero_grad is safe too
      double loss_sum = 0;
      for (int mi = 0; mi < micro; ++mi) {
        auto [x, y] = batch(step, comm.rank() * micro + mi);
        model.sharded().set_requires_gradient_sync(mi + 1 == micro);
        const torch::Tensor out = model.forward(x);
        auto loss = torch::mse_loss(out.to(torch::kDouble), y) / micro;
        loss.backward();
        loss_sum += loss.item<double>();
      }
      opt->step();
      losses[comm.rank()].push_back(loss_sum);
    }
    auto summon = model.sharded().summon_full_params();
    finals[comm.rank()] = torch_test::values(*net);
  });
  Result r;
  r.params = finals[0];
  for (int s = 0; s < steps; ++s) {
    double sum = 0;
    for (int rank = 0; rank < world; ++rank) sum += losses[rank][s];
    r.losses.push_back(sum / world);
  }
  return r;
}

void check_same(const Result& got, const Result& want, double tolerance) {
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s) CHECK(got.losses[s] == doctest::Approx(want.losses[s]).epsilon(tolerance));
  REQUIRE(got.params.size() == want.params.size());
  for (std::size_t i = 0; i < got.params.size(); ++i) {
    CAPTURE(got.params[i].first);
    CHECK(got.params[i].first == want.params[i].first);
    const double diff = (got.params[i].second - want.params[i].second).abs().max().item<double>();
    CHECK(diff <= tolerance);
  }
}

TEST_CASE("a sharded libtorch model trains as unsharded libtorch, in every strategy") {
  torch::set_num_threads(1);
  for (Opt o : {Opt::sgd, Opt::adamw}) {
    CAPTURE(o == Opt::sgd ? "SGD" : "AdamW");
    const Result want = reference(o, 2, 1, 4);
    SUBCASE("FullShard") { check_same(sharded<fsdp::FullShard>(o, 2, 1, 4), want, 1e-10); }
    SUBCASE("ShardGradOp") { check_same(sharded<fsdp::ShardGradOp>(o, 2, 1, 4), want, 1e-10); }
    SUBCASE("NoShard") { check_same(sharded<fsdp::NoShard>(o, 2, 1, 4), want, 1e-10); }
    SUBCASE("OffloadParams") { check_same(sharded<fsdp::FullShard, fsdp::OffloadParams>(o, 2, 1, 4), want, 1e-10); }
  }
}

TEST_CASE("HybridShard on a 2 x 2 mesh, and three ranks that cut parameters anywhere") {
  torch::set_num_threads(1);
  check_same(sharded<fsdp::HybridShard>(Opt::adamw, 4, 1, 3, fsdp::MeshShape{2, 2}), reference(Opt::adamw, 4, 1, 3), 1e-10);
  check_same(sharded<fsdp::FullShard>(Opt::adamw, 3, 1, 3), reference(Opt::adamw, 3, 1, 3), 1e-10);
}

TEST_CASE("gradient accumulation: micro-batches under no_sync add up as unsharded backwards do") {
  torch::set_num_threads(1);
  check_same(sharded<fsdp::FullShard>(Opt::sgd, 2, 3, 3), reference(Opt::sgd, 2, 3, 3), 1e-10);
}

}  // namespace torch_sharded_module_test

namespace torch_sharded_module_test {

// Whether t's storage holds memory (the unit's parameters are gathered).
bool holds_memory(const torch::Tensor& t) { return t.storage().data() != nullptr; }

TEST_CASE("MixedPrecision<bf16, float>: blocks compute in bf16 and train as float libtorch does, to bf16's precision") {
  torch::set_num_threads(1);
  constexpr int world = 2, steps = 5;
  // The float reference, unsharded.
  auto ref = make_net(torch::kFloat);
  torch::optim::AdamW ref_opt(ref->parameters(), torch::optim::AdamWOptions(0.01));
  std::vector<double> want;
  for (int step = 0; step < steps; ++step) {
    ref_opt.zero_grad();
    auto [x0, y0] = batch(step, 0, 4, torch::kFloat);
    auto [x1, y1] = batch(step, 1, 4, torch::kFloat);
    auto loss = torch::mse_loss(ref->forward(torch::cat({x0, x1})), torch::cat({y0, y1}));
    loss.backward();
    ref_opt.step();
    want.push_back(loss.item<double>());
  }
  std::vector<torch_test::Net> nets;
  for (int r = 0; r < world; ++r) nets.push_back(make_net(torch::kFloat));
  std::vector<std::vector<double>> got(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    torch_test::Net& net = nets[comm.rank()];
    fsdp::HostDevice device;
    auto model = fsdp::torch::shard<fsdp::FullShard, fsdp::MixedPrecision<fsdp::bf16, float>>(
        net, comm, device, fsdp::torch::wrap_type<torch_test::BlockImpl>());
    torch::optim::AdamW opt(model.parameters(), torch::optim::AdamWOptions(0.01));
    auto* block = net->blocks[0]->as<torch_test::BlockImpl>();
    for (int step = 0; step < steps; ++step) {
      opt.zero_grad();
      auto [x, y] = batch(step, comm.rank(), 4, torch::kFloat);
      const torch::Tensor out = model.forward(x);
      CHECK((out.scalar_type() == torch::kBFloat16));  // the head computed in bf16 too
      CHECK((block->seen_dtype == torch::kBFloat16));
      auto loss = torch::mse_loss(out.to(torch::kFloat), y);
      loss.backward();
      opt.step();
      got[comm.rank()].push_back(loss.item<double>());
      // Between steps the master shards stay float, the block's parameter float and freed.
      CHECK((block->fc1->weight.scalar_type() == torch::kFloat));
      CHECK_FALSE(holds_memory(block->fc1->weight));
      CHECK_FALSE(block->fc1->weight.grad().defined());
    }
    for (const auto& p : model.parameters()) CHECK((p.scalar_type() == torch::kFloat));
  });
  for (int s = 0; s < steps; ++s) {
    const double mean = (got[0][s] + got[1][s]) / 2;
    CAPTURE(s);
    CHECK(mean == doctest::Approx(want[s]).epsilon(0.02));
  }
}

TEST_CASE("FullShard frees each block's parameters after its forward and its gradient after its backward") {
  torch::set_num_threads(1);
  std::vector<torch_test::Net> nets{make_net(), make_net()};
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    torch_test::Net& net = nets[comm.rank()];
    fsdp::HostDevice device;
    auto model = fsdp::torch::shard<fsdp::FullShard>(net, comm, device, fsdp::torch::wrap_type<torch_test::BlockImpl>());
    CHECK(model.sharded().size() == 1 + torch_test::depth);
    auto [x, y] = batch(0, comm.rank());
    const torch::Tensor out = model.forward(x);
    CHECK(model.sharded()[0].state() == fsdp::TrainingState::IDLE);
    for (const auto& b : *net->blocks) CHECK_FALSE(holds_memory(b->as<torch_test::BlockImpl>()->fc1->weight));
    torch::mse_loss(out, y).backward();
    for (const auto& p : net->parameters()) {
      CHECK_FALSE(holds_memory(p));
      CHECK_FALSE(p.grad().defined());
    }
    for (auto& u : model.sharded()) CHECK(u->state() == fsdp::TrainingState::IDLE);
    // An evaluation pass (no gradient mode) ends itself: no backward will come.
    {
      torch::NoGradGuard no_grad;
      const torch::Tensor eval = model.forward(x);
      CHECK(eval.sizes() == out.sizes());
    }
    CHECK_FALSE(holds_memory(net->head->weight));
    for (auto& u : model.sharded()) CHECK(u->state() == fsdp::TrainingState::IDLE);
  });
}

TEST_CASE("errors: the model called around the ShardedModule, a parameter that views a larger storage") {
  torch::set_num_threads(1);
  std::vector<torch_test::Net> nets{make_net()};
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    torch_test::Net& net = nets[0];
    fsdp::HostDevice device;
    auto model = fsdp::torch::shard<fsdp::FullShard>(net, comm, device, fsdp::torch::wrap_type<torch_test::BlockImpl>());
    auto [x, y] = batch(0, 0);
    // A block entered through call() outside the ShardedModule's forward (the root's own
    // layers fail inside libtorch: "... out of bounds for storage of size 0").
    auto h = torch::zeros({4, torch_test::dim}, torch::kDouble);
    CHECK_THROWS_WITH_AS(fsdp::torch::call(*net->blocks[0]->as<torch_test::BlockImpl>(), h),
                         doctest::Contains("outside ShardedModule::forward"), fsdp::Error);
    CHECK_THROWS_WITH_AS(net->forward(x), doctest::Contains("storage of size 0"), c10::Error);
  });

  struct Viewing : torch::nn::Module {
    Viewing() { w = register_parameter("w", torch::ones({4, 3}).t()); }
    torch::Tensor w;
  };
  auto viewing = std::make_shared<Viewing>();
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    fsdp::HostDevice device;
    CHECK_THROWS_WITH_AS(fsdp::torch::shard<fsdp::FullShard>(viewing, comm, device),
                         doctest::Contains("not contiguous; the library re-points only tensors that own their storage"),
                         fsdp::Error);
  });
  // The failed take-over gave the tensor its memory back, values included.
  CHECK(viewing->w.sum().item<float>() == 12.0f);
}

TEST_CASE("the 8-bit float dtypes have no libtorch 1.13 scalar type: an fsdp::Error naming the dtype") {
  for (const fsdp::DType t : {fsdp::DType::f8e4m3, fsdp::DType::f8e5m2, fsdp::DType::e8m0}) {
    CAPTURE(fsdp::name_of(t));
    CHECK(test_support::contains(test_support::error_of([&] { (void)fsdp::torch::scalar_type_of(t); }),
                                 "fsdp::torch: dtype " + std::string(fsdp::name_of(t)) + " has no libtorch 1.13 scalar type"));
  }
  CHECK((fsdp::torch::scalar_type_of(fsdp::DType::bf16) == c10::ScalarType::BFloat16));
}

}  // namespace torch_sharded_module_test
