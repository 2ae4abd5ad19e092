#!/usr/bin/env bash
# bench/gather_formats.sh keeps working: 2 TCP processes, a tiny model, 2 steps, one run per
# format. Every format's row must be printed; f32's ratios must be 1; the block and per-tensor formats'
# all-gathers must move less than a third of f32's bytes and bf16's half; a bad RUNS is
# refused.
#
# Usage: gather_formats_smoke_test.sh BENCH_SCRIPT TRAIN_BINARY
set -u
bench="$1" train="$2"
tmp="$(mktemp -d "${TEST_TMPDIR:-${TMPDIR:-/tmp}}/gather_smoke.XXXXXX")" || exit 2
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

if NPROC=2 STEPS=2 BLOCKS=2 DIM=16 HIDDEN=32 timeout 240 "$bench" "$train" 1 >"$tmp/out" 2>&1; then
  echo "PASS: exit status 0"
else
  fail "exit status $? (output below)"
  cat "$tmp/out"
fi

python3 - "$tmp/out" <<'PY' || failures=$((failures + 1))
import sys
rows = {}
for line in open(sys.argv[1]):
    f = line.split()
    if f and f[0] in ("f32", "bf16", "fp8", "fp8e5m2", "mxfp8", "int8", "fp8tensor", "fp8e5m2tensor") and len(f) == 7:
        rows[f[0]] = (int(f[1]), float(f[2]), float(f[3]), float(f[4]))
bad = []
if sorted(rows) != sorted(["f32", "bf16", "fp8", "fp8e5m2", "mxfp8", "int8", "fp8tensor", "fp8e5m2tensor"]):
    bad.append(f"rows printed: {sorted(rows)}")
else:
    if rows["f32"][1] != 1.0 or rows["f32"][3] != 1.0: bad.append(f"f32's ratios: {rows['f32']}")
    if abs(rows["bf16"][1] - 0.5) > 1e-3: bad.append(f"bf16's bytes ratio {rows['bf16'][1]}, not 0.5")
    for q in ("fp8", "fp8e5m2", "mxfp8", "int8", "fp8tensor", "fp8e5m2tensor"):
        if not 0 < rows[q][1] < 1 / 3: bad.append(f"{q}'s bytes ratio {rows[q][1]}")
    if any(r[2] <= 0 for r in rows.values()): bad.append("a median time <= 0")
for b in bad: print("FAIL:", b)
if not bad: print("PASS: a row per format, f32's ratios 1, bf16 0.5 of the bytes, the block and per-tensor formats under a third")
sys.exit(1 if bad else 0)
PY

if "$bench" "$train" 0 >/dev/null 2>&1; then fail "RUNS=0 accepted"; else echo "PASS: RUNS=0 refused"; fi

[[ $failures -eq 0 ]] && echo "all cases as expected" || { echo "$failures case(s) wrong"; exit 1; }
