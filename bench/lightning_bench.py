#!/usr/bin/env python3
"""lightning_bench.py - PyTorch Lightning's own checkpointing side by side with
amber's CheckpointIO plug-in, on the same training run.

One Lightning run trains an MLP (--width, --layers; by default 25M parameters with
AdamW: a 300 MB checkpoint) on synthetic data on the CPU, with ModelCheckpoint saving
every --every steps as most runs configure it: the top-2 files (by step) and
last.ckpt (saved after each top-k file; with --save-last link, a symlink to it).
The Trainer's CheckpointIO is a tee that hands every checkpoint dict Lightning
makes to each peer in turn, each saving into its own directory (the order rotates
from save to save):

  torch        Lightning's default TorchCheckpointIO (torch.save into memory, then
               the file; Lightning does not fsync)
  torch-async  Lightning's AsyncCheckpointIO around it (clones every tensor on the
               training thread, then saves in a thread)
  amber <policy>  AmberCheckpointIO(policy=...), for each --policies

Per save and peer:
  stall    the time save_checkpoint() blocks the training thread;
  durable  from that call until the checkpoint is on disk: torch: + fsync of the
           file; torch-async: + its thread's save (teardown()) + fsync; amber: +
           wait() (committed; amber fsyncs the file and the directory);
  bytes    the file written (torch), or the amber step (its file; the pointer file
           of a few hundred bytes not counted).
A peer's save is made durable before the next peer's starts, so the peers do not
compete for the disk or the CPUs; the background parts of torch-async and amber
therefore run while the tee waits, not during training steps, and "stall" is what
training waits when the background write fits in the steps between saves (the
report prints their time). The ratios are taken save by save (the same checkpoint
dict), then their median. "On disk": each peer's directory at the end, after
ModelCheckpoint removed its old files (amber prunes the steps they named).

The machine is shared and noisy: medians with min-max over the saves of the run.

    lightning_bench.py [--steps 40] [--every 10] [--width 2048] [--layers 6]
                       [--policies exact,lossy] [--save-last true|link] [--out DIR]
                       [--markdown] [--json FILE]
"""
import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

import torch
import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO, CheckpointIO, TorchCheckpointIO

import amber
from amber.integrations.lightning import AmberCheckpointIO

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import du, fmt, row, spread  # noqa: E402


class MLP(L.LightningModule):
    def __init__(self, width, layers):
        super().__init__()
        mods = []
        for _ in range(layers):
            mods += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*mods)

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-4)
        return [opt], [{"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                        "interval": "step"}]


class StepTimer(Callback):
    """Seconds of each training step (forward, backward, optimizer), saves excluded."""

    def __init__(self):
        self.times, self.t0 = [], None

    def on_train_batch_start(self, *args):
        self.t0 = time.perf_counter()

    def on_train_batch_end(self, *args):  # before ModelCheckpoint's (Lightning orders it last)
        self.times.append(time.perf_counter() - self.t0)


def fsync(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Tee(CheckpointIO):
    """Hands each checkpoint to every peer (name, io, durable(io, path)) in turn."""

    def __init__(self, root, peers):
        self.root, self.peers, self.n = root, peers, 0
        self.records = []  # (save index, kind, peer, stall, durable, bytes)
        for name in [n for n, _, _ in peers] + ["lightning"]:  # lightning: save_last="link"'s links
            os.makedirs(os.path.join(root, name), exist_ok=True)

    def _path(self, name, path):
        return os.path.join(self.root, name, os.path.basename(path))

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        kind = "last" if os.path.basename(path).startswith("last") else "top-k"
        order = self.peers[self.n % len(self.peers):] + self.peers[:self.n % len(self.peers)]
        for name, io, durable in order:
            p = self._path(name, path)
            t0 = time.perf_counter()
            io.save_checkpoint(checkpoint, p)
            t1 = time.perf_counter()
            nbytes = durable(io, p)
            t2 = time.perf_counter()
            self.records.append((self.n, kind, name, t1 - t0, t2 - t0, nbytes))
        self.n += 1

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        raise NotImplementedError("the bench does not resume")

    def remove_checkpoint(self, path):
        for name, io, _ in self.peers:
            io.remove_checkpoint(self._path(name, path))

    def teardown(self):
        for _, io, _ in self.peers:
            io.teardown()


def torch_durable(io, path):
    fsync(path)
    return os.path.getsize(path)


def async_durable(io, path):
    io.teardown()  # waits for its thread's save (the next save starts a new thread)
    fsync(path)
    return os.path.getsize(path)


def amber_durable(io, path):
    io.wait()
    with open(path) as f:
        step = json.load(f)["step"]
    with amber.Store(os.path.join(os.path.dirname(path), "amber"), readonly=True, create=False) as st:
        return next(c.bytes for c in st.list() if c.step == step)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2, help="torch threads for training")
    ap.add_argument("--policies", default="exact,lossy")
    ap.add_argument("--save-last", choices=("true", "link"), default="true",
                    help="ModelCheckpoint's save_last: True (a last.ckpt save after each top-k "
                         "save) or 'link' (last.ckpt a symlink to the newest top-k file)")
    ap.add_argument("--out", help="scratch directory (default: a temporary one, removed)")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    L.seed_everything(0, verbose=False)
    root = a.out or tempfile.mkdtemp(prefix="lightning-bench-")
    peers = [("torch", TorchCheckpointIO(), torch_durable),
             ("torch-async", AsyncCheckpointIO(TorchCheckpointIO()), async_durable)]
    for pol in a.policies.split(","):
        peers.append((f"amber {pol}", AmberCheckpointIO(policy=pol), amber_durable))
    tee, timer = Tee(root, peers), StepTimer()
    model = MLP(a.width, a.layers)
    n = a.steps * a.batch
    x = torch.randn(n, a.width)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.roll(1, 1).tanh()),
                                       batch_size=a.batch)
    trainer = L.Trainer(
        max_steps=a.steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False, plugins=[tee],
        callbacks=[timer, ModelCheckpoint(dirpath=os.path.join(root, "lightning"),
                                          every_n_train_steps=a.every, save_top_k=2,
                                          monitor="step", mode="max",
                                          save_last=True if a.save_last == "true" else "link")])
    t0 = time.perf_counter()
    try:
        trainer.fit(model, data)
        wall = time.perf_counter() - t0
        on_disk = {name: du(os.path.join(root, name)) for name, _, _ in peers}
    finally:
        if not a.out:
            shutil.rmtree(root, ignore_errors=True)
    report(a, model, tee, timer, on_disk, wall, [name for name, _, _ in peers])


def report(a, model, tee, timer, on_disk, wall, names):
    params = sum(p.numel() for p in model.parameters())
    step = spread(timer.times[1:] or timer.times)
    saves = tee.n
    head = (f"lightning_bench: MLP {params / 1e6:.1f}M parameters + AdamW, {a.steps} steps, "
            f"ModelCheckpoint every {a.every} steps (top-2, save_last={a.save_last}): "
            f"{saves} saves per peer; "
            f"a training step {fmt(step)} ({a.every} steps between saves: "
            f"{a.every * step['median']:.2f} s); batch {a.batch}, {a.threads} torch threads; "
            f"torch {torch.__version__}, lightning {L.__version__}, {os.cpu_count()} CPUs, "
            f"{platform.machine()}; run {wall:.0f} s")
    by = {}
    for i, kind, name, stall, dur, nbytes in tee.records:
        by.setdefault((name, kind), []).append((i, stall, dur, nbytes))
        by.setdefault((name, "all"), []).append((i, stall, dur, nbytes))
    res = {"head": head, "figures": {}, "ratios": {}}
    cols = ["peer", "saves", "stall per save", "to durable", "bytes per save", "on disk at end"]
    lines = [head, ""]
    if a.markdown:
        lines += [row(cols, True), "|" + "---|" * len(cols)]
    else:
        lines.append(row(cols, False, (14, 8, 24, 24, 26)))
    for name in names:
        for kind in ("top-k", "last"):
            recs = by.get((name, kind), [])
            if not recs:
                continue
            st = spread([r[1] for r in recs])
            du_ = spread([r[2] for r in recs])
            nb = spread([r[3] for r in recs])
            res["figures"][f"{name}/{kind}"] = {"stall": st, "durable": du_, "bytes": nb}
            mb = f"{nb['median'] / 1e6:.1f} MB ({nb['min'] / 1e6:.1f}-{nb['max'] / 1e6:.1f})"
            disk = f"{on_disk[name] / 1e6:.1f} MB" if kind == "top-k" else ""
            lines.append(row([name if kind == "top-k" else "", f"{kind} {len(recs)}", fmt(st),
                              fmt(du_), mb, disk], a.markdown, (14, 8, 24, 24, 26)))
    res["on_disk"] = on_disk
    # ratios save by save against Lightning's default
    base = {i: r for i, r in ((r[0], r) for r in by[("torch", "all")])}
    lines.append("")
    for name in names[1:]:
        got = {r[0]: r for r in by[(name, "all")]}
        for what, k in (("stall", 1), ("to durable", 2), ("bytes", 3)):
            xs = [base[i][k] / got[i][k] for i in got if got[i][k] > 0]
            s = spread(xs)
            res["ratios"][f"torch/{name} {what}"] = s
            lines.append(f"torch / {name}, {what}: {fmt(s, 'x')} (higher: {name} better)")
        d = on_disk["torch"] / on_disk[name]
        res["ratios"][f"torch/{name} on disk"] = d
        lines.append(f"torch / {name}, on disk at end: {d:.2f}x")
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
