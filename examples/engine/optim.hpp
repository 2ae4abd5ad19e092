#pragma once
// Optimizers that step on flat slots (a parameter array and its gradient). Sharded
// training hands them each rank's flat shards; unsharded training hands them the model's
// own tensors. Both are element-wise, so a shard steps exactly as its elements would
// inside the full tensor.
#include <cmath>
#include <cstdint>
#include <span>
#include <vector>

#include "examples/engine/tensor.hpp"

namespace engine {

struct Slot {
  float* param;
  const float* grad;
  std::int64_t numel;
  const std::uint8_t* decay = nullptr;  // per element: 1 = apply weight decay (nullptr: everywhere)
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

}  // namespace engine
