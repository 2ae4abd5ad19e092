// A libtorch model trained sharded: a small next-token model (embedding, residual blocks
// with LayerNorm, a head) as any libtorch user writes it, trained with fsdp::torch on
// --ranks thread ranks (each rank its own batch), then the same model trained unsharded on
// all ranks' batches at once with the same optimizer. Prints each step's loss and a last
// line
//
//   final: loss=L unsharded_loss=U max_param_diff=D
//
// (D: the largest difference of any parameter element between the two runs). With
// --strategy (FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2),
// --precision bf16 (MixedPrecision<bf16, float>), --offload (OffloadParams), --optimizer
// (adamw, sgd), --accumulate N (micro-batches under no_sync). CPU (Debian's libtorch), or
// --device cuda where built with -DFSDP_TORCH_CUDA against a CUDA libtorch (tools/gpu_proof.sh
// does, with PyTorch's): one rank on GPU 0, with fsdp::CudaDevice on a stream of torch's pool
// and a one-rank fsdp::NcclComm. One rank, because libtorch runs the backward of every graph
// on a GPU on one thread per device: thread ranks sharing it would wait on each other's
// collectives inside that thread (more ranks: one process per GPU).
//
// Everything fsdp asks of this engine is marked "fsdp" below: 1 line in the model, 9
// around the loop (of which the mesh, no_sync and the summon for the comparison are
// optional).
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <torch/torch.h>

#include <fsdp/fsdp.hpp>
#include "fsdp/torch/sharded_module.hpp"
#if defined(FSDP_TORCH_CUDA)
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>

#include "fsdp/cuda/cuda_device.hpp"
#include "fsdp/nccl/nccl_comm.hpp"
#endif

namespace {

// ---- The model: plain libtorch. ----
struct BlockImpl : torch::nn::Module {
  BlockImpl(std::int64_t dim, std::int64_t hidden)
      : norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        up(register_module("up", torch::nn::Linear(dim, hidden))),
        down(register_module("down", torch::nn::Linear(hidden, dim))) {}
  torch::Tensor forward(torch::Tensor x) { return x + down(torch::gelu(up(norm(x)))); }
  torch::nn::LayerNorm norm;
  torch::nn::Linear up, down;
};
TORCH_MODULE(Block);

struct TokenModelImpl : torch::nn::Module {
  TokenModelImpl(std::int64_t vocab, std::int64_t dim, int depth)
      : embed(register_module("embed", torch::nn::Embedding(vocab, dim))),
        blocks(register_module("blocks", torch::nn::ModuleList())),
        norm(register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})))),
        head(register_module("head", torch::nn::Linear(dim, vocab))) {
    for (int i = 0; i < depth; ++i) blocks->push_back(Block(dim, 4 * dim));
  }
  torch::Tensor forward(torch::Tensor tokens) {
    auto x = embed(tokens);
    for (const auto& b : *blocks) x = fsdp::torch::call(*b->as<BlockImpl>(), x);  // fsdp: a block may be a unit
    return head(norm(x));
  }
  torch::nn::Embedding embed;
  torch::nn::ModuleList blocks;
  torch::nn::LayerNorm norm;
  torch::nn::Linear head;
};
TORCH_MODULE(TokenModel);

struct Config {
  int ranks = 2, steps = 8, accumulate = 1;
  std::int64_t vocab = 64, dim = 32, batch = 8, length = 16;
  int depth = 3;
  std::string strategy = "FULL_SHARD", precision = "fp32", optimizer = "adamw", device = "cpu";
  bool offload = false;
  torch::Device where() const { return device == "cuda" ? torch::Device(torch::kCUDA, 0) : torch::Device(torch::kCPU); }
};

// Tokens of rank `rank`'s micro-batch `m` at `step`: sequences that follow a fixed rule
// (next = 5 * token + 3 mod vocab) from a random start, so the loss can fall.
std::pair<torch::Tensor, torch::Tensor> batch(const Config& c, int step, int rank, int m) {
  auto g = at::detail::createCPUGenerator(static_cast<std::uint64_t>(((step * 131) + rank) * 17 + m + 1));
  auto start = torch::randint(c.vocab, {c.batch, 1}, g, torch::kLong);
  std::vector<torch::Tensor> seq{start};
  for (std::int64_t i = 0; i < c.length; ++i) seq.push_back((seq.back() * 5 + 3) % c.vocab);
  auto all = torch::cat(seq, 1).to(c.where());
  return {all.slice(1, 0, c.length), all.slice(1, 1, c.length + 1)};
}

TokenModel make_model(const Config& c) {
  torch::manual_seed(42);
  TokenModel model(c.vocab, c.dim, c.depth);
  model->to(c.where());
  return model;
}

std::unique_ptr<torch::optim::Optimizer> make_optimizer(const Config& c, std::vector<torch::Tensor> params) {
  if (c.optimizer == "sgd") return std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.5).momentum(0.9));
  return std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(3e-3));
}

torch::Tensor loss_of(const torch::Tensor& logits, const torch::Tensor& targets) {
  return torch::nn::functional::cross_entropy(logits.to(torch::kFloat).flatten(0, 1), targets.flatten());
}

// The same model unsharded, on every rank's batches at once.
std::pair<std::vector<double>, std::vector<torch::Tensor>> unsharded(const Config& c) {
  auto model = make_model(c);
  auto opt = make_optimizer(c, model->parameters());
  std::vector<double> losses;
  for (int step = 0; step < c.steps; ++step) {
    opt->zero_grad();
    double total = 0;
    for (int m = 0; m < c.accumulate; ++m) {
      std::vector<torch::Tensor> xs, ys;
      for (int r = 0; r < c.ranks; ++r) {
        auto [x, y] = batch(c, step, r, m);
        xs.push_back(x), ys.push_back(y);
      }
      auto loss = loss_of(model->forward(torch::cat(xs)), torch::cat(ys)) / c.accumulate;
      loss.backward();
      total += loss.item<double>();
    }
    opt->step();
    losses.push_back(total);
  }
  std::vector<torch::Tensor> params;
  for (const auto& p : model->parameters()) params.push_back(p.detach().to(torch::kCPU, torch::kFloat, false, true));
  return {losses, params};
}

// Runs train(rank, mesh, device) on each of c.ranks thread ranks (CPU), or on one rank on
// GPU 0 (CUDA), with the fsdp device and communicator of c.device.
template <class Train>
void on_ranks(const Config& c, const Train& train) {
  const fsdp::MeshShape shape{c.ranks % 2 == 0 ? 2 : 1, c.ranks % 2 == 0 ? c.ranks / 2 : c.ranks};  // 2 replicas for HYBRID_*
  if (c.device == "cpu") {
    fsdp::ThreadGroup(c.ranks).run([&](fsdp::ThreadComm& comm) {
      torch::set_num_threads(1);
      fsdp::HostDevice device;                                                        // fsdp
      fsdp::DeviceMesh<fsdp::ThreadComm> mesh(comm, shape);                           // fsdp
      train(comm.rank(), mesh, device);
    });
    return;
  }
#if defined(FSDP_TORCH_CUDA)
  auto stream = c10::cuda::getStreamFromPool(false, 0);  // torch's kernels and fsdp's compute
  c10::cuda::CUDAStreamGuard on_stream(stream);
  fsdp::CudaDevice device(0, stream.stream());
  fsdp::NcclCommOptions nccl;
  nccl.after = stream.stream();  // collectives wait for what torch queued
  nccl.name = "torch_train";
  std::vector<fsdp::NcclComm> comms = fsdp::NcclComm::create({0}, nccl);
  fsdp::DeviceMesh<fsdp::NcclComm> mesh(comms[0], shape);
  train(0, mesh, device);
  device.synchronize();  // the parameters it returns are read on the default stream
#else
  (void)train, (void)shape;
#endif
}

// Sharded on c.ranks thread ranks with strategy S and policies Ps.
template <class... Ps>
std::pair<std::vector<double>, std::vector<torch::Tensor>> sharded(const Config& c) {
  std::vector<TokenModel> models;
  for (int r = 0; r < c.ranks; ++r) models.push_back(make_model(c));
  std::vector<std::vector<double>> losses(c.ranks);
  std::vector<torch::Tensor> params;
  on_ranks(c, [&](int rank, auto& mesh, auto& device) {
    TokenModel& model = models[rank];
    auto sharded = fsdp::torch::shard<Ps...>(model, mesh, device, fsdp::torch::wrap_type<BlockImpl>());  // fsdp
    auto opt = make_optimizer(c, sharded.parameters());                               // fsdp: the shards
    for (int step = 0; step < c.steps; ++step) {
      sharded.zero_grad();                                                            // fsdp: (opt->zero_grad() works too)
      double total = 0;
      for (int m = 0; m < c.accumulate; ++m) {
        sharded.sharded().set_requires_gradient_sync(m + 1 == c.accumulate);        // fsdp: no_sync
        auto [x, y] = batch(c, step, rank, m);
        torch::Tensor loss = loss_of(sharded.forward(x), y) / c.accumulate;          // fsdp: sharded.forward
        loss.backward();
        total += loss.item<double>();
      }
      opt->step();
      losses[rank].push_back(total);
    }
    auto full = sharded.sharded().summon_full_params();                               // fsdp: to compare
    if (rank == 0)
      for (const auto& p : model->parameters()) params.push_back(p.detach().to(torch::kCPU, torch::kFloat, false, true));
  });
  std::vector<double> mean(c.steps, 0.0);
  for (int s = 0; s < c.steps; ++s)
    for (int r = 0; r < c.ranks; ++r) mean[s] += losses[r][s] / c.ranks;
  return {mean, params};
}

template <class S>
std::pair<std::vector<double>, std::vector<torch::Tensor>> sharded_with(const Config& c, S) {
  if (c.precision == "bf16") {
    if (c.offload) return sharded<S, fsdp::MixedPrecision<fsdp::bf16, float>, fsdp::OffloadParams>(c);
    return sharded<S, fsdp::MixedPrecision<fsdp::bf16, float>>(c);
  }
  if (c.offload) return sharded<S, fsdp::OffloadParams>(c);
  return sharded<S>(c);
}

}  // namespace

int main(int argc, char** argv) {
  Config c;
  CLI::App app{"Trains a libtorch model sharded with fsdp::torch and compares it with unsharded libtorch"};
  app.add_option("--ranks", c.ranks, "thread ranks")->check(CLI::Range(1, 64));
  app.add_option("--steps", c.steps, "training steps")->check(CLI::Range(1, 100000));
  app.add_option("--accumulate", c.accumulate, "micro-batches per step (no_sync for all but the last)")
      ->check(CLI::Range(1, 64));
  app.add_option("--strategy", c.strategy, "sharding strategy: " + fsdp::strategy_names() + " (any case)");
  app.add_option("--precision", c.precision, "fp32, or bf16: MixedPrecision<bf16, float>")
      ->check(CLI::IsMember({"fp32", "bf16"}));
  app.add_flag("--offload", c.offload, "keep the shards and the optimizer's state in host memory (OffloadParams)");
  app.add_option("--optimizer", c.optimizer, "adamw or sgd (momentum 0.9)")->check(CLI::IsMember({"adamw", "sgd"}));
  app.add_option("--device", c.device, "cpu, or cuda: one rank on GPU 0 (a build with -DFSDP_TORCH_CUDA)")
      ->check(CLI::IsMember({"cpu", "cuda"}));
  CLI11_PARSE(app, argc, argv);
  if (c.device == "cuda") {
    if (app.count("--ranks") && c.ranks != 1) {
      std::fprintf(stderr, "torch_train: --device cuda runs one rank (libtorch runs every backward on a GPU on one "
                           "thread, so thread ranks sharing it would wait on each other): --ranks 1, or one process "
                           "per GPU\n");
      return 2;
    }
    c.ranks = 1;
  }
#if !defined(FSDP_TORCH_CUDA)
  if (c.device == "cuda") {
    std::fprintf(stderr, "torch_train: --device cuda: this build has no CUDA (build it with -DFSDP_TORCH_CUDA against a "
                         "CUDA libtorch, as tools/gpu_proof.sh does)\n");
    return 2;
  }
#endif
  try {
    if (c.device == "cuda" && !torch::cuda::is_available())
      throw std::runtime_error("--device cuda: libtorch sees no CUDA device");
    torch::set_num_threads(1);
    const auto [want_losses, want_params] = unsharded(c);
    std::pair<std::vector<double>, std::vector<torch::Tensor>> got;
    fsdp::with_strategy(c.strategy, [&](auto s) { got = sharded_with(c, s); });
    for (int s = 0; s < c.steps; ++s)
      std::printf("step %d: loss=%.6f unsharded_loss=%.6f\n", s, got.first[s], want_losses[s]);
    double diff = 0;
    for (std::size_t i = 0; i < want_params.size(); ++i)
      diff = std::max(diff, (got.second[i] - want_params[i]).abs().max().item<double>());
    std::printf("final: loss=%.6f unsharded_loss=%.6f max_param_diff=%.3g\n", got.first.back(), want_losses.back(), diff);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "torch_train: %s\n", e.what());
    return 1;
  }
  return 0;
}
