#!/usr/bin/env bash
# fsdp's CMake package, as a user gets it (issue 39): installed into a fresh prefix, then found
# from that prefix alone; and through FetchContent (add_subdirectory) from a source tree.
#
#  1. configure fsdp (CMakeLists.txt, cmake/, include/, src/ copied alone into a scratch
#     tree: the package needs nothing else), build it and `cmake --install` it into an empty
#     prefix; the prefix holds the package files, every header, fsdp::separate's library, and
#     no path of the source or build tree;
#  2. configure test/cmake/consumer with CMAKE_PREFIX_PATH naming that prefix only (no
#     package registry; its sources in a tree without include/, so fsdp's headers can come
#     from the install only): find_package(fsdp CONFIG REQUIRED COMPONENTS checkpoint asio
#     mpi); build examples/train, test/checkpoint/safetensors_test.cpp and
#     test/core/separate_compilation_test.cpp (doctest; the latter on the prefix's
#     libfsdp_separate.a), parts_check.cpp (every part that loaded: cuda and nccl too where
#     the CUDA toolkit is) and, where libtorch's CMake package is (libtorch-dev),
#     torch_check.cpp on fsdp::torch;
#  3. run them: the example trains 2 thread ranks for 3 steps with a checkpoint and prints
#     its `final:` line, the doctest binaries pass, parts_check and torch_check print ok;
#  4. the same consumer through FetchContent from the fsdp source tree, its tiny set:
#     parts_check, run; torch_check generated but not built (fsdp::torch's usage
#     requirements resolve from the consumer's directory); the subproject compiles nothing
#     of fsdp (fsdp::separate's library is built only for a program that links it).
#     Configured and built on one core while step 2's build compiles examples/train.cpp on
#     the other;
#  5. clear failures: a component fsdp does not have, a component whose dependency is not
#     found (CMAKE_DISABLE_FIND_PACKAGE_nlohmann_json; and _Torch where fsdp::torch is
#     checked), a version the package refuses.
#
# fsdp::torch is checked where libtorch's CMake package is installed (Debian's libtorch-dev:
# /usr/lib/<arch>/cmake/Torch/TorchConfig.cmake; tools/setup.sh installs it): fsdp is then
# configured with FSDP_WITH_TORCH=ON, so a libtorch that is there but not found fails the
# check. Without it, FSDP_WITH_TORCH=OFF and the script says so.
#
# Usage: tools/cmake_check.sh [ROOT]   ROOT is the repository (default: the one holding this
# script; under `bazel test`, the runfiles tree: //test/cmake:cmake_package_test).
# JOBS sets the build parallelism (default 2). KEEP=1 keeps the scratch tree. Builds at -O0
# without debug information. Cost: 125 to 160 s of CPU (120 to 150 s before fsdp::torch was
# checked, in the same runs interleaved, on the 2-core development machine at load 2 to 5),
# half of it compiling examples/train.cpp (one translation unit), about 16 s torch_check.cpp
# (fsdp/torch/tensor_traits.hpp includes all of <torch/torch.h>; ATen's tensor alone would
# be 2 s). Every other file is compiled once: fsdp_separate.cpp only for the install, not
# again for the FetchContent build, and one doctest main for both doctest binaries. Wall
# time is examples/train.cpp's compile and the machine's load: 100 to 215 s with 2 jobs.
# Last line: "tests: N passed, M failed" (each numbered check above is one or more tests);
# exits non-zero when one failed.
set -uo pipefail
root=${1:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
root=$(cd "$root" && pwd)
jobs=${JOBS:-2}
start=$SECONDS

passed=0 failed=0
# A doctest binary's summary line is quoted as "doctest:": tools/test_summary.py totals the
# "[doctest] test cases:" lines of a test's log, and this script is one test there.
pass() { echo "PASS: ${1//'[doctest] test cases:'/doctest:}"; passed=$((passed + 1)); }
fail() { echo "FAIL: ${1//'[doctest] test cases:'/doctest:}"; failed=$((failed + 1)); }
finish() {
  local took
  took=$(cd "${tmp:-/nonexistent}/log" 2>/dev/null && for f in *.s; do [[ -f $f ]] && printf '%s %s s, ' "${f%.s}" "$(cat "$f")"; done)
  # CPU seconds of everything run (the compilers mostly): what the load of the machine does
  # not change.
  local cpu=?
  if [[ -d ${tmp:-} ]]; then
    times >"$tmp/log/times"  # in this shell: a pipe or $(...) would time a subshell
    cpu=$(tail -n 1 "$tmp/log/times" | awk '{ t = 0; for (i = 1; i <= NF; i++) { split($i, p, "m"); t += p[1] * 60 + p[2] } printf "%d", t }')
  fi
  echo "cmake_check: $((SECONDS - start)) s with $jobs jobs, $cpu s of CPU (${took%, })"
  echo "tests: $passed passed, $failed failed"
  ((failed == 0))
  exit $?
}

# Nothing from the caller's environment may point CMake at a package: the prefix is the one place.
unset CMAKE_PREFIX_PATH fsdp_DIR fsdp_ROOT CMAKE_INSTALL_PREFIX
command -v cmake >/dev/null || { fail "cmake is not installed (tools/setup.sh installs it)"; finish; }

tmp=$(mktemp -d "${TEST_TMPDIR:-${TMPDIR:-/tmp}}/fsdp-cmake.XXXXXX")
if [[ ${KEEP:-0} == 1 ]]; then echo "cmake_check: scratch tree $tmp"; else trap 'rm -rf "$tmp"' EXIT; fi
mkdir -p "$tmp/log"

# step NAME COMMAND...: runs COMMAND with its output in log/NAME.log and its seconds in
# log/NAME.s; on failure shows the log's end. Returns COMMAND's status.
step() {
  local name=$1 t0=$SECONDS
  shift
  "$@" >"$tmp/log/$name.log" 2>&1
  local rc=$?
  echo $((SECONDS - t0)) >"$tmp/log/$name.s"
  ((rc == 0)) || show_log "$name" "$rc"
  return $rc
}
show_log() {
  echo "--- $1 exited with $2; the end of its output:"
  tail -n 40 "$tmp/log/$1.log"
  echo "---"
}

# Scratch copies (cp -L: under Bazel the tree is symlinks into the source tree).
#   fsdp/  what the package is made of, nothing else;
#   src/   the consumer's own sources: examples/, tools/launcher/, the test files; no include/.
mkdir -p "$tmp/fsdp" "$tmp/src/tools" "$tmp/src/test/checkpoint" "$tmp/src/test/support" \
  "$tmp/src/test/core" "$tmp/src/test/cmake"
copied=1
cp -RL "$root/CMakeLists.txt" "$root/cmake" "$root/include" "$root/src" "$tmp/fsdp/" || copied=0
cp -RL "$root/examples" "$tmp/src/" || copied=0
cp -RL "$root/tools/launcher" "$tmp/src/tools/" || copied=0
cp -L "$root/test/doctest_main.cpp" "$tmp/src/test/" || copied=0
cp -L "$root/test/checkpoint/safetensors_test.cpp" "$root/test/checkpoint/checkpoint_test_support.hpp" \
  "$tmp/src/test/checkpoint/" || copied=0
cp -L "$root/test/support/errors.hpp" "$tmp/src/test/support/" || copied=0
cp -L "$root/test/core/separate_compilation_test.cpp" "$tmp/src/test/core/" || copied=0
cp -RL "$root/test/cmake/consumer" "$tmp/src/test/cmake/" || copied=0
if ((!copied)); then fail "copying the sources from $root"; finish; fi
chmod -R u+w "$tmp/fsdp" "$tmp/src"

# Cheap builds: -O0, no -g; no user or system package registry.
common=(-DCMAKE_BUILD_TYPE= -DCMAKE_CXX_FLAGS=-O0 -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF
  -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF)
prefix=$tmp/prefix
headers=$(cd "$tmp/fsdp/include" && find fsdp -name '*.hpp' | wc -l)

# fsdp::torch where libtorch's CMake package is installed (see above).
torch=OFF
if compgen -G '/usr/lib/*/cmake/Torch/TorchConfig.cmake' >/dev/null; then
  torch=ON
else
  echo "cmake_check: no libtorch CMake package (/usr/lib/<arch>/cmake/Torch, Debian: libtorch-dev): fsdp::torch is not checked"
fi

# ---- 1. install into an empty prefix ----------------------------------------------------------
if step fsdp-configure cmake -S "$tmp/fsdp" -B "$tmp/build/fsdp" "${common[@]}" \
  -DCMAKE_INSTALL_PREFIX="$prefix" -DFSDP_BUILD_EXAMPLES=OFF \
  -DFSDP_WITH_CHECKPOINT=ON -DFSDP_WITH_ASIO=ON -DFSDP_WITH_MPI=ON -DFSDP_WITH_SEPARATE=ON \
  -DFSDP_WITH_TORCH=$torch; then
  pass "fsdp configures ($(grep -o 'fsdp: fsdp::[a-z]*$' "$tmp/log/fsdp-configure.log" | sed 's/fsdp: //' | tr '\n' ' '))"
else
  fail "fsdp configures"
fi
if step fsdp-build cmake --build "$tmp/build/fsdp" --parallel "$jobs" &&
  step fsdp-install cmake --install "$tmp/build/fsdp"; then
  pass "fsdp builds and installs into $prefix"
else
  fail "fsdp builds and installs"
fi
cmakedir=$(dirname "$(find "$prefix" -name fsdpConfig.cmake 2>/dev/null | head -n 1)")
problems=""
wanted=(fsdpConfig.cmake fsdpConfigVersion.cmake fsdpDependencies.cmake fsdp-core-targets.cmake
  fsdp-checkpoint-targets.cmake fsdp-asio-targets.cmake fsdp-mpi-targets.cmake fsdp-separate-targets.cmake)
[[ $torch == ON ]] && wanted+=(fsdp-torch-targets.cmake)
for f in "${wanted[@]}"; do
  [[ -f $cmakedir/$f ]] || problems+=" no $f;"
done
installed=$(find "$prefix/include/fsdp" -name '*.hpp' 2>/dev/null | wc -l)
((installed == headers)) || problems+=" $installed headers installed of $headers;"
[[ -n $(find "$prefix" -name 'libfsdp_separate.a') ]] || problems+=" no libfsdp_separate.a;"
leaks=$(grep -rlF -e "$tmp/fsdp" -e "$tmp/build" "${cmakedir:-$prefix}" 2>/dev/null)
[[ -z $leaks ]] || problems+=" source or build paths in: $leaks;"
if [[ -z $problems ]]; then
  pass "the prefix holds the package ($cmakedir), $installed headers, libfsdp_separate.a, no source or build path"
else
  fail "the installed prefix:$problems"
fi

# ---- 2. a consumer that finds the installed package --------------------------------------------
consumer=$tmp/build/consumer
if step consumer-configure cmake -S "$tmp/src/test/cmake/consumer" -B "$consumer" "${common[@]}" \
  -DCMAKE_PREFIX_PATH="$prefix" -DFSDP_CONSUMER_SOURCE_ROOT="$tmp/src"; then
  found=$(sed -n 's/^fsdp_DIR:PATH=//p' "$consumer/CMakeCache.txt")
  if [[ $found == "$prefix"/* ]]; then
    pass "find_package(fsdp CONFIG REQUIRED COMPONENTS checkpoint asio mpi) from the prefix alone ($(grep -o 'fsdp 0[^(]*' "$tmp/log/consumer-configure.log" | head -n 1))"
  else
    fail "the consumer found fsdp at '$found', not in $prefix"
  fi
else
  fail "the consumer configures against the installed package"
fi
# The FetchContent build (step 4) runs meanwhile, one job: examples/train.cpp is one
# translation unit, so the consumer's build leaves a core idle for much of its time.
fetch=$tmp/build/fetch
(
  cmake -S "$tmp/src/test/cmake/consumer" -B "$fetch" "${common[@]}" -DFSDP_FETCH_SOURCE_DIR="$tmp/fsdp" \
    -DFSDP_CONSUMER_PROGRAMS=tiny -DFSDP_CONSUMER_SOURCE_ROOT="$tmp/src" -DFSDP_WITH_TORCH=$torch \
    >"$tmp/log/fetch-configure.log" 2>&1 ||
    exit 1
  cmake --build "$fetch" --parallel 1 >"$tmp/log/fetch-build.log" 2>&1 || exit 2
) &
fetch_pid=$!
fetch_t0=$SECONDS
built="examples/train, safetensors_test, separate_compilation_test, parts_check"
[[ $torch == ON ]] && built+=", torch_check"
if step consumer-build cmake --build "$consumer" --parallel "$jobs"; then
  pass "the consumer builds $built against the installed package"
else
  fail "the consumer builds against the installed package"
fi

# ---- 3. run them ----------------------------------------------------------------------------
if [[ -x $consumer/fsdp_train ]]; then
  out=$(cd "$tmp" && "$consumer/fsdp_train" --ranks 2 --steps 3 --save "$tmp/ckpt" 2>&1)
  rc=$?
  final=$(grep '^final: ' <<<"$out")
  if ((rc == 0)) && [[ -n $final ]]; then
    pass "examples/train (installed package) trains 2 ranks for 3 steps and saves: $final"
  else
    fail "examples/train (installed package) exited with $rc; its output ends: $(tail -n 5 <<<"$out")"
  fi
else
  fail "examples/train was not built"
fi
# doctest_binary NAME WHAT: runs the consumer's fsdp_NAME; passes when its cases all pass.
doctest_binary() {
  local name=$1 what=$2 out rc summary
  if [[ -x $consumer/fsdp_$name ]]; then
    out=$(cd "$tmp" && "$consumer/fsdp_$name" 2>&1)
    rc=$?
    summary=$(grep '\[doctest\] test cases:' <<<"$out" | sed 's/\x1b\[[0-9;]*m//g')
    if ((rc == 0)) && [[ $summary =~ [1-9][0-9]*\ passed.*\ 0\ failed ]]; then
      pass "$what (installed package): $summary"
    else
      fail "$what (installed package) exited with $rc: $summary $(tail -n 20 <<<"$out")"
    fi
  else
    fail "$what was not built"
  fi
}
doctest_binary safetensors_test safetensors_test
doctest_binary separate_test "fsdp::separate's test (separate_compilation_test on libfsdp_separate.a)"
if [[ -x $consumer/fsdp_parts_check ]]; then
  out=$("$consumer/fsdp_parts_check" 2>&1)
  rc=$?
  if ((rc == 0)) && grep -q '^parts_check: ok$' <<<"$out"; then
    pass "parts_check (installed package): $(grep -o '^fsdp::[a-z]*' <<<"$out" | tr '\n' ' ')"
  else
    fail "parts_check (installed package) exited with $rc: $out"
  fi
else
  fail "parts_check was not built"
fi
if [[ $torch == ON ]]; then
  if [[ -x $consumer/fsdp_torch_check ]]; then
    out=$("$consumer/fsdp_torch_check" 2>&1)
    rc=$?
    if ((rc == 0)) && grep -q '^torch_check: ok$' <<<"$out"; then
      pass "torch_check (installed package): $(grep -m1 '^fsdp::torch' <<<"$out")"
    else
      fail "torch_check (installed package) exited with $rc: $out"
    fi
  else
    fail "torch_check was not built (fsdp::torch did not load in the consumer?)"
  fi
fi

# ---- 4. FetchContent (add_subdirectory) from the source tree ----------------------------------
wait "$fetch_pid"
fetch_rc=$?
echo $((SECONDS - fetch_t0)) >"$tmp/log/fetch-build.s"
if ((fetch_rc == 0)); then
  pass "FetchContent: the consumer configures and builds parts_check"
else
  if ((fetch_rc == 1)); then show_log fetch-configure 1; else show_log fetch-build 1; fi
  fail "FetchContent: the consumer configures and builds"
fi
if [[ -x $fetch/fsdp_parts_check ]]; then
  parts=$("$fetch/fsdp_parts_check" 2>&1)
  prc=$?
  compiled=$(find "$fetch" -name '*.a' -o -name '*.so' | sed "s|^$fetch/||")
  torch_ok=1 torch_said=""
  if [[ $torch == ON ]]; then
    torch_said="; fsdp::torch's targets resolve from the consumer (torch_check generated)"
    [[ -d $fetch/CMakeFiles/fsdp_torch_check.dir ]] || torch_ok=0
  fi
  if ((prc == 0 && torch_ok)) && grep -q '^parts_check: ok$' <<<"$parts" && [[ -z $compiled ]]; then
    pass "FetchContent: parts_check ($(grep -o '^fsdp::[a-z]*' <<<"$parts" | tr '\n' ' ')) passes$torch_said; the subproject compiled no library of fsdp"
  else
    fail "FetchContent: parts_check exited with $prc: $parts; torch_check generated: $torch_ok; libraries the subproject built (none expected): ${compiled:-none}"
  fi
else
  fail "FetchContent: parts_check was not built"
fi

# ---- 5. what a wrong request gets --------------------------------------------------------------
# refused NAME EXPECTED-TEXT FIND-PACKAGE-ARGUMENTS [CMAKE ARGS...]: a project whose one line is
# find_package(fsdp ARGUMENTS) fails to configure, and says EXPECTED-TEXT.
refused() {
  local name=$1 want=$2 args=$3
  shift 3
  mkdir -p "$tmp/$name"
  printf 'cmake_minimum_required(VERSION 3.20)\nproject(%s LANGUAGES CXX)\nfind_package(fsdp %s)\n' \
    "$name" "$args" >"$tmp/$name/CMakeLists.txt"
  cmake -S "$tmp/$name" -B "$tmp/build/$name" "${common[@]}" -DCMAKE_PREFIX_PATH="$prefix" "$@" \
    >"$tmp/log/$name.log" 2>&1
  local rc=$?
  local said
  said=$(tr -s ' \n' ' ' <"$tmp/log/$name.log")
  if ((rc != 0)) && [[ $said == *"$want"* ]]; then
    pass "find_package(fsdp $args)${*:+ with $*} fails, saying: $want"
  else
    fail "find_package(fsdp $args) $*: exit status $rc, wanted a failure saying '$want'; it said: $(tail -n 15 "$tmp/log/$name.log")"
  fi
}
refused unknown_component "fsdp has no component 'nosuchpart'" "CONFIG REQUIRED COMPONENTS checkpoint nosuchpart"
refused missing_dependency "fsdp::checkpoint needs nlohmann_json" "CONFIG REQUIRED COMPONENTS checkpoint" \
  -DCMAKE_DISABLE_FIND_PACKAGE_nlohmann_json=ON
if [[ $torch == ON ]]; then
  refused missing_torch "fsdp::torch needs Torch" "CONFIG REQUIRED COMPONENTS torch" -DCMAKE_DISABLE_FIND_PACKAGE_Torch=ON
fi
refused wrong_version "fsdpConfig.cmake, version: 0.1.0" "1.0 CONFIG REQUIRED"

finish
