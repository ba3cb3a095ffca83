#!/usr/bin/env python3
"""demo_gpt.py - amber's main demo: train a small GPT, checkpoint every step, SIGKILL
the run again and again, resume it from amber each time in a new process, and compare.

A byte-level GPT (4 layers, d=256, context 128: about 3.3M parameters) trains on
CPU on real text the machine has, the Python standard library's sources, with
AdamW and a warm-up + cosine schedule; data batches are a function of the step, so
a resumed run sees what the uninterrupted one saw. Three runs:

  1. reference: uninterrupted, saving every step with the "lossy" preset; on every
     5th step it also waits for durability, and on every 10th it writes the same
     state with torch.save + fsync, to compare times and sizes in the same run;
  2. repeated failures, exact: the same run saving every step with the "exact"
     policy, SIGKILLed by this script every K steps (K = 20: 9 kills in 200 steps,
     whatever the process is doing then), each time resumed by a new process from
     the store the killed one was writing; it also measures the exact policy's
     save times;
  3. repeated failures, lossy: likewise with the "lossy" preset.

Then it prints a table (save-to-durable time, training stall and bytes of amber's
checkpoints against torch.save + fsync; final-loss differences of the resumed runs
against the uninterrupted one) and writes PNG plots to OUT (loss curves;
checkpoint bytes and times per step).

    demo_gpt.py [--out demo-out] [--steps 200] [--kill-every 20[,10...]]
    demo_gpt.py train ...        (one training process; used by the above)
"""
import argparse
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

LAYERS, D, HEADS, CTX, BATCH = 4, 256, 4, 128, 8
LR, WARMUP = 1e-3, 20
MEASURE_EVERY = 5   # wait for durability on these steps; torch.save on every second of them
EVAL_SEQS = 256


# ---- data and model ---------------------------------------------------------------

def corpus():
    """The Python standard library's sources as bytes: 95% to train, 5% held out."""
    stdlib = sysconfig.get_paths()["stdlib"]
    files = sorted(glob.glob(os.path.join(stdlib, "*.py")))
    data = bytearray(b"".join(open(p, "rb").read() for p in files))
    t = torch.frombuffer(data, dtype=torch.uint8)
    cut = int(len(t) * 0.95)
    return t[:cut], t[cut:], len(files)


def batch(data, seed, n):
    """n sequences at offsets drawn from `seed`: the data position is the step."""
    g = torch.Generator().manual_seed(seed)
    ix = torch.randint(len(data) - CTX - 1, (n,), generator=g)
    xy = torch.stack([data[i:i + CTX + 1] for i in ix.tolist()]).long()
    return xy[:, :-1], xy[:, 1:]


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.fc, self.out = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)
        self.drop = nn.Dropout(0.1)
        self.register_buffer("mask", torch.ones(CTX, CTX, dtype=torch.bool).triu(1),
                             persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, D // HEADS).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-1, -2)) * (D // HEADS) ** -0.5
        att = self.drop(att.masked_fill(self.mask[:t, :t], float("-inf")).softmax(-1))
        x = x + self.drop(self.proj((att @ v).transpose(1, 2).reshape(b, t, D)))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok, self.pos = nn.Embedding(256, D), nn.Embedding(CTX, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(D)
        self.head = nn.Linear(D, 256, bias=False)

    def forward(self, x):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))
        for blk in self.blocks:
            h = blk(h)
        return self.head(self.ln(h))


def loss_of(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))


def build(steps):
    torch.manual_seed(0)
    model = GPT()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))

    def lr_at(s):  # warm-up, then cosine to 10%
        if s < WARMUP:
            return (s + 1) / WARMUP
        return 0.1 + 0.45 * (1 + math.cos(math.pi * (s - WARMUP) / max(1, steps - WARMUP)))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    return model, opt, sched


def eval_loss(model, held, n=EVAL_SEQS):
    """Mean loss on n held-out sequences (the same ones for every run)."""
    model.eval()
    x, y = batch(held, 12345, n)
    with torch.no_grad():
        loss = sum(loss_of(model, x[i:i + 32], y[i:i + 32]).item() * len(x[i:i + 32])
                   for i in range(0, len(x), 32)) / len(x)
    model.train()
    return loss


# ---- one training process -----------------------------------------------------------

def train(a):
    from amber.torch import Checkpointer
    torch.set_num_threads(2)
    train_data, held, _ = corpus()
    model, opt, sched = build(a.steps)
    state = {"model": model, "optim": opt, "sched": sched, "extra": {"data_pos": 0}}
    # lossy stores take a full checkpoint only every 50 deltas (full_share off), so
    # that the restore after the kill goes through a long chain of deltas: the
    # worst case for a lossy policy
    cks = [Checkpointer(s, policy=p, full_share=-1 if p != "exact" else None)
           for s, p in zip(a.store, a.policy)]
    start = (cks[0].load(state) or 0) if a.resume else 0
    log = open(a.log, "a")
    log.write(json.dumps({"tag": a.tag, "start": start}) + "\n")
    print(f"[{a.tag}] " + (f"resumed from step {start}" if a.resume else "starting"), flush=True)
    tsave = os.path.join(a.torch_save, "state.pt") if a.torch_save else None
    for step in range(start + 1, a.steps + 1):
        x, y = batch(train_data, step, BATCH)
        t0 = time.perf_counter()
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for ck in cks:
            ck.timings["fence"] = 0.0
        opt.step()  # fences the previous step's save first, by itself
        sched.step()
        rec = {"step": step, "loss": loss.item(), "compute_s": time.perf_counter() - t0,
               "fence_s": sum(ck.timings["fence"] for ck in cks)}
        state["extra"]["data_pos"] = step
        t1 = time.perf_counter()
        for ck in cks:
            ck.save(step, state)
        rec["save_s"] = time.perf_counter() - t1
        if a.measure and (step % MEASURE_EVERY == 0 or step == start + 1):
            for ck in cks:
                ck.wait()
            rec["durable_s"] = time.perf_counter() - t1
            if tsave and step % (2 * MEASURE_EVERY) == 0:
                t2 = time.perf_counter()
                with open(tsave, "wb") as f:
                    torch.save({"model": model.state_dict(), "optim": opt.state_dict(),
                                "sched": sched.state_dict(), "rng": torch.get_rng_state(),
                                "extra": state["extra"]}, f)
                    f.flush()
                    os.fsync(f.fileno())
                rec["torch_save_s"] = time.perf_counter() - t2
                rec["torch_bytes"] = os.path.getsize(tsave)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        print(f"STEP {step}", flush=True)
        if step % 20 == 0 or step == a.steps:
            msg = f"[{a.tag}] step {step:4d}/{a.steps}  loss {rec['loss']:.4f}"
            msg += f"  amber save() {1e3 * rec['save_s']:.1f} ms"
            if "durable_s" in rec:
                msg += f", durable {1e3 * rec['durable_s']:.0f} ms"
            if "torch_save_s" in rec:
                msg += f"  | torch.save+fsync {1e3 * rec['torch_save_s']:.0f} ms"
            print(msg, flush=True)
    for ck in cks:
        ck.close()
    final = {"final_eval": eval_loss(model, held), "final_loss": rec["loss"]}
    log.write(json.dumps(final) + "\n")
    print(f"[{a.tag}] done: eval loss {final['final_eval']:.5f}", flush=True)


# ---- the multi-process part: 2 FSDP2 ranks (gloo), SIGKILLed, resumed by 1 and by 2 ----

def dtrain(a):
    """One rank of a distributed run: the demo's model under FSDP2 (fully_shard on
    CPU, gloo), each rank training on its share of the same global batch, saving every
    step with the distributed Checkpointer (exact policy)."""
    import datetime
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from amber.torch import Checkpointer
    torch.set_num_threads(1)
    rank, world = a.rank, a.world
    dist.init_process_group("gloo", init_method=f"file://{a.rendezvous}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    train_data, held, _ = corpus()
    model, opt, sched = build(a.steps)
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    # build() made the optimizer on the unsharded parameters: remake it on the DTensors
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    other = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": other, "weight_decay": 0.0}], lr=LR, betas=(0.9, 0.95))
    lr_at = sched.lr_lambdas[0]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    torch.manual_seed(1000 + rank)  # dropout: per rank
    state = {"model": model, "optim": opt, "sched": sched, "extra": {"data_pos": 0}}
    ck = Checkpointer(a.store[0], policy="exact", process_group=dist.group.WORLD)
    start = (ck.load(state) or 0) if a.resume else 0
    log = open(a.log, "a") if rank == 0 else None
    if log:
        log.write(json.dumps({"tag": a.tag, "start": start, "world": world}) + "\n")
        print(f"[{a.tag}] {world} rank(s): " + (f"resumed from step {start}" if a.resume
                                                else "starting"), flush=True)
    for step in range(start + 1, a.steps + 1):
        x, y = batch(train_data, step, BATCH)
        x, y = x[rank::world], y[rank::world]  # this rank's share of the global batch
        loss = loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        gl = loss.detach().clone()
        dist.all_reduce(gl)
        state["extra"]["data_pos"] = step
        ck.save(step, state)
        if log:
            log.write(json.dumps({"step": step, "loss": gl.item() / world}) + "\n")
            log.flush()
            print(f"STEP {step}", flush=True)
            if step % 20 == 0 or step == a.steps:
                print(f"[{a.tag}] step {step:4d}/{a.steps}  loss {gl.item() / world:.4f}",
                      flush=True)
    ck.close()
    ev = eval_loss(model, held)
    if log:
        log.write(json.dumps({"final_eval": ev, "final_loss": gl.item() / world}) + "\n")
        log.close()
        print(f"[{a.tag}] done: eval loss {ev:.5f}", flush=True)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)  # leave without tearing the gloo group down (see tests/python/dist_worker.py)


def dchild(out, tag, store, steps, world, resume=False, kill_at=0, timeout=240):
    """Runs a `world`-rank job; SIGKILLs all its ranks after rank 0 reports step
    `kill_at`. Returns True when it finished, False when killed."""
    import tempfile
    log = os.path.join(out, f"{tag}.jsonl")
    rdv = tempfile.mktemp(prefix="amber-demo-rdv-")
    procs = []
    for r in range(world):
        cmd = [sys.executable, os.path.abspath(__file__), "dtrain", "--tag", tag, "--log", log,
               "--store", store, "--policy", "exact", "--steps", str(steps),
               "--rank", str(r), "--world", str(world), "--rendezvous", rdv] + \
            (["--resume"] if resume else [])
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE if r == 0 else
                                      subprocess.DEVNULL, text=True, bufsize=1))
    deadline = time.time() + timeout
    killed = False
    try:
        for line in procs[0].stdout:
            if time.time() > deadline:
                raise RuntimeError("timeout")
            if line.startswith("STEP "):
                if kill_at and int(line.split()[1]) >= kill_at:
                    for p in procs:
                        os.kill(p.pid, signal.SIGKILL)
                    print(f"[{tag}] SIGKILL of all {world} ranks after step {line.split()[1]} "
                          f"began saving", flush=True)
                    killed = True
                    break
                continue
            print(line, end="", flush=True)
        rcs = [p.wait(timeout=max(1, deadline - time.time())) for p in procs]
    except BaseException:
        for p in procs:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGKILL)
                p.wait()
        raise
    finally:
        if os.path.exists(rdv):
            os.remove(rdv)
    if not killed and any(rcs):
        sys.exit(f"demo: distributed job {tag} failed ({rcs})")
    return not killed


def distributed(out, steps, kill_at):
    """The multi-process part: returns the logs of its runs by tag."""
    for name in os.listdir(out):
        if name.startswith("dist"):
            p = os.path.join(out, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    ref, st = os.path.join(out, "dist-ref"), os.path.join(out, "dist-exact")
    print(f"\n== D1. 2 FSDP2 ranks (gloo), {steps} steps, uninterrupted, exact policy ==")
    dchild(out, "dist-2r", ref, steps, 2)
    print(f"\n== D2. the same 2-rank job SIGKILLed (all ranks) after step {kill_at} ==")
    dchild(out, "dist-killed", st, steps, 2, kill_at=kill_at)
    logs = {}
    for world in (2, 1):
        s2 = os.path.join(out, f"dist-exact-{world}r")
        shutil.copytree(st, s2)
        print(f"\n== D{5 - world}. resumed from that store by {world} rank(s), trained to "
              f"step {steps} ==")
        shutil.copy(os.path.join(out, "dist-killed.jsonl"),
                    os.path.join(out, f"dist-resume-{world}r.jsonl"))
        dchild(out, f"dist-resume-{world}r", s2, steps, world, resume=True)
    for tag in ("dist-2r", "dist-resume-2r", "dist-resume-1r"):
        logs[tag] = [json.loads(x) for x in open(os.path.join(out, f"{tag}.jsonl"))]
    return logs


def report_dist(logs, steps):
    fin = lambda log: next(r for r in log if "final_eval" in r)  # noqa: E731
    base = fin(logs["dist-2r"])
    print(f"\n== fidelity, many ranks: 2 FSDP2 ranks, SIGKILLed, resumed by 2 and by 1 rank, "
          f"trained to step {steps} (exact) ==")
    print(f"{'run':32}{'from':>8}{'final eval loss':>17}{'vs 2-rank run':>18}"
          f"{'last train loss':>17}")
    print(f"{'2 ranks, uninterrupted':32}{'-':>8}{base['final_eval']:17.6f}{'':>18}"
          f"{base['final_loss']:17.6f}")
    for tag, label in (("dist-resume-2r", "killed, resumed by 2 ranks"),
                       ("dist-resume-1r", "killed, resumed by 1 rank")):
        log = logs[tag]
        f = fin(log)
        frm = [r["start"] for r in log if "start" in r][-1]
        d = 100 * (f["final_eval"] - base["final_eval"]) / base["final_eval"]
        same = f["final_eval"] == base["final_eval"] and f["final_loss"] == base["final_loss"]
        print(f"{label:32}{frm:>8}{f['final_eval']:17.6f}{d:+17.4f}%{f['final_loss']:17.6f}"
              + ("   bit-identical" if same else ""))
    print("  (1 rank: the same global batch and state, but its gradients are summed in another"
          " order and its dropout RNG is rank 0's: close, not bit-identical)")


# ---- the orchestrating script -------------------------------------------------------

def child(out, tag, args, kill_at=0):
    """Runs one training process, echoing its progress; SIGKILLs it after it
    reports step `kill_at`. Returns True when it finished, False when killed."""
    log = os.path.join(out, f"{tag}.jsonl")
    cmd = [sys.executable, os.path.abspath(__file__), "train", "--tag", tag, "--log", log] + args
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, bufsize=1)
    for line in p.stdout:
        if line.startswith("STEP "):
            if kill_at and int(line.split()[1]) >= kill_at:
                os.kill(p.pid, signal.SIGKILL)
                print(f"[{tag}] SIGKILL after step {line.split()[1]} began saving", flush=True)
                p.wait()
                return False
            continue
        print(line, end="", flush=True)
    rc = p.wait()
    if rc != 0:
        sys.exit(f"demo: training process {tag} failed ({rc})")
    return True


def repeated(out, tag, args, steps, every):
    """Trains to `steps`, SIGKILLing the process after it reports each multiple of
    `every` (0: never) and resuming it in a new one. Returns the log records."""
    kill_at, resume = every, []
    while not child(out, tag, args + resume, kill_at if every and kill_at < steps else 0):
        kill_at, resume = kill_at + every, ["--resume"]
    return [json.loads(x) for x in open(os.path.join(out, f"{tag}.jsonl"))]


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def store_sizes(path):
    from amber import Store
    with Store(path, readonly=True) as st:
        return {c.step: (c.kind, c.bytes) for c in st.list()}


def report(out, logs, stores, steps, kills):
    ref, rex = logs["reference"], logs[f"exact-k{kills[0]}"]
    recs = lambda log: [r for r in log if "step" in r]  # noqa: E731
    exact_sizes, lossy_sizes = store_sizes(stores[f"exact-k{kills[0]}"]), store_sizes(stores["ref"])

    def rows(log, sizes):
        """(kind, durable, stall, bytes) per step; stall = save() + next fence."""
        rs = recs(log)
        out = []
        for i, r in enumerate(rs):
            nxt = rs[i + 1]["fence_s"] if i + 1 < len(rs) and rs[i + 1]["step"] > r["step"] else 0.0
            kind, nbytes = sizes.get(r["step"], ("?", 0))
            out.append((r["step"], kind, r.get("durable_s"), r["save_s"] + nxt, nbytes,
                        "durable_s" in r))
        return out

    def line(label, rr, kind):
        sel = [x for x in rr if x[1] == kind]
        dur = median([x[2] for x in sel if x[2] is not None])
        stall = median([x[3] for x in sel if not x[5]])
        nbytes = median([x[4] for x in sel])
        return label, dur, stall, nbytes, len(sel)

    ts = [r for r in recs(ref) if "torch_save_s" in r]
    tsave, tbytes = median([r["torch_save_s"] for r in ts]), median([r["torch_bytes"] for r in ts])
    lossy_rows, exact_rows = rows(ref, lossy_sizes), rows(rex, exact_sizes)
    table = [("torch.save + fsync", tsave, tsave, tbytes, len(ts)),
             line("amber full (exact)", exact_rows, "full"),
             line("amber delta, exact", exact_rows, "delta"),
             line("amber full (lossy preset)", lossy_rows, "full"),
             line("amber delta, lossy preset", lossy_rows, "delta")]
    full_bytes = median([b for k, b in lossy_sizes.values() if k == "full"])
    ms = lambda s: "-" if s != s else f"{1e3 * s:9.1f} ms"  # noqa: E731
    print()
    print("== checkpoint cost per step: amber vs torch.save + fsync of the same state ==")
    print(f"{'':28}{'save-to-durable':>16}{'training stall':>16}{'bytes':>12}{'vs full':>9}"
          f"{'vs torch':>10}{'n':>5}")
    for label, dur, stall, nbytes, n in table:
        rel = f"{100 * nbytes / full_bytes:7.2f}%" if nbytes == nbytes and full_bytes else "-"
        speed = f"{tsave / stall:8.0f}x" if stall == stall and stall > 0 and label[0] == "a" else ""
        print(f"{label:28}{ms(dur):>16}{ms(stall):>16}{nbytes / 1e6:10.2f}MB{rel:>9}"
              f"{speed:>10}{n:5d}")
    print("  (medians; save-to-durable sampled every 5th step and at each process' first save;")
    print("   stall = time in ck.save() plus the fence before the next optimizer.step();")
    print("   'vs torch' = torch.save+fsync time / amber stall)")

    fin = lambda log: next(r for r in log if "final_eval" in r)  # noqa: E731
    base = fin(ref)
    print()
    print(f"== fidelity: SIGKILLed every K steps, each time resumed in a new process from the "
          f"store, trained to step {steps} ==")
    print(f"{'run':32}{'resumes':>8}{'final eval loss':>17}{'vs uninterrupted':>18}"
          f"{'last train loss':>17}")
    print(f"  (eval loss: {EVAL_SEQS} held-out sequences of {CTX} bytes)")
    print(f"{'uninterrupted (reference)':32}{'-':>8}{base['final_eval']:17.6f}{'':>18}"
          f"{base['final_loss']:17.6f}")
    result = {}
    for k in kills:
        for policy in ("exact", "lossy"):
            log = logs[f"{policy}-k{k}"]
            f = fin(log)
            d = 100 * (f["final_eval"] - base["final_eval"]) / base["final_eval"]
            same = f["final_eval"] == base["final_eval"] and f["final_loss"] == base["final_loss"]
            label = f"every {k} steps, {policy}" + (" preset" if policy == "lossy" else "")
            result[label] = d
            starts = [r["start"] for r in log if "start" in r][1:]
            print(f"{label:32}{len(starts):>8}{f['final_eval']:17.6f}{d:+17.4f}%"
                  f"{f['final_loss']:17.6f}" + ("   bit-identical" if same else ""))
    froms = ", ".join(str(r["start"]) for r in rex if "start" in r and r["start"])
    print(f"  (the exact run with K={kills[0]} resumed from steps {froms}: a kill while a step's"
          f" save is in flight resumes from the step before)")
    plots(out, logs, exact_sizes, lossy_sizes, ts, kills[0])
    return result


def plots(out, logs, exact_sizes, lossy_sizes, ts, every):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax, dx) = plt.subplots(2, 1, figsize=(9, 7), sharex=True,
                                 gridspec_kw={"height_ratios": [2, 1]})
    styles = {"reference": ("uninterrupted", "k", 2.5),
              f"exact-k{every}": (f"killed every {every} steps, exact", "tab:blue", 1),
              f"lossy-k{every}": (f"killed every {every} steps, lossy preset", "tab:orange", 1)}
    for tag, (label, color, width) in styles.items():
        rs = {r["step"]: r["loss"] for r in logs[tag] if "step" in r}  # the last of a redone step
        ax.plot(sorted(rs), [rs[s] for s in sorted(rs)], color=color, lw=width, label=label,
                alpha=0.8)
    ref = {r["step"]: r["loss"] for r in logs["reference"] if "step" in r}
    for tag in list(styles)[1:]:
        label, color, _ = styles[tag]
        rs = {r["step"]: r["loss"] for r in logs[tag] if "step" in r and r["step"] in ref}
        dx.plot(sorted(rs), [rs[s] - ref[s] for s in sorted(rs)], color=color, lw=1, label=label)
    for tag, label, color in (("dist-2r", "2 FSDP2 ranks, uninterrupted", "tab:green"),
                              ("dist-resume-2r", "2 ranks, killed, resumed by 2", "tab:red"),
                              ("dist-resume-1r", "2 ranks, killed, resumed by 1", "tab:purple")):
        if tag in logs:
            rs = {r["step"]: r["loss"] for r in logs[tag] if "step" in r}
            ax.plot(sorted(rs), [rs[s] for s in sorted(rs)], color=color, lw=1, label=label,
                    ls="--" if tag != "dist-2r" else "-", alpha=0.8)
            if tag != "dist-2r":
                base = {r["step"]: r["loss"] for r in logs["dist-2r"] if "step" in r}
                ss = sorted(x for x in rs if x in base)
                dx.plot(ss, [rs[x] - base[x] for x in ss], color=color, lw=1,
                        label=label + " (vs 2-rank run)")
    starts = [r["start"] for r in logs[f"lossy-k{every}"] if "start" in r][1:]
    for a in (ax, dx):
        for s in starts:
            a.axvline(s, color="gray", ls="--", lw=0.6)
    ax.text(starts[0] if starts else 0, ax.get_ylim()[1], " SIGKILL + resume", va="top",
            color="gray", fontsize=8)
    dx.set_xlabel("step")
    dx.set_ylabel("loss - uninterrupted")
    dx.legend(fontsize=8)
    ax.set_ylabel("training loss (nats/byte)")
    ax.set_title("byte-level GPT on the Python standard library, checkpointed every step")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "loss.png"), dpi=110)
    plt.close(fig)

    fig, (a1, a2) = plt.subplots(2, 1, figsize=(9, 8), sharex=True)
    for sizes, label, color in ((exact_sizes, "amber, exact", "tab:blue"),
                                (lossy_sizes, "amber, lossy preset", "tab:orange")):
        steps = sorted(sizes)
        a1.scatter(steps, [sizes[s][1] / 1e6 for s in steps], s=8, color=color, label=label)
    if ts:
        a1.axhline(median([r["torch_bytes"] for r in ts]) / 1e6, color="k", ls="--",
                   label="torch.save")
    a1.set_yscale("log")
    a1.set_ylabel("checkpoint size (MB)")
    a1.legend()
    for tag, label, color in (("reference", "lossy preset", "tab:orange"),
                              (f"exact-k{every}", "exact", "tab:blue")):
        rs = [r for r in logs[tag] if "step" in r]
        stall = [(r["step"], 1e3 * (r["save_s"] + (rs[i + 1]["fence_s"] if i + 1 < len(rs) else 0)))
                 for i, r in enumerate(rs) if "durable_s" not in r]
        a2.scatter([s for s, _ in stall], [v for _, v in stall], s=6, color=color,
                   label=f"amber stall, {label}")
        dur = [(r["step"], 1e3 * r["durable_s"]) for r in rs if "durable_s" in r]
        a2.plot([s for s, _ in dur], [v for _, v in dur], "o-", color=color, ms=4, lw=1,
                label=f"amber save-to-durable, {label}")
    if ts:
        a2.plot([r["step"] for r in ts], [1e3 * r["torch_save_s"] for r in ts], "s-", color="k",
                ms=4, lw=1, label="torch.save + fsync")
    a2.set_yscale("log")
    a2.set_ylabel("time per checkpoint (ms)")
    a2.set_xlabel("step")
    a2.legend(fontsize=7, ncol=3, loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.tight_layout()
    fig.savefig(os.path.join(out, "checkpoints.png"), dpi=110)
    plt.close(fig)
    print(f"\nplots: {os.path.join(out, 'loss.png')}, {os.path.join(out, 'checkpoints.png')}")


def main():
    if len(sys.argv) > 1 and sys.argv[1] in ("train", "dtrain"):
        ap = argparse.ArgumentParser()
        ap.add_argument("mode")
        ap.add_argument("--store", action="append", required=True)
        ap.add_argument("--policy", action="append", required=True)
        ap.add_argument("--steps", type=int, required=True)
        ap.add_argument("--resume", action="store_true")
        ap.add_argument("--measure", action="store_true")
        ap.add_argument("--torch-save", default="")
        ap.add_argument("--tag", required=True)
        ap.add_argument("--log", required=True)
        ap.add_argument("--rank", type=int, default=0)
        ap.add_argument("--world", type=int, default=1)
        ap.add_argument("--rendezvous", default="")
        a = ap.parse_args()
        return dtrain(a) if a.mode == "dtrain" else train(a)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "demo-out"))
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--kill-every", default="20",
                    help="K[,K...]: a repeated-failure run per K and policy "
                         "(the first K is plotted)")
    ap.add_argument("--dist-steps", type=int, default=60,
                    help="steps of the multi-process part (0: skip it)")
    ap.add_argument("--dist-kill", type=int, default=0, help="its kill step (default: half)")
    ap.add_argument("--dist-only", action="store_true")
    a = ap.parse_args()
    kills = [int(k) for k in a.kill_every.split(",") if k]
    t0 = time.time()
    out = os.path.abspath(a.out)
    for name in os.listdir(out) if os.path.isdir(out) else ():
        if name.endswith(".jsonl") or name in ("ref", "exact", "lossy", "torch") or \
                name.startswith(("exact-k", "lossy-k")):
            p = os.path.join(out, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
    os.makedirs(os.path.join(out, "torch"), exist_ok=True)
    train_data, held, nfiles = corpus()
    nparams = sum(p.numel() for p in GPT().parameters())
    print(f"data: {nfiles} files of {sysconfig.get_paths()['stdlib']}, {len(train_data) / 1e6:.1f} MB "
          f"to train, {len(held) / 1e6:.2f} MB held out")
    print(f"model: byte-level GPT, {LAYERS} layers, d={D}, context {CTX}, {nparams / 1e6:.2f}M "
          f"parameters; AdamW; batch {BATCH}; {a.steps} steps; a checkpoint every step")
    # the first K's stores are the ones scripts/demo's CLI part works on
    stores = {"ref": os.path.join(out, "ref")}
    for i, k in enumerate(kills):
        for policy in ("exact", "lossy"):
            stores[f"{policy}-k{k}"] = os.path.join(out, policy if i == 0 else f"{policy}-k{k}")
    n = ["--steps", str(a.steps)]
    logs = {}
    if a.dist_only:
        dl = distributed(out, a.dist_steps, a.dist_kill or a.dist_steps // 2)
        report_dist(dl, a.dist_steps)
        return
    print("\n== 1. uninterrupted reference run (lossy preset; torch.save+fsync every 10th step) ==")
    logs["reference"] = repeated(out, "reference", n + ["--store", stores["ref"], "--policy",
                                                        "lossy", "--measure", "--torch-save",
                                                        os.path.join(out, "torch")], a.steps, 0)
    run = 2
    for k in kills:
        for policy in ("exact", "lossy"):
            tag = f"{policy}-k{k}"
            print(f"\n== {run}. the same run with the {policy} policy, SIGKILLed every {k} steps "
                  f"and resumed from its store in a new process ==")
            run += 1
            extra = ["--measure"] if policy == "exact" and k == kills[0] else []
            logs[tag] = repeated(out, tag, n + ["--store", stores[tag], "--policy", policy] + extra,
                                 a.steps, k)
    if a.dist_steps:
        logs.update(distributed(out, a.dist_steps, a.dist_kill or a.dist_steps // 2))
    report(out, logs, stores, a.steps, kills)
    if a.dist_steps:
        report_dist(logs, a.dist_steps)
    shutil.rmtree(os.path.join(out, "torch"), ignore_errors=True)
    print(f"\ndemo training finished in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
