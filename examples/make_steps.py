#!/usr/bin/env python3
"""Writes a synthetic training trajectory as safetensors files, one per step.

Used by `make demo` (scripts/demo) to show the amber CLI converting a directory of
ordinary checkpoints into a compact store. Standard library only: a small model
(weights, Adam moments, a step counter) follows an Adam-like update, so that, as
in real training, every element moves a little each step and a few move a lot.

    make_steps.py OUTDIR [--steps N] [--params N]
"""
import argparse
import array
import json
import math
import os
import random
import struct


def write_safetensors(path, tensors, metadata):
    """tensors: name -> (dtype string, shape, array.array)."""
    header, blobs, offset = {"__metadata__": metadata}, [], 0
    for name, (dtype, shape, data) in tensors.items():
        blob = data.tobytes()
        header[name] = {"dtype": dtype, "shape": shape,
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    os.replace(tmp, path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("outdir")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--params", type=int, default=100_000)
    a = ap.parse_args()
    os.makedirs(a.outdir, exist_ok=True)
    rnd = random.Random(1234)
    n = a.params
    w = array.array("f", (rnd.gauss(0, 0.02) for _ in range(n)))
    m = array.array("f", bytes(4 * n))
    v = array.array("f", bytes(4 * n))
    lr, b1, b2 = 1e-4, 0.9, 0.999
    warmup = 30  # moments of a run that has been going for a while
    for step in range(1, warmup + a.steps + 1):
        # a sparse-ish gradient: every element gets a little noise, a few a lot
        for i in range(n):
            g = rnd.gauss(0, 1e-3) + (0.05 if rnd.random() < 0.002 else 0.0)
            m[i] = b1 * m[i] + (1 - b1) * g
            v[i] = b2 * v[i] + (1 - b2) * g * g
            w[i] -= lr * (m[i] / (1 - b1 ** step)) / (math.sqrt(v[i] / (1 - b2 ** step)) + 1e-8)
        if step <= warmup:
            continue
        counter = array.array("q", [step])
        write_safetensors(os.path.join(a.outdir, f"step-{step - warmup:04d}.safetensors"),
                          {"model.weight": ("F32", [n // 100, 100], w),
                           "optim.exp_avg": ("F32", [n // 100, 100], m),
                           "optim.exp_avg_sq": ("F32", [n // 100, 100], v),
                           "optim.step": ("I64", [], counter)},
                          {"step": str(step), "lr": str(lr)})
        print(f"\rwrote step {step - warmup}/{a.steps}", end="", flush=True)
    print()


if __name__ == "__main__":
    main()
