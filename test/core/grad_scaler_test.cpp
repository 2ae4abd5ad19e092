// ShardedGradScaler: exact unscaling of every gradient dtype, one agreed skip decision on
// every rank, the scale's backoff and growth, and misuse reported as fsdp::Error.
#include <doctest/doctest.h>

#include "test/support/rank_errors.hpp"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include <fsdp/comm/async_communicator.hpp>
#include <fsdp/testing/counting_communicator.hpp>
#include <fsdp/model/grad_scaler.hpp>
#include <fsdp/host/thread_group.hpp>

namespace core_grad_scaler_test {

namespace {

using fsdp::DType;
using fsdp::ShardedGradScaler;
using fsdp::ThreadComm;

const fsdp::ThreadGroupOptions kShort{std::chrono::milliseconds(2000)};

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// If ShardView carries the gradient's own dtype, keep it equal to the dtype under test.
template <class View>
void set_grad_dtype(View& v, DType t) {
  if constexpr (requires { v.grad_dtype = t; }) v.grad_dtype = t;
}

// A gradient shard of `numel` real elements followed by `pad` padding elements, stored in
// its dtype's bits; values are written and read through fsdp's bit conversions (a double
// is rounded once to f16 / bf16, not through float).
struct Grad {
  DType t;
  std::int64_t numel, pad;
  std::vector<unsigned char> bytes;

  Grad(DType t, std::int64_t numel, std::int64_t pad = 0)
      : t(t), numel(numel), pad(pad), bytes(static_cast<std::size_t>((numel + pad)) * fsdp::size_of(t)) {}

  void set(std::int64_t i, double v) {
    unsigned char* p = bytes.data() + i * fsdp::size_of(t);
    switch (t) {
      case DType::f32: { float f = static_cast<float>(v); std::memcpy(p, &f, 4); return; }
      case DType::f64: std::memcpy(p, &v, 8); return;
      case DType::f16: { std::uint16_t h = fsdp::double_to_f16_bits(v); std::memcpy(p, &h, 2); return; }
      case DType::bf16: { std::uint16_t h = fsdp::double_to_bf16_bits(v); std::memcpy(p, &h, 2); return; }
      default: { std::int32_t x = static_cast<std::int32_t>(v); std::memcpy(p, &x, fsdp::size_of(t)); return; }
    }
  }
  double get(std::int64_t i) const {
    const unsigned char* p = bytes.data() + i * fsdp::size_of(t);
    switch (t) {
      case DType::f32: { float f; std::memcpy(&f, p, 4); return f; }
      case DType::f64: { double d; std::memcpy(&d, p, 8); return d; }
      case DType::f16: { std::uint16_t h; std::memcpy(&h, p, 2); return fsdp::f16_bits_to_float(h); }
      case DType::bf16: { std::uint16_t h; std::memcpy(&h, p, 2); return fsdp::bf16_bits_to_float(h); }
      default: return 0;
    }
  }
  // The value v becomes once stored in this dtype.
  double rounded(double v) const {
    Grad tmp(t, 1);
    tmp.set(0, v);
    return tmp.get(0);
  }
  std::vector<unsigned char> padding() const {
    return {bytes.begin() + numel * static_cast<std::int64_t>(fsdp::size_of(t)), bytes.end()};
  }
  fsdp::ShardView view(std::string_view unit = "layer") {
    fsdp::ShardView v;
    v.unit = unit;
    v.dtype = t;
    set_grad_dtype(v, t);
    v.grad = bytes.data();
    v.numel = numel;
    return v;
  }
};

// Runs fn on every rank with a short timeout; returns each rank's fsdp::Error message (""
// if none). Returning at all is the no-hang check.
using test_support::contains;
using test_support::errors_per_rank;

}  // namespace

TEST_CASE("options are validated: factors positive, backoff < 1 < growth, interval >= 1, finite scale") {
  fsdp::ThreadGroup(1, kShort).run([](ThreadComm& comm) {
    using O = fsdp::GradScalerOptions;
    auto bad = [&](O o, const char* part) {
      CHECK_THROWS_WITH_AS(ShardedGradScaler<ThreadComm>(comm, o), doctest::Contains(part), fsdp::Error);
    };
    bad(O{.init_scale = 0.0}, "init_scale must be a positive finite number, got 0");
    bad(O{.init_scale = -4.0}, "init_scale must be a positive finite number");
    bad(O{.init_scale = kInf}, "init_scale must be a positive finite number");
    bad(O{.init_scale = kNaN}, "init_scale must be a positive finite number");
    bad(O{.growth_factor = 1.0}, "growth_factor must be finite and greater than 1, got 1");
    bad(O{.growth_factor = 0.5}, "growth_factor must be finite and greater than 1");
    bad(O{.growth_factor = kInf}, "growth_factor must be finite and greater than 1");
    bad(O{.backoff_factor = 1.0}, "backoff_factor must be in (0, 1), got 1");
    bad(O{.backoff_factor = 0.0}, "backoff_factor must be in (0, 1)");
    bad(O{.backoff_factor = -0.5}, "backoff_factor must be in (0, 1)");
    bad(O{.backoff_factor = kNaN}, "backoff_factor must be in (0, 1)");
    bad(O{.growth_interval = 0}, "growth_interval must be at least 1, got 0");
    CHECK_THROWS_WITH_AS(ShardedGradScaler<ThreadComm>(comm, O{.growth_interval = -3}),
                         "fsdp: ShardedGradScaler: growth_interval must be at least 1, got -3", fsdp::Error);

    ShardedGradScaler<ThreadComm> def(comm);
    CHECK(def.scale() == 65536.0);
    CHECK(def.good_steps() == 0);
    CHECK(def.scale_loss(0.75) == 0.75 * 65536.0);
    ShardedGradScaler<ThreadComm> custom(comm, O{.init_scale = 3.0, .growth_interval = 1});
    CHECK(custom.scale() == 3.0);
    CHECK(custom.scale_loss(-2.0) == -6.0);
  });
}

TEST_CASE("unscale divides f32, f64, f16 and bf16 gradients exactly by a power-of-two scale; padding untouched") {
  // True gradients, each exactly representable in its dtype (checked below), including an
  // f16 result that is subnormal and an f32 result far below f16's range.
  const std::vector<double> f32_vals = {1.5, -0.375, 3.0517578125e-05, 0.0, 0x1p-100, -12345.5};
  const std::vector<double> f64_vals = {0.1, -2.5, 1e-300, 7.0 / 3.0};
  const std::vector<double> f16_vals = {1.5, -0.375, 0.0009765625, 2.0, -60.0, 0x1p-20};
  const std::vector<double> bf16_vals = {1.5, -0.375, 0x1p40, -0x1p-60, 0.1015625};
  constexpr double kScale = 1024.0;

  fsdp::ThreadGroup(2, kShort).run([&](ThreadComm& comm) {
    ShardedGradScaler<ThreadComm> scaler(comm, {.init_scale = kScale});
    std::vector<Grad> grads;
    for (auto [t, vals] : {std::pair{DType::f32, &f32_vals}, std::pair{DType::f64, &f64_vals},
                           std::pair{DType::f16, &f16_vals}, std::pair{DType::bf16, &bf16_vals}}) {
      Grad g(t, static_cast<std::int64_t>(vals->size()), 3);
      for (std::size_t i = 0; i < vals->size(); ++i) {
        REQUIRE(g.rounded((*vals)[i]) == (*vals)[i]);  // representable: the check below is exact
        // What backward from the scaled loss produced (exact: a power-of-two multiple).
        g.set(static_cast<std::int64_t>(i), (*vals)[i] * kScale);
        REQUIRE(g.get(static_cast<std::int64_t>(i)) == (*vals)[i] * kScale);
      }
      // Padding holds values that must neither change nor count as inf/NaN.
      g.set(g.numel, kNaN);
      g.set(g.numel + 1, kInf);
      g.set(g.numel + 2, 4096.0);
      grads.push_back(std::move(g));
    }
    std::vector<std::vector<unsigned char>> pads;
    std::vector<fsdp::ShardView> views;
    for (auto& g : grads) {
      pads.push_back(g.padding());
      views.push_back(g.view());
    }

    CHECK_FALSE(scaler.unscale(views));

    const std::vector<const std::vector<double>*> expected = {&f32_vals, &f64_vals, &f16_vals, &bf16_vals};
    for (std::size_t s = 0; s < grads.size(); ++s) {
      CAPTURE(fsdp::name_of(grads[s].t));
      for (std::size_t i = 0; i < expected[s]->size(); ++i) {
        CAPTURE(i);
        CHECK(grads[s].get(static_cast<std::int64_t>(i)) == (*expected[s])[i]);
      }
      CHECK(grads[s].padding() == pads[s]);
    }
    scaler.update();
    CHECK(scaler.scale() == kScale);
    CHECK(scaler.good_steps() == 1);
  });
}

TEST_CASE("unscale by a scale that is not a power of two is within the dtype's rounding") {
  for (double scale : {3.0, 1000.0}) {
    CAPTURE(scale);
    const std::vector<double> stored = {1.0, 7.0, -100.0, 0.3, 2049.0, -5e-3};
    fsdp::ThreadGroup(2, kShort).run([&](ThreadComm& comm) {
      ShardedGradScaler<ThreadComm> scaler(comm, {.init_scale = scale});
      std::vector<Grad> grads;
      for (DType t : {DType::f32, DType::f64, DType::f16, DType::bf16}) {
        Grad g(t, static_cast<std::int64_t>(stored.size()), 1);
        for (std::size_t i = 0; i < stored.size(); ++i) g.set(static_cast<std::int64_t>(i), stored[i]);
        g.set(g.numel, 99.0);
        grads.push_back(std::move(g));
      }
      std::vector<fsdp::ShardView> views;
      for (auto& g : grads) views.push_back(g.view());
      std::vector<std::vector<double>> before(grads.size());
      for (std::size_t s = 0; s < grads.size(); ++s)
        for (std::int64_t i = 0; i < grads[s].numel; ++i) before[s].push_back(grads[s].get(i));

      CHECK_FALSE(scaler.unscale(views));

      for (std::size_t s = 0; s < grads.size(); ++s) {
        const DType t = grads[s].t;
        CAPTURE(fsdp::name_of(t));
        // One rounding to the dtype is at most half an ulp: 2^-24 (f32), 2^-53 (f64),
        // 2^-11 (f16), 2^-8 (bf16) relative; allow one ulp, and f16's subnormal spacing
        // (2^-24) absolute, since -5e-3 / 1000 is an f16 subnormal.
        const double rel = t == DType::f32 ? 0x1p-23 : t == DType::f64 ? 0x1p-51 : t == DType::f16 ? 0x1p-10 : 0x1p-7;
        const double abs = t == DType::f16 ? 0x1p-24 : 0.0;
        for (std::int64_t i = 0; i < grads[s].numel; ++i) {
          CAPTURE(i);
          const double want = before[s][i] / scale, got = grads[s].get(i);
          CAPTURE(want);
          CAPTURE(got);
          CHECK(std::fabs(got - want) <= rel * std::fabs(want) + abs);
        }
        CHECK(grads[s].get(grads[s].numel) == 99.0);
      }
    });
  }
}

TEST_CASE("inf or NaN in one rank's shard: every rank skips, halves its scale and resets its good steps") {
  struct Case {
    int bad_rank, bad_shard;
    double value;
    const char* name;
  };
  const Case cases[] = {
      {2, 0, kInf, "+inf in rank 2's f32 shard"},
      {0, 1, kNaN, "NaN in rank 0's f16 shard"},
      {3, 2, -kInf, "-inf in rank 3's bf16 shard"},
      {1, 3, kNaN, "NaN in rank 1's f64 shard"},
  };
  constexpr int kWorld = 4;
  for (const Case& c : cases) {
    CAPTURE(c.name);
    std::array<int, kWorld> step_calls{};
    std::array<bool, kWorld> skipped{};
    std::array<double, kWorld> scale_after{};
    std::array<int, kWorld> good_after{}, good_before{};
    fsdp::ThreadGroup(kWorld, kShort).run([&](ThreadComm& comm) {
      const int r = comm.rank();
      ShardedGradScaler<ThreadComm> scaler(comm, {.init_scale = 256.0, .growth_interval = 100});
      std::vector<Grad> grads = {Grad(DType::f32, 5), Grad(DType::f16, 5), Grad(DType::bf16, 5), Grad(DType::f64, 5)};
      auto fill = [&] {
        for (auto& g : grads)
          for (std::int64_t i = 0; i < 5; ++i) g.set(i, (r + 1) * (i + 1) * scaler.scale());
      };
      std::vector<fsdp::ShardView> views;
      for (auto& g : grads) views.push_back(g.view());
      for (int good = 0; good < 2; ++good) {  // two good steps first, so there is a count to reset
        fill();
        REQUIRE(scaler.step(views, [&] { ++step_calls[r]; }));
        scaler.update();
      }
      good_before[r] = scaler.good_steps();
      fill();
      if (r == c.bad_rank) grads[c.bad_shard].set(3, c.value);
      skipped[r] = scaler.step(views, [&] { ++step_calls[r]; }) == false;
      scaler.update();
      scale_after[r] = scaler.scale();
      good_after[r] = scaler.good_steps();
    });
    for (int r = 0; r < kWorld; ++r) {
      CAPTURE(r);
      CHECK(good_before[r] == 2);
      CHECK(skipped[r]);
      CHECK(step_calls[r] == 2);  // the two good steps only
      CHECK(scale_after[r] == 128.0);
      CHECK(good_after[r] == 0);
    }
  }
}

TEST_CASE("agreement: a rank without shards still joins, and an asynchronous communicator is waited on") {
  std::array<bool, 3> found{};
  fsdp::ThreadGroup(3, kShort).run([&](ThreadComm& comm) {
    fsdp::AsyncCommunicator<ThreadComm> stream(comm);
    ShardedGradScaler<fsdp::AsyncCommunicator<ThreadComm>> scaler(stream, {.init_scale = 2.0});
    Grad g(DType::f32, 4);
    for (std::int64_t i = 0; i < 4; ++i) g.set(i, 1.0);
    if (comm.rank() == 2) g.set(0, kNaN);
    std::vector<fsdp::ShardView> views;
    if (comm.rank() != 1) views.push_back(g.view());  // rank 1 holds no gradient at all
    found[comm.rank()] = scaler.unscale(views);
    scaler.update();
    CHECK(scaler.scale() == 1.0);
  });
  CHECK(found == std::array<bool, 3>{true, true, true});
}

TEST_CASE("unscaling can overflow when the scale is below 1, and that step is skipped too") {
  std::array<bool, 2> found{};
  fsdp::ThreadGroup(2, kShort).run([&](ThreadComm& comm) {
    ShardedGradScaler<ThreadComm> scaler(comm, {.init_scale = 0.5});
    Grad g(DType::f16, 2);
    g.set(0, 1.0);
    g.set(1, comm.rank() == 0 ? 40000.0 : 1.0);  // finite in f16; 80000 after unscaling is not
    found[comm.rank()] = scaler.unscale(std::vector{g.view()});
    CHECK(std::isinf(g.get(1)) == (comm.rank() == 0));
  });
  CHECK(found == std::array<bool, 2>{true, true});
}

TEST_CASE("the scale grows after growth_interval consecutive good steps, on every rank at the same step") {
  constexpr int kWorld = 3;
  // (bad step?, scale after update, good steps after update), with growth_interval 3.
  struct Expect { bool bad; double scale; int good; };
  const std::vector<Expect> expected = {
      {false, 8, 1}, {false, 8, 2}, {false, 16, 0},                  // three good: doubles
      {false, 16, 1}, {false, 16, 2}, {true, 8, 0},                  // a bad step breaks the streak
      {false, 8, 1}, {false, 8, 2}, {false, 16, 0}, {false, 16, 1},  // and counting starts again
  };
  std::array<std::vector<Expect>, kWorld> seen;
  std::array<std::vector<double>, kWorld> optimizer_saw;
  fsdp::ThreadGroup(kWorld, kShort).run([&](ThreadComm& comm) {
    const int r = comm.rank();
    ShardedGradScaler<ThreadComm> scaler(comm, {.init_scale = 8.0, .growth_factor = 2.0, .backoff_factor = 0.5,
                                                .growth_interval = 3});
    Grad g(DType::f32, 2);
    for (const Expect& e : expected) {
      const double true_grad = 0.25 * (r + 1);
      g.set(0, scaler.scale_loss(true_grad));  // what backward from the scaled loss gives
      g.set(1, (e.bad && r == 1) ? kNaN : 3.0 * scaler.scale());
      const bool ran = scaler.step(std::vector{g.view()}, [&] { optimizer_saw[r].push_back(g.get(0)); });
      CHECK(ran == !e.bad);
      scaler.update();
      seen[r].push_back({!ran, scaler.scale(), scaler.good_steps()});
    }
  });
  for (int r = 0; r < kWorld; ++r) {
    CAPTURE(r);
    REQUIRE(seen[r].size() == expected.size());
    for (std::size_t i = 0; i < expected.size(); ++i) {
      CAPTURE(i);
      CHECK(seen[r][i].bad == expected[i].bad);
      CHECK(seen[r][i].scale == expected[i].scale);
      CHECK(seen[r][i].good == expected[i].good);
    }
    // The optimizer ran on the 9 good steps and always saw the true (unscaled) gradient.
    CHECK(optimizer_saw[r] == std::vector<double>(9, 0.25 * (r + 1)));
  }
}

TEST_CASE("growth stops short of overflowing the scale to inf") {
  fsdp::ThreadGroup(1, kShort).run([](ThreadComm& comm) {
    ShardedGradScaler<ThreadComm> scaler(comm, {.init_scale = 1e308, .growth_interval = 1});
    Grad g(DType::f64, 1);
    g.set(0, 1.0);
    CHECK(scaler.step(std::vector{g.view()}, [] {}));
    scaler.update();
    CHECK(scaler.scale() == 1e308);
    CHECK(scaler.good_steps() == 0);
  });
}

TEST_CASE("the optimizer sees unscaled gradients: step() unscales once, whether or not unscale() ran first") {
  fsdp::ThreadGroup(2, kShort).run([](ThreadComm& comm) {
    ShardedGradScaler<ThreadComm> scaler(comm, {.init_scale = 64.0, .growth_interval = 1000});
    Grad g(DType::bf16, 3);
    const double truth[] = {0.5, -1.25, 96.0};
    auto backward = [&] { for (int i = 0; i < 3; ++i) g.set(i, truth[i] * scaler.scale()); };
    auto seen_by_optimizer = [&] { return std::vector<double>{g.get(0), g.get(1), g.get(2)}; };
    const std::vector<double> want(std::begin(truth), std::end(truth));
    std::vector<fsdp::ShardView> views{g.view()};

    backward();  // step() alone unscales
    std::vector<double> seen;
    CHECK(scaler.step(views, [&] { seen = seen_by_optimizer(); }));
    CHECK(seen == want);
    scaler.update();

    backward();  // unscale() first (say, to clip gradients), then step() must not unscale again
    CHECK_FALSE(scaler.unscale(views));
    CHECK(seen_by_optimizer() == want);
    seen.clear();
    CHECK(scaler.step(views, [&] { seen = seen_by_optimizer(); }));
    CHECK(seen == want);
    scaler.update();
    CHECK(scaler.good_steps() == 2);
  });
}

TEST_CASE("misuse is an fsdp::Error: update without unscale, unscale twice, step twice") {
  fsdp::ThreadGroup(2, kShort).run([](ThreadComm& comm) {
    ShardedGradScaler<ThreadComm> scaler(comm);
    Grad g(DType::f32, 2);
    g.set(0, 65536.0);
    g.set(1, 131072.0);
    std::vector<fsdp::ShardView> views{g.view()};

    CHECK_THROWS_WITH_AS(scaler.update(), doctest::Contains("update() called without unscale() or step()"), fsdp::Error);

    CHECK_FALSE(scaler.unscale(views));
    CHECK_THROWS_WITH_AS(scaler.unscale(views),
                         doctest::Contains("unscale() called again after unscale() without update() in between; the "
                                           "gradients would be divided by the scale twice"),
                         fsdp::Error);
    CHECK(g.get(0) == 1.0);  // the refused second call left the gradients alone
    CHECK(g.get(1) == 2.0);

    int calls = 0;
    CHECK(scaler.step(views, [&] { ++calls; }));
    CHECK_THROWS_WITH_AS(scaler.step(views, [&] { ++calls; }), doctest::Contains("step() called twice since the last update()"),
                         fsdp::Error);
    CHECK_THROWS_WITH_AS(scaler.unscale(views), doctest::Contains("unscale() called again after step()"), fsdp::Error);
    CHECK(calls == 1);
    CHECK(g.get(0) == 1.0);

    scaler.update();
    CHECK_THROWS_WITH_AS(scaler.update(), doctest::Contains("update() called without unscale() or step()"), fsdp::Error);
    CHECK(scaler.good_steps() == 1);  // the refused update changed nothing
    CHECK(scaler.scale() == 65536.0);
  });
}

TEST_CASE("a shard one rank cannot unscale fails every rank, naming the rank, without a hang") {
  struct Case {
    const char* name;
    DType t;
    bool null_grad;
    std::int64_t numel;
    const char* own;
  };
  const Case cases[] = {
      {"i32 gradient", DType::i32, false, 2, "has gradient dtype i32; only f32, f64, f16 and bf16 gradients can be unscaled"},
      {"null gradient", DType::f32, true, 2, "has no gradient buffer (grad is null)"},
      {"negative numel", DType::f32, false, -1, "has negative numel -1"},
  };
  for (const Case& c : cases) {
    CAPTURE(c.name);
    auto msgs = errors_per_rank(3, [&](ThreadComm& comm) {
      ShardedGradScaler<ThreadComm> scaler(comm);
      Grad good(DType::f32, 2), bad(c.t, 2);
      std::vector<fsdp::ShardView> views{good.view("a")};
      if (comm.rank() == 1) {
        fsdp::ShardView v = bad.view("blocks.3");
        if (c.null_grad) v.grad = nullptr;
        v.numel = c.numel;
        views.push_back(v);
      }
      scaler.unscale(views);
    });
    CHECK(contains(msgs[1], "fsdp: ShardedGradScaler: unscale() on rank 1: shard 1 of unit 'blocks.3' "));
    CHECK(contains(msgs[1], c.own));
    for (int r : {0, 2}) {
      CAPTURE(msgs[r]);
      CHECK(contains(msgs[r], "unscale() on rank " + std::to_string(r) +
                                  ": rank 1 passed gradient shards it cannot unscale (see that rank's error)"));
    }
  }
}

TEST_CASE("gradients that are never finite back the scale off until it underflows, then an fsdp::Error") {
  int skipped_before_error = 0;
  auto msgs = errors_per_rank(2, [&](ThreadComm& comm) {
    ShardedGradScaler<ThreadComm> scaler(comm, {.init_scale = 1e-300, .backoff_factor = 0.5});
    Grad g(DType::f32, 1);
    for (int step = 0; step < 100; ++step) {
      g.set(0, comm.rank() == 0 ? kNaN : 1.0);  // a NaN loss: no scale helps
      CHECK_FALSE(scaler.step(std::vector{g.view()}, [] { FAIL("stepped on NaN gradients"); }));
      if (comm.rank() == 0) skipped_before_error = step + 1;
      scaler.update();
      REQUIRE(scaler.scale() >= std::numeric_limits<double>::min());
    }
  });
  // 1e-300 halves 26 times to 1.49e-308, below the smallest normal double 2.2e-308.
  int expected_skips = 0;
  for (double s = 1e-300; s >= std::numeric_limits<double>::min(); s *= 0.5) ++expected_skips;
  CHECK(expected_skips == 26);
  CHECK(skipped_before_error == expected_skips);
  for (int r = 0; r < 2; ++r) {
    CAPTURE(msgs[r]);
    CHECK(contains(msgs[r], "the loss scale underflowed"));
    CHECK(contains(msgs[r], "the loss or the model itself is probably not finite"));
  }
}

TEST_CASE("mini training loop: an overflowing fp16 gradient backs the scale off until steps succeed, on every rank alike") {
  // Loss L = sum_i c_i * w_i, so dL/dw_i = c_i. Backward runs in fp16 from the scaled loss:
  // the gradient is fp16(c_i * scale). Rank 3's c = 40 overflows fp16 (max 65504) at every
  // scale above 1024, and rank 1's 3.5 above 16384; ranks 0 and 2 never overflow locally.
  // From 65536 the scale halves 6 times to 1024 (6 skipped steps); then every 3 good steps
  // it grows to 2048, which overflows once more and backs off to 1024.
  const std::array<std::array<double, 2>, 4> coeff = {{{0.125, -0.25}, {3.5, 1.0}, {0.0009765625, 2.0}, {40.0, -0.5}}};
  const std::vector<double> want_scale = {65536, 32768, 16384, 8192, 4096, 2048, 1024,
                                          1024,  1024,  2048,  1024, 1024, 1024, 2048};
  const std::vector<bool> want_ran = {false, false, false, false, false, false, true,
                                      true,  true,  false, true,  true,  true,  false};
  const int kIters = static_cast<int>(want_scale.size());
  constexpr float kLr = 0.5f;

  std::array<std::vector<double>, 4> scales;
  std::array<std::vector<bool>, 4> ran;
  std::array<std::array<float, 2>, 4> weights{};
  std::array<fsdp::CollectiveCounts, 4> counts;
  fsdp::ThreadGroup(4, kShort).run([&](ThreadComm& comm) {
    const int r = comm.rank();
    fsdp::CountingCommunicator<ThreadComm> counted(comm);
    ShardedGradScaler<fsdp::CountingCommunicator<ThreadComm>> scaler(counted, {.growth_interval = 3});
    std::array<float, 2> w = {1.0f, 1.0f};  // f32 master weights
    Grad g(DType::f16, 2, 2);               // fp16 gradient shard, with padding
    g.set(2, 0.0);
    g.set(3, 0.0);
    fsdp::ShardView view = g.view("mlp");
    view.param = w.data();
    for (int it = 0; it < kIters; ++it) {
      scales[r].push_back(scaler.scale());
      const double seed = scaler.scale_loss(1.0);  // dL_scaled/dL: the output gradient's seed
      for (int i = 0; i < 2; ++i) g.set(i, seed * coeff[r][i]);
      const bool stepped = scaler.step(std::span(&view, 1), [&] {
        auto* p = static_cast<float*>(view.param);
        for (int i = 0; i < 2; ++i) p[i] -= kLr * static_cast<float>(g.get(i));
      });
      ran[r].push_back(stepped);
      scaler.update();
    }
    weights[r] = w;
    counts[r] = counted.counts();
  });
  const int steps = static_cast<int>(std::count(want_ran.begin(), want_ran.end(), true));
  CHECK(steps == 6);
  for (int r = 0; r < 4; ++r) {
    CAPTURE(r);
    CHECK(scales[r] == want_scale);
    CHECK(ran[r] == want_ran);
    for (int i = 0; i < 2; ++i) CHECK(weights[r][i] == static_cast<float>(1.0 - steps * 0.5 * coeff[r][i]));
    // One all_reduce of one f32 flag per step, and nothing else.
    CHECK(counts[r][fsdp::Collective::all_reduce].calls == static_cast<std::uint64_t>(kIters));
    CHECK(counts[r][fsdp::Collective::all_reduce].bytes == static_cast<std::uint64_t>(kIters) * 4);
    CHECK(counts[r][fsdp::Collective::all_gather].calls == 0);
    CHECK(counts[r][fsdp::Collective::reduce_scatter].calls == 0);
    CHECK(counts[r][fsdp::Collective::broadcast].calls == 0);
    CHECK(counts[r][fsdp::Collective::barrier].calls == 0);
  }
}

TEST_CASE("the gradient dtype comes from ShardView::grad_dtype where the view has one") {
  struct Old { DType dtype = DType::f16; };
  struct WithGradDtype { DType dtype = DType::bf16; DType grad_dtype = DType::f32; };
  CHECK(fsdp::detail::grad_dtype_of(Old{}) == DType::f16);
  CHECK(fsdp::detail::grad_dtype_of(WithGradDtype{}) == DType::f32);
  fsdp::ShardView v;
  v.dtype = DType::f64;
  set_grad_dtype(v, DType::f64);
  CHECK(fsdp::detail::grad_dtype_of(v) == DType::f64);
}

// A HostDevice that counts its unscale calls, the elements they covered and the waits for
// the inf/NaN flag, to see that a scaler built with a Device unscales through it.
struct CountingUnscaleDevice : fsdp::HostDevice {
  int calls = 0, waits = 0;
  std::size_t elements = 0;
  void unscale(void* p, std::size_t n, DType t, double inv) {
    ++calls;
    elements += n;
    fsdp::HostDevice::unscale(p, n, t, inv);
  }
  bool found_nonfinite() {
    ++waits;
    return fsdp::HostDevice::found_nonfinite();
  }
};

TEST_CASE("built with a Device, the scaler unscales through it, with the same results and decisions") {
  static_assert(fsdp::UnscalingDevice<CountingUnscaleDevice>);
  fsdp::ThreadGroup(2, kShort).run([&](ThreadComm& comm) {
    CountingUnscaleDevice device;
    ShardedGradScaler<ThreadComm> on_device(comm, device, {.init_scale = 1024.0});
    ShardedGradScaler<ThreadComm> on_host(comm, {.init_scale = 1024.0});
    for (int round = 0; round < 2; ++round) {  // round 1 puts an inf in rank 1's shard
      std::vector<Grad> a = {Grad(DType::f32, 7, 1), Grad(DType::bf16, 4), Grad(DType::f16, 0)};
      for (auto& g : a)
        for (std::int64_t i = 0; i < g.numel; ++i) g.set(i, (comm.rank() + 1) * (i - 3) * 1024.0 / 3);
      if (round == 1 && comm.rank() == 1) a[1].set(2, kInf);
      std::vector<Grad> b = a;
      std::vector<fsdp::ShardView> va, vb;
      for (auto& g : a) va.push_back(g.view());
      for (auto& g : b) vb.push_back(g.view());
      const int calls_before = device.calls;
      const bool skip_device = on_device.unscale(va), skip_host = on_host.unscale(vb);
      CHECK(skip_device == (round == 1));  // every rank skips when one rank saw inf
      CHECK(skip_host == skip_device);
      CHECK(device.calls - calls_before == 2);  // the empty shard is not visited
      CHECK(device.waits == round + 1);         // one wait per step, not per shard
      for (std::size_t k = 0; k < a.size(); ++k) CHECK(a[k].bytes == b[k].bytes);  // padding untouched in both
      on_device.update();
      on_host.update();
      CHECK(on_device.scale() == on_host.scale());
    }
    CHECK(device.elements == 2 * (7 + 4));
  });
}

TEST_CASE("state() / load_state(): a scaler resumed from another's state makes the same decisions from then on") {
  fsdp::ThreadGroup(1, kShort).run([](ThreadComm& comm) {
    const fsdp::GradScalerOptions options{.init_scale = 8.0, .growth_factor = 2.0, .backoff_factor = 0.5, .growth_interval = 3};
    // One step: a finite gradient, or NaN where `bad`; returns (scale, good steps) after update().
    auto run = [](ShardedGradScaler<ThreadComm>& scaler, bool bad) {
      Grad g(DType::f32, 1);
      g.set(0, bad ? kNaN : scaler.scale_loss(0.5));
      scaler.step(std::vector{g.view()}, [] {});
      scaler.update();
      return std::pair{scaler.scale(), scaler.good_steps()};
    };
    const std::vector<bool> before = {false, true, false, false, false, false};  // ends mid-streak: good_steps 1
    const std::vector<bool> after = {false, false, true, false, false, false, false};
    ShardedGradScaler<ThreadComm> original(comm, options);
    for (bool bad : before) run(original, bad);
    const fsdp::GradScalerState saved = original.state();
    CHECK(saved.scale == original.scale());
    CHECK(saved.good_steps == original.good_steps());
    REQUIRE(saved.good_steps == 1);  // a growth tracker a fresh scaler would not have

    ShardedGradScaler<ThreadComm> resumed(comm, options), fresh(comm, options);
    resumed.load_state(saved);
    bool fresh_differs = false;
    for (bool bad : after) {
      const auto want = run(original, bad);
      CHECK(run(resumed, bad) == want);
      fresh_differs = fresh_differs || run(fresh, bad) != want;
    }
    CHECK(fresh_differs);  // without the loaded state the scale would have gone another way
  });
}

TEST_CASE("load_state() refuses a bad scale or growth tracker, and a call in the middle of a step; nothing changes") {
  fsdp::ThreadGroup(1, kShort).run([](ThreadComm& comm) {
    ShardedGradScaler<ThreadComm> scaler(comm, {.init_scale = 16.0, .growth_interval = 4});
    for (double scale : {0.0, -2.0, kInf, kNaN})
      CHECK_THROWS_WITH_AS(scaler.load_state({scale, 0}), doctest::Contains("the scale must be a positive finite number"),
                           fsdp::Error);
    for (int good : {-1, 4, 5})
      CHECK_THROWS_WITH_AS(scaler.load_state({2.0, good}), doctest::Contains("good_steps must be in [0, growth_interval 4)"),
                           fsdp::Error);
    Grad g(DType::f32, 1);
    g.set(0, 16.0);
    CHECK_FALSE(scaler.unscale(std::vector{g.view()}));
    CHECK_THROWS_WITH_AS(scaler.load_state({2.0, 0}), doctest::Contains("load_state() between unscale()/step() and update()"),
                         fsdp::Error);
    CHECK(scaler.scale() == 16.0);
    CHECK(scaler.good_steps() == 0);
    scaler.update();
    scaler.load_state({2.0, 3});
    CHECK(scaler.state().scale == 2.0);
    CHECK(scaler.state().good_steps == 3);
  });
}

}  // namespace core_grad_scaler_test
