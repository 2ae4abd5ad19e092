#!/usr/bin/env bash
# Builds and runs every test (`bazel test //...`), then totals the doctest
# case counts of the tests that this invocation ran (cached ones included;
# tools/test_summary.py).
# Last line: "tests: N passed, M failed[, K skipped]". Extra arguments are
# passed to `bazel test` (e.g. --config=..., more target patterns).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

tools/setup.sh || exit 1

# The Build Event Protocol file says exactly which tests ran, with the
# paths of their final logs, so stale logs of removed or unrun targets in
# bazel-testlogs are never counted.
bep=$(mktemp "${TMPDIR:-/tmp}/fsdp-bep.XXXXXX.json")
trap 'rm -f "$bep"' EXIT

# "$@" goes before our BEP flag: the last occurrence of a flag wins.
bazel test //... --keep_going --test_output=errors "$@" \
  --build_event_json_file="$bep"
rc=$?

python3 tools/test_summary.py "$bep" "$rc"
exit $?
