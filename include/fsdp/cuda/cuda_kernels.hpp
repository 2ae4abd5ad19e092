#pragma once
// The element-wise kernels of fsdp::CudaDevice (scale, accumulate, cast, unscale, block
// and per-tensor quantization) as NVRTC source, and their compilation for one GPU architecture, through the on-disk cache of
// fsdp/cuda/kernel_cache.hpp. Compiling needs NVRTC only, no GPU, so CI checks that the
// source builds (and the cache works) everywhere the toolkit is installed.
#include <nvrtc.h>

#include <algorithm>
#include <cstddef>
#include <string>
#include <string_view>
#include <vector>

#include "fsdp/cuda/kernel_cache.hpp"
#include "fsdp/cuda/zero_spans.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {
namespace detail {

// The kernels' dtype codes are fsdp::DType's values.
static_assert(static_cast<int>(DType::f32) == 0 && static_cast<int>(DType::f64) == 1 &&
              static_cast<int>(DType::f16) == 2 && static_cast<int>(DType::bf16) == 3 &&
              static_cast<int>(DType::i8) == 4 && static_cast<int>(DType::u8) == 5 &&
              static_cast<int>(DType::i32) == 6 && static_cast<int>(DType::i64) == 7);

// Whether the kernels below compute in `t`: the eight dtypes above. The 8-bit floats
// (issue 38) are moved by copies and collectives but have no kernel arithmetic yet.
constexpr bool has_kernels(DType t) {
  switch (t) {
    case DType::f32: case DType::f64: case DType::f16: case DType::bf16:
    case DType::i8: case DType::u8: case DType::i32: case DType::i64: return true;
    case DType::f8e4m3: case DType::f8e5m2: case DType::e8m0: return false;
  }
  return false;
}

// NVRTC source of the element-wise kernels (after zero_spans_source, see
// cuda_kernel_program). Self-contained: no #include, so it compiles the same wherever
// NVRTC is installed. The 16-bit conversions are fsdp/core/dtype.hpp's,
// line for line (double -> 16-bit rounds once, as detail::double_to_16bit does).
inline constexpr std::string_view cuda_kernels_source = R"cuda(
typedef unsigned int u32;
typedef unsigned short u16;
typedef long long i64;
typedef unsigned long long u64;

enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I8 = 4, U8 = 5, I32 = 6, I64 = 7 };

__device__ __forceinline__ u16 float_to_bf16_bits(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40);  // quiet NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // ties go to the even neighbour
  return (u16)(u >> 16);
}

__device__ __forceinline__ float bf16_bits_to_float(u16 h) { return __uint_as_float((u32)h << 16); }

__device__ __forceinline__ u16 float_to_f16_bits(float f) {
  const u32 u = __float_as_uint(f);
  const u32 sign = (u >> 16) & 0x8000u;
  const u32 abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return (u16)(sign | 0x7e00u);  // NaN
  if (abs >= 0x477ff000u) return (u16)(sign | 0x7c00u);  // rounds to inf
  if (abs < 0x38800000u) {  // below the smallest normal half: subnormal or zero
    if (abs < 0x33000000u) return (u16)sign;  // rounds to 0 (ties to even 0)
    const u32 exp = abs >> 23;
    const u32 mant = (abs & 0x7fffffu) | 0x800000u;
    const u32 shift = 126u - exp;
    u32 r = mant >> shift;
    const u32 rem = mant & ((1u << shift) - 1u);
    const u32 half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (r & 1u))) ++r;
    return (u16)(sign | r);
  }
  u32 r = abs - 0x38000000u;  // rebias exponent 127 -> 15
  r += 0xfffu + ((r >> 13) & 1u);
  return (u16)(sign | (r >> 13));
}

__device__ __forceinline__ float f16_bits_to_float(u16 h) {
  const u32 sign = (u32)(h & 0x8000u) << 16;
  const u32 exp = (h >> 10) & 0x1fu;
  u32 mant = h & 0x3ffu;
  if (exp == 0x1f) return __uint_as_float(sign | 0x7f800000u | (mant << 13));
  if (exp == 0) {
    if (mant == 0) return __uint_as_float(sign);
    int e = -1;  // normalise the subnormal
    do { ++e; mant <<= 1; } while ((mant & 0x400u) == 0);
    return __uint_as_float(sign | (u32)(112 - e) << 23 | (mant & 0x3ffu) << 13);
  }
  return __uint_as_float(sign | (exp + 112u) << 23 | mant << 13);
}

__device__ __forceinline__ bool is_half(int t) { return t == F16 || t == BF16; }
__device__ __forceinline__ float half_load(u16 v, int t) {
  return t == F16 ? f16_bits_to_float(v) : bf16_bits_to_float(v);
}
__device__ __forceinline__ u16 half_store(float v, int t) {
  return t == F16 ? float_to_f16_bits(v) : float_to_bf16_bits(v);
}

__device__ double load_as_double(const void* p, u64 i, int t) {
  switch (t) {
    case F32: return ((const float*)p)[i];
    case F64: return ((const double*)p)[i];
    case F16: return f16_bits_to_float(((const u16*)p)[i]);
    case BF16: return bf16_bits_to_float(((const u16*)p)[i]);
    case I8: return ((const signed char*)p)[i];
    case U8: return ((const unsigned char*)p)[i];
    case I32: return ((const int*)p)[i];
    case I64: return (double)((const i64*)p)[i];
  }
  return 0;
}

// double -> 16-bit in one rounding step (through float would round twice).
__device__ u16 double_to_16bit(double d, int exp_bits, int mant_bits) {
  const int bias = (1 << (exp_bits - 1)) - 1;
  const u64 inf = ((1ull << exp_bits) - 1) << mant_bits;
  const u64 u = (u64)__double_as_longlong(d);
  const u16 sign = (u16)((u >> 48) & 0x8000u);
  const u64 abs = u & 0x7fffffffffffffffull;
  if (abs > 0x7ff0000000000000ull) return (u16)(sign | inf | (1ull << (mant_bits - 1)));
  const int e = (int)(abs >> 52) - 1023;
  if (e < -bias - mant_bits) return sign;
  const u64 m = (abs & 0xfffffffffffffull) | (1ull << 52);
  const int sub = 1 - bias - e;
  const int drop = 52 - mant_bits + (sub > 0 ? sub : 0);
  u64 r = m >> drop;
  const u64 rest = m & ((1ull << drop) - 1), half = 1ull << (drop - 1);
  if (rest > half || (rest == half && (r & 1u))) ++r;
  const int biased = e + bias > 1 ? e + bias : 1;
  const u64 bits = ((u64)(biased - 1) << mant_bits) + r;
  return (u16)(sign | (bits < inf ? bits : inf));
}

__device__ void store_from_double(void* p, u64 i, int t, double v) {
  switch (t) {
    case F32: ((float*)p)[i] = (float)v; return;
    case F64: ((double*)p)[i] = v; return;
    case F16: ((u16*)p)[i] = double_to_16bit(v, 5, 10); return;
    case BF16: ((u16*)p)[i] = double_to_16bit(v, 8, 7); return;
    case I8: ((signed char*)p)[i] = (signed char)v; return;
    case U8: ((unsigned char*)p)[i] = (unsigned char)v; return;
    case I32: ((int*)p)[i] = (int)v; return;
    case I64: ((i64*)p)[i] = (i64)v; return;
  }
}

// Element i of n for this thread, as block `block` of `blocks` (a grid-stride loop): the
// whole grid, or the share of it a kernel gives one task (fsdp_cast_zero).
#define FSDP_FOR_EACH_OF(i, n, block, blocks) \
  for (u64 i = (u64)(block) * blockDim.x + threadIdx.x; i < (n); i += (u64)(blocks) * blockDim.x)
#define FSDP_FOR_EACH(i, n) FSDP_FOR_EACH_OF(i, n, blockIdx.x, gridDim.x)

template <class T> __device__ void scale_float(T* q, u64 n, double factor) {
  const T f = (T)factor;
  FSDP_FOR_EACH(i, n) q[i] = (T)(q[i] * f);
}
template <class T> __device__ void scale_int(T* q, u64 n, double factor) {  // not truncating factor
  FSDP_FOR_EACH(i, n) q[i] = (T)(q[i] * factor);
}
template <class T> __device__ void add(T* d, const T* s, u64 n) {
  FSDP_FOR_EACH(i, n) d[i] = (T)(d[i] + s[i]);
}

extern "C" __global__ void fsdp_scale(void* p, u64 n, int t, double factor) {
  switch (t) {
    case F32: scale_float((float*)p, n, factor); return;
    case F64: scale_float((double*)p, n, factor); return;
    case F16: case BF16: {
      u16* q = (u16*)p;
      const float f = (float)factor;
      FSDP_FOR_EACH(i, n) q[i] = half_store(half_load(q[i], t) * f, t);
      return;
    }
    case I8: scale_int((signed char*)p, n, factor); return;
    case U8: scale_int((unsigned char*)p, n, factor); return;
    case I32: scale_int((int*)p, n, factor); return;
    case I64: scale_int((i64*)p, n, factor); return;
  }
}

extern "C" __global__ void fsdp_accumulate(void* dst, const void* src, u64 n, int t) {
  switch (t) {
    case F32: add((float*)dst, (const float*)src, n); return;
    case F64: add((double*)dst, (const double*)src, n); return;
    case F16: case BF16: {
      u16* d = (u16*)dst;
      const u16* s = (const u16*)src;
      FSDP_FOR_EACH(i, n) d[i] = half_store(half_load(d[i], t) + half_load(s[i], t), t);
      return;
    }
    case I8: add((signed char*)dst, (const signed char*)src, n); return;
    case U8: add((unsigned char*)dst, (const unsigned char*)src, n); return;
    case I32: add((int*)dst, (const int*)src, n); return;
    case I64: add((i64*)dst, (const i64*)src, n); return;
  }
}

__device__ __forceinline__ bool finite_f32(float v) { return (__float_as_uint(v) & 0x7f800000u) != 0x7f800000u; }
__device__ __forceinline__ bool finite_f64(double v) {
  return ((u64)__double_as_longlong(v) & 0x7ff0000000000000ull) != 0x7ff0000000000000ull;
}

// ShardedGradScaler's unscale, as fsdp::detail::host_unscale: the product in double,
// rounded once; *nonfinite = 1 if any result is inf/NaN (every writer stores the same 1;
// the flag is cleared only by CudaDevice::found_nonfinite).
extern "C" __global__ void fsdp_unscale(void* p, u64 n, int t, double inv, u32* nonfinite) {
  bool bad = false;
  switch (t) {
    case F32: {
      float* q = (float*)p;
      FSDP_FOR_EACH(i, n) { const float v = (float)((double)q[i] * inv); bad |= !finite_f32(v); q[i] = v; }
      break;
    }
    case F64: {
      double* q = (double*)p;
      FSDP_FOR_EACH(i, n) { const double v = q[i] * inv; bad |= !finite_f64(v); q[i] = v; }
      break;
    }
    case F16: case BF16: {
      u16* q = (u16*)p;
      FSDP_FOR_EACH(i, n) {
        const u16 b = half_store((float)((double)half_load(q[i], t) * inv), t);
        bad |= !finite_f32(half_load(b, t));
        q[i] = b;
      }
      break;
    }
  }
  if (bad) *nonfinite = 1u;
}

// Every span of the table zeroed (fsdp/cuda/zero_spans.hpp): a grid-stride loop over the
// blocks of all spans.
extern "C" __global__ void fsdp_zero_spans(ZeroSpans s) {
  zero_spans_blocks(s, blockIdx.x, gridDim.x, threadIdx.x, blockDim.x);
}

// to != from (equal dtypes are a copy). Same steps as fsdp::detail::host_cast, run by
// block `block` of `blocks`, so a kernel can give the cast some of its blocks and other
// work the rest (fsdp_cast_zero).

__device__ __forceinline__ void cast_blocks(void* dst, int to, const void* src, int from, u64 n, u64 block, u64 blocks) {
  if (from == F32 && is_half(to)) {  // the mixed-precision hot paths
    const float* s = (const float*)src;
    u16* d = (u16*)dst;
    FSDP_FOR_EACH_OF(i, n, block, blocks) d[i] = half_store(s[i], to);
    return;
  }
  if (is_half(from) && to == F32) {
    const u16* s = (const u16*)src;
    float* d = (float*)dst;
    FSDP_FOR_EACH_OF(i, n, block, blocks) d[i] = half_load(s[i], from);
    return;
  }
  if (to == F64 || from == F64) {
    FSDP_FOR_EACH_OF(i, n, block, blocks) store_from_double(dst, i, to, load_as_double(src, i, from));
    return;
  }
  FSDP_FOR_EACH_OF(i, n, block, blocks) {
    const float v = is_half(from) ? half_load(((const u16*)src)[i], from) : (float)load_as_double(src, i, from);
    if (is_half(to)) ((u16*)dst)[i] = half_store(v, to);
    else store_from_double(dst, i, to, (double)v);
  }
}

extern "C" __global__ void fsdp_cast(void* dst, int to, const void* src, int from, u64 n) {
  cast_blocks(dst, to, src, from, n, blockIdx.x, gridDim.x);
}

// A cast and a table of buffers to zero in one launch (CudaDevice::cast_zeroing): the
// first `cast_grid` blocks cast, the others zero (a grid-stride loop over the table's blocks).
extern "C" __global__ void fsdp_cast_zero(void* dst, int to, const void* src, int from, u64 n, u32 cast_grid,
                                          ZeroSpans z) {
  if (blockIdx.x < cast_grid) return cast_blocks(dst, to, src, from, n, blockIdx.x, cast_grid);
  zero_spans_blocks(z, blockIdx.x - cast_grid, gridDim.x - cast_grid, threadIdx.x, blockDim.x);
}

// ---- block quantization: fsdp/core/quantize.hpp's formats, line for line ----------------
enum { Q_INT8 = 0, Q_E4M3 = 1, Q_MXFP8 = 2, Q_E5M2 = 3, Q_E4M3_TENSOR = 4, Q_E5M2_TENSOR = 5 };  // fsdp::QuantFormat

// float -> an OFP8 pattern, to nearest with ties to even, saturating: fsdp::detail::float_to_f8
// with saturate = true, for the format of `bias` and `mant` mantissa bits whose largest
// finite pattern is `max_finite` and NaN `nan` (no sign): +-inf and what rounds beyond the
// largest give +-max_finite, a NaN keeps its sign.
__device__ __forceinline__ unsigned char float_to_f8_sat(float f, int bias, int mant, u32 max_finite, u32 nan) {
  const u32 u = __float_as_uint(f);
  const u32 sign = (u >> 24) & 0x80u;
  const u32 abs = u & 0x7fffffffu;
  if (abs > 0x7f800000u) return (unsigned char)(sign | nan);
  if (abs == 0x7f800000u) return (unsigned char)(sign | max_finite);
  const int e = (int)(abs >> 23) - 127;
  if (e < -bias - mant) return (unsigned char)sign;
  const u32 m = (abs & 0x7fffffu) | 0x800000u;
  const int sub = 1 - bias - e;
  const int drop = 23 - mant + (sub > 0 ? sub : 0);
  u32 r = m >> drop;
  const u32 rest = m & ((1u << drop) - 1u), half = 1u << (drop - 1);
  if (rest > half || (rest == half && (r & 1u))) ++r;
  const int biased = e + bias > 1 ? e + bias : 1;
  const u32 bits = ((u32)(biased - 1) << mant) + r;
  return (unsigned char)(sign | (bits > max_finite ? max_finite : bits));
}

// OFP8 pattern -> float, exact: fsdp::detail::f8_to_float. A `special` pattern is inf when
// `inf` (E5M2's S.11111.00), else NaN.
__device__ __forceinline__ float f8_to_float(unsigned char b, int bias, int mant, bool special, bool inf) {
  const u32 sign = (u32)(b & 0x80u) << 24;
  const u32 e = (b & 0x7fu) >> mant, m = b & ((1u << mant) - 1u);
  if (special) return __uint_as_float(sign | (inf ? 0x7f800000u : 0x7fc00000u));
  if (e == 0)
    return __uint_as_float(sign | __float_as_uint((float)m * __uint_as_float((u32)(128 - bias - mant) << 23)));
  return __uint_as_float(sign | (e + 127u - (u32)bias) << 23 | m << (23 - mant));
}

// E4M3 (E4M3FN): bias 7, 3 mantissa bits, largest 0x7e = 448, NaN S.1111.111, no inf
// (fsdp::float_to_f8e4m3_bits saturating, fsdp::f8e4m3_bits_to_float).
__device__ unsigned char float_to_e4m3_sat(float f) { return float_to_f8_sat(f, 7, 3, 0x7eu, 0x7fu); }
__device__ float e4m3_to_float(unsigned char b) { return f8_to_float(b, 7, 3, (b & 0x7fu) == 0x7fu, false); }

// E5M2: bias 15, 2 mantissa bits, largest 0x7b = 57344, NaN 0x7e (a quiet NaN), inf
// S.11111.00 (fsdp::float_to_f8e5m2_bits saturating, fsdp::f8e5m2_bits_to_float).
__device__ unsigned char float_to_e5m2_sat(float f) { return float_to_f8_sat(f, 15, 2, 0x7bu, 0x7eu); }
__device__ float e5m2_to_float(unsigned char b) {
  return f8_to_float(b, 15, 2, (b & 0x7cu) == 0x7cu, (b & 0x7fu) == 0x7cu);
}

// fsdp::detail::scale_for: amax / qmax in double, rounded up to a float, at least the
// smallest subnormal; 0 for an all-zero block.
__device__ float quant_scale_for(float amax, float qmax) {
  if (amax == 0.0f) return 0.0f;
  const double exact = (double)amax / (double)qmax;
  float s = (float)exact;
  if ((double)s < exact) s = nextafterf(s, __uint_as_float(0x7f800000u));
  return s > __uint_as_float(1u) ? s : __uint_as_float(1u);
}

// One warp per block of `block` values (a grid-stride loop over the blocks): the lanes find
// the block's amax together, then each encodes its share. A block holding an inf or NaN is
// written as a NaN block (zero codes, a NaN scale: 0xff in e8m0), so it dequantizes to
// NaNs, and the lowest such element's index goes to *first_bad (atomicMin).
extern "C" __global__ void fsdp_quantize(void* q, void* scales, const float* x, u64 n, int format, u64 block,
                                         u64* first_bad) {
  const u32 lane = threadIdx.x & 31u;
  const u64 warps = ((u64)gridDim.x * blockDim.x) >> 5;
  const u64 blocks = n / block + (n % block != 0);
  for (u64 b = ((u64)blockIdx.x * blockDim.x + threadIdx.x) >> 5; b < blocks; b += warps) {
    const u64 first = b * block, end = first + block < n ? first + block : n;
    float amax = 0.0f;
    u64 bad = ~0ull;
    for (u64 i = first + lane; i < end; i += 32) {
      const float v = x[i];
      if (!finite_f32(v)) bad = i < bad ? i : bad;
      else amax = fmaxf(amax, fabsf(v));
    }
    for (int o = 16; o > 0; o >>= 1) {
      amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
      const u64 other = __shfl_xor_sync(0xffffffffu, bad, o);
      bad = other < bad ? other : bad;
    }
    if (bad != ~0ull) {
      if (lane == 0) {
        atomicMin(first_bad, bad);
        if (format == Q_MXFP8) ((unsigned char*)scales)[b] = (unsigned char)0xffu;
        else ((float*)scales)[b] = __uint_as_float(0x7fc00000u);
      }
      for (u64 i = first + lane; i < end; i += 32) ((unsigned char*)q)[i] = (unsigned char)0;
      continue;
    }
    if (format == Q_MXFP8) {  // fsdp::quantize_mxfp8: x / 2^(floor(log2 amax) - 8), exact
      int shared = amax == 0.0f ? -127 : ilogbf(amax) - 8;
      shared = shared > -127 ? shared : -127;
      if (lane == 0) ((unsigned char*)scales)[b] = (unsigned char)(shared + 127);
      for (u64 i = first + lane; i < end; i += 32) ((unsigned char*)q)[i] = float_to_e4m3_sat(ldexpf(x[i], -shared));
      continue;
    }
    const float scale = quant_scale_for(amax, format == Q_INT8 ? 127.0f : format == Q_E5M2 ? 57344.0f : 448.0f);
    if (lane == 0) ((float*)scales)[b] = scale;
    for (u64 i = first + lane; i < end; i += 32) {
      if (format == Q_INT8) {
        const float r = scale == 0.0f ? 0.0f : rintf(x[i] / scale);  // ties to even
        ((signed char*)q)[i] = (signed char)(r < -127.0f ? -127.0f : (r > 127.0f ? 127.0f : r));
      } else if (scale == 0.0f) {
        ((unsigned char*)q)[i] = (unsigned char)0;
      } else {
        const float v = x[i] / scale;
        ((unsigned char*)q)[i] = format == Q_E5M2 ? float_to_e5m2_sat(v) : float_to_e4m3_sat(v);
      }
    }
  }
}

// x[i] = code i * the scale of its block: in double, clamped to the finite floats as
// std::clamp does (a NaN stays NaN), then rounded once (fsdp::detail::decode_scaled); MXFP8
// by a power of two (an e8m0 scale 0xff is NaN).
extern "C" __global__ void fsdp_dequantize(float* x, const void* q, const void* scales, u64 n, int format, u64 block) {
  const double top = 3.4028234663852886e38;  // FLT_MAX
  FSDP_FOR_EACH(i, n) {
    if (format == Q_MXFP8) {
      const unsigned char s = ((const unsigned char*)scales)[i / 32];
      x[i] = s == 0xffu ? __uint_as_float(0x7fc00000u) : ldexpf(e4m3_to_float(((const unsigned char*)q)[i]), (int)s - 127);
      continue;
    }
    const unsigned char c = ((const unsigned char*)q)[i];
    const float code = format == Q_INT8 ? (float)(signed char)c : format == Q_E5M2 ? e5m2_to_float(c) : e4m3_to_float(c);
    const double d = (double)code * (double)((const float*)scales)[i / block];
    x[i] = (float)(d < -top ? -top : (top < d ? top : d));
  }
}

// ---- per-tensor scaling: fsdp::detail::abs_max_or_inf, quantize_tensor_with_amax and
// dequantize_tensor_with_amax, line for line; the amax is read from device memory.

// *out = max |x[i]|, +inf for an inf or NaN, over as many blocks as the slice needs: each
// thread's largest |x| as bits (non-negative floats order as their bits do, and an inf or
// NaN counts as inf's bits), a tree over the block's shared memory, then one atomicMax
// per block into *out, which CudaDevice::abs_max zeroes first (so n = 0 gives 0).
extern "C" __global__ void fsdp_abs_max(const float* x, u64 n, float* out) {
  __shared__ u32 best[256];  // CudaDevice's threads_per_block
  u32 m = 0;
  FSDP_FOR_EACH(i, n) {
    const u32 a = __float_as_uint(x[i]) & 0x7fffffffu;
    const u32 v = a >= 0x7f800000u ? 0x7f800000u : a;
    m = v > m ? v : m;
  }
  best[threadIdx.x] = m;
  __syncthreads();
  for (u32 half = blockDim.x / 2; half > 0; half >>= 1) {
    if (threadIdx.x < half && best[threadIdx.x + half] > best[threadIdx.x]) best[threadIdx.x] = best[threadIdx.x + half];
    __syncthreads();
  }
  if (threadIdx.x == 0 && best[0] != 0) atomicMax((u32*)out, best[0]);
}

// out[i] = the largest of in[r * n + i] over the rows (the ranks' gathered amaxes), compared
// as bits as fsdp_abs_max does (a NaN, which no amax is, read as inf): fsdp::detail::max_over_rows.
extern "C" __global__ void fsdp_max_over_rows(float* out, const float* in, u64 rows, u64 n) {
  FSDP_FOR_EACH(i, n) {
    u32 m = 0;
    for (u64 r = 0; r < rows; ++r) {
      const u32 a = __float_as_uint(in[r * n + i]) & 0x7fffffffu;
      const u32 v = a > 0x7f800000u ? 0x7f800000u : a;
      m = v > m ? v : m;
    }
    out[i] = __uint_as_float(m);
  }
}

// q[i] = encode(x[i] / scale_for(*amax, qmax)), saturating; zero codes for scale 0 or a
// non-finite *amax.
extern "C" __global__ void fsdp_quantize_tensor(void* q, const float* x, u64 n, int format, const float* amax_at) {
  const float amax = *amax_at;
  const float scale = finite_f32(amax) ? quant_scale_for(amax, format == Q_E5M2_TENSOR ? 57344.0f : 448.0f) : 0.0f;
  FSDP_FOR_EACH(i, n) {
    unsigned char c = 0;
    if (scale != 0.0f) {
      const float v = x[i] / scale;
      c = format == Q_E5M2_TENSOR ? float_to_e5m2_sat(v) : float_to_e4m3_sat(v);
    }
    ((unsigned char*)q)[i] = c;
  }
}

// y[i] = decode(q[i]) * scale_for(*amax, qmax) in double, clamped to the finite floats
// (fsdp::detail::decode_scaled); NaN everywhere for a non-finite *amax.
extern "C" __global__ void fsdp_dequantize_tensor(float* y, const void* q, u64 n, int format, const float* amax_at) {
  const double top = 3.4028234663852886e38;  // FLT_MAX
  const float amax = *amax_at;
  const bool finite = finite_f32(amax);
  const float scale = finite ? quant_scale_for(amax, format == Q_E5M2_TENSOR ? 57344.0f : 448.0f) : 0.0f;
  FSDP_FOR_EACH(i, n) {
    if (!finite) {
      y[i] = __uint_as_float(0x7fc00000u);
      continue;
    }
    const unsigned char c = ((const unsigned char*)q)[i];
    const double d = (double)(format == Q_E5M2_TENSOR ? e5m2_to_float(c) : e4m3_to_float(c)) * (double)scale;
    y[i] = (float)(d < -top ? -top : (top < d ? top : d));
  }
}
)cuda";

// The whole NVRTC program: the zero-spans table and block code, then the kernels.
inline std::string cuda_kernel_program() {
  std::string program = "#define FSDP_ZERO_SPANS_FN __device__ __forceinline__\n";
  program.append(zero_spans_source).append("\n").append(cuda_kernels_source);
  return program;
}

// Compiles cuda_kernel_program() for compute capability major.minor: a CUBIN for sm_XY when
// this NVRTC knows that architecture, else PTX for the newest compute_XY it supports that
// is not newer than the device (the driver finishes it). Needs no GPU. Throws fsdp::Error
// with NVRTC's log on failure.
struct CudaKernelImage {
  std::vector<char> code;  // CUBIN, or PTX with its terminating NUL
  std::string arch;        // "sm_90" or "compute_90"
  bool from_cache = false;  // load_cuda_kernels found it in the on-disk cache
};

inline void nvrtc_check(nvrtcResult r, const char* call, int device_index) {
  if (r != NVRTC_SUCCESS)
    fail("CudaDevice(cuda:", device_index, "): ", call, " failed: ", nvrtcGetErrorString(r));
}

// The architecture to compile for: "sm_XY" when NVRTC knows compute capability X.Y, else
// the newest "compute_XY" it supports below it.
inline std::string cuda_kernel_arch(int major, int minor, int device_index = 0) {
  const int want = major * 10 + minor;
  int num_archs = 0;
  nvrtc_check(nvrtcGetNumSupportedArchs(&num_archs), "nvrtcGetNumSupportedArchs", device_index);
  std::vector<int> archs(static_cast<std::size_t>(num_archs));
  if (num_archs > 0) nvrtc_check(nvrtcGetSupportedArchs(archs.data()), "nvrtcGetSupportedArchs", device_index);
  const bool exact = std::find(archs.begin(), archs.end(), want) != archs.end();
  int use = want;
  if (!exact) {
    use = 0;
    for (int a : archs)
      if (a <= want) use = std::max(use, a);
    if (use == 0)
      fail("CudaDevice(cuda:", device_index, "): NVRTC supports no architecture up to compute capability ",
           major, ".", minor);
  }
  return (exact ? "sm_" : "compute_") + std::to_string(use);
}

// Every option but the architecture (part of the cache key).
inline constexpr const char* cuda_kernel_options[] = {"--std=c++17", "--fmad=false", "--ftz=false", "--prec-div=true",
                                                      "--prec-sqrt=true"};

inline std::string nvrtc_version_text() {
  int major = 0, minor = 0;
  if (nvrtcVersion(&major, &minor) != NVRTC_SUCCESS) return "nvrtc ?";
  return "nvrtc " + std::to_string(major) + "." + std::to_string(minor);
}

inline CudaKernelImage compile_cuda_kernels(int major, int minor, int device_index = 0) {
  CudaKernelImage image;
  image.arch = cuda_kernel_arch(major, minor, device_index);
  const bool exact = image.arch.rfind("sm_", 0) == 0;
  const std::string arch_opt = "--gpu-architecture=" + image.arch;
  std::vector<const char*> opts{arch_opt.c_str()};
  for (const char* o : cuda_kernel_options) opts.push_back(o);

  nvrtcProgram prog = nullptr;
  const std::string src = cuda_kernel_program();
  nvrtc_check(nvrtcCreateProgram(&prog, src.c_str(), "fsdp_cuda_kernels.cu", 0, nullptr, nullptr),
              "nvrtcCreateProgram", device_index);
  struct Destroy {
    nvrtcProgram* p;
    ~Destroy() { nvrtcDestroyProgram(p); }
  } destroy{&prog};

  const nvrtcResult compiled = nvrtcCompileProgram(prog, static_cast<int>(opts.size()), opts.data());
  if (compiled != NVRTC_SUCCESS) {
    std::size_t log_size = 0;
    std::string log;
    if (nvrtcGetProgramLogSize(prog, &log_size) == NVRTC_SUCCESS && log_size > 1) {
      log.resize(log_size);
      if (nvrtcGetProgramLog(prog, log.data()) != NVRTC_SUCCESS) log.clear();
      while (!log.empty() && (log.back() == '\0' || log.back() == '\n')) log.pop_back();
    }
    fail("CudaDevice(cuda:", device_index, "): nvrtcCompileProgram(", arch_opt, ") failed: ",
         nvrtcGetErrorString(compiled), "\n", log);
  }
  std::size_t size = 0;
  if (exact) {
    nvrtc_check(nvrtcGetCUBINSize(prog, &size), "nvrtcGetCUBINSize", device_index);
    image.code.resize(size);
    nvrtc_check(nvrtcGetCUBIN(prog, image.code.data()), "nvrtcGetCUBIN", device_index);
  } else {
    nvrtc_check(nvrtcGetPTXSize(prog, &size), "nvrtcGetPTXSize", device_index);  // includes the NUL
    image.code.resize(size);
    nvrtc_check(nvrtcGetPTX(prog, image.code.data()), "nvrtcGetPTX", device_index);
  }
  return image;
}

// The cache key of the kernels for `arch`: source, architecture, options, NVRTC version.
inline std::uint64_t cuda_kernel_cache_key(const std::string& arch) {
  std::string options;
  for (const char* o : cuda_kernel_options) options.append(o).push_back(' ');
  const std::string program = cuda_kernel_program();
  return KernelCache::key_of({program, arch, options, nvrtc_version_text()});
}

// compile_cuda_kernels, or its result from `cache` when an entry for the same key is
// there and whole; a compiled result is stored for the next process.
inline CudaKernelImage load_cuda_kernels(int major, int minor, int device_index, const KernelCache& cache) {
  if (!cache.enabled()) return compile_cuda_kernels(major, minor, device_index);
  const std::string arch = cuda_kernel_arch(major, minor, device_index);
  const std::uint64_t key = cuda_kernel_cache_key(arch);
  if (auto code = cache.load(key, arch)) return CudaKernelImage{std::move(*code), arch, true};
  CudaKernelImage image = compile_cuda_kernels(major, minor, device_index);
  cache.store(key, image.arch, image.code);
  return image;
}

}  // namespace detail

}  // namespace fsdp
