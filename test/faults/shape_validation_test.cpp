// Shapes the library cannot size (fsdp/core/tensor.hpp): a negative dimension or an element
// or byte count past what int64 / size_t hold is an fsdp::Error naming the shape and the
// tensor, never a wrapped count that allocates too little.
#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <list>
#include <span>
#include <string>
#include <vector>

#include "fsdp/core/error.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/host/thread_group.hpp"
#include "fsdp/model/shard.hpp"
#include "fsdp/core/tensor.hpp"
#include "test/support/errors.hpp"

namespace faults_shape_validation_test {

namespace {

// A tensor with just a shape, as an engine might hand one over.
struct ShapeOnly {
  std::vector<std::int64_t> dims;
};

using test_support::contains;
using test_support::error_of;

constexpr std::int64_t kMax = std::numeric_limits<std::int64_t>::max();

}  // namespace

}  // namespace faults_shape_validation_test

// (Outside this file's namespace: fsdp::tensor_traits is specialized at namespace scope.)
template <>
struct fsdp::tensor_traits<faults_shape_validation_test::ShapeOnly> {
  using ShapeOnly = faults_shape_validation_test::ShapeOnly;
  static DType dtype(const ShapeOnly&) { return DType::f32; }
  static std::span<const std::int64_t> shape(const ShapeOnly& t) { return t.dims; }
  static void* data(ShapeOnly&) { return nullptr; }
  static DeviceId device(const ShapeOnly&) { return {}; }
  static void rebind(ShapeOnly&, void*) {}
};

namespace faults_shape_validation_test {

TEST_CASE("checked_numel multiplies what fits") {
  CHECK(fsdp::checked_numel(std::vector<std::int64_t>{}, "scalar") == 1);
  CHECK(fsdp::checked_numel(std::vector<std::int64_t>{3, 0, 5}, "empty") == 0);
  CHECK(fsdp::checked_numel(std::vector<int>{2, 3, 4}, "w") == 24);
  CHECK(fsdp::checked_numel(std::list<std::size_t>{7, 11}, "w") == 77);  // any range of integers
  CHECK(fsdp::checked_numel(std::vector<std::int64_t>{kMax}, "w") == kMax);
  CHECK(fsdp::checked_numel(std::vector<std::int64_t>{std::int64_t{1} << 31, std::int64_t{1} << 31}, "w") ==
        std::int64_t{1} << 62);
  CHECK(fsdp::numel(ShapeOnly{{4, 5}}) == 20);
}

TEST_CASE("a negative dimension is an error naming the shape, the dimension and the tensor") {
  const std::string msg = error_of([] { fsdp::checked_numel(std::vector<std::int64_t>{2, -3, 4}, "blocks.0.fc1.weight"); });
  CHECK(msg == "fsdp: shape [2, -3, 4] of 'blocks.0.fc1.weight': dimension 1 (-3) is negative");
  // A zero elsewhere does not hide it.
  CHECK(contains(error_of([] { fsdp::checked_numel(std::vector<int>{0, -1}, "b"); }), "dimension 1 (-1) is negative"));
  CHECK(error_of([] { fsdp::numel(ShapeOnly{{-1}}); }) == "fsdp: shape [-1]: dimension 0 (-1) is negative");
}

TEST_CASE("an element count beyond int64 is an error, not a wrapped number") {
  // 2^32 * 2^32 wraps to 0 in int64 arithmetic.
  const std::vector<std::int64_t> wraps{std::int64_t{1} << 32, std::int64_t{1} << 32};
  CHECK(error_of([&] { fsdp::checked_numel(wraps, "embed.weight"); }) ==
        "fsdp: shape [4294967296, 4294967296] of 'embed.weight': dimension 1 (4294967296) makes the element count "
        "overflow int64");
  CHECK(contains(error_of([] { fsdp::checked_numel(std::vector<std::int64_t>{kMax, 2}, "x"); }), "overflow int64"));
  CHECK(contains(error_of([] { fsdp::numel(ShapeOnly{{3, kMax / 2}}); }), "dimension 1"));
  // An unsigned dimension past int64 on its own.
  CHECK(contains(error_of([] { fsdp::checked_numel(std::vector<std::uint64_t>{1, std::uint64_t{1} << 63}, "u"); }),
                 "dimension 1 (9223372036854775808) is beyond int64"));
}

TEST_CASE("checked_bytes refuses negative counts and byte counts past size_t") {
  CHECK(fsdp::detail::checked_bytes(std::int64_t{10}, fsdp::DType::f64, "w") == 80);
  CHECK(fsdp::detail::checked_bytes(std::size_t{0}, fsdp::DType::bf16, "w") == 0);
  CHECK(fsdp::detail::checked_bytes(kMax, fsdp::DType::u8, "w") == static_cast<std::size_t>(kMax));
  CHECK(error_of([] { fsdp::detail::checked_bytes(std::int64_t{-2}, fsdp::DType::f32, "w"); }) ==
        "fsdp: element count -2 of 'w' is negative");
  CHECK(error_of([] { fsdp::detail::checked_bytes(kMax, fsdp::DType::f32, "flat_param"); }) ==
        "fsdp: 9223372036854775807 elements of f32 of 'flat_param' are more bytes than size_t holds");
  CHECK(contains(error_of([] { fsdp::detail::checked_bytes(std::numeric_limits<std::size_t>::max() / 2, fsdp::DType::i32, ""); }),
                 "elements of i32 are more bytes than size_t holds"));
}

namespace {

// A module whose one parameter has the given shape (its gradient too).
struct Shaped {
  ShapeOnly w, g;
  template <class F>
  void visit_parameters(F&& f) { f("w", w, g); }
};
struct TwoShaped {
  Shaped a, b;
  template <class F>
  void visit_parameters(F&&) {}
  template <class F>
  void visit_children(F&& f) {
    f("a", a);
    f("b", b);
  }
};

}  // namespace

TEST_CASE("fsdp::shard sizes wrap policies with checked counts: a bad shape names its parameter first") {
  const std::vector<std::int64_t> wraps{std::int64_t{1} << 32, std::int64_t{1} << 32}, negative{4, -2};
  for (const auto& bad : {wraps, negative}) {
    fsdp::ThreadGroup(1).run([&](fsdp::ThreadComm& comm) {
      TwoShaped m{{{{2, 3}}, {{2, 3}}}, {{bad}, {bad}}};
      fsdp::HostDevice device;
      std::vector<std::string> asked;  // what the predicate was asked about, with which count
      auto pred = [&](auto&, std::string_view fqn, int, std::int64_t n) {
        asked.push_back(std::string(fqn) + "=" + std::to_string(n));
        return false;
      };
      const std::string msg = error_of([&] { fsdp::shard<fsdp::FullShard>(m, comm, device, fsdp::wrap_if(pred)); });
      CAPTURE(msg);
      CHECK(contains(msg, "of 'b.w'"));
      CHECK(contains(msg, bad == wraps ? "overflow int64" : "is negative"));
      CHECK(asked == std::vector<std::string>{"a=6"});  // never asked about 'b' with a wrapped or negative count
    });
  }
}

}  // namespace faults_shape_validation_test
