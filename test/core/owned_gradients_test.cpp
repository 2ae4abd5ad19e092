// Engines that own no gradient tensors (mlpack's FFN layers compute their gradient into a
// matrix the caller passes) and keep several views of one parameter block (mlpack's
// `weights`, with `weight` and `bias` aliases into it): the module visits f(name, param)
// without a gradient, the library owns the gradient and hands it out as a GradientView
// during the unit's backward, and the module's parameters_rebound hook re-points the
// aliases whenever the library re-points `weights`.
//
// The engine here is written in that shape: column-major matrices that own memory or alias
// someone else's, layers whose forward and backward read the aliases only. Trained sharded
// it must match the same engine trained unsharded (bitwise where the sum order is the
// same, as in sharded_parity_test.cpp), which it cannot if the aliases are left stale.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <fsdp/fsdp.hpp>

#include "test/support/errors.hpp"

namespace core_owned_gradients_test {

// arma::mat-like: column-major, owning its memory or (make_alias) a view of someone else's.
// The library rebinds only what a module visits; an alias keeps pointing wherever it was
// made to. Rebinding keeps the owned memory (as an engine whose allocator never returns it
// would): a stale alias then reads frozen values, silently, the failure this test catches.
struct Mat {
  Mat() = default;
  Mat(std::int64_t rows, std::int64_t cols) : mem(static_cast<std::size_t>(rows * cols)), ptr(mem.data()), n_rows(rows), n_cols(cols) {}
  Mat(const Mat&) = delete;  // the library keeps the address of a visited tensor
  Mat& operator=(const Mat&) = delete;
  double& operator()(std::int64_t i, std::int64_t j) const { return ptr[i + j * n_rows]; }
  void make_alias(double* p, std::int64_t rows, std::int64_t cols) { ptr = p, n_rows = rows, n_cols = cols; }
  std::int64_t numel() const { return n_rows * n_cols; }

  std::vector<double> mem;
  double* ptr = nullptr;
  std::int64_t n_rows = 0, n_cols = 0;
  bool refuse_rebind = false;  // a rebind that throws: the take-over fails and rolls back
};

}  // namespace core_owned_gradients_test

template <>
struct fsdp::tensor_traits<core_owned_gradients_test::Mat> {
  using Mat = core_owned_gradients_test::Mat;
  static fsdp::DType dtype(const Mat&) { return fsdp::DType::f64; }
  static std::vector<std::int64_t> shape(const Mat& m) { return {m.n_rows, m.n_cols}; }
  static void* data(Mat& m) { return m.ptr; }
  static fsdp::DeviceId device(const Mat&) { return {}; }
  static void rebind(Mat& m, void* p) {
    if (m.refuse_rebind) throw std::runtime_error("this matrix refuses to be rebound");
    m.ptr = static_cast<double*>(p);
  }
  static double* keep(Mat& m) { return m.ptr; }
  static void restore(Mat& m, double*&& p) noexcept { m.ptr = p; }
};

namespace core_owned_gradients_test {

// mlpack's Linear: one parameter block `weights` (out x in weights, then out biases) and the
// aliases the layer computes with. No gradient tensor: backward writes into `gradient`,
// a block laid out as `weights`, given by the caller.
struct Linear {
  Linear(std::int64_t in_, std::int64_t out_, std::uint64_t seed) : in(in_), out(out_), weights(out_ * in_ + out_, 1) {
    for (std::int64_t k = 0; k < weights.numel(); ++k)
      weights.ptr[k] = std::sin(static_cast<double>(seed * 131 + static_cast<std::uint64_t>(k) * 7 + 3)) * 0.4;
    alias();
  }
  void alias() {  // mlpack's Linear::SetWeights
    weight.make_alias(weights.ptr, out, in);
    bias.make_alias(weights.ptr ? weights.ptr + out * in : nullptr, out, 1);
  }
  std::vector<double> forward(const std::vector<double>& x) {
    input = x;
    std::vector<double> y(static_cast<std::size_t>(out));
    for (std::int64_t i = 0; i < out; ++i) {
      double s = bias(i, 0);
      for (std::int64_t j = 0; j < in; ++j) s += weight(i, j) * x[static_cast<std::size_t>(j)];
      y[static_cast<std::size_t>(i)] = s;
    }
    return y;
  }
  // Adds this sample's gradient into `gradient` (+=: it may hold what earlier micro-batches left).
  std::vector<double> backward(const std::vector<double>& dy, double* gradient) {
    std::vector<double> dx(static_cast<std::size_t>(in), 0.0);
    for (std::int64_t j = 0; j < in; ++j)
      for (std::int64_t i = 0; i < out; ++i) {
        gradient[i + j * out] += dy[static_cast<std::size_t>(i)] * input[static_cast<std::size_t>(j)];
        dx[static_cast<std::size_t>(j)] += weight(i, j) * dy[static_cast<std::size_t>(i)];
      }
    for (std::int64_t i = 0; i < out; ++i) gradient[out * in + i] += dy[static_cast<std::size_t>(i)];
    return dx;
  }

  std::int64_t in, out;
  Mat weights, weight, bias;
  std::vector<double> input;
  std::vector<double> reference_grad;  // the unsharded engine's gradient block
  int rebound = 0;                     // parameters_rebound calls
  bool hook_throws = false;            // parameters_rebound fails (after counting)
};

// A per-feature gain that does own its gradient tensor: a model may mix both kinds.
struct Gain {
  explicit Gain(std::int64_t dim) : g(dim, 1), g_grad(dim, 1) {
    for (std::int64_t i = 0; i < dim; ++i) g.ptr[i] = 1.0 + 0.125 * static_cast<double>(i % 3);
  }
  template <class F> void visit_parameters(F&& f) { f("g", g, g_grad); }
  std::vector<double> forward(const std::vector<double>& x) {
    input = x;
    std::vector<double> y(x.size());
    for (std::size_t i = 0; i < x.size(); ++i) y[i] = g.ptr[i] * x[i];
    return y;
  }
  std::vector<double> backward(const std::vector<double>& dy) {
    std::vector<double> dx(dy.size());
    for (std::size_t i = 0; i < dy.size(); ++i) {
      g_grad.ptr[i] += dy[i] * input[i];
      dx[i] = g.ptr[i] * dy[i];
    }
    return dx;
  }
  Mat g, g_grad;
  std::vector<double> input;
};

struct Block {  // one unit: a Linear (gradient owned by the library) and a Gain (its own)
  Block() : lin(7, 6, 2), gain(6) {}
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) { f("lin", lin); f("gain", gain); }
  Linear lin;
  Gain gain;
};

struct Net {
  template <class F> void visit_parameters(F&&) {}
  template <class F> void visit_children(F&& f) { f("in", in); f("block", block); f("out", out); }
  Linear in{5, 7, 1};
  Block block;
  Linear out{6, 3, 3};
};

}  // namespace core_owned_gradients_test

// The glue an engine whose types it does not own writes (mlpack's): visit the block without
// a gradient, re-point the aliases when it moves.
template <>
struct fsdp::module_traits<core_owned_gradients_test::Linear> {
  template <class F> static void visit_parameters(core_owned_gradients_test::Linear& l, F&& f) { f("weights", l.weights); }
  static void parameters_rebound(core_owned_gradients_test::Linear& l) {
    ++l.rebound;
    l.alias();
    if (l.hook_throws) throw std::runtime_error("this layer's hook refuses");
  }
};

namespace core_owned_gradients_test {
namespace {

using Wrap = fsdp::wrap_types<Linear, Block>;
constexpr double lr = 0.1;

// Sample `s` of the global batch at step `step`, micro-batch `micro`.
struct Sample {
  std::vector<double> x, t;
};
Sample sample(int step, int micro, int s) {
  Sample out{std::vector<double>(5), std::vector<double>(3)};
  for (int i = 0; i < 5; ++i) out.x[i] = std::cos(0.7 * step + 1.3 * micro + 0.37 * s + 0.91 * i);
  for (int i = 0; i < 3; ++i) out.t[i] = std::sin(0.3 * step + 0.5 * micro + 0.11 * s + 1.7 * i) * 0.5;
  return out;
}

// The engine's step over one sample: forward, 0.5 |y - t|^2, backward. With `sm` each
// module's unit hooks run around it and the Linears write into GradientViews; without,
// into their own reference_grad (the unsharded engine).
struct Engine {
  explicit Engine(Net& n, fsdp::ShardedModel* s = nullptr) : net(n), sm(s) {}
  Net& net;
  fsdp::ShardedModel* sm;

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
  double* gradient_of(Linear& l) {
    if (!sm) return l.reference_grad.data();
    const fsdp::GradientView g = sm->gradient(l.weights);
    REQUIRE(g.numel == l.weights.numel());
    return g.as<double>().data();
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
        h1 = net.in.forward(s.x);
      }
      tanh_in_place(h1, a1);
      {
        auto u = forward_scope(net.block);
        h2 = net.block.gain.forward(net.block.lin.forward(h1));
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
        d = net.out.backward(dy, gradient_of(net.out));
      }
      tanh_backward(d, a2);
      {
        auto u = backward_scope(net.block);
        d = net.block.lin.backward(net.block.gain.backward(d), gradient_of(net.block.lin));
      }
      tanh_backward(d, a1);
      auto u = backward_scope(net.in);
      net.in.backward(d, gradient_of(net.in));
    }
    if (sm) sm->finish_backward();
    return loss;
  }
  std::vector<double> a1, a2;
};

struct Run {
  std::vector<double> losses;            // per step: the mean over the global batch
  std::vector<std::vector<double>> params;  // in.weights, block.lin.weights, block.gain.g, out.weights
};

std::vector<double> values(const Mat& m) { return {m.ptr, m.ptr + m.numel()}; }
std::vector<std::vector<double>> all_params(Net& net) {
  return {values(net.in.weights), values(net.block.lin.weights), values(net.block.gain.g), values(net.out.weights)};
}

// The unsharded engine over `world` x `micro` samples per step. Gradients are summed per
// rank over its micro-batches, then over ranks in rank order, then divided by the world:
// the order in which the sharded runs sum them (ThreadGroup reduces in rank order).
Run reference(int world, int micro, int steps) {
  Net net;
  Engine e{net};
  Run r;
  std::vector<Linear*> linears{&net.in, &net.block.lin, &net.out};
  for (int step = 0; step < steps; ++step) {
    std::vector<std::vector<double>> total(linears.size());
    std::vector<double> gain_total(6, 0.0);
    for (std::size_t k = 0; k < linears.size(); ++k) total[k].assign(static_cast<std::size_t>(linears[k]->weights.numel()), 0.0);
    double loss = 0;
    for (int rank = 0; rank < world; ++rank) {
      for (auto* l : linears) l->reference_grad.assign(static_cast<std::size_t>(l->weights.numel()), 0.0);
      std::fill(net.block.gain.g_grad.ptr, net.block.gain.g_grad.ptr + 6, 0.0);
      for (int m = 0; m < micro; ++m) loss += e.run(sample(step, m, rank));
      for (std::size_t k = 0; k < linears.size(); ++k)
        for (std::size_t i = 0; i < total[k].size(); ++i) total[k][i] += linears[k]->reference_grad[i];
      for (std::size_t i = 0; i < 6; ++i) gain_total[i] += net.block.gain.g_grad.ptr[i];
    }
    for (std::size_t k = 0; k < linears.size(); ++k)
      for (std::size_t i = 0; i < total[k].size(); ++i) linears[k]->weights.ptr[i] -= lr * (total[k][i] / world);
    for (std::size_t i = 0; i < 6; ++i) net.block.gain.g.ptr[i] -= lr * (gain_total[i] / world);
    r.losses.push_back(loss / (world * micro));
  }
  r.params = all_params(net);
  return r;
}

// The same engine sharded with strategy S over `world` thread ranks (a replicate x shard
// mesh for the hybrid strategies), `micro` micro-batches per step, all but the last under
// no_sync.
template <class S>
Run sharded(int world, int micro, int steps, fsdp::MeshShape mesh_shape = {}) {
  Run out;
  std::vector<std::vector<double>> losses(world);
  std::vector<std::vector<std::vector<double>>> per_rank(world);
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& comm) {
    Net net;
    fsdp::HostDevice device;
    fsdp::DeviceMesh<fsdp::ThreadComm> mesh(comm, mesh_shape.size() == world ? mesh_shape : fsdp::MeshShape{1, world});
    auto sm = fsdp::shard<S>(net, mesh, device, Wrap{});
    Engine e{net, &sm};
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
    auto summon = sm.summon_full_params();
    // The aliases view what the library shows: the hook ran after the summon's gather.
    for (Linear* l : {&net.in, &net.block.lin, &net.out}) {
      CHECK(l->weight.ptr == l->weights.ptr);
      CHECK(l->bias.ptr == l->weights.ptr + l->out * l->in);
    }
    per_rank[comm.rank()] = all_params(net);
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

void check_same(const Run& got, const Run& want, bool bitwise) {
  REQUIRE(got.params.size() == want.params.size());
  for (std::size_t k = 0; k < got.params.size(); ++k) {
    CAPTURE(k);
    REQUIRE(got.params[k].size() == want.params[k].size());
    if (bitwise) {
      CHECK(std::memcmp(got.params[k].data(), want.params[k].data(), got.params[k].size() * sizeof(double)) == 0);
    } else {
      double worst = 0;
      for (std::size_t i = 0; i < got.params[k].size(); ++i) worst = std::max(worst, std::fabs(got.params[k][i] - want.params[k][i]));
      CHECK(worst <= 1e-12);
    }
  }
  REQUIRE(got.losses.size() == want.losses.size());
  for (std::size_t s = 0; s < got.losses.size(); ++s) CHECK(got.losses[s] == doctest::Approx(want.losses[s]).epsilon(1e-12));
}

}  // namespace

TEST_CASE("an engine without gradient tensors trains sharded as unsharded (FullShard, ShardGradOp, NoShard)") {
  constexpr int steps = 4;
  for (int world : {2, 4}) {
    CAPTURE(world);
    const Run want = reference(world, 1, steps);
    check_same(sharded<fsdp::FullShard>(world, 1, steps), want, true);
    check_same(sharded<fsdp::ShardGradOp>(world, 1, steps), want, true);
    check_same(sharded<fsdp::NoShard>(world, 1, steps), want, true);
  }
}

TEST_CASE("an engine without gradient tensors trains sharded as unsharded (HybridShard on a 2x2 mesh)") {
  // Reduced in the shard groups, then across replicas: another sum order than rank order.
  check_same(sharded<fsdp::HybridShard>(4, 1, 4, fsdp::MeshShape{2, 2}), reference(4, 1, 4), false);
}

TEST_CASE("gradients the library owns accumulate over micro-batches under no_sync") {
  for (int world : {2, 4}) {
    CAPTURE(world);
    const Run want = reference(world, 3, 3);
    check_same(sharded<fsdp::FullShard>(world, 3, 3), want, true);
    check_same(sharded<fsdp::ShardGradOp>(world, 3, 3), want, true);
    check_same(sharded<fsdp::NoShard>(world, 3, 3), want, true);
  }
  check_same(sharded<fsdp::HybridShard>(4, 3, 3, fsdp::MeshShape{2, 2}), reference(4, 3, 3), false);
}

TEST_CASE("parameters_rebound runs after each pass that re-points a module's parameters") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Net net;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{});
    Linear& l = net.in;
    // Taken over: `weights` views no storage (sharded), and so do the aliases.
    CHECK(l.rebound == 1);
    CHECK(l.weights.ptr == nullptr);
    CHECK(l.weight.ptr == nullptr);
    CHECK(l.bias.ptr == nullptr);
    {
      auto u = sm.unit_for(l).forward_scope();  // gathered: the aliases follow
      CHECK(l.rebound == 2);
      REQUIRE(l.weights.ptr != nullptr);
      CHECK(l.weight.ptr == l.weights.ptr);
      CHECK(l.bias.ptr == l.weights.ptr + l.out * l.in);
    }
    CHECK(l.rebound == 3);  // resharded after forward
    CHECK(l.weight.ptr == nullptr);
    CHECK(net.out.rebound == 1);  // another unit's module: not called for this unit's passes
    {
      auto summon = sm.summon_full_params();
      CHECK(l.rebound == 4);
      CHECK(l.weight.ptr == l.weights.ptr);
      CHECK(l.weight(0, 0) == doctest::Approx(std::sin(1.0 * 131 + 3) * 0.4));
    }
    CHECK(l.rebound == 5);
    sm.reshard();  // nothing gathered: nothing re-pointed, no call
    CHECK(l.rebound == 5);
  });
}

TEST_CASE("parameters_rebound: NoShard re-points once, and the aliases see the optimizer's updates in place") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Net net;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::NoShard>(net, comm, device, Wrap{});
    Engine e{net, &sm};
    CHECK(net.in.rebound == 1);
    CHECK(net.in.weight.ptr == net.in.weights.ptr);
    CHECK(net.in.weights.ptr != net.in.weights.mem.data());  // the unit's storage, not the engine's
    sm.zero_grad();
    e.run(sample(0, 0, comm.rank()));
    const double before = net.in.weight(0, 0);
    for (const auto& v : sm.shards())
      for (std::int64_t i = 0; i < v.numel; ++i) static_cast<double*>(v.param)[i] -= 1.0;
    CHECK(net.in.weight(0, 0) == before - 1.0);
    CHECK(net.in.rebound == 1);
  });
}

TEST_CASE("a take-over that fails gives the tensors back and runs parameters_rebound again") {
  fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
    Net net;
    fsdp::HostDevice device;
    double* own = net.in.weights.ptr;
    net.out.weights.refuse_rebind = true;  // taken over after `in` and `block`
    const std::string e = test_support::error_of([&] { (void)fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{}); });
    CHECK(test_support::contains(e, "refuses to be rebound"));
    CHECK(net.in.weights.ptr == own);  // restored (keep/restore)
    CHECK(net.in.rebound == 2);        // after its unit took over, and after the roll back
    CHECK(net.in.weight.ptr == own);   // so the aliases view the engine's storage again
    CHECK(net.in.bias.ptr == own + net.in.out * net.in.in);
  });
}

TEST_CASE("gradient(): refused outside the unit's backward, for engine-held gradients and for other tensors") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Net net;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{});
    const std::string rank = "on rank " + std::to_string(comm.rank());
    std::string e = test_support::error_of([&] { (void)sm.gradient(net.in.weights); });
    CHECK(test_support::contains(e, "unit 'in' " + rank + ": gradient('in.weights') outside its backward (the unit is IDLE)"));
    CHECK(test_support::contains(e, "between the unit's pre_backward and post_backward"));
    {
      auto f = sm.unit_for(net.in).forward_scope();
      e = test_support::error_of([&] { (void)sm.gradient(net.in.weights); });
      CHECK(test_support::contains(e, "outside its backward (the unit is FORWARD)"));
    }
    e = test_support::error_of([&] { (void)sm.gradient(net.block.gain.g); });
    CHECK(test_support::contains(e, "unit 'block' " + rank + ": gradient('block.gain.g'): the parameter was visited with a "
                                    "gradient tensor of its own"));
    e = test_support::error_of([&] { (void)sm.gradient(net.in.weight); });  // an alias: not visited
    CHECK(test_support::contains(e, "ShardedModel " + rank + ": gradient(): the tensor at "));
    CHECK(test_support::contains(e, "is not a parameter of any unit"));
    e = test_support::error_of([&] { (void)sm.unit_for(net.in).gradient(net.out.weights); });
    CHECK(test_support::contains(e, "unit 'in' " + rank + ": gradient(): the tensor at "));
    CHECK(test_support::contains(e, "is not a parameter of this unit"));

    // In the unit's backward: a view of the parameter's gradient, in its dtype only.
    {
      auto f = sm.unit_for(net.in).forward_scope();
    }
    sm.zero_grad();
    {
      auto b = sm.unit_for(net.in).backward_scope();
      const fsdp::GradientView g = sm.gradient(net.in.weights);
      CHECK(g.fqn == "in.weights");
      CHECK(g.unit == "in");
      CHECK(g.dtype == fsdp::DType::f64);
      CHECK(g.numel == 42);
      CHECK(std::vector<std::int64_t>(g.shape.begin(), g.shape.end()) == std::vector<std::int64_t>{42, 1});
      for (double v : g.as<double>()) CHECK(v == 0.0);  // zeroed for the engine to add into
      CHECK(g.as<const double>().data() == g.as<double>().data());
      CHECK(sm.unit_for(net.in).gradient(net.in.weights).data == g.data);
      e = test_support::error_of([&] { (void)g.as<float>(); });
      CHECK(test_support::contains(e, "unit 'in' " + rank + ": the gradient of 'in.weights' is f64, but as<f32>() was asked for"));
    }
    e = test_support::error_of([&] { (void)sm.gradient(net.in.weights); });
    CHECK(test_support::contains(e, "outside its backward (the unit is BACKWARD_POST)"));
    sm.finish_backward();
  });
}

TEST_CASE("gradient() inside summon_full_params with with_grads: the reduced gradient whole") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Net net;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{});
    Engine e{net, &sm};
    sm.zero_grad();
    e.run(sample(0, 0, comm.rank()));
    // This rank's slice of the sharded gradient, to find inside the whole one.
    const fsdp::ParamView* view = nullptr;
    for (const auto& p : sm.parameters())
      if (p.fqn == "out.weights") view = &p;
    REQUIRE(view != nullptr);
    {
      auto summon = sm.summon_full_params({.with_grads = true});
      const fsdp::GradientView g = sm.gradient(net.out.weights);
      const auto whole = g.as<double>();
      REQUIRE(whole.size() == 21);
      const auto* mine = static_cast<const double*>(view->grad);
      for (std::int64_t i = 0; i < view->count; ++i) CHECK(whole[static_cast<std::size_t>(view->param_begin + i)] == mine[i]);
    }
    {
      auto summon = sm.summon_full_params();
      const std::string err = test_support::error_of([&] { (void)sm.gradient(net.out.weights); });
      CHECK(test_support::contains(err, "outside its backward (the unit is SUMMON_FULL_PARAMS, summoned without with_grads)"));
    }
  });
}

namespace erased {
// A type-erased tree (a virtual base, visitors taking std::function) in the same shape: the
// two-argument visitor converts, and the hook may be a (virtual) member.
struct Layer {
  virtual ~Layer() = default;
  virtual void visit_parameters(const std::function<void(std::string_view, Mat&)>&) {}
  virtual void visit_children(const std::function<void(std::string_view, Layer&)>&) {}
  virtual void parameters_rebound() {}
};
struct Dense final : Layer {
  Dense() : weights(6, 1) { alias(); }
  void visit_parameters(const std::function<void(std::string_view, Mat&)>& f) override { f("weights", weights); }
  void parameters_rebound() override {
    ++rebound;
    alias();
  }
  void alias() { weight.make_alias(weights.ptr, 2, 2), bias.make_alias(weights.ptr ? weights.ptr + 4 : nullptr, 2, 1); }
  Mat weights, weight, bias;
  int rebound = 0;
};
struct Stack final : Layer {
  void visit_children(const std::function<void(std::string_view, Layer&)>& f) override { f("a", a); f("b", b); }
  Dense a, b;
};
}  // namespace erased

// ADL: a free parameters_rebound next to the module type.
namespace adl {
struct Dense {
  Mat weights{3, 1};
  int rebound = 0;
  template <class F> void visit_parameters(F&& f) { f("weights", weights); }
};
inline void parameters_rebound(Dense& d) { ++d.rebound; }
}  // namespace adl

TEST_CASE("parameters_rebound as a virtual member and by ADL; two-argument type-erased visitors") {
  static_assert(fsdp::Module<erased::Layer>);
  static_assert(fsdp::detail::has_parameters_rebound<erased::Layer> && fsdp::detail::has_parameters_rebound<adl::Dense>);
  static_assert(!fsdp::detail::has_parameters_rebound<Block>);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    erased::Stack stack;
    adl::Dense d;
    fsdp::HostDevice device;
    {
      auto sm = fsdp::shard<fsdp::FullShard>(static_cast<erased::Layer&>(stack), comm, device, fsdp::wrap_modules(stack.a));
      CHECK(stack.a.rebound == 1);
      CHECK(stack.b.rebound == 1);
      {
        auto f = sm.unit_for(stack.a).forward_scope();
        CHECK(stack.a.rebound == 2);
        CHECK(stack.b.rebound == 1);
        CHECK(stack.a.weight.ptr == stack.a.weights.ptr);
        CHECK(stack.a.weights.ptr != nullptr);
      }
      auto sd = fsdp::shard<fsdp::FullShard>(d, comm, device);
      CHECK(d.rebound == 1);
      {
        auto summon = sd.summon_full_params();
        CHECK(d.rebound == 2);
      }
      CHECK(d.rebound == 3);
    }
    // The units are gone: the tensors were handed back empty, and the modules told.
    CHECK(stack.a.rebound == 4);
    CHECK(stack.a.weight.ptr == nullptr);
    CHECK(d.rebound == 4);
  });
}

TEST_CASE("parameters_rebound: deferred init re-points the aliases before the init writes through them") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Net net;
    for (Linear* l : {&net.in, &net.block.lin, &net.out}) {  // built from shapes alone
      l->weights.mem.clear();
      l->weights.ptr = nullptr;
      l->alias();
    }
    int inits = 0;
    std::vector<std::string> stale;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{},
                                           fsdp::deferred_init([&](auto& m, std::string_view fqn) {
                                             if constexpr (std::is_same_v<std::decay_t<decltype(m)>, Linear>) {
                                               ++inits;
                                               // mlpack's init writes through `weight` and `bias`
                                               if (m.weights.ptr == nullptr || m.weight.ptr != m.weights.ptr) {
                                                 stale.emplace_back(fqn);
                                                 return;
                                               }
                                               for (std::int64_t i = 0; i < m.out; ++i) {
                                                 for (std::int64_t j = 0; j < m.in; ++j) m.weight(i, j) = 0.01 * static_cast<double>(i + 3 * j);
                                                 m.bias(i, 0) = -0.5;
                                               }
                                             }
                                           }));
    CHECK(inits == 3);
    CHECK(stale.empty());
    Linear& l = net.block.lin;
    CHECK(l.weight.ptr == nullptr);  // sharded: the aliases let go of the freed init storage too
    auto summon = sm.summon_full_params();
    REQUIRE(l.weight.ptr != nullptr);
    CHECK(l.weight(1, 2) == doctest::Approx(0.07));
    CHECK(l.bias(2, 0) == -0.5);
  });
}

TEST_CASE("parameters_rebound that throws: abort_step still recovers, a failed summon leaves nothing bound") {
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    Net net;
    fsdp::HostDevice device;
    auto sm = fsdp::shard<fsdp::FullShard>(net, comm, device, Wrap{});
    Linear& l = net.in;
    fsdp::Unit& u = sm.unit_for(l);
    l.hook_throws = true;
    CHECK_THROWS_WITH(u.pre_forward(), doctest::Contains("this layer's hook refuses"));
    // The recovery runs the hook again (the tensors are re-pointed) but is not stopped by it.
    const int before = l.rebound;
    CHECK_NOTHROW(sm.abort_step());
    CHECK(l.rebound == before + 1);
    CHECK(u.state() == fsdp::TrainingState::IDLE);
    CHECK(l.weights.ptr == nullptr);  // nothing left gathered
    CHECK(l.weight.ptr == nullptr);

    // A summon whose gather's hook throws: the full parameters are freed and unbound again,
    // so the next forward gathers (and casts) afresh instead of finding them bound.
    CHECK_THROWS_WITH((void)sm.summon_full_params(), doctest::Contains("this layer's hook refuses"));
    l.hook_throws = false;
    CHECK(l.weights.ptr == nullptr);
    CHECK(l.weight.ptr == nullptr);
    {
      auto scope = u.forward_scope();
      REQUIRE(l.weights.ptr != nullptr);
      CHECK(l.weight.ptr == l.weights.ptr);
    }
  });
}

}  // namespace core_owned_gradients_test
