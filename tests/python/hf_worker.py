"""One run of the Hugging Face Trainer with amber for test_integration_hf.py.

    hf_worker.py OUT [--steps N] [--policy P] [--deltas] [--resume] [--pause-at K] [--sync]
                     [--snapshots] [--restored FILE] [--export DIR]

Trains a tiny GPT-2 built from a config (2 layers, 32 wide, vocab 128, dropout on, so
the RNG states matter) with AmberTrainer on fixed random tokens: 1 torch thread, no
dataloader workers, seeds everywhere, a save every step into OUT/amber. Prints
"step N" after each step (flushed) so that a test can SIGKILL it mid-run;
--pause-at K sleeps 60 s at the end of step K, before its save, to be killed there;
--sync waits after each save until it is durable and then prints "saved N".
At the end it writes OUT/final.safetensors (model, AdamW state, by name), and
prints one JSON line: the step it resumed from, the losses logged, the LR.
--snapshots writes OUT/snap-N.safetensors after each save (the state saved);
--restored FILE writes the state as the resume restored it, before training goes on;
--export DIR exports the last step with amber.integrations.hf.export and reports
whether from_pretrained of DIR gives the trained weights exactly; --errors then
misuses AmberTrainer on the finished store and reports each error's message.
"""
import argparse
import json
import os
import sys
import time

import torch

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from safetensors.torch import save_file  # noqa: E402
from transformers import (GPT2Config, GPT2LMHeadModel, TrainerCallback,  # noqa: E402
                          TrainingArguments, set_seed)
from transformers.trainer_callback import PrinterCallback  # noqa: E402

from amber.integrations.hf import AmberTrainer, export  # noqa: E402

CONFIG = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32,
              bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)


def flat_state(model, optimizer):
    """Every tensor of the training state by name: the model's and AdamW's."""
    out = {f"model/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for k, v in optimizer.state.get(p, {}).items():
                if isinstance(v, torch.Tensor):
                    out[f"optim/{names[id(p)]}/{k}"] = v.detach().clone().reshape(v.shape)
    return {k: v.contiguous() for k, v in out.items()}


class Report(TrainerCallback):
    def __init__(self, opts):
        self.opts = opts
        self.start = None
        self.trainer = None

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kw):
        self.start = state.global_step
        self.seeded = self.trainer.amber.seeded
        if self.opts.restored and state.global_step > 0:
            save_file(flat_state(model, optimizer), self.opts.restored)

    def on_step_end(self, args, state, control, **kw):
        print(f"step {state.global_step}", flush=True)
        if state.global_step == self.opts.pause_at:
            time.sleep(60)

    def on_save(self, args, state, control, model=None, optimizer=None, **kw):
        if self.opts.sync:
            self.trainer.amber.wait()
            print(f"saved {state.global_step}", flush=True)
        if self.opts.snapshots:
            save_file(flat_state(model, optimizer),
                      os.path.join(self.opts.out, f"snap-{state.global_step}.safetensors"))


def training_args(opts, **kw):
    return TrainingArguments(
        output_dir=opts.out, max_steps=opts.steps, per_device_train_batch_size=4,
        learning_rate=3e-3, warmup_steps=3, lr_scheduler_type="linear",
        save_strategy="steps", save_steps=1, logging_steps=1, report_to="none",
        use_cpu=True, dataloader_num_workers=0, seed=0, disable_tqdm=True, **kw)


def misuse(opts, model, data):
    """{case: the message of the exception raised}, and the store's latest step after."""
    def err(fn):
        try:
            fn()
        except (ValueError, TypeError) as e:
            return str(e)
        return None

    def trainer(args=None, **kw):
        return AmberTrainer(model=model, args=args or training_args(opts), train_dataset=data, **kw)
    t = trainer()
    store = t.amber_store
    return {
        "fresh_into_used_store": err(lambda: t.train()),
        "resume_older_step": err(lambda: t.train(resume_from_checkpoint=3)),
        "resume_missing_step": err(lambda: t.train(resume_from_checkpoint=99)),
        "store_as_folder": err(lambda: t.train(resume_from_checkpoint=store)),
        "load_best_model_at_end": err(lambda: trainer(training_args(
            opts, load_best_model_at_end=True, eval_strategy="steps", eval_steps=1),
            eval_dataset=data)),
        "bad_option": err(lambda: trainer(amber_options={"keep_last": 2})),
        "latest_after": t.amber_latest(),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--policy", default="exact")
    ap.add_argument("--deltas", action="store_true", help="no full checkpoints after the first")
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--pause-at", type=int)
    ap.add_argument("--sync", action="store_true")
    ap.add_argument("--snapshots", action="store_true")
    ap.add_argument("--restored")
    ap.add_argument("--export")
    ap.add_argument("--errors", action="store_true")
    ap.add_argument("--store", help="amber_store (default: OUT/amber); may be s3://")
    opts = ap.parse_args()
    sys.stdout.write(f"pid {os.getpid()}\n")  # for a kill under a launcher: one write
    sys.stdout.flush()

    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(**CONFIG))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 128, (48, 16), generator=g)
    data = [{"input_ids": t, "labels": t} for t in tokens]
    args = training_args(opts)
    report = Report(opts)
    trainer = AmberTrainer(model=model, args=args, train_dataset=data, callbacks=[report],
                           amber_policy=opts.policy, amber_store=opts.store,
                           amber_options={"full_share": -1, "full_every": 1000} if opts.deltas else None)
    trainer.remove_callback(PrinterCallback)
    report.trainer = trainer
    trainer.train(resume_from_checkpoint=True if opts.resume else None)
    opt = trainer.optimizer.optimizer
    rank = trainer.args.process_index
    save_file(flat_state(trainer.model, opt),
              os.path.join(opts.out, f"final{f'-{rank}' if rank else ''}.safetensors"))
    result = {"start": report.start, "seeded": report.seeded,
              "losses": {str(e["step"]): e["loss"] for e in trainer.state.log_history
                         if "loss" in e},
              "lr": opt.param_groups[0]["lr"], "global_step": trainer.state.global_step}
    if opts.export:
        from transformers import AutoModelForCausalLM
        result["exported_step"] = export(trainer.amber_store, opts.export)
        loaded = AutoModelForCausalLM.from_pretrained(opts.export)
        want = trainer.model.state_dict()
        got = loaded.state_dict()
        result["export_class"] = type(loaded).__name__
        result["export_same"] = sorted(got) == sorted(want) and all(
            torch.equal(got[k], want[k]) for k in want)
    if opts.errors:
        result["errors"] = misuse(opts, trainer.model, data)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    sys.exit(main())
