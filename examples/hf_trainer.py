#!/usr/bin/env python3
"""hf_trainer.py - the Hugging Face Trainer checkpointing into amber.

A tiny GPT-2 built from a config (no download) learns to continue counting
sequences (token t is followed by t+1 mod 128) with transformers' Trainer, here
AmberTrainer: every save (save_steps) goes into the amber store OUT/amber instead of
a checkpoint-N/ folder, the newest 2 are kept (save_total_limit). Run it, stop it at
any moment (Ctrl-C, kill -9) and run it again: it resumes from the store's latest
step with the Trainer's resume_from_checkpoint semantics (TrainerState, the seen
batches skipped, RNG states). At the end the last step is exported to OUT/final, a
folder that AutoModelForCausalLM.from_pretrained loads.

    python examples/hf_trainer.py [--out hf-example] [--steps 60] [--policy exact|lossy]

On CPU it takes a few seconds. Under `accelerate launch --multi_gpu --num_processes 2`
the ranks save and resume together (DDP over gloo on CPU).
"""
import argparse
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is built locally

import torch  # noqa: E402
from transformers import (AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel,  # noqa: E402
                          TrainingArguments, set_seed)

from amber.integrations.hf import AmberTrainer, export  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="hf-example")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--policy", default="exact", help="exact, lossy, lossy-frequent, lossy-compact, lossy-capped")
    opts = ap.parse_args()
    torch.set_num_threads(1)  # a model this small runs fastest on one thread

    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128,
                                       n_positions=32, bos_token_id=0, eos_token_id=0))
    starts = torch.randint(0, 128, (256, 1), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": s, "labels": s} for s in (starts + torch.arange(16)) % 128]

    args = TrainingArguments(opts.out, max_steps=opts.steps, per_device_train_batch_size=8,
                             learning_rate=1e-2, warmup_steps=5, save_strategy="steps",
                             save_steps=5, save_total_limit=2, logging_steps=10,
                             report_to="none", use_cpu=True, disable_tqdm=True)
    trainer = AmberTrainer(model=model, args=args, train_dataset=data, amber_policy=opts.policy)
    latest = trainer.amber_latest()
    if latest is None or latest < opts.steps:
        if latest is not None and trainer.is_world_process_zero():
            print(f"resuming from step {latest} of {trainer.amber_store}")
        trainer.train(resume_from_checkpoint=latest is not None)  # True: the store's latest step

    if not trainer.is_world_process_zero():  # with many ranks, one exports
        return
    step = export(trainer.amber_store, os.path.join(opts.out, "final"))
    loaded = AutoModelForCausalLM.from_pretrained(os.path.join(opts.out, "final"))
    prompt = torch.tensor([[5, 6, 7, 8]])
    guess = loaded.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)[0, 4:]
    print(f"exported step {step} to {opts.out}/final; 5 6 7 8 -> {' '.join(map(str, guess.tolist()))}")


if __name__ == "__main__":
    main()
