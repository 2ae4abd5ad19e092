#pragma once
// One SGD step (lr 1, no momentum) of a model sharded with fsdp::torch::shard against the same
// model unsharded, for the torch tests that check how the adapter follows libtorch's autograd
// (test/torch/autograd_cases_test.cpp). With lr 1 the step is new = old - grad, so any
// gradient the adapter lost, doubled or misplaced shows in the parameters after the step.
//
// A test passes a `make` (the model, the same initial values on every call) and a `body`
// that runs forward(s) and backward(s) through the `forward` it is given: the model's own
// forward unsharded, ShardedModule::forward sharded.
#include "test/torch/torch_doctest.hpp"  // first: see there

#include <algorithm>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include <torch/torch.h>

#include <fsdp/fsdp.hpp>
#include "fsdp/torch/sharded_module.hpp"
#include "test/torch/torch_model.hpp"

namespace torch_test::one_step {

// Every parameter by FQN (torch_test::values).
using Values = std::vector<std::pair<std::string, torch::Tensor>>;

// Unsharded: zero_grad, `body`, one step.
template <class Make, class Body>
Values reference(Make make, Body body) {
  auto net = make();
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(1.0));
  opt.zero_grad();
  body([&](auto&&... a) { return net->forward(std::forward<decltype(a)>(a)...); });
  opt.step();
  return values(*net);
}

// Sharded over `world` thread ranks with policies Ps and wrap policy `wrap`, every rank
// running the same body on the same data (so the mean gradient is the one-rank gradient):
// zero_grad, `body`, a check that every unit ended its step (IDLE), one step. Rank 0's full
// parameters after the step.
template <class... Ps, class Make, class Wrap, class Body>
Values sharded(int world, Make make, Wrap wrap, Body body) {
  using Net = decltype(make());
  std::vector<Net> nets;
  for (int r = 0; r < world; ++r) nets.push_back(make());
  Values out;
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    torch::set_num_threads(1);
    Net& net = nets[comm.rank()];
    fsdp::HostDevice device;
    auto sm = fsdp::torch::shard<Ps...>(net, comm, device, wrap);
    torch::optim::SGD opt(sm.parameters(), torch::optim::SGDOptions(1.0));
    opt.zero_grad();
    body([&](auto&&... a) { return sm.forward(std::forward<decltype(a)>(a)...); });
    for (auto& u : sm.sharded()) {
      CAPTURE(u->fqn());
      CHECK(u->state() == fsdp::TrainingState::IDLE);
    }
    opt.step();
    auto summon = sm.sharded().summon_full_params();
    if (comm.rank() == 0) out = values(*net);
  });
  return out;
}

// The same parameters, each within `tolerance` of the reference (one CHECK per parameter,
// naming it).
inline void check_same(const Values& got, const Values& want, double tolerance = 1e-10) {
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CAPTURE(want[i].first);
    CHECK(got[i].first == want[i].first);
    const double diff = (got[i].second - want[i].second).abs().max().item<double>();
    CHECK(diff <= tolerance);
  }
}

}  // namespace torch_test::one_step
