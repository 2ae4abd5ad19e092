#!/usr/bin/env bash
# What including the library costs an engine's build (issue 34, goal: at most +2.0 s of CPU
# and +150 MB of peak memory per file that uses it). Compiles, N times in turn:
#  (a) bench/compile_cost/engine_step.cpp -DWITH_FSDP: fsdp/fsdp.hpp and the reference
#      engine's integration header, fsdp::shard<fsdp::FullShard> on its model, one sharded
#      training step;
#  (b) the same file without fsdp: the engine alone, the same standard headers, one
#      unsharded step;
#  (c) bench/compile_cost/include_only.cpp: only #include <fsdp/fsdp.hpp>;
#  (d) (a) under FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp): the engine's file when the
#      unit's implementation is compiled once elsewhere;
#  (e) that once: src/fsdp_separate.cpp (a program pays it once, not per file);
# and prints for each the median user+sys CPU seconds and maximum resident set size
# (/usr/bin/time), then (a) - (b) and (d) - (b) against the goal. The runs interleave
# (a b c d e a b c d e ...), so a change in the machine's load falls on all of them alike. A benchmark, not a test: the
# numbers depend on the machine and its load; compare runs made on one machine.
#
# Usage: bench/compile_cost.sh [N]   (N runs each, default 5)
# CXX (default g++-12) and CXXFLAGS (default: -O2 -DNDEBUG -std=c++20 -Wall -Wextra, what
# `bazel build -c opt` gives g++, less its -ffunction-sections -fdata-sections -g0 and
# fortify flags) choose the compiler; CXXFLAGS='-O0 -std=c++20 -Wall -Wextra' is close to
# the plain (fastbuild) build.
#
# Measured on the 2-core development machine, shared with other builds (so every figure is
# high; compare within one run), 5 runs each, November 2026:
#                                         (a)              (b)             (c)
#   before (the unit's vtable everywhere)  19.08 s  535 MB   2.92 s  196 MB   9.03 s  386 MB
#   after (fsdp/unit/sharded_unit.hpp)     18.49 s  535 MB   3.09 s  196 MB   4.26 s  327 MB
# and later, 3 runs each on a quieter machine (compare within a pair only):
#   planner runs real units, in fsdp.hpp   13.55 s  571 MB   2.08 s  196 MB   3.30 s  345 MB
#   planner out of fsdp.hpp                13.51 s  504 MB   2.17 s  196 MB   3.01 s  319 MB
# (a) - (b) = +15.4 s, +339 MB against the goal's +2.0 s, +150 MB. Of (a), about 4.9 s is
# the front end (-fsyntax-only: (b) 1.3 s) and the rest code generation, 70% of it (by bytes
# of code) for fsdp functions that depend on no engine type. The separately compiled mode
# (fsdp/core/config.hpp) takes that part out of the engine's file; 3 runs each, a busier
# machine than the pair above:
#                                         (a)              (b)             (d)              (e)
#   fsdp::shard through detail::make_unit  18.22 s  485 MB   3.02 s  196 MB  11.35 s  423 MB   9.96 s  381 MB
# (d) - (b) = +8.33 s (3.76x the engine alone), +227 MB: still over the goal. What is left
# is the front end (-fsyntax-only: 4.4 s against (b)'s 1.2 s) and the code generated for
# what the file instantiates (the module walk, the engine's layers with their hooks, the
# thread-rank backend, ShardedModel's members), about 160 KB of code against (b)'s 52 KB.
# Then ShardedModel's non-template members, ExecutionOrder's, the thread-rank backend's
# collectives and the host arithmetic moved into the one file too (FSDP_DECL); 3 runs each,
# the machine busy with a build:
#                                         (a)              (b)             (d)              (e)
#   root, backend, host math compiled once 18.15 s  556 MB   3.01 s  196 MB   8.76 s  399 MB  13.23 s  422 MB
# (d) - (b) = +5.75 s, +203 MB (the same day before the move, interleaved the same way:
# +8.02 s, +225 MB); (d)'s object file: 127 KB of code, from 185 KB.
# Then (2026-12-01, a slower machine: (b) 4.4 s) the headers kept out of an engine's file
# what only the separately compiled functions use (ShardedModel's take-over, ThreadComm's
# shared state and its mismatch messages, the quantization loops), HostDevice's
# quantize/dequantize and the setup's cross-rank check (detail::check_same_across_ranks)
# moved into the one file, and the module walk compiles one copy of its per-module step
# per module type (detail::collect_module, WrapPlanner::meet/decide), not one per root and
# module type. (b) and (d) of both commits, interleaved, 3 runs each:
#                                         (b)              (d)
#   before                                 4.37 s  195 MB  12.75 s  397 MB
#   after                                  4.37 s  195 MB  10.59 s  366 MB
# (d) - (b) = +6.22 s (2.42x), +171 MB, from +8.38 s (2.92x), +202 MB; (d)'s object file:
# 103 KB of code, from 123 KB; -fsyntax-only 4.6 s from 5.7 s ((b): 2.1 s).
# Then [[gnu::cold]] on the setup-only walk (fsdp/model/shard.hpp): (d) 9.56 s against 9.81 s
# just before, by the same compile three times each (object: 102 KB of code).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
n=${1:-5}
cxx=${CXX:-g++-12}
read -r -a flags <<<"${CXXFLAGS:--O2 -DNDEBUG -std=c++20 -Wall -Wextra}"
[[ -x /usr/bin/time ]] || { echo "compile_cost: needs /usr/bin/time (Debian package 'time')" >&2; exit 1; }
tmp=$(mktemp -d "${TMPDIR:-/tmp}/compile_cost.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

declare -A src def
src[a]=bench/compile_cost/engine_step.cpp def[a]=-DWITH_FSDP
src[b]=bench/compile_cost/engine_step.cpp def[b]=-DWITHOUT_FSDP
src[c]=bench/compile_cost/include_only.cpp def[c]=-DINCLUDE_ONLY
src[d]=bench/compile_cost/engine_step.cpp def[d]="-DWITH_FSDP -DFSDP_SEPARATE_COMPILATION"
src[e]=src/fsdp_separate.cpp def[e]=-DFSDP_SEPARATE_COMPILATION
variants=(a b c d e)
for ((i = 1; i <= n; ++i)); do
  for v in "${variants[@]}"; do
    read -r -a defs <<<"${def[$v]}"
    /usr/bin/time -f '%U %S %M' -o "$tmp/t" "$cxx" "${flags[@]}" "${defs[@]}" -Iinclude -I. -c "${src[$v]}" -o "$tmp/$v.o"
    awk -v v="$v" '{ printf "%s %.2f %d\n", v, $1 + $2, $3 }' "$tmp/t" >>"$tmp/runs"
  done
done

median() {  # median of column $2 of the runs of variant $1
  awk -v v="$1" -v c="$2" '$1 == v { print $c }' "$tmp/runs" | sort -g |
    awk '{ x[NR] = $1 } END { print (NR % 2 ? x[(NR + 1) / 2] : (x[NR / 2] + x[NR / 2 + 1]) / 2) }'
}
echo "compile_cost: $cxx ${flags[*]}, $n runs each, medians of user+sys CPU and max RSS"
declare -A cpu mb
for v in "${variants[@]}"; do
  cpu[$v]=$(median "$v" 2)
  mb[$v]=$(awk -v k="$(median "$v" 3)" 'BEGIN { printf "%.0f", k / 1024 }')
done
printf '  (a) engine + fsdp, shard<FullShard>, one step  %6.2f s  %5d MB\n' "${cpu[a]}" "${mb[a]}"
printf '  (b) the engine alone, one step                 %6.2f s  %5d MB\n' "${cpu[b]}" "${mb[b]}"
printf '  (c) only #include <fsdp/fsdp.hpp>               %6.2f s  %5d MB\n' "${cpu[c]}" "${mb[c]}"
printf '  (d) (a), FSDP_SEPARATE_COMPILATION              %6.2f s  %5d MB\n' "${cpu[d]}" "${mb[d]}"
printf '  (e) src/fsdp_separate.cpp, once per program     %6.2f s  %5d MB\n' "${cpu[e]}" "${mb[e]}"
against() {  # the cost of variant $1 over the engine alone, against the goal
  awk -v v="$1" -v s="$(awk -v a="${cpu[$1]}" -v b="${cpu[b]}" 'BEGIN { print a - b }')" -v m="$((mb[$1] - mb[b]))" \
    -v r="$(awk -v a="${cpu[$1]}" -v b="${cpu[b]}" 'BEGIN { print a / b }')" 'BEGIN {
    ok = s <= 2.0 && m <= 150
    printf "  (%s) - (b): %+.2f s (%.2fx), %+d MB; goal +2.00 s, +150 MB: %s\n", v, s, r, m, ok ? "met" : "not met" }'
}
against a
against d
