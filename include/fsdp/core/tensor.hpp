#pragma once
// The Tensor customization point. The library never owns the engine's tensor type; it
// reads it through fsdp::tensor_traits<T>, whose fields follow DLPack's DLTensor
// (data, device, dtype, shape). The one thing beyond DLPack is `rebind`: the library
// points a parameter (and its gradient) at storage it owns, which is what makes unshard
// zero-copy — the all-gather output *is* the parameters. A tensor type that is a handle
// (libtorch's torch::Tensor, any refcounted engine: copies share what they point to) says so
// with tensor_traits<T>::identity, and the library then keeps copies of the handles and
// tells tensors apart by what they point to, not by the address of the engine's object.
#include <concepts>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <ranges>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

// DLPack's DLDeviceType, reduced to what the library distinguishes.
enum class DeviceKind : std::uint8_t { cpu = 1, cuda = 2 };

struct DeviceId {
  DeviceKind kind = DeviceKind::cpu;
  int index = 0;
  friend bool operator==(const DeviceId&, const DeviceId&) = default;
};

namespace detail { template <class> inline constexpr bool always_false = false; }

// Specialize for your tensor type. Required members (all static):
//   DType           dtype(const T&)
//   <int64 range>   shape(const T&)          // e.g. std::span<const int64_t> or std::vector<int64_t>
//   void*           data(T&)                 // first element; may be null for empty tensors
//   DeviceId        device(const T&)
//   void            rebind(T&, void* data)   // make T a view of `data` (same shape and dtype);
//                                            // data == nullptr means "no storage" (resharded)
// and, only for MixedPrecision, which shows parameters in another dtype:
//   void            rebind(T&, void* data, DType)  // view of `data` in that dtype
// and, optionally, so that a take-over a throwing rebind stops loses no values:
//   K               keep(T&)                 // keeps t's storage alive past rebind; t still views it
//   void            restore(T&, K&&) noexcept  // t owns and views that storage again, its own dtype
// and, for a tensor type that is a handle (copies share one tensor, as torch::Tensor's share
// its TensorImpl, so that rebinding any copy is seen through all of them):
//   const void*     identity(const T&)       // what the handle points to (the TensorImpl);
//                                            // equal for two handles iff they are one tensor
// With identity, T must be copyable, and the library keeps its own copy of each visited
// parameter, gradient and buffer handle (for as long as the unit lives) and rebinds through
// it, so a visitor may pass copies of the handles (as libtorch's named_parameters() gives);
// it identifies tensors by identity() wherever it would compare addresses (ties, ignored
// parameters, gradient(param), the visitor checks). Without it, T& must be the engine's own,
// lasting tensor object, identified by its address.
template <class T>
struct tensor_traits {
  static_assert(detail::always_false<T>,
                "fsdp: no fsdp::tensor_traits<T> for this tensor type. Specialize it with static "
                "members dtype(const T&) -> fsdp::DType, shape(const T&) -> range of int64_t, "
                "data(T&) -> void*, device(const T&) -> fsdp::DeviceId, and "
                "rebind(T&, void*) that makes the tensor a view of library-owned storage. "
                "See docs/concepts.md#tensor.");
};

template <class T>
concept Tensor = requires(T& t, const T& ct, void* p) {
  { tensor_traits<T>::dtype(ct) } -> std::convertible_to<DType>;
  { tensor_traits<T>::shape(ct) } -> std::ranges::input_range;
  { tensor_traits<T>::data(t) } -> std::convertible_to<void*>;
  { tensor_traits<T>::device(ct) } -> std::convertible_to<DeviceId>;
  { tensor_traits<T>::rebind(t, p) };
};

// Tensors the library can show in another dtype (MixedPrecision needs it).
template <class T>
concept RebindableAs = Tensor<T> && requires(T& t, void* p, DType d) { tensor_traits<T>::rebind(t, p, d); };

// Tensors whose storage the library can keep across the take-over and give back when a
// rebind throws (fsdp/unit/detail/take_over.hpp). Without keep/restore, tensors rebound before
// the throw are left without storage.
template <class T>
concept KeepsStorage = Tensor<T> && requires(T& t) { tensor_traits<T>::restore(t, tensor_traits<T>::keep(t)); };

// Tensor types that are handles (tensor_traits<T>::identity, above).
template <class T>
concept TensorHandle = Tensor<T> && requires(const T& ct) {
  { tensor_traits<T>::identity(ct) } -> std::convertible_to<const void*>;
};

// What identifies a tensor to the library: identity() for a handle, else the object's
// address. ShardOptions::ignored_parameters names parameters by it.
template <Tensor T>
const void* tensor_identity(const T& t) {
  if constexpr (TensorHandle<T>) {
    static_assert(std::is_copy_constructible_v<T>,
                  "fsdp: tensor_traits<T>::identity declares T a handle, which the library keeps copies of: "
                  "T must be copy constructible (copies sharing one tensor)");
    return static_cast<const void*>(tensor_traits<T>::identity(t));
  } else {
    return static_cast<const void*>(&t);
  }
}

namespace detail {

template <class Range>
std::string format_shape(Range&& shape) {
  std::ostringstream os;
  os << '[';
  const char* sep = "";
  for (auto d : shape) { os << sep << +d; sep = ", "; }
  os << ']';
  return os.str();
}

// Names the tensor in a shape error: " of 'blocks.0.weight'", or nothing.
inline std::string of_what(std::string_view what) {
  return what.empty() ? std::string() : " of '" + std::string(what) + "'";
}

// numel * size_of(t) as a byte count, refusing a negative count or one that overflows.
template <std::integral N>
std::size_t checked_bytes(N numel, DType t, std::string_view what) {
  std::size_t bytes = 0;
  if (std::cmp_less(numel, 0)) fail("element count ", +numel, of_what(what), " is negative");
  if (__builtin_mul_overflow(numel, size_of(t), &bytes))
    fail(+numel, " elements of ", name_of(t), of_what(what), " are more bytes than size_t holds");
  return bytes;
}

}  // namespace detail

// Element count of a shape (any range of integers), refusing what is not one: a negative
// dimension, or a product beyond int64. `what` names the tensor in the error (its FQN).
template <class Shape>
  requires std::ranges::input_range<Shape>
std::int64_t checked_numel(Shape&& shape, std::string_view what) {
  std::int64_t n = 1;
  std::size_t dim = 0;
  for (auto d : shape) {
    static_assert(std::integral<decltype(d)>, "fsdp: shape dimensions must be integers");
    const char* problem = nullptr;
    if (std::cmp_less(d, 0)) problem = "is negative";
    else if (!std::in_range<std::int64_t>(d)) problem = "is beyond int64";
    else if (__builtin_mul_overflow(n, static_cast<std::int64_t>(d), &n)) problem = "makes the element count overflow int64";
    if (problem) {
      if constexpr (std::ranges::forward_range<Shape>)
        detail::fail("shape ", detail::format_shape(shape), detail::of_what(what), ": dimension ", dim, " (", +d, ") ",
                     problem);
      else
        detail::fail("shape", detail::of_what(what), ": dimension ", dim, " (", +d, ") ", problem);
    }
    ++dim;
  }
  return n;
}

// Element count from the shape, the way every caller needs it (checked as above).
template <Tensor T>
std::int64_t numel(const T& t) {
  return checked_numel(tensor_traits<T>::shape(t), {});
}

}  // namespace fsdp
