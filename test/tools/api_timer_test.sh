#!/usr/bin/env bash
# tools/gpu_proof/api_timer.so and the split tools/gpu_proof.sh prints with it
# (tools/gpu_proof/host_time_split.awk), without a GPU: the timer counts a program's CUDA
# calls and those inside its marked region, and measures its own cost per call; the split
# takes that cost out of both shares, to the digit, and takes nothing out of a report
# without it.
# Usage: api_timer_test.sh API_TIMER_SO PROBE SPLIT_AWK
set -u
timer=$(realpath "$1") probe=$2 split=$3
failures=0
expect() {  # expect NAME PATTERN TEXT: TEXT has a line matching the extended regex PATTERN
  if grep -Eq "$2" <<<"$3"; then echo "ok: $1"; else echo "FAIL: $1: no line matching '$2' in:"; echo "$3"; failures=$((failures + 1)); fi
}

out=$(LD_PRELOAD=$timer timeout 60 "$probe" 2>&1)
expect "the probe ran under the timer" '^api_timer_probe: done$' "$out"
expect "5 cudaGetDevice calls, 3 of them in the region" '^api_timer: cudaGetDevice calls=5 .* region_calls=3 ' "$out"
expect "the timer's own cost per call, measured" '^api_timer: own cost per call inside_ns=[0-9]+\.[0-9] outside_ns=-?[0-9]+\.[0-9]$' "$out"
real=$(awk -v per=3 -v measured=10 -f "$split" <<<"$out")
expect "the split of a real report" '^  cudaGetDevice +1\.00 calls .*$' "$real"
expect "the split of a real report, its total" '^gpu proof: of the library host time per unit per step \(10 us under the timer\), .* \(1\.0 calls at ' "$real"

# Known numbers, 100 unit-steps: a launch 20 us inside the region over 6 calls per unit,
# an allocation 3 us over 4; the timer costs 20 + 30 ns per call. Calls: 20 - 6 * 0.02 =
# 19.88 and 3 - 4 * 0.02 = 2.92 us; the timer 10 * 0.05 = 0.5 us; own code 30 - 22.8 - 0.5.
report='api_timer: own cost per call inside_ns=20.0 outside_ns=30.0
api_timer: cudaLaunchKernel calls=1000 main_us=4000.0 other_us=0.0 mean_us=4.000 region_calls=600 region_us=2000.0
api_timer: cudaMallocAsync calls=500 main_us=400.0 other_us=0.0 mean_us=0.800 region_calls=400 region_us=300.0
api_timer: cudaGetDevice calls=5 main_us=1.0 other_us=0.0 mean_us=0.200 region_calls=0 region_us=0.0'
got=$(awk -v per=100 -v measured=30 -f "$split" <<<"$report")
want="  cudaLaunchKernel             6.00 calls   19.88 us
  cudaMallocAsync              4.00 calls    2.92 us
gpu proof: of the library host time per unit per step (30 us under the timer), 22.80 us are CUDA and NCCL calls, 6.70 us the library's own code, 0.50 us the timer's own cost (10.0 calls at 20.0 + 30.0 ns, taken out of both)"
if [ "$got" = "$want" ]; then echo "ok: the split's arithmetic"; else echo "FAIL: the split's arithmetic: got"; echo "$got"; echo "want"; echo "$want"; failures=$((failures + 1)); fi
old=$(awk -v per=100 -v measured=30 -f "$split" <<<"$(tail -n +2 <<<"$report")")
expect "a report without the timer's cost: nothing taken out" '^gpu proof: .*, 23\.00 us are CUDA and NCCL calls, 7\.00 us the library.s own code, 0\.00 us the timer.s own cost \(10\.0 calls at 0\.0 \+ 0\.0 ns' "$old"

if [ "$failures" -ne 0 ]; then echo "$failures check(s) failed"; exit 1; fi
echo "all checks passed"
