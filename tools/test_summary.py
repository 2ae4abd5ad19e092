#!/usr/bin/env python3
"""Totals the doctest case counts of one `bazel test` run from its Build Event Protocol file.

  tools/test_summary.py BEP_JSON_FILE BAZEL_EXIT_CODE

Used by tools/test.sh and tools/sanitize.sh. Prints one FAILED: line per failing test,
then "tests: N passed, M failed[, K skipped]"; exits 1 if anything failed.
"""
import json, re, sys
from urllib.parse import unquote, urlparse

bep_path, bazel_rc = sys.argv[1], int(sys.argv[2])
SUMMARY = re.compile(r"\[doctest\] test cases:.*?(\d+) passed.*?(\d+) failed"
                     r".*?(\d+) skipped")
ANSI = re.compile(r"\x1b\[[0-9;]*m")

tests = set()    # labels of configured test targets
built = {}       # label -> did the target (and its deps) build
results = {}     # (label, run, shard) -> (attempt, status, log path)
try:
    events = [json.loads(l) for l in open(bep_path) if l.strip()]
except OSError:
    events = []
for ev in events:
    eid = ev.get("id", {})
    if "targetConfigured" in eid:
        label = eid["targetConfigured"]["label"]
        cfg = ev.get("configured", {})
        if "testSize" in cfg or cfg.get("targetKind", "").endswith("test rule"):
            tests.add(label)
    elif "targetCompleted" in eid:
        label = eid["targetCompleted"]["label"]
        ok = ev.get("completed", {}).get("success", False)
        built[label] = built.get(label, True) and ok
    elif "testResult" in eid:
        r, res = eid["testResult"], ev.get("testResult", {})
        key = (r["label"], r.get("run", 1), r.get("shard", 1))
        logs = [o["uri"] for o in res.get("testActionOutput", [])
                if o.get("name") == "test.log"]
        log = unquote(urlparse(logs[0]).path) if logs else None
        # Flaky retries: only the last attempt decides.
        if key not in results or r.get("attempt", 1) > results[key][0]:
            results[key] = (r.get("attempt", 1), res.get("status"), log)

passed = failed = skipped = 0
problems = []
ran = {k[0] for k in results}
for label in sorted(tests - ran):
    # Configured but never run: it or a dependency failed to build (tests
    # excluded by tag filters build fine and are simply not run).
    if not built.get(label, False):
        failed += 1
        problems.append(f"{label}: failed to build")
for (label, run, shard), (_, status, log) in sorted(results.items()):
    text = ""
    if log:
        try:
            text = ANSI.sub("", open(log, errors="replace").read())
        except OSError:
            pass
    counts = [tuple(map(int, m)) for m in SUMMARY.findall(text)]
    p = sum(c[0] for c in counts)
    f = sum(c[1] for c in counts)
    s = sum(c[2] for c in counts)
    many = sum(1 for k in results if k[0] == label) > 1
    where = f"{label} (run {run}, shard {shard})" if many else label
    if not counts:
        # Not a doctest binary, or it died before printing its summary.
        if status == "PASSED":
            p = 1
        else:
            f = 1
            problems.append(f"{where}: {status} without doctest summary")
    elif status != "PASSED" and f == 0:
        # e.g. crashed in a destructor or timed out after the summary.
        f = 1
        problems.append(f"{where}: {status} although doctest reported no failures")
    elif f:
        problems.append(f"{where}: {f} failed test case(s)")
    passed, failed, skipped = passed + p, failed + f, skipped + s

# Bazel failed without any test to blame (analysis error, bad flag, ...).
# rc 3 = some tests failed, rc 4 = build OK but no test targets at all.
if bazel_rc not in (0, 3, 4) and failed == 0:
    failed = 1
    problems.append(f"bazel test exited with {bazel_rc}")
if bazel_rc == 4:
    print("note: no test targets found", file=sys.stderr)

for line in problems:
    print("FAILED:", line)
line = f"tests: {passed} passed, {failed} failed"
if skipped:
    line += f", {skipped} skipped"
print(line)
sys.exit(1 if failed or bazel_rc not in (0, 4) else 0)
