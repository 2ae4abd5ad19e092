#pragma once
// The Tensor customization point. The library never owns the engine's tensor type; it
// reads it through fsdp::tensor_traits<T>, whose fields follow DLPack's DLTensor
// (data, device, dtype, shape). The one thing beyond DLPack is `rebind`: the library
// points a parameter (and its gradient) at storage it owns, which is what makes unshard
// zero-copy — the all-gather output *is* the parameters.
#include <concepts>
#include <cstdint>
#include <ranges>
#include <type_traits>

#include "fsdp/dtype.hpp"

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

// Element count from the shape, the way every caller needs it.
template <Tensor T>
std::int64_t numel(const T& t) {
  std::int64_t n = 1;
  for (auto d : tensor_traits<T>::shape(t)) n *= static_cast<std::int64_t>(d);
  return n;
}

}  // namespace fsdp
