#!/usr/bin/env python3
"""gpu_bench.py - amber's accelerator path (amber.device) against torch.save and DCP,
with the training state on the device: what crosses to the host per save, how long
training stalls, how long until the save is durable, and how big it is.

The state is GPT-2 small (124M parameters, --size 124m) or a 0.5B-parameter model of
the same shape (--size 0.5b: 24 layers of width 1280), with AdamW, on the GPU when
there is one. Training is AdamW steps on synthetic gradients of GPT-2's clipped size,
from a warmed optimizer state (bench/torch_bench.py explains why).

Rows:
  - amber delta: the steady delta (median of --deltas): bytes copied device-to-host
    (only the selection), stall = the save() call (the selection and its copy) + the
    fence at the next optimizer step, save-to-durable = save() + wait(), file size;
  - amber full: every byte crosses (through reused host buffers);
  - torch.save of model and optimizer state_dicts (its copy to host included) + fsync;
  - dcp.save (FileSystemWriter, sync_files) and dcp.async_save (stall: until its
    staging has completed, which is when it returns with a synchronous stager;
    durable: its future);
  - the full device-to-host copy of the state, the yardstick of the stall target.
Targets on a GPU (issue 15): bytes copied per delta <= 3% of the state; a delta's stall
<= 5% of the full copy; delta save-to-durable >= 25x faster than torch.save.

On a CPU it runs the same path with AMBER_DEVICE_PATH=1 (set here when absent), so it
prints the same table for CPU tensors; there "device-to-host" means the copy out of
the tensors' memory into amber's buffers. AMBER_DEVICE_ASYNC=1 selects on a thread
while the next step computes (the stall is then the wait at the fence);
AMBER_CUDA_KERNEL=1 uses libamber_cuda's fused kernel (every policy).

    gpu_bench.py [--size 124m|0.5b] [--policy lossy-compact] [--deltas 4] [--quick] [--out DIR]
                 [--threads N]
"""
import argparse
import os
import shutil
import statistics
import sys
import time

os.environ.setdefault("AMBER_DEVICE_PATH", "1")  # before amber.torch decides per tensor

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import (GPT2Small, clock, dcp_async_save, dcp_save, dcp_state, du,  # noqa: E402
                     fake_grads, logger, quick_model, torch_save, warm_up)

from amber.torch import Checkpointer  # noqa: E402

SIZES = {"124m": (12, 768), "0.5b": (24, 1280)}

log = logger("gpu_bench")


def state_bytes(model, opt):
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(v.numel() * v.element_size() for v in st.values() if torch.is_tensor(v))
    return n


def full_copy(model, opt, dev):
    """A plain copy of the whole state to host memory (pageable, as torch.save's)."""
    ts = [p.data for p in model.parameters()]
    for st in opt.state.values():
        ts += [v for v in st.values() if torch.is_tensor(v)]
    t0 = clock(dev)
    host = [t.to("cpu", copy=True) for t in ts]
    t = clock(dev) - t0
    del host
    return t


def dcp_runs(out, model, opt, dev):
    """{name: (stall, durable, size)} of dcp.save and dcp.async_save."""
    r = {}
    path = os.path.join(out, "dcp")
    t = dcp_save(lambda: dcp_state(model, opt), path, dev)
    r["dcp.save"] = (t, t, du(path))
    shutil.rmtree(path)
    stall, durable = dcp_async_save(lambda: dcp_state(model, opt), path, dev)
    r["dcp.async_save"] = (stall, durable, du(path))
    shutil.rmtree(path)
    return r


def amber_runs(out, model, opt, gen, dev, policy, deltas):
    """(full, [deltas]) as (copied bytes, stall, durable, size) each."""
    path = os.path.join(out, "amber")
    state = {"model": model, "optim": opt}
    with Checkpointer(path, policy=policy, rng=False, full_every=1000, full_share=-1) as ck:
        t0 = clock(dev)
        ck.save(1, state, full=True)
        ck.fence()
        t1 = time.perf_counter()
        ck.wait()
        full = (ck._saver.dev.copied, t1 - t0, time.perf_counter() - t0, ck.steps()[-1].bytes)
        rows = []
        for step in range(2, deltas + 2):
            fake_grads(model, gen)
            opt.step()  # fences the previous save first
            t0 = clock(dev)
            ck.save(step, state)
            t1 = time.perf_counter()
            fake_grads(model, gen)  # stands for the next forward and backward pass
            t2 = clock(dev)
            ck.fence()
            t3 = time.perf_counter()
            ck.wait()
            t4 = time.perf_counter()
            info = ck.steps()[-1]
            assert info.kind == "delta", f"step {step} was {info.kind}"
            # durable = the save's own time: the call, its fence and its wait
            rows.append((ck._saver.dev.copied, (t1 - t0) + (t3 - t2), (t1 - t0) + (t4 - t2), info.bytes))
    shutil.rmtree(path)
    return full, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="124m")
    ap.add_argument("--policy", default="lossy-compact")
    ap.add_argument("--deltas", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="a small model (smoke runs)")
    ap.add_argument("--out", default=os.path.join(os.getcwd(), "gpu-bench-out"))
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2,
                    help="torch's CPU threads (fewer on a machine shared with other jobs)")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.set_num_threads(a.threads)
    shutil.rmtree(a.out, ignore_errors=True)
    os.makedirs(a.out)
    torch.manual_seed(0)
    layers, width = SIZES[a.size]
    with torch.device(dev):
        model = quick_model() if a.quick else GPT2Small(layers, width)
    gen = torch.Generator(device=dev).manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    warm_up(model, opt, gen)
    nparams = sum(p.numel() for p in model.parameters())
    total = state_bytes(model, opt)
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else \
        f"CPU ({os.cpu_count()} cores), AMBER_DEVICE_PATH={os.environ['AMBER_DEVICE_PATH']}"
    log(f"{nparams / 1e6:.0f}M parameters + AdamW ({total / 1e9:.2f} GB) on {where}")
    try:
        t_copy = full_copy(model, opt, dev)
        log("torch.save")
        t_ts = torch_save(os.path.join(a.out, "state.pt"), model, opt, dev)
        ts_size = os.path.getsize(os.path.join(a.out, "state.pt"))
        os.remove(os.path.join(a.out, "state.pt"))
        log("dcp")
        peers = dcp_runs(a.out, model, opt, dev)
        log("amber")
        full, rows = amber_runs(a.out, model, opt, gen, dev, a.policy, a.deltas)
    finally:
        shutil.rmtree(a.out, ignore_errors=True)
    med = [statistics.median(r[i] for r in rows) for i in range(4)]
    modes = ", ".join(f"{k}={os.environ[k]}" for k in ("AMBER_DEVICE_ASYNC", "AMBER_CUDA_KERNEL",
                                                        "AMBER_DEVICE_REFERENCE")
                      if os.environ.get(k))
    print(f"amber gpu_bench: {nparams / 1e6:.0f}M parameters + AdamW, {total / 1e9:.2f} GB, "
          f"on {where}, policy {a.policy!r}, torch {torch.__version__}"
          + (f", {modes}" if modes else ""))
    print(f"{'':28}{'copied to host':>16}{'stall s':>10}{'durable s':>11}{'size':>11}")

    def row(name, copied, stall, durable, size):
        print(f"{name:28}{copied / 1e6:13.1f} MB{stall:10.3f}{durable:11.3f}"
              f"{size / 1e6:8.1f} MB")
    row(f"amber delta (median of {len(rows)})", *med)
    row("amber full", *full)
    row("torch.save (+ fsync)", total, t_ts, t_ts, ts_size)
    for name, (stall, durable, size) in peers.items():
        row(name, total, stall, durable, size)
    print(f"{'full copy to host':28}{total / 1e6:13.1f} MB{t_copy:10.3f}")
    targets = [("bytes copied per delta <= 3% of the state", med[0] / total, 0.03),
               ("delta stall <= 5% of the full copy", med[1] / t_copy, 0.05),
               ("delta durable >= 25x faster than torch.save", med[2] / t_ts, 1 / 25)]
    for text, ratio, limit in targets:
        print(f"  {text}: {ratio:.4f} ({'met' if ratio <= limit else 'not met'})")


if __name__ == "__main__":
    main()
