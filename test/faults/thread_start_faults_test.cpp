// ThreadGroup::run when a rank's thread cannot be started (a process or memory limit):
// an fsdp::Error naming the rank, with the ranks already running aborted and joined,
// never std::terminate. The failure is injected by interposing pthread_create in this
// test binary (the library has no hook for it); ASan's leak check covers "nothing
// leaks" when the test runs under -fsanitize=address.
#include <doctest/doctest.h>

#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/host/thread_group.hpp"
#include "test/support/errors.hpp"

namespace {

// pthread_create calls to let through before one fails with EAGAIN (< 0: none fails).
std::atomic<int> creations_before_failure{-1};
std::atomic<int> failed_creations{0};

}  // namespace

// The pthread_create this one stands in front of. clang links a sanitizer's runtime into
// the binary, and its pthread_create (which registers the thread with the sanitizer) is
// __interceptor_pthread_create there, not the next library's: calling libc's directly
// crashes ThreadSanitizer at the join. g++ loads the runtime as a library: RTLD_NEXT finds it.
#if defined(__clang__) && defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer)
#define FSDP_TEST_SANITIZER_PTHREAD_CREATE 1
extern "C" int __interceptor_pthread_create(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
#endif
#endif

extern "C" int pthread_create(pthread_t* thread, const pthread_attr_t* attr, void* (*start)(void*), void* arg) {
  using Create = int (*)(pthread_t*, const pthread_attr_t*, void* (*)(void*), void*);
#ifdef FSDP_TEST_SANITIZER_PTHREAD_CREATE
  static const Create real = &__interceptor_pthread_create;
#else
  static const auto real = reinterpret_cast<Create>(dlsym(RTLD_NEXT, "pthread_create"));
#endif
  if (creations_before_failure.load() >= 0 && creations_before_failure.fetch_sub(1) == 0) {
    ++failed_creations;
    return EAGAIN;
  }
  return real(thread, attr, start, arg);
}

namespace {

using fsdp::ThreadComm;
using fsdp::ThreadGroup;
using fsdp::ThreadGroupOptions;
using namespace std::chrono_literals;

using test_support::contains;

}  // namespace

TEST_CASE("a thread that cannot be started is an fsdp::Error; the ranks already running are aborted and joined") {
  const int n = 4;
  for (int failing = 1; failing < n; ++failing) {  // rank 0 runs on the calling thread
    CAPTURE(failing);
    std::vector<std::string> rank_errors(n);
    std::vector<std::atomic<int>> started(n);
    std::string msg;
    failed_creations = 0;
    creations_before_failure = failing - 1;  // ranks 1 .. failing-1 start
    try {
      ThreadGroup(n, ThreadGroupOptions{5000ms}).run([&](ThreadComm& c) {
        started[c.rank()] = 1;
        std::vector<float> big(1 << 16, 1.0f);  // something to leak if unwinding went wrong
        try {
          for (int i = 0; i < 100; ++i) c.all_reduce(big.data(), big.data(), big.size(), fsdp::DType::f32, fsdp::ReduceOp::sum).wait();
        } catch (const fsdp::Error& e) {
          rank_errors[c.rank()] = e.what();
        }
      });
    } catch (const fsdp::Error& e) {
      msg = e.what();
    }
    creations_before_failure = -1;
    CAPTURE(msg);
    CHECK(failed_creations == 1);
    CHECK(contains(msg, "ThreadGroup: could not start the thread of rank " + std::to_string(failing) + " of 4"));
    CHECK(contains(msg, "Resource temporarily unavailable"));
    CHECK(contains(msg, std::to_string(failing - 1) + " rank(s) already started were aborted and joined"));
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CAPTURE(rank_errors[r]);
      const bool ran = r >= 1 && r < failing;  // rank 0 never runs: its thread is the caller's
      CHECK(started[r] == (ran ? 1 : 0));
      if (ran) CHECK(contains(rank_errors[r], "could not start the thread of rank " + std::to_string(failing)));
    }
  }
  // Nothing is left over: the next group runs normally.
  std::vector<float> sums(n);
  ThreadGroup(n, ThreadGroupOptions{5000ms}).run([&](ThreadComm& c) {
    float one = 1.0f;
    c.all_reduce(&one, &sums[c.rank()], 1, fsdp::DType::f32, fsdp::ReduceOp::sum).wait();
  });
  for (float s : sums) CHECK(s == 4.0f);
}
