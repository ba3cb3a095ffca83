"""amber.integrations.hf - the Hugging Face Trainer checkpointing into an amber store.

    from amber.integrations.hf import AmberTrainer, export
    args = TrainingArguments("out", save_strategy="steps", save_steps=1, save_total_limit=3)
    trainer = AmberTrainer(model=model, args=args, train_dataset=ds, amber_policy="lossy")
    trainer.train(resume_from_checkpoint=trainer.amber_latest() is not None)
    export("out/amber", "out/final")   # safetensors + config.json: from_pretrained loads it

AmberTrainer is transformers.Trainer whose checkpoints go into an amber store
(default: <output_dir>/amber) instead of checkpoint-N/ folders; AmberTrainerMixin is
the same for another Trainer subclass (`class MyTrainer(AmberTrainerMixin, SFTTrainer)`).
When the Trainer saves (save_strategy, save_steps: every step or every N), the store
gets one step holding the model ("model/<FQN>"), the optimizer ("optim/..."), the LR
scheduler ("sched"), the GradScaler if there is one ("scaler"), the RNG states (torch,
random, NumPy; each rank's own) and, as JSON text in "extra", the TrainerState (global
step, epoch, log history, best metric, stateful callbacks, ...) and the model's config.
No checkpoint-N/ folder, model.safetensors, optimizer.pt, scheduler.pt, rng_state.pth
or trainer_state.json is written. save_total_limit=K keeps the newest K steps (and
the chain their restores need); save_only_model=True saves only the model (and the
TrainerState). The cadence of full checkpoints and deltas, and the policy, are
amber's (amber_policy: "exact", "lossy", ...; amber_options: full_every,
full_share, threads, chunk_elems, as amber.torch.Checkpointer takes them).

Resume: train(resume_from_checkpoint=...) with the Trainer's semantics: True is the
store's latest step (ValueError if it has none), an int is that step; the Trainer
then restores its TrainerState, skips the batches already seen in the current epoch
(unless ignore_data_skip) and restores the RNG states after skipping, exactly as it
does from its own folders, so a run killed at any time and resumed from its last
save ends bit-identical to an uninterrupted run under policy "exact" (deterministic
data and kernels assumed). A string is a checkpoint folder of the Trainer's own
(from a run before amber): the Trainer loads it, and amber saves from then on.
train() without resume_from_checkpoint into a store that already holds steps raises
ValueError (amber's steps only increase): resume, or use a new store. Likewise a
resume from a step older than the latest while saving is on.

Why a Trainer subclass and not a TrainerCallback: a callback sees the state after
the Trainer has set it up. In on_train_begin the Trainer has already computed from
TrainerState which epoch and batch to start from, and skips seen batches and
restores RNG states only on its resume_from_checkpoint path; a callback can save,
but cannot resume. The Trainer's checkpoint I/O is five methods, and the mixin
overrides exactly those: _save_checkpoint (save into amber), _load_from_checkpoint,
_load_optimizer_and_scheduler, _load_scaler (one amber load of model, optimizer,
scheduler and scaler, after the Trainer has created and prepared them) and
_load_rng_state (the RNG states of that load, applied when the Trainer applies its
own: after skipping seen batches). The TrainerState reaches the Trainer as it
always does, as trainer_state.json in the folder that resume_from_checkpoint
names: a temporary folder holding only that file, removed when train() returns.
These methods are the Trainer's private API: this module is tested with the
transformers release pinned in requirements-dev.txt and checks at import that they
exist.

When the save runs. The Trainer saves after optimizer.step(), scheduler.step(),
zero_grad() and on_step_end, so amber.torch's Checkpointer sees each step's final
state; its scan runs while the next forward and backward compute, and it fences by
itself before the next optimizer.step() (a hook on the torch optimizer inside the
Trainer's AcceleratedOptimizer). Under torch.distributed (DDP; torchrun or
accelerate launch) every rank saves and loads collectively through the
distributed Checkpointer: replicated parameters are written once.

Not supported (a clear error at construction): DeepSpeed, FSDP (use amber.dcp or
amber.torch's distributed Checkpointer in your own loop), load_best_model_at_end
(the best step stays in the store: export(store, out, step=state.best_global_step)).
push_to_hub pushes no checkpoint folders.

export(store, out_dir, step=None) writes the model of a step (default: latest) as
out_dir/model.safetensors with the config the trainer saved as out_dir/config.json,
a folder that AutoModel*.from_pretrained loads; it reads stores of one process and
of many ranks.
"""

import dataclasses
import json
import os
import random
import tempfile

import numpy as np
import torch
import transformers
from transformers import Trainer
from transformers.trainer_callback import ExportableState

import amber
from amber.torch import Checkpointer
from amber.torch._dtypes import TORCH as _TORCH
from amber.torch._source import latest_of, single_store, source_for

__all__ = ["AmberTrainerMixin", "AmberTrainer", "export"]

_HOOKS = ("_save_checkpoint", "_load_from_checkpoint", "_load_optimizer_and_scheduler",
          "_load_scaler", "_load_rng_state")
_missing = [h for h in _HOOKS if not callable(getattr(Trainer, h, None))]
if _missing:
    raise ImportError(f"amber.integrations.hf: transformers {transformers.__version__} has no "
                      f"Trainer.{', Trainer.'.join(_missing)}; amber replaces these to checkpoint "
                      "the Trainer (tested with the release pinned in amber's requirements-dev.txt)")

TRAINER_STATE_NAME = "trainer_state.json"  # what Trainer.train reads from the resume folder
_OPTION_NAMES = {"full_every", "full_share", "threads", "chunk_elems"}


def _rng_states():
    """The global RNG states a resume must restore: torch (CPU and CUDA), random, NumPy."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and \
        torch.cuda.is_initialized() else None
    return torch.get_rng_state(), cuda, random.getstate(), np.random.get_state()


def _set_rng_states(states):
    cpu, cuda, py, npy = states
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state_all(cuda)
    random.setstate(py)
    np.random.set_state(npy)


def _inner(optimizer):
    """The torch optimizer inside accelerate's AcceleratedOptimizer: the one whose
    step() runs the parameter update, where the Checkpointer's fence hooks in."""
    return getattr(optimizer, "optimizer", optimizer)


def _is_store(path):
    """Whether `path` (a directory, or an s3:// store) holds an amber store."""
    return amber.is_global_store(path) or single_store(path)


class AmberTrainerMixin:
    """A transformers.Trainer (subclass) that checkpoints into an amber store; see the
    module's documentation. Keywords, besides the Trainer's:
      amber_store: the store's path (default: <args.output_dir>/amber), or an s3:// store.
      amber_policy: "exact" (default), "lossy", "lossy-frequent", "lossy-compact", "lossy-capped" or
          rules, as amber.torch.Checkpointer's policy.
      amber_options: a dict of Checkpointer options: full_every, full_share,
          threads, chunk_elems. save_total_limit becomes keep_last.
    `amber` is the open Checkpointer during train(), else None."""

    def __init__(self, *args, amber_store=None, amber_policy=None, amber_options=None, **kwargs):
        super().__init__(*args, **kwargs)
        options = dict(amber_options or {})
        unknown = set(options) - _OPTION_NAMES
        if unknown:
            raise ValueError(f"amber_options: unknown {sorted(unknown)} (known: "
                             f"{sorted(_OPTION_NAMES)}; the policy is amber_policy, "
                             "keep_last is TrainingArguments.save_total_limit)")
        if self.args.load_best_model_at_end:
            raise ValueError("AmberTrainer: load_best_model_at_end is not supported (the Trainer "
                             "loads the best model from its own checkpoint folder); export the "
                             "best step from the store instead: "
                             "amber.integrations.hf.export(store, out, step=state.best_global_step)")
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise NotImplementedError("AmberTrainer: DeepSpeed and FSDP are not supported; use "
                                      "amber.dcp or amber.torch's distributed Checkpointer")
        self.amber_store = os.fspath(amber_store) if amber_store is not None else \
            os.path.join(self.args.output_dir, "amber")
        self.amber_policy = amber_policy
        self.amber_options = options
        self.amber = None
        self._amber_resume = None  # (step, is the latest) while train() resumes from amber
        self._amber_rng = None     # the resumed step's RNG states, applied by _load_rng_state

    # -- the store --
    def _amber_open(self):
        self.amber = Checkpointer(self.amber_store, policy=self.amber_policy,
                                  keep_last=self.args.save_total_limit or None,
                                  **self.amber_options)

    def amber_latest(self):
        """The store's latest step, or None when it is empty or absent (before
        train(): a read of the store's own files, without opening a Checkpointer)."""
        if self.amber is not None:
            return self.amber.latest()
        return latest_of(self.amber_store)

    def _amber_state(self, extra):
        """The dict amber saves and loads: the same keys in both, so that a load of
        the latest step seeds the writer and the first save after it is a delta."""
        state = {"model": self.model}
        if not self.args.save_only_model:
            state["optim"] = _inner(self.optimizer)
            state["sched"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
        state["extra"] = extra
        return state

    # -- train(): resume_from_checkpoint in amber's terms --
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Trainer.train, resuming from the amber store: resume_from_checkpoint is None
        or False (a fresh run: the store must be empty), True (its latest step), an
        int (that step), or a str (a checkpoint folder of the Trainer's own)."""
        hf_folder = resume_from_checkpoint if isinstance(resume_from_checkpoint, (str, os.PathLike)) \
            else None
        if hf_folder is not None and _is_store(hf_folder):
            raise ValueError(f"resume_from_checkpoint={hf_folder!r} is an amber store: pass "
                             "amber_store= to AmberTrainer and resume_from_checkpoint=True or a step")
        self._amber_open()
        ok = False
        try:
            latest = self.amber.latest()
            step = self._amber_resume_step(resume_from_checkpoint, latest)
            if step is None:
                if latest is not None and self.args.save_strategy != "no":
                    raise ValueError(f"amber store {self.amber_store} already holds steps up to "
                                     f"{latest}: resume (resume_from_checkpoint=True) or give a "
                                     "new amber_store (a step is saved once)")
                out = super().train(resume_from_checkpoint=hf_folder, trial=trial,
                                    ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            else:
                with tempfile.TemporaryDirectory(prefix="amber-resume-") as folder:
                    with open(os.path.join(folder, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
                        f.write(self._amber_trainer_state(step))
                    self._amber_resume = (step, step == latest)
                    out = super().train(resume_from_checkpoint=folder, trial=trial,
                                        ignore_keys_for_eval=ignore_keys_for_eval, **kwargs)
            ok = True
            return out
        finally:
            self._amber_resume = self._amber_rng = None
            ck, self.amber = self.amber, None
            try:
                ck.close()  # the last save becomes durable before train() returns
            except amber.AmberError:
                if ok:
                    raise  # else the training's own exception is the one to see

    def _amber_resume_step(self, resume, latest):
        if resume is None or resume is False or isinstance(resume, (str, os.PathLike)):
            return None
        if resume is True:
            if latest is None:
                raise ValueError(f"resume_from_checkpoint=True: the amber store {self.amber_store} "
                                 "holds no checkpoint")
            return latest
        if not isinstance(resume, int) or resume < 0:
            raise TypeError(f"resume_from_checkpoint must be None, a bool, a step (int) or a "
                            f"checkpoint folder, not {resume!r}")
        steps = [s.step for s in self.amber.steps()]
        if resume not in steps:
            raise ValueError(f"resume_from_checkpoint={resume}: the amber store {self.amber_store} "
                             f"has no step {resume} (steps: {steps[:3]}...{steps[-3:]})")
        if resume != latest and self.args.save_strategy != "no":
            raise ValueError(f"resume_from_checkpoint={resume}: the store's latest step is "
                             f"{latest}, and later saves would reuse its steps; resume from the "
                             "latest, or set save_strategy='no'")
        return resume

    def _amber_trainer_state(self, step):
        """The TrainerState JSON saved with `step` (read alone: the model and the
        optimizer are loaded later, once the Trainer has created them)."""
        state = {"extra": {}}
        kept = _rng_states()
        try:
            self.amber.load(state, step=step)
        finally:
            _set_rng_states(kept)
        text = state["extra"].get("trainer_state") if isinstance(state["extra"], dict) else None
        if not isinstance(text, str):
            raise ValueError(f"step {step} of amber store {self.amber_store} holds no TrainerState "
                             "(not written by AmberTrainer)")
        return text

    # -- the Trainer's checkpoint I/O --
    def _save_checkpoint(self, model, trial):
        if self.amber is None:
            return super()._save_checkpoint(model, trial)
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        # ExportableState callbacks and TrainerControl, as Trainer._save_checkpoint records them
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control]
                   if isinstance(cb, ExportableState)]:
            name = cb.__class__.__name__
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb.state())
            else:
                self.state.stateful_callbacks[name] = cb.state()
        extra = {"trainer_state": json.dumps(dataclasses.asdict(self.state), sort_keys=True),
                 "config": self._amber_config()}
        self.amber.save(self.state.global_step, self._amber_state(extra))

    def _amber_config(self):
        """config.json as save_pretrained writes it, for export()."""
        config = getattr(self.model, "config", None)
        if not hasattr(config, "to_json_string"):
            return None
        out = json.loads(config.to_json_string())
        out["architectures"] = [type(self.model).__name__]
        return json.dumps(out, sort_keys=True)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if self._amber_resume is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # the model loads with the optimizer (their names go together), in
        # _load_optimizer_and_scheduler, once the Trainer has created both

    def _load_optimizer_and_scheduler(self, checkpoint):
        if self._amber_resume is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        step, latest = self._amber_resume
        kept = _rng_states()
        try:  # latest: step=None, so that the writer's reference is seeded from the load
            done = self.amber.load(self._amber_state({}), step=None if latest else step)
            self._amber_rng = _rng_states()
        finally:
            _set_rng_states(kept)
        if done != step:
            raise RuntimeError(f"amber store {self.amber_store}: loaded step {done}, expected {step}")

    def _load_scaler(self, checkpoint):
        if self._amber_resume is None:
            return super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint):
        if self._amber_resume is None:
            return super()._load_rng_state(checkpoint)
        if self._amber_rng is not None:
            _set_rng_states(self._amber_rng)


class AmberTrainer(AmberTrainerMixin, Trainer):
    """transformers.Trainer checkpointing into an amber store (see the module)."""


# -- export -----------------------------------------------------------------------------

def _read_model(store, step, prefix):
    """{name without prefix: tensor} of the tensors under `prefix`, and the step's
    amber.torch metadata (rank 0's for a store of many ranks)."""
    with source_for(store).step(step) as s:
        want = [ti for ti in s.tensors() if ti.name.startswith(prefix)]
        out = {ti.name[len(prefix):]: torch.empty(ti.shape, dtype=_TORCH[ti.dtype])
               for ti in want}
        s.read_whole([(ti.index, out[ti.name[len(prefix):]]) for ti in want])
        return s.step, out, s.meta(0)


def export(store, out_dir, step=None, config=None, key="model"):
    """Writes the model of `step` (default: the latest) of amber store `store` as a
    folder that transformers' from_pretrained loads: out_dir/model.safetensors
    (the tensors saved under `key`, by their names in the model) and
    out_dir/config.json (`config`: a PretrainedConfig, a dict, or None for the
    config AmberTrainer saved with the step). Returns the step exported."""
    from safetensors.torch import save_file

    done, tensors, raw = _read_model(os.fspath(store), step, f"{key}/")
    if not tensors:
        raise ValueError(f"step {done} of amber store {store} holds no tensors under '{key}/'")
    if config is None:
        try:
            meta = json.loads(raw) if raw else {}
            config = json.loads(meta["entries"]["extra"]["value"]["config"])
        except (ValueError, KeyError, TypeError, RecursionError):
            raise ValueError(f"step {done} of amber store {store} holds no model config (not "
                             "written by AmberTrainer): pass config=") from None
    os.makedirs(out_dir, exist_ok=True)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    if hasattr(config, "save_pretrained"):
        config.save_pretrained(out_dir)
    else:
        with open(os.path.join(out_dir, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")
    return done
