#pragma once
// A small torch::nn model with residual blocks, as a libtorch user writes one, for the torch
// adapter's tests: the only line that knows of fsdp is fsdp::torch::call in forward, which
// is the block's plain forward when the model is not sharded. Also the unsharded reference
// training it is compared with, and the deterministic data both use.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <torch/torch.h>

#include "fsdp/torch/unit_hooks.hpp"

namespace torch_test {

struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t dim, std::int64_t hidden)
      : fc1(register_module("fc1", torch::nn::Linear(dim, hidden))),
        fc2(register_module("fc2", torch::nn::Linear(hidden, dim))) {}
  torch::Tensor forward(torch::Tensor x) {
    seen_dtype = fc1->weight.scalar_type();
    return x + fc2(torch::tanh(fc1(x)));
  }
  torch::nn::Linear fc1, fc2;
  c10::ScalarType seen_dtype = c10::ScalarType::Undefined;  // fc1's weight's, at the last forward
};
TORCH_MODULE(Block);

struct NetImpl : torch::nn::Module {
  NetImpl(std::int64_t in, std::int64_t dim, std::int64_t hidden, int depth, std::int64_t out)
      : input(register_module("input", torch::nn::Linear(in, dim))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        head(register_module("head", torch::nn::Linear(dim, out))) {
    for (int i = 0; i < depth; ++i) blocks->push_back(Block(dim, hidden));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(input(x));
    for (const auto& b : *blocks) x = fsdp::torch::call(*b->as<BlockImpl>(), x);
    return head(x);
  }
  torch::nn::Linear input;
  torch::nn::ModuleList blocks;
  torch::nn::Linear head;
};
TORCH_MODULE(Net);

constexpr std::int64_t in_features = 6, dim = 8, hidden = 12, out_features = 3;
constexpr int depth = 3;

// The same initial values on every call: built from one seed, on the calling thread.
inline Net make_net(torch::Dtype dtype = torch::kDouble) {
  torch::manual_seed(7);
  Net net(in_features, dim, hidden, depth, out_features);
  net->to(dtype);
  return net;
}

// Batch `b` of step `step` (inputs and targets), `rows` rows: fixed values for a fixed
// (step, b), whatever the thread.
inline std::pair<torch::Tensor, torch::Tensor> batch(int step, int b, std::int64_t rows = 4,
                                                     torch::Dtype dtype = torch::kDouble) {
  auto g = at::detail::createCPUGenerator(static_cast<std::uint64_t>(1000 * step + b + 1));
  auto x = torch::randn({rows, in_features}, g, torch::TensorOptions().dtype(torch::kDouble));
  auto y = torch::randn({rows, out_features}, g, torch::TensorOptions().dtype(torch::kDouble));
  return {x.to(dtype), y.to(dtype)};
}

// The two optimizers the tests train with: SGD with momentum, AdamW with weight decay.
enum class Opt { sgd, adamw };

inline std::unique_ptr<torch::optim::Optimizer> make_optimizer(Opt o, std::vector<torch::Tensor> params) {
  if (o == Opt::sgd) return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.1).momentum(0.9));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.01).weight_decay(0.1));
}

// Every parameter by FQN, copied out (full values).
inline std::vector<std::pair<std::string, torch::Tensor>> values(torch::nn::Module& m) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (auto& item : m.named_parameters()) out.emplace_back(item.key(), item.value().detach().clone().to(torch::kDouble));
  return out;
}

}  // namespace torch_test
