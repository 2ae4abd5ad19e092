#pragma once
// fsdp::module_traits for every torch::nn::Module type: the library walks any libtorch model
// (its own modules, torch::nn's, Sequential, ModuleList, ModuleDict) through the module's
// registered children, parameters and buffers, the same tree that named_parameters() and
// torch::save see, so FQNs are libtorch's ("blocks.0.fc1.weight").
//
// Parameters are visited without a gradient tensor: the library owns each gradient
// (docs/engines/owned_gradients.md). During a unit's backward each parameter's .grad() is a
// view of the library's gradient, so autograd's AccumulateGrad adds into it in place; the
// view is dropped at the unit's post_backward (fsdp/torch/unit_hooks.hpp), so the unsharded
// parameters keep no .grad() between backwards and the model's zero_grad() has nothing of
// the library's to touch.
//
// Children are visited as torch::nn::Module& (libtorch's modules are polymorphic): the
// library identifies them by their dynamic type and address, and wrap policies choose them
// with fsdp::torch::wrap_type<BlockImpl>() (a dynamic_cast), not wrap_types<>, which sees
// only the static type torch::nn::Module.
#include <string>
#include <type_traits>

#include <torch/torch.h>

#include "fsdp/core/module.hpp"
#include "fsdp/torch/tensor_traits.hpp"

template <class M>
struct fsdp::module_traits<M, std::enable_if_t<std::is_base_of_v<::torch::nn::Module, M>>> {
  template <class F>
  static void visit_parameters(::torch::nn::Module& m, F&& f) {
    for (auto& item : m.named_parameters(/*recurse=*/false)) f(item.key(), item.value());
  }
  template <class F>
  static void visit_children(::torch::nn::Module& m, F&& f) {
    for (auto& item : m.named_children()) f(item.key(), *item.value());
  }
  template <class F>
  static void visit_buffers(::torch::nn::Module& m, F&& f) {
    for (auto& item : m.named_buffers(/*recurse=*/false)) f(item.key(), item.value());
  }
};
