#pragma once
// The reference model: embed -> blocks -> gain -> head, trained with MSE on a synthetic
// regression task. Forward and backward call `hooks` around the whole model and around
// each top-level layer; the engine does not know what the hooks do (fsdp's integration
// in fsdp_integration.hpp turns them into unit lifecycle calls). Parameters (and their
// gradients) and buffers may be built in f32, f16 or bf16.
#include <cstdint>
#include <string>
#include <vector>

#include "examples/engine/layers.hpp"

namespace engine {

struct ModelConfig {
  std::int64_t in = 5, dim = 13, hidden = 7, out = 3;  // odd sizes on purpose
  int blocks = 3;
  std::uint64_t seed = 1;
  Init init = Init::now;  // Init::deferred: parameters without storage until fsdp::deferred_init
  // The loss's gradient: the mean over a batch's samples, or their sum (then shard with
  // fsdp::ShardOptions::local_gradients = fsdp::LocalGradients::sum).
  LossReduction loss = LossReduction::mean;
};

struct NoHooks {
  void before_forward(const void*) {}
  void after_forward(const void*) {}
  void before_backward(const void*) {}
  void after_backward(const void*) {}
};

class Model {
 public:
  // Initial values are computed in float, the same for every dtype, then rounded to the
  // parameter (or buffer) dtype; gradients take the parameter dtype.
  explicit Model(const ModelConfig& c, Allocator& alloc = heap(), fsdp::DType param_dtype = fsdp::DType::f32,
                 fsdp::DType buffer_dtype = fsdp::DType::f32)
      : config(c), embed(c.in, c.dim, c.seed * 1000, alloc, param_dtype, c.init),
        gain(c.dim, c.seed * 1000 + 500, alloc, param_dtype, buffer_dtype, c.init),
        head(c.dim, c.out, c.seed * 1000 + 900, alloc, param_dtype, c.init) {
    blocks.reserve(static_cast<std::size_t>(c.blocks));
    for (int i = 0; i < c.blocks; ++i)
      blocks.emplace_back(c.dim, c.hidden, c.seed * 1000 + 10 * (i + 1), alloc, param_dtype, c.init);
  }

  template <class Hooks = NoHooks>
  Mat forward(const Mat& x, Hooks&& h = {}) {
    h.before_forward(this);
    Mat a = embed.forward(x);
    for (auto& b : blocks) {
      h.before_forward(&b);
      a = b.forward(a);
      h.after_forward(&b);
    }
    h.before_forward(&gain);
    a = gain.forward(a);
    h.after_forward(&gain);
    Mat y = head.forward(a);
    h.after_forward(this);
    return y;
  }

  template <class Hooks = NoHooks>
  void backward(const Mat& dy, Hooks&& h = {}) {
    h.before_backward(this);
    Mat d = head.backward(dy);
    h.before_backward(&gain);
    d = gain.backward(d);
    h.after_backward(&gain);
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
      h.before_backward(&*it);
      d = it->backward(d);
      h.after_backward(&*it);
    }
    embed.backward(d);
    h.after_backward(this);
  }

  template <class F>
  void visit_children(F&& f) {
    f("embed", embed);
    for (std::size_t i = 0; i < blocks.size(); ++i) f("blocks." + std::to_string(i), blocks[i]);
    f("gain", gain);
    f("head", head);
  }
  template <class F>
  void visit_parameters(F&&) {}  // all parameters live in children

  ModelConfig config;
  Linear embed;
  std::vector<Block> blocks;
  Gain gain;
  Linear head;
};

// Every parameter with its FQN, depth first: the unsharded engine's own walk, used for its
// optimizer, for zeroing gradients, and by tests to compare models.
struct NamedParam {
  std::string fqn;
  Tensor* param;
  Tensor* grad;
};

// Every buffer with its FQN, in the same walk.
struct NamedBuffer {
  std::string fqn;
  Tensor* buffer;
};

template <class M>
void collect(M& m, const std::string& prefix, std::vector<NamedParam>& out) {
  auto join = [&](std::string_view n) { return prefix.empty() ? std::string(n) : prefix + "." + std::string(n); };
  if constexpr (requires { m.visit_parameters([](std::string_view, Tensor&, Tensor&) {}); })
    m.visit_parameters([&](std::string_view n, Tensor& p, Tensor& g) { out.push_back({join(n), &p, &g}); });
  if constexpr (requires { m.visit_children([](std::string_view, auto&) {}); })
    m.visit_children([&](std::string_view n, auto& c) { collect(c, join(n), out); });
}

template <class M>
void collect(M& m, const std::string& prefix, std::vector<NamedBuffer>& out) {
  auto join = [&](std::string_view n) { return prefix.empty() ? std::string(n) : prefix + "." + std::string(n); };
  if constexpr (requires { m.visit_buffers([](std::string_view, Tensor&) {}); })
    m.visit_buffers([&](std::string_view n, Tensor& b) { out.push_back({join(n), &b}); });
  if constexpr (requires { m.visit_children([](std::string_view, auto&) {}); })
    m.visit_children([&](std::string_view n, auto& c) { collect(c, join(n), out); });
}

inline std::vector<NamedParam> named_parameters(Model& m) {
  std::vector<NamedParam> out;
  collect(m, "", out);
  return out;
}

inline std::vector<NamedBuffer> named_buffers(Model& m) {
  std::vector<NamedBuffer> out;
  collect(m, "", out);
  return out;
}

// The synthetic task: sample i of step s, the same on every rank.
struct Batch {
  Mat x, y;
};

inline Batch make_batch(const ModelConfig& c, int step, std::int64_t first_sample, std::int64_t count) {
  Batch b{Mat(count, c.in), Mat(count, c.out)};
  for (std::int64_t r = 0; r < count; ++r) {
    const std::uint64_t id = static_cast<std::uint64_t>(step) * 1000003ull + static_cast<std::uint64_t>(first_sample + r);
    for (std::int64_t i = 0; i < c.in; ++i) b.x.at(r, i) = uniform(77, id * 64 + static_cast<std::uint64_t>(i));
    for (std::int64_t o = 0; o < c.out; ++o) {
      float t = 0;
      for (std::int64_t i = 0; i < c.in; ++i) t += b.x.at(r, i) * uniform(99, static_cast<std::uint64_t>(o * 64 + i));
      b.y.at(r, o) = std::sin(t);
    }
  }
  return b;
}

}  // namespace engine
