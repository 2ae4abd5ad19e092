#!/usr/bin/env python3
"""Compiles the C++ blocks of README.md and docs/*.md, and checks that every fsdp header
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
errors (a warning fails a block too), then a last line
`docs: N blocks, C compiled, F fragments, E failed` (C: blocks that compiled cleanly; E:
blocks that did not, plus every other problem: a missing header, an unknown fence word, a
`continued` block with nothing before it); exits 1 on any failure.

Usage: tools/check_docs.py [--root DIR] [--jobs N] [--no-pch] [FILE.md ...]
  Without files: README.md and docs/*.md under the root (default: this script's parent's
  parent). --jobs defaults to the number of CPUs. A precompiled header of fsdp/fsdp.hpp is
  built first into a temporary directory and used by every block whose first line is
  `#include <fsdp/fsdp.hpp>`; a block that starts otherwise compiles without it (g++ uses
  a PCH only before any other code), so a block never sees a header it did not include.
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
# Headers precompiled when a block includes one of them before anything else. fsdp.hpp
# opens nearly every block: its PCH (about 10 s of CPU to build) halves each block's
# compile (4.6 s -> 2.5 s of CPU for the README's block).
PCH_HEADERS = [
    ("fsdp/fsdp.hpp", "include/fsdp/fsdp.hpp"),
]
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


def first_include(text):
    """The header of a block's first non-blank, non-comment line if it is an #include."""
    for line in text.split("\n"):
        s = line.strip()
        if not s or s.startswith("//"):
            continue
        m = re.match(r'#\s*include\s*[<"]([^">]+)[">]', s)
        return m.group(1) if m else None
    return None


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


def compile_block(block, work, include_args, use_pch):
    src = os.path.join(work, f"block{id(block)}.cpp")
    with open(src, "w", encoding="utf-8") as fh:
        fh.write(block.source)
    cmd = ["g++", *FLAGS, *(["-I" + use_pch] if use_pch else []), *include_args, src]
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
    files = args.files or [os.path.join(root, "README.md"), *sorted(glob.glob(os.path.join(root, "docs", "*.md")))]

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
    work = tempfile.mkdtemp(prefix="check_docs.")
    failed = 0
    try:
        pch = set() if args.no_pch or not compiled else build_pch(root, os.path.join(work, "pch"), include_args, args.jobs)
        pch_dir = os.path.join(work, "pch")

        def check_chain(chain):
            """(block, errors) for each block of a chain that does not compile. The whole
            chain compiles first: when it does, the steps before it are taken to compile
            too (one compile instead of one per step); when it does not, every step is
            compiled to find where it breaks."""
            use = pch_dir if first_include(chain[0].source.split("\n", 1)[1]) in pch else None
            err = compile_block(chain[-1], work, include_args, use)
            if err is not None and use is not None:
                # Again without the PCH: a header edited after the PCH was built makes g++
                # see it twice (its #pragma once compares contents), which is not the block's fault.
                use = None
                err = compile_block(chain[-1], work, include_args, use)
            if err is None:
                return []
            found = [(b, e) for b in chain[:-1] for e in [compile_block(b, work, include_args, use)] if e is not None]
            return found + [(chain[-1], err)]

        with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.jobs)) as pool:
            for found in pool.map(check_chain, chains):
                for b, err in found:
                    failed += 1
                    problems.append(f"{b.path}:{b.line}: ```cpp{' continued' if b.kind == 'continued' else ''} block does not compile cleanly:\n{err}")
    finally:
        shutil.rmtree(work, ignore_errors=True)

    for p in problems:
        print(p)
    fragments = sum(1 for b in blocks if b.kind == "fragment")
    errors = failed + (len(problems) - failed)
    print(f"docs: {len(blocks)} blocks, {len(compiled) - failed} compiled, {fragments} fragments, {errors} failed")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
