#!/usr/bin/env bash
# Compile-time diagnostics: misusing a policy, a tensor type or a communicator must stop
# compilation with the library's own readable message, and correct code must compile.
#
# Usage: policy_errors_test.sh [INCLUDE_DIR]
#   INCLUDE_DIR defaults to <this script's dir>/../../include. From a Bazel sh_test, put
#   the headers in `data` (e.g. data = ["//:fsdp"] or a glob of include/fsdp/**) and pass
#   their directory relative to the runfiles root, where the test runs: args = ["include"].
# Needs only bash, g++, grep and mktemp. Prints one line per case; exits non-zero if any
# case is wrong.
set -u

inc="${1:-$(dirname "$0")/../../include}"
if [[ ! -f "$inc/fsdp/policy/policies.hpp" ]]; then
  echo "FAIL: include dir '$inc' has no fsdp/policy/policies.hpp"
  exit 2
fi
if ! command -v g++ >/dev/null 2>&1; then
  echo "FAIL: g++ not found on PATH"
  exit 2
fi

tmp="$(mktemp -d "${TEST_TMPDIR:-${TMPDIR:-/tmp}}/fsdp_policy_errors.XXXXXX")" || exit 2
trap 'rm -rf "$tmp"' EXIT

failures=0

# A precompiled fsdp/fsdp.hpp, for the snippets whose first line includes it: they spend 5.3 s
# of 5.6 on it without one, 2.0 s with one (g++ 12, December 2026). The PCH comes in
# (-include) before the snippet's first line, which includes the same header, so the snippet
# sees nothing it would not see alone. g++ reads the header itself where the PCH is missing or
# does not fit (-include names the header; its .gch sits beside it), so the PCH cannot change a
# result, only the time.
pch="$tmp/pch/fsdp_pch.hpp"
mkdir -p "$tmp/pch"
echo '#include "fsdp/fsdp.hpp"' >"$pch"
g++ -std=c++20 -I"$inc" -x c++-header "$pch" -o "$pch.gch" >"$tmp/pch/build.log" 2>&1 ||
  echo "note: the PCH of fsdp/fsdp.hpp did not build (every snippet reads the header):" "$(head -c 400 "$tmp/pch/build.log")"

# compile NAME: compiles $tmp/NAME.cpp (syntax and template instantiation only) and
# leaves the diagnostics in $tmp/NAME.log. Returns g++'s exit status.
compile() {
  local first
  first=$(head -n 1 "$tmp/$1.cpp")
  local -a pch_args=()
  [[ $first == '#include "fsdp/fsdp.hpp"' ]] && pch_args=(-include "$pch")
  g++ -std=c++20 -fsyntax-only -I"$inc" ${pch_args[@]+"${pch_args[@]}"} "$tmp/$1.cpp" >"$tmp/$1.log" 2>&1
}

# expect_error NAME MESSAGE < SOURCE: the snippet must fail to compile, and the
# diagnostics must contain MESSAGE (a fixed string).
expect_error() {
  local name="$1" message="$2"
  cat >"$tmp/$name.cpp"
  if compile "$name"; then
    echo "FAIL: $name: compiled, expected an error containing \"$message\""
    failures=$((failures + 1))
  elif ! grep -qF -- "$message" "$tmp/$name.log"; then
    echo "FAIL: $name: failed to compile but without \"$message\"; diagnostics:"
    sed 's/^/    /' "$tmp/$name.log" | head -n 30
    failures=$((failures + 1))
  else
    echo "PASS: $name: rejected with \"$message\""
  fi
}

# expect_ok NAME < SOURCE: the snippet must compile cleanly.
expect_ok() {
  local name="$1"
  cat >"$tmp/$name.cpp"
  if compile "$name"; then
    echo "PASS: $name: compiles"
  else
    echo "FAIL: $name: expected to compile; diagnostics:"
    sed 's/^/    /' "$tmp/$name.log" | head -n 30
    failures=$((failures + 1))
  fi
}

expect_error non_policy_argument "is not an fsdp policy" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<int> p;
EOF

expect_error two_sharding_strategies "more than one policy for the ShardingStrategy slot" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::FullShard, fsdp::FullShard> p;
EOF

expect_error two_different_strategies "more than one policy for the ShardingStrategy slot" <<'EOF'
#include "fsdp/policy/policies.hpp"
struct MyStrategy { using fsdp_policy_slot = fsdp::sharding_strategy_slot; };
fsdp::Policies<fsdp::NoOffload, MyStrategy, fsdp::FullShard> p;
EOF

expect_error two_comm_precisions "more than one policy for the CommPrecision slot" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::CommPrecision<fsdp::bf16>, fsdp::FullShard, fsdp::FullCommPrecision> p;
EOF

expect_error comm_precision_integer "CommPrecision dtypes must be floating point" <<'EOF'
#include <cstdint>
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::CommPrecision<std::int32_t>> p;
EOF

expect_error comm_precision_8bit "the 8-bit floats need per-block scales" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::CommPrecision<fsdp::f8e4m3>> p;
EOF

expect_error comm_precision_e5m2_names_blocks "fsdp::F8E5M2Blocks<128>, fsdp::MXFP8); the 8-bit floats need per-block scales" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::CommPrecision<fsdp::f8e5m2>> p;
EOF

expect_error mixed_precision_8bit "MixedPrecision dtypes must be floating point" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::MixedPrecision<float, fsdp::e8m0>> p;
EOF

expect_error block_gather_without_reduce "block formats quantize all-gathers only; write CommPrecision<fsdp::Int8Blocks<128>, float>" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::CommPrecision<fsdp::Int8Blocks<>>> p;
EOF

expect_error block_gather_empty_block "Int8Blocks<Block> needs a positive Block" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::CommPrecision<fsdp::Int8Blocks<0>, float>> p;
EOF

expect_error block_gather_empty_e5m2_block "F8E5M2Blocks<Block> needs a positive Block" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::CommPrecision<fsdp::F8E5M2Blocks<0>, float>> p;
EOF

expect_error block_gather_wrong_mx_block "block format has a block its format cannot have" <<'EOF'
#include "fsdp/policy/policies.hpp"
struct MyMx {  // a user's own block format: MXFP8 with blocks of 64
  static constexpr fsdp::QuantFormat format = fsdp::QuantFormat::mxfp8;
  static constexpr std::size_t block = 64;
};
fsdp::Policies<fsdp::CommPrecision<MyMx, float>> p;
EOF

expect_ok block_gather_under_mixed_precision <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::MixedPrecision<fsdp::bf16>, fsdp::CommPrecision<fsdp::MXFP8, fsdp::bf16>> p;
static_assert(decltype(p)::comm_precision::quantized);
EOF

expect_error comm_and_mixed_reduce "both choose the gradient reduction dtype" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::MixedPrecision<float, fsdp::bf16>, fsdp::CommPrecision<fsdp::bf16>> p;
EOF

expect_error comm_wider_than_compute "must be MixedPrecision's Param" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::CommPrecision<float>, fsdp::MixedPrecision<fsdp::bf16>> p;
EOF

expect_error comm_same_size_as_compute "must be MixedPrecision's Param" <<'EOF'
#include "fsdp/policy/policies.hpp"
fsdp::Policies<fsdp::MixedPrecision<fsdp::f16>, fsdp::CommPrecision<fsdp::bf16>> p;
EOF

expect_ok comm_precision_in_any_order <<'EOF'
#include <type_traits>
#include "fsdp/policy/policies.hpp"
using A = fsdp::Policies<fsdp::CommPrecision<fsdp::bf16>, fsdp::MixedPrecision<float>, fsdp::FullShard>;
using B = fsdp::Policies<fsdp::FullShard, fsdp::MixedPrecision<float>, fsdp::CommPrecision<fsdp::bf16>>;
static_assert(std::is_same_v<A::comm_precision, B::comm_precision>);
fsdp::Policies<fsdp::MixedPrecision<fsdp::bf16>, fsdp::CommPrecision<fsdp::bf16>> same_as_param;
EOF

# fsdp::shard's wrap options: only wrap options, at most one of each kind.
shard_prelude='#include "fsdp/fsdp.hpp"
struct Net { fsdp::HostTensor w{{2, 2}}; };
template <class F> void visit_parameters(Net& n, F&& f) { f("w", n.w); }'

expect_error shard_non_option "is not a wrap option" <<EOF
$shard_prelude
void f(Net& n, fsdp::ThreadComm& c, fsdp::HostDevice& d) { auto m = fsdp::shard<fsdp::FullShard>(n, c, d, 42); }
EOF

expect_error shard_two_min_params "at most one wrap_min_params" <<EOF
$shard_prelude
void f(Net& n, fsdp::ThreadComm& c, fsdp::HostDevice& d) {
  auto m = fsdp::shard<fsdp::FullShard>(n, c, d, fsdp::wrap_min_params(1), fsdp::wrap_min_params(2));
}
EOF

expect_error unknown_tensor_type "no fsdp::tensor_traits" <<'EOF'
#include <cstdint>
#include "fsdp/core/tensor.hpp"
struct MyTensor { int rows = 2, cols = 3; };
std::int64_t f(const MyTensor& t) { return fsdp::numel(t); }
EOF

expect_error not_a_communicator "is not an fsdp::Communicator" <<'EOF'
#include "fsdp/core/communicator.hpp"
void f() { fsdp::check_communicator<int>(); }
EOF

expect_error hybrid_without_mesh "pass an fsdp::DeviceMesh instead of a communicator" <<'EOF'
#include "fsdp/fsdp.hpp"
struct M {
  fsdp::HostTensor w{{2}}, g{{2}};
  template <class F> void visit_parameters(F&& f) { f("w", w, g); }
};
void f(fsdp::ThreadComm& c, fsdp::HostDevice& d, M& m) { fsdp::Sharded<M, fsdp::HybridShard> u(m, c, d); }
EOF

expect_error unit_lookup_by_pointer "pass the module itself" <<'EOF'
#include "fsdp/fsdp.hpp"
struct M {};
void f(fsdp::ShardedModel& sm, M& m) { sm.find_unit_for(&m); }
EOF

expect_error root_not_a_module "the model passed to fsdp::shard is not an fsdp::Module" <<'EOF'
#include "fsdp/fsdp.hpp"
struct NotAModule {};
void f(fsdp::ThreadComm& c, fsdp::HostDevice& d, NotAModule& m) { fsdp::shard<fsdp::FullShard>(m, c, d); }
EOF

# A parameter or gradient the visit passes as const (a const visit_parameters, or a const
# member): the library rebinds both, so it must say so, not fail deep inside the unit.
expect_error const_gradient "visit_parameters passed a const gradient" <<'EOF'
#include "fsdp/fsdp.hpp"
struct M {
  fsdp::HostTensor w{{2}}, g{{2}};
  template <class F> void visit_parameters(F&& f) { const fsdp::HostTensor& cg = g; f("w", w, cg); }
};
void f(fsdp::ThreadComm& c, fsdp::HostDevice& d, M& m) { auto sm = fsdp::shard<fsdp::FullShard>(m, c, d); }
EOF

expect_error const_visit "visit_parameters passed a const parameter" <<'EOF'
#include "fsdp/fsdp.hpp"
struct M {
  fsdp::HostTensor w{{2}}, g{{2}};
  template <class F> void visit_parameters(F&& f) const { f("w", w, g); }
};
void f(fsdp::ThreadComm& c, fsdp::HostDevice& d, M& m) { auto sm = fsdp::shard<fsdp::FullShard>(m, c, d); }
EOF

# The same kinds of use, done right: must compile (so the errors above come from the
# misuse, not from the snippets' scaffolding).
expect_error scaler_device_without_unscale "needs a Device with unscale(ptr, count, dtype, inv_scale) and found_nonfinite()" <<'EOF'
#include "fsdp/model/grad_scaler.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/host/thread_group.hpp"
struct PlainDevice : fsdp::HostDevice { void unscale() = delete; };  // a Device without unscale
void f(fsdp::ThreadComm& comm, PlainDevice& d) { fsdp::ShardedGradScaler scaler(comm, d); }
EOF

expect_error block_gather_device_without_quantize "needs a device that quantizes" <<EOF
$shard_prelude
struct PlainDevice : fsdp::HostDevice { void quantize() = delete; };  // a Device without quantize
void f(Net& n, fsdp::ThreadComm& c, PlainDevice& d) {
  auto m = fsdp::shard<fsdp::FullShard, fsdp::CommPrecision<fsdp::Int8Blocks<>, float>>(n, c, d);
}
EOF

expect_error tensor_gather_device_without_abs_max "needs a device that scales per tensor" <<EOF
$shard_prelude
struct PlainDevice : fsdp::HostDevice { void abs_max() = delete; };  // quantizes in blocks, not per tensor
void f(Net& n, fsdp::ThreadComm& c, PlainDevice& d) {
  auto m = fsdp::shard<fsdp::FullShard, fsdp::CommPrecision<fsdp::F8E4M3Tensor, float>>(n, c, d);
}
EOF

expect_ok block_gather_device_without_abs_max <<EOF
$shard_prelude
struct PlainDevice : fsdp::HostDevice { void abs_max() = delete; };  // block formats need no per-tensor ops
static_assert(fsdp::QuantizingDevice<PlainDevice> && !fsdp::TensorScalingDevice<PlainDevice>);
void f(Net& n, fsdp::ThreadComm& c, PlainDevice& d) {
  auto m = fsdp::shard<fsdp::FullShard, fsdp::CommPrecision<fsdp::F8E5M2Blocks<>, float>>(n, c, d);
}
EOF

expect_error tensor_gather_with_a_block "block format has a block its format cannot have" <<'EOF'
#include "fsdp/policy/policies.hpp"
struct MyTensor {  // a per-tensor format given a block
  static constexpr fsdp::QuantFormat format = fsdp::QuantFormat::f8e4m3_tensor;
  static constexpr std::size_t block = 128;
};
fsdp::Policies<fsdp::CommPrecision<MyTensor, float>> p;
EOF

expect_ok scaler_on_a_device <<'EOF'
#include "fsdp/model/grad_scaler.hpp"
#include "fsdp/host/host_device.hpp"
#include "fsdp/host/thread_group.hpp"
void f(fsdp::ThreadComm& comm, fsdp::HostDevice& d) {
  fsdp::ShardedGradScaler scaler(comm, d, fsdp::GradScalerOptions{.init_scale = 1024});  // as in the docs
  static_assert(std::is_same_v<decltype(scaler), fsdp::ShardedGradScaler<fsdp::ThreadComm>>);
  fsdp::GradScalerOptions o;
  fsdp::ShardedGradScaler<fsdp::ThreadComm> on_host(comm, o);  // options, not a device
}
EOF

expect_ok valid_usage <<'EOF'
#include <cstdint>
#include <span>
#include <type_traits>
#include "fsdp/core/communicator.hpp"
#include "fsdp/policy/policies.hpp"
#include "fsdp/core/tensor.hpp"
#include "fsdp/host/host_tensor.hpp"
#include "fsdp/host/thread_group.hpp"

struct MyTensor { std::int64_t shape_[2] = {2, 3}; void* data_ = nullptr; };
template <> struct fsdp::tensor_traits<MyTensor> {
  static fsdp::DType dtype(const MyTensor&) { return fsdp::DType::f32; }
  static std::span<const std::int64_t> shape(const MyTensor& t) { return t.shape_; }
  static void* data(MyTensor& t) { return t.data_; }
  static fsdp::DeviceId device(const MyTensor&) { return {}; }
  static void rebind(MyTensor& t, void* p) { t.data_ = p; }
};

fsdp::Policies<fsdp::NoOffload, fsdp::FullShard> p;
static_assert(std::is_same_v<decltype(p)::strategy, fsdp::FullShard>);
std::int64_t f(const MyTensor& t) { return fsdp::numel(t); }
std::int64_t g(const fsdp::HostTensor& t) { return fsdp::numel(t); }
void h() { fsdp::check_communicator<fsdp::ThreadComm>(); }
EOF

# Gradients the library owns (f(name, param)): a visit with too many arguments, and
# gradient() handed a pointer instead of the parameter tensor.
expect_error visit_too_many_arguments "visit_parameters called f with too many arguments" <<'EOF'
#include "fsdp/fsdp.hpp"
struct M {
  fsdp::HostTensor w{{2}}, g{{2}}, h{{2}};
  template <class F> void visit_parameters(F&& f) { f("w", w, g, h); }
};
void f(fsdp::ThreadComm& c, fsdp::HostDevice& d, M& m) { fsdp::Sharded<M, fsdp::FullShard> u(m, c, d); }
EOF

expect_error gradient_of_pointer "gradient(param) takes the parameter tensor the module visited" <<'EOF'
#include "fsdp/fsdp.hpp"
void f(fsdp::ShardedModel& sm, fsdp::HostTensor& w) { (void)sm.gradient(&w); }
EOF

# Module adapters (fsdp::module_adapter): a named adapter is shared or moved, never copied
# out of the engine's reach; one adapter per model.
expect_error adapter_lvalue "pass the adapter as a std::shared_ptr" <<'EOF'
#include "fsdp/fsdp.hpp"
struct A {};
void f(A& a) { (void)fsdp::module_adapter(a); }
EOF

expect_error adapter_pointer "not a raw pointer, std::ref or std::unique_ptr" <<'EOF'
#include "fsdp/fsdp.hpp"
struct A {};
void f(A& a) { (void)fsdp::module_adapter(&a); }
EOF

expect_error adapter_unique_ptr "not a raw pointer, std::ref or std::unique_ptr" <<'EOF'
#include "fsdp/fsdp.hpp"
#include <memory>
struct A {};
void f() { (void)fsdp::module_adapter(std::make_unique<A>()); }
EOF

expect_error adapter_twice "fsdp::shard takes at most one module_adapter" <<'EOF'
#include "fsdp/fsdp.hpp"
struct M {
  fsdp::HostTensor w{{2}};
  template <class F> void visit_parameters(F&& f) { f("w", w); }
};
struct A {};
void f(fsdp::ThreadComm& c, fsdp::HostDevice& d, M& m) {
  (void)fsdp::shard<fsdp::FullShard>(m, c, d, fsdp::module_adapter(A{}), fsdp::module_adapter(A{}));
}
EOF

expect_error adapter_visits_nothing "the model passed to fsdp::shard is not an fsdp::Module" <<'EOF'
#include "fsdp/fsdp.hpp"
struct M { fsdp::HostTensor w{{2}}; };
struct A { template <class F> void visit_parameters(int&, F&&) {} };
void f(fsdp::ThreadComm& c, fsdp::HostDevice& d, M& m) {
  (void)fsdp::shard<fsdp::FullShard>(m, c, d, fsdp::module_adapter(A{}));
}
EOF

if [[ $failures -ne 0 ]]; then
  echo "$failures case(s) wrong"
  exit 1
fi
echo "all cases as expected"
