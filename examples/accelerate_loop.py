#!/usr/bin/env python3
"""accelerate_loop.py - an Accelerate training loop checkpointing into amber.

A tiny GPT-2 built from a config (no download) learns to continue counting
sequences with a plain Accelerate loop; AcceleratorCheckpointer saves the model,
optimizer, LR scheduler, sampler epoch, RNG states and the loop's own position
into the amber store OUT/amber every --save-every steps, keeping the newest 2. Stop it at
any moment (Ctrl-C, kill -9) and run it again: it resumes from the latest step,
skipping the batches of the epoch that were already seen.

    python examples/accelerate_loop.py [--out accelerate-example] [--steps 60] [--policy exact]
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py   # 2 ranks, DDP

On CPU (Accelerator(cpu=True); with 2 processes that is DDP over gloo) it takes a
few seconds. With several ranks every rank saves and loads its part of one store.
"""
import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally

import torch  # noqa: E402
from accelerate import Accelerator, DataLoaderConfiguration  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup  # noqa: E402

from amber.integrations.accelerate import AcceleratorCheckpointer  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="accelerate-example")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--policy", default="exact", help="exact, lossy, lossy-frequent, lossy-compact, lossy-capped")
    opts = ap.parse_args()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread

    # the seedable sampler makes the data order a function of (seed, epoch): a resume
    # sees the batches the interrupted run would have seen
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128,
                                       n_positions=32, bos_token_id=0, eos_token_id=0))
    starts = torch.randint(0, 128, (256, 1), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": s, "labels": s} for s in (starts + torch.arange(16)) % 128]
    dl = torch.utils.data.DataLoader(data, batch_size=8, shuffle=True,
                                     generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = get_linear_schedule_with_warmup(opt, 5, opts.steps)
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)

    with AcceleratorCheckpointer(acc, os.path.join(opts.out, "amber"), policy=opts.policy,
                                 keep_last=2) as ck:
        step = ck.load_state() or 0  # the latest step; None for an empty store
        if step:
            acc.print(f"resuming from step {step}")
        epoch, seen = divmod(step, len(dl))
        while step < opts.steps:
            dl.set_epoch(epoch)
            for batch in acc.skip_first_batches(dl, seen) if seen else dl:
                loss = model(**batch).loss
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                if step % opts.save_every == 0 or step == opts.steps:
                    ck.save_state(step, extra={"epoch": epoch})  # fences before the next opt.step()
                if step % 10 == 0:
                    acc.print(f"step {step}: loss {loss.item():.3f}")
                if step == opts.steps:
                    break
            epoch, seen = epoch + 1, 0
    acc.print(f"done at step {step}; the store: {os.path.join(opts.out, 'amber')}")
    acc.end_training()


if __name__ == "__main__":
    main()
