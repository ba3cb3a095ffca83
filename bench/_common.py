"""_common.py - what bench/torch_bench.py, dist_bench.py and gpu_bench.py share: the
training state (GPT-2 small + AdamW on synthetic gradients, torch_bench.py says why),
the same-run bounds (page cache, O_DIRECT pace, reading the state), the peers' timed
saves (torch.save, dcp.save, dcp.async_save), amber's steady deltas, the statistics
over rounds and their formatting, the targets (ratio, threshold, met) as text or
markdown rows and as JSON records, and the spawning of a group of ranks with a
deadline.

Not a script: the benches import it from their own folder. It imports no amber
module, so a bench may set amber's environment (AMBER_DEVICE_PATH) before it does.
"""
import gc
import glob
import json
import math
import mmap
import os
import signal
import statistics
import subprocess
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.tensor import DTensor


def logger(name):
    """A log(msg) that prints `[name] msg` to stderr."""
    def log(msg):
        print(f"[{name}] {msg}", file=sys.stderr, flush=True)
    return log


# ---------------------------------------------------------------- the state
class Block(nn.Module):
    def __init__(self, D):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.attn = nn.ModuleDict({"c_attn": nn.Linear(D, 3 * D), "c_proj": nn.Linear(D, D)})
        self.mlp = nn.ModuleDict({"c_fc": nn.Linear(D, 4 * D), "c_proj": nn.Linear(4 * D, D)})


class GPT2Small(nn.Module):
    """GPT-2 small's parameters under GPT-2's names (the LM head is tied to wte)."""

    def __init__(self, layers=12, D=768, vocab=50257, ctx=1024):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, D), nn.Embedding(ctx, D)
        self.h = nn.ModuleList(Block(D) for _ in range(layers))
        self.ln_f = nn.LayerNorm(D)
        with torch.no_grad():
            for n, p in self.named_parameters():
                if p.dim() >= 2:
                    p.normal_(0, 0.02)


def quick_model():
    """The small model of --quick (3.7M parameters: tests, smoke runs)."""
    return GPT2Small(2, 256, 8192, 256)


def local(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: a DTensor's local shard, else `t` itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def fake_grads(model, gen):
    """Stands for forward + backward: fresh gradients for every parameter, of the
    size GPT-2 training clips them to (global norm 1.0: 1/sqrt(124M) per element).
    A sharded parameter (FSDP2's DTensor) gets a DTensor gradient, filled on this
    rank's shard."""
    std = 1.0 / sum(p.numel() for p in model.parameters()) ** 0.5
    for p in model.parameters():
        if p.grad is None:
            g = torch.empty_like(local(p))
            p.grad = DTensor.from_local(g, p.device_mesh, p.placements, shape=p.shape,
                                        stride=p.stride(), run_check=False) \
                if isinstance(p, DTensor) else g
        local(p.grad).normal_(0, std, generator=gen)


def warm_state(model, opt, gen=None):
    """Sets AdamW's state to what many steps on fake_grads' gradients leave: step
    1000, first moments at the stationary spread of an EMA (beta 0.9) of the
    gradients, second moments near the gradients' variance."""
    std = 1.0 / sum(p.numel() for p in model.parameters()) ** 0.5
    b1, b2 = opt.defaults["betas"]
    with torch.no_grad():
        for p in model.parameters():
            s = opt.state[p]
            s["step"].fill_(1000.0)
            local(s["exp_avg"]).normal_(0, std * ((1 - b1) / (1 + b1)) ** 0.5, generator=gen)
            local(s["exp_avg_sq"]).normal_(1, ((1 - b2) / (1 + b2)) ** 0.5,
                                           generator=gen).mul_(std * std)


def warm_up(model, opt, gen, steps=3):
    """A first step (AdamW creates its state), warm_state, then `steps` more steps."""
    fake_grads(model, gen)
    opt.step()
    warm_state(model, opt, gen)
    for _ in range(steps):
        fake_grads(model, gen)
        opt.step()


class Trainer:
    """The training loop the benches checkpoint: fake_grads stands for forward and
    backward, then AdamW's step. `state` is what a Checkpointer saves."""

    def __init__(self, model, opt, gen):
        self.model, self.opt, self.gen = model, opt, gen
        self.state = {"model": model, "optim": opt}

    def grads(self):
        fake_grads(self.model, self.gen)

    def step(self):
        self.opt.step()

    def train(self):
        """One training step: gradients, then the optimizer."""
        self.grads()
        self.step()


def warm_trainer(a):
    """The benches' one-process trainer: GPT-2 small (or --quick's model) and AdamW at
    --lr, warmed up (warm_up), on every core."""
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 2)
    model = quick_model() if a.quick else GPT2Small()
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    gen = torch.Generator().manual_seed(1)
    warm_up(model, opt, gen)
    return Trainer(model, opt, gen)


def state_bytes(model, opt):
    """Bytes of the model's state dict and the optimizer's tensors."""
    n = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


def dcp_state(model, opt):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


# ---------------------------------------------------------------- files and bounds
def drop_cache(paths):
    """Drops the files' pages from the page cache, so the next read is cold."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def du(path):
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(f) for f in glob.glob(os.path.join(path, "**"), recursive=True)
               if os.path.isfile(f))


def read_floor(tensors, reps=3):
    """Seconds to read the state twice (stands for the live state and the
    reference, which every delta's scan reads once): a sum over every tensor and
    over a copy of it, on all threads. No delta save can be faster than this."""
    copies = [t.clone() for t in tensors]
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for t in tensors + copies:
            t.sum()
        times.append(time.perf_counter() - t0)
    del copies
    gc.collect()
    return statistics.median(times)


def _pieces(n, inflight, io):
    """io(k, i) for every piece i < n, on `inflight` threads (thread k: i = k mod inflight)."""
    workers = [threading.Thread(target=lambda k: [io(k, i) for i in range(k, n, inflight)],
                                args=(k,)) for k in range(inflight)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()


def _write_direct(path, nbytes, piece, inflight):
    """Seconds to write `nbytes` to a new file `path` with O_DIRECT, `inflight` writes
    at once, then fsync; the file stays. None where the file system refuses O_DIRECT."""
    buf = mmap.mmap(-1, piece)  # page-aligned, as O_DIRECT needs
    buf.write(bytes(range(256)) * (piece // 256))
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except (OSError, AttributeError):
        return None
    try:
        t0 = time.perf_counter()
        _pieces((nbytes + piece - 1) // piece, inflight, lambda k, i: os.pwrite(fd, buf, i * piece))
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def direct_write(path, nbytes, piece=8 << 20, inflight=2, reps=3):
    """Seconds to write `nbytes` to a new file with O_DIRECT, `inflight` writes at
    once (as amber does), then fsync: the disk's own pace, which a full save of
    raw bytes cannot beat. None where the file system refuses O_DIRECT."""
    times = []
    for _ in range(reps):
        try:
            t = _write_direct(path, nbytes, piece, inflight)
        finally:
            if os.path.exists(path):
                os.remove(path)
        if t is None:
            return None
        times.append(t)
    return statistics.median(times)


def direct_read(nbytes, dirpath, piece=8 << 20, inflight=2, reps=3):
    """Seconds to read `nbytes` of a file with O_DIRECT, `inflight` reads at once:
    the disk's read pace, which no load of a raw checkpoint of that size can beat
    (a cold load reads every byte from the disk). None without O_DIRECT."""
    path = os.path.join(dirpath, "direct-read.bin")
    n = (nbytes + piece - 1) // piece
    times = []
    try:
        if _write_direct(path, nbytes, piece, inflight) is None:
            return None
        for _ in range(reps):
            drop_cache([path])
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            bufs = [mmap.mmap(-1, piece) for _ in range(inflight)]
            try:
                t0 = time.perf_counter()
                _pieces(n, inflight, lambda k, i: os.preadv(fd, [bufs[k]], i * piece))
                times.append(time.perf_counter() - t0)
            finally:
                os.close(fd)
    finally:
        if os.path.exists(path):
            os.remove(path)
    return statistics.median(times)


def cold_read(paths, piece=8 << 20, inflight=2, reps=3):
    """Seconds to read the files `paths` whole, cold (dropped from the page cache
    first), in `piece`-byte reads with O_DIRECT (buffered where the file system
    refuses it), `inflight` at once: a cold read of exactly the bytes a load of those
    files reads, at the disk's pace, which no load of them can beat."""
    jobs = []  # (path, offset, length)
    for p in paths:
        size = os.path.getsize(p)
        jobs += [(p, o, min(piece, size - o)) for o in range(0, size, piece)]
    times = []
    for _ in range(reps):
        drop_cache(paths)
        bufs = [mmap.mmap(-1, piece) for _ in range(inflight)]  # page-aligned
        fds = {}
        for p in paths:
            fd = None
            try:
                fd = os.open(p, os.O_RDONLY | os.O_DIRECT)
                os.preadv(fd, [memoryview(bufs[0])[:4096]], 0)  # refused at read time?
            except OSError:
                if fd is not None:
                    os.close(fd)
                fd = os.open(p, os.O_RDONLY)
            fds[p] = fd

        def io(k, i):
            p, off, n = jobs[i]
            # whole blocks: the last read of a file stops short at its end
            os.preadv(fds[p], [memoryview(bufs[k])[:(n + 4095) & ~4095]], off)
        try:
            t0 = time.perf_counter()
            _pieces(len(jobs), inflight, io)
            times.append(time.perf_counter() - t0)
        finally:
            for fd in fds.values():
                os.close(fd)
    return statistics.median(times)


# ---------------------------------------------------------------- timed saves
def clock(dev=None):
    """time.perf_counter(), once the work queued on `dev` (a CUDA device) is done."""
    if dev is not None and dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter()


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def torch_save(path, model, opt, dev=None):
    """Seconds for torch.save of the model's and optimizer's state_dicts + fsync."""
    t0 = clock(dev)
    with open(path, "wb") as f:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
        f.flush()
        os.fsync(f.fileno())
    return time.perf_counter() - t0


def dcp_save(state, path, dev=None, **writer):
    """Seconds for dcp.save(state()) with FileSystemWriter(path, sync_files=True,
    **writer); the state dict's gathering (state()) counts."""
    t0 = clock(dev)
    dcp.save(state(), storage_writer=dcp.FileSystemWriter(path, sync_files=True, **writer))
    return time.perf_counter() - t0


def dcp_async_save(state, path, dev=None, **writer):
    """(stall, durable) of dcp.async_save(state()) with its default stager: the stall
    is until its staging has completed (the call returns after staging where staging
    is synchronous), durable when its future completes."""
    t0 = clock(dev)
    fut = dcp.async_save(state(), storage_writer=dcp.FileSystemWriter(path, sync_files=True, **writer))
    if isinstance(fut, dcp.state_dict_saver.AsyncSaveResponse):
        fut.staging_completion.result()
        fut = fut.upload_completion
    stall = time.perf_counter() - t0
    fut.result()
    return stall, time.perf_counter() - t0


def amber_full(ck, state, step):
    """Seconds for a full save through Checkpointer `ck` to be durable (save() + wait())."""
    t0 = time.perf_counter()
    ck.save(step, state, full=True)
    ck.wait()
    return time.perf_counter() - t0


def amber_deltas(ck, state, step, n, grads, opt_step, barrier=None, calls=None):
    """`n` delta saves through Checkpointer `ck` after step `step`, alternately
    synchronous (save() + wait(): save-to-durable) and overlapped (save() + the fence
    after the next gradients: the training thread's stall). Each is preceded by
    grads() and opt_step(), and barrier() where given. Returns (last step, [durable
    seconds], [stall seconds]); `calls`, when given, gets the overlapped saves' save()
    call alone: (seconds, seconds of the calling thread's CPU time: the work save()
    does, whether or not other processes took the core meanwhile)."""
    dur, stall = [], []
    for i in range(n):
        grads()
        opt_step()
        step += 1
        if barrier:
            barrier()
        t0, c0 = time.perf_counter(), time.thread_time()
        ck.save(step, state)
        t_call, c_call = time.perf_counter() - t0, time.thread_time() - c0
        if i % 2 == 0:
            ck.wait()
            dur.append(time.perf_counter() - t0)
        else:
            grads()
            ck.timings["fence"] = 0.0
            ck.fence()
            stall.append(t_call + ck.timings["fence"])
            if calls is not None:
                calls.append((t_call, c_call))
            ck.wait()
    return step, dur, stall


def delta_figures(dur, stall, dbytes):
    """The steady delta's figures: medians of save-to-durable, stall and bytes, the
    largest delta's bytes."""
    return {"amber_delta": statistics.median(dur), "amber_delta_stall": statistics.median(stall),
            "amber_delta_bytes": statistics.median(dbytes), "amber_delta_bytes_max": max(dbytes)}


# ---------------------------------------------------------------- statistics, formatting
def spread(xs):
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def spreads(rounds, skip=()):
    """{key: spread over the rounds} for every key of the first round but `skip`."""
    return {k: spread([f[k] for f in rounds]) for k in rounds[0] if k not in skip}


def fmt(s, unit="s"):
    """A spread as text: seconds ('s'), milliseconds ('ms'), a ratio ('x'), a
    percentage ('%') or MB ('B'); the median, and (min-max) over more than one round."""
    if unit == "B":
        return f"{s['median'] / 1e6:.1f} MB"
    v = {"s": lambda x: f"{x:.3f}" if x < 10 else f"{x:.2f}", "x": lambda x: f"{x:.2f}",
         "%": lambda x: f"{x:.2f}", "ms": lambda x: f"{x:.2f}"}[unit]
    tail = {"s": " s", "x": "x", "%": "%", "ms": " ms"}[unit]
    if s["n"] > 1:
        return f"{v(s['median'])}{tail} ({v(s['min'])}-{v(s['max'])})"
    return f"{v(s['median'])}{tail}"


def row(cells, markdown, widths=()):
    """A table row: markdown (| a | b |), or text with the first cells padded to `widths`."""
    if markdown:
        return "| " + " | ".join(cells) + " |"
    return " ".join([f"{c:{w}}" for c, w in zip(cells, widths)] + list(cells[len(widths):]))


def met(median, threshold, higher):
    return bool(median >= threshold if higher else median <= threshold)


# The markdown head of a targets table.
TARGETS_HEAD = ["", "| target | measured (median, min-max) | same-run bound | met |",
                "|---|---|---|---|"]


def unit_of(k):
    """How a ratio of the targets prints: a percentage (_pct_of_), milliseconds (_ms)
    or a ratio."""
    return "%" if "_pct_of_" in k else "ms" if k.endswith("_ms") else "x"


def target_lines(targets, ratios, markdown, widths, bounds=None):
    """A line per target (ratio, threshold, higher is better, text) whose ratio is
    in `ratios` ({ratio: spread}): its text, the measured spread, the same-run bound
    (`bounds`: {ratio: the ratio of the floor itself, in `ratios`}: the most any
    implementation could show on this machine in this run) and whether it is met;
    a target that the bound itself does not reach says so. A markdown row, or text in
    columns of `widths` (text, measured)."""
    lines = []
    for k, tgt, hi, text in targets:
        if k not in ratios:
            continue
        s = ratios[k]
        m = fmt(s, unit_of(k))
        b = (bounds or {}).get(k)
        bound = fmt(ratios[b], unit_of(k)) if b in ratios else ""
        ok = met(s["median"], tgt, hi)
        verdict = "met" if ok else "not met" if markdown else "NOT met"
        if not ok and b in ratios and not met(ratios[b]["median"], tgt, hi):
            verdict += " (above what the floor allows)"
        if markdown:
            lines.append(row([text, m, bound or "", verdict], True))
        else:
            lines.append(row([text, m, verdict + (f"; bound {bound}" if bound else "")],
                             False, widths))
    return lines


def target_records(targets, ratios, bounds=None, **extra):
    """The targets as JSON records: `extra` (e.g. ranks), target, ratio, threshold,
    met, and the same-run bound's median where there is one."""
    out = []
    for k, tgt, hi, text in targets:
        if k not in ratios:
            continue
        r = dict(extra, target=text, ratio=k, threshold=tgt, measured=ratios[k]["median"],
                 met=met(ratios[k]["median"], tgt, hi))
        b = (bounds or {}).get(k)
        if b in ratios:
            r["bound"] = ratios[b]["median"]
        out.append(r)
    return out


def write_json(path, res):
    with open(path, "w") as fh:
        json.dump(res, fh, indent=1, default=lambda x: None if x == math.inf else x)


def emit(head, report, res, json_path):
    """Prints the run's head line and report; writes `res` to json_path where given."""
    print(head)
    print(report)
    if json_path:
        write_json(json_path, res)


def add_run_args(ap):
    """The options --quick, --json, --markdown and --lr of torch_bench and dist_bench."""
    ap.add_argument("--quick", action="store_true", help="a small model (tests, smoke runs)")
    ap.add_argument("--json", help="write every figure of every round here")
    ap.add_argument("--markdown", action="store_true", help="print the tables as Markdown (docs/benchmarks.md)")
    ap.add_argument("--lr", type=float, default=1e-4)


# ---------------------------------------------------------------- a group of ranks
def run_group(cmds, timeout, env=None):
    """Runs the commands as processes, each in its own session, and waits for all of
    them until `timeout` seconds from now; kills the process group of any still
    running then. Returns their exit codes (negative: killed by that signal)."""
    procs = [subprocess.Popen(c, env=env, start_new_session=True) for c in cmds]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    return [p.returncode for p in procs]
