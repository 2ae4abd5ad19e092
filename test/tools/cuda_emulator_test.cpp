// The emulated CUDA runtime (tools/cuda_emulator) itself: that it finds the stream-order
// races and invalid memory uses it promises to find, and nothing where the order is right;
// that its kernels compute what a GPU would for the grid they are given; that injected
// failures reach the library as errors; that calls are counted per thread; that a host
// function or an NCCL collective holds its stream (queries say not ready, work behind it is
// deferred and runs in order, synchronizations wait); that the emulated NCCL moves the
// right bytes between communicators, hangs on mismatched calls as NCCL may, and drains
// on abort.
#include <doctest/doctest.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/cuda/cuda_device.hpp"
#include "fsdp/cuda/cuda_kernels.hpp"
#include "test/support/errors.hpp"
#include "tools/cuda_emulator/emulator.hpp"

namespace {

using test_support::contains;

bool any_contains(const std::vector<std::string>& v, const std::string& part) {
  return std::ranges::any_of(v, [&](const std::string& s) { return contains(s, part); });
}

struct Streams {
  cudaStream_t a = nullptr, b = nullptr;
  cudaEvent_t e = nullptr;
  Streams() {
    REQUIRE(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking) == cudaSuccess);
    REQUIRE(cudaEventCreateWithFlags(&e, cudaEventDisableTiming) == cudaSuccess);
  }
  ~Streams() {
    cudaStreamSynchronize(a), cudaStreamSynchronize(b);
    cudaEventDestroy(e), cudaStreamDestroy(a), cudaStreamDestroy(b);
  }
};

}  // namespace

TEST_CASE("a read on another stream with nothing ordering it after the write is a race; an event wait orders it") {
  (void)cuda_emulator::take_violations();
  Streams s;
  std::vector<char> host(64);
  for (bool wait : {false, true}) {
    CAPTURE(wait);
    void* p = nullptr;
    REQUIRE(cudaMallocAsync(&p, 64, s.a) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(p, 1, 64, s.a) == cudaSuccess);
    if (wait) {
      REQUIRE(cudaEventRecord(s.e, s.a) == cudaSuccess);
      REQUIRE(cudaStreamWaitEvent(s.b, s.e, 0) == cudaSuccess);
    }
    REQUIRE(cudaMemcpyAsync(host.data(), p, 64, cudaMemcpyDeviceToHost, s.b) == cudaSuccess);
    CHECK(host[63] == 1);  // eager: the bytes are right either way
    const auto found = cuda_emulator::take_violations();
    CHECK(found.empty() == wait);
    if (!wait) {
      CHECK(any_contains(found, "reads bytes [0, 64) of the 64-byte device allocation"));
      CHECK(any_contains(found, "which cudaMemsetAsync on stream #"));
      CHECK(any_contains(found, "before its cudaMallocAsync on stream #"));  // the allocation too
    }
    REQUIRE(cudaStreamSynchronize(s.b) == cudaSuccess);
    REQUIRE(cudaFreeAsync(p, s.a) == cudaSuccess);
    (void)cuda_emulator::take_violations();
  }
}

TEST_CASE("a host synchronization orders what follows it on every stream") {
  (void)cuda_emulator::take_violations();
  Streams s;
  void* p = nullptr;
  REQUIRE(cudaMallocAsync(&p, 16, s.a) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(p, 0, 16, s.a) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s.a) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(p, 2, 16, s.b) == cudaSuccess);  // after the host saw stream a done
  REQUIRE(cudaStreamSynchronize(s.b) == cudaSuccess);
  REQUIRE(cudaFreeAsync(p, s.a) == cudaSuccess);
  CHECK(cuda_emulator::take_violations().empty());
}

// A destroyed stream's queued work still runs: cudaDeviceSynchronize waits for it, and
// what follows is ordered after it; without the synchronization a free races with it.
TEST_CASE("cudaDeviceSynchronize waits for the work of a stream destroyed since") {
  for (bool sync : {false, true}) {
    CAPTURE(sync);
    (void)cuda_emulator::take_violations();
    cudaStream_t a = nullptr;
    REQUIRE(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking) == cudaSuccess);
    void* p = nullptr;
    REQUIRE(cudaMalloc(&p, 16) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(p, 1, 16, a) == cudaSuccess);
    REQUIRE(cudaStreamDestroy(a) == cudaSuccess);
    if (sync) REQUIRE(cudaDeviceSynchronize() == cudaSuccess);
    REQUIRE(cudaFree(p) == cudaSuccess);
    const auto found = cuda_emulator::take_violations();
    CHECK(found.empty() == sync);
    if (!sync) CHECK(any_contains(found, "cudaFree"));
  }
}

TEST_CASE("a stream-ordered free must come after every stream's use of the memory") {
  (void)cuda_emulator::take_violations();
  Streams s;
  void* p = nullptr;
  REQUIRE(cudaMallocAsync(&p, 32, s.a) == cudaSuccess);
  REQUIRE(cudaEventRecord(s.e, s.a) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(s.b, s.e, 0) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(p, 0, 32, s.b) == cudaSuccess);
  REQUIRE(cudaFreeAsync(p, s.a) == cudaSuccess);  // stream a never waited for b's memset
  const auto found = cuda_emulator::take_violations();
  CHECK(any_contains(found, "cudaFreeAsync on stream #"));
  CHECK(any_contains(found, "while cudaMemsetAsync on stream #"));
}

TEST_CASE("use after free, past the end, and pageable memory in a kernel are refused and reported") {
  (void)cuda_emulator::take_violations();
  Streams s;
  void* p = nullptr;
  REQUIRE(cudaMallocAsync(&p, 32, s.a) == cudaSuccess);
  CHECK(cudaMemsetAsync(p, 0, 33, s.a) == cudaErrorInvalidValue);
  CHECK(contains(cudaGetErrorString(cudaErrorInvalidValue), "past its end"));
  (void)cudaGetLastError();
  REQUIRE(cudaFreeAsync(p, s.a) == cudaSuccess);
  std::vector<char> host(32);
  CHECK(cudaMemcpyAsync(host.data(), p, 32, cudaMemcpyDefault, s.a) == cudaErrorInvalidValue);
  CHECK(contains(cudaGetErrorString(cudaErrorInvalidValue), "already freed"));
  CHECK(cudaGetLastError() == cudaErrorInvalidValue);
  CHECK(cudaGetLastError() == cudaSuccess);  // cleared
  // A kernel on pageable host memory (a GPU would fault), through CudaDevice: an fsdp::Error.
  fsdp::CudaDevice d(0);
  std::vector<float> pageable(8, 1.0f);
  CHECK_THROWS_WITH_AS(d.scale(pageable.data(), 8, fsdp::DType::f32, 2.0),
                       doctest::Contains("fsdp_scale writes"), fsdp::Error);
  CHECK(pageable[0] == 1.0f);  // not run
  const auto found = cuda_emulator::take_violations();
  CHECK(found.size() == 3);
  CHECK(any_contains(found, "which is not device memory"));
}

TEST_CASE("the kernels cover what their grid covers: a fused launch with no zeroing blocks zeroes nothing") {
  const auto image = fsdp::detail::compile_cuda_kernels(9, 0);
  cudaLibrary_t lib = nullptr;
  REQUIRE(cudaLibraryLoadData(&lib, image.code.data(), nullptr, nullptr, 0, nullptr, nullptr, 0) == cudaSuccess);
  cudaKernel_t cast_zero = nullptr, missing = nullptr;
  REQUIRE(cudaLibraryGetKernel(&cast_zero, lib, "fsdp_cast_zero") == cudaSuccess);
  CHECK(cudaLibraryGetKernel(&missing, lib, "fsdp_not_a_kernel") == cudaErrorSymbolNotFound);
  (void)cudaGetLastError();
  Streams s;
  constexpr unsigned long long n = 1000;  // 4 blocks of 256 elements, cast by one block looping
  void *src = nullptr, *dst = nullptr, *zeroed = nullptr;
  REQUIRE(cudaMallocAsync(&src, n * 4, s.a) == cudaSuccess);
  REQUIRE(cudaMallocAsync(&dst, n * 2, s.a) == cudaSuccess);
  REQUIRE(cudaMallocAsync(&zeroed, 100, s.a) == cudaSuccess);
  std::vector<float> ones(n, 1.0f);
  REQUIRE(cudaMemcpyAsync(src, ones.data(), n * 4, cudaMemcpyHostToDevice, s.a) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(dst, 0, n * 2, s.a) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(zeroed, 7, 100, s.a) == cudaSuccess);
  fsdp::detail::ZeroSpans table;
  const fsdp::ZeroSpan spans[] = {{zeroed, 100}};
  REQUIRE(fsdp::detail::fill_zero_spans_table(spans, table) == 1);
  int to = static_cast<int>(fsdp::DType::bf16), from = static_cast<int>(fsdp::DType::f32);
  unsigned long long count = n;
  for (unsigned zero_blocks : {0u, 1u}) {
    CAPTURE(zero_blocks);
    unsigned cast_grid = 1;
    void* args[] = {&dst, &to, &src, &from, &count, &cast_grid, &table};
    REQUIRE(cudaLaunchKernel(reinterpret_cast<const void*>(cast_zero), dim3(cast_grid + zero_blocks), dim3(256), args, 0,
                             s.a) == cudaSuccess);
    std::vector<unsigned short> out(n);
    std::vector<unsigned char> z(100);
    REQUIRE(cudaMemcpyAsync(out.data(), dst, n * 2, cudaMemcpyDeviceToHost, s.a) == cudaSuccess);
    REQUIRE(cudaMemcpyAsync(z.data(), zeroed, 100, cudaMemcpyDeviceToHost, s.a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s.a) == cudaSuccess);
    CHECK(out[0] == 0x3f80);  // bf16 1.0
    CHECK(out[n - 1] == 0x3f80);
    CHECK(z[99] == (zero_blocks ? 0 : 7));
  }
  for (void* p : {src, dst, zeroed}) REQUIRE(cudaFreeAsync(p, s.a) == cudaSuccess);
  CHECK(cudaLibraryUnload(lib) == cudaSuccess);
  CHECK(cuda_emulator::take_violations().empty());
}

TEST_CASE("an injected failure reaches the library as an fsdp::Error naming the device and the call") {
  fsdp::CudaDevice d(0);
  cuda_emulator::fail_next("cudaMallocAsync", cudaErrorMemoryAllocation);
  CHECK_THROWS_WITH_AS(d.allocate(4096), doctest::Contains("CudaDevice(cuda:0): cudaMallocAsync(4096 bytes) failed"),
                       fsdp::Error);
  void* p = d.allocate(4096);  // once only
  CHECK(p != nullptr);
  d.deallocate(p, 4096);
  d.synchronize();
  CHECK(cuda_emulator::live_device_bytes() == 0);
}

TEST_CASE("calls are counted for the thread that makes them") {
  cuda_emulator::reset_this_thread_calls();
  int n = 0;
  REQUIRE(cudaGetDeviceCount(&n) == cudaSuccess);
  std::thread([] {
    int d = 0;
    (void)cudaGetDevice(&d);
    CHECK(cuda_emulator::this_thread_calls().of(cuda_emulator::Call::cudaGetDevice) == 1);
  }).join();
  const auto& here = cuda_emulator::this_thread_calls();
  CHECK(here.of(cuda_emulator::Call::cudaGetDeviceCount) == 1);
  CHECK(here.of(cuda_emulator::Call::cudaGetDevice) == 0);
  CHECK(here.total() == 1);
  CHECK(here.summary() == "cudaGetDeviceCount=1");
}

TEST_CASE("a host function holds its stream: queries are not ready, work behind it runs after it, in order") {
  Streams st;
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, 8) == cudaSuccess);
  REQUIRE(cudaMemset(p, 0, 8) == cudaSuccess);
  static std::atomic<bool> release{false};
  release = false;
  REQUIRE(cudaLaunchHostFunc(st.a, [](void*) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(20);
    while (!release && std::chrono::steady_clock::now() < until) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }, nullptr) == cudaSuccess);
  const unsigned char ones[8] = {1, 1, 1, 1, 1, 1, 1, 1};
  REQUIRE(cudaMemcpyAsync(p, ones, 8, cudaMemcpyHostToDevice, st.a) == cudaSuccess);  // staged now, written later
  REQUIRE(cudaMemsetAsync(p, 7, 4, st.a) == cudaSuccess);                            // after the copy
  REQUIRE(cudaEventRecord(st.e, st.a) == cudaSuccess);
  CHECK(static_cast<const unsigned char*>(p)[0] == 0);  // nothing ran yet
  CHECK(cudaStreamQuery(st.a) == cudaErrorNotReady);
  CHECK(cudaEventQuery(st.e) == cudaErrorNotReady);
  REQUIRE(cudaStreamWaitEvent(st.b, st.e, 0) == cudaSuccess);
  CHECK(cudaStreamQuery(st.b) == cudaErrorNotReady);  // ordered behind it too
  release = true;
  REQUIRE(cudaStreamSynchronize(st.b) == cudaSuccess);  // waits for the function, then the deferred work
  CHECK(cudaEventQuery(st.e) == cudaSuccess);
  unsigned char got[8];
  std::memcpy(got, p, 8);
  const unsigned char want[8] = {7, 7, 7, 7, 1, 1, 1, 1};
  CHECK(std::memcmp(got, want, 8) == 0);
  REQUIRE(cudaFree(p) == cudaSuccess);
  CHECK(cuda_emulator::take_violations().empty());
}

namespace {

// Two ranks in this process, one per emulated GPU, through ncclCommInitRankConfig in a group.
struct TwoRanks {
  ncclComm_t comm[2] = {nullptr, nullptr};
  cudaStream_t stream[2] = {nullptr, nullptr};
  std::string dir;  // where the ranks meet (the unique id names it)
  TwoRanks() {
    cuda_emulator::set_device_count(2);
    ncclUniqueId id;
    REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
    const std::string text(id.internal);
    REQUIRE(text.rfind("fsdp-nccl-emulator:", 0) == 0);
    dir = text.substr(text.find(':') + 1);
    REQUIRE(ncclGroupStart() == ncclSuccess);
    for (int r = 0; r < 2; ++r) {
      REQUIRE(cudaSetDevice(r) == cudaSuccess);
      REQUIRE(ncclCommInitRankConfig(&comm[r], 2, id, r, nullptr) == ncclSuccess);
    }
    REQUIRE(ncclGroupEnd() == ncclSuccess);
    for (int r = 0; r < 2; ++r) {
      REQUIRE(cudaSetDevice(r) == cudaSuccess);
      REQUIRE(cudaStreamCreateWithFlags(&stream[r], cudaStreamNonBlocking) == cudaSuccess);
    }
    REQUIRE(cudaSetDevice(0) == cudaSuccess);
  }
  ~TwoRanks() {
    for (int r = 0; r < 2; ++r) {
      cudaSetDevice(r);
      ncclCommDestroy(comm[r]);
      cudaStreamDestroy(stream[r]);
    }
    cudaSetDevice(0);
    cuda_emulator::set_device_count(1);
  }
  float* buffer(int r, std::initializer_list<float> v) {
    void* p = nullptr;
    cudaSetDevice(r);
    REQUIRE(cudaMalloc(&p, 64) == cudaSuccess);
    std::vector<float> host(16, 0.0f);
    std::copy(v.begin(), v.end(), host.begin());
    REQUIRE(cudaMemcpy(p, host.data(), 64, cudaMemcpyHostToDevice) == cudaSuccess);
    return static_cast<float*>(p);
  }
};

}  // namespace

TEST_CASE("emulated NCCL: a collective completes once every rank has queued it, and moves the right bytes") {
  TwoRanks two;
  float* in[2] = {two.buffer(0, {1, 2, 3, 4}), two.buffer(1, {10, 20, 30, 40})};
  float* out[2] = {two.buffer(0, {}), two.buffer(1, {})};
  cudaSetDevice(0);
  REQUIRE(ncclAllReduce(in[0], out[0], 4, ncclFloat32, ncclSum, two.comm[0], two.stream[0]) == ncclSuccess);
  CHECK(cudaStreamQuery(two.stream[0]) == cudaErrorNotReady);  // rank 1 has not called yet
  cudaSetDevice(1);
  REQUIRE(ncclAllReduce(in[1], out[1], 4, ncclFloat32, ncclSum, two.comm[1], two.stream[1]) == ncclSuccess);
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(cudaStreamSynchronize(two.stream[r]) == cudaSuccess);
    CHECK(std::vector<float>(out[r], out[r] + 4) == std::vector<float>{11, 22, 33, 44});
  }
  // reduce-scatter: rank r gets elements [2r, 2r + 2) of the sum; all-gather: both halves.
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(ncclReduceScatter(in[r], out[r], 2, ncclFloat32, ncclMax, two.comm[r], two.stream[r]) == ncclSuccess);
    REQUIRE(ncclAllGather(out[r], in[r], 2, ncclFloat32, two.comm[r], two.stream[r]) == ncclSuccess);
  }
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(cudaStreamSynchronize(two.stream[r]) == cudaSuccess);
    CHECK(std::vector<float>(in[r], in[r] + 4) == std::vector<float>{10, 20, 30, 40});
  }
  // A long run keeps only what is in flight on disk: each rank's part goes once both ranks
  // have read it.
  for (int i = 0; i < 50; ++i) {
    for (int r = 0; r < 2; ++r) {
      cudaSetDevice(r);
      REQUIRE(ncclAllReduce(in[r], in[r], 4, ncclFloat32, ncclMax, two.comm[r], two.stream[r]) == ncclSuccess);
    }
    for (int r = 0; r < 2; ++r) {
      cudaSetDevice(r);
      REQUIRE(cudaStreamSynchronize(two.stream[r]) == cudaSuccess);
    }
  }
  int parts = 0;
  for (const auto& f : std::filesystem::directory_iterator(two.dir)) parts += f.path().filename().string()[0] == 'c';
  CHECK(parts <= 4);
  for (int r = 0; r < 2; ++r) cudaSetDevice(r), cudaFree(in[r]), cudaFree(out[r]);
  cudaSetDevice(0);
  CHECK(cuda_emulator::take_violations().empty());
}

TEST_CASE("emulated NCCL: fail_next fails the named call once, as ncclSystemError in the emulator's words") {
  TwoRanks two;
  float* in[2] = {two.buffer(0, {1, 2}), two.buffer(1, {3, 4})};
  cuda_emulator::fail_next("ncclAllReduce", cudaErrorUnknown);
  cudaSetDevice(0);
  CHECK(ncclAllReduce(in[0], in[0], 2, ncclFloat32, ncclSum, two.comm[0], two.stream[0]) == ncclSystemError);
  CHECK(contains(ncclGetLastError(two.comm[0]), "(NCCL emulator) ncclAllReduce: injected by cuda_emulator::fail_next"));
  CHECK(cudaStreamQuery(two.stream[0]) == cudaSuccess);  // nothing was queued
  for (int r = 0; r < 2; ++r) {  // once only: the collective both ranks now call completes
    cudaSetDevice(r);
    REQUIRE(ncclAllReduce(in[r], in[r], 2, ncclFloat32, ncclSum, two.comm[r], two.stream[r]) == ncclSuccess);
  }
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    REQUIRE(cudaStreamSynchronize(two.stream[r]) == cudaSuccess);
    CHECK((in[r][0] == 4.0f && in[r][1] == 6.0f));
  }
  cuda_emulator::fail_next("ncclCommSplit", cudaErrorUnknown);
  ncclComm_t part = nullptr;
  cudaSetDevice(0);
  CHECK(ncclCommSplit(two.comm[0], 0, 0, &part, nullptr) == ncclSystemError);
  CHECK(part == nullptr);
  CHECK(contains(ncclGetLastError(two.comm[0]), "ncclCommSplit: injected by cuda_emulator::fail_next"));
  for (int r = 0; r < 2; ++r) cudaSetDevice(r), cudaFree(in[r]);
  cudaSetDevice(0);
  CHECK(cuda_emulator::take_violations().empty());
}

TEST_CASE("emulated NCCL: a nonblocking split writes its communicator once complete, as NCCL 2.28 does") {
  cuda_emulator::set_device_count(1);
  ncclUniqueId id;
  REQUIRE(ncclGetUniqueId(&id) == ncclSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  ncclComm_t comm = nullptr;
  const ncclResult_t init = ncclCommInitRankConfig(&comm, 1, id, 0, &config);
  CHECK((init == ncclSuccess || init == ncclInProgress));
  REQUIRE(comm != nullptr);  // a created communicator is there at once, to be polled
  ncclResult_t state = ncclInProgress;
  for (int i = 0; i < 1000 && state == ncclInProgress; ++i) REQUIRE(ncclCommGetAsyncError(comm, &state) == ncclSuccess);
  REQUIRE(state == ncclSuccess);
  ncclComm_t part = reinterpret_cast<ncclComm_t>(&state);  // NCCL clears it first
  CHECK(ncclCommSplit(comm, 0, 0, &part, &config) == ncclInProgress);
  CHECK(part == nullptr);  // even for one rank: the parent says when the split is done
  REQUIRE(ncclCommGetAsyncError(comm, &state) == ncclSuccess);
  CHECK(state == ncclSuccess);
  REQUIRE(part != nullptr);
  int size = 0;
  CHECK(ncclCommCount(part, &size) == ncclSuccess);
  CHECK(size == 1);
  CHECK(ncclCommDestroy(part) == ncclSuccess);
  CHECK(ncclCommDestroy(comm) == ncclSuccess);
  // Two ranks: rank 0's split stays pending while rank 1 has not split; then the parent is
  // aborted with it pending (leave() drops it: ASan sees no leak, nothing writes `late`).
  cuda_emulator::set_device_count(2);
  ncclUniqueId id2;
  REQUIRE(ncclGetUniqueId(&id2) == ncclSuccess);
  ncclComm_t two[2] = {nullptr, nullptr};
  for (int r = 0; r < 2; ++r) {
    REQUIRE(cudaSetDevice(r) == cudaSuccess);
    const ncclResult_t made = ncclCommInitRankConfig(&two[r], 2, id2, r, &config);
    CHECK((made == ncclSuccess || made == ncclInProgress));
  }
  for (int r = 0; r < 2; ++r) {
    state = ncclInProgress;
    for (int i = 0; i < 1000 && state == ncclInProgress; ++i) REQUIRE(ncclCommGetAsyncError(two[r], &state) == ncclSuccess);
    REQUIRE(state == ncclSuccess);
  }
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  ncclComm_t late = nullptr;
  CHECK(ncclCommSplit(two[0], 0, 0, &late, &config) == ncclInProgress);
  REQUIRE(ncclCommGetAsyncError(two[0], &state) == ncclSuccess);
  CHECK(state == ncclInProgress);  // rank 1 has not said its color
  CHECK(late == nullptr);
  REQUIRE(ncclCommAbort(two[0]) == ncclSuccess);
  REQUIRE(cudaSetDevice(1) == cudaSuccess);
  CHECK(ncclCommAbort(two[1]) == ncclSuccess);
  REQUIRE(cudaSetDevice(0) == cudaSuccess);
  cuda_emulator::set_device_count(1);
  CHECK(cuda_emulator::take_violations().empty());
}

TEST_CASE("emulated NCCL: calls that differ between ranks never complete (as on NCCL); an abort drains the stream") {
  TwoRanks two;
  float* a = two.buffer(0, {1});
  float* b = two.buffer(1, {2});
  cudaSetDevice(0);
  REQUIRE(ncclAllReduce(a, a, 1, ncclFloat32, ncclSum, two.comm[0], two.stream[0]) == ncclSuccess);
  cudaSetDevice(1);
  REQUIRE(ncclAllReduce(b, b, 2, ncclFloat32, ncclSum, two.comm[1], two.stream[1]) == ncclSuccess);  // other count
  cudaSetDevice(0);
  for (int i = 0; i < 20; ++i) CHECK(cudaStreamQuery(two.stream[0]) == cudaErrorNotReady);
  ncclResult_t state = ncclInProgress;
  REQUIRE(ncclCommGetAsyncError(two.comm[0], &state) == ncclSuccess);
  CHECK(state == ncclSuccess);  // NCCL itself reports nothing: the library's watchdog must notice
  cuda_emulator::nccl_fail_async(ncclRemoteError, "peer went away");
  REQUIRE(ncclCommGetAsyncError(two.comm[0], &state) == ncclSuccess);
  CHECK(state == ncclRemoteError);
  CHECK(contains(ncclGetLastError(two.comm[0]), "peer went away"));
  REQUIRE(ncclCommAbort(two.comm[0]) == ncclSuccess);
  two.comm[0] = nullptr;
  CHECK(cudaStreamQuery(two.stream[0]) == cudaSuccess);  // the aborted collective ended
  CHECK(a[0] == 1.0f);                                   // without writing its result
  cudaSetDevice(1);
  REQUIRE(ncclCommAbort(two.comm[1]) == ncclSuccess);
  two.comm[1] = nullptr;
  CHECK(cudaStreamSynchronize(two.stream[1]) == cudaSuccess);
  cudaSetDevice(0), cudaFree(a);
  cudaSetDevice(1), cudaFree(b);
  cudaSetDevice(0);
  CHECK(cuda_emulator::take_violations().empty());
}

// ---- stream capture and graphs (tools/cuda_emulator/capture.hpp) ----

namespace {

std::vector<unsigned char> bytes_at(const void* p, std::size_t n) {
  const auto* b = static_cast<const unsigned char*>(p);
  return {b, b + n};
}

// Two streams, the event `e` to fork from a to b, `back` to join b back into a, and two
// 16-byte device buffers.
struct ForkJoin : Streams {
  cudaEvent_t back = nullptr;
  void *x = nullptr, *y = nullptr;
  ForkJoin() {
    (void)cuda_emulator::take_violations();
    REQUIRE(cudaEventCreateWithFlags(&back, cudaEventDisableTiming) == cudaSuccess);
    REQUIRE(cudaMalloc(&x, 16) == cudaSuccess);
    REQUIRE(cudaMalloc(&y, 16) == cudaSuccess);
  }
  ~ForkJoin() {
    cudaStreamSynchronize(a), cudaStreamSynchronize(b);
    cudaFree(x), cudaFree(y), cudaEventDestroy(back);
    (void)cudaGetLastError();
  }
};

}  // namespace

TEST_CASE("stream capture: queued work is recorded, not run; each launch of the graph replays it in stream order") {
  (void)cuda_emulator::take_violations();
  Streams s;
  void *src = nullptr, *dst = nullptr;
  REQUIRE(cudaMalloc(&src, 16) == cudaSuccess);
  REQUIRE(cudaMalloc(&dst, 16) == cudaSuccess);
  REQUIRE(cudaMemset(src, 1, 16) == cudaSuccess);
  REQUIRE(cudaMemset(dst, 0, 16) == cudaSuccess);
  static std::atomic<int> ran{0};
  ran = 0;
  REQUIRE(cudaStreamBeginCapture(s.a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  REQUIRE(cudaStreamIsCapturing(s.a, &status) == cudaSuccess);
  CHECK(status == cudaStreamCaptureStatusActive);
  REQUIRE(cudaMemcpyAsync(dst, src, 16, cudaMemcpyDeviceToDevice, s.a) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(dst, 9, 4, s.a) == cudaSuccess);
  REQUIRE(cudaLaunchHostFunc(s.a, [](void*) { ++ran; }, nullptr) == cudaSuccess);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(s.a, &graph) == cudaSuccess);
  REQUIRE(graph != nullptr);
  REQUIRE(cudaStreamIsCapturing(s.a, &status) == cudaSuccess);
  CHECK(status == cudaStreamCaptureStatusNone);
  CHECK(bytes_at(dst, 16) == std::vector<unsigned char>(16, 0));  // nothing ran
  CHECK(ran == 0);
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  for (int launch = 1; launch <= 2; ++launch) {
    CAPTURE(launch);
    REQUIRE(cudaMemsetAsync(src, launch + 1, 16, s.a) == cudaSuccess);  // queued before the launch: the replay reads it
    cuda_emulator::reset_this_thread_calls();
    REQUIRE(cudaGraphLaunch(exec, s.a) == cudaSuccess);
    CHECK(cuda_emulator::this_thread_calls().summary() == "cudaGraphLaunch=1");  // the replay's calls are not the caller's
    REQUIRE(cudaStreamSynchronize(s.a) == cudaSuccess);
    std::vector<unsigned char> want(16, static_cast<unsigned char>(launch + 1));
    std::fill_n(want.begin(), 4, 9);
    CHECK(bytes_at(dst, 16) == want);
    CHECK(ran == launch);
  }
  REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  CHECK(cudaGraphLaunch(exec, s.a) == cudaErrorInvalidResourceHandle);
  REQUIRE(cudaFree(src) == cudaSuccess);
  REQUIRE(cudaFree(dst) == cudaSuccess);
  CHECK(cuda_emulator::take_violations().empty());
}

TEST_CASE("stream capture: a call the capture prohibits fails and invalidates it, as on a GPU") {
  Streams s;
  void* p = nullptr;
  REQUIRE(cudaMalloc(&p, 16) == cudaSuccess);
  // Runs `prohibited` during a capture of s.a begun in `mode`; returns what it returned and
  // checks that the capture is invalidated from then on.
  auto during_capture = [&](cudaStreamCaptureMode mode, auto&& prohibited, bool invalidates = true) {
    REQUIRE(cudaStreamBeginCapture(s.a, mode) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(p, 1, 16, s.a) == cudaSuccess);
    const cudaError_t got = prohibited();
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    REQUIRE(cudaStreamIsCapturing(s.a, &status) == cudaSuccess);
    CHECK(status == (invalidates ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive));
    CHECK(cudaMemsetAsync(p, 2, 16, s.a) == (invalidates ? cudaErrorStreamCaptureInvalidated : cudaSuccess));
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(s.a, &graph);
    CHECK(ended == (invalidates ? cudaErrorStreamCaptureInvalidated : cudaSuccess));
    CHECK((graph == nullptr) == invalidates);
    if (graph) cudaGraphDestroy(graph);
    (void)cudaGetLastError();
    return got;
  };
  SUBCASE("synchronizing or querying the capturing stream") {
    CHECK(during_capture(cudaStreamCaptureModeGlobal, [&] {
            const cudaError_t e = cudaStreamSynchronize(s.a);
            CHECK(contains(cudaGetErrorString(e), "cudaErrorStreamCaptureUnsupported (CUDA runtime emulator): "
                                                  "cudaStreamSynchronize of stream #"));
            return e;
          }) == cudaErrorStreamCaptureUnsupported);
    CHECK(during_capture(cudaStreamCaptureModeRelaxed, [&] { return cudaStreamQuery(s.a); }) ==
          cudaErrorStreamCaptureUnsupported);  // relaxed or not
  }
  SUBCASE("cudaMalloc on the capturing thread: refused unless the capture is relaxed") {
    void* q = nullptr;
    CHECK(during_capture(cudaStreamCaptureModeGlobal, [&] { return cudaMalloc(&q, 8); }) == cudaErrorStreamCaptureUnsupported);
    CHECK(during_capture(cudaStreamCaptureModeThreadLocal, [&] { return cudaMalloc(&q, 8); }) ==
          cudaErrorStreamCaptureUnsupported);
    CHECK(during_capture(cudaStreamCaptureModeRelaxed, [&] { return cudaMalloc(&q, 8); }, false) == cudaSuccess);
    CHECK(cudaFree(q) == cudaSuccess);
  }
  SUBCASE("an event query on another thread (a watchdog's) during a global capture, unless that thread is relaxed") {
    REQUIRE(cudaEventRecord(s.e, s.b) == cudaSuccess);  // an eager event of another stream
    auto query_from_thread = [&](cudaStreamCaptureMode thread_mode) {
      cudaError_t got = cudaSuccess;
      std::thread([&] {
        cudaStreamCaptureMode m = thread_mode;
        REQUIRE(cudaThreadExchangeStreamCaptureMode(&m) == cudaSuccess);
        CHECK(m == cudaStreamCaptureModeGlobal);  // every thread starts in the global mode
        got = cudaEventQuery(s.e);
      }).join();
      return got;
    };
    CHECK(during_capture(cudaStreamCaptureModeGlobal, [&] { return query_from_thread(cudaStreamCaptureModeGlobal); }) ==
          cudaErrorStreamCaptureUnsupported);
    CHECK(during_capture(cudaStreamCaptureModeGlobal, [&] { return query_from_thread(cudaStreamCaptureModeRelaxed); },
                         false) == cudaSuccess);
    CHECK(during_capture(cudaStreamCaptureModeThreadLocal, [&] { return query_from_thread(cudaStreamCaptureModeGlobal); },
                         false) == cudaSuccess);  // a thread-local capture ignores other threads
  }
  SUBCASE("a query of an event recorded in the capture") {
    CHECK(during_capture(cudaStreamCaptureModeRelaxed, [&] {
            REQUIRE(cudaEventRecord(s.e, s.a) == cudaSuccess);
            return cudaEventQuery(s.e);
          }) == cudaErrorCapturedEvent);
    REQUIRE(cudaEventRecord(s.e, s.b) == cudaSuccess);  // an eager record makes it a stream's point again
    CHECK(cudaEventQuery(s.e) == cudaSuccess);
  }
  SUBCASE("a copy of pageable host memory") {
    std::vector<char> pageable(16);
    CHECK(during_capture(cudaStreamCaptureModeGlobal, [&] {
            return cudaMemcpyAsync(p, pageable.data(), 16, cudaMemcpyHostToDevice, s.a);
          }) == cudaErrorStreamCaptureUnsupported);
  }
  SUBCASE("a wait on an event recorded outside the capture") {
    REQUIRE(cudaEventRecord(s.e, s.b) == cudaSuccess);
    CHECK(during_capture(cudaStreamCaptureModeGlobal, [&] { return cudaStreamWaitEvent(s.a, s.e, 0); }) ==
          cudaErrorStreamCaptureIsolation);
  }
  REQUIRE(cudaFree(p) == cudaSuccess);
  (void)cuda_emulator::take_violations();
}

TEST_CASE("stream capture: a stream joins through an event it waits on, and must be joined back before the end") {
  ForkJoin s;
  void *x = s.x, *y = s.y;
  cudaEvent_t back = s.back;
  REQUIRE(cudaMemset(x, 0, 16) == cudaSuccess);
  for (bool joined : {false, true}) {
    CAPTURE(joined);
    REQUIRE(cudaStreamBeginCapture(s.a, cudaStreamCaptureModeGlobal) == cudaSuccess);
    REQUIRE(cudaMemsetAsync(x, 3, 16, s.a) == cudaSuccess);
    REQUIRE(cudaEventRecord(s.e, s.a) == cudaSuccess);
    REQUIRE(cudaStreamWaitEvent(s.b, s.e, 0) == cudaSuccess);  // b joins the capture
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    REQUIRE(cudaStreamIsCapturing(s.b, &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusActive);
    REQUIRE(cudaMemcpyAsync(y, x, 16, cudaMemcpyDeviceToDevice, s.b) == cudaSuccess);  // after a's memset
    if (joined) {
      REQUIRE(cudaEventRecord(back, s.b) == cudaSuccess);
      REQUIRE(cudaStreamWaitEvent(s.a, back, 0) == cudaSuccess);
    }
    cudaGraph_t graph = nullptr;
    const cudaError_t ended = cudaStreamEndCapture(s.a, &graph);
    REQUIRE(cudaStreamIsCapturing(s.b, &status) == cudaSuccess);
    CHECK(status == cudaStreamCaptureStatusNone);  // the end ends it for every stream in it
    if (!joined) {
      CHECK(ended == cudaErrorStreamCaptureUnjoined);
      CHECK(contains(cudaGetErrorString(ended), "not joined back"));
      CHECK(graph == nullptr);
      continue;
    }
    REQUIRE(ended == cudaSuccess);
    cudaGraphExec_t exec = nullptr;
    REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, s.a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s.a) == cudaSuccess);  // the launch stream waits for the whole graph
    CHECK(bytes_at(y, 16) == std::vector<unsigned char>(16, 3));
    CHECK(cudaEventQuery(back) == cudaErrorCapturedEvent);  // still the graph's point, not a stream's
    REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
    REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  }
  (void)cudaGetLastError();
  CHECK(cuda_emulator::take_violations().empty());
}

TEST_CASE("stream capture: memory allocated in a capture has one address in every replay and is live only during it") {
  (void)cuda_emulator::take_violations();
  Streams s;
  void* out = nullptr;
  REQUIRE(cudaMalloc(&out, 16) == cudaSuccess);
  const std::size_t live_before = cuda_emulator::live_device_bytes();
  REQUIRE(cudaStreamBeginCapture(s.a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  void* scratch = nullptr;
  REQUIRE(cudaMallocAsync(&scratch, 16, s.a) == cudaSuccess);
  REQUIRE(scratch != nullptr);
  REQUIRE(cudaMemsetAsync(scratch, 5, 16, s.a) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(out, scratch, 16, cudaMemcpyDeviceToDevice, s.a) == cudaSuccess);
  REQUIRE(cudaFreeAsync(scratch, s.a) == cudaSuccess);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(s.a, &graph) == cudaSuccess);
  CHECK(cuda_emulator::live_device_bytes() == live_before);
  CHECK(cudaMemsetAsync(scratch, 0, 16, s.b) == cudaErrorInvalidValue);  // outside a replay it is no memory
  CHECK(!cuda_emulator::take_violations().empty());
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  for (int launch = 0; launch < 2; ++launch) {
    REQUIRE(cudaMemsetAsync(out, 0, 16, s.a) == cudaSuccess);
    REQUIRE(cudaGraphLaunch(exec, s.a) == cudaSuccess);
    REQUIRE(cudaStreamSynchronize(s.a) == cudaSuccess);
    CHECK(bytes_at(out, 16) == std::vector<unsigned char>(16, 5));
    CHECK(cuda_emulator::live_device_bytes() == live_before);
  }
  cudaGraphExec_t second = nullptr;  // CUDA: one executable graph at a time when it has memory nodes
  CHECK(cudaGraphInstantiate(&second, graph, 0) == cudaErrorNotSupported);
  REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
  REQUIRE(cudaGraphInstantiate(&second, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphExecDestroy(second) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  // Memory a capture allocates and does not free is not emulated: refused at the end.
  REQUIRE(cudaStreamBeginCapture(s.a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(cudaMallocAsync(&scratch, 16, s.a) == cudaSuccess);
  const cudaError_t ended = cudaStreamEndCapture(s.a, &graph);
  CHECK(ended == cudaErrorNotSupported);
  CHECK(contains(cudaGetErrorString(ended), "not freed in it"));
  REQUIRE(cudaFree(out) == cudaSuccess);
  (void)cudaGetLastError();
  CHECK(cuda_emulator::take_violations().empty());
}

TEST_CASE("stream capture: launches of one executable graph are ordered, whatever their streams") {
  (void)cuda_emulator::take_violations();
  Streams s;
  void *x = nullptr, *y = nullptr;
  REQUIRE(cudaMalloc(&x, 16) == cudaSuccess);
  REQUIRE(cudaMalloc(&y, 16) == cudaSuccess);
  REQUIRE(cudaStreamBeginCapture(s.a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(x, 4, 16, s.a) == cudaSuccess);
  REQUIRE(cudaMemcpyAsync(y, x, 16, cudaMemcpyDeviceToDevice, s.a) == cudaSuccess);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(s.a, &graph) == cudaSuccess);
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s.a) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s.b) == cudaSuccess);  // writes x and y again: after the first launch, as in CUDA
  REQUIRE(cudaStreamSynchronize(s.b) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s.a) == cudaSuccess);
  CHECK(bytes_at(y, 16) == std::vector<unsigned char>(16, 4));
  CHECK(cuda_emulator::take_violations().empty());
  cudaGraphExecDestroy(exec), cudaGraphDestroy(graph), cudaFree(x), cudaFree(y);
}

TEST_CASE("stream capture: a replay is checked for stream-order races like eager work") {
  ForkJoin s;
  void *x = s.x, *y = s.y;
  cudaEvent_t back = s.back;
  REQUIRE(cudaStreamBeginCapture(s.a, cudaStreamCaptureModeGlobal) == cudaSuccess);
  REQUIRE(cudaEventRecord(s.e, s.a) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(s.b, s.e, 0) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(x, 1, 16, s.a) == cudaSuccess);                            // after the fork on a
  REQUIRE(cudaMemcpyAsync(y, x, 16, cudaMemcpyDeviceToDevice, s.b) == cudaSuccess);  // nothing orders it after
  REQUIRE(cudaEventRecord(back, s.b) == cudaSuccess);
  REQUIRE(cudaStreamWaitEvent(s.a, back, 0) == cudaSuccess);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(s.a, &graph) == cudaSuccess);
  CHECK(cuda_emulator::take_violations().empty());  // nothing ran yet
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s.a) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s.a) == cudaSuccess);
  const auto found = cuda_emulator::take_violations();
  CHECK(any_contains(found, "stream-order race: cudaMemcpyAsync"));
  CHECK(any_contains(found, "which cudaMemsetAsync on stream #"));
  REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
}

TEST_CASE("emulated NCCL: a collective captured on each rank's stream runs at every launch, with the launch's inputs") {
  TwoRanks two;
  float* in[2] = {two.buffer(0, {1, 2}), two.buffer(1, {10, 20})};
  float* out[2] = {two.buffer(0, {}), two.buffer(1, {})};
  cudaGraph_t graph[2] = {nullptr, nullptr};
  cudaGraphExec_t exec[2] = {nullptr, nullptr};
  for (int r = 0; r < 2; ++r) {
    REQUIRE(cudaSetDevice(r) == cudaSuccess);
    REQUIRE(cudaStreamBeginCapture(two.stream[r], cudaStreamCaptureModeGlobal) == cudaSuccess);
    REQUIRE(ncclAllReduce(in[r], out[r], 2, ncclFloat32, ncclSum, two.comm[r], two.stream[r]) == ncclSuccess);
    REQUIRE(cudaStreamEndCapture(two.stream[r], &graph[r]) == cudaSuccess);
    REQUIRE(cudaGraphInstantiate(&exec[r], graph[r], 0) == cudaSuccess);
  }
  CHECK(out[0][0] == 0.0f);  // recorded, not run: no rank waits for the other yet
  for (float scale : {1.0f, 3.0f}) {
    CAPTURE(scale);
    for (int r = 0; r < 2; ++r) {
      REQUIRE(cudaSetDevice(r) == cudaSuccess);
      const float v[2] = {scale * (r ? 10.0f : 1.0f), scale * (r ? 20.0f : 2.0f)};
      REQUIRE(cudaMemcpy(in[r], v, sizeof v, cudaMemcpyHostToDevice) == cudaSuccess);
      REQUIRE(cudaGraphLaunch(exec[r], two.stream[r]) == cudaSuccess);
    }
    for (int r = 0; r < 2; ++r) {
      REQUIRE(cudaSetDevice(r) == cudaSuccess);
      REQUIRE(cudaStreamSynchronize(two.stream[r]) == cudaSuccess);
      CHECK(std::vector<float>(out[r], out[r] + 2) == std::vector<float>{scale * 11, scale * 22});
    }
  }
  for (int r = 0; r < 2; ++r) {
    cudaSetDevice(r);
    cudaGraphExecDestroy(exec[r]), cudaGraphDestroy(graph[r]), cudaFree(in[r]), cudaFree(out[r]);
  }
  cudaSetDevice(0);
  CHECK(cuda_emulator::take_violations().empty());
}
