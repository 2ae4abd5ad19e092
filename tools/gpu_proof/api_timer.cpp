// A profiling aid for tools/gpu_proof.sh: an LD_PRELOAD library that times every call a
// program makes to the CUDA runtime and NCCL functions the library and the example engine
// use, and prints, at exit, how many calls each had and their host time, split between the
// main thread and the others (NCCL's watchdog polls from its own thread), and the share
// made inside a region the program marks (fsdp_api_timer_region(1) ... (0), looked up with
// dlsym so that programs run without this library too; examples/cuda_train marks each call
// into fsdp in its timed steps):
//   api_timer: <function> calls=<n> main_us=<t> other_us=<t> mean_us=<mean> region_calls=<n> region_us=<t>
// tools/gpu_proof.sh uses it to split the library's host time per unit into CUDA and NCCL
// calls and the library's own code.
//   g++ -std=c++20 -O2 -shared -fPIC -I$CUDA/include -I$NCCL/include api_timer.cpp -o api_timer.so -ldl
//   LD_PRELOAD=./api_timer.so cuda_train ...
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nccl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

struct Counter {
  const char* name;
  std::atomic<std::uint64_t> calls{0}, main_ns{0}, other_ns{0}, region_calls{0}, region_ns{0};
};

thread_local int region_depth = 0;

constexpr int kMax = 64;
Counter counters[kMax];
std::atomic<int> used{0};

Counter& counter(const char* name) {
  const int i = used.fetch_add(1);
  counters[i].name = name;
  return counters[i];
}

bool on_main_thread() {
  static thread_local const bool main = syscall(SYS_gettid) == getpid();
  return main;
}

void report_own_cost();

struct Report {
  ~Report() {
    report_own_cost();
    for (int i = 0; i < used.load() && i < kMax; ++i) {
      const Counter& c = counters[i];
      const auto n = c.calls.load();
      if (n == 0) continue;
      std::fprintf(stderr, "api_timer: %s calls=%llu main_us=%.1f other_us=%.1f mean_us=%.3f region_calls=%llu region_us=%.1f\n",
                   c.name, static_cast<unsigned long long>(n), c.main_ns.load() / 1e3, c.other_ns.load() / 1e3,
                   (c.main_ns.load() + c.other_ns.load()) / 1e3 / static_cast<double>(n),
                   static_cast<unsigned long long>(c.region_calls.load()), c.region_ns.load() / 1e3);
    }
  }
} report;

template <class F>
F next_symbol(const char* name) {
  void* p = dlsym(RTLD_NEXT, name);
  if (!p) {
    std::fprintf(stderr, "api_timer: %s not found after this library\n", name);
    _exit(3);
  }
  return reinterpret_cast<F>(p);
}

struct Timing {
  Counter& c;
  std::chrono::steady_clock::time_point begin = std::chrono::steady_clock::now();
  ~Timing() {
    const auto ns = std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - begin).count();
    c.calls.fetch_add(1, std::memory_order_relaxed);
    (on_main_thread() ? c.main_ns : c.other_ns).fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
    if (region_depth > 0) {
      c.region_calls.fetch_add(1, std::memory_order_relaxed);
      c.region_ns.fetch_add(static_cast<std::uint64_t>(ns), std::memory_order_relaxed);
    }
  }
};

// What timing costs per call, measured around an empty body: `inside_ns` lands in the
// measured interval (a clock read), `outside_ns` in the caller's time around it (the other
// clock read, the counters' atomics). tools/gpu_proof.sh takes both out of its split, so
// the timer's cost is counted neither as CUDA calls nor as the library's own code.
void report_own_cost() {
  constexpr int n = 200000;
  Counter probe;
  probe.name = "probe";
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < n; ++i) {
    Timing t{probe};
    asm volatile("" ::: "memory");
  }
  const double outer = static_cast<double>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count());
  const double inner = static_cast<double>(probe.main_ns.load() + probe.other_ns.load());
  std::fprintf(stderr, "api_timer: own cost per call inside_ns=%.1f outside_ns=%.1f\n", inner / n, (outer - inner) / n);
}

}  // namespace

// Marks the calling thread's calls from here on as inside (1) or outside (0) the region.
extern "C" void fsdp_api_timer_region(int enter) { region_depth += enter ? 1 : -1; }

// Each wrapper forwards to the next definition (the real library), timing the call.
#define FSDP_TIMED(ret, name, params, args)                                   \
  extern "C" ret name params {                                                \
    static auto real = next_symbol<ret(*) params>(#name);                     \
    static Counter& counter_ = counter(#name);                               \
    Timing timing_{counter_};                                                 \
    return real args;                                                         \
  }

FSDP_TIMED(cudaError_t, cudaMallocAsync, (void** p, size_t n, cudaStream_t s), (p, n, s))
FSDP_TIMED(cudaError_t, cudaFreeAsync, (void* p, cudaStream_t s), (p, s))
FSDP_TIMED(cudaError_t, cudaMalloc, (void** p, size_t n), (p, n))
FSDP_TIMED(cudaError_t, cudaFree, (void* p), (p))
FSDP_TIMED(cudaError_t, cudaMallocHost, (void** p, size_t n), (p, n))
FSDP_TIMED(cudaError_t, cudaFreeHost, (void* p), (p))
FSDP_TIMED(cudaError_t, cudaEventRecord, (cudaEvent_t e, cudaStream_t s), (e, s))
FSDP_TIMED(cudaError_t, cudaStreamWaitEvent, (cudaStream_t s, cudaEvent_t e, unsigned int f), (s, e, f))
FSDP_TIMED(cudaError_t, cudaEventQuery, (cudaEvent_t e), (e))
FSDP_TIMED(cudaError_t, cudaEventCreateWithFlags, (cudaEvent_t * e, unsigned int f), (e, f))
FSDP_TIMED(cudaError_t, cudaEventDestroy, (cudaEvent_t e), (e))
FSDP_TIMED(cudaError_t, cudaLaunchKernel, (const void* f, dim3 g, dim3 b, void** a, size_t sm, cudaStream_t s),
           (f, g, b, a, sm, s))
FSDP_TIMED(cudaError_t, cudaMemcpyAsync, (void* d, const void* s, size_t n, cudaMemcpyKind k, cudaStream_t st),
           (d, s, n, k, st))
FSDP_TIMED(cudaError_t, cudaMemcpy, (void* d, const void* s, size_t n, cudaMemcpyKind k), (d, s, n, k))
FSDP_TIMED(cudaError_t, cudaMemsetAsync, (void* p, int v, size_t n, cudaStream_t s), (p, v, n, s))
FSDP_TIMED(cudaError_t, cudaSetDevice, (int d), (d))
FSDP_TIMED(cudaError_t, cudaGetDevice, (int* d), (d))
FSDP_TIMED(cudaError_t, cudaGetLastError, (), ())
FSDP_TIMED(cudaError_t, cudaStreamSynchronize, (cudaStream_t s), (s))
FSDP_TIMED(cudaError_t, cudaStreamQuery, (cudaStream_t s), (s))
FSDP_TIMED(cudaError_t, cudaStreamGetDevice, (cudaStream_t s, int* d), (s, d))
FSDP_TIMED(cudaError_t, cudaPointerGetAttributes, (cudaPointerAttributes * a, const void* p), (a, p))
FSDP_TIMED(ncclResult_t, ncclAllGather, (const void* s, void* r, size_t n, ncclDataType_t t, ncclComm_t c, cudaStream_t st),
           (s, r, n, t, c, st))
FSDP_TIMED(ncclResult_t, ncclReduceScatter,
           (const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c, cudaStream_t st),
           (s, r, n, t, op, c, st))
FSDP_TIMED(ncclResult_t, ncclAllReduce,
           (const void* s, void* r, size_t n, ncclDataType_t t, ncclRedOp_t op, ncclComm_t c, cudaStream_t st),
           (s, r, n, t, op, c, st))
FSDP_TIMED(ncclResult_t, ncclBroadcast,
           (const void* s, void* r, size_t n, ncclDataType_t t, int root, ncclComm_t c, cudaStream_t st),
           (s, r, n, t, root, c, st))
FSDP_TIMED(ncclResult_t, ncclGroupStart, (), ())
FSDP_TIMED(ncclResult_t, ncclGroupEnd, (), ())
FSDP_TIMED(ncclResult_t, ncclCommGetAsyncError, (ncclComm_t c, ncclResult_t* r), (c, r))
