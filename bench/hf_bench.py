#!/usr/bin/env python3
"""hf_bench.py - the Hugging Face Trainer's own checkpointing side by side with amber
(amber.integrations.hf.AmberTrainer), on the same training run, in one process.

Every pass trains the same GPT-2 built from a config (default: 4 layers, 256 wide,
vocab 8192, context 128: 5.3M parameters, a 64 MB training state with AdamW) from the
same seed on the same synthetic tokens for --steps steps, saving every --every steps:

  no saves     save_strategy="no": the pass time without checkpoints;
  Trainer      save_strategy="steps": checkpoint-N/ folders (model.safetensors,
               optimizer.pt, scheduler.pt, rng_state.pth, trainer_state.json, ...);
  amber exact  AmberTrainer, policy "exact" (bit-exact restores);
  amber lossy  AmberTrainer, the "lossy" preset.

Per save it measures:
  stall        how long the training loop is blocked by the save: Trainer's
               _save_checkpoint call; for amber that call (save() returns once its
               scan has started) plus the wait at the fence before the next
               optimizer.step() (Checkpointer.timings["fence"]);
  durable      from the save's start until it is on disk for good: for the Trainer,
               its call plus an fsync of every file it wrote (the Trainer itself does
               not fsync: its files are in the page cache when it returns; the fsync
               runs after the save and is not counted in the stall or the pass time);
               for amber, until LATEST names the step (amber commits after fsync),
               watched by a thread that reads LATEST every 0.5 ms; amber's commit
               also waits for the fence before the next optimizer.step() (where it
               checks that no saved tensor changed in place), so this is at least
               the rest of that training step;
  bytes        the checkpoint's size on disk (the folder; amber's step file).
The first save of a pass is left out of the per-save medians (amber's is a full
checkpoint that also allocates its reference; the Trainer's creates the folder
tree); "on disk" is everything a pass left, all saves kept. A short pass first, not
measured, warms up what runs once per process.

Each round runs the four passes in a rotated order; a figure's median over the saves
of a pass is one sample, and the table gives the median and min-max of the rounds.
The machine is shared and noisy: compare within the table, not across runs.

    hf_bench.py [--rounds 3] [--steps 40] [--every 5] [--quick] [--out DIR] [--json FILE]
    hf_bench.py --report FILE      (the table of an earlier --json)
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,  # noqa: E402
                          TrainingArguments, set_seed)
from transformers.trainer_callback import PrinterCallback  # noqa: E402
from transformers.utils import logging as hf_logging  # noqa: E402

import amber  # noqa: E402
from amber.integrations.hf import AmberTrainer  # noqa: E402

VARIANTS = ("no saves", "Trainer", "amber exact", "amber lossy")


def log(msg):
    print(f"[hf_bench] {msg}", file=sys.stderr, flush=True)


class _Timed:
    """Times each _save_checkpoint call and remembers when it began, by step."""

    def _save_checkpoint(self, model, trial):
        t0 = time.perf_counter()
        self.bench["begun"][self.state.global_step] = t0
        super()._save_checkpoint(model, trial)
        t1 = time.perf_counter()
        self.bench["call"].append(t1 - t0)
        if self.amber is None:  # the Trainer's folder: fsync what it wrote, timed apart
            folder = os.path.join(self.args.output_dir, f"checkpoint-{self.state.global_step}")
            self.bench["fsync"].append(_fsync_tree(folder))
            self.bench["bytes"].append(_tree_bytes(folder))
        else:
            self.bench["pending"] = True


class TimedTrainer(_Timed, Trainer):
    amber = None


class TimedAmberTrainer(_Timed, AmberTrainer):
    pass


class FenceProbe(TrainerCallback):
    """After the optimizer step that follows an amber save: the fence's wait."""

    def __init__(self, trainer):
        self.trainer = trainer

    def on_optimizer_step(self, args, state, control, **kw):
        b = self.trainer.bench
        if b.get("pending"):
            b["fence"].append(self.trainer.amber.timings["fence"])
            b["pending"] = False


class LatestWatch(threading.Thread):
    """Records when the store's LATEST first names each step."""

    def __init__(self, store):
        super().__init__(daemon=True)
        self.path = os.path.join(store, "LATEST")
        self.seen = {}
        self.stop = threading.Event()

    def run(self):
        last = None
        while not self.stop.is_set():
            try:
                with open(self.path) as f:
                    text = f.read()
            except OSError:
                text = None
            if text and text != last:
                last = text
                try:
                    self.seen.setdefault(int(text.split()[0]), time.perf_counter())
                except ValueError:
                    pass
            time.sleep(0.0005)


def _fsync_tree(folder):
    t0 = time.perf_counter()
    for root, _, files in os.walk(folder):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - t0


def _tree_bytes(path):
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def one_pass(variant, opts, cfg, data, out):
    set_seed(0)
    model = GPT2LMHeadModel(cfg)
    saves = variant != "no saves"
    args = TrainingArguments(out, max_steps=opts.steps, per_device_train_batch_size=opts.batch,
                             learning_rate=1e-3, warmup_steps=2,
                             save_strategy="steps" if saves else "no", save_steps=opts.every,
                             logging_steps=10 ** 6, report_to="none", use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True, seed=0)
    if variant.startswith("amber"):
        trainer = TimedAmberTrainer(model=model, args=args, train_dataset=data,
                                    amber_policy=variant.split()[1])
        trainer.add_callback(FenceProbe(trainer))
    else:
        trainer = TimedTrainer(model=model, args=args, train_dataset=data)
    trainer.remove_callback(PrinterCallback)
    trainer.bench = {"begun": {}, "call": [], "fence": [], "fsync": [], "bytes": []}
    watch = None
    if variant.startswith("amber"):
        watch = LatestWatch(trainer.amber_store)
        watch.start()
    t0 = time.perf_counter()
    trainer.train()  # for amber, returns once the last save is durable
    elapsed = time.perf_counter() - t0
    b = trainer.bench
    res = {"pass": elapsed - sum(b["fsync"])}
    if watch is not None:
        time.sleep(0.01)
        watch.stop.set()
        watch.join()
        with amber.Store(trainer.amber_store, readonly=True) as st:
            sizes = {c.step: c.bytes for c in st.list()}
        steps = sorted(b["begun"])
        res["durable"] = [watch.seen[s] - b["begun"][s] for s in steps]
        res["bytes"] = [sizes[s] for s in steps]
        res["stall"] = [c + f for c, f in zip(b["call"], b["fence"] + [0.0])]
        res["kinds"] = [c.kind for c in amber.Store(trainer.amber_store, readonly=True).list()]
    elif saves:
        res["stall"] = b["call"]
        res["durable"] = [c + f for c, f in zip(b["call"], b["fsync"])]
        res["bytes"] = b["bytes"]
    if saves:
        res["disk"] = _tree_bytes(out)
    return res


def _steady(xs):
    return statistics.median(xs[1:] if len(xs) > 1 else xs)


def _spread(xs, fmt, unit=""):
    return f"{fmt(statistics.median(xs))} ({fmt(min(xs))}-{fmt(max(xs))}){unit}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="a tiny model, 1 round (smoke run)")
    ap.add_argument("--out", help="where the passes write (default: a temporary folder)")
    ap.add_argument("--json", help="also write the raw figures here")
    ap.add_argument("--report", metavar="JSON", help="print the table of an earlier --json, run nothing")
    opts = ap.parse_args()
    if opts.report:
        with open(opts.report) as f:
            saved = json.load(f)
        return report(saved["meta"], saved["results"])
    hf_logging.disable_progress_bar()  # save_pretrained's, on stderr at every save
    if opts.quick:
        opts.rounds, opts.steps, opts.every = 1, 8, 2
        cfg = dict(n_layer=2, n_embd=64, n_head=2, vocab_size=512, n_positions=64)
    else:
        cfg = dict(n_layer=4, n_embd=256, n_head=4, vocab_size=8192, n_positions=128)
    cfg = GPT2Config(**cfg, bos_token_id=0, eos_token_id=0)
    ctx = min(64, cfg.n_positions)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, cfg.vocab_size, (opts.batch * opts.steps, ctx), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    n_params = sum(p.numel() for p in GPT2LMHeadModel(cfg).parameters())

    root = opts.out or tempfile.mkdtemp(prefix="hf-bench-")
    os.makedirs(root, exist_ok=True)
    results = {v: [] for v in VARIANTS}
    load0 = os.getloadavg()[0]
    try:  # a first pass warms up what runs once per process (allocator, kernels, imports)
        one_pass("no saves", argparse.Namespace(**{**vars(opts), "steps": 2}), cfg, data,
                 os.path.join(root, "warm-up"))
        for r in range(opts.rounds):
            order = VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]
            for v in order:
                out = os.path.join(root, f"r{r}-{v.replace(' ', '-')}")
                shutil.rmtree(out, ignore_errors=True)
                log(f"round {r + 1}/{opts.rounds}: {v}")
                results[v].append(one_pass(v, opts, cfg, data, out))
                shutil.rmtree(out, ignore_errors=True)
    finally:
        if not opts.out:
            shutil.rmtree(root, ignore_errors=True)
    load1 = os.getloadavg()[0]

    meta = {"params": n_params, "steps": opts.steps, "batch": opts.batch, "ctx": ctx,
            "every": opts.every, "rounds": opts.rounds, "load": [load0, load1],
            "versions": f"transformers {transformers.__version__}, torch {torch.__version__}",
            "machine": f"{platform.machine()} x{os.cpu_count()}"}
    report(meta, results)
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


def report(meta, results):
    """Prints the table and the ratios (also from a --json file: --report FILE)."""
    ms = lambda s: f"{s * 1e3:.1f}"  # noqa: E731
    mb = lambda n: f"{n / 1e6:.2f}"  # noqa: E731
    sec = lambda s: f"{s:.2f}"  # noqa: E731
    times = lambda x: f"{x:.2f}"  # noqa: E731
    print(f"Hugging Face Trainer vs amber: GPT-2 from a config, {meta['params'] / 1e6:.1f}M "
          f"parameters (+ AdamW), {meta['steps']} steps of batch {meta['batch']} x {meta['ctx']} "
          f"tokens, a save every {meta['every']} steps; {meta['rounds']} rounds; "
          f"{meta['versions']}, {meta['machine']}, load average {meta['load'][0]:.1f} -> "
          f"{meta['load'][1]:.1f}. Median (min-max) over rounds of each pass's median over its "
          "saves after the first.\n")
    print("| checkpointing | stall per save | save -> durable | bytes per save | on disk "
          "at the end | pass time |")
    print("|---|---|---|---|---|---|")
    for v in VARIANTS:
        rs = results[v]
        passes = _spread([x["pass"] for x in rs], sec, " s")
        if v == "no saves":
            print(f"| no saves | | | | | {passes} |")
            continue
        name = {"Trainer": "Trainer (checkpoint-N/: safetensors, optimizer.pt, ...)"}.get(v, v)
        print(f"| {name} | {_spread([_steady(x['stall']) for x in rs], ms, ' ms')} | "
              f"{_spread([_steady(x['durable']) for x in rs], ms, ' ms')} | "
              f"{_spread([_steady(x['bytes']) for x in rs], mb, ' MB')} | "
              f"{_spread([x['disk'] for x in rs], mb, ' MB')} | {passes} |")
    print()
    hf = results["Trainer"]
    for v in ("amber exact", "amber lossy"):
        rs = results[v]
        ratio = lambda key: [_steady(a[key]) / _steady(h[key]) for h, a in zip(hf, rs)]  # noqa: E731
        print(f"- {v} against the Trainer (within each round): stall "
              f"{_spread(ratio('stall'), times, 'x')}, time to durable "
              f"{_spread(ratio('durable'), times, 'x')}, bytes per save "
              f"{_spread(ratio('bytes'), times, 'x')}; the last round's steps: "
              f"{' '.join(k[0] for k in rs[-1]['kinds'])} (f full, d delta)")

if __name__ == "__main__":
    main()
