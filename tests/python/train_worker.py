"""A small training run for the resume tests, run in its own process.

    train_worker.py STORE --steps N [--policy P] [--kill-at K] [--resume] [--load-only S]
                    [--memory DIR [--budget BYTES] [--max-lag N] [--log FILE] [--sleep S]]

Trains a little MLP with dropout (so the torch RNG matters) on data drawn per step
(so the data position is the step), with input noise from `random` and NumPy (so
their RNG states matter), AdamW and a StepLR; saves every step with amber. With
--kill-at K it SIGKILLs itself right after save(K) returned, while that save may
still be in flight. Prints one JSON line: the first step it trained, the loss of
each step, and a digest of the model and optimizer state after each step.

With --memory DIR the Checkpointer saves to that memory tier and drains to STORE
(storage tiers); --log FILE gets a line "STEP DIGEST" as each save() returns (so that
a process killed from outside leaves what each step saved), --sleep S pauses between
steps, and the JSON line also says which tier served the load ("served_by")."""
import argparse
import hashlib
import json
import os
import random
import signal
import sys
import time

import numpy as np
import torch

from amber.torch import Checkpointer


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.2),
        torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Dropout(0.2), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    random.seed(1)
    np.random.seed(2)
    return model, opt, sched


def digest(model, opt):
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.numpy().tobytes())
    for s in opt.state.values():
        for k in sorted(s):
            h.update(s[k].numpy().tobytes())
    h.update(repr([g["lr"] for g in opt.param_groups]).encode())
    return h.hexdigest()[:16]


def train_step(step, model, opt, sched):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=g)
    y = torch.randint(0, 4, (32,), generator=g)
    x = x + 0.01 * float(np.random.randn()) + 0.01 * random.random()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    return loss.item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("store")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--policy", default="exact")
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--load-only", type=int, default=0)
    ap.add_argument("--memory")
    ap.add_argument("--budget", type=int)
    ap.add_argument("--max-lag", type=int)
    ap.add_argument("--log")
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--full-every", type=int)
    a = ap.parse_args()
    torch.set_num_threads(2)
    model, opt, sched = build()
    state = {"model": model, "optim": opt, "sched": sched, "extra": {"data_pos": 0}}
    out = {"start": 0, "losses": {}, "digests": {}}
    tiers = {} if a.memory is None else {"memory": a.memory, "memory_budget": a.budget,
                                         "max_lag": a.max_lag}
    if a.full_every:
        tiers.update(full_every=a.full_every, full_share=-1)
    log = open(a.log, "a") if a.log else None
    with Checkpointer(a.store, policy=a.policy, **tiers) as ck:
        if a.load_only:
            out["start"] = ck.load(state, step=None if a.load_only < 0 else a.load_only)
            out["digests"][out["start"]] = digest(model, opt)
            out["extra"] = state["extra"]
            out["served_by"] = ck.served_by
            print(json.dumps(out))
            return
        if a.resume:
            out["start"] = ck.load(state) or 0
            out["served_by"] = ck.served_by
            assert state["extra"]["data_pos"] == out["start"]
        for step in range(out["start"] + 1, a.steps + 1):
            out["losses"][step] = train_step(step, model, opt, sched)
            state["extra"]["data_pos"] = step
            ck.save(step, state)
            out["digests"][step] = digest(model, opt)
            if log is not None:
                log.write(f"{step} {out['digests'][step]}\n")
                log.flush()
            if a.sleep:
                time.sleep(a.sleep)
            if step == a.kill_at:
                sys.stdout.flush()
                os.kill(os.getpid(), signal.SIGKILL)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
