// What a user types, refused at the door: flags' and environment variables' values are read
// whole (fsdp/core/parse.hpp), products of user-given sizes are checked, and option values
// that mean nothing are refused; every refusal is an fsdp::Error naming the input (the
// variable, the option, the field) and its value, never a value read as something else.
#include <doctest/doctest.h>

#include <clocale>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "examples/engine/fsdp_integration.hpp"
#include "fsdp/core/device_mesh.hpp"
#include "fsdp/core/dist_env.hpp"
#include "fsdp/core/error.hpp"
#include "fsdp/core/parse.hpp"
#include "fsdp/host/thread_group.hpp"
#include "fsdp/model/memory_plan.hpp"
#include "fsdp/model/shard.hpp"
#include "test/support/errors.hpp"
#include "test/support/scoped_env.hpp"

namespace faults_input_validation_test {

namespace {

using test_support::contains;
using test_support::error_of;
using test_support::ScopedEnv;
namespace d = fsdp::detail;

constexpr int kIntMax = std::numeric_limits<int>::max();

// One unit of 4 f32 elements, planned by hand.
std::vector<fsdp::PlannedUnit> one_unit() {
  std::vector<fsdp::PlannedUnit> units(1);
  units[0].flat = {{fsdp::DType::f32, 4}};
  return units;
}

}  // namespace

TEST_CASE("integers are read whole, in range, naming the input") {
  CHECK(d::parse_integer<int>("42", "--steps") == 42);
  CHECK(d::parse_integer<int>("-7", "x") == -7);
  CHECK(d::parse_integer<int>("010", "x") == 10);  // decimal, not octal
  for (const char* bad : {"", "2abc", " 5", "5 ", "+5", "0x10", "1e3", "1.0", "nan", "true"})
    CHECK(error_of([&] { d::parse_integer<int>(bad, "--steps"); }) ==
          "fsdp: --steps: '" + std::string(bad) + "' is not an integer");
  CHECK(error_of([&] { d::parse_integer<int>("0", "--steps", 1, 100); }) ==
        "fsdp: --steps: 0 is out of range; it must be in [1, 100]");
  CHECK(contains(error_of([&] { d::parse_integer<int>("99999999999", "--steps"); }), "--steps: 99999999999 is out of range"));
  CHECK(contains(error_of([&] { d::parse_integer<std::uint16_t>("-1", "MASTER_PORT"); }), "MASTER_PORT: '-1' is not an integer"));
}

TEST_CASE("reals are finite numbers read whole") {
  CHECK(d::parse_real("0.5", "--clip") == 0.5);
  CHECK(d::parse_real("1e-3", "--clip") == 1e-3);
  for (const char* bad : {"nan", "NaN", "inf", "-inf", "infinity", "0x1p3", "", " 1", "1 ", "1.5x", "abc", "+1", "1,5"})
    CHECK(contains(error_of([&] { d::parse_real(bad, "--clip"); }), "--clip: '" + std::string(bad) + "' is not a finite number"));
  CHECK(contains(error_of([&] { d::parse_real("1e400", "--clip"); }), "--clip: 1e400 is out of range"));
  CHECK(contains(error_of([&] { d::parse_real("-1", "--clip", 0.0); }), "--clip: -1 is out of range; it must be in [0, "));
  // The C locale's decimal point does not matter (a host program may have set its own).
  for (const char* comma_locale : {"de_DE.UTF-8", "fr_FR.UTF-8", "de_DE", "fr_FR"}) {
    if (!std::setlocale(LC_NUMERIC, comma_locale)) continue;  // not installed here
    CAPTURE(comma_locale);
    const double half = d::parse_real("0.5", "--clip");
    std::setlocale(LC_NUMERIC, "C");
    CHECK(half == 0.5);
    break;
  }
}

TEST_CASE("booleans are 1/0, true/false, yes/no, on/off and nothing else") {
  for (const char* yes : {"1", "true", "TRUE", "yes", "Yes", "on"}) CHECK(d::parse_bool(yes, "b"));
  for (const char* no : {"0", "false", "False", "no", "NO", "off"}) CHECK_FALSE(d::parse_bool(no, "b"));
  for (const char* bad : {"", "2", "-1", "enable", "+", "truee", "y", " 1"}) {
    CHECK_FALSE(d::as_bool(bad).has_value());
    CHECK(error_of([&] { d::parse_bool(bad, "--reshard-after-backward"); }) ==
          "fsdp: --reshard-after-backward: '" + std::string(bad) + "' is not a boolean; write 1/0, true/false, yes/no or on/off");
  }
}

TEST_CASE("environment variables: unset or empty is nullopt, anything set is read strictly, naming the variable") {
  ScopedEnv env("FSDP_TEST_INPUT", std::nullopt);
  CHECK_FALSE(d::env_bool("FSDP_TEST_INPUT").has_value());
  CHECK_FALSE(d::env_integer<int>("FSDP_TEST_INPUT").has_value());
  env.set("FSDP_TEST_INPUT", "");
  CHECK_FALSE(d::env_bool("FSDP_TEST_INPUT").has_value());
  env.set("FSDP_TEST_INPUT", "false");
  CHECK(d::env_bool("FSDP_TEST_INPUT") == false);
  env.set("FSDP_TEST_INPUT", "12");
  CHECK(d::env_integer<int>("FSDP_TEST_INPUT", 1, 20) == 12);
  CHECK(contains(error_of([&] { d::env_integer<int>("FSDP_TEST_INPUT", 1, 10); }),
                 "environment variable FSDP_TEST_INPUT: 12 is out of range"));
  env.set("FSDP_TEST_INPUT", "maybe");
  CHECK(contains(error_of([&] { d::env_bool("FSDP_TEST_INPUT"); }), "environment variable FSDP_TEST_INPUT: 'maybe' is not a boolean"));
}

TEST_CASE("FSDP_TCP_SHM is read as a boolean: false turns shared memory off, garbage is refused") {
  // TcpComm reads it through env_bool (test/asio/tcp_shm_test.cpp checks the links it makes).
  ScopedEnv env("FSDP_TCP_SHM", "false");
  CHECK(d::env_bool("FSDP_TCP_SHM") == false);
  env.set("FSDP_TCP_SHM", "off");
  CHECK(d::env_bool("FSDP_TCP_SHM") == false);
  env.set("FSDP_TCP_SHM", "fasle");
  CHECK(contains(error_of([&] { d::env_bool("FSDP_TCP_SHM"); }), "FSDP_TCP_SHM: 'fasle' is not a boolean"));
}

TEST_CASE("the launch environment's numbers are read whole") {
  ScopedEnv env("WORLD_SIZE", "4");
  CHECK(fsdp::DistEnv::number("WORLD_SIZE", 1, 8, true) == 4);
  for (const char* bad : {" 4", "+4", "4abc", "0x4", "4.0"}) {
    env.set("WORLD_SIZE", bad);
    CHECK(contains(error_of([&] { fsdp::DistEnv::number("WORLD_SIZE", 1, 8, true); }),
                   "environment: WORLD_SIZE: '" + std::string(bad) + "' is not an integer"));
  }
  env.set("WORLD_SIZE", "9");
  CHECK(contains(error_of([&] { fsdp::DistEnv::number("WORLD_SIZE", 1, 8, true); }),
                 "environment: WORLD_SIZE: 9 is out of range; it must be in [1, 8]"));
}

TEST_CASE("TORCHELASTIC_RESTART_COUNT: 0 when unset, read whole when set") {
  ScopedEnv env("RANK", "1");
  env.set("WORLD_SIZE", "2");
  env.set("MASTER_ADDR", "127.0.0.1");
  env.set("MASTER_PORT", "29500");
  env.set("TORCHELASTIC_RESTART_COUNT", std::nullopt);
  CHECK(fsdp::DistEnv::from_env().restart_count == 0);
  env.set("TORCHELASTIC_RESTART_COUNT", "3");
  CHECK(fsdp::DistEnv::from_env().restart_count == 3);
  env.set("TORCHELASTIC_RESTART_COUNT", "-1");
  CHECK(contains(error_of([] { fsdp::DistEnv::from_env(); }), "environment: TORCHELASTIC_RESTART_COUNT: -1 is out of range"));
}

TEST_CASE("checked_product refuses a product that overflows, naming what it counts") {
  CHECK(d::checked_product(46340, 46340, "n") == 2147395600);
  CHECK(error_of([&] { d::checked_product(5002, 858650, "ranks"); }) ==
        "fsdp: ranks: 5002 x 858650 overflows (the most is " + std::to_string(kIntMax) + ")");
  CHECK(contains(error_of([&] { d::checked_product<std::int64_t>(std::int64_t{1} << 32, std::int64_t{1} << 31, "bytes"); }),
                 "bytes: 4294967296 x 2147483648 overflows"));
}

TEST_CASE("a mesh shape whose ranks overflow an int is refused, not wrapped to a small world") {
  // 5002 x 858650 = 4294967300 = 2^32 + 4: wrapped to int, a 4-rank world.
  CHECK(error_of([] { fsdp::parse_mesh_shape("5002x858650"); }) ==
        "fsdp: mesh shape '5002x858650': 5002 x 858650 = 4294967300 ranks, more than an int counts (2147483647)");
  CHECK(contains(error_of([] { fsdp::parse_mesh_shape("5002x858650", "--mesh"); }), "--mesh '5002x858650': 5002 x 858650"));
  CHECK(contains(error_of([] { fsdp::parse_mesh_shape("1x99999999999", "--mesh"); }),
                 "--mesh '1x99999999999': SHARD: 99999999999 is out of range"));
  CHECK(fsdp::parse_mesh_shape("1x2147483647").size() == kIntMax);
  CHECK(fsdp::parse_mesh_shape("01x4") == fsdp::MeshShape{1, 4});
  const fsdp::MeshShape wide{5002, 858650};
  CHECK(wide.ranks() == 4294967300);
  CHECK(contains(error_of([&] { (void)wide.size(); }), "mesh shape 5002x858650: its number of ranks: 5002 x 858650 overflows"));
}

TEST_CASE("a device mesh whose product overflows is refused on a world it wraps to, naming both numbers") {
  std::vector<std::string> errors(4);
  fsdp::ThreadGroup(4).run([&](fsdp::ThreadComm& comm) {
    errors[static_cast<std::size_t>(comm.rank())] = error_of([&] { fsdp::DeviceMesh mesh(comm, fsdp::MeshShape{5002, 858650}); });
  });
  for (int r = 0; r < 4; ++r)
    CHECK(errors[static_cast<std::size_t>(r)] == "fsdp: device mesh on rank " + std::to_string(r) +
                                                     ": shape 5002x858650 (replicate x shard) needs 4294967300 ranks but "
                                                     "the communicator has 4");
}

TEST_CASE("PlanOptions: every number out of range is refused, naming the field") {
  const auto units = one_unit();
  auto refusal = [&](const fsdp::PlanOptions& o) { return error_of([&] { fsdp::plan<fsdp::FullShard>(units, o); }); };
  CHECK(fsdp::plan<fsdp::FullShard>(units, {.mesh = {1, 2}}).peak_bytes() > 0);
  CHECK(refusal({.mesh = {5002, 858650}}) ==
        "fsdp: fsdp::plan: PlanOptions::mesh 5002x858650 is 4294967300 ranks, more than an int counts (2147483647)");
  CHECK(refusal({.mesh = {1, 2}, .persistence_threshold = -5}) ==
        "fsdp: fsdp::plan: PlanOptions::persistence_threshold must be >= 0 (0: every unit follows its strategy), got -5");
  CHECK(contains(refusal({.mesh = {1, 2}, .max_prefetched = -1}), "PlanOptions::max_prefetched) must be >= 0, got -1"));
  CHECK(contains(refusal({.mesh = {1, 2}, .steps = 0}), "PlanOptions::steps must be >= 1 and at most 1000"));
  CHECK(contains(refusal({.mesh = {1, 2}, .steps = 1001}), "PlanOptions::steps must be >= 1 and at most 1000"));
  CHECK(contains(refusal({.mesh = {1, 2}, .micro_batches = -3}), "PlanOptions::micro_batches must be >= 1"));
  CHECK(contains(refusal({.mesh = {1, 2}, .micro_batches = kIntMax}), "PlanOptions::micro_batches must be >= 1 and at most 65536"));
  const std::size_t negative = static_cast<std::size_t>(std::int64_t{-64});
  CHECK(contains(refusal({.mesh = {1, 2}, .engine_state = {negative, 0}}), "PlanOptions::engine_state[device] is 18446744073709551552 bytes"));
  auto hooked = units;
  hooked[0].post_accumulate_grad_hook = fsdp::GradientAfterHook::keep;
  CHECK(contains(error_of([&] {
                   fsdp::plan<fsdp::FullShard>(hooked, {.mesh = {1, 2}, .engine_state_in_hook = {{"", {0, negative}}}});
                 }),
                 "PlanOptions::engine_state_in_hook['']"));
}

TEST_CASE("PlannedUnit sizes: a negative buffer or a byte count past int64 is refused, naming the unit") {
  auto units = one_unit();
  units[0].fqn = "";
  units[0].buffers = {{fsdp::DType::f32, -1}};
  CHECK(contains(error_of([&] { fsdp::plan<fsdp::FullShard>(units, {.mesh = {1, 2}}); }), "has a buffer of -1 elements"));
  units[0].buffers = {{fsdp::DType::f32, std::int64_t{1} << 62}};
  CHECK(contains(error_of([&] { fsdp::plan<fsdp::FullShard>(units, {.mesh = {1, 2}}); }),
                 "the bytes of a buffer: 4611686018427387904 x 4 overflows"));
}

TEST_CASE("ShardOptions::persistence_threshold < 0 is refused on every rank, naming the option and the unit") {
  const engine::ModelConfig config{.in = 4, .dim = 8, .hidden = 16, .out = 2, .blocks = 1, .seed = 1};
  std::vector<std::string> errors(2);
  fsdp::ThreadGroup(2).run([&](fsdp::ThreadComm& comm) {
    engine::Model model(config);
    fsdp::HostDevice device;
    errors[static_cast<std::size_t>(comm.rank())] = error_of([&] {
      fsdp::shard<fsdp::FullShard>(model, comm, device, engine::Wrap{}, fsdp::ShardOptions{.persistence_threshold = -5});
    });
  });
  for (int r = 0; r < 2; ++r)
    CHECK(contains(errors[static_cast<std::size_t>(r)],
                   "on rank " + std::to_string(r) + ": ShardOptions::persistence_threshold must be >= 0 (0: every unit follows "
                                                    "its strategy), got -5"));
}

}  // namespace faults_input_validation_test
