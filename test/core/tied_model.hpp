#pragma once
// A GPT-style test model on the reference engine's tensors: a token embedding at the
// start, residual blocks, and an output projection at the end whose weight is the
// embedding's (tied: two engine tensors, one per name, viewing one storage, and likewise
// their gradients). The root unit (embedding + projection) is used at both ends of each
// pass; optionally one block is applied a second time, and blocks recompute their forward
// inside their backward (activation checkpointing). Hooks are called around each use:
//   forward:  the model's use (embedding), each block, the model's use (projection)
//   backward: the reverse, a recomputed block forward nested inside its backward.
// `whole_pass_root` calls the root's hooks around the whole pass instead (the only way
// before a unit could be entered twice): the baseline the memory test compares against.
#include <cstdint>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"

namespace tied {

using engine::Mat;
using engine::Tensor;

struct Config {
  std::int64_t vocab = 97, dim = 12, hidden = 20;
  int blocks = 3;
  int repeat_block = -1;   // >= 0: this block is applied again after the last one
  bool recompute = false;  // blocks recompute their forward inside their backward
  bool whole_pass_root = false;
  std::uint64_t seed = 5;
};

class Embedding {  // rows of weight [vocab, dim], looked up by token
 public:
  Embedding(std::int64_t vocab, std::int64_t dim, std::uint64_t seed) : weight({vocab, dim}), weight_grad({vocab, dim}), dim_(dim) {
    engine::fill_uniform(weight, seed, 0.5f);
  }
  Mat forward(const std::vector<int>& tokens) {
    tokens_ = tokens;
    Mat y(static_cast<std::int64_t>(tokens.size()), dim_);
    for (std::int64_t b = 0; b < y.rows; ++b)
      for (std::int64_t j = 0; j < dim_; ++j) y.at(b, j) = weight[tokens[static_cast<std::size_t>(b)] * dim_ + j];
    return y;
  }
  void backward(const Mat& dy) {
    for (std::int64_t b = 0; b < dy.rows; ++b)
      for (std::int64_t j = 0; j < dim_; ++j) weight_grad[tokens_[static_cast<std::size_t>(b)] * dim_ + j] += dy.at(b, j);
  }
  template <class F> void visit_parameters(F&& f) { f("weight", weight, weight_grad); }
  Tensor weight, weight_grad;

 private:
  std::int64_t dim_;
  std::vector<int> tokens_;
};

class Projection {  // logits = h W^T, W [vocab, dim]: the embedding's weight when tied
 public:
  explicit Projection(Embedding& tied_to)
      : weight({tied_to.weight.shape()[0], tied_to.weight.shape()[1]}),
        weight_grad({tied_to.weight.shape()[0], tied_to.weight.shape()[1]}) {
    weight.rebind(tied_to.weight.raw());  // a second tensor, one storage
    weight_grad.rebind(tied_to.weight_grad.raw());
  }
  Mat forward(const Mat& h) {
    h_ = h;
    const std::int64_t vocab = weight.shape()[0], dim = weight.shape()[1];
    Mat y(h.rows, vocab);
    for (std::int64_t b = 0; b < h.rows; ++b)
      for (std::int64_t v = 0; v < vocab; ++v) {
        float acc = 0;
        for (std::int64_t j = 0; j < dim; ++j) acc += h.at(b, j) * weight[v * dim + j];
        y.at(b, v) = acc;
      }
    return y;
  }
  Mat backward(const Mat& dy) {
    const std::int64_t vocab = weight.shape()[0], dim = weight.shape()[1];
    Mat dh(dy.rows, dim);
    for (std::int64_t b = 0; b < dy.rows; ++b)
      for (std::int64_t v = 0; v < vocab; ++v) {
        const float g = dy.at(b, v);
        for (std::int64_t j = 0; j < dim; ++j) {
          weight_grad[v * dim + j] += g * h_.at(b, j);
          dh.at(b, j) += g * weight[v * dim + j];
        }
      }
    return dh;
  }
  template <class F> void visit_parameters(F&& f) { f("weight", weight, weight_grad); }
  Tensor weight, weight_grad;

 private:
  Mat h_;
};

class TiedLM {
 public:
  explicit TiedLM(const Config& c) : config(c), embed(c.vocab, c.dim, c.seed * 100), head(embed) {
    blocks.reserve(static_cast<std::size_t>(c.blocks));
    for (int i = 0; i < c.blocks; ++i) blocks.emplace_back(c.dim, c.hidden, c.seed * 100 + 10 * (i + 1));
  }

  template <class Hooks = engine::NoHooks>
  Mat forward(const std::vector<int>& tokens, Hooks&& h = {}) {
    inputs_.clear();
    if (config.whole_pass_root) h.before_forward(this);
    use_root(h, true, [&] { act_ = embed.forward(tokens); });
    for (int i : block_uses()) {
      auto& b = blocks[static_cast<std::size_t>(i)];
      inputs_.push_back(act_);
      h.before_forward(&b);
      act_ = b.forward(act_);
      h.after_forward(&b);
    }
    Mat y;
    use_root(h, true, [&] { y = head.forward(act_); });
    if (config.whole_pass_root) h.after_forward(this);
    return y;
  }

  template <class Hooks = engine::NoHooks>
  void backward(const Mat& dy, Hooks&& h = {}) {
    if (config.whole_pass_root) h.before_backward(this);
    Mat d;
    use_root(h, false, [&] { d = head.backward(dy); });
    const auto uses = block_uses();
    for (std::size_t k = uses.size(); k-- > 0;) {
      auto& b = blocks[static_cast<std::size_t>(uses[k])];
      h.before_backward(&b);
      // A block applied twice holds the activations of its last use only: recompute them.
      if (config.recompute || (config.repeat_block >= 0 && uses[k] == config.repeat_block)) {
        h.before_forward(&b);
        b.forward(inputs_[k]);
        h.after_forward(&b);
      }
      d = b.backward(d);
      h.after_backward(&b);
    }
    use_root(h, false, [&] { embed.backward(d); });
    if (config.whole_pass_root) h.after_backward(this);
  }

  template <class F> void visit_children(F&& f) {
    f("embed", embed);
    for (std::size_t i = 0; i < blocks.size(); ++i) f("blocks." + std::to_string(i), blocks[i]);
    f("head", head);
  }
  template <class F> void visit_parameters(F&&) {}

  // The tensors an unsharded optimizer steps: each storage once.
  std::vector<engine::Slot> unique_slots() {
    std::vector<engine::NamedParam> named;
    engine::collect(*this, "", named);
    std::vector<engine::Slot> out;
    for (auto& p : named)
      if (p.param != &head.weight) out.push_back({p.param->data(), p.grad->data(), p.param->numel()});
    return out;
  }

  Config config;
  Embedding embed;
  std::vector<engine::Block> blocks;
  Projection head;

 private:
  std::vector<int> block_uses() const {
    std::vector<int> u;
    for (int i = 0; i < config.blocks; ++i) u.push_back(i);
    if (config.repeat_block >= 0) u.push_back(config.repeat_block);
    return u;
  }
  template <class Hooks, class F>
  void use_root(Hooks& h, bool forward, F&& f) {
    if (config.whole_pass_root) return f();
    if (forward) h.before_forward(this); else h.before_backward(this);
    f();
    if (forward) h.after_forward(this); else h.after_backward(this);
  }
  Mat act_;
  std::vector<Mat> inputs_;  // each block use's input, for recomputation
};

// Sample i of step s: a few tokens and a target row per token, the same on every rank.
struct Batch {
  std::vector<int> tokens;
  Mat target;
};
inline Batch make_batch(const Config& c, int step, std::int64_t first, std::int64_t count) {
  Batch b{{}, Mat(count, c.vocab)};
  for (std::int64_t r = 0; r < count; ++r) {
    const std::uint64_t id = static_cast<std::uint64_t>(step) * 7919ull + static_cast<std::uint64_t>(first + r);
    b.tokens.push_back(static_cast<int>((id * 2654435761ull >> 7) % static_cast<std::uint64_t>(c.vocab)));
    for (std::int64_t v = 0; v < c.vocab; ++v) b.target.at(r, v) = 0.3f * engine::uniform(41, id * 1024 + static_cast<std::uint64_t>(v));
  }
  return b;
}

// Unsharded: forward and backward on the whole batch, then SGD on each storage once.
inline double unsharded_step(TiedLM& m, const Batch& batch, float lr) {
  for (auto& s : m.unique_slots()) std::fill_n(const_cast<float*>(s.grad), s.numel, 0.0f);
  Mat dout;
  const double loss = engine::mse(m.forward(batch.tokens), batch.target, dout);
  m.backward(dout);
  engine::Sgd(lr).step(m.unique_slots());
  return loss;
}

// Sharded: this rank's samples, the hooks driving the units, SGD on the shards.
inline double sharded_step(TiedLM& m, fsdp::ShardedModel& sm, const Batch& local, float lr) {
  sm.zero_grad();
  engine::UnitHooks hooks{sm};
  Mat dout;
  const double loss = engine::mse(m.forward(local.tokens, hooks), local.target, dout);
  m.backward(dout, hooks);
  sm.finish_backward();
  engine::Sgd(lr).step(engine::slots(sm));
  return loss;
}

}  // namespace tied
