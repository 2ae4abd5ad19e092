#pragma once
// Sharded training whose tensors live in a Device's memory, for tests that must run the
// same training on different Devices (HostDevice, CudaDevice) and communicators
// (ThreadComm, StagedCommunicator) and compare the results bit for bit.
//
// The model is tiny and element-wise: h0 = x * gain * scale, then per layer
// h = tanh(w * h + b), and a squared-error loss. Its tensors are DevTensors: raw pointers
// into the Device's memory. The "engine" computes on the host: at each unit's forward and
// backward it reads what it needs out of the Device with the Device's own copy and writes
// gradients back the same way. The library's whole device path (allocation, casts,
// all-gathers, reductions, offload copies, the synchronization at the end of backward)
// runs on the Device, while the model's arithmetic is the same host code on every Device.
// So two Devices that are correct must give identical parameters.
#include <doctest/doctest.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <fsdp/core/detail/host_math.hpp>
#include <fsdp/fsdp.hpp>

#include "test/support/full_params.hpp"

namespace test_support {

// A tensor that is a view of Device memory; it may own that memory (until rebound).
struct DevTensor {
  void* data = nullptr;
  std::vector<std::int64_t> shape;
  fsdp::DType dtype = fsdp::DType::f32;
  fsdp::DeviceId device;
  std::shared_ptr<void> owner;  // frees the engine's own storage through its Device

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  std::size_t bytes() const { return static_cast<std::size_t>(numel()) * fsdp::size_of(dtype); }
};

}  // namespace test_support

template <>
struct fsdp::tensor_traits<test_support::DevTensor> {
  using T = test_support::DevTensor;
  static DType dtype(const T& t) { return t.dtype; }
  static std::span<const std::int64_t> shape(const T& t) { return t.shape; }
  static void* data(T& t) { return t.data; }
  static DeviceId device(const T& t) { return t.device; }
  static void rebind(T& t, void* p) { t.owner.reset(), t.data = p; }
  static void rebind(T& t, void* p, DType d) { rebind(t, p), t.dtype = d; }
};

namespace test_support {

// Host <-> Device element transfers in any floating dtype, through float, converted by
// the library's own host casts.
template <fsdp::Device D>
std::vector<float> read_floats(D& dev, const DevTensor& t) {
  std::vector<unsigned char> raw(t.bytes());
  if (!raw.empty()) dev.copy(raw.data(), t.data, raw.size());
  dev.synchronize();
  std::vector<float> out(static_cast<std::size_t>(t.numel()));
  fsdp::detail::host_cast(out.data(), fsdp::DType::f32, raw.data(), t.dtype, out.size());
  return out;
}

template <fsdp::Device D>
void write_floats(D& dev, DevTensor& t, const std::vector<float>& v) {
  REQUIRE(v.size() == static_cast<std::size_t>(t.numel()));
  std::vector<unsigned char> raw(t.bytes());
  fsdp::detail::host_cast(raw.data(), t.dtype, v.data(), fsdp::DType::f32, v.size());
  if (!raw.empty()) dev.copy(t.data, raw.data(), raw.size());
  dev.synchronize();
}

// Gradients accumulate, as an engine's backward does: g += delta, rounded to g's dtype.
template <fsdp::Device D>
void accumulate_floats(D& dev, DevTensor& g, const std::vector<float>& delta) {
  std::vector<float> now = read_floats(dev, g);
  for (std::size_t i = 0; i < now.size(); ++i) now[i] += delta[i];
  write_floats(dev, g, now);
}

struct DeviceTrainingConfig {
  int width = 24;
  int layers = 3;
  int batch = 2;  // samples per rank
  int steps = 3;
  float lr = 0.05f;
};

struct Layer {  // h' = tanh(w * h + b), element-wise
  DevTensor w, b, gw, gb;
  template <class F> void visit_parameters(F&& f) { f("w", w, gw), f("b", b, gb); }
};

template <fsdp::Device D>
struct Net {
  DevTensor gain, ggain;  // the root's parameter: h0 = x * gain * scale
  DevTensor scale;        // a buffer (f32), cast under MixedPrecision
  std::vector<Layer> layers;

  Net(D& dev, const DeviceTrainingConfig& c) : layers(static_cast<std::size_t>(c.layers)) {
    int k = 0;
    auto make = [&](DevTensor& p, DevTensor& g) {
      p = tensor(dev, c.width);
      std::vector<float> v(static_cast<std::size_t>(c.width));
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = 0.5f + 0.37f * std::sin(1.3f * static_cast<float>(i) + 0.7f * static_cast<float>(k));
      ++k;
      write_floats(dev, p, v);
      g = DevTensor{nullptr, p.shape, p.dtype, p.device, nullptr};  // the library binds it
    };
    make(gain, ggain);
    for (auto& l : layers) make(l.w, l.gw), make(l.b, l.gb);
    scale = tensor(dev, c.width);
    std::vector<float> s(static_cast<std::size_t>(c.width));
    for (std::size_t i = 0; i < s.size(); ++i) s[i] = 1.0f + 0.01f * static_cast<float>(i);
    write_floats(dev, scale, s);
  }

  template <class F> void visit_parameters(F&& f) { f("gain", gain, ggain); }
  template <class F> void visit_buffers(F&& f) { f("scale", scale); }
  template <class F> void visit_children(F&& f) {
    for (std::size_t i = 0; i < layers.size(); ++i) f("layers." + std::to_string(i), layers[i]);
  }

  static DevTensor tensor(D& dev, int n) {
    DevTensor t;
    t.shape = {n};
    t.device = dev.id();
    const std::size_t bytes = t.bytes();
    t.data = dev.allocate(bytes, fsdp::MemorySpace::device);
    t.owner = std::shared_ptr<void>(t.data, [&dev, bytes](void* p) { dev.deallocate(p, bytes, fsdp::MemorySpace::device); });
    return t;
  }
};

// Inputs and targets of `rank`'s samples at `step`: deterministic, different per rank.
inline std::vector<float> sample(int rank, int step, int s, int width, bool target) {
  std::vector<float> v(static_cast<std::size_t>(width));
  for (int i = 0; i < width; ++i)
    v[static_cast<std::size_t>(i)] = (target ? 0.3f : 1.0f) * std::cos(0.9f * i + 1.7f * rank + 0.45f * step + 2.3f * s + (target ? 1.0f : 0.0f));
  return v;
}

// One training step of `net`; `loss_scale` multiplies the output gradient (fp16 loss
// scaling). Returns the local loss.
template <fsdp::Device D>
double forward_backward(D& dev, Net<D>& net, fsdp::ShardedModel& sm, const DeviceTrainingConfig& c, int rank, int step,
                        double loss_scale) {
  const auto W = static_cast<std::size_t>(c.width);
  fsdp::Unit& root = *sm.find_unit_for(net);
  const auto B = static_cast<std::size_t>(c.batch);
  std::vector<std::vector<float>> xs(B), dh(B);
  // acts[k][s]: sample s's activations after layer k (k = 0: h0), kept for backward.
  std::vector<std::vector<std::vector<float>>> acts(net.layers.size() + 1, std::vector<std::vector<float>>(B));
  double loss = 0;
  const auto scale = read_floats(dev, net.scale);  // a buffer: valid outside the root's scopes too
  {
    auto root_scope = root.forward_scope();
    const auto gain = read_floats(dev, net.gain);
    for (std::size_t s = 0; s < B; ++s) {
      xs[s] = sample(rank, step, static_cast<int>(s), c.width, false);
      acts[0][s].resize(W);
      for (std::size_t i = 0; i < W; ++i) acts[0][s][i] = xs[s][i] * gain[i] * scale[i];
    }
    for (std::size_t k = 1; k <= net.layers.size(); ++k) {
      Layer& l = net.layers[k - 1];
      auto scope = sm.find_unit_for(l)->forward_scope();
      const auto w = read_floats(dev, l.w), b = read_floats(dev, l.b);
      for (std::size_t s = 0; s < B; ++s) {
        acts[k][s].resize(W);
        for (std::size_t i = 0; i < W; ++i) acts[k][s][i] = std::tanh(w[i] * acts[k - 1][s][i] + b[i]);
      }
    }
    for (std::size_t s = 0; s < B; ++s) {
      const auto t = sample(rank, step, static_cast<int>(s), c.width, true);
      dh[s].resize(W);
      for (std::size_t i = 0; i < W; ++i) {
        const float e = acts.back()[s][i] - t[i];
        loss += 0.5 * e * e / c.batch;
        dh[s][i] = static_cast<float>(e / c.batch * loss_scale);
      }
    }
  }
  auto root_scope = root.backward_scope();
  for (std::size_t k = net.layers.size(); k >= 1; --k) {
    Layer& l = net.layers[k - 1];
    auto scope = sm.find_unit_for(l)->backward_scope();
    const auto w = read_floats(dev, l.w);
    std::vector<float> gw(W, 0.0f), gb(W, 0.0f);
    for (std::size_t s = 0; s < B; ++s)
      for (std::size_t i = 0; i < W; ++i) {
        const float out = acts[k][s][i];
        const float da = dh[s][i] * (1.0f - out * out);
        gw[i] += da * acts[k - 1][s][i];
        gb[i] += da;
        dh[s][i] = da * w[i];
      }
    accumulate_floats(dev, l.gw, gw);
    accumulate_floats(dev, l.gb, gb);
  }
  std::vector<float> ggain(W, 0.0f);
  for (std::size_t s = 0; s < B; ++s)
    for (std::size_t i = 0; i < W; ++i) ggain[i] += dh[s][i] * xs[s][i] * scale[i];
  accumulate_floats(dev, net.ggain, ggain);
  return loss;
}

// One step's hooks alone, with an engine that computes nothing and makes no device call,
// so every device or CUDA call made is the library's: zero_grad, every unit's forward, every
// unit's backward (last layer first, inside the root's), finish_backward.
template <fsdp::Device D>
void hooks_only_step(Net<D>& net, fsdp::ShardedModel& sm) {
  fsdp::Unit& root = *sm.find_unit_for(net);
  sm.zero_grad();
  {
    auto fwd = root.forward_scope();
    for (auto& l : net.layers) auto scope = sm.find_unit_for(l)->forward_scope();
  }
  {
    auto bwd = root.backward_scope();
    for (auto it = net.layers.rbegin(); it != net.layers.rend(); ++it) auto scope = sm.find_unit_for(*it)->backward_scope();
  }
  sm.finish_backward();
}

// SGD on this rank's f32 shards: p += (-lr) * g, as Device::scale then Device::accumulate
// on `stepper`: the training Device, or a HostDevice for shards in host memory (offloaded),
// which then reads the gradients right after finish_backward, as a CPU optimizer does; that
// is what finish_backward's synchronization is for.
template <fsdp::Device S>
void sgd_step(S& stepper, std::span<const fsdp::ShardView> shards, float lr) {
  for (const auto& v : shards) {
    REQUIRE(v.dtype == fsdp::DType::f32);
    REQUIRE(v.grad_dtype == fsdp::DType::f32);
    const auto n = static_cast<std::size_t>(v.numel);
    stepper.scale(v.grad, n, fsdp::DType::f32, -lr);
    stepper.accumulate(v.param, v.grad, n, fsdp::DType::f32);
  }
}

struct DeviceTrainingResult {
  Params params;               // rank 0's full parameters after training
  std::vector<double> losses;  // rank 0's, per step
  int skipped_steps = 0;       // fp16: steps the scaler skipped
  fsdp::MemoryStats device_space, host_space;  // rank 0's, over the training steps (after shard())
};

// Full parameters, in their own dtype, read while every unit is summoned.
template <fsdp::Device D>
Params full_parameters(D& dev, Net<D>& net, fsdp::ShardedModel& sm) {
  auto summoned = sm.summon_full_params();
  Params out;
  out.emplace_back("gain", read_floats(dev, net.gain));
  for (std::size_t i = 0; i < net.layers.size(); ++i) {
    out.emplace_back("layers." + std::to_string(i) + ".w", read_floats(dev, net.layers[i].w));
    out.emplace_back("layers." + std::to_string(i) + ".b", read_floats(dev, net.layers[i].b));
  }
  return out;
}

// Trains on `devices.size()` thread ranks, rank r on *devices[r]. `with_comm(comm,
// device, body)` calls body with the communicator to shard over (ThreadComm itself, or a
// wrapper around it). Every rank must end with the same parameters. `CommP`: the
// CommPrecision policy (a block format's all-gathers, say).
template <class Strategy, class Precision, class Offload, class CommP = fsdp::FullCommPrecision, fsdp::Device D,
          class WithComm>
DeviceTrainingResult train_on_devices(const std::vector<D*>& devices, const DeviceTrainingConfig& c, WithComm with_comm) {
  const int world = static_cast<int>(devices.size());
  constexpr bool fp16 = std::is_same_v<Precision, fsdp::MixedPrecision<fsdp::f16>>;  // needs the loss scaler
  std::vector<DeviceTrainingResult> per_rank(static_cast<std::size_t>(world));
  fsdp::ThreadGroup(world).run([&](fsdp::ThreadComm& tc) {
    D& dev = *devices[static_cast<std::size_t>(tc.rank())];
    with_comm(tc, dev, [&](auto& comm) {
      auto& out = per_rank[static_cast<std::size_t>(tc.rank())];  // comm may be one rank of a larger world
      Net<D> net(dev, c);
      auto sm = fsdp::shard<Strategy, Precision, Offload, CommP>(net, comm, dev, fsdp::wrap_types<Layer>{});
      dev.synchronize();
      dev.reset_peak(fsdp::MemorySpace::device);
      dev.reset_peak(fsdp::MemorySpace::host);
      const std::size_t device_allocations = dev.stats(fsdp::MemorySpace::device).allocations;
      const std::size_t host_allocations = dev.stats(fsdp::MemorySpace::host).allocations;
      using Comm = std::remove_cvref_t<decltype(comm)>;
      fsdp::ShardedGradScaler<Comm> scaler(comm, dev, {.init_scale = 1024.0});  // fp16 only
      fsdp::HostDevice host;  // steps offloaded shards
      for (int step = 0; step < c.steps; ++step) {
        sm.zero_grad();
        out.losses.push_back(forward_backward(dev, net, sm, c, comm.rank(), step, fp16 ? scaler.scale() : 1.0));
        sm.finish_backward();
        auto opt = [&] {
          if constexpr (Offload::offload) sgd_step(host, sm.shards(), c.lr);
          else sgd_step(dev, sm.shards(), c.lr);
        };
        if constexpr (fp16) {
          if (!scaler.step(sm.shards(), opt)) ++out.skipped_steps;
          scaler.update();
        } else {
          opt();
        }
      }
      dev.synchronize();
      out.device_space = dev.stats(fsdp::MemorySpace::device);
      out.host_space = dev.stats(fsdp::MemorySpace::host);
      out.device_space.allocations -= device_allocations;  // those of the training steps alone
      out.host_space.allocations -= host_allocations;
      out.params = full_parameters(dev, net, sm);
    });
  });
  for (int r = 1; r < world; ++r) {
    CAPTURE(r);
    CHECK(per_rank[static_cast<std::size_t>(r)].params == per_rank[0].params);
  }
  return per_rank[0];
}

// Runs `f.template operator()<Strategy, Precision, Offload>(name)` for every combination
// the issue asks for: fp32 / bf16 / fp16 x offload off / on x FullShard / ShardGradOp / NoShard.
template <class F>
void for_each_combination(F&& f) {
  auto by_offload = [&]<class S, class P>() {
    f.template operator()<S, P, fsdp::NoOffload>();
    f.template operator()<S, P, fsdp::OffloadParams>();
  };
  auto by_precision = [&]<class S>() {
    by_offload.template operator()<S, fsdp::FullPrecision>();
    by_offload.template operator()<S, fsdp::MixedPrecision<fsdp::bf16>>();
    by_offload.template operator()<S, fsdp::MixedPrecision<fsdp::f16>>();
  };
  by_precision.template operator()<fsdp::FullShard>();
  by_precision.template operator()<fsdp::ShardGradOp>();
  by_precision.template operator()<fsdp::NoShard>();
}

// "FullShard, MixedPrecision<bf16>, OffloadParams" for CAPTURE.
template <class S, class P, class O>
std::string combination_name() {
  std::string s = S::name;
  if constexpr (P::enabled) s += std::string(", MixedPrecision<") + std::string(fsdp::name_of(P::param)) + ">";
  else s += ", FullPrecision";
  s += O::offload ? ", OffloadParams" : ", NoOffload";
  return s;
}

}  // namespace test_support
