#pragma once
// Optimizers that step on flat slots (a parameter array and its gradient). Sharded
// training hands them each rank's flat shards; unsharded training hands them the model's
// own tensors. SGD and AdamW are element-wise, so a shard steps exactly as its elements
// would inside the full tensor. Muon is not: it orthogonalizes each weight matrix's
// momentum as a whole, so it steps on one slot per parameter, each 2-D one whole (sharded:
// ShardOptions::shard_layout = param_atomic(), each parameter whole on one rank).
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "examples/engine/tensor.hpp"

namespace engine {

struct Slot {
  float* param;
  const float* grad;
  std::int64_t numel;
  const std::uint8_t* decay = nullptr;  // per element: 1 = apply weight decay (nullptr: everywhere)
  // A whole 2-D weight matrix of rows x cols (row-major, rows * cols == numel); 0: not one.
  std::int64_t rows = 0, cols = 0;
};

class Sgd {
 public:
  explicit Sgd(float lr) : lr_(lr) {}
  void step(std::span<const Slot> slots) {
    for (auto& s : slots)
      for (std::int64_t i = 0; i < s.numel; ++i) s.param[i] -= lr_ * s.grad[i];
  }

 private:
  float lr_;
};

// AdamW (decoupled weight decay). State is allocated on the first step, through the
// engine Allocator, so a counting allocator sees it.
class AdamW {
 public:
  struct Options {
    float lr = 1e-2f, beta1 = 0.9f, beta2 = 0.999f, eps = 1e-8f, weight_decay = 1e-2f;
  };
  explicit AdamW(Options o, Allocator& alloc = heap()) : o_(o), alloc_(&alloc) {}

  void step(std::span<const Slot> slots) {
    if (state_.empty())
      for (auto& s : slots) state_.push_back({Tensor({s.numel}, *alloc_), Tensor({s.numel}, *alloc_)});
    if (state_.size() != slots.size()) throw fsdp::Error("AdamW: stepped on " + std::to_string(slots.size()) +
                                                         " slots, but its state is for " + std::to_string(state_.size()));
    ++t_;
    const float c1 = 1.0f - std::pow(o_.beta1, static_cast<float>(t_));
    const float c2 = 1.0f - std::pow(o_.beta2, static_cast<float>(t_));
    for (std::size_t k = 0; k < slots.size(); ++k) {
      auto& s = slots[k];
      float* m = state_[k].m.data();
      float* v = state_[k].v.data();
      for (std::int64_t i = 0; i < s.numel; ++i) {
        const float g = s.grad[i];
        if (!s.decay || s.decay[i]) s.param[i] -= o_.lr * o_.weight_decay * s.param[i];
        m[i] = o_.beta1 * m[i] + (1.0f - o_.beta1) * g;
        v[i] = o_.beta2 * v[i] + (1.0f - o_.beta2) * g * g;
        s.param[i] -= o_.lr * (m[i] / c1) / (std::sqrt(v[i] / c2) + o_.eps);
      }
    }
  }

 // For checkpoints: the moments of slot k (0: exp_avg, 1: exp_avg_sq), created zeroed for
  // slots of the given sizes if the optimizer has not stepped yet; and the step count.
  float* moment(int which, std::size_t k, std::span<const std::int64_t> numels) {
    if (state_.empty())
      for (auto n : numels) state_.push_back({Tensor({n}, *alloc_), Tensor({n}, *alloc_)});
    auto& m = state_.at(k);
    return which == 0 ? m.m.data() : m.v.data();
  }
  long step_count() const { return t_; }
  void set_step_count(long t) { t_ = t; }

 private:
  struct Moments {
    Tensor m, v;
  };
  Options o_;
  Allocator* alloc_;
  std::vector<Moments> state_;
  long t_ = 0;
};

// Muon: SGD with Nesterov momentum whose update, for each whole 2-D weight matrix, is the
// momentum orthogonalized (its singular values pushed towards 1) by five iterations of a
// quintic Newton-Schulz map, scaled by sqrt(max(1, rows / cols)). Every slot without rows
// and cols (biases, gains, and a flat shard's slots, which hold no whole matrix: hand it
// parameter_slots or slots(Model&)) steps with AdamW. The same slots at every step: the
// state is kept by position, and a slot list that changes is refused. Momentum in f32,
// the Newton-Schulz iteration in double, so that a rank that owns a matrix computes bit
// for bit what the unsharded engine computes for it.
class Muon {
 public:
  static constexpr bool per_parameter = true;  // step on parameter slots (fsdp_integration.hpp: slots_for)
  struct Options {
    float lr = 0.02f, momentum = 0.95f;
    int newton_schulz_steps = 5;
    AdamW::Options adamw = {};  // for the slots that are no matrix
  };
  explicit Muon(Options o, Allocator& alloc = heap()) : o_(o), alloc_(&alloc), adamw_(o.adamw, alloc) {}

  void step(std::span<const Slot> slots) {
    std::vector<Slot> others;
    std::size_t matrices = 0;
    for (const auto& s : slots) {
      if (s.rows == 0) {
        others.push_back(s);
        continue;
      }
      if (s.rows * s.cols != s.numel)
        throw fsdp::Error("Muon: a matrix slot of " + std::to_string(s.rows) + " x " + std::to_string(s.cols) + " holds " +
                          std::to_string(s.numel) + " elements");
      if (stepped_ == 0 && matrices == momentum_.size()) {
        momentum_.emplace_back(std::vector<std::int64_t>{s.numel}, *alloc_);
        shapes_.emplace_back(s.rows, s.cols);
      }
      if (matrices >= shapes_.size() || shapes_[matrices] != std::pair{s.rows, s.cols})
        throw fsdp::Error("Muon: matrix slot " + std::to_string(matrices) + " is " + std::to_string(s.rows) + " x " +
                          std::to_string(s.cols) + ", but its state is for " +
                          (matrices < shapes_.size() ? std::to_string(shapes_[matrices].first) + " x " +
                                                           std::to_string(shapes_[matrices].second)
                                                     : std::string("no matrix")) +
                          ": step on the same slots every step");
      step_matrix(s, momentum_[matrices].data());
      ++matrices;
    }
    if (matrices != shapes_.size())
      throw fsdp::Error("Muon: stepped on " + std::to_string(matrices) + " matrix slots, but its state is for " +
                        std::to_string(shapes_.size()));
    if (!others.empty()) adamw_.step(others);
    ++stepped_;
  }

  // The orthogonalization alone, in place on a rows x cols matrix: what the tests check.
  static void orthogonalize(float* x, std::int64_t rows, std::int64_t cols, int steps) {
    // Work on the wide orientation (m <= n): X X^T is then the smaller product.
    const bool tall = rows > cols;
    const std::int64_t m = tall ? cols : rows, n = tall ? rows : cols;
    std::vector<double> X(static_cast<std::size_t>(m * n)), A(static_cast<std::size_t>(m * m)), B(A.size()), next(X.size());
    double norm = 0;
    for (std::int64_t i = 0; i < rows * cols; ++i) norm += double(x[i]) * x[i];
    const double scale = 1.0 / (std::sqrt(norm) + 1e-7);
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        X[static_cast<std::size_t>(tall ? c * n + r : r * n + c)] = x[r * cols + c] * scale;
    // Coefficients of the quintic p(s) = a s + b s^3 + c s^5 applied to the singular values:
    // steep at 0, so small singular values grow fast, and settling in about [0.7, 1.2].
    constexpr double a = 3.4445, b = -4.7750, c = 2.0315;
    for (int it = 0; it < steps; ++it) {
      for (std::int64_t i = 0; i < m; ++i)  // A = X X^T
        for (std::int64_t j = 0; j < m; ++j) {
          double sum = 0;
          for (std::int64_t k = 0; k < n; ++k) sum += X[static_cast<std::size_t>(i * n + k)] * X[static_cast<std::size_t>(j * n + k)];
          A[static_cast<std::size_t>(i * m + j)] = sum;
        }
      for (std::int64_t i = 0; i < m; ++i)  // B = b A + c A A
        for (std::int64_t j = 0; j < m; ++j) {
          double sum = 0;
          for (std::int64_t k = 0; k < m; ++k) sum += A[static_cast<std::size_t>(i * m + k)] * A[static_cast<std::size_t>(k * m + j)];
          B[static_cast<std::size_t>(i * m + j)] = b * A[static_cast<std::size_t>(i * m + j)] + c * sum;
        }
      for (std::int64_t i = 0; i < m; ++i)  // X = a X + B X
        for (std::int64_t j = 0; j < n; ++j) {
          double sum = 0;
          for (std::int64_t k = 0; k < m; ++k) sum += B[static_cast<std::size_t>(i * m + k)] * X[static_cast<std::size_t>(k * n + j)];
          next[static_cast<std::size_t>(i * n + j)] = a * X[static_cast<std::size_t>(i * n + j)] + sum;
        }
      X.swap(next);
    }
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < cols; ++c)
        x[r * cols + c] = static_cast<float>(X[static_cast<std::size_t>(tall ? c * n + r : r * n + c)]);
  }

  // The momentum buffers of the matrix slots so far, in slot order (for tests and memory plans).
  std::size_t matrices() const { return momentum_.size(); }

 private:
  void step_matrix(const Slot& s, float* buf) {
    std::vector<float> update(static_cast<std::size_t>(s.numel));
    for (std::int64_t i = 0; i < s.numel; ++i) {  // Nesterov: the gradient's step past the new momentum
      buf[i] = o_.momentum * buf[i] + s.grad[i];
      update[static_cast<std::size_t>(i)] = s.grad[i] + o_.momentum * buf[i];
    }
    orthogonalize(update.data(), s.rows, s.cols, o_.newton_schulz_steps);
    const float scale = o_.lr * std::sqrt(std::max(1.0f, static_cast<float>(s.rows) / static_cast<float>(s.cols)));
    for (std::int64_t i = 0; i < s.numel; ++i) s.param[i] -= scale * update[static_cast<std::size_t>(i)];
  }

  Options o_;
  Allocator* alloc_;
  AdamW adamw_;
  std::vector<Tensor> momentum_;
  std::vector<std::pair<std::int64_t, std::int64_t>> shapes_;  // each matrix slot's rows and cols
  long stepped_ = 0;
};

}  // namespace engine
