#!/usr/bin/env python3
"""torch_bench.py - amber.torch against torch.save/torch.load on a GPT-2-small-sized
training state (124M parameters + AdamW moments and step counters, about 1.5 GB),
side by side in one run.

The state trains by AdamW steps on synthetic gradients (a forward/backward pass of
GPT-2 small takes seconds on a CPU and would not change what is measured: every
element of weights and moments moves at every step, as in real training). The
gradients have the size that GPT-2 training clips them to (global norm 1), and the
optimizer starts from the state it has after many steps on such gradients (step
1000; moments at their stationary statistics), not from the first steps' transient,
in which Adam's second moments change by large factors at each step. Between a save
and the next optimizer step the script draws the next gradients, which stands for
the forward and backward pass that a save overlaps with.

Measured, each as the median of several repetitions:
  - torch.save + fsync of the state: save-to-durable (= training stall), bytes;
  - amber full and delta saves: save-to-durable (save() + wait()), training stall
    (time in save() plus the fence in the next optimizer.step()), bytes;
  - load: torch.load (+ load_state_dict) against Checkpointer.load of the latest
    delta (its chain: a full checkpoint and the deltas after it), into the live
    model and optimizer. Both read cold files: the script drops them from the page
    cache first (posix_fadvise DONTNEED; amber writes with O_DIRECT anyway).
  - bounds: reading the state twice (a delta's scan reads the live state and the
    reference once) and writing a full checkpoint's bytes with O_DIRECT + fsync
    (the disk's pace); the ratios above cannot exceed torch.save's time over these.

    torch_bench.py [--out bench-out] [--policy lossy] [--deltas 5] [--lr 1e-4]
"""
import argparse
import gc
import glob
import mmap
import os
import shutil
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "python"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

from amber.torch import Checkpointer  # noqa: E402

LAYERS, D, VOCAB, CTX = 12, 768, 50257, 1024


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(D, 3 * D), "c_proj": nn.Linear(D, D)})
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(D, 4 * D), "c_proj": nn.Linear(4 * D, D)})


class GPT2Small(nn.Module):
    """GPT-2 small's parameters under GPT-2's names (the LM head is tied to wte)."""

    def __init__(self):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(CTX, D)
        self.h = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        with torch.no_grad():
            for n, p in self.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.02)


def fake_grads(model, gen):
    """Stands for forward + backward: fresh gradients for every parameter, of the
    size GPT-2 training clips them to (global norm 1.0: 1/sqrt(124M) per element)."""
    std = 1.0 / sum(p.numel() for p in model.parameters()) ** 0.5
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.normal_(0, std, generator=gen)


def warm_state(model, opt):
    """Sets AdamW's state to what many steps on fake_grads' gradients leave: step
    1000, first moments at the stationary spread of an EMA (beta 0.9) of the
    gradients, second moments near the gradients' variance."""
    std = 1.0 / sum(p.numel() for p in model.parameters()) ** 0.5
    b1, b2 = opt.defaults["betas"]
    for p in model.parameters():
        s = opt.state[p]
        s["step"].fill_(1000.0)
        s["exp_avg"].normal_(0, std * ((1 - b1) / (1 + b1)) ** 0.5)
        s["exp_avg_sq"].normal_(1, ((1 - b2) / (1 + b2)) ** 0.5).mul_(std * std)


def drop_cache(paths):
    """Drops the files' pages from the page cache, so the next read is cold."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2]


def torch_save(path, model, opt):
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def state_tensors(model, opt):
    """The tensors a checkpoint of the state holds (weights, moments)."""
    ts = [p.data for p in model.parameters()]
    for st in opt.state.values():
        ts += [v for v in st.values() if torch.is_tensor(v) and v.numel() > 1]
    return ts


def read_floor(tensors, reps=3):
    """Seconds to read the state twice (stands for the live state and the
    reference, which every delta's scan reads once): a sum over every tensor and
    over a copy of it, on all threads. No delta save can be faster than this."""
    copies = [t.clone() for t in tensors]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for t in tensors:
            t.sum()
        for t in copies:
            t.sum()
        times.append(time.perf_counter() - t0)
    del copies
    gc.collect()
    return median(times)


def direct_write(path, nbytes, piece=8 << 20, inflight=2, reps=3):
    """Seconds to write `nbytes` to a new file with O_DIRECT, `inflight` writes at
    once (as amber does), then fsync: the disk's own pace, which a full save of
    raw bytes cannot beat. None where the file system refuses O_DIRECT."""
    buf = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
    buf.write(bytes(range(256)) * (piece // 256))
    n = (nbytes + piece - 1) // piece
    times = []
    for _ in range(reps):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except (OSError, AttributeError):
            return None
        try:
            t0 = time.perf_counter()
            workers = [threading.Thread(target=lambda k: [os.pwrite(fd, buf, i * piece)
                                                          for i in range(k, n, inflight)],
                                        args=(k,)) for k in range(inflight)]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            os.fsync(fd)
            times.append(time.perf_counter() - t0)
        finally:
            os.close(fd)
            os.remove(path)
    return median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "bench-out"))
    ap.add_argument("--policy", default="lossy")
    ap.add_argument("--deltas", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--lr", type=float, default=1e-4)
    a = ap.parse_args()
    torch.set_num_threads(os.cpu_count() or 2)
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = GPT2Small()
    nparams = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.1)
    fake_grads(model, gen)
    opt.step()
    warm_state(model, opt)
    for _ in range(3):
        fake_grads(model, gen)
        opt.step()
    state = {"model": model, "optim": opt}
    print(f"state: {nparams / 1e6:.1f}M parameters + AdamW ({len(opt.state)} tensors x 3 state), "
          f"policy {a.policy!r}, lr {a.lr}, {os.cpu_count()} CPUs")

    # torch.save + fsync, torch.load
    tpath = os.path.join(a.out, "state.pt")
    t_save = [torch_save(tpath, model, opt) for _ in range(a.reps)]
    t_bytes = os.path.getsize(tpath)
    t_load, t_load_sd = [], []
    for _ in range(a.reps):
        drop_cache([tpath])
        t0 = time.perf_counter()
        sd = torch.load(tpath)
        t1 = time.perf_counter()
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])
        t_load.append(t1 - t0)
        t_load_sd.append(time.perf_counter() - t0)
        del sd
        gc.collect()
    os.remove(tpath)
    print(f"torch.save+fsync {median(t_save):.2f} s, {t_bytes / 1e9:.2f} GB; "
          f"torch.load {median(t_load):.2f} s (+ load_state_dict: {median(t_load_sd):.2f} s)")

    store = os.path.join(a.out, "store")
    step = 0
    full_durable, full_stall, delta_durable, delta_stall = [], [], [], []
    with Checkpointer(store, policy=a.policy, full_every=1000, full_share=-1) as ck:
        # full checkpoints: the first save of a writer, then forced ones
        for i in range(a.reps):
            step += 1
            t0 = time.perf_counter()
            ck.save(step, state, full=True)
            ck.wait()
            full_durable.append(time.perf_counter() - t0)
            fake_grads(model, gen)
            step += 1
            ck.timings["fence"] = 0.0
            opt.step()
            t0 = time.perf_counter()
            ck.save(step, state, full=True)
            t_call = time.perf_counter() - t0
            fake_grads(model, gen)  # the next forward/backward overlaps the save
            ck.timings["fence"] = 0.0
            opt.step()  # fences first
            full_stall.append(t_call + ck.timings["fence"])
            ck.wait()
        # deltas: alternately synchronous (save-to-durable) and overlapped (stall)
        step += 1
        ck.save(step, state, full=True)  # the chain's full checkpoint
        ck.wait()
        first_delta = step + 1
        for i in range(2 * a.deltas):
            fake_grads(model, gen)
            ck.timings["fence"] = 0.0
            opt.step()
            if i % 2 == 1:
                delta_stall.append(t_call + ck.timings["fence"])
                ck.wait()
            step += 1
            t0 = time.perf_counter()
            ck.save(step, state)
            t_call = time.perf_counter() - t0
            if i % 2 == 0:
                ck.wait()
                delta_durable.append(time.perf_counter() - t0)
        ck.wait()
        infos = {c.step: c for c in ck.steps()}
    deltas = [c.bytes for s, c in infos.items() if s >= first_delta]
    assert all(infos[s].kind == "delta" for s in infos if s >= first_delta)
    full_bytes = infos[first_delta - 1].bytes

    a_load = []
    for _ in range(a.reps):
        drop_cache(glob.glob(os.path.join(store, "*.amber")))
        with Checkpointer(store, readonly=True) as ck:
            t0 = time.perf_counter()
            got = ck.load(state)
            a_load.append(time.perf_counter() - t0)
        assert got == step
    gc.collect()

    ts, tl = median(t_save), median(t_load)
    rows = [
        ("torch.save + fsync", ts, ts, t_bytes, ""),
        ("amber full", median(full_durable), median(full_stall), full_bytes, ""),
        ("amber delta", median(delta_durable), median(delta_stall), median(deltas), ""),
    ]
    print()
    print(f"{'':22}{'save-to-durable':>16}{'stall':>12}{'bytes':>12}{'vs full':>9}"
          f"{'durable x':>11}{'stall x':>10}")
    for label, dur, stall, nbytes, _ in rows:
        print(f"{label:22}{dur:14.3f} s{stall:10.4f} s{nbytes / 1e6:10.1f}MB"
              f"{100 * nbytes / full_bytes:8.2f}%{ts / dur:10.1f}x{ts / stall:9.1f}x")
    print(f"{'largest delta':22}{'':28}{max(deltas) / 1e6:10.1f}MB{100 * max(deltas) / full_bytes:8.2f}%")
    print(f"\nload: torch.load {tl:.2f} s (+ load_state_dict {median(t_load_sd):.2f} s); "
          f"amber load of the latest delta into the live state {median(a_load):.2f} s "
          f"({tl / median(a_load):.1f}x faster than torch.load)")
    # What the machine allows, measured now: the floors of a delta and of a full save.
    t_read = read_floor(state_tensors(model, opt))
    t_disk = direct_write(os.path.join(a.out, "direct.bin"), full_bytes)
    print(f"bounds, same run: reading the state twice (live + reference, as every delta's "
          f"scan does) takes {t_read:.3f} s: no delta save can beat {ts / t_read:.1f}x "
          f"torch.save+fsync here")
    if t_disk:
        print(f"                  writing {full_bytes / 1e9:.2f} GB with O_DIRECT + fsync (the "
              f"disk's pace) takes {t_disk:.2f} s: no full save of raw bytes can beat "
              f"{ts / t_disk:.1f}x")
    targets = [("delta save-to-durable >= 25x faster", ts / median(delta_durable) >= 25),
               ("stall >= 100x smaller", ts / median(delta_stall) >= 100),
               ("full save >= 3x faster", ts / median(full_durable) >= 3),
               ("load >= 2x faster than torch.load", tl / median(a_load) >= 2),
               ("each delta <= 3% of a full", max(deltas) <= 0.03 * full_bytes)]
    print("targets: " + "; ".join(f"{t}: {'met' if ok else 'NOT met'}" for t, ok in targets))
    shutil.rmtree(a.out, ignore_errors=True)


if __name__ == "__main__":
    main()
