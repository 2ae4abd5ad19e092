#pragma once
// GradientView: the gradient of a parameter whose gradient the library owns (visited as
// f(name, param), without a gradient tensor), as Unit::gradient(param) and
// ShardedModel::gradient(param) hand it to the engine. Engines whose layers own no gradient
// tensors (mlpack's layers compute into a matrix the caller passes) write into it during
// the unit's backward, by the rules an engine-held gradient tensor follows: it holds what
// such a tensor would (zeros, or the sum kept by gradient accumulation), so add into it.
// A view: it owns nothing, and it is valid only until the unit's post_backward (or the end
// of the summon that showed it).
#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>
#include <type_traits>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/training_state.hpp"

namespace fsdp {

struct GradientView {
  void* data = nullptr;         // the first element (null for a parameter without elements)
  DType dtype = DType::f32;     // the compute dtype (MixedPrecision's Param) during backward
  std::span<const std::int64_t> shape;  // the parameter's
  std::int64_t numel = 0;
  std::string_view fqn;         // the parameter's FQN (its first name, when tied)
  std::string_view unit;        // its unit's FQN ("" for the root)
  int rank = 0;

  // The elements as E (float for f32, double for f64, ...); an fsdp::Error when E is not
  // the gradient's dtype. 16-bit dtypes have no C++ element type here: use data and dtype.
  template <class E>
  std::span<E> as() const {
    static_assert(requires { dtype_of<std::remove_const_t<E>>::value; } &&
                      !std::is_empty_v<std::remove_const_t<E>>,
                  "fsdp: GradientView::as<E>() takes an element type: float, double, std::int32_t, ...; "
                  "for f16 and bf16 gradients use data and dtype");
    constexpr DType want = dtype_of<std::remove_const_t<E>>::value;
    if (dtype != want)
      detail::fail("unit '", detail::display_name(unit), "' on rank ", rank, ": the gradient of '",
                   fqn, "' is ", name_of(dtype), ", but as<", name_of(want), ">() was asked for; ask for its dtype "
                   "(the compute dtype: MixedPrecision's Param when the unit has one)");
    return {static_cast<E*>(data), static_cast<std::size_t>(numel)};
  }
};

}  // namespace fsdp
