#pragma once
// What fsdp::NcclComm shares with its helpers: its options, fsdp dtypes and reduce ops as
// NCCL's, the unique id as store text, and checked NCCL calls whose errors name the call
// (checked CUDA calls: fsdp/cuda/cuda_check.hpp). The one fsdp header that includes
// <nccl.h>; the others get it from here.
#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstddef>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "fsdp/core/communicator.hpp"
#include "fsdp/cuda/cuda_check.hpp"
#include "fsdp/core/detail/timeout.hpp"
#include "fsdp/core/dtype.hpp"
#include "fsdp/core/error.hpp"

namespace fsdp {

struct NcclCommOptions {
  // Longest time one collective may take from the call that issued it (it may first queue
  // behind work on its stream). Past it the watchdog aborts the communicator
  // (ncclCommAbort) and every wait() throws.
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};
  // The bound on creating (unique id from the store included), splitting and finalizing a
  // communicator: NCCL's first initialization in a process alone can take seconds, so it
  // is apart from the collectives' timeout.
  std::chrono::milliseconds setup_timeout{std::chrono::minutes(5)};
  // How often the watchdog looks at the oldest collective in flight and NCCL's async error.
  std::chrono::milliseconds watchdog_interval{10};
  // from_store(): where rank 0 puts the unique id. One key per communicator of a job.
  std::string store_key = "fsdp/nccl/unique_id";
  std::string name = "world";  // in messages
  // Given: every collective runs on this stream, which the caller owns. Null: the
  // communicator creates two non-blocking streams of its own, one for all-gathers and one
  // for the other collectives, so a compute stream that waits for an all-gather is not
  // ordered behind a reduce-scatter's wait for the gradients (FSDP's two streams).
  cudaStream_t stream = nullptr;
  // Given: each collective first waits (on the GPU) for the work already queued on this
  // stream: the engine's compute stream (CudaDevice::stream()), whose kernels write the
  // buffers it reads and on which the library allocates them (stream-ordered). Needed
  // whenever the buffers come from a CudaDevice.
  cudaStream_t after = nullptr;
};

namespace detail {

inline void check_nccl_options(const NcclCommOptions& o, std::string_view where) {
  check_timeout(o.timeout, where, ": NcclCommOptions::timeout");
  check_timeout(o.setup_timeout, where, ": NcclCommOptions::setup_timeout");
  check_timeout(o.watchdog_interval, where, ": NcclCommOptions::watchdog_interval");
  if (o.watchdog_interval > o.timeout)
    fail(where, ": NcclCommOptions::watchdog_interval (", o.watchdog_interval.count(),
         " ms) is longer than the timeout (", o.timeout.count(), " ms) it enforces");
  if (o.store_key.empty()) fail(where, ": NcclCommOptions::store_key is empty");
}

// "NcclComm 'world' rank 1 of 4": how messages name a rank of a communicator.
inline std::string nccl_where(const std::string& name, int rank, int size) {
  return "NcclComm '" + name + "' rank " + std::to_string(rank) + " of " + std::to_string(size);
}

inline ncclDataType_t nccl_dtype(DType t) {
  switch (t) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::f16: return ncclFloat16;
    case DType::bf16: return ncclBfloat16;
    case DType::i8: return ncclInt8;
    case DType::u8: return ncclUint8;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::f8e4m3: return ncclFloat8e4m3;  // NCCL 2.24+ (reductions need sm_90 or newer)
    case DType::f8e5m2: return ncclFloat8e5m2;
    case DType::e8m0: return ncclUint8;  // max and min only (CollectiveCalls refuses the rest): ordered as the values
  }
  fail("NcclComm: dtype code ", static_cast<int>(t), " is not an fsdp::DType NCCL can move");
}

// avg is NCCL's own: integers are summed, then divided (truncating) by the group size;
// floats are each multiplied by 1/size before the sum, which equals sum-then-divide
// exactly when the size is a power of two (barring underflow).
inline ncclRedOp_t nccl_op(ReduceOp op) {
  switch (op) {
    case ReduceOp::sum: return ncclSum;
    case ReduceOp::avg: return ncclAvg;
    case ReduceOp::max: return ncclMax;
    case ReduceOp::min: return ncclMin;
  }
  fail("NcclComm: reduce op code ", static_cast<int>(op), " is not an fsdp::ReduceOp");
}

// "unhandled system error (ncclSystemError): <NCCL's last message>".
inline std::string nccl_error_text(ncclResult_t r, ncclComm_t comm = nullptr) {
  static constexpr const char* names[] = {"ncclSuccess",       "ncclUnhandledCudaError", "ncclSystemError",
                                          "ncclInternalError", "ncclInvalidArgument",    "ncclInvalidUsage",
                                          "ncclRemoteError",   "ncclInProgress"};
  std::string text = ncclGetErrorString(r);
  const int code = static_cast<int>(r);
  text += code >= 0 && code < 8 ? std::string(" (") + names[code] + ")" : " (ncclResult " + std::to_string(code) + ")";
  const char* last = ncclGetLastError(comm);
  if (last && *last) text += std::string(": ") + last;
  return text;
}

// The fsdp::ErrorKind of an NCCL error: peer_lost for a remote peer's failure or a failed
// system call (a socket to a peer that died), misuse for the rest.
inline ErrorKind nccl_error_kind(ncclResult_t r) {
  return r == ncclRemoteError || r == ncclSystemError ? ErrorKind::peer_lost : ErrorKind::misuse;
}

// ncclSuccess and ncclInProgress (a nonblocking call still under way) pass.
template <class... Where>
void nccl_check(ncclResult_t r, ncclComm_t comm, const char* call, Where&&... where) {
  if (r == ncclSuccess || r == ncclInProgress) return;
  fail_as(nccl_error_kind(r), std::forward<Where>(where)..., ": ", call, " failed: ", nccl_error_text(r, comm));
}

// Makes a device current for the calling thread, restoring the previous one after.
class CurrentDevice {
 public:
  template <class... Where>
  explicit CurrentDevice(int device, Where&&... where) : device_(device) {
    cuda_check(cudaGetDevice(&prev_), "cudaGetDevice", where...);
    if (prev_ != device_) cuda_check(cudaSetDevice(device_), "cudaSetDevice", std::forward<Where>(where)...);
  }
  ~CurrentDevice() {
    if (prev_ != device_ && prev_ >= 0) cudaSetDevice(prev_);
  }
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;

 private:
  int device_;
  int prev_ = -1;
};

// The unique id as store text: hex, since a store value is read back as a string.
inline std::string nccl_unique_id_to_hex(const ncclUniqueId& id) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string text;
  for (char c : id.internal) {
    const auto b = static_cast<unsigned char>(c);
    text += digits[b >> 4];
    text += digits[b & 15];
  }
  return text;
}

inline ncclUniqueId nccl_unique_id_from_hex(std::string_view text, std::string_view key) {
  ncclUniqueId id;
  constexpr std::size_t bytes = sizeof id.internal;
  if (text.size() != 2 * bytes)
    fail("NcclComm: store key '", key, "' holds ", text.size(), " characters, not the ", 2 * bytes,
         " hex digits of an ncclUniqueId (is the key used by something else?)");
  auto nibble = [&](char c) -> unsigned {
    if (c >= '0' && c <= '9') return static_cast<unsigned>(c - '0');
    if (c >= 'a' && c <= 'f') return static_cast<unsigned>(c - 'a' + 10);
    fail("NcclComm: store key '", key, "' holds '", c, "', not a lowercase hex digit of an ncclUniqueId");
  };
  for (std::size_t i = 0; i < bytes; ++i)
    id.internal[i] = static_cast<char>(nibble(text[2 * i]) << 4 | nibble(text[2 * i + 1]));
  return id;
}

// A nonblocking communicator (blocking = 0): calls return at once, and a stalled peer is
// seen by polling, never by a thread stuck inside NCCL.
inline ncclConfig_t nccl_nonblocking_config(const char* name) {
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.commName = name;
  return config;
}

}  // namespace detail
}  // namespace fsdp
