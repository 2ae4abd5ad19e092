#pragma once
// A test engine whose module tree is known only at run time: a virtual Layer base, children
// held as std::unique_ptr<Layer>, visitors taking type-erased callbacks. Its math reuses the
// reference engine's layers (examples/engine/layers.hpp). Shared by the wrap policy and the
// type-erased model tests: training it sharded and unsharded, and comparing the two.
#include <cmath>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <doctest/doctest.h>

#include "examples/engine/fsdp_integration.hpp"

namespace layers {

using engine::Mat;
using engine::Tensor;
struct Layer;
using ParamVisitor = std::function<void(std::string_view, Tensor&, Tensor&)>;
using BufferVisitor = std::function<void(std::string_view, Tensor&)>;
using ChildVisitor = std::function<void(std::string_view, Layer&)>;

// Where the engine tells whoever listens that a layer starts or ends a pass.
struct Hooks {
  virtual ~Hooks() = default;
  virtual void before_forward(Layer&) {}
  virtual void after_forward(Layer&) {}
  virtual void before_backward(Layer&) {}
  virtual void after_backward(Layer&) {}
};

struct Layer {
  virtual ~Layer() = default;
  virtual void visit_parameters(const ParamVisitor&) {}
  virtual void visit_children(const ChildVisitor&) {}
  virtual void visit_buffers(const BufferVisitor&) {}
  // Computes the initial values of the layer's own parameters (deferred init calls it).
  virtual void reset_parameters() {}

  Mat forward(const Mat& x, Hooks& h) {
    h.before_forward(*this);
    Mat y = forward_impl(x, h);
    h.after_forward(*this);
    return y;
  }
  Mat backward(const Mat& dy, Hooks& h) {
    h.before_backward(*this);
    Mat dx = backward_impl(dy, h);
    h.after_backward(*this);
    return dx;
  }

 protected:
  virtual Mat forward_impl(const Mat& x, Hooks& h) = 0;
  virtual Mat backward_impl(const Mat& dy, Hooks& h) = 0;
};

struct Linear final : Layer {
  Linear(std::int64_t in, std::int64_t out, std::uint64_t seed, engine::Init init = engine::Init::now)
      : lin(in, out, seed, engine::heap(), fsdp::DType::f32, init) {}
  void visit_parameters(const ParamVisitor& f) override { lin.visit_parameters(f); }
  void reset_parameters() override { lin.reset_parameters(); }
  engine::Linear lin;

 protected:
  Mat forward_impl(const Mat& x, Hooks&) override { return lin.forward(x); }
  Mat backward_impl(const Mat& dy, Hooks&) override { return lin.backward(dy); }
};

struct Relu final : Layer {  // no parameters
 protected:
  Mat forward_impl(const Mat& x, Hooks&) override {
    Mat y = x;
    mask_.assign(y.v.size(), 0);
    for (std::size_t i = 0; i < y.v.size(); ++i) if (y.v[i] > 0) mask_[i] = 1; else y.v[i] = 0;
    return y;
  }
  Mat backward_impl(const Mat& dy, Hooks&) override {
    Mat dx = dy;
    for (std::size_t i = 0; i < dx.v.size(); ++i) if (!mask_[i]) dx.v[i] = 0;
    return dx;
  }
  std::vector<std::uint8_t> mask_;
};

// A per-feature gain with a fixed scale buffer (engine::Gain's math).
struct Norm final : Layer {
  Norm(std::int64_t dim, std::uint64_t seed, engine::Init init = engine::Init::now)
      : g(dim, seed, engine::heap(), fsdp::DType::f32, fsdp::DType::f32, init) {}
  void visit_parameters(const ParamVisitor& f) override { g.visit_parameters(f); }
  void reset_parameters() override { g.reset_parameters(); }
  void visit_buffers(const BufferVisitor& f) override { g.visit_buffers(f); }
  engine::Gain g;

 protected:
  Mat forward_impl(const Mat& x, Hooks&) override { return g.forward(x); }
  Mat backward_impl(const Mat& dy, Hooks&) override { return g.backward(dy); }
};

// Children in order, named `prefix.i`: y = body(x), plus x when residual.
struct Sequence : Layer {
  explicit Sequence(std::string prefix, bool residual = false) : prefix_(std::move(prefix)), residual_(residual) {}
  void visit_children(const ChildVisitor& f) override {
    for (std::size_t i = 0; i < body.size(); ++i) f(prefix_ + "." + std::to_string(i), *body[i]);
  }
  template <class L, class... Args>
  L& add(Args&&... args) {
    body.push_back(std::make_unique<L>(std::forward<Args>(args)...));
    return static_cast<L&>(*body.back());
  }
  std::vector<std::unique_ptr<Layer>> body;

 protected:
  Mat forward_impl(const Mat& x, Hooks& h) override {
    Mat a = x;
    for (auto& l : body) a = l->forward(a, h);
    if (residual_) for (std::size_t i = 0; i < a.v.size(); ++i) a.v[i] += x.v[i];
    return a;
  }
  Mat backward_impl(const Mat& dy, Hooks& h) override {
    Mat d = dy;
    for (auto it = body.rbegin(); it != body.rend(); ++it) d = (*it)->backward(d, h);
    if (residual_) for (std::size_t i = 0; i < d.v.size(); ++i) d.v[i] += dy.v[i];
    return d;
  }

 private:
  std::string prefix_;
  bool residual_;
};

struct Residual final : Sequence {
  Residual() : Sequence("body", true) {}
};

constexpr std::int64_t in = 5, dim = 8, hidden = 6, out = 3;

// layers.0 Linear 5->8 | layers.1 Residual(Linear 8->6, Relu, Linear 6->8) | layers.2 Norm |
// layers.3 Residual(Linear 8->6, Relu, Linear 6->8, Norm) | layers.4 Linear 8->3
// (Init::deferred: parameters without storage, for fsdp::deferred_init.)
inline std::unique_ptr<Sequence> make_net(engine::Init init = engine::Init::now) {
  auto net = std::make_unique<Sequence>("layers");
  net->add<Linear>(in, dim, 11, init);
  auto& r1 = net->add<Residual>();
  r1.add<Linear>(dim, hidden, 21, init);
  r1.add<Relu>();
  r1.add<Linear>(hidden, dim, 31, init);
  net->add<Norm>(dim, 41, init);
  auto& r2 = net->add<Residual>();
  r2.add<Linear>(dim, hidden, 51, init);
  r2.add<Relu>();
  r2.add<Linear>(hidden, dim, 61, init);
  r2.add<Norm>(dim, 71, init);
  net->add<Linear>(dim, out, 81, init);
  return net;
}

// A predicate for fsdp::wrap_if: the residual blocks, found by their dynamic type.
inline bool is_residual(Layer& l, std::string_view, int, std::int64_t) { return dynamic_cast<Residual*>(&l) != nullptr; }

// Every parameter with its FQN, walked as the library walks it (engine::collect takes the
// type-erased visitors too).
inline std::vector<engine::NamedParam> named_parameters(Layer& l) {
  std::vector<engine::NamedParam> out;
  engine::collect(l, "", out);
  return out;
}

// Units by module: works with the children seen as Layer&.
struct UnitHooks final : Hooks {
  explicit UnitHooks(fsdp::ShardedModel& m) : model(m) {}
  void before_forward(Layer& l) override { if (auto* u = model.find_unit_for(l)) u->pre_forward(); }
  void after_forward(Layer& l) override { if (auto* u = model.find_unit_for(l)) u->post_forward(); }
  void before_backward(Layer& l) override { if (auto* u = model.find_unit_for(l)) u->pre_backward(); }
  void after_backward(Layer& l) override { if (auto* u = model.find_unit_for(l)) u->post_backward(); }
  fsdp::ShardedModel& model;
};

constexpr int steps = 3, rows_per_rank = 2;
constexpr float lr = 0.05f;

inline engine::Batch batch(int step, std::int64_t first, std::int64_t count) {
  engine::ModelConfig c;
  c.in = in;
  c.out = out;
  return engine::make_batch(c, step, first, count);
}

// Plain SGD on every parameter of `net` (the unsharded reference), from zeroed gradients.
inline void reference_step(Layer& net, const engine::Batch& b) {
  auto params = named_parameters(net);
  for (auto& p : params) for (std::int64_t i = 0; i < p.grad->numel(); ++i) p.grad->set(i, 0);
  Hooks none;
  Mat dout;
  engine::mse(net.forward(b.x, none), b.y, dout);
  net.backward(dout, none);
  for (auto& p : params) for (std::int64_t i = 0; i < p.param->numel(); ++i) p.param->data()[i] -= lr * p.grad->data()[i];
}

// The reference model after `steps` steps on the whole batch of `world` ranks.
inline std::unique_ptr<Sequence> trained_reference(int world) {
  auto ref = make_net();
  for (int s = 0; s < steps; ++s) reference_step(*ref, batch(s, 0, world * rows_per_rank));
  return ref;
}

// One sharded step on this rank's rows. `local_step` runs between backward and the
// optimizer for what the engine keeps itself (ignored parameters).
inline void sharded_step(Layer& net, fsdp::ShardedModel& sm, int step, int rank,
                         const std::function<void()>& local_step = {}) {
  sm.zero_grad();
  UnitHooks hooks(sm);
  const auto b = batch(step, rank * rows_per_rank, rows_per_rank);
  Mat dout;
  engine::mse(net.forward(b.x, hooks), b.y, dout);
  net.backward(dout, hooks);
  sm.finish_backward();
  if (local_step) local_step();
  engine::Sgd(lr).step(engine::slots(sm));
}

// Every parameter of `net` (summoned by the caller) against `ref`, FQN by FQN, within a
// relative 1e-5: the sharded run sums the batch in another order than the reference.
inline void check_close(Layer& net, Layer& ref) {
  auto a = named_parameters(net), b = named_parameters(ref);
  REQUIRE(a.size() == b.size());
  for (std::size_t k = 0; k < a.size(); ++k) {
    REQUIRE(a[k].fqn == b[k].fqn);
    REQUIRE(a[k].param->numel() == b[k].param->numel());
    for (std::int64_t i = 0; i < a[k].param->numel(); ++i) {
      const float x = a[k].param->get(i), y = b[k].param->get(i);
      INFO(a[k].fqn << "[" << i << "]");
      CHECK(std::abs(x - y) <= 1e-5f * (1.0f + std::abs(y)));
    }
  }
}

// FQNs of the units, in the ShardedModel's order.
inline std::vector<std::string> unit_names(fsdp::ShardedModel& sm) {
  std::vector<std::string> out;
  for (auto& u : sm) out.push_back(u->fqn());
  return out;
}

}  // namespace layers
