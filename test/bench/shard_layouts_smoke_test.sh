#!/usr/bin/env bash
# bench/shard_layouts keeps its promises: 6 parameter lists x 2 rank counts x 4 layouts,
# every JSON row parsed; element-flat splits evenly (to within one element per unit and
# rank); the parameter-atomic layout of GPT-2 small's 12 and 24 blocks in one unit on 8 ranks is
# within 5% of an even split (issue 38's goal), and one unit per block is not (so the rows
# differ where they should).
#
# Usage: shard_layouts_smoke_test.sh SHARD_LAYOUTS_BINARY
set -u
bin="$1"
out="$(timeout 60 "$bin" --json)" || { echo "FAIL: exit status $?"; exit 1; }
python3 - <<PY
import json, sys
rows = [json.loads(l) for l in """$out""".splitlines() if l.strip()]
bad = []
if len(rows) != 6 * 2 * 4:
    bad.append(f"{len(rows)} rows, expected 48")
by = {(r["parameters"], r["ranks"], r["layout"]): r for r in rows}
for r in rows:
    if r["layout"] == "flat" and not (1.0 <= r["balance"] < 1.0001 and r["padded_vs_flat"] == 1.0):
        bad.append(f"flat row {r}")
for blocks in (12, 24):
    r = by.get((f"GPT-2 small, {blocks} blocks in one unit", 8, "param"))
    if not r or r["balance"] > 1.05:
        bad.append(f"GPT-2 small, {blocks} blocks in one unit, 8 ranks, param: {r}")
r = by.get(("GPT-2 small, one unit per block", 8, "param"))
if not r or r["balance"] < 2.0:  # a block's largest matrix (768 x 3072) is 2.6x an eighth of the block
    bad.append(f"GPT-2 small, one unit per block, 8 ranks, param: {r}")
for bad_row in bad:
    print("FAIL:", bad_row)
if bad:
    sys.exit(1)
print(f"PASS: {len(rows)} rows; GPT-2 small's 12 blocks on 8 ranks, parameter-atomic: {by[('GPT-2 small, 12 blocks in one unit', 8, 'param')]['balance']:.4f} of an even split")
PY
