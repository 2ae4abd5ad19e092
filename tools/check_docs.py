#!/usr/bin/env python3
"""Compiles the C++ blocks of README.md and docs/**/*.md, and checks that every fsdp header
they name exists. Doc examples that do not compile go stale silently; this keeps them honest.

Conventions of a block's opening fence:
  ```cpp            a translation unit that must compile on its own;
  ```cpp continued  appended to the previous compiled block of the same file (a walk-through
                    in steps). A chain compiles as a whole, once: a step that leaves a brace
                    open for a later one to close, or that warns until a later step uses what
                    it declares, passes, since only the whole chain is what a reader builds;
                    when the whole fails, each prefix is compiled to name the step that breaks;
  ```cpp fragment   not compiled (a piece that cannot stand alone: use sparingly).
Any other word after `cpp` is an error. Blocks compile with
`g++ -std=c++20 -fsyntax-only -Wall -Wextra`, include paths include/, the repository root
(`#include "examples/engine/..."`: the reference engine) and the system dirs of Boost,
nlohmann, MPI and CUDA. A `#line` before each block makes the compiler's messages name the
markdown file and line.

Every `fsdp/....hpp` named after `#include <` or `#include "`, or in backquotes in prose
(`fsdp/core/error.hpp`), must exist under include/.

Prints each failure as FILE:LINE (the block's opening fence) and the compiler's first
errors (a warning fails a block too), how many chains shared a translation unit, then a
last line
`docs: N blocks, C compiled, F fragments, E failed` (C: blocks that compiled cleanly; E:
blocks that did not, plus every other problem: a missing header, an unknown fence word, a
`continued` block with nothing before it); exits 1 on any failure.

Usage: tools/check_docs.py [--root DIR] [--jobs N] [--no-pch] [FILE.md ...]
  Without files: README.md and docs/**/*.md under the root (default: this script's parent's
  parent). --jobs defaults to the number of CPUs; --no-pch builds no precompiled header.

Cost. Most of a block's compile (2 s of CPU of 2.5 for a short one) is instantiating the
templates that the library's inline code uses, the same in every block. So:
  - A precompiled header of fsdp/fsdp.hpp is built first into a temporary directory, and a
    chain whose opening #include lines (those before any other code) include it, directly
    or through our headers, compiles with it prepended (-include): only #include lines come
    before it, so the chain sees the same headers, never one it did not include.
  - Chains that see the same headers share one translation unit: the headers their opening
    #include lines name, with what our headers include under no #if (include/, and the
    root for examples/...), are the same set. The unit is their #include lines, then each
    chain in a namespace of its own (its #include lines blanked, so line numbers hold). A
    chain with any other preprocessor line, an explicit specialization (`template <>`: it
    must be in its template's namespace), `main`, `namespace fsdp` or `std`, `extern "C"`
    or a using-directive (in a namespace, a name the chain declares would hide one the
    directive brings in, where at global scope the use is ambiguous) compiles alone. After
    the namespaces, a using-declaration of each name a chain declares at namespace scope
    brings it to global scope, where the chain alone declares it: a clash with a global
    name of the headers' (`int index;` and <strings.h>'s index) fails the unit. Should the
    unit not compile cleanly, each of its chains compiles alone, and those results are the
    ones reported. So a shared unit fails no block, and a block in it sees the headers it
    sees alone and no name another declares (the names it declares are read by a simple
    scan, top_level_names: a global clash of one the scan misses would go unnoticed).
    README.md and docs/ (49 blocks, 29 chains, 12 of them in 2 shared units): the whole
    check_docs_test took 90 s of CPU, 114 s with each chain alone (November 2026).
"""
import argparse
import concurrent.futures
import glob
import os
import re
import shutil
import subprocess
import sys
import tempfile

FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*(\S*)\s*(.*?)\s*$")
# fsdp/... headers named in code (#include) or prose (`fsdp/x.hpp`, include/fsdp/x.hpp):
# any fsdp/....hpp that does not continue a longer path (examples/fsdp/... would not count).
HEADER_REF = re.compile(r"(?:(?<![\w/.])|(?<=include/))(fsdp/[A-Za-z0-9_./]+\.hpp)")
SYSTEM_DIRS = [
    "/usr/lib/x86_64-linux-gnu/openmpi/include",
    "/usr/local/cuda/include",
]
FLAGS = ["-std=c++20", "-fsyntax-only", "-Wall", "-Wextra"]
# Headers precompiled for the blocks whose opening #include lines include them. fsdp.hpp
# opens nearly every block: its PCH (about 10 s of CPU to build) halves each block's
# compile (4.6 s -> 2.5 s of CPU for the README's block).
PCH_HEADERS = [
    ("fsdp/fsdp.hpp", "include/fsdp/fsdp.hpp"),
]
INCLUDE = re.compile(r'\s*#\s*include\s*[<"]([^">]+)[">]')
# What keeps a chain out of a shared translation unit (in its text after the opening
# #include lines): see the module's docstring.
ALONE = [
    (re.compile(r"^\s*#", re.M), "a preprocessor line"),
    (re.compile(r"\btemplate\s*<\s*>"), "an explicit specialization"),
    (re.compile(r"\bmain\s*\("), "main"),
    (re.compile(r"\bnamespace\s+(fsdp|std)\b"), "namespace fsdp or std"),
    (re.compile(r'\bextern\s+"C'), "extern \"C\""),
    # Inside a namespace, a name the chain declares hides a name a using-directive brings
    # in, where at global scope both are found and the use is ambiguous.
    (re.compile(r"\busing\s+namespace\b"), "a using-directive"),
]
KEYWORDS = {"alignas", "alignof", "auto", "concept", "const", "constexpr", "consteval", "constinit", "decltype",
            "explicit", "extern", "friend", "inline", "mutable", "noexcept", "operator", "requires", "sizeof",
            "static", "static_assert", "thread_local", "typename", "virtual", "volatile"}


def top_level_names(text):
    """The names a chain's text declares at namespace scope, as far as a simple reading
    finds them (a name it misses goes unchecked, a wrong one only costs the shared unit:
    check_unit)."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/|\"(?:\\.|[^\"\\\n])*\"|'(?:\\.|[^'\\\n])*'", " ", text, flags=re.S)
    statements, flat, depth = [], "", 0
    for ch in text:
        if ch in "([{":
            if depth == 0:
                flat += ch
            depth += 1
        elif ch in ")]}":
            depth = max(0, depth - 1)
            if depth == 0:
                flat += ch
                if ch == "}":
                    statements.append(flat)
                    flat = ""
        elif depth == 0:
            if ch == ";":
                statements.append(flat + ";")
                flat = ""
            else:
                flat += ch
    names = set()
    for st in statements:
        st = st.strip()
        while st.startswith("template"):  # template <...>: its parameters
            i, d = st.find("<"), 0
            for j in range(max(i, 0), len(st)):
                d += {"<": 1, ">": -1}.get(st[j], 0)
                if d == 0:
                    break
            st = st[j + 1:].strip() if i >= 0 else ""
        if not st or re.match(r"(namespace|using\s+[\w:]+\s*;|using\s+(typename\s+)?[\w:]+::)", st):
            continue
        if m := re.match(r"(?:using\s+(\w+)\s*=|typedef\b.*?(\w+)\s*$)", st):
            names.add(m.group(1) or m.group(2))
        elif m := re.match(r"(?:struct|class|union|enum(?:\s+class|\s+struct)?)\s+(?:alignas\s*\(\)\s*)?(\w+)\s*(?:final\b)?\s*[:{;]", st):
            names.add(m.group(1))
        elif m := re.search(r"(?<![\w:~])(\w+)\s*[(={\[;]", st):
            if m.group(1) not in KEYWORDS and not m.group(1).isdigit():
                names.add(m.group(1))
    return names
MAX_ERROR_LINES = 12


class Block:
    def __init__(self, path, line, kind, text):
        self.path, self.line, self.kind, self.text = path, line, kind, text
        self.source = None  # the translation unit compiled for this block


def parse(path, display):
    """The cpp blocks of one markdown file, and the fence errors found."""
    blocks, errors = [], []
    with open(path, encoding="utf-8") as fh:
        lines = fh.read().split("\n")
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang, rest = m.groups()
        start = i + 1  # 1-based line of the opening fence
        body = []
        i += 1
        while i < len(lines):
            c = FENCE.match(lines[i])
            if c and c.group(2)[0] == fence[0] and len(c.group(2)) >= len(fence) and not c.group(3):
                break
            body.append(lines[i][len(indent):] if lines[i].startswith(indent) else lines[i])
            i += 1
        i += 1
        if lang.lower() not in ("cpp", "c++", "cxx"):
            continue
        kind = rest or "unit"
        if kind not in ("unit", "continued", "fragment"):
            errors.append(f"{display}:{start}: unknown word '{rest}' after ```{lang} (use `continued` or `fragment`)")
            continue
        blocks.append(Block(display, start, kind, "\n".join(body)))
    return blocks, errors


def header_refs(path, display, include_dir):
    missing = []
    with open(path, encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            for h in HEADER_REF.findall(line):
                if not os.path.isfile(os.path.join(include_dir, h)):
                    missing.append(f"{display}:{n}: names {h}, which is not in include/")
    return missing


def opening_includes(text):
    """The headers named by a block's opening #include lines (those before any other code;
    blank and // comment lines may come between), and the text with those lines blanked."""
    lines = text.split("\n")
    headers = []
    for i, line in enumerate(lines):
        s = line.strip()
        if not s or s.startswith("//"):
            continue
        m = INCLUDE.match(s)
        if not m:
            break
        headers.append(m.group(1))
        lines[i] = ""
    return headers, "\n".join(lines)


class Seen:
    """The headers that a list of #include lines makes a translation unit see, as far as
    our own headers' #include lines (those under no #if) tell: a subset of what the compiler
    includes, which is all that sharing a unit needs (docstring)."""

    def __init__(self, root):
        self.dirs = [os.path.join(root, "include"), root]
        self.memo = {}

    def __call__(self, headers):
        out = set()
        for h in headers:
            out |= self.one(h)
        return frozenset(out)

    def one(self, h):
        if h not in self.memo:
            self.memo[h] = {h}  # first, for a cycle
            path = next((p for p in (os.path.join(d, h) for d in self.dirs) if os.path.isfile(p)), None)
            if path and h.endswith((".hpp", ".h")):
                depth, found = 0, {h}
                with open(path, encoding="utf-8") as fh:
                    for line in fh:
                        if re.match(r"\s*#\s*if", line):
                            depth += 1
                        elif re.match(r"\s*#\s*endif", line):
                            depth -= 1
                        elif depth == 0 and (m := INCLUDE.match(line)):
                            found |= self.one(m.group(1))
                self.memo[h] = found
        return self.memo[h]


def build_pch(root, pch_dir, include_args, jobs):
    """Builds the precompiled headers in parallel; returns the names of those that built."""
    def one(name, rel):
        src = os.path.join(root, rel)
        if not os.path.isfile(src):
            return None
        out = os.path.join(pch_dir, name + ".gch")
        os.makedirs(os.path.dirname(out), exist_ok=True)
        # Where g++ finds X.gch it opens X from the same directory when the PCH does not
        # apply (X included after other code): the header itself lies beside it.
        os.symlink(src, os.path.join(pch_dir, name))
        # -fsyntax-only does not write a PCH; the PCH must use the blocks' other flags.
        cmd = ["g++", "-std=c++20", "-Wall", "-Wextra", "-x", "c++-header", *include_args, src, "-o", out]
        if subprocess.run(cmd, capture_output=True, text=True).returncode == 0:
            return name
        os.unlink(os.path.join(pch_dir, name))  # the blocks that include it report the errors
        return None

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        return {n for n in pool.map(lambda h: one(*h), PCH_HEADERS) if n}


def compile_source(source, work, include_args, pch):
    """None if the source compiles cleanly, else its first errors. pch: the PCH directory
    and the header in it to prepend (-include), or None."""
    fd, src = tempfile.mkstemp(suffix=".cpp", dir=work)
    with os.fdopen(fd, "w", encoding="utf-8") as fh:
        fh.write(source)
    use = ["-I" + pch[0], "-include", os.path.join(*pch)] if pch else []
    cmd = ["g++", *FLAGS, *use, *include_args, src]
    r = subprocess.run(cmd, capture_output=True, text=True)
    out = (r.stdout + r.stderr).strip()
    failed = r.returncode != 0 or re.search(r"\bwarning:", out) is not None
    if not failed:
        return None
    keep = [l for l in out.split("\n") if re.search(r"\b(error|warning):", l)] or out.split("\n")
    return "\n".join("    " + l for l in keep[:MAX_ERROR_LINES])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--root", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--no-pch", action="store_true")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    root = os.path.abspath(args.root)
    include_dir = os.path.join(root, "include")
    files = args.files or [os.path.join(root, "README.md"),
                           *sorted(glob.glob(os.path.join(root, "docs", "**", "*.md"), recursive=True))]

    problems = []
    blocks = []
    for f in files:
        display = os.path.relpath(f, root) if os.path.abspath(f).startswith(root + os.sep) else f
        b, errs = parse(f, display)
        problems += errs
        problems += header_refs(f, display, include_dir)
        blocks += b

    # Translation units: a plain block starts one; `continued` appends to the last of its file.
    last = {}
    compiled = []
    chains = []  # a plain block and the `continued` blocks after it
    chain_of = {}
    for b in blocks:
        piece = f'#line {b.line + 1} "{b.path}"\n{b.text}\n'
        if b.kind == "fragment":
            continue
        if b.kind == "continued":
            if b.path not in last:
                problems.append(f"{b.path}:{b.line}: ```cpp continued, but no compiled block before it in this file")
                continue
            b.source = last[b.path] + piece
            chain_of[b.path].append(b)
        else:
            b.source = piece
            chain_of[b.path] = [b]
            chains.append(chain_of[b.path])
        last[b.path] = b.source
        compiled.append(b)

    include_args = ["-I" + include_dir, "-I" + root] + [f"-isystem{d}" for d in SYSTEM_DIRS if os.path.isdir(d)]
    # What each chain sees (its opening #include lines), and the chains that share a unit:
    # those that see the same, unless one must compile alone (ALONE).
    seen = Seen(root)
    opening, body, plain, shared = {}, {}, {}, {}  # by id(chain): its opening headers, its text without them
    for chain in chains:
        headers, text = opening_includes(chain[0].text)
        opening[id(chain)] = headers
        plain[id(chain)] = "\n".join([text] + [b.text for b in chain[1:]])
        body[id(chain)] = "".join(f'#line {b.line + 1} "{b.path}"\n{t}\n' for b, t in
                                  zip(chain, [text] + [b.text for b in chain[1:]]))
        if not any(r.search("\n".join([text] + [b.text for b in chain[1:]])) for r, _ in ALONE):
            shared.setdefault(seen(headers), []).append(chain)
    units = [group for group in shared.values() if len(group) > 1]
    alone = [chain for chain in chains if not any(chain in group for group in units)]

    work = tempfile.mkdtemp(prefix="check_docs.")
    failed = 0
    try:
        pch = set() if args.no_pch or not compiled else build_pch(root, os.path.join(work, "pch"), include_args, args.jobs)
        pch_dir = os.path.join(work, "pch")

        def pch_for(headers):  # the PCH to prepend for a unit that opens with these headers
            found = seen(headers)
            return next(((pch_dir, h) for h in sorted(pch) if h in found), None)

        def compile_(source, use):
            err = compile_source(source, work, include_args, use)
            if err is not None and use is not None:
                # Again without the PCH: a header edited after the PCH was built makes g++
                # see it twice (its #pragma once compares contents), which is not the block's fault.
                err = compile_source(source, work, include_args, None)
            return err

        def check_chain(chain):
            """(block, errors) for each block of a chain that does not compile. The whole
            chain compiles first: when it does, the steps before it are taken to compile
            too (one compile instead of one per step); when it does not, every step is
            compiled to find where it breaks."""
            use = pch_for(opening[id(chain)])
            err = compile_(chain[-1].source, use)
            if err is None:
                return []
            found = [(b, e) for b in chain[:-1] for e in [compile_(b.source, use)] if e is not None]
            return found + [(chain[-1], err)]

        def check_unit(group):
            """The chains of a shared unit, compiled together; each alone if that fails."""
            headers = list(dict.fromkeys(h for chain in group for h in opening[id(chain)]))
            source = "".join(f"#include <{h}>\n" for h in headers)
            for n, chain in enumerate(group):
                source += f"namespace check_docs_{n} {{\n{body[id(chain)]}}}\n"
            # Each name a chain declares, also at global scope, where the chain alone declares
            # it: a clash with a name of the headers' (a C function, say) fails the unit, as it
            # fails the chain alone. A name that two chains declare: the first's.
            declared = {}
            for n, chain in enumerate(group):
                for name in sorted(top_level_names(plain[id(chain)])):
                    declared.setdefault(name, n)
            source += "".join(f"using check_docs_{n}::{name};\n" for name, n in declared.items())
            if compile_(source, pch_for(headers)) is None:
                return []
            fell_back.append(group)
            return [found for chain in group for found in check_chain(chain)]

        fell_back = []  # the units that did not compile cleanly
        tasks = [(check_unit, group) for group in units] + [(check_chain, chain) for chain in alone]
        errors = {}  # id(block) -> its errors
        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for found in pool.map(lambda task: task[0](task[1]), tasks):
                errors.update((id(b), err) for b, err in found)
        for b in compiled:
            if id(b) in errors:
                failed += 1
                problems.append(f"{b.path}:{b.line}: ```cpp{' continued' if b.kind == 'continued' else ''} block does not compile cleanly:\n{errors[id(b)]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for p in problems:
        print(p)
    if chains:
        print(f"docs: {len(chains)} chains of blocks; {sum(len(g) for g in units)} of them share "
              f"{len(units)} translation unit(s), {len(alone)} compile alone; "
              f"{len(fell_back)} unit(s) failed, their chains compiled alone")
    fragments = sum(1 for b in blocks if b.kind == "fragment")
    errors = failed + (len(problems) - failed)
    print(f"docs: {len(blocks)} blocks, {len(compiled) - failed} compiled, {fragments} fragments, {errors} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
