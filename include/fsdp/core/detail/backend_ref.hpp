#pragma once
// Non-owning, type-erased references to a Communicator and a Device. A unit's type names
// its module and policies, not the backend (as in the design's Sharded<Block, FullShard>);
// the backend is picked at construction and reached through one indirect call per
// collective or allocation, which is noise next to the work behind it.
#include <typeinfo>

#include "fsdp/core/collective_tag.hpp"
#include "fsdp/core/communicator.hpp"
#include "fsdp/core/detail/tagged_calls.hpp"
#include "fsdp/core/detail/type_name.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/device.hpp"
#include "fsdp/core/quant_format.hpp"

namespace fsdp::detail {

class CommRef {
 public:
  template <Communicator C>
  explicit CommRef(C& c) : obj_(&c), vt_(&table<C>) {}
  int rank() const { return vt_->rank(obj_); }
  int size() const { return vt_->size(obj_); }
  // With a tag (null: none): a unit's collectives, checked across ranks by a
  // communicator that takes tags, plain calls on one that does not.
  Work all_gather(const void* s, void* r, std::size_t n, DType t, const CollectiveTag* tag = nullptr) const {
    return vt_->all_gather(obj_, s, r, n, t, tag);
  }
  Work reduce_scatter(const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag = nullptr) const {
    return vt_->reduce_scatter(obj_, s, r, n, t, op, tag);
  }
  Work all_reduce(const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag = nullptr) const {
    return vt_->all_reduce(obj_, s, r, n, t, op, tag);
  }
  // Whether the communicator compares tags (TaggedCommunicator).
  bool checks_tags() const { return vt_->checks_tags; }
  Work broadcast(const void* s, void* r, std::size_t n, DType t, int root) const {
    return vt_->broadcast(obj_, s, r, n, t, root);
  }
  Work barrier() const { return vt_->barrier(obj_); }
  const void* address() const { return obj_; }

 private:
  struct VTable {
    int (*rank)(void*);
    int (*size)(void*);
    Work (*all_gather)(void*, const void*, void*, std::size_t, DType, const CollectiveTag*);
    Work (*reduce_scatter)(void*, const void*, void*, std::size_t, DType, ReduceOp, const CollectiveTag*);
    Work (*all_reduce)(void*, const void*, void*, std::size_t, DType, ReduceOp, const CollectiveTag*);
    Work (*broadcast)(void*, const void*, void*, std::size_t, DType, int);
    Work (*barrier)(void*);
    bool checks_tags;
  };
  template <class C>
  static constexpr VTable table{
      [](void* o) { return static_cast<int>(static_cast<C*>(o)->rank()); },
      [](void* o) { return static_cast<int>(static_cast<C*>(o)->size()); },
      [](void* o, const void* s, void* r, std::size_t n, DType t, const CollectiveTag* tag) -> Work {
        return detail::all_gather(*static_cast<C*>(o), s, r, n, t, tag);
      },
      [](void* o, const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag) -> Work {
        return detail::reduce_scatter(*static_cast<C*>(o), s, r, n, t, op, tag);
      },
      [](void* o, const void* s, void* r, std::size_t n, DType t, ReduceOp op, const CollectiveTag* tag) -> Work {
        return detail::all_reduce(*static_cast<C*>(o), s, r, n, t, op, tag);
      },
      [](void* o, const void* s, void* r, std::size_t n, DType t, int root) -> Work {
        return static_cast<C*>(o)->broadcast(s, r, n, t, root);
      },
      [](void* o) -> Work { return static_cast<C*>(o)->barrier(); },
      TaggedCommunicator<C>,
  };
  void* obj_;
  const VTable* vt_;
};

// DeviceRef's refusal of a per-tensor op on a device without it (no TensorScalingDevice).
template <class D>
[[noreturn]] void no_tensor_scaling(const char* op) {
  fail_as(ErrorKind::misuse, "this device (", type_name(typeid(D)), ") has no ", op,
          ": per-tensor scaling (F8E4M3Tensor, F8E5M2Tensor) needs abs_max, max_over_rows, quantize_tensor and "
          "dequantize_tensor "
          "(fsdp::TensorScalingDevice); gather in a block format (F8E4M3Blocks<128>) on it instead");
}

class DeviceRef {
 public:
  template <Device D>
  explicit DeviceRef(D& d) : obj_(&d), vt_(&table<D>) {}
  DeviceId id() const { return vt_->id(obj_); }
  void* allocate(std::size_t bytes, MemorySpace s) const { return vt_->allocate(obj_, bytes, s); }
  void deallocate(void* p, std::size_t bytes, MemorySpace s) const { vt_->deallocate(obj_, p, bytes, s); }
  void copy(void* d, const void* s, std::size_t bytes) const { vt_->copy(obj_, d, s, bytes); }
  void fill_zero(void* p, std::size_t bytes) const { vt_->fill_zero(obj_, p, bytes); }
  // Device-space buffers, in one call where the device can (BatchZeroingDevice).
  void fill_zero_batch(std::span<const ZeroSpan> spans) const { vt_->fill_zero_batch(obj_, spans); }
  void scale(void* p, std::size_t n, DType t, double f) const { vt_->scale(obj_, p, n, t, f); }
  void accumulate(void* d, const void* s, std::size_t n, DType t) const { vt_->accumulate(obj_, d, s, n, t); }
  void cast(void* d, DType to, const void* s, DType from, std::size_t n) const { vt_->cast(obj_, d, to, s, from, n); }
  // The cast, and `spans` zeroed, in one call where the device can (CastZeroingDevice).
  void cast_zeroing(void* d, DType to, const void* s, DType from, std::size_t n, std::span<const ZeroSpan> spans) const {
    vt_->cast_zeroing(obj_, d, to, s, from, n, spans);
  }
  // Block quantization (QuantizingDevice). A device that does not model it refuses; a
  // policy that quantizes is refused at compile time before that (fsdp::shard).
  void quantize(QuantFormat f, const float* x, std::size_t n, void* q, void* scales, std::size_t block) const {
    vt_->quantize(obj_, f, x, n, q, scales, block);
  }
  void dequantize(QuantFormat f, const void* q, const void* scales, std::size_t n, float* x, std::size_t block) const {
    vt_->dequantize(obj_, f, q, scales, n, x, block);
  }
  // Per-tensor scaling (TensorScalingDevice), refused as above on a device without it.
  void abs_max(const float* x, std::size_t n, float* out) const { vt_->abs_max(obj_, x, n, out); }
  void max_over_rows(const float* in, std::size_t rows, std::size_t n, float* out) const {
    vt_->max_over_rows(obj_, in, rows, n, out);
  }
  void quantize_tensor(QuantFormat f, const float* x, std::size_t n, void* q, const float* amax) const {
    vt_->quantize_tensor(obj_, f, x, n, q, amax);
  }
  void dequantize_tensor(QuantFormat f, const void* q, std::size_t n, const float* amax, float* y) const {
    vt_->dequantize_tensor(obj_, f, q, n, amax, y);
  }
  void synchronize() const { vt_->synchronize(obj_); }
  MemoryStats stats(MemorySpace s) const { return vt_->stats(obj_, s); }
  // The device's queue (QueuedDevice), or a null handle: collectives are waited on the host.
  DeviceQueue queue() const { return vt_->queue(obj_); }
  const void* address() const { return obj_; }

 private:
  struct VTable {
    DeviceId (*id)(void*);
    void* (*allocate)(void*, std::size_t, MemorySpace);
    void (*deallocate)(void*, void*, std::size_t, MemorySpace);
    void (*copy)(void*, void*, const void*, std::size_t);
    void (*fill_zero)(void*, void*, std::size_t);
    void (*fill_zero_batch)(void*, std::span<const ZeroSpan>);
    void (*scale)(void*, void*, std::size_t, DType, double);
    void (*accumulate)(void*, void*, const void*, std::size_t, DType);
    void (*cast)(void*, void*, DType, const void*, DType, std::size_t);
    void (*cast_zeroing)(void*, void*, DType, const void*, DType, std::size_t, std::span<const ZeroSpan>);
    void (*quantize)(void*, QuantFormat, const float*, std::size_t, void*, void*, std::size_t);
    void (*dequantize)(void*, QuantFormat, const void*, const void*, std::size_t, float*, std::size_t);
    void (*abs_max)(void*, const float*, std::size_t, float*);
    void (*max_over_rows)(void*, const float*, std::size_t, std::size_t, float*);
    void (*quantize_tensor)(void*, QuantFormat, const float*, std::size_t, void*, const float*);
    void (*dequantize_tensor)(void*, QuantFormat, const void*, std::size_t, const float*, float*);
    void (*synchronize)(void*);
    MemoryStats (*stats)(void*, MemorySpace);
    DeviceQueue (*queue)(void*);
  };
  template <class D>
  static constexpr VTable table{
      [](void* o) -> DeviceId { return static_cast<D*>(o)->id(); },
      [](void* o, std::size_t b, MemorySpace s) -> void* { return static_cast<D*>(o)->allocate(b, s); },
      [](void* o, void* p, std::size_t b, MemorySpace s) { static_cast<D*>(o)->deallocate(p, b, s); },
      [](void* o, void* d, const void* s, std::size_t b) { static_cast<D*>(o)->copy(d, s, b); },
      [](void* o, void* p, std::size_t b) { static_cast<D*>(o)->fill_zero(p, b); },
      [](void* o, std::span<const ZeroSpan> spans) { zero_spans(*static_cast<D*>(o), spans); },
      [](void* o, void* p, std::size_t n, DType t, double f) { static_cast<D*>(o)->scale(p, n, t, f); },
      [](void* o, void* d, const void* s, std::size_t n, DType t) { static_cast<D*>(o)->accumulate(d, s, n, t); },
      [](void* o, void* d, DType to, const void* s, DType from, std::size_t n) { static_cast<D*>(o)->cast(d, to, s, from, n); },
      [](void* o, void* d, DType to, const void* s, DType from, std::size_t n, std::span<const ZeroSpan> spans) {
        D& dev = *static_cast<D*>(o);
        if constexpr (CastZeroingDevice<D>) dev.cast_zeroing(d, to, s, from, n, spans);
        else zero_then_cast(dev, d, to, s, from, n, spans);
      },
      [](void* o, QuantFormat f, const float* x, std::size_t n, void* q, void* scales, std::size_t block) {
        if constexpr (QuantizingDevice<D>) static_cast<D*>(o)->quantize(f, x, n, q, scales, block);
        else fail_as(ErrorKind::misuse, "this device (", type_name(typeid(D)), ") does not quantize (no QuantizingDevice)");
      },
      [](void* o, QuantFormat f, const void* q, const void* scales, std::size_t n, float* x, std::size_t block) {
        if constexpr (QuantizingDevice<D>) static_cast<D*>(o)->dequantize(f, q, scales, n, x, block);
        else fail_as(ErrorKind::misuse, "this device (", type_name(typeid(D)), ") does not dequantize (no QuantizingDevice)");
      },
      [](void* o, const float* x, std::size_t n, float* out) {
        if constexpr (TensorScalingDevice<D>) static_cast<D*>(o)->abs_max(x, n, out);
        else no_tensor_scaling<D>("abs_max");
      },
      [](void* o, const float* in, std::size_t rows, std::size_t n, float* out) {
        if constexpr (TensorScalingDevice<D>) static_cast<D*>(o)->max_over_rows(in, rows, n, out);
        else no_tensor_scaling<D>("max_over_rows");
      },
      [](void* o, QuantFormat f, const float* x, std::size_t n, void* q, const float* amax) {
        if constexpr (TensorScalingDevice<D>) static_cast<D*>(o)->quantize_tensor(f, x, n, q, amax);
        else no_tensor_scaling<D>("quantize_tensor");
      },
      [](void* o, QuantFormat f, const void* q, std::size_t n, const float* amax, float* y) {
        if constexpr (TensorScalingDevice<D>) static_cast<D*>(o)->dequantize_tensor(f, q, n, amax, y);
        else no_tensor_scaling<D>("dequantize_tensor");
      },
      [](void* o) { static_cast<D*>(o)->synchronize(); },
      [](void* o, MemorySpace s) -> MemoryStats { return static_cast<D*>(o)->stats(s); },
      [](void* o) -> DeviceQueue {
        if constexpr (QueuedDevice<D>) return static_cast<D*>(o)->queue();
        else return {static_cast<D*>(o)->id(), nullptr};
      },
  };
  void* obj_;
  const VTable* vt_;
};

}  // namespace fsdp::detail
