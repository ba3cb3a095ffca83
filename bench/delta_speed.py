#!/usr/bin/env python3
"""delta_speed.py - how long a lossy delta takes and how many bytes it stores, policy
against policy in one run (issue 22's "no slower per stored byte" target).

GPT-2 small + AdamW (1.49 GB of state, as bench/torch_bench.py builds it: warm AdamW
state, fake gradients of GPT-2's clipped size) is saved by amber.torch's Checkpointer
once in full, then DELTAS times as a delta after an optimizer step each; a delta's time
is save() + wait() (to durable), its bytes the file's. The policies take turns, ROUNDS
times over, so that a drift of the machine's load hits them alike; the first two deltas
of each turn are left out (the reference still catching up with the warm state). It
prints, per policy, the median time and bytes of the rest, the encode and scan CPU time
the library reports (amber_writer_save_stats), and each policy's ratio to the first one
per delta and per stored byte.

    delta_speed.py [--policies v1-lossy-compact,lossy,lossy-capped] [--rounds 2]
                   [--deltas 6] [--threads 2] [--out DIR] [--quick] [--json FILE]

--quick: a 3.7M-parameter model instead of GPT-2 small (a smoke run).
"""
import argparse
import ctypes
import json
import os
import shutil
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from _common import GPT2Small, fake_grads, quick_model, warm_up  # noqa: E402
from torch_bench import V1  # noqa: E402

import amber  # noqa: E402
from amber.torch import Checkpointer, PRESETS  # noqa: E402


class _Stats(ctypes.Structure):  # amber_save_stats (include/amber.h)
    _fields_ = ([("kind", ctypes.c_uint32), ("workers", ctypes.c_uint32),
                 ("bytes", ctypes.c_uint64)]
                + [(n, ctypes.c_double) for n in ("prepare_s", "chunks_s", "scan_cpu_s",
                                                  "encode_cpu_s", "finish_s", "commit_s",
                                                  "total_s")]
                + [("reserved", ctypes.c_uint64 * 4)])


def rules(name):
    if name in V1:
        return list(V1[name])
    if name in PRESETS:
        return list(PRESETS[name])
    return name.split(",")


def one_turn(name, store, deltas, quick):
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = quick_model() if quick else GPT2Small()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    warm_up(model, opt, gen)
    shutil.rmtree(store, ignore_errors=True)
    state = {"model": model, "optim": opt}
    out = []
    stats = amber._lib.amber_writer_save_stats
    stats.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    with Checkpointer(store, policy=rules(name), full_every=1000, full_share=-1) as ck:
        ck.save(1, state, full=True)
        ck.wait()
        for step in range(2, 2 + deltas):
            fake_grads(model, gen)
            opt.step()
            t0 = time.perf_counter()
            ck.save(step, state)
            ck.wait()
            dt = time.perf_counter() - t0
            st = _Stats()
            if stats(ck._writer._h, ctypes.byref(st)) != 0:
                sys.exit("delta_speed: amber_writer_save_stats failed")
            out.append({"s": dt, "scan": st.scan_cpu_s, "encode": st.encode_cpu_s})
        for row, info in zip(out, ck.steps()[1:]):
            row["bytes"] = info.bytes
    shutil.rmtree(store, ignore_errors=True)
    return out[2:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="v1-lossy-compact,lossy,lossy-capped")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deltas", type=int, default=6)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="/var/tmp")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None, help="write the medians and ratios here")
    a = ap.parse_args()
    if a.deltas < 3:
        sys.exit("delta_speed: --deltas must be at least 3 (the first two are left out)")
    torch.set_num_threads(a.threads)
    names = [n for n in a.policies.split(",") if n]
    rows = {n: [] for n in names}
    store = os.path.join(a.out, f"amber-delta-speed-{os.getpid()}")
    print(f"delta_speed: {', '.join(names)}; {a.rounds} rounds of {a.deltas} deltas; "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    for r in range(a.rounds):
        for n in names:
            got = one_turn(n, store, a.deltas, a.quick)
            rows[n] += got
            print(f"  round {r + 1} {n:18} " + " ".join(f"{x['s']:.3f}s/{x['bytes'] / 1e6:.1f}MB"
                                                       for x in got), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"{'policy':20}{'delta s':>9}{'MB':>8}{'ms/MB':>8}{'scan cpu':>10}{'enc cpu':>9}"
          f"{'x time':>8}{'x per MB':>10}")
    first, res = None, {}
    for n in names:
        med = {k: statistics.median(x[k] for x in rows[n]) for k in ("s", "bytes", "scan",
                                                                     "encode")}
        per = med["s"] / (med["bytes"] / 1e6)
        first = first or (med["s"], per)
        print(f"{n:20}{med['s']:9.3f}{med['bytes'] / 1e6:8.1f}{1e3 * per:8.1f}"
              f"{med['scan']:10.3f}{med['encode']:9.3f}{med['s'] / first[0]:8.2f}"
              f"{per / first[1]:10.2f}")
        res[n] = dict(med, s_per_mb=per, x_time=med["s"] / first[0], x_per_mb=per / first[1])
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"policies": res, "rounds": a.rounds, "deltas": a.deltas}, f, indent=1)


if __name__ == "__main__":
    main()
