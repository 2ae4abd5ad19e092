#!/usr/bin/env bash
# tools/check_docs.py: every C++ block of README.md and docs/*.md compiles (or is marked a
# fragment) and every fsdp header they name exists; and, on temporary markdown files, the
# checker fails a broken block (naming its file and line), skips a fragment, compiles a
# `continued` block together with the block before it, and refuses a `continued` block with
# nothing before it, an unknown fence word and a header that does not exist.
#   check_docs_test.sh CHECKER ROOT   (ROOT: holds README.md, docs/, include/, examples/)
set -uo pipefail
checker=$1 root=$2
fails=0
pass() { echo "PASS: $1"; }
fail() { echo "FAIL: $1"; fails=$((fails + 1)); }

start=$SECONDS
out=$(python3 "$checker" --root "$root" 2>&1); rc=$?
if [[ $rc -eq 0 && $(tail -n 1 <<<"$out") =~ ^docs:\ [0-9]+\ blocks,\ [0-9]+\ compiled,\ [0-9]+\ fragments,\ 0\ failed$ ]]; then
  pass "README.md and docs/: $(tail -n 1 <<<"$out") in $((SECONDS - start)) s"
else
  fail "README.md and docs/ (rc $rc):"$'\n'"$out"
fi

tmp=$(mktemp -d "${TEST_TMPDIR:-${TMPDIR:-/tmp}}/check_docs.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
fence='```'
# case NAME WANT_RC WANT_SUBSTRING MARKDOWN: runs the checker on one temporary file.
case_() {
  local name=$1 want_rc=$2 want=$3
  printf '%s\n' "$4" > "$tmp/$name.md"
  local got rc
  got=$(python3 "$checker" --root "$root" --no-pch "$tmp/$name.md" 2>&1); rc=$?
  if [[ $rc -eq $want_rc && $got == *"$want"* ]]; then pass "$name"; else fail "$name (rc $rc, wanted $want_rc and \"$want\"):"$'\n'"$got"; fi
}

case_ broken 1 "broken.md:3: \`\`\`cpp block does not compile cleanly" "# A page

${fence}cpp
int f() { return undeclared_name; }
${fence}"
case_ broken_line 1 "broken_line.md:4:" "# A page

${fence}cpp
int f() { return undeclared_name; }
${fence}"
case_ warning 1 "unused variable" "${fence}cpp
int f() { int unused = 0; return 1; }
${fence}"
case_ fragment 0 "docs: 2 blocks, 1 compiled, 1 fragments, 0 failed" "${fence}cpp fragment
this is not C++ at all {
${fence}

${fence}cpp
#include <fsdp/core/dtype.hpp>
static_assert(fsdp::DType::f32 != fsdp::DType::bf16);
${fence}"
case_ continued 0 "docs: 2 blocks, 2 compiled, 0 fragments, 0 failed" "${fence}cpp
constexpr int twice(int x) { return 2 * x; }
${fence}

Then:

${fence}cpp continued
static_assert(twice(2) == 4);
${fence}"
case_ continued_alone 1 "no compiled block before it" "${fence}cpp continued
int x = 0;
${fence}"
case_ continued_broken 1 "continued_broken.md:5: \`\`\`cpp continued block does not compile" "${fence}cpp
constexpr int twice(int x) { return 2 * x; }
${fence}

${fence}cpp continued
static_assert(thrice(2) == 6);
${fence}"
case_ unknown_word 1 "unknown word 'fragmnet'" "${fence}cpp fragmnet
x
${fence}"
case_ missing_header 1 "names fsdp/no_such_header.hpp, which is not in include/" "Include \`fsdp/no_such_header.hpp\` for it."

if ((fails)); then echo "check_docs_test: $fails failed"; exit 1; fi
echo "check_docs_test: all passed"
