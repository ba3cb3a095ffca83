#!/usr/bin/env python3
"""lightning_train.py - PyTorch Lightning checkpointing through amber.

Trains a small MLP on synthetic data on the CPU (no downloads) with Lightning's
ModelCheckpoint saving every --every steps (the top-2 files, and last.ckpt as a link
to the newest: save_last="link"), the checkpoints going through amber's CheckpointIO
plug-in instead of torch.save. The run stops after --steps steps as if it had been
interrupted; a second Trainer, as a restarted job would build it, resumes with
fit(ckpt_path="last") and trains --steps more. Then it prints what is on disk:
Lightning's .ckpt files (small pointers into the store) and the amber store's
checkpoints (full ones, and deltas between them).

    python examples/lightning_train.py [--dir lightning-out] [--steps 16] [--every 4]
                                       [--policy exact|lossy|lossy-frequent|lossy-compact|lossy-capped]
"""
import argparse
import json
import os

import torch
import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import amber
from amber.integrations.lightning import AmberCheckpointIO


class MLP(L.LightningModule):
    def __init__(self, width=256, lr=1e-3):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, width), torch.nn.GELU(),
                                       torch.nn.Linear(width, width), torch.nn.GELU(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        return [opt], [{"scheduler": sched, "interval": "step"}]


def data(batches_per_epoch=8, batch=32):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batches_per_epoch * batch, 32, generator=g)
    y = x[:, :8].sum(1, keepdim=True).sin()
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


class ShowStart(Callback):
    def on_train_start(self, trainer, _):
        if trainer.global_step:
            print(f"resumed from global step {trainer.global_step}")


def trainer(args, steps):
    return L.Trainer(
        max_steps=steps, accelerator="cpu", logger=False, enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[AmberCheckpointIO(policy=args.policy)],       # <- amber
        callbacks=[ShowStart(), ModelCheckpoint(dirpath=args.dir, every_n_train_steps=args.every,
                                                save_top_k=2, monitor="step", mode="max",
                                                save_last="link")])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default="lightning-out")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--every", type=int, default=4)
    ap.add_argument("--policy", default="exact")
    args = ap.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)

    trainer(args, args.steps).fit(MLP(), data())                  # "interrupted" here
    t = trainer(args, 2 * args.steps)
    t.fit(MLP(), data(), ckpt_path="last")                        # a restarted job
    print(f"trained to global step {t.global_step}")

    print(f"\nLightning's files in {args.dir}:")
    for name in sorted(os.listdir(args.dir)):
        path = os.path.join(args.dir, name)
        if os.path.islink(path):
            print(f"  {name:24s} a link to {os.readlink(path)}")
        elif name.endswith(".ckpt"):
            with open(path) as f:
                p = json.load(f)
            print(f"  {name:24s} {os.path.getsize(path):4d} bytes -> amber step {p['step']} "
                  f"(global step {p['global_step']})")
    store = os.path.join(args.dir, "amber")
    print(f"amber store {store}:")
    with amber.Store(store, readonly=True, create=False) as st:
        for c in st.list():
            print(f"  step {c.step:3d}  {c.kind:5s}  {c.bytes:8d} bytes"
                  + (f"  (delta against step {c.parent})" if c.parent is not None else ""))


if __name__ == "__main__":
    main()
