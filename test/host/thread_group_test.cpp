// fsdp/host/thread_group.hpp: N ranks as threads. Results of every collective against
// references computed here (reductions in rank order 0..N-1, rounding after every step
// for bf16), bitwise reproducibility, and failures that reach every rank instead of
// hanging.
//
// Rank bodies never use doctest assertions; they record what they saw in per-rank slots
// and the test checks those after ThreadGroup::run returns.
#include <doctest/doctest.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/host/thread_group.hpp"

namespace host_thread_group_test {

namespace {

using fsdp::DType;
using fsdp::ReduceOp;
using fsdp::ThreadComm;
using fsdp::ThreadGroup;
using fsdp::ThreadGroupOptions;
using namespace std::chrono_literals;

constexpr int kSizes[] = {1, 2, 3, 4, 8};
constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

// Generous for tests that must succeed (a bug that waits forever fails after this).
const ThreadGroupOptions kOk{std::chrono::milliseconds(10000)};
// Short, for tests of failures: a failure that is only noticed by the timeout shows up as
// a "timed out" message instead of the expected one.
const ThreadGroupOptions kShort{std::chrono::milliseconds(1000)};

template <class T>
bool same_bits(const T* a, const T* b, std::size_t n) { return n == 0 || std::memcmp(a, b, n * sizeof(T)) == 0; }

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// ---- reference element types ------------------------------------------------------------
// Each says how two elements combine and how avg finishes, written independently of the
// library: avg is the rank-order sum multiplied by 1/N in the element's precision (as a
// kernel working in that dtype would); for integers it is the sum divided by N,
// truncating, as NCCL's ncclAvg does.

// Rounds an exact value to bfloat16 (8 significant bits) with ties to even, by scaling
// the binade's quantum to 1 and using nearbyint in the default rounding mode.
float ref_round_bf16(double x) {
  if (x == 0 || !std::isfinite(x)) return static_cast<float>(x);
  const int e = std::max(std::ilogb(x), -126);
  const double quantum = std::ldexp(1.0, e - 7);
  return static_cast<float>(std::nearbyint(x / quantum) * quantum);
}
std::uint16_t bf16_bits(float exact) { return static_cast<std::uint16_t>(std::bit_cast<std::uint32_t>(exact) >> 16); }
float bf16_value(std::uint16_t h) { return std::bit_cast<float>(static_cast<std::uint32_t>(h) << 16); }

// Float values of many magnitudes, so that the summation order shows in the result.
template <class F>
std::vector<F> spread_values(std::mt19937& rng, std::size_t n, int max_exp) {
  std::uniform_real_distribution<F> mant(-1, 1);
  std::uniform_int_distribution<int> e(-max_exp, max_exp);
  std::vector<F> v(n);
  for (auto& x : v) x = std::ldexp(mant(rng), e(rng));
  return v;
}

struct F32 {
  using T = float;
  static constexpr DType dtype = DType::f32;
  static std::vector<T> random(std::mt19937& rng, std::size_t n) { return spread_values<float>(rng, n, 12); }
  static T sum(T a, T b) { return static_cast<float>(static_cast<double>(a) + static_cast<double>(b)); }
  static T avg(T s, int n) { return static_cast<float>(static_cast<double>(s) * static_cast<float>(1.0 / n)); }
  static bool less(T a, T b) { return a < b; }
};

struct F64 {
  using T = double;
  static constexpr DType dtype = DType::f64;
  static std::vector<T> random(std::mt19937& rng, std::size_t n) { return spread_values<double>(rng, n, 40); }
  static T sum(T a, T b) { return a + b; }
  static T avg(T s, int n) { return s * (1.0 / n); }
  static bool less(T a, T b) { return a < b; }
};

struct I32 {
  using T = std::int32_t;
  static constexpr DType dtype = DType::i32;
  static std::vector<T> random(std::mt19937& rng, std::size_t n) {
    std::uniform_int_distribution<T> d(-1000000, 1000000);
    std::vector<T> v(n);
    for (auto& x : v) x = d(rng);
    return v;
  }
  static T sum(T a, T b) { return a + b; }
  static T avg(T s, int n) { return static_cast<T>(s / n); }
  static bool less(T a, T b) { return a < b; }
};

struct BF16 {
  using T = std::uint16_t;  // bit patterns
  static constexpr DType dtype = DType::bf16;
  static std::vector<T> random(std::mt19937& rng, std::size_t n) {
    std::uniform_int_distribution<int> exp(118, 136), mant(0, 127), sign(0, 1);
    std::vector<T> v(n);
    for (auto& h : v) h = static_cast<T>(sign(rng) << 15 | exp(rng) << 7 | mant(rng));
    return v;
  }
  static T sum(T a, T b) {
    return bf16_bits(ref_round_bf16(static_cast<double>(bf16_value(a)) + static_cast<double>(bf16_value(b))));
  }
  static T avg(T s, int n) {
    return bf16_bits(ref_round_bf16(static_cast<double>(bf16_value(s)) * static_cast<float>(1.0 / n)));
  }
  static bool less(T a, T b) { return bf16_value(a) < bf16_value(b); }
};

template <class E>
typename E::T ref_combine(typename E::T a, typename E::T b, ReduceOp op) {
  switch (op) {
    case ReduceOp::max: return E::less(a, b) ? b : a;
    case ReduceOp::min: return E::less(b, a) ? b : a;
    default: return E::sum(a, b);
  }
}

// Rank-order reference of element `at` of the ranks' inputs.
template <class E>
typename E::T ref_reduce(const std::vector<std::vector<typename E::T>>& in, std::size_t at, ReduceOp op) {
  const int n = static_cast<int>(in.size());
  typename E::T acc = in[0][at];
  for (int r = 1; r < n; ++r) acc = ref_combine<E>(acc, in[r][at], op);
  return op == ReduceOp::avg ? E::avg(acc, n) : acc;
}

// What one rank saw in a collective that must succeed.
struct RankView {
  int rank = -1, size = -1;
  bool work_ready = false;
  bool send_untouched = true;
  bool no_overrun = true;
};

// Runs all_reduce or reduce_scatter of E on n ranks and compares every rank's result with
// the reference. In place: all_reduce with send == recv; reduce_scatter with
// recv == send + rank*count.
template <class E>
void check_reduction(int n, ReduceOp op, bool scatter, bool in_place, std::size_t count, std::mt19937& rng) {
  using T = typename E::T;
  CAPTURE(n);
  CAPTURE(fsdp::name_of(E::dtype));
  CAPTURE(fsdp::name_of(op));
  CAPTURE(scatter);
  CAPTURE(in_place);
  const std::size_t len = scatter ? n * count : count;
  std::vector<std::vector<T>> in(n);
  for (auto& v : in) v = E::random(rng, len);
  std::vector<std::vector<T>> out(n);
  std::vector<RankView> views(n);

  ThreadGroup group(n, kOk);
  group.run([&](ThreadComm& c) {
    const int r = c.rank();
    RankView& view = views[r];
    view.rank = r;
    view.size = c.size();
    if (in_place) {
      std::vector<T> buf = in[r];
      T* recv = buf.data() + (scatter ? r * count : 0);
      fsdp::Work w = scatter ? c.reduce_scatter(buf.data(), recv, count, E::dtype, op)
                             : c.all_reduce(buf.data(), buf.data(), count, E::dtype, op);
      view.work_ready = w.ready();
      w.wait();
      out[r].assign(recv, recv + count);
    } else {
      const std::vector<T> send = in[r];
      const T sentinel = static_cast<T>(77);
      std::vector<T> recv(count + 1, sentinel);  // one past the end must stay untouched
      fsdp::Work w = scatter ? c.reduce_scatter(send.data(), recv.data(), count, E::dtype, op)
                             : c.all_reduce(send.data(), recv.data(), count, E::dtype, op);
      view.work_ready = w.ready();
      w.wait();
      view.send_untouched = same_bits(send.data(), in[r].data(), len);
      view.no_overrun = recv[count] == sentinel;
      out[r].assign(recv.begin(), recv.begin() + static_cast<std::ptrdiff_t>(count));
    }
  });

  int bad = 0;
  for (int q = 0; q < n; ++q) {
    CAPTURE(q);
    CHECK(views[q].rank == q);
    CHECK(views[q].size == n);
    CHECK(views[q].work_ready);  // host collectives complete before they return
    CHECK(views[q].send_untouched);
    CHECK(views[q].no_overrun);
    REQUIRE(out[q].size() == count);
    const std::size_t base = scatter ? q * count : 0;
    for (std::size_t i = 0; i < count; ++i) {
      const T want = ref_reduce<E>(in, base + i, op);
      if (!same_bits(&out[q][i], &want, 1) && ++bad <= 3) {
        INFO("rank " << q << " element " << i << ": got " << +out[q][i] << ", want " << +want);
        CHECK(false);
      }
    }
  }
  CHECK(bad == 0);
}

template <class E>
void check_all_reductions(std::uint32_t seed) {
  std::mt19937 rng(seed);
  for (int n : kSizes)
    for (ReduceOp op : kOps)
      for (bool scatter : {false, true})
        for (bool in_place : {false, true}) check_reduction<E>(n, op, scatter, in_place, 257, rng);
}

// Runs fn on n ranks; each rank catches fsdp::Error and its message is returned in that
// rank's slot (empty: no error). Anything else a rank throws reaches run() and fails.
std::vector<std::string> errors_per_rank(int n, ThreadGroupOptions opts, const std::function<void(ThreadComm&)>& fn) {
  std::vector<std::string> msgs(n);
  ThreadGroup group(n, opts);
  auto body = [&](ThreadComm& c) {
    try {
      fn(c);
    } catch (const fsdp::Error& e) {
      msgs[c.rank()] = e.what();
    }
  };
  CHECK_NOTHROW(group.run(body));
  return msgs;
}

// The ranks listed after "never arrived:" at the end of a timeout message.
std::vector<int> never_arrived(const std::string& msg) {
  const std::string key = "never arrived:";
  const auto at = msg.rfind(key);
  if (at == std::string::npos) return {-1};
  std::istringstream is(msg.substr(at + key.size()));
  std::vector<int> ranks;
  for (int r; is >> r;) ranks.push_back(r);
  return ranks;
}

void sleep_ms(int ms) { std::this_thread::sleep_for(std::chrono::milliseconds(ms)); }

}  // namespace

// ---- collectives that succeed ---------------------------------------------------------------

TEST_CASE("every rank runs once with its own rank and the group size") {
  for (int n : kSizes) {
    CAPTURE(n);
    std::vector<std::atomic<int>> seen(n);
    std::vector<int> sizes(n, -1);
    ThreadGroup group(n, kOk);
    CHECK(group.size() == n);
    group.run([&](ThreadComm& c) {
      seen[c.rank()].fetch_add(1);
      sizes[c.rank()] = c.size();
    });
    for (int r = 0; r < n; ++r) {
      CHECK(seen[r].load() == 1);
      CHECK(sizes[r] == n);
    }
  }
}

namespace {
std::atomic<int> ranks_run_by_function{0};
void count_rank(ThreadComm&) { ranks_run_by_function.fetch_add(1); }
}  // namespace

TEST_CASE("run takes a function, a const function object and a temporary as well as a lambda") {
  ThreadGroup group(3, kOk);
  group.run(count_rank);
  group.run(&count_rank);
  CHECK(ranks_run_by_function.load() == 6);
  std::atomic<int> calls{0};
  const auto counted = [&](ThreadComm&) { calls.fetch_add(1); };
  group.run(counted);
  group.run(std::function<void(ThreadComm&)>(counted));
  CHECK(calls.load() == 6);
}

template <class T>
void check_all_gather(DType t, std::size_t count, bool in_place) {
  for (int n : kSizes) {
    CAPTURE(n);
    CAPTURE(fsdp::name_of(t));
    CAPTURE(count);
    CAPTURE(in_place);
    // Element i of rank r's chunk: distinct across ranks and positions (mod 2^bits).
    auto value = [](int r, std::size_t i) { return static_cast<T>(r * 97 + static_cast<int>(i) * 3 + 1); };
    std::vector<std::vector<T>> out(n);
    std::vector<int> overrun(n, 0);
    ThreadGroup group(n, kOk);
    group.run([&](ThreadComm& c) {
      const int r = c.rank();
      const T sentinel = static_cast<T>(250);
      std::vector<T> recv(n * count + 1, sentinel);
      if (in_place) {
        T* mine = recv.data() + r * count;
        for (std::size_t i = 0; i < count; ++i) mine[i] = value(r, i);
        c.all_gather(mine, recv.data(), count, t).wait();
      } else {
        std::vector<T> send(count + 1);
        for (std::size_t i = 0; i < count; ++i) send[i] = value(r, i);
        c.all_gather(send.data(), recv.data(), count, t).wait();
      }
      overrun[r] = recv[n * count] != sentinel;
      recv.pop_back();
      out[r] = std::move(recv);
    });
    for (int q = 0; q < n; ++q) {
      CAPTURE(q);
      CHECK(overrun[q] == 0);
      int bad = 0;
      for (int r = 0; r < n; ++r)
        for (std::size_t i = 0; i < count; ++i) bad += out[q][r * count + i] != value(r, i);
      CHECK(bad == 0);
    }
  }
}

TEST_CASE("all_gather concatenates the ranks' chunks in rank order") {
  for (bool in_place : {false, true}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{1000}}) {
      check_all_gather<float>(DType::f32, count, in_place);
      check_all_gather<double>(DType::f64, count, in_place);
      check_all_gather<std::uint16_t>(DType::bf16, count, in_place);
      check_all_gather<std::uint8_t>(DType::u8, count, in_place);
    }
  }
}

TEST_CASE("all_reduce and reduce_scatter on f32 match the rank-order reference") { check_all_reductions<F32>(1); }
TEST_CASE("all_reduce and reduce_scatter on f64 match the rank-order reference") { check_all_reductions<F64>(2); }
TEST_CASE("all_reduce and reduce_scatter on i32 match the reference") { check_all_reductions<I32>(3); }
TEST_CASE("all_reduce and reduce_scatter on bf16 round after every step") { check_all_reductions<BF16>(4); }

TEST_CASE("single-element and empty reductions") {
  std::mt19937 rng(5);
  for (int n : kSizes) {
    check_reduction<F32>(n, ReduceOp::sum, false, false, 1, rng);
    check_reduction<F32>(n, ReduceOp::sum, true, true, 1, rng);
    check_reduction<BF16>(n, ReduceOp::avg, true, false, 1, rng);
  }
  // count 0: nothing written, nothing hangs.
  for (int n : kSizes) {
    std::vector<int> touched(n, 0);
    ThreadGroup group(n, kOk);
    group.run([&](ThreadComm& c) {
      float send[1] = {1.0f}, recv[1] = {-3.0f};
      c.all_reduce(send, recv, 0, DType::f32, ReduceOp::sum).wait();
      c.reduce_scatter(send, recv, 0, DType::f32, ReduceOp::avg).wait();
      c.broadcast(send, recv, 0, DType::f32, 0).wait();
      touched[c.rank()] = recv[0] != -3.0f;
    });
    for (int r = 0; r < n; ++r) CHECK(touched[r] == 0);
  }
}

TEST_CASE("avg of integers divides the sum") {
  // Exact cases worked out by hand: (3 + 5 + 10) / 3 = 6; (-7 + 0) / 2 = -3 (truncated).
  std::vector<std::int32_t> got3(3), got2(2);
  ThreadGroup(3, kOk).run([&](ThreadComm& c) {
    const std::int32_t v[] = {3, 5, 10};
    std::int32_t r = 0;
    c.all_reduce(&v[c.rank()], &r, 1, DType::i32, ReduceOp::avg).wait();
    got3[c.rank()] = r;
  });
  ThreadGroup(2, kOk).run([&](ThreadComm& c) {
    const std::int32_t v[] = {-7, 0};
    std::int32_t r = 0;
    c.all_reduce(&v[c.rank()], &r, 1, DType::i32, ReduceOp::avg).wait();
    got2[c.rank()] = r;
  });
  for (int x : got3) CHECK(x == 6);
  for (int x : got2) CHECK(x == -3);
}

TEST_CASE("broadcast from every root") {
  for (int n : kSizes) {
    for (int root = 0; root < n; ++root) {
      for (bool in_place : {false, true}) {
        CAPTURE(n);
        CAPTURE(root);
        CAPTURE(in_place);
        const std::size_t count = 300;
        auto value = [](int r, std::size_t i) { return static_cast<float>(r * 1000 + static_cast<int>(i)) + 0.25f; };
        std::vector<int> bad(n, -1), root_send_changed(n, 0);
        ThreadGroup group(n, kOk);
        group.run([&](ThreadComm& c) {
          const int r = c.rank();
          // Every rank passes a send buffer with its own values; only the root's counts.
          std::vector<float> send(count), recv(count + 1, -1.0f);
          for (std::size_t i = 0; i < count; ++i) send[i] = value(r, i);
          float* dst = recv.data();
          if (in_place && r == root) {  // NCCL-style in place: the root's send is its recv
            std::copy(send.begin(), send.end(), recv.begin());
            c.broadcast(dst, dst, count, DType::f32, root).wait();
          } else {
            c.broadcast(send.data(), dst, count, DType::f32, root).wait();
            for (std::size_t i = 0; i < count; ++i) root_send_changed[r] += send[i] != value(r, i);
          }
          int b = recv[count] != -1.0f;
          for (std::size_t i = 0; i < count; ++i) b += recv[i] != value(root, i);
          bad[r] = b;
        });
        for (int r = 0; r < n; ++r) {
          CHECK(bad[r] == 0);
          CHECK(root_send_changed[r] == 0);
        }
      }
    }
  }
}

TEST_CASE("barrier: nobody leaves before everybody has arrived") {
  for (int n : kSizes) {
    CAPTURE(n);
    const int rounds = 20;
    std::vector<std::atomic<int>> arrived(rounds);
    std::vector<int> early(n, 0);
    ThreadGroup group(n, kOk);
    group.run([&](ThreadComm& c) {
      const int r = c.rank();
      for (int k = 0; k < rounds; ++k) {
        // Stagger arrivals differently each round.
        std::this_thread::sleep_for(std::chrono::microseconds(((r * 7 + k * 3) % 5) * 200));
        arrived[k].fetch_add(1);
        c.barrier().wait();
        if (arrived[k].load() != n) ++early[r];
      }
    });
    for (int r = 0; r < n; ++r) CHECK(early[r] == 0);
  }
}

TEST_CASE("ring_shift: each rank receives rank r-1's buffer (mod N), on 1 to 4 ranks") {
  static_assert(fsdp::RingShiftCommunicator<ThreadComm>);
  for (int n : {1, 2, 3, 4}) {
    for (std::size_t count : {std::size_t{0}, std::size_t{1}, std::size_t{7}, std::size_t{300000}}) {  // 300000: 2 and 3 chunks of 1 MiB
      CAPTURE(n);
      CAPTURE(count);
      auto value = [](int r, std::size_t i) { return static_cast<float>(1000 * r) + static_cast<float>(i) * 0.5f; };
      std::vector<int> bad(n, -1);
      ThreadGroup group(n, kOk);
      group.run([&](ThreadComm& c) {
        const int r = c.rank(), left = (r + n - 1) % n;
        std::vector<float> send(count), recv(count + 1, -1.0f);
        std::vector<std::int64_t> send64(count), recv64(count + 1, -1);
        for (std::size_t i = 0; i < count; ++i) {
          send[i] = value(r, i);
          send64[i] = (std::int64_t{1} << 40) * r + static_cast<std::int64_t>(i);
        }
        c.ring_shift(send.data(), recv.data(), count, DType::f32).wait();
        c.ring_shift(send64.data(), recv64.data(), count, DType::i64).wait();
        int b = recv[count] != -1.0f || recv64[count] != -1;  // nothing past `count`
        for (std::size_t i = 0; i < count; ++i) {
          b += recv[i] != value(left, i) || send[i] != value(r, i);
          b += recv64[i] != (std::int64_t{1} << 40) * left + static_cast<std::int64_t>(i);
        }
        bad[r] = b;
      });
      for (int r = 0; r < n; ++r) CHECK(bad[r] == 0);
    }
  }
  // One rank: send may be recv (it copies nothing then).
  float x[3] = {1, 2, 3};
  ThreadGroup(1, kOk).run([&](ThreadComm& c) { c.ring_shift(x, x, 3, DType::f32).wait(); });
  CHECK((x[0] == 1 && x[1] == 2 && x[2] == 3));
}

TEST_CASE("float reductions are bitwise reproducible whatever the arrival order") {
  const int n = 8;
  const std::size_t count = 4096;
  std::mt19937 rng(6);
  std::vector<std::vector<float>> in(n);
  for (auto& v : in) v = spread_values<float>(rng, n * count, 20);

  // The data is order-sensitive: summing in reverse rank order gives other bits somewhere,
  // so agreeing bit for bit means the order really is fixed.
  int order_sensitive = 0;
  for (std::size_t i = 0; i < count; ++i) {
    float fwd = in[0][i], rev = in[n - 1][i];
    for (int r = 1; r < n; ++r) fwd += in[r][i];
    for (int r = n - 2; r >= 0; --r) rev += in[r][i];
    order_sensitive += fwd != rev;
  }
  REQUIRE(order_sensitive > 0);

  // stagger: rank r waits (n-1-r) ms first, so ranks arrive in reverse order.
  auto once = [&](bool scatter, bool stagger) {
    std::vector<std::vector<float>> out(n);
    ThreadGroup group(n, kOk);
    group.run([&](ThreadComm& c) {
      const int r = c.rank();
      if (stagger) sleep_ms(n - 1 - r);
      std::vector<float> recv(count);
      if (scatter) c.reduce_scatter(in[r].data(), recv.data(), count, DType::f32, ReduceOp::sum).wait();
      else c.all_reduce(in[r].data(), recv.data(), count, DType::f32, ReduceOp::sum).wait();
      out[r] = std::move(recv);
    });
    return out;
  };
  for (bool scatter : {false, true}) {
    CAPTURE(scatter);
    const auto a = once(scatter, false), b = once(scatter, true), c = once(scatter, false);
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CHECK(same_bits(a[r].data(), b[r].data(), count));
      CHECK(same_bits(a[r].data(), c[r].data(), count));
      if (!scatter) CHECK(same_bits(a[r].data(), a[0].data(), count));  // all ranks agree
    }
  }
}

// ---- failures: every rank hears about them, nothing hangs ---------------------------------

TEST_CASE("ThreadGroup rejects a size below 1") {
  CHECK_THROWS_AS(ThreadGroup(0), fsdp::Error);
  CHECK_THROWS_AS(ThreadGroup(-2), fsdp::Error);
  CHECK_NOTHROW(ThreadGroup(1));
}

TEST_CASE("different collectives on different ranks fail on every rank, naming both calls") {
  SUBCASE("two ranks") {
    const auto msgs = errors_per_rank(2, kShort, [](ThreadComm& c) {
      float send[4] = {}, recv[8] = {};
      if (c.rank() == 0) c.all_gather(send, recv, 4, DType::f32).wait();
      else c.all_reduce(send, recv, 4, DType::f32, ReduceOp::sum).wait();
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "mismatch"));
      CHECK(contains(msgs[r], "all_gather"));
      CHECK(contains(msgs[r], "all_reduce"));
    }
  }
  SUBCASE("one of four ranks differs") {
    const auto msgs = errors_per_rank(4, kShort, [](ThreadComm& c) {
      float send[16] = {}, recv[16] = {};
      if (c.rank() == 3) c.reduce_scatter(send, recv, 4, DType::f32, ReduceOp::sum).wait();
      else c.all_gather(send, recv, 4, DType::f32).wait();
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "all_gather"));
      CHECK(contains(msgs[r], "reduce_scatter"));
    }
  }
  SUBCASE("after some matching collectives") {
    const auto msgs = errors_per_rank(3, kShort, [](ThreadComm& c) {
      c.barrier().wait();
      c.barrier().wait();
      float x = 0;
      if (c.rank() == 1) c.barrier().wait();
      else c.broadcast(&x, &x, 1, DType::f32, 0).wait();
    });
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "barrier"));
      CHECK(contains(msgs[r], "broadcast"));
      CHECK(contains(msgs[r], "#2"));  // the third collective
    }
  }
}

TEST_CASE("the same collective with different arguments fails on every rank, naming both") {
  struct Case {
    const char* name;
    std::function<void(ThreadComm&)> fn;
    const char* a;
    const char* b;
  };
  const Case cases[] = {
      {"count",
       [](ThreadComm& c) {
         float send[8] = {}, recv[8] = {};
         c.all_reduce(send, recv, c.rank() == 1 ? 5 : 4, DType::f32, ReduceOp::sum).wait();
       },
       "count=4", "count=5"},
      {"dtype",
       [](ThreadComm& c) {
         float send[8] = {}, recv[8] = {};
         c.all_reduce(send, recv, 2, c.rank() == 2 ? DType::bf16 : DType::f32, ReduceOp::sum).wait();
       },
       "dtype=f32", "dtype=bf16"},
      {"reduce op",
       [](ThreadComm& c) {
         float send[8] = {}, recv[8] = {};
         c.reduce_scatter(send, recv, 2, DType::f32, c.rank() == 0 ? ReduceOp::max : ReduceOp::sum).wait();
       },
       "op=max", "op=sum"},
      {"broadcast root",
       [](ThreadComm& c) {
         float x[2] = {};
         c.broadcast(x, x, 2, DType::f32, c.rank() == 1 ? 1 : 0).wait();
       },
       "root=0", "root=1"},
  };
  for (const auto& k : cases) {
    CAPTURE(k.name);
    const auto msgs = errors_per_rank(3, kShort, k.fn);
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "mismatch"));
      CHECK(contains(msgs[r], k.a));
      CHECK(contains(msgs[r], k.b));
    }
  }
}

TEST_CASE("a rank that returns while the others wait in a collective is reported") {
  SUBCASE("before any collective") {
    const auto msgs = errors_per_rank(3, kShort, [](ThreadComm& c) {
      if (c.rank() == 2) return;
      float x[4] = {};
      c.all_reduce(x, x, 4, DType::f32, ReduceOp::sum).wait();
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "rank 2 finished without joining"));
      CHECK(contains(msgs[r], "all_reduce"));
    }
    CHECK(msgs[2].empty());  // it returned normally
  }
  SUBCASE("after a collective the others go on to") {
    const auto msgs = errors_per_rank(4, kShort, [](ThreadComm& c) {
      c.barrier().wait();
      if (c.rank() == 0) return;
      float send[2] = {}, recv[8] = {};
      c.all_gather(send, recv, 2, DType::f32).wait();
    });
    for (int r = 1; r < 4; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "rank 0 finished without joining"));
      CHECK(contains(msgs[r], "all_gather"));
    }
  }
}

TEST_CASE("a rank that throws aborts the group; run() rethrows its exception") {
  for (int delay_ms : {0, 50}) {  // 0: others may not have arrived yet; 50: they are waiting
    CAPTURE(delay_ms);
    const int n = 3;
    std::vector<std::string> msgs(n);
    ThreadGroup group(n, kShort);
    std::string rethrown, wrong_type;
    try {
      group.run([&](ThreadComm& c) {
        if (c.rank() == 1) {
          sleep_ms(delay_ms);
          throw std::runtime_error("boom from rank 1");
        }
        try {
          float x[4] = {};
          c.all_reduce(x, x, 4, DType::f32, ReduceOp::sum).wait();
        } catch (const fsdp::Error& e) {
          msgs[c.rank()] = e.what();
        }
      });
    } catch (const fsdp::Error& e) {
      wrong_type = e.what();
    } catch (const std::runtime_error& e) {
      rethrown = e.what();
    }
    CHECK(wrong_type.empty());
    CHECK(rethrown == "boom from rank 1");
    for (int r : {0, 2}) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "rank 1 failed"));
      CHECK(contains(msgs[r], "boom from rank 1"));
    }
  }
}

TEST_CASE("run() rethrows the exception that caused the abort, not an echo of it") {
  SUBCASE("a later rank's std::runtime_error, echoed by earlier ranks") {
    std::string rethrown, wrong_type;
    try {
      ThreadGroup(4, kShort).run([](ThreadComm& c) {
        if (c.rank() == 3) {
          sleep_ms(50);  // ranks 0..2 are waiting by now: their echoes come first by rank
          throw std::runtime_error("origin on rank 3");
        }
        float x[1] = {};
        c.all_reduce(x, x, 1, DType::f32, ReduceOp::sum).wait();  // uncaught echo
      });
    } catch (const fsdp::Error& e) {
      wrong_type = e.what();
    } catch (const std::runtime_error& e) {
      rethrown = e.what();
    }
    CHECK(wrong_type.empty());
    CHECK(rethrown == "origin on rank 3");
  }
  SUBCASE("an fsdp::Error thrown by a rank itself") {
    std::string rethrown;
    try {
      ThreadGroup(3, kShort).run([](ThreadComm& c) {
        if (c.rank() == 2) {
          sleep_ms(50);
          throw fsdp::Error("custom origin");
        }
        c.barrier().wait();
      });
    } catch (const fsdp::Error& e) {
      rethrown = e.what();
    }
    CHECK(rethrown == "fsdp: custom origin");
  }
  SUBCASE("a timeout: the rank that timed out, not the late rank's echo") {
    std::string rethrown;
    try {
      ThreadGroup(3, ThreadGroupOptions{std::chrono::milliseconds(200)}).run([](ThreadComm& c) {
        if (c.rank() == 0) sleep_ms(800);  // rank 0 is late; its echo would come first
        c.barrier().wait();
      });
    } catch (const fsdp::Error& e) {
      rethrown = e.what();
    }
    CAPTURE(rethrown);
    CHECK(contains(rethrown, "timed out"));
    CHECK_FALSE(contains(rethrown, "rank 0: "));  // rank 0 only echoed it
    CHECK(never_arrived(rethrown) == std::vector<int>{0});
  }
}

TEST_CASE("a rank that never arrives times out on every rank, named in the message") {
  SUBCASE("one late rank of three") {
    const auto msgs = errors_per_rank(3, ThreadGroupOptions{std::chrono::milliseconds(200)}, [](ThreadComm& c) {
      if (c.rank() == 2) sleep_ms(800);
      float x[4] = {};
      c.all_reduce(x, x, 4, DType::f32, ReduceOp::sum).wait();
    });
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "timed out"));
      CHECK(never_arrived(msgs[r]) == std::vector<int>{2});
    }
  }
  SUBCASE("two late ranks of four") {
    const auto msgs = errors_per_rank(4, ThreadGroupOptions{std::chrono::milliseconds(200)}, [](ThreadComm& c) {
      if (c.rank() == 1 || c.rank() == 3) sleep_ms(800);
      c.barrier().wait();
    });
    for (int r = 0; r < 4; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "timed out"));
      CHECK(never_arrived(msgs[r]) == std::vector<int>{1, 3});
    }
  }
}

TEST_CASE("broadcast with a root outside the group fails on every rank") {
  for (int bad_root : {3, -1, 100}) {
    CAPTURE(bad_root);
    const auto msgs = errors_per_rank(3, kShort, [bad_root](ThreadComm& c) {
      float x[2] = {};
      c.broadcast(x, x, 2, DType::f32, bad_root).wait();
    });
    for (int r = 0; r < 3; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "root " + std::to_string(bad_root)));
    }
  }
}

TEST_CASE("ring_shift refuses overlapping buffers before it meets the other ranks") {
  for (int n : {2, 3}) {
    CAPTURE(n);
    std::vector<std::string> msgs(n);
    std::vector<int> after(n, 0);
    ThreadGroup group(n, kShort);
    group.run([&](ThreadComm& c) {
      float buf[8] = {};
      // In place (send == recv) on rank 0, partly overlapping on the others.
      try {
        c.ring_shift(buf, c.rank() == 0 ? buf : buf + 2, 4, DType::f32).wait();
      } catch (const fsdp::Error& e) {
        msgs[c.rank()] = e.what();
      }
      // Nothing was issued: the group is still in step.
      float send = static_cast<float>(c.rank()), recv = -1.0f;
      c.ring_shift(&send, &recv, 1, DType::f32).wait();
      after[c.rank()] = recv == static_cast<float>((c.rank() + n - 1) % n);
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "rank " + std::to_string(r) + ": ring_shift(count=4, dtype=f32)"));
      CHECK(contains(msgs[r], "overlap"));
      CHECK(after[r] == 1);
    }
  }
}

TEST_CASE("ring_shift on one rank, all_gather of the same count on the others: every rank fails naming both") {
  for (int n : {2, 3, 4}) {
    CAPTURE(n);
    const auto msgs = errors_per_rank(n, kShort, [n](ThreadComm& c) {
      std::vector<float> send(4, 1.0f), recv(4 * static_cast<std::size_t>(n));
      if (c.rank() == 0) c.ring_shift(send.data(), recv.data(), 4, DType::f32).wait();
      else c.all_gather(send.data(), recv.data(), 4, DType::f32).wait();
    });
    for (int r = 0; r < n; ++r) {
      CAPTURE(r);
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "mismatch"));
      CHECK(contains(msgs[r], "ring_shift(count=4, dtype=f32)"));
      CHECK(contains(msgs[r], "all_gather(count=4, dtype=f32)"));
      CHECK_FALSE(contains(msgs[r], "timed out"));
    }
  }
}

TEST_CASE("8-bit floats: f8 sums in float rounded to the format; e8m0 takes max and min, and refuses a sum on every rank") {
  // E5M2 patterns of 3.0 (0x42) and 0.75 (0x3a), summed in rank order, rounded after each
  // step: 3.0 + 0.75 = 3.75, a tie between 3.5 and 4.0 -> 4.0 (even); 4.0 + 0.75 = 4.75 -> 5.0
  // (0x45). Rounded once at the end, 4.5 would tie to 4.0 (0x44).
  std::vector<std::uint8_t> sums(3);
  ThreadGroup(3, kOk).run([&](ThreadComm& c) {
    const std::uint8_t v[] = {0x42, 0x3a, 0x3a};
    std::uint8_t r = 0;
    c.all_reduce(&v[c.rank()], &r, 1, DType::f8e5m2, ReduceOp::sum).wait();
    sums[static_cast<std::size_t>(c.rank())] = r;
  });
  for (auto x : sums) CHECK(int(x) == 0x45);
  // e8m0: 2^(e - 127); the patterns order as the values do.
  std::vector<std::uint8_t> maxes(3), mins(3);
  ThreadGroup(3, kOk).run([&](ThreadComm& c) {
    const std::uint8_t v[] = {126, 131, 127};
    std::uint8_t hi = 0, lo = 0;
    c.all_reduce(&v[c.rank()], &hi, 1, DType::e8m0, ReduceOp::max).wait();
    c.all_reduce(&v[c.rank()], &lo, 1, DType::e8m0, ReduceOp::min).wait();
    maxes[static_cast<std::size_t>(c.rank())] = hi, mins[static_cast<std::size_t>(c.rank())] = lo;
  });
  for (int r = 0; r < 3; ++r) CHECK((maxes[r] == 131 && mins[r] == 126));
  for (const ReduceOp op : {ReduceOp::sum, ReduceOp::avg}) {
    const auto msgs = errors_per_rank(2, kShort, [op](ThreadComm& c) {
      std::uint8_t x[2] = {127, 127}, y[1] = {};
      if (c.rank() == 0) c.reduce_scatter(x, y, 1, DType::e8m0, op).wait();
      else c.all_reduce(x, x, 2, DType::e8m0, op).wait();
    });
    for (int r = 0; r < 2; ++r) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "rank " + std::to_string(r) + ": " + (r == 0 ? "reduce_scatter" : "all_reduce")));
      CHECK(contains(msgs[r], "of e8m0 (power-of-two scales): only max and min reduce it"));
    }
  }
}

TEST_CASE("ThreadGroup refuses a timeout of 0, below 0 or over a day, naming it in ms") {
  for (const auto t : {0ms, -5ms, std::chrono::milliseconds(std::chrono::hours(24) + 1ms),
                       std::chrono::milliseconds(std::chrono::hours(24 * 365))}) {
    CAPTURE(t.count());
    std::string msg;
    try {
      ThreadGroup group(2, ThreadGroupOptions{t});
    } catch (const fsdp::Error& e) {
      msg = e.what();
    }
    CAPTURE(msg);
    CHECK(contains(msg, "ThreadGroup: timeout must be in (0 ms, 24 h], got " + std::to_string(t.count()) + " ms"));
  }
  CHECK_NOTHROW(ThreadGroup(2, ThreadGroupOptions{1ms}));
  CHECK_NOTHROW(ThreadGroup(2, ThreadGroupOptions{std::chrono::hours(24)}));
}

TEST_CASE("split groups are released when no communicator uses them") {
  const int n = 4;
  std::vector<std::size_t> baseline(n), after_splits(n), while_kept(n), at_end(n);
  std::vector<int> wrong_sum(n, 0);
  ThreadGroup(n, kOk).run([&](ThreadComm& c) {
    const int r = c.rank();
    baseline[r] = c.live_split_groups();
    for (int i = 0; i < 300; ++i) {  // each iteration makes 2 groups, then drops them
      ThreadComm half = c.split(r % 2, r);
      ThreadComm pair = half.split(0, -r);  // a split of a split
      float x = 1.0f, sum = 0.0f;
      pair.all_reduce(&x, &sum, 1, DType::f32, ReduceOp::sum).wait();
      wrong_sum[r] += sum != 2.0f;
    }
    c.barrier().wait();  // every rank has dropped its groups
    after_splits[r] = c.live_split_groups();
    ThreadComm kept = c.split(0, r);
    c.barrier().wait();
    while_kept[r] = c.live_split_groups();
    kept.barrier().wait();
  });
  for (int r = 0; r < n; ++r) {
    CAPTURE(r);
    CHECK(baseline[r] == 0);
    CHECK(wrong_sum[r] == 0);
    CHECK(after_splits[r] == baseline[r]);
    CHECK(while_kept[r] == 1);
  }
}

TEST_CASE("a split communicator kept past run() stays usable for errors, not a dangling root") {
  std::vector<std::unique_ptr<ThreadComm>> kept(2);
  ThreadGroup(2, kShort).run([&](ThreadComm& c) { kept[c.rank()] = std::make_unique<ThreadComm>(c.split(0, c.rank())); });
  CHECK(kept[0]->live_split_groups() == 1);
  // Rank 1's thread is gone: a collective reports it instead of touching freed state.
  std::string msg;
  try {
    kept[0]->barrier().wait();
  } catch (const fsdp::Error& e) {
    msg = e.what();
  }
  CAPTURE(msg);
  CHECK(contains(msg, "rank 1 finished without joining barrier"));
  kept.clear();
}

}  // namespace host_thread_group_test
