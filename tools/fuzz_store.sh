#!/usr/bin/env bash
# Fuzzes the rendezvous store's frame parser with libFuzzer for a bounded time.
#   tools/fuzz_store.sh [SECONDS] [libFuzzer flags...]     (default: 30 s)
# Builds test/asio/store_protocol_fuzz.cpp with clang++-14 (libFuzzer, ASan, UBSan),
# starts from the checked-in corpus (test/asio/store_fuzz_corpus/, read only) and keeps
# new inputs in a scratch directory. A crash or broken invariant leaves its input in that
# directory and exits non-zero; to keep an input, copy it into the corpus.
set -euo pipefail
# Under `bazel test` this script runs as test/asio/asio_store_fuzz_test, so the tree is
# found from the runfiles root instead of from the script's own place.
if [[ -n ${TEST_SRCDIR:-} ]]; then
  root=$TEST_SRCDIR/$TEST_WORKSPACE
else
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
fi
seconds=${1:-30}
shift $(( $# > 0 ? 1 : 0 ))
if ! [[ $seconds =~ ^[1-9][0-9]*$ ]] || (( seconds > 86400 )); then
  echo "fuzz_store.sh: SECONDS must be an integer in [1, 86400], got '$seconds'" >&2
  exit 2
fi
command -v clang++-14 >/dev/null || { echo "fuzz_store.sh: clang++-14 not found (apt install clang-14)" >&2; exit 2; }

work=${FUZZ_WORK_DIR:-$(mktemp -d "${TMPDIR:-/tmp}/fsdp-store-fuzz.XXXXXX")}
mkdir -p "$work/new"
clang++-14 -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$root/include" "$root/test/asio/store_protocol_fuzz.cpp" -o "$work/store_fuzz"

echo "fuzz_store.sh: fuzzing for ${seconds} s in $work"
cd "$work"
# -max_len: frames past the small limits are refused by their header alone.
"$work/store_fuzz" -max_total_time="$seconds" -max_len=4096 -timeout=5 -rss_limit_mb=2048 \
  -print_final_stats=1 "$@" "$work/new" "$root/test/asio/store_fuzz_corpus"
