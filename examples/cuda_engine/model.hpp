#pragma once
// The CUDA engine's model: embed -> blocks -> gain -> head with an MSE loss, the host
// reference engine's model (examples/engine/model.hpp) layer for layer, so both can train
// from the same initial values (copied from an engine::Model) on the same data. Forward
// and backward call `hooks` around the model and around each block and the gain, where
// fsdp's units are (fsdp_integration.hpp's UnitHooks, or no hooks at all).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <fsdp/core/detail/host_math.hpp>

#include "examples/cuda_engine/layers.hpp"
#include "examples/engine/model.hpp"

namespace cuda_engine {

using engine::NoHooks;  // the reference engine's: hooks are called with layer addresses only

class Model {
 public:
  // Parameters in `dtype` with the reference model's values (rounded to dtype), the gain's
  // scale buffer in `buffer_dtype`; gradients with storage only when grads_with_storage.
  Model(engine::Model& reference, fsdp::DType dtype, fsdp::DType buffer_dtype, int device, StreamAllocator& alloc,
        bool grads_with_storage)
      : embed("embed", reference.config.in, reference.config.dim, dtype, device, alloc, grads_with_storage),
        gain(reference.config.dim, dtype, buffer_dtype, device, alloc, grads_with_storage),
        head("head", reference.config.dim, reference.config.out, dtype, device, alloc, grads_with_storage) {
    const auto& c = reference.config;
    blocks.reserve(static_cast<std::size_t>(c.blocks));
    for (int i = 0; i < c.blocks; ++i)
      blocks.emplace_back("blocks." + std::to_string(i), c.dim, c.hidden, dtype, device, alloc, grads_with_storage);
    copy_from(reference, alloc.stream());
  }

  // x: [B, in] in the compute dtype; returns y: [B, out] in f32 (the loss reads f32).
  template <class Hooks = NoHooks>
  Act forward(Context& c, const Act& x, Hooks&& h = {}) {
    h.before_forward(this);
    Act a = embed.forward(c, x, c.act);
    for (auto& b : blocks) {
      h.before_forward(&b);
      a = b.forward(c, a);
      h.after_forward(&b);
    }
    h.before_forward(&gain);
    a = gain.forward(c, a);
    h.after_forward(&gain);
    Act y = head.forward(c, a, fsdp::DType::f32);
    h.after_forward(this);
    return y;
  }

  template <class Hooks = NoHooks>
  void backward(Context& c, const Act& dy, Hooks&& h = {}) {
    h.before_backward(this);
    Act d = head.backward(c, dy, true);
    h.before_backward(&gain);
    d = gain.backward(c, d);
    h.after_backward(&gain);
    for (auto it = blocks.rbegin(); it != blocks.rend(); ++it) {
      h.before_backward(&*it);
      d = it->backward(c, d);
      h.after_backward(&*it);
    }
    embed.backward(c, d, /*need_dx=*/false);
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

  // Every parameter with its gradient, and every buffer, in the reference engine's order.
  struct Named {
    std::string fqn;
    Tensor* param;
    Tensor* grad;  // null for a buffer
  };
  std::vector<Named> parameters() {
    std::vector<Named> out;
    walk(*this, "", out, false);
    return out;
  }
  std::vector<Named> buffers() {
    std::vector<Named> out;
    walk(*this, "", out, true);
    return out;
  }

  Linear embed;
  std::vector<Block> blocks;
  Gain gain;
  Linear head;

 private:
  template <class M>
  static void walk(M& m, const std::string& prefix, std::vector<Named>& out, bool buffers) {
    auto join = [&](std::string_view n) { return prefix.empty() ? std::string(n) : prefix + "." + std::string(n); };
    if constexpr (requires { m.visit_parameters([](std::string_view, Tensor&, Tensor&) {}); })
      if (!buffers) m.visit_parameters([&](std::string_view n, Tensor& p, Tensor& g) { out.push_back({join(n), &p, &g}); });
    if constexpr (requires { m.visit_buffers([](std::string_view, Tensor&) {}); })
      if (buffers) m.visit_buffers([&](std::string_view n, Tensor& b) { out.push_back({join(n), &b, nullptr}); });
    if constexpr (requires { m.visit_children([](std::string_view, auto&) {}); })
      m.visit_children([&](std::string_view n, auto& child) { walk(child, join(n), out, buffers); });
  }

  // Uploads the reference's values, rounded to each tensor's dtype; waits for the copies
  // (the host staging goes out of scope). Its zero-size adapters have no counterpart here.
  void copy_from(engine::Model& reference, cudaStream_t stream) {
    std::map<std::string, const engine::Tensor*> values;
    for (auto& p : engine::named_parameters(reference)) values[p.fqn] = p.param;
    for (auto& b : engine::named_buffers(reference)) values[b.fqn] = b.buffer;
    std::vector<std::vector<unsigned char>> staging;
    auto upload = [&](const Named& n) {
      const auto it = values.find(n.fqn);
      if (it == values.end() || it->second->numel() != n.param->numel())
        fsdp::detail::fail("cuda_engine::Model: the reference model has no '", n.fqn, "' of ", n.param->numel(), " elements");
      std::vector<float> v(static_cast<std::size_t>(n.param->numel()));
      for (std::size_t i = 0; i < v.size(); ++i) v[i] = it->second->get(static_cast<std::int64_t>(i));
      auto& raw = staging.emplace_back(n.param->bytes());
      fsdp::detail::host_cast(raw.data(), n.param->dtype(), v.data(), fsdp::DType::f32, v.size());
      check(cudaMemcpyAsync(n.param->data(), raw.data(), raw.size(), cudaMemcpyHostToDevice, stream),
            "cudaMemcpyAsync(upload of ", n.fqn, ")");
    };
    for (const auto& n : parameters()) upload(n);
    for (const auto& n : buffers()) upload(n);
    check(cudaStreamSynchronize(stream), "cudaStreamSynchronize(after the upload of the initial values)");
  }
};

// Mean squared error of y ([B, out], f32) against target (f32): writes dout (in the compute
// dtype) and adds the sum of squares into *sum on the device; the loss is *sum / (B * out).
inline Act mse(Context& c, const Activation& y, const void* target, double* sum) {
  const auto n = static_cast<unsigned long long>(y.rows * y.cols);
  Act dout = c.make(y.rows, y.cols, c.act);
  const float scale = 2.0f / static_cast<float>(y.rows * y.cols);  // as engine::mse
  c.kernels.mse_loss(c.stream, static_cast<const float*>(y.data()), static_cast<const float*>(target), dout->data(), c.act,
                     n, scale, sum);
  return dout;
}

}  // namespace cuda_engine
