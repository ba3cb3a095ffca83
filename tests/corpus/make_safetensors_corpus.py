#!/usr/bin/env python3
"""Writes the seed corpus of fuzz/fuzz_safetensors.c into tests/corpus/safetensors/.

Each file is a small safetensors file, valid ("ok-*") or malformed ("bad-*", named
after what is wrong with it). The output is deterministic; rerun this after adding
a case and commit the new files:

    .venv/bin/python tests/corpus/make_safetensors_corpus.py
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "safetensors")

ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
            "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "U16": 2, "U32": 4, "U64": 8}


def layout(tensors, metadata=None):
    """Header dict for [(name, dtype, shape)] laid out back to back, and data size."""
    header, pos = {}, 0
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape in tensors:
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    return header, pos


def raw(header_bytes, data_size, length=None, pad_to=8):
    """File bytes: length, header (padded with spaces) and `data_size` data bytes."""
    if pad_to:
        header_bytes += b" " * (-(8 + len(header_bytes)) % pad_to)
    if length is None:
        length = len(header_bytes)
    data = bytes((i * 37 + 11) & 0xFF for i in range(data_size))
    return struct.pack("<Q", length) + header_bytes + data


def dumps(obj):
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def st(tensors, metadata=None, extra=0):
    header, size = layout(tensors, metadata)
    return raw(dumps(header), size + extra)


def entry(dtype, shape, begin, end):
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


def cases():
    all_dtypes = [(f"t_{d.lower()}", d, [3]) for d in ITEMSIZE]
    yield "ok-all-dtypes", st(all_dtypes)
    yield "ok-f32", st([("w", "F32", [2, 3])])
    yield "ok-bf16", st([("emb", "BF16", [4, 2])])
    yield "ok-f8-e4m3", st([("q", "F8_E4M3", [5]), ("r", "F8_E5M2", [3])])
    yield "ok-bool", st([("mask", "BOOL", [7])])
    yield "ok-unsigned", st([("u16", "U16", [3]), ("u32", "U32", [2, 2]), ("u64", "U64", [])])
    yield "ok-scalar", st([("step", "I64", [])])
    yield "ok-empty-tensor", st([("nothing", "F32", [0]), ("also", "F16", [3, 0, 2]),
                                 ("x", "U8", [2])])
    yield "ok-metadata", st([("w", "F32", [2])], {"format": "pt", "step": "100"})
    yield "ok-nonascii-name", st([("poids.é", "F16", [2]), ("层.0.权重", "I8", [3])],
                                 {"説明": "ünïcödé"})
    yield "ok-no-tensors", raw(b"{}", 0)
    yield "ok-unpadded", raw(dumps(layout([("w", "I32", [3])])[0]), 12, pad_to=0)
    yield "ok-gap", raw(dumps({"a": entry("U8", [2], 0, 2), "b": entry("U8", [2], 6, 8)}), 8)
    yield "ok-unsorted", raw(dumps({"b": entry("I16", [2], 4, 8),
                                    "a": entry("I16", [2], 0, 4)}), 8)

    good = dumps(layout([("w", "F32", [2])])[0])
    yield "bad-short-file", b"\x08\x00\x00"
    yield "bad-len-beyond-file", raw(good, 8, length=len(good) + 100, pad_to=0)
    yield "bad-len-huge", raw(good, 8, length=1 << 63, pad_to=0)
    yield "bad-len-2p40", raw(good, 8, length=1 << 40, pad_to=0)
    yield "bad-truncated-json", raw(good[:-3], 8)
    yield "bad-not-object", raw(b'[{"dtype":"F32"}]', 8)
    yield "bad-trailing-garbage", raw(good + b"}", 8)
    yield "bad-dtype-f8-e8m0", raw(dumps({"w": entry("F8_E8M0", [8], 0, 8)}), 8)
    yield "bad-dtype-f4", raw(dumps({"w": entry("F4", [16], 0, 8)}), 8)
    yield "bad-dtype-f6-e2m3", raw(dumps({"w": entry("F6_E2M3", [4], 0, 3)}), 8)
    yield "bad-dtype-c64", raw(dumps({"w": entry("C64", [1], 0, 8)}), 8)
    yield "bad-dtype-not-string", raw(dumps({"w": entry(4, [2], 0, 8)}), 8)
    yield "bad-shape-too-long", raw(dumps({"w": entry("U8", [1] * 9, 0, 1)}), 8)
    yield "bad-shape-negative", raw(dumps({"w": entry("U8", [-2], 0, 0)}), 8)
    yield "bad-shape-float", raw(b'{"w":{"dtype":"U8","shape":[2.0],"data_offsets":[0,2]}}', 8)
    yield "bad-shape-overflow", raw(dumps({"w": entry("F32", [1 << 40, 1 << 40], 0, 0)}), 8)
    yield "bad-offsets-range", raw(dumps({"w": entry("U8", [16], 0, 16)}), 8)
    yield "bad-offsets-reversed", raw(dumps({"w": entry("U8", [2], 4, 2)}), 8)
    yield "bad-offsets-three", raw(b'{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2,4]}}', 8)
    yield "bad-offsets-mismatch", raw(dumps({"w": entry("F32", [4], 0, 12)}), 16)
    yield "bad-overlap", raw(dumps({"a": entry("F32", [2], 0, 8), "b": entry("F32", [2], 4, 12)}),
                             16)
    yield "bad-meta-nonstring", raw(dumps({"__metadata__": {"step": 100},
                                           "w": entry("U8", [2], 0, 2)}), 8)
    yield "bad-duplicate-key", raw(b'{"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},'
                                   b'"w":{"dtype":"U8","shape":[2],"data_offsets":[2,4]}}', 8)
    yield "bad-empty-name", raw(dumps({"": entry("U8", [2], 0, 2)}), 8)
    yield "bad-unknown-key", raw(dumps({"w": dict(entry("U8", [2], 0, 2), extra=1)}), 8)


def main():
    os.makedirs(OUT, exist_ok=True)
    for name, data in cases():
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main()
