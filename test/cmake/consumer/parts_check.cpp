// Each part of the fsdp CMake package that this build links, used once: its headers are
// found through the target alone, and its libraries link and load. Prints one line per part
// and "parts_check: ok" at the end; exits non-zero on a wrong answer.
#include <cstdio>
#include <cstdlib>
#include <string>

#include <fsdp/core/dtype.hpp>

#if FSDP_CONSUMER_CHECKPOINT
#include <fsdp/checkpoint/checksum.hpp>  // xxHash (header-only)
#include <nlohmann/json.hpp>
#endif
#if FSDP_CONSUMER_ASIO
#include <fsdp/asio/endpoint.hpp>  // Boost.Asio
#endif
#if FSDP_CONSUMER_MPI
#include <fsdp/mpi/mpi_types.hpp>  // <mpi.h>, libmpi
#endif
#if FSDP_CONSUMER_CUDA
#include <fsdp/cuda/cuda_check.hpp>    // <cuda_runtime.h>, libcudart
#include <fsdp/cuda/cuda_kernels.hpp>  // <nvrtc.h>, libnvrtc
#endif
#if FSDP_CONSUMER_NCCL
#include <fsdp/nccl/nccl_types.hpp>  // <nccl.h>, libnccl
#endif

namespace {
int failures = 0;
void expect(bool ok, const char* what) {
  std::printf("%s: %s\n", what, ok ? "ok" : "WRONG");
  if (!ok) ++failures;
}
}  // namespace

int main() {
  expect(fsdp::size_of(fsdp::DType::bf16) == 2, "fsdp::fsdp");
#if FSDP_CONSUMER_CHECKPOINT
  fsdp::checkpoint::Xxh64 h;
  h.update("abc", 3);
  const bool json_ok = nlohmann::json::parse(R"({"a": 1})").at("a") == 1;
  expect(h.digest() == 0x44bc2cf5ad770999ULL && json_ok, "fsdp::checkpoint (XXH64 of \"abc\", nlohmann::json)");
#endif
#if FSDP_CONSUMER_ASIO
  const auto endpoint = fsdp::detail::parse_endpoint("127.0.0.1:29500");
  expect(endpoint && endpoint->port() == 29500, "fsdp::asio (parse_endpoint)");
#endif
#if FSDP_CONSUMER_MPI
  char version[MPI_MAX_LIBRARY_VERSION_STRING];
  int length = 0;
  expect(MPI_Get_library_version(version, &length) == MPI_SUCCESS && length > 0, "fsdp::mpi (MPI_Get_library_version)");
#endif
#if FSDP_CONSUMER_CUDA
  int runtime = 0;
  expect(cudaRuntimeGetVersion(&runtime) == cudaSuccess && runtime > 0 &&
             fsdp::detail::nvrtc_version_text().rfind("nvrtc ", 0) == 0 &&
             fsdp::detail::cuda_error_kind(cudaErrorMemoryAllocation) == fsdp::ErrorKind::out_of_memory,
         "fsdp::cuda (cudaRuntimeGetVersion, nvrtcVersion)");
#endif
#if FSDP_CONSUMER_NCCL
  int nccl = 0;
  expect(ncclGetVersion(&nccl) == ncclSuccess && nccl > 0 && fsdp::detail::nccl_dtype(fsdp::DType::f32) == ncclFloat32,
         "fsdp::nccl (ncclGetVersion)");
#endif
  if (failures) return EXIT_FAILURE;
  std::printf("parts_check: ok\n");
  return EXIT_SUCCESS;
}
