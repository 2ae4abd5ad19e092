#!/usr/bin/env bash
# tools/check_layers.py: the tree as it is passes, and each kind of violation in a copy of
# the tree fails with its message (an upward include, a detail/ header that includes a
# public header of its folder which uses that detail/, an include after the first
# declaration, a folder missing from the table).
#   check_layers_test.sh CHECKER INCLUDE_DIR
set -uo pipefail
checker=$1 inc=$2
fails=0
pass() { echo "PASS: $1"; }
fail() { echo "FAIL: $1"; fails=$((fails + 1)); }

out=$(python3 "$checker" "$inc" 2>&1)
if [[ $? -eq 0 && $out == *", 0 violations" ]]; then pass "the tree has no violation"; else fail "the tree: $out"; fi

tmp=$(mktemp -d "${TMPDIR:-/tmp}/layers.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
# Each case: a fresh copy, one edit, the message the checker must print.
expect() {  # name file-to-append-to line-to-add expected-substring [prepend]
  local name=$1 file=$2 line=$3 want=$4 where=${5:-append}
  rm -rf "$tmp/include" && mkdir -p "$tmp/include" && cp -RL "$inc/fsdp" "$tmp/include/" && chmod -R u+w "$tmp/include"
  if [[ $where == prepend ]]; then
    { echo "$line"; cat "$tmp/include/$file"; } > "$tmp/x" && mv "$tmp/x" "$tmp/include/$file"
  else
    echo "$line" >> "$tmp/include/$file"
  fi
  local got rc
  got=$(python3 "$checker" "$tmp/include" 2>&1); rc=$?
  if [[ $rc -ne 0 && $got == *"$want"* && $got == *", 1 violations" ]]; then pass "$name"; else fail "$name (rc $rc): $got"; fi
}
expect "core including the unit" fsdp/core/dtype.hpp '#include "fsdp/unit/unit.hpp"' \
  "include/fsdp/core/dtype.hpp:1: includes fsdp/unit/unit.hpp: folder 'core' may use only nothing else" prepend
expect "a backend including the model" fsdp/asio/tcp_comm.hpp '#include "fsdp/model/shard.hpp"' \
  "folder 'asio' may use only ['core']" prepend
expect "the unit including checkpoints" fsdp/unit/unit.hpp '#include "fsdp/checkpoint/checkpoint.hpp"' \
  "folder 'unit' may use only ['core', 'policy']" prepend
expect "fsdp.hpp including a testing tool" fsdp/fsdp.hpp '#include "fsdp/testing/counting_device.hpp"' \
  "includes fsdp/testing/counting_device.hpp: folder 'fsdp' may use only"
expect "detail including a public header that uses detail" fsdp/unit/detail/zero_batch.hpp '#include "fsdp/unit/unit.hpp"' \
  "which uses this folder's detail/: detail/ must sit below what uses it" prepend
expect "an include at the end of a file" fsdp/unit/unit.hpp '#include "fsdp/unit/unit_views.hpp"' \
  "after the file's first declaration"
rm -rf "$tmp/include" && mkdir -p "$tmp/include" && cp -RL "$inc/fsdp" "$tmp/include/" && chmod -R u+w "$tmp/include"
mkdir -p "$tmp/include/fsdp/extras" && echo '#pragma once' > "$tmp/include/fsdp/extras/x.hpp"
got=$(python3 "$checker" "$tmp/include" 2>&1)
if [[ $? -ne 0 && $got == *"folder 'extras' is not in tools/check_layers.py's table"* ]]; then pass "a folder missing from the table"; else fail "a folder missing from the table: $got"; fi

if ((fails)); then echo "check_layers_test: $fails failed"; exit 1; fi
echo "check_layers_test: all passed"
