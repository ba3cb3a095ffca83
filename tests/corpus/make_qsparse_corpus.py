#!/usr/bin/env python3
"""Writes the seeds of fuzz/fuzz_qsparse.c: valid quantized sparse bodies (docs/FORMAT.md,
"Quantized sparse body") of every value mode, position form and dtype, each behind
the target's 5-byte prefix (dtype selector, n, k). Run once from the repository root:
tests/corpus/make_qsparse_corpus.py
"""
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "qsparse")
Q8, Q4, BF16 = 1, 2, 3


def varint(v):
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def gaps(idx):
    return b"".join(varint(i - (idx[j - 1] + 1 if j else 0)) for j, i in enumerate(idx))


def body(n, idx, mode, codes, glog=24, rel=0.0, steps=(), esc=(), esc_vals=b"", bitmap=False):
    if bitmap:
        bm = bytearray((n + 7) // 8)
        for i in idx:
            bm[i // 8] |= 1 << (i % 8)
        pos = b"\x00" + bytes(bm)
    else:
        pos = b"\x01" + gaps(idx)
    head = bytes([mode, glog if mode != BF16 else 0, 0, 0]) + struct.pack("<fI", rel, len(esc))
    st = b"".join(struct.pack("<f", s) for s in steps)
    if mode == Q8:
        cb = bytes(c & 0xFF for c in codes)
    elif mode == Q4:
        nib = [c & 0xF for c in codes] + ([0] if len(codes) % 2 else [])
        cb = bytes(nib[i] | nib[i + 1] << 4 for i in range(0, len(nib), 2))
    else:
        cb = bytes(c & 0xFF for c in codes) + bytes(c >> 8 for c in codes)
    return pos + head + st + cb + gaps(list(esc)) + esc_vals


def put(name, dsel, n, k, b):
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(bytes([dsel]) + struct.pack("<HH", n - 1, k) + b)
    print("wrote", name)


def main():
    os.makedirs(OUT, exist_ok=True)
    idx = [1, 4, 9, 20, 39]
    put("f32-q4-varint", 0, 40, 5, body(40, idx, Q4, [3, -7, 0, 7, -8], steps=[0.5],
                                         esc=[2], esc_vals=struct.pack("<f", 42.0)))
    put("f32-q8-bitmap-groups", 0, 40, 5, body(40, idx, Q8, [3, -127, 5, 127, -1], glog=1,
                                                steps=[0.5, 0.25, 1e-3], bitmap=True))
    put("f64-q8-rel", 1, 40, 5, body(40, idx, Q8, [1, 2, 3, -4, 0], rel=0.1, steps=[0.0],
                                      esc=[4], esc_vals=struct.pack("<d", float("nan"))))
    put("bf16-bf16", 2, 40, 5, body(40, idx, BF16, [0x3F80, 0xBF80, 0, 0x4000, 0x0001],
                                     esc=[2], esc_vals=struct.pack("<H", 0x7F80)))
    put("f16-q4-all", 3, 8, 8, body(8, list(range(8)), Q4, [1, -1, 2, -2, 3, -3, 7, -8],
                                     rel=0.5, steps=[0.0], bitmap=True))
    put("f8-refused", 4, 8, 1, body(8, [3], Q8, [1], steps=[0.5]))


if __name__ == "__main__":
    main()
