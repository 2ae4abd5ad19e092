// Handle tensor types (fsdp/core/tensor.hpp, tensor_traits<T>::identity): an engine whose
// tensor is a refcounted handle, as libtorch's torch::Tensor is a handle to a TensorImpl.
// Copies of a handle share the tensor, so rebinding any copy is seen through all of them,
// and such engines hand out copies (named_parameters() returns them by value). The library
// keeps its own copies of the handles and tells tensors apart by what they point to, so a
// visitor that passes copies (whose addresses die with the visit) trains sharded exactly as
// the engine trains unsharded; one that passes new tensors at each visit (detach(),
// clone()) is refused, and so is the same type visited by copies without the declaration.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <span>
#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "test/support/errors.hpp"
#include <fsdp/unit/sharded.hpp>  // fsdp::Sharded: units built by hand

namespace core_handle_tensors_test {

// torch::TensorImpl-like: shape, dtype, and the storage it views (owned, and shared with
// the detach() views of it, or someone else's: the library's).
struct Impl {
  std::vector<std::int64_t> shape;
  fsdp::DType dtype = fsdp::DType::f64;
  std::shared_ptr<std::vector<double>> storage;  // owned storage (null: viewing someone else's)
  void* data = nullptr;
  bool refuse_rebind = false;  // a rebind that throws: the take-over fails and rolls back
};

// torch::Tensor-like: a handle; copies share the Impl. `Handle` says whether its
// tensor_traits declare it (identity); the same type without, to show what that changes.
// `Keeps`: whether its traits have keep/restore.
template <bool Handle, bool Keeps = true>
struct BasicTensor {
  std::shared_ptr<Impl> impl;

  static BasicTensor zeros(std::vector<std::int64_t> shape) {
    auto i = std::make_shared<Impl>();
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    i->shape = std::move(shape);
    i->storage = std::make_shared<std::vector<double>>(static_cast<std::size_t>(n), 0.0);
    i->data = i->storage->data();
    return {std::move(i)};
  }
  BasicTensor detach() const { return {std::make_shared<Impl>(*impl)}; }  // a new tensor viewing the same storage
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : impl->shape) n *= d;
    return n;
  }
  // Element i, in whatever dtype the tensor shows now (MixedPrecision shows f32).
  double get(std::int64_t i) const {
    if (impl->dtype == fsdp::DType::f32) return static_cast<const float*>(impl->data)[i];
    return static_cast<const double*>(impl->data)[i];
  }
  void add(std::int64_t i, double v) const {
    if (impl->dtype == fsdp::DType::f32) static_cast<float*>(impl->data)[i] += static_cast<float>(v);
    else static_cast<double*>(impl->data)[i] += v;
  }
  double* f64() const { return static_cast<double*>(impl->data); }
};

using Tensor = BasicTensor<true>;
using Unmarked = BasicTensor<false>;
using Unkept = BasicTensor<true, false>;

struct Kept {
  std::shared_ptr<std::vector<double>> storage;
  void* data;
  fsdp::DType dtype;
};

}  // namespace core_handle_tensors_test

template <bool Handle, bool Keeps>
struct fsdp::tensor_traits<core_handle_tensors_test::BasicTensor<Handle, Keeps>> {
  using T = core_handle_tensors_test::BasicTensor<Handle, Keeps>;
  static fsdp::DType dtype(const T& t) { return t.impl->dtype; }
  static std::span<const std::int64_t> shape(const T& t) { return t.impl->shape; }
  static void* data(T& t) { return t.impl->data; }
  static fsdp::DeviceId device(const T&) { return {}; }
  static void rebind(T& t, void* p) { rebind(t, p, t.impl->dtype); }
  static void rebind(T& t, void* p, fsdp::DType d) {
    if (t.impl->refuse_rebind) throw std::runtime_error("this tensor refuses to be rebound");
    t.impl->storage.reset();  // as libtorch's set_data: the old storage goes unless kept
    t.impl->data = p;
    t.impl->dtype = d;
  }
  static core_handle_tensors_test::Kept keep(T& t)
    requires Keeps
  {
    return {t.impl->storage, t.impl->data, t.impl->dtype};
  }
  static void restore(T& t, core_handle_tensors_test::Kept&& k) noexcept
    requires Keeps
  {
    t.impl->storage = std::move(k.storage);
    t.impl->data = k.data;
    t.impl->dtype = k.dtype;
  }
  // The declaration that makes it a handle type: what the handle points to.
  static const void* identity(const T& t)
    requires Handle
  {
    return t.impl.get();
  }
};

static_assert(fsdp::TensorHandle<core_handle_tensors_test::Tensor>);
static_assert(!fsdp::TensorHandle<core_handle_tensors_test::Unmarked>);
static_assert(!fsdp::KeepsStorage<core_handle_tensors_test::Unkept>);

namespace core_handle_tensors_test {

enum class Visit { copies, new_tensors };

// torch::nn::Linear-like: y = W x + b, its tensors handles. The visitor hands over copies of
// the handles, by value into a local list at each visit, as a libtorch glue over
// named_parameters() does. `owned_grad`: visited as f(name, param), the library owns the
// gradient, which the engine writes through ShardedModel::gradient(weight).
template <class T>
struct Linear {
  Linear(std::int64_t in_, std::int64_t out_, std::uint64_t seed, bool owned = false)
      : in(in_), out(out_), owned_grad(owned), weight(T::zeros({out_, in_})), bias(T::zeros({out_})),
        weight_grad(T::zeros({out_, in_})), bias_grad(T::zeros({out_})), seed_(seed) {
    reset();
  }
  void reset() {  // the engine's init: in place, into whatever storage the tensors view
    if (!tied_weight)
      for (std::int64_t k = 0; k < weight.numel(); ++k)
        weight.f64()[k] = std::sin(static_cast<double>(seed_ * 131 + static_cast<std::uint64_t>(k) * 7 + 3)) * 0.4;
    for (std::int64_t k = 0; k < bias.numel(); ++k) bias.f64()[k] = 0.05 * static_cast<double>(k % 3);
  }
  struct Named {
    std::string name;
    T param, grad;
  };
  std::vector<Named> named_parameters() const { return {{"weight", weight, weight_grad}, {"bias", bias, bias_grad}}; }
  template <class F>
  void visit_parameters(F&& f) {
    auto ps = named_parameters();  // copies of the handles, gone when the visit returns
    for (auto& p : ps) {
      if (visit == Visit::new_tensors) {  // a new tensor at each visit: refused
        T d = p.param.detach(), g = p.grad.detach();
        f(std::string_view(p.name), d, g);
      } else if (owned_grad) {
        f(std::string_view(p.name), p.param);
      } else {
        f(std::string_view(p.name), p.param, p.grad);
      }
    }
  }
  std::vector<double> forward(const std::vector<double>& x) {
    input = x;
    std::vector<double> y(static_cast<std::size_t>(out));
    for (std::int64_t i = 0; i < out; ++i) {
      double s = bias.get(i);
      for (std::int64_t j = 0; j < in; ++j) s += weight.get(i * in + j) * x[static_cast<std::size_t>(j)];
      y[static_cast<std::size_t>(i)] = s;
    }
    return y;
  }
  // Adds this sample's gradient into wg and bg (the gradient tensors, or the library's).
  template <class G>
  std::vector<double> backward(const std::vector<double>& dy, const G& wg, const G& bg) {
    std::vector<double> dx(static_cast<std::size_t>(in), 0.0);
    for (std::int64_t i = 0; i < out; ++i) {
      for (std::int64_t j = 0; j < in; ++j) {
        wg.add(i * in + j, dy[static_cast<std::size_t>(i)] * input[static_cast<std::size_t>(j)]);
        dx[static_cast<std::size_t>(j)] += weight.get(i * in + j) * dy[static_cast<std::size_t>(i)];
      }
      bg.add(i, dy[static_cast<std::size_t>(i)]);
    }
    return dx;
  }

  std::int64_t in, out;
  bool owned_grad;
  Visit visit = Visit::copies;
  bool tied_weight = false;  // the weight is another Linear's, initialized there
  T weight, bias, weight_grad, bias_grad;
  std::vector<double> input;
  std::uint64_t seed_;
};

// Block: two square Linears whose weights are tied (one tensor, two handles, as
// `b.weight = a.weight` in libtorch), its gradient too.
template <class T>
struct Block {
  Block() : a(6, 6, 2), b(6, 6, 4) {
    b.tied_weight = true;
    b.weight = a.weight;
    b.weight_grad = a.weight_grad;
  }
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) { f("a", a); f("b", b); }
  Linear<T> a, b;
};

template <class T>
struct Net {
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) { f("in", in); f("block", block); f("out", out); }
  Linear<T> in{5, 6, 1};
  Block<T> block;
  Linear<T> out{6, 3, 3, true};  // its gradient is the library's
};

}  // namespace core_handle_tensors_test

namespace core_handle_tensors_test {
namespace {

using test_support::contains;
using test_support::error_of;
using Wrap = fsdp::wrap_types<Linear<Tensor>, Block<Tensor>>;
constexpr double lr = 0.1;

struct Sample {
  std::vector<double> x, t;
};
Sample sample(int step, int micro, int s) {
  Sample out{std::vector<double>(5), std::vector<double>(3)};
  for (int i = 0; i < 5; ++i) out.x[i] = std::cos(0.7 * step + 1.3 * micro + 0.37 * s + 0.91 * i);
  for (int i = 0; i < 3; ++i) out.t[i] = std::sin(0.3 * step + 0.5 * micro + 0.11 * s + 1.7 * i) * 0.5;
  return out;
}

// A gradient the library owns, written as a tensor is (GradientView in f64 or f32).
struct ViewGrad {
  fsdp::GradientView g;
  void add(std::int64_t i, double v) const {
    if (g.dtype == fsdp::DType::f32) static_cast<float*>(g.data)[i] += static_cast<float>(v);
    else static_cast<double*>(g.data)[i] += v;
  }
};
// The unsharded engine's gradient of `out` (which it owns there).
struct OwnGrad {
  const Tensor& t;
  void add(std::int64_t i, double v) const { t.add(i, v); }
};

// The engine's step over one sample, with each module's unit hooks around it when sharded.
struct Engine {
  explicit Engine(Net<Tensor>& n, fsdp::ShardedModel* s = nullptr) : net(n), sm(s) {}
  Net<Tensor>& net;
  fsdp::ShardedModel* sm;
  std::vector<double> a1, a2;
  fsdp::DType seen_dtype = fsdp::DType::f64;  // what `in.weight` showed in the forward

  template <class M>
  fsdp::Unit::ForwardScope forward_scope(M& m) {
    if (sm)
      if (auto* u = sm->find_unit_for(m)) return u->forward_scope();
    return {};
  }
  template <class M>
  fsdp::Unit::BackwardScope backward_scope(M& m) {
    if (sm)
      if (auto* u = sm->find_unit_for(m)) return u->backward_scope();
    return {};
  }
  static void tanh_in_place(std::vector<double>& v, std::vector<double>& saved) {
    for (auto& x : v) x = std::tanh(x);
    saved = v;
  }
  static void tanh_backward(std::vector<double>& d, const std::vector<double>& y) {
    for (std::size_t i = 0; i < d.size(); ++i) d[i] *= 1 - y[i] * y[i];
  }

  double run(const Sample& s) {
    std::vector<double> h1, h2, y;
    {
      auto root = forward_scope(net);
      {
        auto u = forward_scope(net.in);
        seen_dtype = net.in.weight.impl->dtype;
        h1 = net.in.forward(s.x);
      }
      tanh_in_place(h1, a1);
      {
        auto u = forward_scope(net.block);
        h2 = net.block.b.forward(net.block.a.forward(h1));
      }
      tanh_in_place(h2, a2);
      auto u = forward_scope(net.out);
      y = net.out.forward(h2);
    }
    double loss = 0;
    std::vector<double> dy(y.size());
    for (std::size_t i = 0; i < y.size(); ++i) {
      dy[i] = y[i] - s.t[i];
      loss += 0.5 * dy[i] * dy[i];
    }
    {
      auto root = backward_scope(net);
      std::vector<double> d;
      {
        auto u = backward_scope(net.out);
        if (sm)  // found by any copy of the handle: here the engine's own, not what was visited
          d = net.out.backward(dy, ViewGrad{sm->gradient(net.out.weight)}, ViewGrad{sm->gradient(net.out.bias)});
        else
          d = net.out.backward(dy, OwnGrad{net.out.weight_grad}, OwnGrad{net.out.bias_grad});
      }
      tanh_backward(d, a2);
      {
        auto u = backward_scope(net.block);
        auto& b = net.block;
        d = b.a.backward(b.b.backward(d, b.b.weight_grad, b.b.bias_grad), b.a.weight_grad, b.a.bias_grad);
      }
      tanh_backward(d, a1);
      auto u = backward_scope(net.in);
      net.in.backward(d, net.in.weight_grad, net.in.bias_grad);
    }
    if (sm) sm->finish_backward();
    return loss;
  }
};

std::vector<Tensor> distinct_params(Net<Tensor>& n) {  // the tied weight once
  return {n.in.weight, n.in.bias, n.block.a.weight, n.block.a.bias, n.block.b.bias, n.out.weight, n.out.bias};
}
std::vector<Tensor> distinct_grads(Net<Tensor>& n) {
  return {n.in.weight_grad, n.in.bias_grad, n.block.a.weight_grad, n.block.a.bias_grad, n.block.b.bias_grad,
          n.out.weight_grad, n.out.bias_grad};
}

struct Run {
  std::vector<double> losses;
  std::vector<std::vector<double>> params;
};
std::vector<std::vector<double>> values(Net<Tensor>& n) {
  std::vector<std::vector<double>> out;
  for (const auto& t : distinct_params(n)) {
    out.emplace_back();
    for (std::int64_t i = 0; i < t.numel(); ++i) out.back().push_back(t.get(i));
  }
  return out;
}

// The unsharded engine over `world` x `micro` samples per step: gradients summed per rank
// over its micro-batches, then over ranks in rank order, divided by the world (the order
// ThreadGroup reduces in).
Run reference(int world, int micro, int steps) {
  Net<Tensor> net;
  Engine e(net);
  Run r;
  auto params = distinct_params(net);
  auto grads = distinct_grads(net);
  for (int step = 0; step < steps; ++step) {
    std::vector<std::vector<double>> total(params.size());
    for (std::size_t k = 0; k < params.size(); ++k) total[k].assign(static_cast<std::size_t>(params[k].numel()), 0.0);
    double loss = 0;
    for (int rank = 0; rank < world; ++rank) {
      for (auto& g : grads) std::fill(g.f64(), g.f64() + g.numel(), 0.0);
      for (int m = 0; m < micro; ++m) loss += e.run(sample(step, m, rank));
      for (std::size_t k = 0; k < params.size(); ++k)
        for (std::size_t i = 0; i < total[k].size(); ++i) total[k][i] += grads[k].f64()[i];
    }
    for (std::size_t k = 0; k < params.size(); ++k)
      for (std::size_t i = 0; i < total[k].size(); ++i) params[k].f64()[i] -= lr * (total[k][i] / world);
    r.losses.push_back(loss / (world * micro));
  }
  r.params = values(net);
  return r;
}

// The same engine sharded with strategy S (and P: precision) over `world` thread ranks.
template <class S, class P = fsdp::FullPrecision>
Run sharded(int world, int micro, int steps, fsdp::MeshShape mesh_shape = {}) {
  Run out;
  std::vector<std::vector<double>> losses(world);
  std::vector<std::vector<std::vector<double>>> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    Net<Tensor> net;
    fsdp::HostDevice device;
    fsdp::DeviceMesh<fsdp::ThreadComm> mesh(comm, mesh_shape.size() == world ? mesh_shape : fsdp::MeshShape{1, world});
    auto sm = fsdp::shard<S, P>(net, mesh, device, Wrap{});
    // The engine's own handles are the ones taken over (no copy is left behind).
    CHECK(net.in.weight.impl->storage == nullptr);
    Engine e(net, &sm);
    for (int step = 0; step < steps; ++step) {
      sm.zero_grad();
      double loss = 0;
      if (micro > 1) {
        auto no_sync = sm.no_sync();
        for (int m = 0; m + 1 < micro; ++m) loss += e.run(sample(step, m, comm.rank()));
      }
      loss += e.run(sample(step, micro - 1, comm.rank()));
      for (const auto& v : sm.shards()) {
        REQUIRE(v.dtype == fsdp::DType::f64);
        auto* p = static_cast<double*>(v.param);
        const auto* g = static_cast<const double*>(v.grad);
        for (std::int64_t i = 0; i < v.numel; ++i) p[i] -= lr * g[i];
      }
      losses[comm.rank()].push_back(loss);
    }
    CHECK(e.seen_dtype == (std::is_same_v<P, fsdp::FullPrecision> ? fsdp::DType::f64 : fsdp::DType::f32));
    auto summon = sm.summon_full_params();
    per_rank[comm.rank()] = values(net);
  });
  for (int r = 1; r < world; ++r) REQUIRE(per_rank[r] == per_rank[0]);
  out.params = per_rank[0];
  for (int s = 0; s < steps; ++s) {
    double sum = 0;
    for (int r = 0; r < world; ++r) sum += losses[r][s];
    out.losses.push_back(sum / (world * micro));
  }
  return out;
}

void check_same(const Run& got, const Run& want, double tolerance) {
  REQUIRE(got.params.size() == want.params.size());
  for (std::size_t k = 0; k < got.params.size(); ++k) {
    CAPTURE(k);
    REQUIRE(got.params[k].size() == want.params[k].size());
    if (tolerance == 0) {
      CHECK(std::memcmp(got.params[k].data(), want.params[k].data(), got.params[k].size() * sizeof(double)) == 0);
    } else {
      double worst = 0;
      for (std::size_t i = 0; i < got.params[k].size(); ++i) worst = std::max(worst, std::fabs(got.params[k][i] - want.params[k][i]));
      CHECK(worst <= tolerance);
    }
  }
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s)
    CHECK(got.losses[s] == doctest::Approx(want.losses[s]).epsilon(tolerance == 0 ? 1e-12 : tolerance));
}

template <class M>
std::string shard_error(M& m) {
  return error_of([&] {
    fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
      fsdp::HostDevice device;
      fsdp::Sharded<M> unit(m, comm, device);
    });
  });
}

}  // namespace

TEST_CASE("handle tensors visited by copies train sharded as unsharded (FullShard, ShardGradOp, NoShard)") {
  constexpr int steps = 4;
  for (int world : {2, 4}) {
    CAPTURE(world);
    const Run want = reference(world, 1, steps);
    check_same(sharded<fsdp::FullShard>(world, 1, steps), want, 0);
    check_same(sharded<fsdp::ShardGradOp>(world, 1, steps), want, 0);
    check_same(sharded<fsdp::NoShard>(world, 1, steps), want, 0);
  }
}

TEST_CASE("handle tensors visited by copies train sharded as unsharded (HybridShard on a 2x2 mesh)") {
  // Reduced in the shard groups, then across replicas: another sum order than rank order.
  check_same(sharded<fsdp::HybridShard>(4, 1, 4, fsdp::MeshShape{2, 2}), reference(4, 1, 4), 1e-12);
}

TEST_CASE("handle tensors: gradient accumulation under no_sync, and MixedPrecision") {
  for (int world : {2, 4}) {
    CAPTURE(world);
    const Run want = reference(world, 3, 3);
    check_same(sharded<fsdp::FullShard>(world, 3, 3), want, 0);
    check_same(sharded<fsdp::ShardGradOp>(world, 3, 3), want, 0);
  }
  // Shown in f32 through the handles (rebind with a dtype), master weights in f64.
  check_same(sharded<fsdp::FullShard, fsdp::MixedPrecision<float>>(2, 1, 3), reference(2, 1, 3), 1e-5);
}

TEST_CASE("handle tensors: summon_full_params shows and writes back through the engine's handles; ties are one parameter") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Net<Tensor> net;
    const std::vector<double> initial(net.in.weight.f64(), net.in.weight.f64() + net.in.weight.numel());
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{});
    CHECK(net.in.weight.f64() == nullptr);  // sharded: the engine's handle views nothing
    {
      auto summon = sm.summon_full_params({.writeback = true});
      REQUIRE(net.in.weight.f64() != nullptr);
      CHECK(std::vector<double>(net.in.weight.f64(), net.in.weight.f64() + net.in.weight.numel()) == initial);
      net.in.weight.f64()[0] = 42.0;  // written back
    }
    CHECK(net.in.weight.f64() == nullptr);
    {
      auto summon = sm.summon_full_params();
      CHECK(net.in.weight.f64()[0] == 42.0);
      CHECK(net.block.b.weight.f64() == net.block.a.weight.f64());  // one tensor
    }
    // The tie is one parameter of the block's unit, stored once, under both names.
    int found = 0;
    for (const auto& p : sm.parameters()) {
      CHECK(p.fqn != "block.b.weight");
      if (p.fqn == "block.a.weight") {
        ++found;
        REQUIRE(p.aliases.size() == 1);
        CHECK(p.aliases[0] == "block.b.weight");
      }
    }
    CHECK(found == 1);
  });
}

TEST_CASE("handle tensors: an ignored parameter is named by its identity, and gradient() finds any copy") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Net<Tensor> net;
    fsdp::HostDevice device;
    const Tensor copy = net.in.bias;  // a copy of the handle: the same tensor
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{},
                                           fsdp::ShardOptions{.ignored_parameters = {fsdp::tensor_identity(copy)}});
    for (const auto& p : sm.parameters()) CHECK(p.fqn != "in.bias");
    CHECK(net.in.bias.impl->storage != nullptr);  // left to the engine
    CHECK(net.in.weight.impl->storage == nullptr);
    const auto msg = error_of([&] { (void)sm.gradient(net.in.bias); });
    CHECK(contains(msg, "is not a parameter of any unit"));
  });
}

TEST_CASE("handle tensors: deferred init fills the storage the library binds to the engine's handles") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Net<Tensor> eager, net;
    auto all = distinct_params(net);
    for (const auto& g : distinct_grads(net)) all.push_back(g);
    for (auto& t : all) {  // built from shapes and dtypes alone
      t.impl->storage.reset();
      t.impl->data = nullptr;
    }
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{}, fsdp::deferred_init([](auto& m) {
                                             if constexpr (requires { m.reset(); }) m.reset();
                                           }));
    auto summon = sm.summon_full_params();
    CHECK(values(net) == values(eager));
  });
}

TEST_CASE("handle tensors: a take-over that fails gives every tensor its storage and values back") {
  Net<Tensor> net;
  const std::vector<double> w(net.in.weight.f64(), net.in.weight.f64() + net.in.weight.numel());
  const auto* storage = net.in.weight.impl->storage.get();
  net.out.bias.impl->refuse_rebind = true;
  const auto msg = error_of([&] {
    fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
      fsdp::HostDevice device;
      auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{});
    });
  });
  CAPTURE(msg);
  CHECK(contains(msg, "this tensor refuses to be rebound"));
  CHECK(contains(msg, "every tensor keeps its storage and values"));
  CHECK(net.in.weight.impl->storage.get() == storage);
  REQUIRE(net.in.weight.f64() != nullptr);
  CHECK(std::vector<double>(net.in.weight.f64(), net.in.weight.f64() + net.in.weight.numel()) == w);
  CHECK(net.block.b.weight.f64() == net.block.a.weight.f64());
  CHECK(net.out.weight.f64() != nullptr);
}

TEST_CASE("handle tensors without keep/restore: a failed take-over counts a tied tensor once among those left empty") {
  Block<Unkept> m;
  m.b.bias.impl->refuse_rebind = true;
  const auto msg = shard_error(m);
  CAPTURE(msg);
  // Before b.bias: the gradients (a.weight_grad under two names) and a.weight, a.bias.
  CHECK(contains(msg, "tensor_traits<T>::rebind threw while the unit took over parameter 'b.bias'"));
  CHECK(contains(msg, "but 5 tensors rebound before it are left without storage"));
  CHECK(m.a.weight.f64() == nullptr);
}

TEST_CASE("handle tensors: a visitor that hands over new tensors at each visit (detach()) is refused") {
  Linear<Tensor> m(3, 2, 1);
  m.visit = Visit::new_tensors;
  const double w0 = m.weight.f64()[0];
  const auto msg = shard_error(m);
  CAPTURE(msg);
  CHECK(contains(msg, "unit '<root>' on rank 0: the module's visitor handed over parameter 'weight' as another tensor "
                      "object on a second visit"));
  CHECK(contains(msg, "not temporaries"));
  CHECK(m.weight.f64()[0] == w0);  // nothing was taken
  CHECK(m.weight.impl->storage != nullptr);
}

TEST_CASE("the same tensor type visited by copies without the handle declaration is refused") {
  Linear<Unmarked> m(3, 2, 1);
  const auto msg = shard_error(m);
  CAPTURE(msg);
  CHECK(contains(msg, "the module's visitor handed over parameter 'weight' as another tensor object"));
  CHECK(contains(msg, "not temporaries"));
  CHECK(m.weight.impl->storage != nullptr);
}

TEST_CASE("handle tensors: the library's copies of the handles live as long as the unit") {
  std::weak_ptr<Impl> weight;
  {
    Linear<Tensor> m(3, 2, 1);
    weight = m.weight.impl;
    fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
      fsdp::HostDevice device;
      fsdp::Sharded<Linear<Tensor>> unit(m, comm, device);
      CHECK(weight.use_count() == 2);  // the engine's handle and the unit's copy
    });
    CHECK(weight.use_count() == 1);  // the unit let its copy go
    CHECK(m.weight.f64() == nullptr);  // after handing the tensor back without storage, as for any type
  }
  CHECK(weight.expired());
}

}  // namespace core_handle_tensors_test
