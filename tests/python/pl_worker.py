"""A small, deterministic PyTorch Lightning run for tests/python/test_integration_lightning.py.

    pl_worker.py DIR --steps N [--every E] [--policy P] [--io amber|torch]
                 [--kill-at K] [--resume | --ckpt PATH] [--ddp] [--dropout P] [--lr LR]
                 [--dump DUMPDIR] [--store PATH]

Trains a tiny LightningModule (Linear, BatchNorm, dropout, Linear; AdamW with a
per-step StepLR) on synthetic batches from a resumable loader (its position goes
into Lightning's checkpoint) for N optimizer steps, saving through ModelCheckpoint
every E steps (top-2 by step, save_last) into DIR, with amber's CheckpointIO (or
Lightning's own TorchCheckpointIO). --kill-at K: every rank SIGKILLs itself at
the start of the step after global step K, while the save of K may be in flight.
--resume: fit(ckpt_path="last"). --dump: torch.save of the live state at each saved
step (rank 0), and after a resume, of the restored state ("resumed.pt"; other ranks:
"resumed-rank<r>.pt"). Rank 0 prints one JSON
line: the final global step and epoch, the losses of the steps it ran, a digest of
the final model + optimizer + scheduler state, the step it resumed from and a
callback's counter (restored from the checkpoint).
"""
import argparse
import hashlib
import json
import os
import signal
import sys

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

from amber.integrations.lightning import AmberCheckpointIO  # noqa: E402


class Batches:
    """Synthetic batches, resumable: Lightning saves state_dict() in its checkpoint
    (loops/fit_loop/state_dict/combined_loader) and restores it on resume."""

    def __init__(self, n=5, rank=0):
        self.n, self.rank, self.pos, self.epoch = n, rank, 0, 0

    def __len__(self):
        return self.n

    def __iter__(self):
        if self.pos >= self.n:  # Lightning stops after len() batches: a new epoch
            self.pos, self.epoch = 0, self.epoch + 1
        while self.pos < self.n:
            g = torch.Generator().manual_seed(1000 * self.epoch + 10 * self.pos + self.rank)
            self.pos += 1
            x = torch.randn(8, 16, generator=g)
            yield x, (x[:, :4] * 2 + x[:, 4:8].sin())

    def state_dict(self):
        return {"pos": self.pos, "epoch": self.epoch}

    def load_state_dict(self, s):
        self.pos, self.epoch = s["pos"], s["epoch"]


class Net(L.LightningModule):
    def __init__(self, dropout=0.1, lr=1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.BatchNorm1d(64),
                                       torch.nn.ReLU(), torch.nn.Dropout(dropout),
                                       torch.nn.Linear(64, 4))
        self.losses = {}

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss)
        self.losses[self.global_step + 1] = repr(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.7)
        return [opt], [{"scheduler": sched, "interval": "step"}]

    def train_dataloader(self):
        return Batches(rank=self.global_rank)


class Counter(Callback):
    """State that only the checkpoint carries: batches seen over the whole run."""

    def __init__(self):
        self.seen = 0

    def on_train_batch_end(self, *args):
        self.seen += 1

    def state_dict(self):
        return {"seen": self.seen}

    def load_state_dict(self, s):
        self.seen = s["seen"]


def live_state(trainer, model):
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    for i, opt in enumerate(trainer.optimizers):
        for pi, s in opt.state_dict()["state"].items():
            for k, v in s.items():
                if isinstance(v, torch.Tensor):
                    out[f"optim{i}/{pi}/{k}"] = v.detach().clone()
    return out


class Probe(Callback):
    """--kill-at and --dump."""

    def __init__(self, kill_at, dump, every):
        self.kill_at, self.dump, self.every = kill_at, dump, every
        self.resumed_from = None

    def on_train_start(self, trainer, model):
        if trainer.global_step:
            self.resumed_from = trainer.global_step
            if self.dump:
                rank = trainer.global_rank
                torch.save(live_state(trainer, model),
                           os.path.join(self.dump, f"resumed{f'-rank{rank}' if rank else ''}.pt"))

    def on_train_batch_start(self, trainer, model, batch, batch_idx):
        if self.kill_at is not None and trainer.global_step == self.kill_at:
            # every rank gets here (no collective between the save's barrier and here)
            sys.stdout.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer, model, *args):
        # runs before ModelCheckpoint's save of the same step (Lightning orders it last)
        if self.dump and trainer.is_global_zero and trainer.global_step % self.every == 0:
            torch.save(live_state(trainer, model),
                       os.path.join(self.dump, f"step{trainer.global_step}.pt"))


def digest(trainer, model):
    h = hashlib.sha256()
    for k, v in sorted(live_state(trainer, model).items()):
        h.update(k.encode())
        h.update(v.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    for cfg in trainer.lr_scheduler_configs:
        h.update(json.dumps(cfg.scheduler.state_dict(), sort_keys=True).encode())
    return h.hexdigest()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--policy", default="exact")
    ap.add_argument("--io", choices=("amber", "torch"), default="amber")
    ap.add_argument("--store")
    ap.add_argument("--kill-at", type=int)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--ckpt")
    ap.add_argument("--ddp", action="store_true")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--dump")
    a = ap.parse_args()

    L.seed_everything(7, verbose=False)
    model = Net(dropout=a.dropout, lr=a.lr)
    probe, counter = Probe(a.kill_at, a.dump, a.every), Counter()
    plugins = [AmberCheckpointIO(store=a.store, policy=a.policy)] if a.io == "amber" else []
    trainer = L.Trainer(
        max_steps=a.steps, accelerator="cpu", deterministic=True, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        devices=2 if a.ddp else 1, strategy="ddp" if a.ddp else "auto", plugins=plugins,
        callbacks=[probe, counter,
                   ModelCheckpoint(dirpath=a.dir, every_n_train_steps=a.every, save_top_k=2,
                                   monitor="step", mode="max", save_last=True)])
    ckpt = a.ckpt or ("last" if a.resume else None)
    trainer.fit(model, ckpt_path=ckpt)
    if trainer.is_global_zero:
        print(json.dumps({
            "global_step": trainer.global_step, "epoch": trainer.current_epoch,
            "losses": model.losses, "digest": digest(trainer, model),
            "resumed_from": probe.resumed_from, "seen": counter.seen,
            "files": sorted(os.listdir(a.dir))}))


if __name__ == "__main__":
    main()
