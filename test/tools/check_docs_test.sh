#!/usr/bin/env bash
# tools/check_docs.py: every C++ block of README.md and docs/**/*.md compiles (or is marked a
# fragment) and every fsdp header they name exists; and, on temporary markdown files, the
# checker fails a broken block (naming its file and line), skips a fragment, compiles a
# `continued` block together with the block before it, compiles blocks that see the same
# headers in one unit without letting one block see another's headers or names, and
# refuses a `continued` block with nothing before it, an unknown fence word and a header
# that does not exist.
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
# Blocks that see the same headers compile in one translation unit, each in a namespace of
# its own (tools/check_docs.py): a block still sees no header another block includes and
# no name another declares, and a failure is still its own block's.
case_ shared_pass 0 "docs: 4 chains of blocks; 2 of them share 1 translation unit(s), 2 compile alone; 0 unit(s) failed" "${fence}cpp
#include <vector>
struct Model { std::vector<int> layers; };
${fence}

${fence}cpp
#include <vector>
struct Model { std::vector<float> weights; };  // the same name: each block is on its own
${fence}

${fence}cpp
#include <map>
std::map<int, int> table;
${fence}

${fence}cpp
int main() { return 0; }
${fence}"
case_ shared_missing_include 1 "shared_missing_include.md:6: \`\`\`cpp block does not compile cleanly" "${fence}cpp
#include <map>
std::map<int, int> table;
${fence}

${fence}cpp
#include <vector>
std::map<int, int> other;  // <map> is another block's
${fence}

${fence}cpp
#include <vector>
std::vector<int> v;
${fence}"
case_ shared_missing_include_count 1 "docs: 3 blocks, 2 compiled, 0 fragments, 1 failed" "$(cat "$tmp/shared_missing_include.md")"
case_ shared_name 1 "shared_name.md:6: \`\`\`cpp block does not compile cleanly" "${fence}cpp
#include <vector>
inline int helper() { return 1; }
${fence}

${fence}cpp
#include <vector>
inline int twice() { return 2 * helper(); }  // helper() is another block's
${fence}"
case_ shared_warning 1 "shared_warning.md:6: \`\`\`cpp block does not compile cleanly" "${fence}cpp
#include <vector>
inline int one() { return 1; }
${fence}

${fence}cpp
#include <vector>
inline int f() { int unused = 0; return 1; }
${fence}"
# A name a block declares clashes with ::index (<cstring>, from glibc's <strings.h>) at
# global scope, where the block alone declares it: the shared unit must fail it too.
case_ shared_global_clash 1 "shared_global_clash.md:6: \`\`\`cpp block does not compile cleanly" "${fence}cpp
#include <cstring>
inline int one() { return 1; }
${fence}

${fence}cpp
#include <cstring>
int index = 0;  // ::index is strings.h's
${fence}"
# A using-directive (of std by an alias): alone, the block's count and std::count are both
# found (ambiguous); in a namespace the block's would hide std's. Such a chain compiles alone.
case_ shared_using_directive 1 "shared_using_directive.md:7: \`\`\`cpp block does not compile cleanly" "${fence}cpp
#include <algorithm>
#include <vector>
inline int one() { return 1; }
${fence}

${fence}cpp
#include <algorithm>
#include <vector>
namespace s = std;
using namespace s;
int count = 0;
inline int next_count() { return ++count; }
${fence}"
case_ missing_header 1 "names fsdp/no_such_header.hpp, which is not in include/" "Include \`fsdp/no_such_header.hpp\` for it."

if ((fails)); then echo "check_docs_test: $fails failed"; exit 1; fi
echo "check_docs_test: all passed"
