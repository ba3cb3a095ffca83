#!/usr/bin/env python3
"""tiers_bench.py - amber's storage tiers side by side with what users would pick
instead, in one run: a restart from the memory tier against a cold load from the
durable tier, against dcp.load and against the load of torch_checkpointing (Meta's
successor of DCP's async checkpointer, whose save() "returns immediately"); the
training thread's stall with tiers against without and against torch_checkpointing's;
the bytes a peer replica receives per step against a full state.

The state is GPT-2 small (124M parameters) + AdamW, trained by AdamW steps on
synthetic gradients (bench/torch_bench.py says why), policy `lossy` by default.

Saves (per round, medians over --deltas steady deltas: the stall over the half that
overlap the next gradients, save-to-durable over the other half):
  amber without tiers: the Checkpointer on the durable path; the stall of a delta is
  save() + the fence after the next gradients (the training thread's wait).
  amber with tiers: Checkpointer(path, memory=/dev/shm/...): the same stall, while
  the library drains each step to the durable path in the background.
  torch_checkpointing: CheckpointManager with its CPU configuration (docs:
  troubleshooting: no pinned memory, no non-blocking copy) and use_direct_io=False
  (its O_DIRECT writes fail with EINVAL on this file system); the stall is save() +
  the wait for its staging (the tensors may change only then: its manager waits for
  it before the next save too); durable when its write future completes.
Restores (into the live model and optimizer):
  amber from the memory tier (its files in /dev/shm: a restarted process on the
  same node); amber from the durable tier, cold (the files dropped from the page
  cache first); dcp.load + set_state_dict, cold; torch_checkpointing's load + the
  optimizer's load_state_dict, cold.
Bounds, measured in the same run: the memory tier's floor is one copy of the state's
bytes (any restore writes every byte of the state once); a cold load's floor is its
files read cold at the disk's pace (O_DIRECT, 8 MiB reads, two at a time).

Many ranks (--ranks 2,4): GPT-2 small + AdamW sharded with FSDP2 on CPU ranks (gloo),
each rank a "host" of its own (its own memory directory under /dev/shm, AMBER_HOST),
Checkpointer(path, memory=HOST_DIR, replicas=1): the stall of a delta, the bytes each
rank sends its peer per delta step against its shard of the state, then a restart of
the job (new processes) from the memory tiers, from a peer after one host's memory
was wiped, and from the durable tier (cold) after every host's was, against dcp.load
(cold) of the same state at the same world size. Every figure is the slowest rank's.

    tiers_bench.py [--repeat 1] [--deltas 12] [--policy lossy] [--quick] [--json FILE]
                   [--markdown] [--out DIR] [--ranks 2,4] [--timeout 900]
"""
import argparse
import datetime
import gc
import glob
import json
import os
import platform
import shutil
import statistics
import sys
import time
import uuid

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict

import amber
from amber.torch import Checkpointer

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (TARGETS_HEAD, GPT2Small, add_run_args, amber_deltas, amber_full,  # noqa: E402
                     cold_read, dcp_state, drop_cache, du, emit, fake_grads, fmt, logger,
                     quick_model, row, run_group, spreads, state_bytes, target_lines,
                     target_records, warm_trainer, warm_up)

log = logger("tiers_bench")


def copy_floor(model, opt, reps=3):
    """Seconds to copy every byte of the state once into memory that holds it already
    (no page faults): what any restore must at least do."""
    ts = list(model.state_dict().values())
    for st in opt.state.values():
        ts += [v for v in st.values() if torch.is_tensor(v)]
    dst = [t.clone() for t in ts]
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        torch._foreach_copy_(dst, ts)
        best = min(best, time.perf_counter() - t0)
    return best


def files(path):
    return [f for f in glob.glob(os.path.join(path, "**"), recursive=True) if os.path.isfile(f)]


def amber_run(tr, path, step, n, policy, **tiers):
    """A full save and `n` steady deltas through a Checkpointer (with `tiers` when
    given); returns (last step, stalls, delta bytes, full seconds)."""
    with Checkpointer(path, policy=policy, **tiers) as ck:
        t_full = amber_full(ck, tr.state, step)
        first = step
        step, _, stall = amber_deltas(ck, tr.state, step, n, tr.grads, tr.step)
        ck.wait()
        infos = ck.steps()
    dbytes = [i.bytes for i in infos if i.step > first and i.kind == "delta"]
    return step, stall, dbytes, t_full


def tc_manager():
    from torch_checkpointing import CheckpointManager
    from torch_checkpointing.config import AsyncCheckpointSaverConfig
    from torch_checkpointing.staging import CheckpointStagerConfig
    from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig
    return CheckpointManager(CheckpointManager.Config(
        save=AsyncCheckpointSaverConfig(staging_config=CheckpointStagerConfig(
            use_pinned_memory=False, use_non_blocking_copy=False)),
        storage_config=LocalFileSystemStorageConfig(use_direct_io=False)))


def tc_saves(tr, out, n):
    """torch_checkpointing: a first save (its staging pool is made), then `n` saves
    after a training step each: (stalls, durable seconds, last checkpoint dir)."""
    mgr = tc_manager()
    stalls, durs, last = [], [], None
    try:
        for i in range(n + 1):
            tr.grads()
            tr.step()
            last = os.path.join(out, f"tc-{i}")
            t0 = time.perf_counter()
            fut = mgr.save(last, {"model": tr.model.state_dict(), "optim": tr.opt.state_dict()})
            staged = mgr._staging_future  # the manager's own wait before the next save
            if staged is not None:
                staged.result()
            stall = time.perf_counter() - t0
            fut.result()
            if i:
                stalls.append(stall)
                durs.append(time.perf_counter() - t0)
            if i >= 1:
                prev = os.path.join(out, f"tc-{i - 1}")
                if prev != last:
                    shutil.rmtree(prev, ignore_errors=True)
    finally:
        mgr.close()
    return stalls, durs, last


def tc_load(tr, path):
    mgr = tc_manager()
    try:
        t0 = time.perf_counter()
        got = mgr.load(path, into={"model": tr.model.state_dict(),
                                   "optim": tr.opt.state_dict()})
        tr.opt.load_state_dict(got["optim"])
        return time.perf_counter() - t0
    finally:
        mgr.close()


def one_round(tr, out, r, a):
    f = {}
    nbytes = state_bytes(tr.model, tr.opt)
    f["state_bytes"] = nbytes
    step = 1000 * (r + 1)
    # amber without tiers: the durable path on the disk
    disk = os.path.join(out, f"amber-disk-{r}")
    log(f"round {r}: amber on the disk, {a.deltas} deltas")
    _, stall, dbytes, f["amber_full_disk"] = amber_run(tr, disk, step, a.deltas, a.policy)
    f["stall_disk"] = statistics.median(stall)
    shutil.rmtree(disk, ignore_errors=True)
    # amber with tiers
    durable = os.path.join(out, f"amber-tiers-{r}")
    memory = f"/dev/shm/amber-bench-{uuid.uuid4().hex[:8]}"
    try:
        log(f"round {r}: amber with a memory tier ({memory}), {a.deltas} deltas")
        step, stall, dbytes, f["amber_full_tiers"] = amber_run(tr, durable, step, a.deltas,
                                                               a.policy, memory=memory)
        f["stall_tiers"] = statistics.median(stall)
        f["delta_bytes"] = statistics.median(dbytes)
        f["replica_pct_of_full_state"] = 100.0 * f["delta_bytes"] / nbytes
        f["memory_bytes"] = du(memory)
        # restores: memory, then cold durable
        gc.collect()
        log(f"round {r}: restore from the memory tier")
        with Checkpointer(durable, memory=memory, policy=a.policy) as ck:
            t0 = time.perf_counter()
            got = ck.load(tr.state)
            f["restore_memory"] = time.perf_counter() - t0
            assert ck.served_by == "memory" and got == step, (ck.served_by, got, step)
            # the same from the chain's full checkpoint alone (no delta to apply): what a
            # restore costs right after a full save
            full = max(i.step for i in ck.steps() if i.kind == "full")
            t0 = time.perf_counter()
            ck.load(tr.state, step=full)
            f["restore_memory_full"] = time.perf_counter() - t0
            assert ck.served_by == "memory"
            f["chain_deltas"] = step - full
            ck.load(tr.state)  # back to the newest step for what follows
        drop_cache(files(durable))
        log(f"round {r}: cold load from the durable tier")
        with Checkpointer(durable, readonly=True) as ck:
            t0 = time.perf_counter()
            assert ck.load(tr.state) == step
            f["restore_durable_cold"] = time.perf_counter() - t0
        chain = [os.path.join(durable, f"ckpt-{i.step:020d}.amber")
                 for i in Checkpointer(durable, readonly=True).steps()
                 if i.step >= max(j.step for j in Checkpointer(durable, readonly=True).steps()
                                  if j.kind == "full")]
        f["durable_floor"] = cold_read([c for c in chain if os.path.exists(c)])
    finally:
        shutil.rmtree(memory, ignore_errors=True)
        shutil.rmtree(durable, ignore_errors=True)
    f["copy_floor"] = copy_floor(tr.model, tr.opt)
    # dcp.load, cold
    dpath = os.path.join(out, f"dcp-{r}")
    log(f"round {r}: dcp.save (not timed), dcp.load cold")
    dcp.save(dcp_state(tr.model, tr.opt), storage_writer=dcp.FileSystemWriter(dpath))
    drop_cache(files(dpath))
    t0 = time.perf_counter()
    sd = dcp_state(tr.model, tr.opt)
    dcp.load(sd, storage_reader=dcp.FileSystemReader(dpath))
    set_state_dict(tr.model, tr.opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    f["dcp_load_cold"] = time.perf_counter() - t0
    f["dcp_floor"] = cold_read(files(dpath))
    shutil.rmtree(dpath, ignore_errors=True)
    # torch_checkpointing
    log(f"round {r}: torch_checkpointing, {a.deltas} saves, load cold")
    stalls, durs, last = tc_saves(tr, out, a.deltas)
    f["stall_tc"], f["tc_durable"] = statistics.median(stalls), statistics.median(durs)
    drop_cache(files(last))
    f["tc_load_cold"] = tc_load(tr, last)
    shutil.rmtree(last, ignore_errors=True)
    # the ratios
    f["memory_vs_dcp_load"] = f["dcp_load_cold"] / f["restore_memory"]
    f["memory_full_vs_dcp_load"] = f["dcp_load_cold"] / f["restore_memory_full"]
    f["memory_vs_durable_cold"] = f["restore_durable_cold"] / f["restore_memory"]
    f["memory_vs_tc_load"] = f["tc_load_cold"] / f["restore_memory"]
    f["floor_vs_dcp_load"] = f["dcp_load_cold"] / f["copy_floor"]
    f["stall_tiers_vs_disk"] = f["stall_tiers"] / f["stall_disk"]
    f["stall_tc_vs_tiers"] = f["stall_tc"] / f["stall_tiers"]
    return f


TARGETS = [
    ("memory_vs_dcp_load", 5.0, True, "restart from the memory tier >= 5x faster than dcp.load (cold)"),
    ("stall_tiers_vs_disk", 1.1, False, "stall with tiers within 1.1x of the stall without"),
    ("replica_pct_of_full_state", 3.0, False, "replication bytes per step <= 3% of a full state"),
]
BOUNDS = {"memory_vs_dcp_load": "floor_vs_dcp_load"}


def report(res, markdown):
    R = res["ratios"]
    F = res["figures"]
    w = (58, 26)
    lines = [row(["figure", "seconds (median, min-max)"], markdown, w)]
    if markdown:
        lines.append("|---|---|")
    for k, text in (("stall_disk", "amber delta stall, no tiers"),
                    ("stall_tiers", "amber delta stall, memory tier + drain"),
                    ("stall_tc", "torch_checkpointing save stall (save + staging)"),
                    ("tc_durable", "torch_checkpointing save to durable"),
                    ("restore_memory", "amber restore from the memory tier"),
                    ("restore_memory_full", "amber restore from memory, the chain's full step"),
                    ("restore_durable_cold", "amber load from the durable tier, cold"),
                    ("dcp_load_cold", "dcp.load + set_state_dict, cold"),
                    ("tc_load_cold", "torch_checkpointing load, cold"),
                    ("copy_floor", "floor: one copy of the state's bytes"),
                    ("durable_floor", "floor: the durable chain read cold"),
                    ("dcp_floor", "floor: DCP's files read cold")):
        if k in F:
            lines.append(row([text, fmt(F[k], "s")], markdown, w))
    lines.append("")
    lines.append(row(["ratio", "median (min-max)"], markdown, w))
    if markdown:
        lines.append("|---|---|")
    for k, text in (("memory_vs_dcp_load", "restore: dcp.load / memory tier"),
                    ("memory_full_vs_dcp_load", "restore: dcp.load / memory tier, full step"),
                    ("memory_vs_durable_cold", "restore: durable cold / memory tier"),
                    ("memory_vs_tc_load", "restore: torch_checkpointing / memory tier"),
                    ("floor_vs_dcp_load", "bound: dcp.load / one copy of the state"),
                    ("stall_tiers_vs_disk", "stall: tiers / no tiers"),
                    ("stall_tc_vs_tiers", "stall: torch_checkpointing / amber with tiers"),
                    ("replica_pct_of_full_state", "a replica's bytes per step, % of the state")):
        if k in R:
            lines.append(row([text, fmt(R[k], unit="%" if k.endswith("state") else "x")],
                             markdown, w))
    lines.append("")
    if markdown:
        lines += TARGETS_HEAD + target_lines(TARGETS, R, True, w, BOUNDS)
    else:
        lines += target_lines(TARGETS, R, False, w, BOUNDS)
    return "\n".join(lines)


# ---------------------------------------------------------------- many ranks
def rank_worker(a):
    """One rank of phase a.worker: "save" (full + deltas through the tiers, and a
    dcp.save of the same state), "restore" (a restart's load), "dcp" (dcp.load)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    rank, world = a.rank, a.world
    os.environ["AMBER_HOST"] = f"host-{rank}"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{a.init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=a.timeout))
    torch.manual_seed(0)
    model = quick_model() if a.quick else GPT2Small()
    for b in model.h:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(1 + rank)

    def grads():
        fake_grads(model, gen)

    warm_up(model, opt, gen)  # AdamW well into training, as the one-process part
    state = {"model": model, "optim": opt}
    mine = sum(p.to_local().numel() * 4 for p in model.parameters()) * 3
    durable, memory = os.path.join(a.out, "durable"), os.path.join(a.mem, f"host-{rank}")
    dpath = os.path.join(a.out, "dcp")
    res = {"rank": rank}

    def cold(paths):
        dist.barrier()
        if rank == 0:
            drop_cache([f for p in paths for f in files(p)])
        dist.barrier()

    if a.worker == "save":
        with Checkpointer(durable, policy=a.policy, memory=memory, replicas=1) as ck:
            dist.barrier()
            ck.save(1, state, full=True)
            ck.wait()
            ck._tiers.settle()
            sent0 = ck._tiers.stats().total_sent
            # alternately save() + wait() and save() + the fence after the next
            # gradients (the stall: save() and the fence, as in the one-process part)
            _, _, stalls = amber_deltas(ck, state, 1, a.deltas, grads, opt.step, dist.barrier)
            ck._tiers.settle()
            st = ck._tiers.stats()
            res["replica_bytes"] = (st.total_sent - sent0) / a.deltas
            res["stall"] = statistics.median(stalls)
        res["shard_bytes"] = mine
        msd, osd = get_state_dict(model, opt)
        import torch.distributed.checkpoint as dcp_
        dcp_.save({"model": msd, "optim": osd}, storage_writer=dcp_.FileSystemWriter(dpath))
    elif a.worker == "restore":
        if a.cold:
            cold([durable])
        t0 = time.perf_counter()
        with Checkpointer(durable, policy=a.policy, memory=memory, replicas=1) as ck:
            res["open"] = time.perf_counter() - t0  # the tiers' group, drain, replicator
            dist.barrier()
            t0 = time.perf_counter()
            got = ck.load(state)  # the agreement, what peers send, the read
            res["seconds"] = time.perf_counter() - t0
            res["tier"], res["step"] = ck.served_by, got
    elif a.worker == "dcp":
        import torch.distributed.checkpoint as dcp_
        from torch.distributed.checkpoint.state_dict import set_state_dict
        cold([dpath])
        t0 = time.perf_counter()
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd}
        dcp_.load(sd, storage_reader=dcp_.FileSystemReader(dpath))
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        res["seconds"] = time.perf_counter() - t0
    with open(f"{a.result}.{rank}", "w") as fh:
        json.dump(res, fh)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def spawn(a, phase, world, out, mem, cold=False):
    init = os.path.join(out, f"rdzv-{phase}-{time.time_ns()}")
    result = os.path.join(out, f"result-{phase}")
    cmd = lambda r: [sys.executable, os.path.abspath(__file__), "--worker", phase,  # noqa: E731
                     "--rank", str(r), "--world", str(world), "--init", init, "--result", result,
                     "--out", out, "--mem", mem, "--deltas", str(a.deltas), "--policy", a.policy,
                     "--lr", str(a.lr), "--timeout", str(a.timeout)] + \
        (["--quick"] if a.quick else []) + (["--cold"] if cold else [])
    codes = run_group([cmd(r) for r in range(world)], a.timeout,
                      env=dict(os.environ, OMP_NUM_THREADS="1"))
    if any(codes):
        raise SystemExit(f"tiers_bench: {phase} at {world} ranks failed (exit codes {codes})")
    return [json.load(open(f"{result}.{r}")) for r in range(world)]


def ranks_round(a, world, r):
    out = os.path.abspath(os.path.join(a.out, f"ranks-{world}-{r}"))
    mem = f"/dev/shm/amber-bench-{uuid.uuid4().hex[:8]}"
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    f = {}
    try:
        log(f"{world} ranks, round {r}: save through the tiers ({a.deltas} deltas), dcp.save")
        saved = spawn(a, "save", world, out, mem)
        f["stall"] = max(x["stall"] for x in saved)
        f["replica_pct_of_shard"] = max(100.0 * x["replica_bytes"] / x["shard_bytes"] for x in saved)
        log(f"{world} ranks, round {r}: restart from memory")
        got = spawn(a, "restore", world, out, mem)
        assert {x["tier"] for x in got} <= {"memory", "peer"}, got
        f["restore_memory"] = max(x["seconds"] for x in got)
        f["open"] = max(x["open"] for x in got)
        shutil.rmtree(os.path.join(mem, "host-1"))
        log(f"{world} ranks, round {r}: host 1 wiped: restart from its peer")
        got = spawn(a, "restore", world, out, mem)
        assert got[1]["tier"] == "peer", got
        f["restore_peer"] = max(x["seconds"] for x in got)
        shutil.rmtree(mem)
        log(f"{world} ranks, round {r}: every host wiped: restart from the durable tier, cold")
        got = spawn(a, "restore", world, out, mem, cold=True)
        assert {x["tier"] for x in got} == {"durable"}, got
        f["restore_durable_cold"] = max(x["seconds"] for x in got)
        log(f"{world} ranks, round {r}: dcp.load, cold")
        f["dcp_load_cold"] = max(x["seconds"] for x in spawn(a, "dcp", world, out, mem))
    finally:
        shutil.rmtree(mem, ignore_errors=True)
        shutil.rmtree(out, ignore_errors=True)
    f["memory_vs_dcp_load"] = f["dcp_load_cold"] / f["restore_memory"]
    f["peer_vs_dcp_load"] = f["dcp_load_cold"] / f["restore_peer"]
    f["durable_vs_dcp_load"] = f["dcp_load_cold"] / f["restore_durable_cold"]
    return f


def ranks_report(res, markdown):
    w = (58, 26)
    lines = []
    for world, R in sorted(res.items()):
        lines += ["", f"{world} ranks (each its own host):", row(["figure", "median (min-max)"],
                                                                 markdown, w)]
        if markdown:
            lines.append("|---|---|")
        for k, text, unit in (("stall", "amber delta stall, slowest rank", "s"),
                              ("replica_pct_of_shard", "replica bytes per delta step, % of the rank's shard", "%"),
                              ("open", "a restart's Checkpointer(...) (group, drain, replicator)", "s"),
                              ("restore_memory", "restart from the memory tiers", "s"),
                              ("restore_peer", "restart, host 1 wiped: from its peer", "s"),
                              ("restore_durable_cold", "restart, all memory wiped: durable, cold", "s"),
                              ("dcp_load_cold", "dcp.load + set_state_dict, cold", "s"),
                              ("memory_vs_dcp_load", "dcp.load / restart from memory", "x"),
                              ("peer_vs_dcp_load", "dcp.load / restart from a peer", "x"),
                              ("durable_vs_dcp_load", "dcp.load / restart from durable", "x")):
            lines.append(row([text, fmt(R[k], unit)], markdown, w))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_run_args(ap)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--deltas", type=int, default=12)
    ap.add_argument("--policy", default="lossy")
    ap.add_argument("--out", default="bench-out/tiers")
    ap.add_argument("--ranks", default="", help="world sizes of the many-rank part, e.g. 2,4")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    for k in ("--rank", "--world"):
        ap.add_argument(k, type=int, help=argparse.SUPPRESS)
    for k in ("--init", "--result", "--mem"):
        ap.add_argument(k, help=argparse.SUPPRESS)
    ap.add_argument("--cold", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return rank_worker(a)
    tr = warm_trainer(a)
    os.makedirs(a.out, exist_ok=True)
    rounds = [one_round(tr, a.out, r, a) for r in range(a.repeat)]
    ratio_keys = [k for k in rounds[0] if "_vs_" in k or k.endswith("_pct_of_full_state")]
    for f in rounds:
        f.pop("chain_deltas", None)
    res = {"machine": platform.node(), "cpus": os.cpu_count(), "amber": amber.version(),
           "policy": a.policy, "figures": spreads(rounds, skip=ratio_keys),
           "ratios": spreads([{k: f[k] for k in ratio_keys} for f in rounds])}
    res["targets"] = target_records(TARGETS, res["ratios"], BOUNDS)
    head = (f"tiers_bench: {'quick model' if a.quick else 'GPT-2 small + AdamW'} "
            f"({rounds[0]['state_bytes'] / 1e9:.2f} GB), policy {a.policy}, {a.repeat} round(s), "
            f"{a.deltas} deltas (the memory tier's chain: a full and {a.deltas} deltas), "
            f"{os.cpu_count()} CPUs")
    text = report(res, a.markdown)
    if a.ranks:
        res["ranks"] = {}
        for world in [int(x) for x in a.ranks.split(",") if x]:
            rounds_w = [ranks_round(a, world, r) for r in range(a.repeat)]
            res["ranks"][world] = spreads(rounds_w)
        text += "\n" + ranks_report(res["ranks"], a.markdown)
    emit(head, text, res, a.json)


if __name__ == "__main__":
    main()
