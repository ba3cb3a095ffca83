"""One rank of an Accelerate training loop with amber, for test_integration_accelerate.py.

    accelerate launch --multi_gpu --num_processes 2 ... hf_accelerate_worker.py OUT
        [--steps N] [--policy P] [--resume] [--pause-at K]

A tiny causal transformer built from a config (2 layers, 32 wide, dropout on; plain
torch, so that the ranks start without importing transformers) trained by a plain
Accelerate loop on CPU (Accelerator(cpu=True); under `accelerate launch` with 2
processes that is DDP over gloo), AdamW and a linear warm-up schedule, saving every
step with AcceleratorCheckpointer into OUT/amber. The data order comes from
accelerate's seedable sampler (seed and epoch) and the DataLoader has a generator
of its own, so torch's global RNG feeds only dropout; a resume skips the epoch's
seen batches with accelerator.skip_first_batches.

Each rank prints "pid P" at the start (so that a test can SIGKILL every rank) and
dies with its launcher; rank 0 prints "step N" after each step. --pause-at K
sleeps 60 s at the end of step K, before its save, to be killed there. At the end
each rank writes OUT/final-RANK.safetensors (model and AdamW state by name) and
rank 0 prints one JSON line: the step it resumed from and the losses after it.
"""
import argparse
import ctypes
import json
import os
import signal
import sys
import time

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
try:  # a rank must not outlive its launcher (torchrun starts each in a new session)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass

from accelerate import Accelerator, DataLoaderConfiguration  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from amber.integrations.accelerate import AcceleratorCheckpointer  # noqa: E402

CONFIG = dict(layers=2, heads=2, width=32, vocab=128, context=16, dropout=0.1)


class TinyLM(torch.nn.Module):
    def __init__(self, layers, heads, width, vocab, context, dropout):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.pos = torch.nn.Parameter(torch.randn(context, width) * 0.02)
        layer = torch.nn.TransformerEncoderLayer(width, heads, 4 * width, dropout, batch_first=True)
        self.blocks = torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(width, vocab)
        self.register_buffer("mask", torch.nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, input_ids, labels):
        n = input_ids.shape[1]
        h = self.blocks(self.embed(input_ids) + self.pos[:n], mask=self.mask[:n, :n], is_causal=True)
        logits = self.head(h)[:, :-1]
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 labels[:, 1:].reshape(-1))


def flat_state(model, optimizer):
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                out[f"optim/{names[id(p)]}/{k}"] = v.detach().clone()
    return {k: v.contiguous() for k, v in out.items()}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--policy", default="exact")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--pause-at", type=int)
    opts = ap.parse_args()

    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    sys.stdout.write(f"pid {os.getpid()}\n")  # one write: the ranks share the pipe
    sys.stdout.flush()
    set_seed(0)
    model = TinyLM(**CONFIG)
    tokens = torch.randint(0, 128, (48, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    dl = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True,
                                     generator=torch.Generator().manual_seed(2))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up over 3 steps, then linear decay
        opt, lambda s: min((s + 1) / 3, max(0.0, (opts.steps - s) / (opts.steps - 3))))
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)

    losses = {}
    with AcceleratorCheckpointer(acc, os.path.join(opts.out, "amber"), policy=opts.policy) as ck:
        start = (ck.load_state() if opts.resume else None) or 0
        step = start
        epoch, skip = divmod(start, len(dl))
        while step < opts.steps:
            dl.set_epoch(epoch)
            for batch in acc.skip_first_batches(dl, skip) if skip else dl:
                loss = model(**batch)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                losses[str(step)] = loss.item()
                if acc.is_main_process:
                    print(f"step {step}", flush=True)
                if step == opts.pause_at:
                    time.sleep(60)
                ck.save_state(step, extra={"epoch": epoch})
                if step == opts.steps:
                    break
            epoch, skip = epoch + 1, 0
    save_file(flat_state(acc.unwrap_model(model), opt.optimizer),
              os.path.join(opts.out, f"final-{acc.process_index}.safetensors"))
    if acc.is_main_process:
        print(json.dumps({"start": start, "losses": losses, "world": acc.num_processes,
                          "distributed": str(acc.distributed_type), "extra": ck.extra}), flush=True)
    acc.end_training()


if __name__ == "__main__":
    sys.exit(main())
