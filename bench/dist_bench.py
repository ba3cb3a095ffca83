#!/usr/bin/env python3
"""dist_bench.py - amber with many ranks side by side with PyTorch's Distributed
Checkpoint (DCP), in one run: GPT-2 small (124M) + AdamW sharded with FSDP2
(fully_shard, on CPU, gloo), at each world size of --ranks (the script spawns its own
ranks; they meet through torch.distributed's file:// rendezvous).

The state, its training by AdamW steps on synthetic gradients and the bounds are
bench/torch_bench.py's (see its purpose paragraph); here each rank holds its FSDP2
shard of them. Every figure is the slowest rank's (a save or a load is done when
every rank is done).

Saves (durable = fsynced and committed):
  dcp.save with FileSystemWriter(sync_files=True); dcp.async_save with its default
  stager: its stall is until its staging completed, durable when its future completes.
  amber's distributed Checkpointer: full save (save() + wait()), steady delta
  save-to-durable and the stall a delta costs the training thread (save() + the
  fence before the next optimizer step); amber.dcp.Writer through dcp.save: full and
  steady delta save-to-durable.
Loads (cold: files dropped from the page cache; into the live model and optimizer):
  dcp.load (FileSystemReader) + set_state_dict; amber's Checkpointer.load; dcp.load
  with amber.dcp.Reader. Each at the world size that saved, and at every other world
  size of --ranks (resharding: saved at 2, loaded at 4 and the reverse).
Bounds, measured in the same run: a delta's floor = every rank reading its live
shard and a reference once + the delta's bytes written at the disk's O_DIRECT pace;
a cold load's floor = the Checkpointer store's files (every rank's full checkpoint
and deltas) read cold at the disk's pace (O_DIRECT, 8 MiB reads, two at a time), for
the store saved at this world size and for the one loaded from the other. Each target
with a floor prints the ratio the floor itself shows.

    dist_bench.py [--ranks 2,4] [--repeat 1] [--deltas 2] [--policy lossy-compact] [--quick]
                  [--json FILE] [--markdown] [--out DIR] [--timeout S]
    dist_bench.py --save-calls [--ranks 2,4] [--deltas 4] [--baseline TREE] [--quick]

--save-calls measures only what a steady delta's save() call costs the training
thread (the call alone, wall and thread CPU time, median over the overlapped deltas,
the slowest rank's), for one process (the same model, unsharded, in a store of one
process) and at each world size of --ranks, so that the cost at many ranks stands next
to the one-process cost in the same run; with --baseline TREE the same runs once more
with the amber of another checkout TREE (its python/ and build/libamber.so), e.g. the
code before a change.

More ranks than cores oversubscribe the CPUs: the figures then include the ranks'
contention for them (the report prints both numbers).
"""
import argparse
import datetime
import gc
import glob
import json
import math
import os
import platform
import shutil
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (TARGETS_HEAD, GPT2Small, add_run_args, amber_deltas, amber_full,  # noqa: E402
                     cold_read, dcp_async_save, dcp_save, delta_figures, direct_write, drop_cache,
                     du, emit, fake_grads, fmt, logger, quick_model, read_floor, row, run_group,
                     spreads, target_lines, target_records, timed, warm_up)

log = logger("dist_bench")


# ---------------------------------------------------------------- one rank
def _use_tree(tree):
    """Imports amber from checkout `tree` instead of the installed one (--baseline)."""
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not type(f).__module__.startswith("_editable")]
    sys.path.insert(0, os.path.join(tree, "python"))
    os.environ["AMBER_LIBRARY"] = os.path.join(tree, "build", "libamber.so")


def calls_worker(a):
    """--save-calls: a full save, then --deltas pairs of deltas; the save() calls of the
    overlapped ones, timed. World size 1: the unsharded model in one process."""
    if a.tree:
        _use_tree(a.tree)
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from amber.torch import Checkpointer

    rank, world = a.rank, a.world
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{a.init}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=a.timeout))
    torch.manual_seed(0)
    model = quick_model() if a.quick else GPT2Small()
    if world > 1:
        for b in model.h:
            fully_shard(b)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1 + rank)

    def grads():
        for p in model.parameters():
            loc = p.to_local() if isinstance(p, DTensor) else p
            if p.grad is None:
                g = torch.empty_like(loc)
                p.grad = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape,
                                            stride=p.stride(), run_check=False) \
                    if isinstance(p, DTensor) else g
            (p.grad.to_local() if isinstance(p, DTensor) else p.grad).normal_(0, 1e-3,
                                                                               generator=gen)
    grads()
    opt.step()
    state = {"model": model, "optim": opt}
    store = os.path.join(a.out, f"calls-{world}-{'base' if a.tree else 'this'}")
    calls = []
    barrier = dist.barrier if world > 1 else None
    # each save() call's wall and, within it, the wall of its collectives (the vote's
    # all_gather: what the rank waits there for the slowest rank), by wrapping the
    # communicator's all_gather for the length of each call
    votes, inside = [], [0.0, False]
    if world > 1:
        from amber.torch import _comm
        allgather = _comm.TorchComm.allgather

        def timed_allgather(self, data):
            t0 = time.perf_counter()
            try:
                return allgather(self, data)
            finally:
                if inside[1]:
                    inside[0] += time.perf_counter() - t0
        _comm.TorchComm.allgather = timed_allgather
    with Checkpointer(store, policy=a.policy, full_every=1000, full_share=-1) as ck:
        amber_full(ck, state, 1)
        save = ck.save

        def timed_save(*args, **kw):
            inside[0], inside[1] = 0.0, True
            t0 = time.perf_counter()
            try:
                return save(*args, **kw)
            finally:
                inside[1] = False
                votes.append((time.perf_counter() - t0, inside[0]))
        ck.save = timed_save
        amber_deltas(ck, state, 1, 2 * a.deltas, grads, opt.step, barrier, calls)
    calls = calls[1:] or calls  # the first overlapped delta may still plan
    votes = votes[2:] or votes  # the same: the first two deltas may still plan
    out = {"save_call": statistics.median(t for t, _ in calls),
           "save_cpu": statistics.median(c for _, c in calls), "allgather": 0.0,
           "vote_wait": statistics.median(v for _, v in votes),
           "save_less_vote": statistics.median(t - v for t, v in votes)}
    if world > 1:  # the floor of any vote: one all_gather of a byte per rank
        t, o = torch.zeros(1, dtype=torch.uint8), [torch.zeros(1, dtype=torch.uint8)] * world
        for i in range(60):
            if i == 10:
                t0 = time.perf_counter()
            dist.all_gather(o, t)
        out["allgather"] = (time.perf_counter() - t0) / 50
    if world > 1:
        got = [None] * world
        dist.all_gather_object(got, out)
        out = {k: max(g[k] for g in got) for k in out}
    if rank == 0:
        with open(a.result, "w") as fh:
            json.dump(out, fh)
    if world > 1:
        dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def save_calls(a, worlds):
    """--save-calls: the runs, this checkout's and --baseline's, and their table."""
    trees = [("this checkout", None)] + ([("baseline " + a.baseline, a.baseline)]
                                        if a.baseline else [])
    res = {}
    for label, tree in trees:
        for w in [1] + worlds:
            res[(label, w)] = spawn(a, "calls", w, w, os.path.join(a.out, f"calls-{w}.json"),
                                    tree)
    lines = [f"save() of a steady delta ({'GPT-2 small' if not a.quick else 'quick model'}"
             f" + AdamW, policy {a.policy!r}; median over {max(1, a.deltas - 1)} calls, the "
             "slowest rank's):", ""]
    lines.append(row(["", "ranks", "save() ms", "CPU ms", "all_gather ms", "in the vote ms",
                      "save() less the vote ms", "vs one process"],
                     a.markdown, (16, 6, 10, 10, 14, 15, 24)))
    if a.markdown:
        lines.insert(3, "|---|---|---|---|---|---|---|---|")
    for label, _ in trees:
        one = res[(label, 1)]
        for w in [1] + worlds:
            f = res[(label, w)]
            many = w > 1
            lines.append(row([label, str(w), f"{1e3 * f['save_call']:.2f}",
                              f"{1e3 * f['save_cpu']:.2f}",
                              f"{1e3 * f.get('allgather', 0.0):.2f}" if many else "-",
                              f"{1e3 * f.get('vote_wait', 0.0):.2f}" if many else "-",
                              f"{1e3 * f.get('save_less_vote', f['save_call']):.2f}",
                              f"{f['save_call'] / one['save_call']:.2f}x (CPU "
                              f"{f['save_cpu'] / one['save_cpu']:.2f}x, less the vote "
                              f"{f.get('save_less_vote', f['save_call']) / one.get('save_less_vote', one['save_call']):.2f}x)"],
                             a.markdown, (16, 6, 10, 10, 14, 15, 24)))
    lines.append("")
    lines.append("save() at many ranks makes one collective (the vote, one byte per rank): "
                 "the all_gather column is its floor, measured in the same run; \"in the "
                 "vote\" is the wall of that all_gather inside save() (the wait for the "
                 "slowest rank to get there), and the last columns save() without it.")
    return "\n".join(lines), {f"{k[0]}|{k[1]}": v for k, v in res.items()}


def worker(a):
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import amber
    from amber.dcp import Reader, Writer
    from amber.torch import Checkpointer

    rank, world = a.rank, a.world
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{a.init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.timeout))

    torch.manual_seed(0)  # the same initial weights on every rank, as FSDP2 expects
    model = quick_model() if a.quick else GPT2Small()
    nparams = sum(p.numel() for p in model.parameters())
    for b in model.h:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    gen = torch.Generator().manual_seed(1 + rank)

    def grads():
        fake_grads(model, gen)

    def local_tensors():
        ts = [p.to_local() for p in model.parameters()]
        for st in opt.state.values():
            ts += [v.to_local() for v in st.values() if isinstance(v, DTensor)]
        return ts

    warm_up(model, opt, gen, steps=2)
    state = {"model": model, "optim": opt}

    def dstate():
        msd, osd = get_state_dict(model, opt)
        return {"model": msd, "optim": osd}

    def cold(path):
        dist.barrier()
        if rank == 0:
            drop_cache([f for f in glob.glob(os.path.join(path, "**"), recursive=True)
                        if os.path.isfile(f)])
        dist.barrier()

    def timed_all(fn):
        dist.barrier()
        return timed(fn)[0]

    def dcp_load(path, reader):
        sd = dstate()
        dcp.load(sd, storage_reader=reader, checkpoint_id=path if isinstance(reader, Reader) else None)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    def load_floor(ck_store):
        """Rank 0: the Checkpointer store's files (every rank's full checkpoint and
        deltas of the latest step) read cold at the disk's pace."""
        files = sorted(glob.glob(os.path.join(ck_store, "rank-*", "ckpt-*.amber")))
        return cold_read(files), sum(os.path.getsize(p) for p in files)

    def loads(f, sfx, dcp_dir, store, ck_store):
        if rank == 0:
            f["load_floor" + sfx], f["load_bytes" + sfx] = load_floor(ck_store)
        dist.barrier()
        cold(dcp_dir)
        f["dcp_load" + sfx] = timed_all(lambda: dcp_load(dcp_dir, dcp.FileSystemReader(dcp_dir)))
        cold(ck_store)

        def ckload():
            with Checkpointer(ck_store, policy=a.policy, full_every=1000, full_share=-1) as ck:
                assert ck.load(state) is not None
        f["amber_load" + sfx] = timed_all(ckload)
        cold(store)
        f["amber_dcp_load" + sfx] = timed_all(lambda: dcp_load(store, Reader()))

    rounds = []
    base = os.path.join(a.out, f"w{a.saved_at}")
    for r in range(1, a.repeat + 1):
        f = {}
        if a.phase == "load":  # stores saved at another world size
            if rank == 0:
                log(f"{world} ranks, round {r}: loads of the stores saved at {a.saved_at} ranks")
            loads(f, "_other", os.path.join(base, "dcp"), os.path.join(base, "adcp"),
                  os.path.join(base, "ck"))
            f["loadavg"] = os.getloadavg()[0]
            rounds.append(f)
            continue
        d = os.path.join(base, "dcp")
        if rank == 0:
            shutil.rmtree(base, ignore_errors=True)
            os.makedirs(base)
            log(f"{world} ranks, round {r}: dcp.save, dcp.async_save")
        dist.barrier()
        f["dcp_save"] = dcp_save(dstate, d)
        f["dcp_bytes"] = du(d)
        da = os.path.join(base, "dcpa")
        dist.barrier()
        f["dcp_async_stall"], f["dcp_async_durable"] = dcp_async_save(dstate, da)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(da)
        gc.collect()

        # amber's distributed Checkpointer: a full save, then deltas, alternately
        # synchronous (save-to-durable) and overlapped (stall)
        if rank == 0:
            log(f"{world} ranks, round {r}: amber Checkpointer full + {2 * a.deltas} deltas")
        ck_store = os.path.join(base, "ck")
        step = 1
        with Checkpointer(ck_store, policy=a.policy, full_every=1000, full_share=-1) as ck:
            dist.barrier()
            f["amber_full"] = amber_full(ck, state, step)
            step, dur, stall = amber_deltas(ck, state, step, 2 * a.deltas, grads, opt.step,
                                            dist.barrier)
            infos = ck.steps()
        if any(c.kind != "delta" for c in infos[1:]):
            raise RuntimeError(f"expected deltas after the full save: {infos}")
        f["amber_full_bytes"] = infos[0].bytes
        f.update(delta_figures(dur, stall, [c.bytes for c in infos[1:]]))

        # amber.dcp.Writer through dcp.save: a full save, then synchronous deltas
        if rank == 0:
            log(f"{world} ranks, round {r}: amber.dcp.Writer full + {a.deltas} deltas")
        store = os.path.join(base, "adcp")
        dur = []
        with Writer(policy=a.policy, full_every=1000, full_share=-1) as w:
            for i in range(a.deltas + 1):
                if i:
                    grads()
                    opt.step()
                t = timed_all(lambda: dcp.save(dstate(), storage_writer=w,
                                           checkpoint_id=f"{store}/step-{i + 1}"))
                if i == 0:
                    f["amber_dcp_full"] = t
                else:
                    dur.append(t)
        infos = amber.global_steps(store)
        if any(c.kind != "delta" for c in infos[1:]):
            raise RuntimeError(f"expected deltas after the full save: {infos}")
        f["amber_dcp_delta"] = statistics.median(dur)
        f["amber_dcp_delta_bytes_max"] = max(c.bytes for c in infos[1:])

        if rank == 0:
            log(f"{world} ranks, round {r}: loads and bounds")
        loads(f, "", d, store, ck_store)
        # bounds: every rank reads its live shard and a reference at once; the disk's
        # pace is rank 0's O_DIRECT write of a full checkpoint's bytes (the loads' own
        # floor, the store's files read cold, is taken in loads())
        dist.barrier()
        f["read_floor"] = read_floor(local_tensors())
        dist.barrier()
        if rank == 0:
            t_disk = direct_write(os.path.join(a.out, "direct.bin"), f["amber_full_bytes"])
            f["disk_rate"] = f["amber_full_bytes"] / t_disk if t_disk else math.inf
        dist.barrier()
        f["loadavg"] = os.getloadavg()[0]
        rounds.append(f)

    # every figure is the slowest rank's (the bytes are global: the same on every rank)
    got = [None] * world
    dist.all_gather_object(got, rounds)
    if rank == 0:
        out = []
        for i in range(len(rounds)):
            m = {}
            for k in got[0][i]:
                vals = [g[i].get(k) for g in got if g[i].get(k) is not None]
                m[k] = max(vals)
            if "delta_floor" not in m and "read_floor" in m:
                m["delta_floor"] = m["read_floor"] + m["amber_delta_bytes"] / m.pop("disk_rate")
            out.append(m)
        with open(a.result, "w") as fh:
            json.dump({"params": nparams, "rounds": out}, fh)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as tests/python/dist_worker.py: no gloo teardown at interpreter exit


# ---------------------------------------------------------------- the run
def spawn(a, phase, world, saved_at, result, tree=None):
    """Runs `phase` on `world` ranks of this script (with another checkout's amber:
    `tree`); kills them all past --timeout."""
    init = os.path.join(a.out, f"rdzv-{phase}-{world}-{saved_at}")
    if os.path.exists(init):
        os.unlink(init)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    args = ["--quick"] if a.quick else []
    codes = run_group([[sys.executable, os.path.abspath(__file__), "--worker", phase,
                        "--rank", str(r), "--world", str(world), "--init", init,
                        "--saved-at", str(saved_at), "--result", result, "--out", a.out,
                        "--repeat", str(a.repeat), "--deltas", str(a.deltas),
                        "--policy", a.policy, "--lr", str(a.lr),
                        "--timeout", str(a.timeout)] + args +
                       (["--tree", tree] if tree else []) for r in range(world)],
                      a.timeout, env=env)
    if any(codes):
        raise SystemExit(f"dist_bench: {phase} at {world} ranks failed (exit codes {codes})")
    with open(result) as fh:
        return json.load(fh)


# (ratio, target, higher is better, text)
TARGETS = [
    ("delta_vs_dcp_save", 15.0, True, "Checkpointer delta save-to-durable >= 15x faster than dcp.save"),
    ("dcpw_delta_vs_dcp_save", 15.0, True, "amber.dcp.Writer delta save-to-durable >= 15x faster than dcp.save"),
    ("stall_vs_dcp_async", 20.0, True, "stall >= 20x smaller than dcp.async_save's"),
    ("full_vs_dcp_save", 1.0, True, "Checkpointer full save at least as fast as dcp.save"),
    ("dcpw_full_vs_dcp_save", 1.0, True, "amber.dcp.Writer full save at least as fast as dcp.save"),
    ("load_other_vs_dcp_load", 1.5, True, "load at another world size >= 1.5x faster than dcp.load"),
    ("load_other_over_floor", 1.2, False, "load at another world size within 1.2x of a cold read of its bytes"),
    ("delta_pct_of_dcp", 3.0, False, "each delta <= 3% of DCP's bytes"),
    ("delta_over_floor", 1.2, False, "delta save-to-durable within 1.2x of the run's floor"),
]
# The same-run bound of a target: the ratio that the floor itself shows.
BOUNDS = {"delta_vs_dcp_save": "floor_vs_dcp_save", "dcpw_delta_vs_dcp_save": "floor_vs_dcp_save",
          "load_other_vs_dcp_load": "load_floor_other_vs_dcp_load"}


def ratios(f):
    r = {
        "delta_vs_dcp_save": f["dcp_save"] / f["amber_delta"],
        "dcpw_delta_vs_dcp_save": f["dcp_save"] / f["amber_dcp_delta"],
        "stall_vs_dcp_async": f["dcp_async_stall"] / f["amber_delta_stall"],
        "full_vs_dcp_save": f["dcp_save"] / f["amber_full"],
        "dcpw_full_vs_dcp_save": f["dcp_save"] / f["amber_dcp_full"],
        "load_vs_dcp_load": f["dcp_load"] / f["amber_load"],
        "delta_pct_of_dcp": 100.0 * max(f["amber_delta_bytes_max"],
                                        f["amber_dcp_delta_bytes_max"]) / f["dcp_bytes"],
        "delta_over_floor": f["amber_delta"] / f["delta_floor"],
        "floor_vs_dcp_save": f["dcp_save"] / f["delta_floor"],
        "load_floor_vs_dcp_load": f["dcp_load"] / f["load_floor"],
    }
    if "dcp_load_other" in f:
        r["load_other_vs_dcp_load"] = f["dcp_load_other"] / f["amber_load_other"]
        r["dcpr_load_other_vs_dcp_load"] = f["dcp_load_other"] / f["amber_dcp_load_other"]
        r["load_other_over_floor"] = f["amber_load_other"] / f["load_floor_other"]
        r["load_floor_other_vs_dcp_load"] = f["dcp_load_other"] / f["load_floor_other"]
    return r


ROWS = [("dcp.save (FileSystemWriter, sync_files)", "dcp_save", "dcp_bytes"),
        ("dcp.async_save: stall (until staged)", "dcp_async_stall", None),
        ("dcp.async_save: durable", "dcp_async_durable", None),
        ("amber Checkpointer full save", "amber_full", "amber_full_bytes"),
        ("amber Checkpointer delta save", "amber_delta", "amber_delta_bytes"),
        ("amber Checkpointer delta: stall", "amber_delta_stall", None),
        ("amber.dcp.Writer full save (dcp.save)", "amber_dcp_full", None),
        ("amber.dcp.Writer delta save (dcp.save)", "amber_dcp_delta", "amber_dcp_delta_bytes_max"),
        ("delta floor (read live + reference, write delta at O_DIRECT pace)", "delta_floor", None),
        ("dcp.load + set_state_dict, same world size", "dcp_load", None),
        ("amber Checkpointer.load, same world size", "amber_load", None),
        ("dcp.load with amber.dcp.Reader, same world size", "amber_dcp_load", None),
        ("dcp.load + set_state_dict, saved at {o} ranks", "dcp_load_other", None),
        ("amber Checkpointer.load, saved at {o} ranks", "amber_load_other", None),
        ("dcp.load with amber.dcp.Reader, saved at {o} ranks", "amber_dcp_load_other", None),
        ("load floor: the store's files read cold at the disk's pace", "load_floor", "load_bytes"),
        ("load floor, saved at {o} ranks: its files read cold", "load_floor_other", "load_bytes_other")]


def report(res, markdown):
    lines = []
    for w, r in res["worlds"].items():
        S, R, o = r["figures"], r["ratios"], r.get("other")
        cpus = res["config"]["cpus"]
        over = f" ({w} ranks on {cpus} CPUs: oversubscribed)" if int(w) > cpus else ""
        lines.append(f"\n{w} ranks{over}, highest load average at a round's end "
                     f"{r['loadavg']:.2f}:\n")
        if markdown:
            lines += ["| figure (slowest rank) | seconds (median, min-max) | bytes |", "|---|---|---|"]
        for label, k, b in ROWS:
            if k not in S:
                continue
            lines.append(row([label.format(o=o), fmt(S[k]), fmt(S[b], 'B') if b else ''],
                             markdown, (68, 26)))
        if markdown:
            lines += TARGETS_HEAD
        lines += target_lines(TARGETS, R, markdown, (68, 26), BOUNDS)
        other = "" if "load_floor_other_vs_dcp_load" not in R else (
            f" (saved at {o} ranks: {fmt(R['load_floor_other_vs_dcp_load'], 'x')})")
        lines.append(f"{'' if not markdown else chr(10)}Bound: the run's delta floor is "
                     f"{fmt(R['floor_vs_dcp_save'], 'x')} faster than dcp.save; reading the "
                     f"store's files cold at the disk's pace is "
                     f"{fmt(R['load_floor_vs_dcp_load'], 'x')} faster than dcp.load{other}.")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", default="2,4", help="world sizes, comma-separated")
    ap.add_argument("--out", default=os.path.join(os.getcwd(), "dist-bench-out"),
                    help="scratch directory (removed at the end)")
    ap.add_argument("--policy", default="lossy-compact")
    ap.add_argument("--deltas", type=int, default=2, help="synchronous and overlapped deltas per round")
    ap.add_argument("--repeat", type=int, default=1, help="rounds (the spread is over them)")
    add_run_args(ap)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per spawned phase")
    # a spawned rank's own arguments
    ap.add_argument("--save-calls", action="store_true",
                    help="only the cost of a delta's save() call, one process and --ranks")
    ap.add_argument("--baseline", help="with --save-calls: also another checkout's amber")
    ap.add_argument("--worker", choices=("save", "load", "calls"), help=argparse.SUPPRESS)
    ap.add_argument("--tree", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--world", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--init", help=argparse.SUPPRESS)
    ap.add_argument("--saved-at", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        a.phase = a.worker
        return calls_worker(a) if a.worker == "calls" else worker(a)
    worlds = [int(x) for x in a.ranks.split(",")]
    if a.repeat < 1 or a.deltas < 1 or any(w < 1 for w in worlds):
        ap.error("--repeat, --deltas and --ranks must be >= 1")
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    if a.save_calls:
        try:
            text, res = save_calls(a, worlds)
        finally:
            shutil.rmtree(a.out, ignore_errors=True)
        emit("amber dist_bench --save-calls", text, res, a.json)
        return
    import torch
    config = {"ranks": worlds, "policy": a.policy, "lr": a.lr, "repeat": a.repeat,
              "deltas": a.deltas, "cpus": os.cpu_count(), "torch": torch.__version__,
              "machine": platform.machine(), "loadavg_start": os.getloadavg()[0]}
    log(f"world sizes {worlds}, policy {a.policy!r}, {a.repeat} round(s), "
        f"load average {config['loadavg_start']:.2f}")
    res = {"config": config, "worlds": {}}
    try:
        saved = {}
        for w in worlds:
            saved[w] = spawn(a, "save", w, w, os.path.join(a.out, f"save-{w}.json"))
        config["params"] = saved[worlds[0]]["params"]
        for i, w in enumerate(worlds):  # load what the next world size saved
            rounds = saved[w]["rounds"]
            other = worlds[(i + 1) % len(worlds)] if len(worlds) > 1 else None
            if other is not None:
                got = spawn(a, "load", w, other, os.path.join(a.out, f"load-{w}.json"))
                for f, g in zip(rounds, got["rounds"]):
                    f.update(g)
            rs = [ratios(f) for f in rounds]
            res["worlds"][str(w)] = {
                "other": other, "rounds": rounds,
                "loadavg": max(f["loadavg"] for f in rounds),
                "figures": spreads(rounds, skip=("loadavg",)),
                "ratios": spreads(rs)}
    finally:
        shutil.rmtree(a.out, ignore_errors=True)
    res["targets"] = [t for w, r in res["worlds"].items()
                      for t in target_records(TARGETS, r["ratios"], BOUNDS, ranks=int(w))]
    emit(f"amber dist_bench: {config['params'] / 1e6:.1f}M parameters + AdamW under FSDP2, "
         f"policy {a.policy!r}, {a.repeat} round(s), {config['cpus']} CPUs, torch "
         f"{config['torch']}, load average {config['loadavg_start']:.2f} -> "
         f"{os.getloadavg()[0]:.2f}", report(res, a.markdown), res, a.json)


if __name__ == "__main__":
    main()
