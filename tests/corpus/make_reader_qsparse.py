#!/usr/bin/env python3
"""Writes the reader corpus entries of format 1.3 (quantized deltas, QSPARSE):
deltas of fuzz/fuzz_reader.c's fixed parent (step 0: a f32[40], b bf16[20], c u8[16],
s i64 scalar, chunks of 16 elements, byte k of tensor i = k*7+i) under quantized
policies of every value mode, with NaN, Inf and large jumps (escapes), as written
by the library. fuzz_reader reseals each input onto its own parent, so the files'
parent ids need not match. Run once from the repository root with the package
installed (.venv): tests/corpus/make_reader_qsparse.py
"""
import array
import ctypes
import math
import os
import shutil
import struct
import sys
import tempfile

import amber

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reader")
TENSORS = [("a", amber.F32, (40,), "f"), ("b", amber.BF16, (20,), "H"),
           ("c", amber.U8, (16,), "B"), ("s", amber.I64, (), "q")]
NBYTES = {"a": 160, "b": 40, "c": 16, "s": 8}


def parent_bytes(i, name):
    return bytearray((k * 7 + i) & 0xFF for k in range(NBYTES[name]))


def bf16(x):
    return struct.unpack("<I", struct.pack("<f", x))[0] >> 16


def write(tag, rules, mutate):
    d = tempfile.mkdtemp()
    try:
        bufs = {n: parent_bytes(i, n) for i, (n, *_) in enumerate(TENSORS)}
        arrs = {n: (ctypes.c_uint8 * len(b)).from_buffer(b) for n, b in bufs.items()}
        with amber.Store(d) as st:
            w = st.writer(chunk_elems=16)
            for n, dt, shape, _ in TENSORS:
                w.add(n, dt, shape, ctypes.addressof(arrs[n]))
            for r in rules:
                w.add_policy(r)
            w.save(0, full=True)
            mutate(bufs)
            w.save(1)
            w.close()
        shutil.copy(os.path.join(d, "ckpt-%020d.amber" % 1), os.path.join(OUT, tag))
        print("wrote", os.path.join(OUT, tag))
    finally:
        shutil.rmtree(d)


def drift(bufs, jumps=True, nan=True):
    a = array.array("f", bytes(bufs["a"]))
    for k in range(len(a)):
        a[k] += 2e-3 * math.cos(k) + (50.0 if jumps and k % 13 == 5 else 0.0)
    if nan:
        a[3], a[20] = float("nan"), float("inf")
    bufs["a"][:] = a.tobytes()
    b = array.array("H", bytes(bufs["b"]))
    for k in range(len(b)):
        x = struct.unpack("<f", struct.pack("<I", b[k] << 16))[0]
        if math.isfinite(x):
            b[k] = bf16(x * 1.5 + 0.01 * k)
    bufs["b"][:] = b.tobytes()


def main():
    if not os.path.isdir(OUT):
        sys.exit(f"no {OUT}")
    write("delta-qsparse-q4-lead", ["a=threshold:1e-3@q4+lead", "b=threshold:0:0.3@q4+lead"], drift)
    write("delta-qsparse-q8-budget", ["a=budget:0.5:100@q8", "b=budget:0.3@q8"], drift)
    write("delta-qsparse-bf16", ["*=threshold:1e-4:1e-3@bf16"],
          lambda b: drift(b, jumps=False, nan=False))


if __name__ == "__main__":
    main()
