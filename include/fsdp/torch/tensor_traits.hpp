#pragma once
// fsdp::tensor_traits<at::Tensor> (torch::Tensor is the same type): what lets the library
// shard libtorch parameters in place, without copying them out of the model and without
// touching the model's code.
//
// A torch::Tensor is a handle: copies share one TensorImpl, so the traits declare
// identity() (the TensorImpl) and the library keeps its own copies of the handles
// (docs/concepts.md#tensor). Rebinding re-points the tensor's *storage* (the StorageImpl
// that the tensor and all its views share) at library memory, or at nothing when the unit
// is sharded: autograd saves views of parameters in forward (a transposed weight for a
// matmul's backward), and those views see the memory gathered again for backward. The
// tensor keeps its TensorImpl, its autograd metadata and its version counter, so autograd
// sees no in-place change. MixedPrecision's dtype-changing rebind changes the TensorImpl's
// dtype over the same storage (bf16 while the unit computes, the master dtype otherwise).
//
// Only a tensor that owns its whole storage can be re-pointed this way: a contiguous
// tensor at storage offset 0 whose storage holds exactly its elements (what
// register_parameter and register_buffer make). Anything else is refused with an
// fsdp::Error naming its shape, before the library takes it over.
//
// keep/restore let a take-over that fails give every tensor its own memory back.
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include <ATen/core/Tensor.h>
#include <c10/core/ScalarType.h>
#include <c10/core/Storage.h>

#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/tensor.hpp"

namespace fsdp::torch {

// The fsdp::DType of a libtorch scalar type; an fsdp::Error for the ones the library has no
// dtype for (complex, bool, quantized).
inline DType dtype_of(c10::ScalarType s) {
  switch (s) {
    case c10::ScalarType::Float: return DType::f32;
    case c10::ScalarType::Double: return DType::f64;
    case c10::ScalarType::Half: return DType::f16;
    case c10::ScalarType::BFloat16: return DType::bf16;
    case c10::ScalarType::Char: return DType::i8;
    case c10::ScalarType::Byte: return DType::u8;
    case c10::ScalarType::Int: return DType::i32;
    case c10::ScalarType::Long: return DType::i64;
    default: break;
  }
  fsdp::detail::fail("fsdp::torch: tensors of dtype ", c10::toString(s),
                     " cannot be sharded (the library's dtypes are f32, f64, f16, bf16, i8, u8, i32, i64)");
}

inline c10::ScalarType scalar_type_of(DType d) {
  switch (d) {
    case DType::f32: return c10::ScalarType::Float;
    case DType::f64: return c10::ScalarType::Double;
    case DType::f16: return c10::ScalarType::Half;
    case DType::bf16: return c10::ScalarType::BFloat16;
    case DType::i8: return c10::ScalarType::Char;
    case DType::u8: return c10::ScalarType::Byte;
    case DType::i32: return c10::ScalarType::Int;
    case DType::i64: return c10::ScalarType::Long;
    case DType::f8e4m3: case DType::f8e5m2: case DType::e8m0: break;
  }
  fsdp::detail::fail("fsdp::torch: dtype ", name_of(d), " has no libtorch 1.13 scalar type (it has no 8-bit floats)");
}

inline DeviceId device_id_of(const c10::Device& d) {
  if (d.is_cuda()) return {DeviceKind::cuda, d.index() < 0 ? 0 : d.index()};
  if (d.is_cpu()) return {DeviceKind::cpu, 0};
  fsdp::detail::fail("fsdp::torch: tensors on device ", d.str(), " cannot be sharded (CPU and CUDA only)");
}

inline c10::Device device_of(DeviceId d) {
  if (d.kind == DeviceKind::cuda) return {c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(d.index)};
  return c10::Device(c10::DeviceType::CPU);
}

namespace detail {
// A storage's memory as writable bytes: libtorch 1.x's Storage::data() gives void*; 2.x's
// gives const void* (copy-on-write storages) and mutable_data() the writable pointer, which
// is what the library re-points and writes (a template, so the branch not taken is never
// compiled).
template <class S>
void* storage_data(const S& st) {
  if constexpr (requires { st.mutable_data(); }) return st.mutable_data();
  else return const_cast<void*>(static_cast<const void*>(st.data()));
}

inline std::string shape_text(const at::Tensor& t) {
  std::string s = "[";
  for (std::size_t i = 0; i < t.sizes().size(); ++i) s += (i ? ", " : "") + std::to_string(t.sizes()[i]);
  return s + "] " + std::string(c10::toString(t.scalar_type()));
}

// Refuses a tensor whose storage the library cannot re-point as its own.
inline void check_repointable(const at::Tensor& t) {
  if (!t.defined()) fsdp::detail::fail("fsdp::torch: an undefined tensor cannot be sharded");
  if (!t.has_storage())
    fsdp::detail::fail("fsdp::torch: tensor ", shape_text(t), " has no storage (a sparse, meta or opaque tensor)");
  const auto& st = t.storage();
  const std::size_t bytes = static_cast<std::size_t>(t.numel()) * t.itemsize();
  if (t.storage_offset() != 0 || !t.is_contiguous() || (st.data() != nullptr && st.nbytes() != bytes))
    fsdp::detail::fail("fsdp::torch: tensor ", shape_text(t), " is a view into a larger storage (offset ",
                       t.storage_offset(), ", ", st.nbytes(), " bytes for ", bytes,
                       ") or not contiguous; the library re-points only tensors that own their storage, as "
                       "register_parameter and register_buffer make them");
}

// Points t's storage (shared with every view of t) at p, nbytes long, without an owner.
inline void repoint(at::Tensor& t, void* p, caffe2::TypeMeta meta) {
  c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  const at::Storage& st = impl->storage();
  st.set_data_ptr_noswap(at::DataPtr(p, t.device()));
  st.set_nbytes(p ? static_cast<std::size_t>(t.numel()) * meta.itemsize() : 0);
  if (meta != impl->dtype()) impl->set_storage_and_dtype(st, meta);
}
}  // namespace detail

// What keep() holds for a tensor while the library takes it over: the memory the tensor
// owned (freed when this is destroyed, given back by restore).
struct KeptStorage {
  at::DataPtr owned;
  std::size_t nbytes = 0;
  caffe2::TypeMeta dtype;
};

}  // namespace fsdp::torch

template <>
struct fsdp::tensor_traits<at::Tensor> {
  static fsdp::DType dtype(const at::Tensor& t) { return fsdp::torch::dtype_of(t.scalar_type()); }
  static std::span<const std::int64_t> shape(const at::Tensor& t) {
    const auto s = t.sizes();
    return {s.data(), s.size()};
  }
  // Null while the unit is sharded (the storage has no memory), and for no elements.
  static void* data(at::Tensor& t) {
    if (!t.defined() || !t.has_storage()) return nullptr;
    auto* base = static_cast<char*>(fsdp::torch::detail::storage_data(t.storage()));
    return base ? base + t.storage_offset() * static_cast<std::int64_t>(t.itemsize()) : nullptr;
  }
  static fsdp::DeviceId device(const at::Tensor& t) { return fsdp::torch::device_id_of(t.device()); }
  static void rebind(at::Tensor& t, void* p) {
    fsdp::torch::detail::check_repointable(t);
    fsdp::torch::detail::repoint(t, p, t.dtype());
  }
  static void rebind(at::Tensor& t, void* p, fsdp::DType d) {
    fsdp::torch::detail::check_repointable(t);
    fsdp::torch::detail::repoint(t, p, caffe2::TypeMeta::fromScalarType(fsdp::torch::scalar_type_of(d)));
  }
  // The memory t owns moves into the returned object; t still views it, unowned.
  static fsdp::torch::KeptStorage keep(at::Tensor& t) {
    fsdp::torch::KeptStorage k;
    if (!t.defined() || !t.has_storage()) return k;
    const at::Storage& st = t.storage();
    k.nbytes = st.nbytes();
    k.dtype = t.dtype();
    k.owned = st.set_data_ptr(at::DataPtr(fsdp::torch::detail::storage_data(st), t.device()));
    return k;
  }
  static void restore(at::Tensor& t, fsdp::torch::KeptStorage&& k) noexcept {
    if (!t.defined() || !t.has_storage()) return;
    try {
      c10::TensorImpl* impl = t.unsafeGetTensorImpl();
      const at::Storage& st = impl->storage();
      st.set_data_ptr_noswap(std::move(k.owned));
      st.set_nbytes(k.nbytes);
      if (k.dtype != impl->dtype()) impl->set_storage_and_dtype(st, k.dtype);
    } catch (...) {  // the tensor then keeps the library's last view of it
    }
  }
  static const void* identity(const at::Tensor& t) { return t.unsafeGetTensorImpl(); }
};

static_assert(fsdp::TensorHandle<at::Tensor> && fsdp::RebindableAs<at::Tensor> && fsdp::KeepsStorage<at::Tensor>);
