#!/usr/bin/env bash
# Runs the host tests under a sanitizer (the asan / tsan configs of .bazelrc).
#   tools/sanitize.sh asan|tsan [TARGET_PATTERN...] [BAZEL_TEST_FLAG...]
# Without target patterns: every host test (test/core, test/host, test/faults,
# test/checkpoint, test/asio, test/tools, test/streams, test/nccl's emulated ones); with only
# subtracted ones (-//test:x), every host test but those. Tests tagged no_asan / no_tsan are
# neither built nor run. Last line, as tools/test.sh: "tests: N passed, M failed[, K skipped]".
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

config=${1:-}
if [[ $config != asan && $config != tsan ]]; then
  echo "usage: tools/sanitize.sh asan|tsan [TARGET_PATTERN...] [BAZEL_TEST_FLAG...]" >&2
  exit 2
fi
shift

targets=()
subtracted=()  # after the others: Bazel's "-//x" removes only what patterns before it named
flags=()
for arg in "$@"; do
  case $arg in
    -//*) subtracted+=("$arg") ;;
    //* | :*) targets+=("$arg") ;;
    *) flags+=("$arg") ;;
  esac
done
every_host_test=(//test:all //test/faults/... //test/checkpoint/... //test/asio/... //test/tools/... //test/streams/...
  //test/nccl/...)
if ((${#targets[@]} == 0)); then
  targets=("${every_host_test[@]}")
fi
targets+=("${subtracted[@]}")

tools/setup.sh || exit 1

bep=$(mktemp "${TMPDIR:-/tmp}/fsdp-bep.XXXXXX.json")
trap 'rm -f "$bep"' EXIT

# "--" ends the flags, so that "-//x" patterns subtract targets.
bazel test --config="$config" --keep_going --test_output=errors "${flags[@]}" \
  --build_event_json_file="$bep" -- "${targets[@]}"
rc=$?

python3 tools/test_summary.py "$bep" "$rc"
exit $?
