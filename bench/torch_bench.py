#!/usr/bin/env python3
"""torch_bench.py - amber.torch side by side with what users would pick instead:
torch.save, safetensors, and PyTorch's Distributed Checkpoint (DCP: dcp.save,
dcp.async_save, dcp.load), on the same training state in one run.

The state is GPT-2 small (124M parameters) + AdamW (two moments and a step counter
per parameter): about 1.5 GB. It trains by AdamW steps on synthetic gradients (a
forward/backward pass of GPT-2 small takes seconds on a CPU and would not change what
is measured: every element of weights and moments moves at every step, as in real
training). The gradients have the size GPT-2 training clips them to (global norm 1),
and the optimizer starts from the state it has after many steps on such gradients
(step 1000), not from the first steps' transient. Between a save and the next
optimizer step the script draws the next gradients, which stands for the forward and
backward pass that a save overlaps with.

Each round measures every figure once; --repeat N rounds give the spread (median,
min-max), and each ratio is taken within a round, so both sides of a ratio saw the
same machine state.

Saves (durable = the file is fsynced and, for amber and DCP, committed):
  torch.save + fsync; safetensors.torch.save_file + fsync (model and optimizer state
  as one flat dict); dcp.save with FileSystemWriter(sync_files=True), thread_count 1
  and 2; dcp.async_save with its default stager: its stall is the time until its
  staging has completed (the call returns after staging: DefaultStager's staging is
  synchronous on a CPU), durable when its future completes.
  amber: full save (save() + wait()), steady delta save-to-durable, the stall a delta
  costs the training thread (the save() call + the wait at the next optimizer
  step's fence), and the first save after a resume (load, then a delta whose
  reference the load seeded).
  A state of plain tensors that no optimizer owns (0.58 GB: weights and two moments
  as dicts of tensors, updated in place after each fence as an optimizer would): the
  stall of a delta save, save() + the fence after a stand-in forward/backward pass
  (under the policy's rules, or v1-lossy-compact's where they are in units of the
  learning rate, which plain tensors do not have).
Loads (cold: the files are dropped from the page cache first; into the live model
and optimizer): torch.load + load_state_dict; safetensors load_file + copy into the
live tensors; dcp.load + set_state_dict; amber's resuming load of the latest step
(which also starts seeding the writer's reference, on a thread until the next
optimizer step: that wait counts in the first save after the load) and a read-only
load.
Bounds, measured in the same run: a delta's floor = reading live and reference once
(both arrays summed at memory speed) + writing the delta's bytes at the disk's
O_DIRECT pace (a full checkpoint's size written with O_DIRECT + fsync); a load's
floor = the latest step's files (its full checkpoint and the deltas after it) read
cold at the disk's pace (O_DIRECT, 8 MiB reads, two at a time). Each target with a
floor prints the ratio the floor itself shows: no implementation can show more on
this machine in this run.

    torch_bench.py [--repeat 3] [--policy lossy-compact] [--deltas 4] [--quick]
                   [--json FILE] [--markdown] [--out DIR]
"""
import argparse
import gc
import glob
import math
import os
import platform
import shutil
import statistics
import sys
import time

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import set_state_dict
from safetensors.torch import load_file, save_file

import amber
from amber.torch import Checkpointer, PRESETS
from amber.torch._presets import have_units, rules

# The presets before quantized deltas (format 1.2), to compare speed with: element
# selection with values stored whole.
V1 = {"v1-lossy-compact": ("budget:0.02:2e-3", "*/exp_avg=budget:0.02:2e-4",
                           "*/momentum_buffer=budget:0.02:2e-4", "*/exp_avg_sq=threshold:0:0.5",
                           "*/max_exp_avg_sq=threshold:0:0.5")}


def policy_arg(text):
    """--policy: a preset's name (amber.torch's, or V1's), or rules separated by commas."""
    if text in PRESETS:
        return text
    if text in V1:
        return list(V1[text])
    return [r for r in text.split(",") if r]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (TARGETS_HEAD, GPT2Small, Trainer, add_run_args, amber_deltas, amber_full,  # noqa: E402
                     cold_read, dcp_async_save, dcp_save, dcp_state, delta_figures, direct_write,
                     drop_cache, du, emit, fmt, logger, quick_model, read_floor, row,
                     spreads, target_lines, target_records, timed, torch_save, warm_up)

log = logger("torch_bench")


def state_tensors(model, opt):
    """The tensors a checkpoint of the state holds (weights, moments)."""
    ts = [p.data for p in model.parameters()]
    for st in opt.state.values():
        ts += [v for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    return ts


def flat_state(model, opt):
    """Model and optimizer state as one flat {name: tensor} dict (safetensors' shape
    of a checkpoint), with the live tensors themselves (no copies)."""
    names = {p: n for n, p in model.named_parameters()}
    flat = {f"model.{n}": t for n, t in model.state_dict().items()}
    for p, st in opt.state.items():
        for k, v in st.items():
            if torch.is_tensor(v):
                flat[f"optim.{names[p]}.{k}"] = v
    return flat


def peers(tr, out, r):
    """One round of the peers' saves and loads; returns {figure: value}."""
    model, opt = tr.model, tr.opt
    f = {}
    # torch.save + fsync, torch.load + load_state_dict
    path = os.path.join(out, "state.pt")
    log(f"round {r}: torch.save")
    f["torch_save"] = torch_save(path, model, opt)
    f["torch_bytes"] = os.path.getsize(path)
    drop_cache([path])

    def tload():
        sd = torch.load(path)
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
    f["torch_load"], _ = timed(tload)
    os.remove(path)
    gc.collect()

    # safetensors
    log(f"round {r}: safetensors")
    path = os.path.join(out, "state.safetensors")

    def ssave():
        save_file(flat_state(model, opt), path)
        fd = os.open(path, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    f["st_save"], _ = timed(ssave)
    f["st_bytes"] = os.path.getsize(path)
    drop_cache([path])

    def sload():
        got = load_file(path)
        with torch.no_grad():
            for n, t in flat_state(model, opt).items():
                t.copy_(got[n])
    f["st_load"], _ = timed(sload)
    os.remove(path)
    gc.collect()

    # dcp.save, thread_count 1 and 2
    for k in (1, 2):
        log(f"round {r}: dcp.save thread_count={k}")
        d = os.path.join(out, f"dcp{k}")
        f[f"dcp_save_t{k}"] = dcp_save(lambda: dcp_state(model, opt), d, thread_count=k)
        f["dcp_bytes"] = du(d)
        if k == 2:
            drop_cache([p for p in glob.glob(os.path.join(d, "*")) if os.path.isfile(p)])

            def dload():
                sd = dcp_state(model, opt)
                dcp.load(sd, storage_reader=dcp.FileSystemReader(d))
                set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
            log(f"round {r}: dcp.load")
            f["dcp_load"], _ = timed(dload)
        shutil.rmtree(d)
    gc.collect()

    # dcp.async_save: the stall is until its staging completed, then the next step runs
    log(f"round {r}: dcp.async_save")
    d = os.path.join(out, "dcpa")
    f["dcp_async_stall"], f["dcp_async_durable"] = dcp_async_save(lambda: dcp_state(model, opt), d,
                                                                  thread_count=1)
    shutil.rmtree(d)
    gc.collect()
    return f


def amber_round(tr, out, r, policy, deltas):
    """One round of amber's saves and loads on a fresh store; returns {figure: value}."""
    f = {}
    store = os.path.join(out, "store")
    shutil.rmtree(store, ignore_errors=True)
    state = tr.state
    step = 0
    log(f"round {r}: amber full and {deltas} deltas ({policy})")
    with Checkpointer(store, policy=policy, full_every=1000, full_share=-1) as ck:
        step += 1
        f["amber_full"] = amber_full(ck, state, step)
        # the full save's stall: save() call + the fence in the next step
        tr.grads()
        tr.step()
        step += 1
        t0 = time.perf_counter()
        ck.save(step, state, full=True)
        t_call = time.perf_counter() - t0
        tr.grads()
        ck.timings["fence"] = 0.0
        tr.step()  # fences first
        f["amber_full_stall"] = t_call + ck.timings["fence"]
        ck.wait()
        full_step = step
        # deltas, alternately synchronous (save-to-durable) and overlapped (stall)
        calls = []
        step, dur, stall = amber_deltas(ck, state, step, 2 * deltas, tr.grads, tr.step,
                                        calls=calls)
        infos = {c.step: c for c in ck.steps()}
    kinds = [infos[s].kind for s in infos if s > full_step]
    if any(k != "delta" for k in kinds):
        raise RuntimeError(f"expected only deltas after step {full_step}, got {kinds}")
    dbytes = [infos[s].bytes for s in infos if s > full_step]
    f["amber_full_bytes"] = infos[full_step].bytes
    f.update(delta_figures(dur, stall, dbytes))
    f["amber_delta_call"] = statistics.median(c for c, _ in calls)
    f["amber_delta_call_cpu"] = statistics.median(c for _, c in calls)

    # the floor of a load of the latest step: its chain's files (the full checkpoint and
    # the deltas after it) read cold at the disk's pace
    chain, s = [], step
    while s is not None:
        chain.append(os.path.join(store, f"ckpt-{s:020d}.amber"))
        s = infos[s].parent
    log(f"round {r}: a cold read of the latest step's {len(chain)} files")
    f["load_floor"] = cold_read(chain)
    f["load_bytes"] = sum(os.path.getsize(p) for p in chain)
    files = lambda: glob.glob(os.path.join(store, "*.amber"))  # noqa: E731
    # read-only load of the latest step
    drop_cache(files())
    with Checkpointer(store, readonly=True) as ck:
        t, got = timed(lambda: ck.load(state))
    assert got == step, (got, step)
    f["amber_load_ro"] = t
    # resuming load (seeds the next delta's reference), then the first save after it:
    # once synchronous (durable), once overlapped (stall)
    for mode in ("durable", "stall"):
        drop_cache(files())
        with Checkpointer(store, policy=policy, full_every=1000, full_share=-1) as ck:
            t, got = timed(lambda: ck.load(state))
            assert got == step, (got, step)
            f.setdefault("_resume_loads", []).append(t)
            tr.grads()
            ck.timings["fence"] = 0.0
            tr.step()
            seed_wait = ck.timings["fence"]
            step += 1
            t0 = time.perf_counter()
            ck.save(step, state)
            t_call = time.perf_counter() - t0
            if mode == "durable":
                ck.wait()
                f["first_after_load"] = time.perf_counter() - t0 + seed_wait
            else:
                tr.grads()
                ck.timings["fence"] = 0.0
                ck.fence()
                f["first_after_load_stall"] = seed_wait + t_call + ck.timings["fence"]
                ck.wait()
            kind = {c.step: c for c in ck.steps()}[step].kind
            if kind != "delta":
                raise RuntimeError(f"the first save after a load was a {kind} checkpoint")
    f["amber_load"] = statistics.median(f.pop("_resume_loads"))
    shutil.rmtree(store)
    gc.collect()
    return f


def plain_round(out, r, policy, deltas, nbytes=int(0.58e9), parts=48):
    """A state of plain tensors that no optimizer owns (weights and two moments in
    dicts, `nbytes` in all), updated in place after each fence as an optimizer would;
    the stall of an overlapped delta save: save() + the fence after a stand-in for the
    forward and backward pass (gradients drawn at random). Returns {figure: value}."""
    n = nbytes // 4 // 3 // parts
    gen = torch.Generator().manual_seed(r)
    W = {f"w{i}": torch.randn(n, generator=gen) * 0.02 for i in range(parts)}
    M = {f"w{i}": torch.zeros(n) for i in range(parts)}
    V = {f"w{i}": torch.zeros(n) for i in range(parts)}
    G = {f"w{i}": torch.empty(n) for i in range(parts)}
    state = {"weights": W, "moments": {"exp_avg": M, "exp_avg_sq": V}}

    def grads():
        for g in G.values():
            g.normal_(0, 1e-4, generator=gen)

    def update():  # Adam's arithmetic, in place, after the fence
        with torch.no_grad():
            for k in W:
                M[k].mul_(0.9).add_(G[k], alpha=0.1)
                V[k].mul_(0.999).addcmul_(G[k], G[k], value=0.001)
                W[k].addcdiv_(M[k], V[k].sqrt().add_(1e-8), value=-1e-4)

    store = os.path.join(out, "plain")
    shutil.rmtree(store, ignore_errors=True)
    log(f"round {r}: amber on {parts * 3} plain tensors ({nbytes / 1e9:.2f} GB), {deltas} deltas")
    stalls, calls, cpu = [], [], []
    with Checkpointer(store, policy=policy, full_every=1000, full_share=-1) as ck:
        grads()
        update()
        ck.save(1, state, full=True)
        ck.wait()
        for step in range(2, 3 + deltas):
            grads()
            update()
            t0, c0 = time.perf_counter(), time.thread_time()
            ck.save(step, state)
            t_call, c_call = time.perf_counter() - t0, time.thread_time() - c0
            grads()  # the next forward and backward pass
            ck.timings["fence"] = 0.0
            ck.fence()
            if step > 2:  # the first delta after the full one makes the save plan
                stalls.append(t_call + ck.timings["fence"])
                calls.append(t_call)
                cpu.append(c_call)
            ck.wait()
        kinds = [c.kind for c in ck.steps()[1:]]
    if any(k != "delta" for k in kinds):
        raise RuntimeError(f"expected only deltas after the full save, got {kinds}")
    shutil.rmtree(store)
    del W, M, V, G, state
    gc.collect()
    return {"plain_stall": statistics.median(stalls), "plain_call": statistics.median(calls),
            "plain_call_cpu": statistics.median(cpu), "plain_bytes": 3 * parts * n * 4}


def ratios(f):
    """The targets' ratios within one round (> 1 is better unless said)."""
    fastest_peer = min(f["torch_save"], f["st_save"], f["dcp_save_t1"], f["dcp_save_t2"])
    dcp_save = min(f["dcp_save_t1"], f["dcp_save_t2"])
    return {
        "delta_vs_dcp_save": dcp_save / f["amber_delta"],
        "stall_vs_dcp_async": f["dcp_async_stall"] / f["amber_delta_stall"],
        "full_vs_fastest_peer": fastest_peer / f["amber_full"],
        "save_call_ms": 1e3 * f["amber_delta_call"],
        "save_cpu_ms": 1e3 * f["amber_delta_call_cpu"],
        "plain_stall_ms": 1e3 * f["plain_stall"],
        "load_vs_dcp_load": f["dcp_load"] / f["amber_load"],
        "load_ro_vs_dcp_load": f["dcp_load"] / f["amber_load_ro"],
        "load_over_floor": f["amber_load"] / f["load_floor"],
        "delta_over_floor": f["amber_delta"] / f["delta_floor"],
        "first_after_load_durable_x": f["first_after_load"] / f["amber_delta"],
        "first_after_load_stall_x": f["first_after_load_stall"] / f["amber_delta_stall"],
        "delta_pct_of_full": 100.0 * f["amber_delta_bytes_max"] / f["amber_full_bytes"],
    }


# (ratio, target, higher is better, text)
TARGETS = [
    ("delta_vs_dcp_save", 20.0, True, "delta save-to-durable >= 20x faster than dcp.save"),
    ("stall_vs_dcp_async", 50.0, True, "stall >= 50x smaller than dcp.async_save's"),
    ("save_cpu_ms", 1.0, False, "a delta's save() call: <= 1 ms of Python (its thread's CPU time)"),
    ("plain_stall_ms", 2.0, False, "stall of 0.58 GB of plain tensors (no optimizer) < 2 ms"),
    ("full_vs_fastest_peer", 1.0, True, "full save at least as fast as the fastest peer"),
    ("load_vs_dcp_load", 1.5, True, "load of the latest step >= 1.5x faster than dcp.load"),
    ("load_over_floor", 1.2, False, "load of the latest step within 1.2x of a cold read of its bytes"),
    ("delta_over_floor", 1.2, False, "delta save-to-durable within 1.2x of the run's floor"),
    ("first_after_load_durable_x", 2.0, False, "first save after a load: durable within 2x of a steady delta"),
    ("first_after_load_stall_x", 2.0, False, "first save after a load: stall within 2x of a steady delta"),
    ("delta_pct_of_full", 3.0, False, "each delta <= 3% of a full checkpoint"),
]


# The same-run bound of a target: the ratio that the floor itself shows.
BOUNDS = {"delta_vs_dcp_save": "floor_vs_dcp_save", "load_vs_dcp_load": "load_floor_vs_dcp_load"}


def report(res, markdown):
    S, R = res["figures"], res["ratios"]
    lines = []
    if markdown:
        lines += ["| save | seconds (median, min-max) | bytes |", "|---|---|---|"]
        rows = [("torch.save + fsync", "torch_save", "torch_bytes"),
                ("safetensors save_file + fsync", "st_save", "st_bytes"),
                ("dcp.save, 1 thread", "dcp_save_t1", "dcp_bytes"),
                ("dcp.save, 2 threads", "dcp_save_t2", "dcp_bytes"),
                ("dcp.async_save: stall (until staged)", "dcp_async_stall", None),
                ("dcp.async_save: durable", "dcp_async_durable", None),
                ("amber full save", "amber_full", "amber_full_bytes"),
                ("amber full save: stall", "amber_full_stall", None),
                (f"amber delta save ({res['config']['policy']})", "amber_delta", "amber_delta_bytes"),
                ("amber delta: stall", "amber_delta_stall", None),
                ("amber delta: its save() call", "amber_delta_call", None),
                ("amber delta: its save() call, CPU time of its thread", "amber_delta_call_cpu", None),
                ("amber delta of plain tensors, no optimizer: stall", "plain_stall", "plain_bytes"),
                ("amber delta of plain tensors: its save() call, CPU time of its thread",
                 "plain_call_cpu", None),
                ("amber first delta after a load", "first_after_load", None),
                ("amber first delta after a load: stall", "first_after_load_stall", None),
                ("delta floor (read live + reference, write delta at O_DIRECT pace)", "delta_floor", None)]
        for label, k, b in rows:
            lines.append(row([label, fmt(S[k]), fmt(S[b], 'B') if b else ''], True))
        lines += ["", "| load (cold, into the live model and optimizer) | seconds |", "|---|---|"]
        for label, k in [("torch.load + load_state_dict", "torch_load"),
                         ("safetensors load_file + copy", "st_load"),
                         ("dcp.load + set_state_dict", "dcp_load"),
                         ("amber load, resuming (seeds the next delta)", "amber_load"),
                         ("amber load, read-only", "amber_load_ro"),
                         ("floor: the latest step's files (full + deltas) read cold at the disk's pace", "load_floor")]:
            lines.append(row([label, fmt(S[k])], True))
        lines += TARGETS_HEAD + target_lines(TARGETS, R, True, (70, 28), BOUNDS)
        b = R["floor_vs_dcp_save"]
        lines.append(f"\nBound: the run's delta floor is {fmt(b, 'x')} faster than dcp.save; "
                     f"no delta save on this machine can show a larger ratio.")
        lines.append(f"Bound: reading the latest step's files cold at the disk's pace "
                     f"({fmt(S['load_bytes'], 'B')}) is {fmt(R['load_floor_vs_dcp_load'], 'x')} "
                     f"faster than dcp.load; no cold load of them can show a larger ratio (and one "
                     f"at the 1.2x of that floor that the load target allows: "
                     f"{fmt(R['load_floor_vs_dcp_load_12'], 'x')}).")
    else:
        for k, s in S.items():
            if k == "loadavg":
                continue
            unit = "B" if k.endswith("bytes") or k.endswith("bytes_max") else "s"
            lines.append(f"{k:28} {fmt(s, unit)}")
        lines.append("")
        lines += target_lines(TARGETS, R, False, (70, 28), BOUNDS)
        lines.append(f"{'bound: the delta floor against dcp.save':70} {fmt(R['floor_vs_dcp_save'], 'x')}")
        lines.append(f"{'bound: the cold read of the latest step against dcp.load':70} "
                     f"{fmt(R['load_floor_vs_dcp_load'], 'x')}")
        lines.append(f"{'bound: 1.2x that read against dcp.load':70} "
                     f"{fmt(R['load_floor_vs_dcp_load_12'], 'x')}")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.getcwd(), "bench-out"),
                    help="scratch directory (removed at the end)")
    ap.add_argument("--policy", default="lossy-compact",
                    help=f"amber's policy: a preset ({', '.join(list(PRESETS) + list(V1))}) or "
                         "rules separated by commas")
    ap.add_argument("--deltas", type=int, default=4, help="synchronous and overlapped deltas per round")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (the spread is over them)")
    add_run_args(ap)
    a = ap.parse_args()
    policy = policy_arg(a.policy)
    # Plain tensors have no learning rate: a rule in units of it keeps them exact
    # (every element, every delta); they are saved under the same rules with numbers
    # instead (v1-lossy-compact's), as a user of such a state would write them.
    plain_policy = list(V1["v1-lossy-compact"]) if have_units(rules(policy)) else policy
    if a.repeat < 1 or a.deltas < 1:
        ap.error("--repeat and --deltas must be >= 1")
    torch.set_num_threads(os.cpu_count() or 2)
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = quick_model() if a.quick else GPT2Small()
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    warm_up(model, opt, gen)
    tr = Trainer(model, opt, gen)
    config = {"params": nparams, "policy": a.policy, "lr": a.lr, "repeat": a.repeat,
              "deltas": a.deltas, "cpus": os.cpu_count(), "torch": torch.__version__,
              "amber": getattr(amber, "__version__", "?"), "machine": platform.machine(),
              "loadavg_start": os.getloadavg()[0]}
    log(f"state: {nparams / 1e6:.1f}M parameters + AdamW, policy {a.policy!r}, "
        f"{a.repeat} rounds, load average {config['loadavg_start']:.2f}")
    rounds = []
    try:
        for r in range(1, a.repeat + 1):
            f = peers(tr, a.out, r)
            f.update(amber_round(tr, a.out, r, policy, a.deltas))
            f.update(plain_round(a.out, r, plain_policy, a.deltas,
                                 nbytes=int(0.58e9) if not a.quick else 24 << 20))
            log(f"round {r}: bounds")
            f["read_floor"] = read_floor(state_tensors(model, opt))
            t_disk = direct_write(os.path.join(a.out, "direct.bin"), f["amber_full_bytes"])
            # without O_DIRECT (tmpfs), the floor counts the read only
            f["disk_rate"] = f["amber_full_bytes"] / t_disk if t_disk else math.inf
            f["delta_floor"] = f["read_floor"] + f["amber_delta_bytes"] / f["disk_rate"]
            f["loadavg"] = os.getloadavg()[0]
            rounds.append(f)
    finally:
        shutil.rmtree(a.out, ignore_errors=True)
    figures = spreads(rounds, skip=("disk_rate",))
    rs = [ratios(f) for f in rounds]
    for f, rr in zip(rounds, rs):
        rr["floor_vs_dcp_save"] = min(f["dcp_save_t1"], f["dcp_save_t2"]) / f["delta_floor"]
        rr["load_floor_vs_dcp_load"] = f["dcp_load"] / f["load_floor"]
        rr["load_floor_vs_dcp_load_12"] = f["dcp_load"] / (1.2 * f["load_floor"])
    res = {"config": config, "rounds": rounds, "figures": figures,
           "ratios": spreads(rs)}
    res["targets"] = target_records(TARGETS, res["ratios"], BOUNDS)
    emit(f"amber torch_bench: {nparams / 1e6:.1f}M parameters + AdamW, policy {a.policy!r}, "
         f"{a.repeat} round(s), {config['cpus']} CPUs, torch {torch.__version__}, "
         f"load average {config['loadavg_start']:.2f} -> {rounds[-1]['loadavg']:.2f}",
         report(res, a.markdown), res, a.json)


if __name__ == "__main__":
    main()
