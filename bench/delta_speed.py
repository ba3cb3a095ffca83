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
per delta and per stored byte, and the time per stored element.

The floor: "floor" (on by default, last in the turn) is a delta that stores nothing
(rule threshold:1e30: every change is under its bound; only AdamW's step counters
are stored), that is the scan alone: reading the live state and the reference once.
No delta can take less than that (its figures vary more than the policies', with the
commit's fsyncs: the median is the bound used, the fastest is printed beside it). A policy
storing B bytes is as fast per stored byte as the first one when it takes B times
the first one's time per byte; the script prints that time against the floor (what
is left of it for selecting, coding and writing), and each policy's time above the
floor per stored element against the first one's.

    delta_speed.py [--policies v1-lossy-compact,lossy,lossy-capped,floor] [--rounds 2]
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


FLOOR = ("threshold:1e30",)


def rules(name):
    if name == "floor":
        return list(FLOOR)
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
            if stats(ck._saver.sink.writer._h, ctypes.byref(st)) != 0:
                sys.exit("delta_speed: amber_writer_save_stats failed")
            out.append({"s": dt, "scan": st.scan_cpu_s, "encode": st.encode_cpu_s})
        for row, info in zip(out, ck.steps()[1:]):
            row["bytes"] = info.bytes
            with amber.Reader(ck.store, info.step) as rd:
                row["elems"] = sum(t.stored_elems for t in rd.tensors())
    shutil.rmtree(store, ignore_errors=True)
    return out[2:]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--policies", default="v1-lossy-compact,lossy,lossy-capped,floor")
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
    print(f"{'policy':20}{'delta s':>9}{'MB':>8}{'Melems':>8}{'ms/MB':>8}{'ns/elem':>9}"
          f"{'scan cpu':>10}{'enc cpu':>9}{'x time':>8}{'x per MB':>10}{'x per elem':>11}")
    first, res = None, {}
    for n in names:
        med = {k: statistics.median(x[k] for x in rows[n])
               for k in ("s", "bytes", "elems", "scan", "encode")}
        per = med["s"] / max(med["bytes"] / 1e6, 1e-9)
        pel = med["s"] / max(med["elems"], 1)
        first = first or (med["s"], per, pel)
        if n == "floor":  # stores nothing: no time per byte or element
            print(f"{n:20}{med['s']:9.3f}{med['bytes'] / 1e6:8.1f}{'-':>8}{'-':>8}{'-':>9}"
                  f"{med['scan']:10.3f}{med['encode']:9.3f}{med['s'] / first[0]:8.2f}")
        else:
            print(f"{n:20}{med['s']:9.3f}{med['bytes'] / 1e6:8.1f}{med['elems'] / 1e6:8.2f}"
                  f"{1e3 * per:8.1f}{1e9 * pel:9.1f}{med['scan']:10.3f}{med['encode']:9.3f}"
                  f"{med['s'] / first[0]:8.2f}{per / first[1]:10.2f}{pel / first[2]:11.2f}")
        res[n] = dict(med, s_per_mb=per, s_per_elem=pel, x_time=med["s"] / first[0],
                      x_per_mb=per / first[1], x_per_elem=pel / first[2])
    # The floor's figures vary more than the policies' (a delta that stores next to
    # nothing is mostly the scan and the commit's fsyncs): its median is the bound
    # used, beside the fastest one seen.
    floor = res["floor"]["s"] if "floor" in res else None
    if floor is not None and names[0] != "floor":
        fmin = min(x["s"] for x in rows["floor"])
        base = res[names[0]]
        above0 = (base["s"] - floor) / max(base["elems"], 1)
        print(f"floor: a delta that stores nothing (the scan alone): median {floor:.3f} s, "
              f"fastest {fmin:.3f} s")
        for n in names[1:]:
            if n == "floor":
                continue
            r = res[n]
            parity = first[1] * r["bytes"] / 1e6  # the same time per byte as names[0]
            above = (r["s"] - floor) / max(r["elems"], 1)
            # (a tiny model's deltas can come out at or under the floor's median: noise)
            ratio = above / above0 if above0 > 0 else None
            r.update(parity_s=parity, parity_above_floor=parity >= floor,
                     above_floor_s_per_elem=above, x_above_floor_per_elem=ratio)
            print(f"  {n}: per-byte parity with {names[0]} means {parity:.3f} s a delta, "
                  + (f"{parity - floor:.3f} s above the floor's median"
                     if parity >= floor else "below the floor's median")
                  + f"; time above the floor per stored element {1e9 * above:.1f} ns, "
                  + (f"{ratio:.2f}x" if ratio is not None else "(no ratio: not above the floor)")
                  + f" {names[0]}'s ({1e9 * above0:.1f} ns)")
        res["floor"]["fastest_s"] = fmin
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"policies": res, "rounds": a.rounds, "deltas": a.deltas,
                       "floor_s": floor}, f, indent=1)


if __name__ == "__main__":
    main()
