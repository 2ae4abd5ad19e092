#!/usr/bin/env bash
# The library's headers compile without a single warning under -Wall -Wextra -Wpedantic
# (-Werror), with g++ 12 and clang 14, and each header compiles on its own (it includes what
# it uses). Third-party headers come in as system headers, so only ours count: Boost,
# nlohmann, doctest, xxhash, fmt from /usr/include (a system directory already), MPI, CUDA/NCCL
# and libtorch's C++ API by -isystem.
#
# What compiles (-fsyntax-only, in parallel):
#  - every header of include/fsdp and examples/engine on its own, with clang++-14: the
#    self-containment check (both compilers use the same libstdc++, so one is enough) and
#    clang's warnings, the end-of-file ones too (an unused private field: clang reports it
#    only where nothing is included after the class, so only in the header's own compile).
#    The headers that include libtorch (fsdp/torch/) with g++-12 instead: clang 14 cannot
#    parse libtorch 1.13's headers as C++20. They are checked only where
#    /usr/include/torch/csrc/api/include/torch/torch.h exists, and reported skipped elsewhere;
#  - one file including every header (but libtorch's: each compiles with g++ on its own),
#    then test/tools/header_warnings_engine.cpp, with g++-12: g++'s warnings in every header, and
#    the templates instantiated the way the reference engine does (shard<FullShard>,
#    training steps, MixedPrecision, offload, checkpoint save and load), for the warnings
#    inside template bodies; the engine file alone with clang++-14; and once more with g++
#    under FSDP_SEPARATE_COMPILATION (fsdp/core/config.hpp), whose own source,
#    fsdp/separate_compilation.hpp, is compiled in that mode too, as is, on its own, every
#    header with definitions for that source (#if FSDP_DEFINES_IMPLEMENTATION);
#  - canaries: a header of ours with an unused variable must fail with each compiler, or the
#    flags are wrong; a header that uses std::priority_queue without <queue> must fail after
#    a precompiled header (below), or the PCHs hide missing includes.
# A middle-end warning (those -O2 finds) is not in reach of -fsyntax-only.
#
# Precompiled headers. Most of a header's compile is not its own text but what it includes,
# and the templates their inline code instantiates (sharded_model.hpp and what it includes:
# 2 s; some 60 headers include it). So a few headers ("hubs", picked by estimated cost) are
# also compiled into a PCH (clang: -fpch-instantiate-templates, so those instantiations are
# done there, once), and a header H that includes a hub B, directly or through headers it
# includes (never under an #if), compiles after B's PCH: B and what it includes come first
# instead of where H includes them, and H sees all of them either way. So H still sees only
# what it includes: a missing #include still fails. Not for a header that defines a macro
# or has code before an #include (which the PCH would put before that code), or that
# compiles with other -D flags. A header that fails after a PCH is compiled again without
# it, and that compile is its result: a PCH cannot fail a header.
# libtorch's headers that include <torch/torch.h> under no #if compile after a PCH of that
# header alone (third-party, but one each of them includes anyway), not after a hub of ours.
# PCHs are not chained (clang 14 crashes on a PCH built on another, or loses its macros).
# Building a PCH is no check (clang skips its end-of-file checks there): every header, hub or
# not, has its own compile. Hubs are clang's: g++ compiles only libtorch's headers, never hubs.
#
# Usage: header_warnings_test.sh [ROOT]   ROOT holds include/, examples/engine/ and this
# test's engine file (default: the current directory, as under `bazel test`). JOBS sets the
# parallelism (default: nproc); TORCH_INCLUDE libtorch's C++ API directory (default:
# /usr/include/torch/csrc/api/include). Cost: 331 s of CPU, 180 s with 2 jobs on the 2-core
# development machine (382 s and 231 s with a hub of ours for libtorch's headers, run just
# before, December 2026); 436 s of CPU without any PCH (November 2026).
set -uo pipefail
root=${1:-.}
root=$(cd "$root" && pwd)
jobs=${JOBS:-$(nproc)}
gxx=g++-12 clang=clang++-14
for c in $gxx $clang python3; do
  command -v "$c" >/dev/null || { echo "FAIL: $c is not installed (tools/setup.sh installs it)"; exit 1; }
done
torch_include=${TORCH_INCLUDE:-/usr/include/torch/csrc/api/include}
[[ -f $torch_include/torch/torch.h ]] || torch_include=""
flags=(-std=c++20 -Wall -Wextra -Wpedantic -Werror
  -I"$root/include" -I"$root"
  -isystem /usr/lib/x86_64-linux-gnu/openmpi/include -isystem /usr/local/cuda/include
  ${torch_include:+-isystem "$torch_include"})

tmp=$(mktemp -d "${TMPDIR:-/tmp}/header_warnings.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

start=$SECONDS
# Plans and runs every compile; for each writes log/NAME.log and log/NAME.rc, and the list
# "COMPILER NAME" of them in report order to jobs.
python3 - "$root" "$tmp" "$jobs" "$gxx" "$clang" "$torch_include" "${flags[@]}" <<'EOF' || { echo "FAIL: the planner failed"; exit 1; }
import concurrent.futures, os, re, subprocess, sys

root, tmp, jobs, gxx, clang, torch_include = sys.argv[1:7]
flags, jobs = sys.argv[7:], max(1, int(sys.argv[3]))
for d in ("src", "log", "pch", "canary/fsdp"):
    os.makedirs(os.path.join(tmp, d))

def find(top, rel):
    out = []
    for d, _, files in os.walk(os.path.join(root, top, rel)):
        out += [os.path.relpath(os.path.join(d, f), os.path.join(root, top)) for f in files if f.endswith(".hpp")]
    return sorted(out)

# Headers, as included: fsdp/... under include/, examples/engine/... under the root.
ours_found, engine_found = find("include", "fsdp"), find("", "examples/engine")
if not ours_found or not engine_found:
    print(f"FAIL: no headers under {root}/include or {root}/examples/engine")
    sys.exit(1)
headers = ours_found + engine_found
path = {h: os.path.join(root, "include" if h.startswith("fsdp/") else "", h) for h in headers}

# Each header's includes: ours (all, and those under no #if), third-party; and whether it
# defines a macro before an #include.
INCLUDE = re.compile(r'\s*#\s*include\s*[<"]([^">]+)[">]')
IF, ENDIF, DEFINE = (re.compile(r"\s*#\s*" + w) for w in ("if", r"endif\b", r"(define|undef)\b"))
# And whether code comes before an #include (what the PCH would put before that code, the
# code would see: a name used before the #include that declares it would compile).
ours, theirs, unconditional, define_first, lines, theirs_unconditional = {}, {}, {}, {}, {}, {}
for h in headers:
    ours[h], theirs[h], unconditional[h], theirs_unconditional[h] = [], [], [], []
    depth, defined, define_first[h], lines[h] = 0, False, False, 0
    code, comment = False, False
    with open(path[h], encoding="utf-8") as fh:
        for line in fh:
            lines[h] += 1
            s = line.strip()
            if comment or s.startswith("/*"):
                comment = "*/" not in s[2 if s.startswith("/*") else 0:]
            elif s and not s.startswith(("//", "#")):
                code = True
            if IF.match(line):
                depth += 1
            elif ENDIF.match(line):
                depth -= 1
            elif DEFINE.match(line):
                defined = True
            elif m := INCLUDE.match(line):
                define_first[h] |= defined or code
                if m.group(1) in path:
                    ours[h].append(m.group(1))
                    if depth == 0:
                        unconditional[h].append(m.group(1))
                else:
                    theirs[h].append(m.group(1))
                    if depth == 0:
                        theirs_unconditional[h].append(m.group(1))

closure = {}
def close(h):  # h and every header of ours it includes
    if h not in closure:
        closure[h] = {h}
        for d in ours[h]:
            closure[h] |= close(d)
    return closure[h]
def reach(h):  # the headers of ours that h includes, directly or not, never under an #if
    out, todo = set(), list(unconditional[h])
    while todo:
        d = todo.pop()
        if d not in out:
            out.add(d)
            todo += unconditional[d]
    return out

# libtorch's: fsdp/torch/'s headers, and any that includes libtorch (torch/, ATen/, c10/).
torch = {h for h in headers if h.startswith("fsdp/torch/") or
         any(t.startswith(("torch/", "ATen/", "c10/")) for d in close(h) for t in theirs[d])}
if torch and not torch_include:
    print(f"SKIPPED: {len(torch)} headers that include libtorch ({' '.join(sorted(torch))}): libtorch is not "
          f"installed ({os.environ.get('TORCH_INCLUDE', '/usr/include/torch/csrc/api/include')}/torch/torch.h; "
          "tools/setup.sh installs libtorch-dev)")
    headers = [h for h in headers if h not in torch]
# The one source of the separately compiled mode is compiled in that mode (fsdp/core/config.hpp).
extra = {h: ["-DFSDP_SEPARATE_COMPILATION"] for h in headers if h == "fsdp/separate_compilation.hpp"}
# The headers that keep definitions for that one source (#if FSDP_DEFINES_IMPLEMENTATION)
# and include there what only those use: each compiles on its own in that mode too, so that
# the rest of it uses nothing it includes only there.
separate = sorted(h for h in headers if h not in extra and h != "fsdp/core/config.hpp" and h not in torch and
                  "FSDP_DEFINES_IMPLEMENTATION" in open(path[h], encoding="utf-8").read())
compiler = {h: gxx if h in torch else clang for h in headers}

# Estimated CPU seconds of a header's compile, only used to pick the hubs: a least-squares
# fit to this library's headers with clang 14 (November 2026, 0.24 s rms): 0.25 s per 1000
# lines of ours, and the libraries with a large cost of their own (libtorch: measured).
HEAVY = {"nlohmann/json.hpp": 1.5, "boost/asio": 1.4, "cuda_runtime.h": 0.4, "xxhash.h": 0.25, "torch/torch.h": 17}
def est(h):
    tp = {t for d in close(h) for t in theirs[d]}
    heavy = {k for t in tp for k in HEAVY if t.startswith(k)}
    return 0.2 + sum(lines[d] for d in close(h)) / 4000 + sum(HEAVY[k] for k in heavy) + 0.015 * len(tp)
cost = {h: est(h) for h in headers}
LOAD = {clang: 0.1}  # loading a PCH
# A header's possible hubs: what it includes under no #if, compiled by the same compiler. Not
# for libtorch's headers: those that include <torch/torch.h> under no #if compile after a PCH
# of it instead (below), which is what they spend their time on.
eligible = {h: sorted(d for d in reach(h) if d in cost and d not in extra and compiler[d] == compiler[h])
            for h in headers if h not in extra and not define_first[h] and h not in torch}
base, hubs = {}, set()
def now(h):
    return LOAD[compiler[h]] + cost[h] - cost[base[h]] if h in base else cost[h]
while True:  # greedy: add the hub that saves the most, while one saves more than a second
    best, gain = None, 1.0
    for b in sorted(cost):
        if b in hubs or b in extra or b in torch:
            continue
        g = -(1.3 * cost[b] + 0.2)  # its PCH: a compile more, a third slower than a check
        for h, cands in eligible.items():
            if b in cands:
                g += max(0.0, now(h) - (LOAD[compiler[h]] + cost[h] - cost[b]))
        if g > gain:
            best, gain = b, g
    if best is None:
        break
    hubs.add(best)
    for h, cands in eligible.items():
        if best in cands and (h not in base or cost[best] > cost[base[h]]):
            base[h] = best
# libtorch's headers: <torch/torch.h> alone takes 20 s of g++'s CPU of the 21 to 30 each of
# them took, and 36 s into a PCH, after which each takes 6 to 10 s (December 2026). A header
# that includes it under no #if compiles after that PCH: it sees nothing it does not include
# itself, as after a hub's. (A hub of ours that includes libtorch, chosen by the estimates,
# took 46 s to build, and fsdp/torch/optimizer.hpp, which does not include it, 30 s alone.
# fsdp/torch/tensor_traits.hpp includes only ATen's tensor: it compiles alone, in 5 s.)
TORCH_HUB = "torch/torch.h"
torch_users = sorted(h for h in torch if h in headers and TORCH_HUB in theirs_unconditional[h] and not define_first[h])
compiler[TORCH_HUB] = gxx
def name(h):
    return h.replace("/", "_").replace(".", "_")
work, order = {}, []  # job name -> (argv, hub or None, priority); "COMPILER NAME" in report order
def add(job, c, argv, hub=None, prio=0, report=True):
    work[job] = (argv, hub, prio)
    if report:
        order.append(f"{c} {job}")

# Each header on its own (-fsyntax-only), and each hub into its PCH, from its own "#include"
# (a PCH takes the same flags as the files that use it). Building a PCH is no check: clang
# skips its end-of-file checks there. So a hub is checked as every header is.
# g++ finds a PCH (libtorch's) as X.gch beside the X it is told to -include (and reads X, the
# "#include", should the PCH not fit).
if torch_users:
    hubs.add(TORCH_HUB)
    for h in torch_users:
        base[h] = TORCH_HUB
pch_job = {}  # hub -> the job that writes its PCH
for h in sorted(hubs):
    c, n = compiler[h], name(h)
    src = os.path.join(tmp, "pch", n + ".hpp")
    with open(src, "w") as fh:
        fh.write(f'#include <{h}>\n' if h == TORCH_HUB else f'#include "{h}"\n')
    pch_job[h] = "pch-" + n
    out = ["-x", "c++-header"] + (["-fpch-instantiate-templates"] if c == clang else []) + [
        src, "-o", src + (".gch" if c == gxx else ".pch")]
    add(pch_job[h], c, [c, *flags, *out], prio=2, report=False)
for h in headers:
    c, n = compiler[h], name(h)
    src = os.path.join(tmp, "src", n + ".cpp")
    with open(src, "w") as fh:
        fh.write(f'#include "{h}"\n')
    add(n, c, [c, *flags, *extra.get(h, []), "-fsyntax-only", src], base.get(h))
for h in separate:  # the same one-line file, in the separately compiled mode, after no PCH
    add(name(h) + "-separate", compiler[h], [compiler[h], *flags, "-DFSDP_SEPARATE_COMPILATION", "-fsyntax-only",
                                            os.path.join(tmp, "src", name(h) + ".cpp")])

# Every header in one file (not the separate compilation's source, nor libtorch's, which
# compile with g++ on their own already), then the engine file, with g++: g++'s warnings in
# every header, and in the templates as the engine instantiates them. The engine file alone
# with clang (clang's warnings in every header are its compiles of each header).
engine = os.path.join(root, "test/tools/header_warnings_engine.cpp")
src = os.path.join(tmp, "src", "all.hpp")
with open(src, "w") as fh:
    fh.writelines(f'#include "{h}"\n' for h in headers if h not in extra and h not in torch)
add(f"all+engine-{gxx}", gxx, [gxx, *flags, "-fsyntax-only", "-include", src, engine], prio=1)
add(f"engine-{clang}", clang, [clang, *flags, "-fsyntax-only", engine], prio=1)
# The engine file in the separately compiled mode (what its files see), with g++.
add("engine-separate", gxx, [gxx, *flags, "-fsyntax-only", engine, "-DFSDP_SEPARATE_COMPILATION"], prio=1)
# The canaries.
canary = os.path.join(tmp, "canary")
with open(os.path.join(canary, "fsdp/canary.hpp"), "w") as fh:
    fh.write("#pragma once\ninline int canary() { int unused = 0; return 1; }\n")
with open(os.path.join(tmp, "src", "canary.cpp"), "w") as fh:
    fh.write('#include "fsdp/canary.hpp"\n#include "fsdp/core/dtype.hpp"\n')
for c in (gxx, clang):
    add(f"canary-{c}", c, [c, *flags, "-fsyntax-only", os.path.join(tmp, "src", "canary.cpp"), "-I" + canary])
# After the PCH of the hub with the most headers on it, which includes nothing with <queue>.
on = {b: [h for h in base if base[h] == b] for b in hubs}
hub = max((b for b in hubs if compiler[b] == clang and not any(t == "queue" for d in close(b) for t in theirs[d])),
          key=lambda b: (len(on[b]), b), default=None)
if hub:
    with open(os.path.join(canary, "fsdp/canary_include.hpp"), "w") as fh:
        fh.write(f'#pragma once\n#include "{hub}"\ninline std::priority_queue<int> canary_queue() {{ return {{}}; }}\n')
    with open(os.path.join(tmp, "src", "canary_include.cpp"), "w") as fh:
        fh.write('#include "fsdp/canary_include.hpp"\n')
    add("canary-include", clang, [clang, *flags, "-fsyntax-only", os.path.join(tmp, "src", "canary_include.cpp"),
                                  "-I" + canary], hub)
else:
    order.append(f"{clang} canary-include-unused")  # no clang PCH, so nothing to prove

# Run, each job once its hub's PCH is done, in parallel: the hubs first, then the long all-in-one
# files, so that the last jobs to finish are short ones.
built = set()
def pch_args(argv, hub):
    if hub not in built:
        return []
    src = os.path.join(tmp, "pch", name(hub) + ".hpp")
    return ["-include", src] if argv[0] == gxx else ["-include-pch", src + ".pch"]
def compile_(argv, log):
    with open(log, "w") as fh:
        return subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT).returncode
def run(job):
    argv, hub, _ = work[job]
    log = os.path.join(tmp, "log", job + ".log")
    pch = pch_args(argv, hub)
    rc = compile_(argv[:1] + pch + argv[1:], log)
    if rc != 0 and pch:
        rc = compile_(argv, log)
    with open(os.path.join(tmp, "log", job + ".rc"), "w") as fh:
        fh.write(f"{rc}\n")
    return job, rc

after = {}
for j, (_, hub, _) in work.items():
    if hub:
        after.setdefault(pch_job[hub], []).append(j)
def key(j):
    return (-work[j][2], -len(after.get(j, [])), -cost.get(work[j][1] or "", 0))
ready = sorted((j for j in work if not work[j][1]), key=key)
with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
    running = set()
    while ready or running:
        while ready and len(running) < jobs:
            running.add(pool.submit(run, ready.pop(0)))
        done, running = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
        for f in done:
            job, rc = f.result()
            if job in after:
                if rc == 0:
                    built.add(next(h for h in hubs if pch_job[h] == job))
                ready = sorted(ready + after[job], key=key)

with open(os.path.join(tmp, "jobs"), "w") as fh:
    fh.writelines(o + "\n" for o in order)
with open(os.path.join(tmp, "summary"), "w") as fh:
    fh.write(f"{len(headers)} headers on their own ({len(headers) - len(torch & set(headers))} with {clang}, "
             f"{len(separate)} of them also under FSDP_SEPARATE_COMPILATION, "
             f"{len(torch & set(headers))} that include libtorch with {gxx}, {len(torch_users)} of them after a PCH of "
             f"<{TORCH_HUB}>; {len(hubs & set(headers))} of ours also into PCHs, used by "
             f"{sum(1 for h in base if base[h] != TORCH_HUB)})")
EOF

fails=0
while read -r c name _; do
  rc=$(cat "$tmp/log/$name.rc" 2>/dev/null || echo missing)
  if [[ $name == canary-include-unused ]]; then
    echo "PASS: canary-include: no header compiles after a PCH here"
  elif [[ $name == canary-include ]]; then
    if [[ $rc != 0 ]] && grep -q 'priority_queue' "$tmp/log/$name.log"; then echo "PASS: $name: a header missing an #include fails after a PCH"; else
      echo "FAIL: $name: a header that uses std::priority_queue without <queue> compiled after a PCH (rc $rc): the PCHs hide missing includes"; fails=$((fails + 1)); fi
  elif [[ $name == canary-* ]]; then
    if [[ $rc != 0 ]] && grep -q 'unused' "$tmp/log/$name.log"; then echo "PASS: $name: a warning in our header fails"; else
      echo "FAIL: $name: a header of ours with an unused variable compiled (rc $rc): the flags catch nothing"; fails=$((fails + 1)); fi
  elif [[ $rc == 0 && ! -s $tmp/log/$name.log ]]; then
    :
  else
    echo "FAIL: $c on $name (rc $rc):"
    head -n 40 "$tmp/log/$name.log"
    fails=$((fails + 1))
  fi
done <"$tmp/jobs"
echo "header_warnings_test: $(cat "$tmp/summary"); all headers and the engine file in one file with $gxx, the engine file with $clang; $((SECONDS - start)) s with $jobs jobs"
if ((fails)); then echo "header_warnings_test: $fails failed"; exit 1; fi
echo "header_warnings_test: all passed"
