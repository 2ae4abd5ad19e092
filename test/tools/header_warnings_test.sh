#!/usr/bin/env bash
# The library's headers compile without a single warning under -Wall -Wextra -Wpedantic
# (-Werror), with g++ 12 and clang 14, and each header compiles on its own (it includes what
# it uses). Third-party headers come in as system headers, so only ours count: Boost,
# nlohmann, doctest, xxhash, fmt from /usr/include (a system directory already), MPI and
# CUDA/NCCL by -isystem.
#
# What compiles (-fsyntax-only, in parallel):
#  - every header of include/fsdp and examples/engine on its own, with clang++-14: the
#    self-containment check (both compilers use the same libstdc++, so one is enough) and
#    clang's warnings;
#  - one file including every header, with g++-12: g++'s warnings in every header;
#  - test/tools/header_warnings_engine.cpp with each compiler: the templates instantiated
#    the way the reference engine does (shard<FullShard>, training steps, MixedPrecision,
#    offload, checkpoint save and load), for the warnings inside template bodies; and once
#    more with g++ under FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp), whose own source,
#    fsdp/separate_compilation.hpp, is compiled in that mode too;
#  - a canary: a header of ours with an unused variable must fail, or the flags are wrong.
#  - the libtorch adapter's headers (fsdp/torch/) each on its own with g++-12 only, libtorch's
#    C++ API by -isystem: clang 14 cannot parse libtorch 1.13's headers as C++20. They are
#    not in the all-in-one file (each includes libtorch, 5 to 25 s to parse); the torch tests
#    (//test/torch, g++ -Werror) instantiate them. Where libtorch is not installed
#    (/usr/include/torch/csrc/api/include/torch/torch.h), they are reported skipped.
# A middle-end warning (those -O2 finds) is not in reach of -fsyntax-only.
#
# Usage: header_warnings_test.sh [ROOT]   ROOT holds include/, examples/engine/ and this
# test's engine file (default: the current directory, as under `bazel test`). JOBS sets the
# parallelism (default: nproc). Cost: about 350 s of CPU (clang's 150 headers on their own
# most of it), so about 3 minutes on an idle 2-core machine; 530 s with 2 jobs on the
# 2-core development machine shared with other builds (November 2026).
set -uo pipefail
root=${1:-.}
root=$(cd "$root" && pwd)
jobs=${JOBS:-$(nproc)}
gxx=g++-12 clang=clang++-14
for c in $gxx $clang; do
  command -v "$c" >/dev/null || { echo "FAIL: $c is not installed (tools/setup.sh installs it)"; exit 1; }
done
flags=(-std=c++20 -Wall -Wextra -Wpedantic -Werror -fsyntax-only
  -I"$root/include" -I"$root"
  -isystem /usr/lib/x86_64-linux-gnu/openmpi/include -isystem /usr/local/cuda/include)

tmp=$(mktemp -d "${TMPDIR:-/tmp}/header_warnings.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src" "$tmp/log" "$tmp/canary/fsdp"

# One job per line: COMPILER NAME SOURCE.
headers=$(cd "$root/include" && find fsdp -name '*.hpp' -not -path 'fsdp/torch/*' | LC_ALL=C sort)
torch_headers=$(cd "$root/include" && find fsdp/torch -name '*.hpp' 2>/dev/null | LC_ALL=C sort)
torch_include=/usr/include/torch/csrc/api/include
engine=$(cd "$root" && find examples/engine -name '*.hpp' | LC_ALL=C sort)
[[ -n $headers && -n $engine ]] || { echo "FAIL: no headers under $root/include or $root/examples/engine"; exit 1; }
n=0
for h in $headers $engine; do
  n=$((n + 1))
  name=$(tr '/.' '__' <<<"$h")
  printf '#include "%s"\n' "$h" >"$tmp/src/$name.cpp"
  # The one source of the separately compiled mode is compiled in that mode (fsdp/core/config.hpp).
  if [[ $h == fsdp/separate_compilation.hpp ]]; then echo "$clang $name $tmp/src/$name.cpp -DFSDP_SEPARATE_COMPILATION"
  else echo "$clang $name $tmp/src/$name.cpp"; fi
done >"$tmp/jobs"
if [[ -f $torch_include/torch/torch.h ]]; then
  for h in $torch_headers; do
    n=$((n + 1))
    name=$(tr '/.' '__' <<<"$h")
    printf '#include "%s"\n' "$h" >"$tmp/src/$name.cpp"
    echo "$gxx $name $tmp/src/$name.cpp -isystem $torch_include"
  done >>"$tmp/jobs"
elif [[ -n $torch_headers ]]; then
  echo "SKIPPED: fsdp/torch/ headers: libtorch is not installed ($torch_include/torch/torch.h; tools/setup.sh installs libtorch-dev)"
fi
for h in $headers $engine; do [[ $h == fsdp/separate_compilation.hpp ]] || printf '#include "%s"\n' "$h"; done >"$tmp/src/all.cpp"
echo "$gxx all $tmp/src/all.cpp" >>"$tmp/jobs"
for c in $gxx $clang; do echo "$c engine-$c $root/test/tools/header_warnings_engine.cpp"; done >>"$tmp/jobs"
# The same engine file in the separately compiled mode (what its files see), with g++.
echo "$gxx engine-separate $root/test/tools/header_warnings_engine.cpp -DFSDP_SEPARATE_COMPILATION" >>"$tmp/jobs"
# The canary: a warning in a header of ours (under -I) must fail the compile.
printf '#pragma once\ninline int canary() { int unused = 0; return 1; }\n' >"$tmp/canary/fsdp/canary.hpp"
printf '#include "fsdp/canary.hpp"\n#include "fsdp/core/dtype.hpp"\n' >"$tmp/src/canary.cpp"
for c in $gxx $clang; do echo "$c canary-$c $tmp/src/canary.cpp -I$tmp/canary"; done >>"$tmp/jobs"

# Each job: COMPILER FLAGS... SOURCE [MORE] > log/NAME.log; its status in log/NAME.rc.
{
  echo 'c=$1 name=$2 src=$3; shift 3'
  printf '"$c"'; printf ' %q' "${flags[@]}"; echo ' "$src" "$@" >"'"$tmp"'/log/$name.log" 2>&1'
  echo 'echo $? >"'"$tmp"'/log/$name.rc"'
} >"$tmp/run.sh"
start=$SECONDS
# The engine files first: they take longest, so the last job to finish is a short one.
{ grep ' engine-' "$tmp/jobs"; grep -v ' engine-' "$tmp/jobs"; } | xargs -P "$jobs" -L 1 bash "$tmp/run.sh"
fails=0
while read -r c name _; do
  rc=$(cat "$tmp/log/$name.rc" 2>/dev/null || echo missing)
  if [[ $name == canary-* ]]; then
    if [[ $rc != 0 ]] && grep -q 'unused' "$tmp/log/$name.log"; then echo "PASS: $name: a warning in our header fails"; else
      echo "FAIL: $name: a header of ours with an unused variable compiled (rc $rc): the flags catch nothing"; fails=$((fails + 1)); fi
  elif [[ $rc == 0 && ! -s $tmp/log/$name.log ]]; then
    :
  else
    echo "FAIL: $c on $name (rc $rc):"
    head -n 40 "$tmp/log/$name.log"
    fails=$((fails + 1))
  fi
done <"$tmp/jobs"
echo "header_warnings_test: $n headers on their own (fsdp/torch/ with $gxx, the rest with $clang), all headers but fsdp/torch/ in one file, the engine file, with $gxx and $clang; $((SECONDS - start)) s with $jobs jobs"
if ((fails)); then echo "header_warnings_test: $fails failed"; exit 1; fi
echo "header_warnings_test: all passed"
