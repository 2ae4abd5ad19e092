#!/usr/bin/env python3
"""Checks the layers of include/fsdp (README.md, "Layout"; each folder's README.md): every `#include "fsdp/..."` in a
header must point at its own folder or at a folder that the table below lets it use, a
folder's detail/ may include of its own folder's public headers only those that use no
detail/ header of the folder, even indirectly (detail sits strictly below what uses it), and no header includes anything after its first declaration (no include at the end
of a file to break a cycle). Prints each violation as FILE:LINE: why, and a last line
`layers: N headers, M violations`; exits 1 on any violation.

Usage: tools/check_layers.py [include-dir]   (default: include/ beside this script's parent)
"""
import os
import re
import sys

# folder -> the folders its headers may include (besides itself). Bottom to top:
# concepts; backends and communicator adapters (concepts only); policies; the unit;
# the model (root and training loop); checkpoints; the libtorch adapter (an engine's
# integration: its tensors, modules, hooks and optimizers, with the host backend's thread
# ranks and checkpoints of its optimizer state); CUDA graphs of a training step (the model
# with the CUDA and NCCL backends); testing tools; fsdp.hpp on top.
ALLOWED = {
    "core": set(),
    "comm": {"core"},
    "host": {"core"},
    "cuda": {"core", "host"},
    "nccl": {"core", "host", "cuda"},
    "asio": {"core"},
    "mpi": {"core"},
    "policy": {"core"},
    "unit": {"core", "policy"},
    "model": {"core", "policy", "unit", "host"},
    "checkpoint": {"core", "policy", "unit", "model"},
    "torch": {"core", "policy", "unit", "model", "host", "checkpoint"},
    "graph": {"core", "policy", "unit", "model", "host", "cuda", "nccl"},
    "testing": {"core", "comm", "host", "policy", "unit", "model"},
    "": {"core", "comm", "host", "policy", "unit", "model"},  # fsdp/fsdp.hpp
}

INCLUDE = re.compile(r'^\s*#\s*include\s*[<"](fsdp/[^">]+)[">]')
# The first line that is neither a comment, a preprocessor line nor blank: after it, an
# #include is one at the end of the file.
CODE = re.compile(r"^\s*(namespace|template|class|struct|inline|using|enum|constexpr|static_assert|extern|typedef)\b")


def folder_of(rel):
    """('unit', True) for fsdp/unit/detail/x.hpp; ('', False) for fsdp/fsdp.hpp."""
    parts = rel.split("/")[1:-1]  # drop 'fsdp' and the file name
    detail = "detail" in parts
    parts = [p for p in parts if p != "detail"]
    return (parts[0] if parts else ""), detail


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "include")
    headers = []
    for d, _, files in os.walk(os.path.join(root, "fsdp")):
        for f in files:
            if f.endswith(".hpp"):
                headers.append(os.path.relpath(os.path.join(d, f), root))
    includes = {rel: [] for rel in headers}
    for rel in headers:
        with open(os.path.join(root, rel), encoding="utf-8") as fh:
            includes[rel] = [m.group(1) for m in map(INCLUDE.match, fh) if m]

    def uses_own_detail(rel, seen=None):
        """Whether a public header reaches its folder's detail/ through its own folder."""
        seen = seen if seen is not None else set()
        folder, _ = folder_of(rel)
        for t in includes.get(rel, []):
            f, d = folder_of(t)
            if f != folder or t in seen:
                continue
            seen.add(t)
            if d or uses_own_detail(t, seen):
                return True
        return False

    violations = []
    for rel in sorted(headers):
        src, src_detail = folder_of(rel)
        if src not in ALLOWED:
            violations.append(f"include/{rel}:1: folder '{src}' is not in tools/check_layers.py's table: add it with the folders it may use")
            continue
        seen_code = False
        with open(os.path.join(root, rel), encoding="utf-8") as fh:
            for n, line in enumerate(fh, 1):
                if CODE.match(line):
                    seen_code = True
                m = INCLUDE.match(line)
                if not m:
                    continue
                target = m.group(1)
                if not os.path.exists(os.path.join(root, target)):
                    violations.append(f"include/{rel}:{n}: includes {target}, which does not exist")
                    continue
                dst, dst_detail = folder_of(target)
                where = f"include/{rel}:{n}: includes {target}"
                if seen_code:
                    violations.append(f"{where} after the file's first declaration (move it to the top; break the cycle instead)")
                if dst != src and dst not in ALLOWED[src]:
                    violations.append(f"{where}: folder '{src or 'fsdp'}' may use only {sorted(ALLOWED[src]) or 'nothing else'}")
                elif dst == src and src_detail and not dst_detail and uses_own_detail(target):
                    violations.append(f"{where}, which uses this folder's detail/: detail/ must sit below what uses it")
    for v in violations:
        print(v)
    print(f"layers: {len(headers)} headers, {len(violations)} violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
