#pragma once
// Layers with hand-written forward and backward. Backward *accumulates* into gradients,
// as autograd does, one sample at a time in batch order: that fixed order is what lets
// sharded training match unsharded training bit for bit when each rank holds one sample.
// Parameters, gradients and buffers may be f32, f16 or bf16 (engine::Tensor's dtypes):
// the layers read them as floats and accumulate gradients in the gradient's own dtype
// (each add rounded once). Activations (Mat) are always float. With f32 tensors the
// arithmetic is plain float arithmetic, in the same order whatever the dtypes.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string_view>
#include <vector>

#include "examples/engine/tensor.hpp"

namespace engine {

struct Mat {  // activations: rows = samples
  std::int64_t rows = 0, cols = 0;
  std::vector<float> v;
  Mat() = default;
  Mat(std::int64_t r, std::int64_t c) : rows(r), cols(c), v(static_cast<std::size_t>(r * c), 0.0f) {}
  float& at(std::int64_t r, std::int64_t c) { return v[static_cast<std::size_t>(r * cols + c)]; }
  float at(std::int64_t r, std::int64_t c) const { return v[static_cast<std::size_t>(r * cols + c)]; }
  float* row(std::int64_t r) { return v.data() + r * cols; }
  const float* row(std::int64_t r) const { return v.data() + r * cols; }
};

// Deterministic pseudo-random numbers in [-1, 1) from (seed, index): every rank and the
// unsharded reference build identical initial weights and data without sharing state.
inline float uniform(std::uint64_t seed, std::uint64_t i) {
  std::uint64_t z = seed * 0x9e3779b97f4a7c15ull + i + 0x632be59bd9b4e019ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(static_cast<double>(z >> 11) / 9007199254740992.0 * 2.0 - 1.0);
}

// Values computed in float, then rounded to t's dtype.
inline void fill_uniform(Tensor& t, std::uint64_t seed, float scale) {
  for (std::int64_t i = 0; i < t.numel(); ++i) t.set(i, scale * uniform(seed, static_cast<std::uint64_t>(i)));
}

// When parameters get their values: at construction, or later (Init::deferred: parameters
// and gradients are built with shapes and dtypes but no storage, and reset_parameters()
// fills them once fsdp::deferred_init has bound storage to them).
enum class Init { now, deferred };

inline Tensor make_tensor(std::vector<std::int64_t> shape, Allocator& alloc, fsdp::DType dtype, Init init) {
  return init == Init::now ? Tensor(std::move(shape), alloc, dtype) : Tensor::without_storage(std::move(shape), dtype);
}

// y = x W^T + b, W: [out, in]
class Linear {
 public:
  Linear(std::int64_t in, std::int64_t out, std::uint64_t seed, Allocator& alloc = heap(),
         fsdp::DType dtype = fsdp::DType::f32, Init init = Init::now)
      : weight(make_tensor({out, in}, alloc, dtype, init)), bias(make_tensor({out}, alloc, dtype, init)),
        weight_grad(make_tensor({out, in}, alloc, dtype, init)), bias_grad(make_tensor({out}, alloc, dtype, init)),
        in_(in), out_(out), seed_(seed) {
    if (init == Init::now) reset_parameters();
  }

  // The initial values, the same whenever they are computed.
  void reset_parameters() {
    fill_uniform(weight, seed_, 1.0f / std::sqrt(static_cast<float>(in_)));
    fill_uniform(bias, seed_ + 1, 0.1f);
  }

  Mat forward(const Mat& x) {
    x_ = x;
    Mat y(x.rows, out_);
    with_access([&](auto w, auto bias_) {
      for (std::int64_t b = 0; b < x.rows; ++b) {
        const float* xb = x.row(b);
        for (std::int64_t o = 0; o < out_; ++o) {
          float acc = bias_.get(o);
          for (std::int64_t i = 0, wi = o * in_; i < in_; ++i, ++wi) acc += xb[i] * w.get(wi);
          y.at(b, o) = acc;
        }
      }
    }, weight, bias);
    return y;
  }

  Mat backward(const Mat& dy) {
    Mat dx(dy.rows, in_);
    with_access([&](auto w, auto wg, auto bg) {
      for (std::int64_t b = 0; b < dy.rows; ++b) {
        const float* xb = x_.row(b);
        float* dxb = dx.row(b);
        for (std::int64_t o = 0; o < out_; ++o) {
          const float g = dy.at(b, o);
          bg.add(o, g);
          for (std::int64_t i = 0, wi = o * in_; i < in_; ++i, ++wi) {
            wg.add(wi, g * xb[i]);
            dxb[i] += g * w.get(wi);
          }
        }
      }
    }, weight, weight_grad, bias_grad);
    return dx;
  }

  template <class F>
  void visit_parameters(F&& f) {
    f("weight", weight, weight_grad);
    f("bias", bias, bias_grad);
  }

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  std::int64_t in_, out_;
  std::uint64_t seed_;
  Mat x_;
};

// y = x * g * s, one gain g per feature and a fixed scale s per feature: a module with a
// single parameter and a single buffer (state that is not trained: no gradient, never
// stepped, but part of the model, so it follows the model's buffer dtype).
class Gain {
 public:
  // The buffer is the engine's and always built with its values; Init::deferred defers the gain.
  Gain(std::int64_t dim, std::uint64_t seed, Allocator& alloc = heap(), fsdp::DType dtype = fsdp::DType::f32,
       fsdp::DType buffer_dtype = fsdp::DType::f32, Init init = Init::now)
      : gain(make_tensor({dim}, alloc, dtype, init)), gain_grad(make_tensor({dim}, alloc, dtype, init)),
        scale({dim}, alloc, buffer_dtype), seed_(seed) {
    if (init == Init::now) reset_parameters();
    for (std::int64_t i = 0; i < dim; ++i) scale.set(i, 1.0f + 0.05f * uniform(seed + 3, static_cast<std::uint64_t>(i)));
  }
  void reset_parameters() {
    for (std::int64_t i = 0; i < gain.numel(); ++i) gain.set(i, 1.0f + 0.1f * uniform(seed_, static_cast<std::uint64_t>(i)));
  }
  Mat forward(const Mat& x) {
    x_ = x;
    Mat y = x;
    with_access([&](auto g, auto s) {
      for (std::int64_t b = 0; b < x.rows; ++b)
        for (std::int64_t j = 0; j < x.cols; ++j) y.at(b, j) = y.at(b, j) * g.get(j) * s.get(j);
    }, gain, scale);
    return y;
  }
  Mat backward(const Mat& dy) {
    Mat dx = dy;
    with_access([&](auto g, auto gg, auto s) {
      for (std::int64_t b = 0; b < dy.rows; ++b)
        for (std::int64_t j = 0; j < dy.cols; ++j) {
          gg.add(j, dy.at(b, j) * x_.at(b, j) * s.get(j));
          dx.at(b, j) = dx.at(b, j) * g.get(j) * s.get(j);
        }
    }, gain, gain_grad, scale);
    return dx;
  }
  template <class F>
  void visit_parameters(F&& f) { f("gain", gain, gain_grad); }
  template <class F>
  void visit_buffers(F&& f) { f("scale", scale); }

  Tensor gain, gain_grad;
  Tensor scale;  // buffer

 private:
  std::uint64_t seed_;
  Mat x_;
};

// Residual MLP block: y = x + fc2(relu(fc1(x))). `adapter` is a zero-size parameter (a
// disabled low-rank adapter, say): it exists, has an FQN, and holds no elements.
class Block {
 public:
  Block(std::int64_t dim, std::int64_t hidden, std::uint64_t seed, Allocator& alloc = heap(),
        fsdp::DType dtype = fsdp::DType::f32, Init init = Init::now)
      : fc1(dim, hidden, seed, alloc, dtype, init), fc2(hidden, dim, seed + 7, alloc, dtype, init),
        adapter({0, dim}, alloc, dtype), adapter_grad({0, dim}, alloc, dtype) {}

  Mat forward(const Mat& x) {
    Mat h = fc1.forward(x);
    mask_.assign(h.v.size(), 0);
    for (std::size_t i = 0; i < h.v.size(); ++i)
      if (h.v[i] > 0) mask_[i] = 1; else h.v[i] = 0;
    Mat y = fc2.forward(h);
    for (std::size_t i = 0; i < y.v.size(); ++i) y.v[i] += x.v[i];
    return y;
  }
  Mat backward(const Mat& dy) {
    Mat dh = fc2.backward(dy);
    for (std::size_t i = 0; i < dh.v.size(); ++i) if (!mask_[i]) dh.v[i] = 0;
    Mat dx = fc1.backward(dh);
    for (std::size_t i = 0; i < dx.v.size(); ++i) dx.v[i] += dy.v[i];
    return dx;
  }

  template <class F>
  void visit_parameters(F&& f) { f("adapter", adapter, adapter_grad); }
  template <class F>
  void visit_children(F&& f) {
    f("fc1", fc1);
    f("fc2", fc2);
  }

  Linear fc1, fc2;
  Tensor adapter, adapter_grad;

 private:
  std::vector<std::uint8_t> mask_;
};

// What a loss adds up over the batch's samples (rows), each sample's loss being its mean
// over the outputs: their mean, or their sum (PyTorch's reduction="sum" over samples, and
// mlpack's gradients), whose gradient is larger by the batch's size. A sharded engine tells
// fsdp which one it computes (fsdp::ShardOptions::local_gradients).
enum class LossReduction { mean, sum };

// Squared error; returns the mean over all elements (the loss reported, whatever
// `reduction`) and writes d(loss)/d(out) of the loss `reduction` says: the mean over all
// elements, or the sum over rows of each row's mean. The sum's per-element gradient does
// not depend on the batch's size, so a sample contributes the same values however the
// global batch is split.
inline double mse(const Mat& out, const Mat& target, Mat& dout, LossReduction reduction = LossReduction::mean) {
  dout = Mat(out.rows, out.cols);
  const float scale = 2.0f / static_cast<float>(reduction == LossReduction::sum ? out.cols : out.rows * out.cols);
  double loss = 0;
  for (std::size_t i = 0; i < out.v.size(); ++i) {
    const float d = out.v[i] - target.v[i];
    loss += static_cast<double>(d) * d;
    dout.v[i] = d * scale;
  }
  return loss / static_cast<double>(out.v.size());
}

}  // namespace engine
