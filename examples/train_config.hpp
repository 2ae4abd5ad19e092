#pragma once
// examples/train.cpp's configuration: its flags, and how the runtime --precision and
// --offload become compile-time policies.
#include <string>

#include <fsdp/fsdp.hpp>

#include "examples/engine/model.hpp"

namespace train_example {

// --precision names: the dtype computation sees.
inline fsdp::DType precision_dtype(const std::string& name) {
  return name == "bf16" ? fsdp::DType::bf16 : name == "fp16" ? fsdp::DType::f16 : fsdp::DType::f32;
}

// Runtime --precision and --offload -> the compile-time policies: f(Precision{}, Offload{}).
template <class F>
void with_precision_and_offload(fsdp::DType param, bool offload, F&& f) {
  auto with_offload = [&](auto precision) {
    if (offload) f(precision, fsdp::OffloadParams{});
    else f(precision, fsdp::NoOffload{});
  };
  if (param == fsdp::DType::bf16) with_offload(fsdp::MixedPrecision<fsdp::bf16>{});
  else if (param == fsdp::DType::f16) with_offload(fsdp::MixedPrecision<fsdp::f16>{});
  else with_offload(fsdp::FullPrecision{});
}

struct Config {
  int steps = 20, batch_per_rank = 8;
  std::string optimizer = "adamw", strategy = "FULL_SHARD", precision = "fp32", trace_dir;
  bool offload = false;
  double clip = 0;  // --clip: the max gradient 2-norm; 0: no clipping
  int accumulate = 1;                  // --accumulate: micro-batches per step
  bool sync_every_microbatch = false;  // GradientSyncMode::reduce_every_microbatch
  bool optimizer_in_backward = false;  // --optimizer-in-backward: each unit steps in its post-accumulate-grad hook
  std::string save_dir, resume_dir;
  int save_every = 0;  // 0: save after the last step only
  engine::ModelConfig model{.in = 16, .dim = 64, .hidden = 256, .out = 4, .blocks = 8, .seed = 1};
};

}  // namespace train_example
