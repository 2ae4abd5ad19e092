#!/usr/bin/env bash
# bench/collectives keeps working: `--quick --json` on 2 ranks, 1 KiB and 4 KiB per rank,
# every backend. Each stdout line must be a JSON row with the documented fields, every
# (backend, op, size) must be there and verified, and bad flags must be refused.
#
# Usage: collectives_smoke_test.sh COLLECTIVES_BINARY [BACKENDS (default thread,tcp,tcp-socket,gloo,mpi)]
set -u
bin="$1"
backends="${2:-thread,tcp,tcp-socket,gloo,mpi}"
tmp="$(mktemp -d "${TEST_TMPDIR:-${TMPDIR:-/tmp}}/collectives_smoke.XXXXXX")" || exit 2
trap 'rm -rf "$tmp"' EXIT
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

if "$bin" --quick --json --worlds 2 --max-bytes 4096 --backends "$backends" --timeout-s 25 \
    >"$tmp/rows.jsonl" 2>"$tmp/err"; then
  echo "PASS: exit status 0"
else
  fail "exit status $? (stderr below)"
  cat "$tmp/err"
fi

python3 - "$tmp/rows.jsonl" "$backends" <<'PY' || failures=$((failures + 1))
import json, sys
path, backends = sys.argv[1], sys.argv[2].split(",")
need = {"backend": str, "op": str, "world": int, "bytes_per_rank": int, "iters": int, "time_us": float,
        "algbw_GBps": float, "busbw_GBps": float, "verified": bool}
seen, bad = set(), 0
for n, line in enumerate(open(path), 1):
    try:
        row = json.loads(line)
        for key, kind in need.items():
            if not isinstance(row[key], kind) and not (kind is float and isinstance(row[key], int)):
                raise ValueError(f"{key}={row[key]!r} is not {kind.__name__}")
        if not row["verified"]:
            raise ValueError("verified is false")
        if row["world"] != 2 or row["busbw_GBps"] <= 0 or row["time_us"] <= 0:
            raise ValueError("world is not 2 or a figure is not positive")
        if abs(row["busbw_GBps"] - row["algbw_GBps"] / 2) > 1e-9 * row["algbw_GBps"]:
            raise ValueError("busbw is not algbw * (n-1)/n")
        seen.add((row["backend"], row["op"], row["bytes_per_rank"]))
    except (ValueError, KeyError) as e:
        print(f"FAIL: line {n}: {e}: {line.strip()[:200]}")
        bad += 1
missing = [(b, op, s) for b in backends for op in ("all_gather", "reduce_scatter") for s in (1024, 4096)
           if (b, op, s) not in seen]
for m in missing:
    print(f"FAIL: no row for {m}")
print(f"{'PASS' if not bad and not missing else 'FAIL'}: {len(seen)} rows parsed, verified, none missing")
sys.exit(1 if bad or missing else 0)
PY

for bad in "--backends nccl" "--min-bytes 3" "--min-bytes 4096 --max-bytes 1024"; do
  # shellcheck disable=SC2086
  if "$bin" $bad --quick >/dev/null 2>&1; then fail "'$bad' was accepted"; else echo "PASS: '$bad' is refused"; fi
done

[[ $failures -eq 0 ]] && echo "all cases as expected" || { echo "$failures case(s) wrong"; exit 1; }
