#pragma once
// The CUDA engine's layers, the same as the host reference engine's (examples/engine/
// layers.hpp): Linear (y = x W^T + b), Gain (y = x * g * s, s a buffer) and the residual
// MLP Block (y = x + fc2(relu(fc1(x)))). Matrix products go through cuBLAS (cublasGemmEx,
// f32 accumulation: CUBLAS_COMPUTE_32F, no TF32), the rest through the engine's kernels,
// everything on the Context's one stream. Backward adds into the gradients (beta = 1), as
// autograd does; fsdp hands them zeroed.
//
// Row-major vs cuBLAS. cuBLAS is column-major: a row-major [r, c] matrix in memory is the
// column-major [c, r] matrix, its transpose, with leading dimension c. Every product below
// is written for the transposes, with the comment spelling out each operand.
#include <cublas_v2.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <string>
#include <utility>

#include "examples/cuda_engine/kernels.hpp"
#include "examples/cuda_engine/tensor.hpp"

namespace cuda_engine {

// An activation: a row-major [rows, cols] device matrix in `dtype`.
struct Activation {
  Buffer buffer;
  std::int64_t rows = 0, cols = 0;
  fsdp::DType dtype = fsdp::DType::f32;
  void* data() const { return buffer.get(); }
  std::size_t bytes() const { return buffer.bytes(); }
};
using Act = std::shared_ptr<Activation>;  // saved by the layers that need it in backward

// What every layer computes with: one stream, one cuBLAS handle bound to it, the kernels,
// the allocator (on the same stream) and the compute dtype of activations and of the
// parameters as the layers see them (bf16 under fsdp's MixedPrecision<bf16>).
struct Context {
  Context(cudaStream_t s, cublasHandle_t b, const Kernels& k, StreamAllocator& a, fsdp::DType compute)
      : stream(s), blas(b), kernels(k), alloc(a), act(compute) {}
  cudaStream_t stream;
  cublasHandle_t blas;
  const Kernels& kernels;
  StreamAllocator& alloc;
  fsdp::DType act;

  Act make(std::int64_t rows, std::int64_t cols, fsdp::DType dtype) {
    auto a = std::make_shared<Activation>();
    a->rows = rows, a->cols = cols, a->dtype = dtype;
    a->buffer = Buffer(alloc, static_cast<std::size_t>(rows * cols) * fsdp::size_of(dtype));
    return a;
  }
  // `rows` ones in the compute dtype: the right operand that sums a matrix's rows.
  const void* ones(std::int64_t rows) {
    if (ones_rows_ < rows) {
      ones_ = Buffer(alloc, static_cast<std::size_t>(rows) * fsdp::size_of(act));
      kernels.fill_value(stream, ones_.get(), act, static_cast<unsigned long long>(rows), 1.0f);
      ones_rows_ = rows;
    }
    return ones_.get();
  }

 private:
  Buffer ones_;
  std::int64_t ones_rows_ = 0;
};

inline cudaDataType_t cuda_type(fsdp::DType t) {
  if (t == fsdp::DType::f32) return CUDA_R_32F;
  if (t == fsdp::DType::bf16) return CUDA_R_16BF;
  fsdp::detail::fail("cuda_engine: cuBLAS products take f32 or bf16, not ", fsdp::name_of(t));
}

inline int blas_dim(std::int64_t v, const char* what) {
  if (v < 0 || v > std::numeric_limits<int>::max()) fsdp::detail::fail("cuda_engine: ", what, " dimension ", v, " exceeds int");
  return static_cast<int>(v);
}

// Column-major C[m, n] = op(A) op(B) + beta * C, A and B in `ab`, C in `tc`, accumulated in
// f32 (alpha and beta are floats for CUBLAS_COMPUTE_32F).
inline void gemm(Context& c, const std::string& what, cublasOperation_t op_a, cublasOperation_t op_b, std::int64_t m,
                 std::int64_t n, std::int64_t k, const void* a, std::int64_t lda, const void* b, std::int64_t ldb,
                 fsdp::DType ab, float beta, void* out, fsdp::DType tc, std::int64_t ldc) {
  const float alpha = 1.0f;
  check(cublasGemmEx(c.blas, op_a, op_b, blas_dim(m, "m"), blas_dim(n, "n"), blas_dim(k, "k"), &alpha, a, cuda_type(ab),
                     blas_dim(lda, "lda"), b, cuda_type(ab), blas_dim(ldb, "ldb"), &beta, out, cuda_type(tc),
                     blas_dim(ldc, "ldc"), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
        "cublasGemmEx(", what, ")");
}

// target's gradient += the sum of m's rows: column-major, g[cols, 1] = M^T[cols, rows] ones[rows, 1],
// where M^T is m's own memory (row-major [rows, cols]) with leading dimension cols, op N.
inline void add_row_sum(Context& c, const std::string& what, const Activation& m, Tensor& g) {
  gemm(c, what, CUBLAS_OP_N, CUBLAS_OP_N, m.cols, 1, m.rows, m.data(), m.cols, c.ones(m.rows), m.rows, m.dtype, 1.0f,
       g.data(), g.dtype(), m.cols);
}

inline void copy(Context& c, const Activation& from, Activation& to) {
  if (from.bytes() != to.bytes()) fsdp::detail::fail("cuda_engine: copy of ", from.bytes(), " bytes into ", to.bytes());
  check(cudaMemcpyAsync(to.data(), from.data(), from.bytes(), cudaMemcpyDeviceToDevice, c.stream), "cudaMemcpyAsync(",
        from.bytes(), " bytes)");
}

// y = x W^T + b, W: [out, in]. Gradient tensors get storage only when `alloc` is given
// (unsharded); under fsdp the library binds them.
class Linear {
 public:
  Linear(std::string name, std::int64_t in, std::int64_t out, fsdp::DType dtype, int device, StreamAllocator& alloc,
         bool grads_with_storage)
      : weight({out, in}, dtype, device, alloc), bias({out}, dtype, device, alloc),
        weight_grad(grads_with_storage ? Tensor({out, in}, dtype, device, alloc) : Tensor({out, in}, dtype, device)),
        bias_grad(grads_with_storage ? Tensor({out}, dtype, device, alloc) : Tensor({out}, dtype, device)),
        name_(std::move(name)), in_(in), out_(out) {}

  // `residual` (same shape as y) is added: y = residual + x W^T + b.
  Act forward(Context& c, const Act& x, fsdp::DType out_dtype, const Act& residual = nullptr) {
    check_dtype(weight, c.act, (name_ + ".weight").c_str());
    check_dtype(bias, c.act, (name_ + ".bias").c_str());
    if (x->dtype != c.act || x->cols != in_)
      fsdp::detail::fail("cuda_engine: ", name_, " input is [", x->rows, ", ", x->cols, "] ", fsdp::name_of(x->dtype),
                         ", expected ", in_, " columns of ", fsdp::name_of(c.act));
    Act y = c.make(x->rows, out_, out_dtype);
    float beta = 0.0f;
    if (residual) copy(c, *residual, *y), beta = 1.0f;
    // Y^T[out, B] (y's memory, ld out) = op_T(W's memory = W^T[in, out], ld in) * X^T[in, B] (x's memory, ld in)
    gemm(c, name_ + " forward", CUBLAS_OP_T, CUBLAS_OP_N, out_, x->rows, in_, weight.data(), in_, x->data(), in_, c.act,
         beta, y->data(), out_dtype, out_);
    c.kernels.add_bias(c.stream, y->data(), out_dtype, bias.data(), bias.dtype(), static_cast<unsigned long long>(x->rows),
                       static_cast<unsigned long long>(out_));
    x_ = x;
    return y;
  }

  // Adds into the gradients; returns dx (+ dx_init when given), or nothing unless need_dx.
  Act backward(Context& c, const Act& dy, bool need_dx, const Act& dx_init = nullptr) {
    check_dtype(weight_grad, c.act, (name_ + ".weight gradient").c_str());
    check_dtype(bias_grad, c.act, (name_ + ".bias gradient").c_str());
    const std::int64_t rows = dy->rows;
    // dW^T[in, out] (dW's memory, ld in) += X^T[in, B] (x's memory, ld in, op N) * op_T(dY^T[out, B]: dy's memory, ld out)
    gemm(c, name_ + " weight gradient", CUBLAS_OP_N, CUBLAS_OP_T, in_, out_, rows, x_->data(), in_, dy->data(), out_, c.act,
         1.0f, weight_grad.data(), weight_grad.dtype(), in_);
    add_row_sum(c, name_ + " bias gradient", *dy, bias_grad);  // db += sum over samples of dy
    Act dx;
    if (need_dx) {
      dx = c.make(rows, in_, c.act);
      float beta = 0.0f;
      if (dx_init) copy(c, *dx_init, *dx), beta = 1.0f;
      check_dtype(weight, c.act, (name_ + ".weight").c_str());
      // dX^T[in, B] (dx's memory, ld in) = W^T[in, out] (W's memory, ld in, op N) * dY^T[out, B] (dy's memory, ld out, op N)
      gemm(c, name_ + " input gradient", CUBLAS_OP_N, CUBLAS_OP_N, in_, rows, out_, weight.data(), in_, dy->data(), out_,
           c.act, beta, dx->data(), c.act, in_);
    }
    x_.reset();
    return dx;
  }

  template <class F>
  void visit_parameters(F&& f) {
    f("weight", weight, weight_grad);
    f("bias", bias, bias_grad);
  }

  Tensor weight, bias, weight_grad, bias_grad;

 private:
  std::string name_;
  std::int64_t in_, out_;
  Act x_;
};

// y = x * g * s: one trained gain and one fixed scale (a buffer) per feature.
class Gain {
 public:
  Gain(std::int64_t dim, fsdp::DType dtype, fsdp::DType buffer_dtype, int device, StreamAllocator& alloc,
       bool grads_with_storage)
      : gain({dim}, dtype, device, alloc),
        gain_grad(grads_with_storage ? Tensor({dim}, dtype, device, alloc) : Tensor({dim}, dtype, device)),
        scale({dim}, buffer_dtype, device, alloc), dim_(dim) {}

  Act forward(Context& c, const Act& x) {
    check_dtype(gain, c.act, "gain.gain");
    // The buffer may be f32 or bf16 (MixedPrecision casts it to its Buffer dtype).
    check_dtype(scale, scale.dtype() == fsdp::DType::bf16 ? fsdp::DType::bf16 : fsdp::DType::f32, "gain.scale");
    Act y = c.make(x->rows, dim_, c.act);
    c.kernels.gain(c.stream, y->data(), x->data(), c.act, gain.data(), gain.dtype(), scale.data(), scale.dtype(),
                   static_cast<unsigned long long>(x->rows), static_cast<unsigned long long>(dim_));
    x_ = x;
    return y;
  }

  Act backward(Context& c, const Act& dy) {
    check_dtype(gain_grad, c.act, "gain.gain gradient");
    Act dx = c.make(dy->rows, dim_, c.act), products = c.make(dy->rows, dim_, c.act);
    c.kernels.gain_grad(c.stream, dx->data(), products->data(), dy->data(), x_->data(), c.act, gain.data(), gain.dtype(),
                        scale.data(), scale.dtype(), static_cast<unsigned long long>(dy->rows),
                        static_cast<unsigned long long>(dim_));
    add_row_sum(c, "gain gradient", *products, gain_grad);  // dg += sum over samples of dy * x * s
    x_.reset();
    return dx;
  }

  template <class F>
  void visit_parameters(F&& f) { f("gain", gain, gain_grad); }
  template <class F>
  void visit_buffers(F&& f) { f("scale", scale); }

  Tensor gain, gain_grad;
  Tensor scale;  // buffer

 private:
  std::int64_t dim_;
  Act x_;
};

// Residual MLP block: y = x + fc2(relu(fc1(x))).
class Block {
 public:
  Block(const std::string& name, std::int64_t dim, std::int64_t hidden, fsdp::DType dtype, int device,
        StreamAllocator& alloc, bool grads_with_storage)
      : fc1(name + ".fc1", dim, hidden, dtype, device, alloc, grads_with_storage),
        fc2(name + ".fc2", hidden, dim, dtype, device, alloc, grads_with_storage) {}

  Act forward(Context& c, const Act& x) {
    h_ = fc1.forward(c, x, c.act);
    c.kernels.relu_inplace(c.stream, h_->data(), c.act, static_cast<unsigned long long>(h_->rows * h_->cols));
    return fc2.forward(c, h_, c.act, /*residual=*/x);
  }

  Act backward(Context& c, const Act& dy) {
    Act dh = fc2.backward(c, dy, true);
    c.kernels.relu_grad(c.stream, dh->data(), h_->data(), c.act, static_cast<unsigned long long>(dh->rows * dh->cols));
    h_.reset();
    return fc1.backward(c, dh, true, /*dx_init=*/dy);  // the residual's gradient, plus fc1's
  }

  template <class F>
  void visit_parameters(F&&) {}  // all parameters live in fc1 and fc2
  template <class F>
  void visit_children(F&& f) {
    f("fc1", fc1);
    f("fc2", fc2);
  }

  Linear fc1, fc2;

 private:
  Act h_;  // relu(fc1(x)): fc2's input, and where relu passed
};

}  // namespace cuda_engine
