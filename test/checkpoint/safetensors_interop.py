#!/usr/bin/env python3
"""An independent reader and writer of the published safetensors format, in numpy alone.

    safetensors_interop.py check FILE   # FILE holds exactly expected(): exit 0, else 1
    safetensors_interop.py write FILE   # writes expected() to FILE

The format: an 8-byte little-endian length N, N bytes of JSON (name -> dtype, shape,
data_offsets into the data that follows; "__metadata__" -> strings), then the data.
fsdp's safetensors_interop_test computes the same tensors in C++ and checks both ways.
"""
import json
import struct
import sys

import numpy as np

# BF16 has no numpy dtype: its raw bits travel as uint16.
DTYPES = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "BF16": "<u2",
          "I64": "<i8", "I32": "<i4", "I8": "i1", "U8": "u1"}


def read(path):
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    metadata = header.pop("__metadata__", {})
    buffer = data[8 + n:]
    tensors = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        array = np.frombuffer(buffer[begin:end], dtype=DTYPES[t["dtype"]]).reshape(t["shape"])
        tensors[name] = (t["dtype"], array)
    return tensors, metadata


def write(path, tensors, metadata):
    header, chunks, at = {}, [], 0
    if metadata:
        header["__metadata__"] = metadata
    for name, (dtype, array) in tensors.items():
        raw = np.ascontiguousarray(array, dtype=DTYPES[dtype]).tobytes()
        header[name] = {"dtype": dtype, "shape": list(array.shape), "data_offsets": [at, at + len(raw)]}
        chunks.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))


def expected():
    """The tensors both sides agree on (the C++ test builds the same ones)."""
    tensors = {
        "f32": ("F32", ((np.arange(6) - 2.5) * 0.25).astype(np.float32).reshape(2, 3)),
        "f64": ("F64", np.arange(4) * 0.1 - 1.0),
        "f16": ("F16", (np.arange(5) * 0.5 - 1.0).astype(np.float16)),
        "bf16": ("BF16", np.array([0x3F80, 0xC000, 0x4049], dtype=np.uint16)),  # 1, -2, 3.140625
        "i64": ("I64", np.array([-(2 ** 40), 0, 2 ** 62 + 7], dtype=np.int64)),
        "i32": ("I32", np.array([[-1, 2], [2 ** 31 - 1, -(2 ** 31)]], dtype=np.int32)),
        "i8": ("I8", np.array([-128, 0, 127], dtype=np.int8)),
        "u8": ("U8", np.array([0, 1, 128, 255], dtype=np.uint8)),
        "scalar": ("F32", np.array(3.5, dtype=np.float32)),
        "empty": ("F32", np.zeros((0,), dtype=np.float32)),
    }
    return tensors, {"format": "pt", "step": "7"}


def check(path):
    tensors, metadata = read(path)
    want, want_metadata = expected()
    problems = []
    if metadata != want_metadata:
        problems.append("metadata %r != %r" % (metadata, want_metadata))
    if sorted(tensors) != sorted(want):
        problems.append("tensors %s != %s" % (sorted(tensors), sorted(want)))
    for name, (dtype, array) in want.items():
        if name not in tensors:
            continue
        got_dtype, got = tensors[name]
        if got_dtype != dtype or got.shape != array.shape or not np.array_equal(got, array.astype(got.dtype)):
            problems.append("%s: got %s %s %r, want %s %s %r" % (name, got_dtype, got.shape, got, dtype, array.shape, array))
    for p in problems:
        print(p)
    return 0 if not problems else 1


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("check", "write"):
        sys.exit(__doc__)
    if sys.argv[1] == "write":
        write(sys.argv[2], *expected())
        sys.exit(0)
    sys.exit(check(sys.argv[2]))
