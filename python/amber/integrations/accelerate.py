"""amber.integrations.accelerate - Accelerate's save_state/load_state into an amber store.

    from amber.integrations.accelerate import AcceleratorCheckpointer
    model, opt, dl, sched = accelerator.prepare(model, opt, dl, sched)
    with AcceleratorCheckpointer(accelerator, "runs/x", policy="lossy") as ck:
        start = ck.load_state() or 0                 # the latest step, or load_state(step)
        for step in range(start + 1, steps + 1):
            train_one_step()                         # ..., opt.step(), sched.step(), opt.zero_grad()
            ck.save_state(step)

What Accelerator.save_state writes into a folder, AcceleratorCheckpointer writes
as one step of an amber store, from the objects the Accelerator tracks: every
prepared model ("model", "model_1", ...: unwrapped from DDP, by parameter name),
optimizer ("optimizer", ...: the torch optimizer inside AcceleratedOptimizer, its
state keyed by parameter name), LR scheduler ("scheduler", ...), the GradScaler
("scaler") when mixed precision uses one, the objects given to
accelerator.register_for_checkpointing ("custom_0", ...), the state of stateful
data loaders ("dataloader_0", ...), the epoch of accelerate's seedable samplers,
Accelerator.step, and the RNG states (torch, random, NumPy; each process its own).
Plain data of your own (the data position, an epoch counter) goes in `extra`:
save_state(step, extra={...}); load_state puts it back in `ck.extra`.

Why not Accelerator.register_save_state_pre_hook: that hook may only take models
out of the list that save_state writes; the optimizers, schedulers, samplers and
RNG files are written regardless. So this is save_state/load_state in its own
object, which also keeps what amber needs between saves (the writer's reference
state, so that each save is a delta against the last, and the fence).

Many processes (accelerate launch, DDP): construct it on every process after
prepare() and call save_state/load_state on every process, as with
Accelerator.save_state: the store is one amber store written by all ranks
together (amber.torch's distributed Checkpointer over the job's torch.distributed
group); replicated DDP parameters are written once, by rank 0.

When to call. save_state after optimizer.step() (and scheduler.step(),
zero_grad()): its scan reads the parameters and optimizer state in place while
the next forward and backward run, and it fences by itself before the next
optimizer.step(); anything else that changes them in place must call ck.fence()
first. load_state restores the RNG states at once, like Accelerator.load_state:
a DataLoader without a generator of its own draws from torch's global RNG when it
is iterated, so for a resume that matches an uninterrupted run bit for bit give it
`generator=` (and skip seen batches with accelerator.skip_first_batches).

Not supported (NotImplementedError): DeepSpeed, FSDP and Megatron-LM (their
engines keep state that is not in these objects; FSDP2 state is saved by
amber.torch's distributed Checkpointer or amber.dcp from your loop).
"""

from accelerate.data_loader import SeedableRandomSampler
from accelerate.utils import DistributedType

from amber.torch import Checkpointer

__all__ = ["AcceleratorCheckpointer"]

_UNSUPPORTED = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM)


def _name(kind, i):
    return kind if i == 0 else f"{kind}_{i}"


def _samplers(accelerator):
    """(index, sampler) of the prepared data loaders whose sampler is accelerate's
    SeedableRandomSampler, whose epoch decides the order of the data."""
    out = []
    for i, dl in enumerate(accelerator._dataloaders):
        get = getattr(dl, "get_sampler", None)
        sampler = get() if get is not None else getattr(dl, "sampler", None)
        if isinstance(sampler, SeedableRandomSampler):
            out.append((i, sampler))
    return out


class AcceleratorCheckpointer:
    """save_state/load_state of `accelerator` into the amber store at `path`.

    AcceleratorCheckpointer(accelerator, path, policy=None, **options): policy and
    options (full_every, full_share, keep_last, threads, chunk_elems, rng) as
    amber.torch.Checkpointer takes them. Construct it after accelerator.prepare().
    `extra` holds the plain data of the last load_state. A context manager: leaving
    the block waits for the last save and releases the store."""

    def __init__(self, accelerator, path, policy=None, **options):
        if accelerator.distributed_type in _UNSUPPORTED:
            raise NotImplementedError(f"AcceleratorCheckpointer: {accelerator.distributed_type} is "
                                      "not supported (DDP and single-process runs are)")
        if "readonly" in options or "process_group" in options:
            raise ValueError("AcceleratorCheckpointer: readonly and process_group are not options "
                             "here (every process saves and loads, over the job's group)")
        self.accelerator = accelerator
        self.checkpointer = Checkpointer(path, policy=policy, **options)
        self.extra = None

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self.checkpointer.__exit__(exc_type, *_)

    def state(self, extra=None):
        """The dict that save_state saves (and load_state loads into)."""
        acc = self.accelerator
        state = {}
        if not acc._models and not acc._optimizers:
            raise ValueError("AcceleratorCheckpointer: the accelerator has prepared no model and no "
                             "optimizer (construct it after accelerator.prepare)")
        for i, m in enumerate(acc._models):
            state[_name("model", i)] = acc.unwrap_model(m)
        for i, o in enumerate(acc._optimizers):
            state[_name("optimizer", i)] = getattr(o, "optimizer", o)
        for i, s in enumerate(acc._schedulers):
            state[_name("scheduler", i)] = getattr(s, "scheduler", s)
        for i, dl in enumerate(acc._dataloaders):
            if getattr(dl, "use_stateful_dataloader", False):
                state[f"dataloader_{i}"] = dl
        if acc.scaler is not None:
            state["scaler"] = acc.scaler
        for i, obj in enumerate(acc._custom_objects):
            state[f"custom_{i}"] = obj
        state["accelerate"] = {"step": acc.step,
                               "samplers": {str(i): s.epoch for i, s in _samplers(acc)}}
        state["extra"] = {} if extra is None else extra
        return state

    def save_state(self, step, extra=None, full=False):
        """Saves the accelerator's state as `step` (every process, collectively).
        extra: plain data of your own (a dict). Returns once the scan has begun."""
        if extra is not None and not isinstance(extra, dict):
            raise TypeError(f"extra must be a dict of plain data, not {type(extra).__name__}")
        self.checkpointer.save(step, self.state(extra), full=full)

    def load_state(self, step=None, strict=True, fallback=False):
        """Restores the accelerator's state from `step` (default: the latest) in place
        and returns the step, or None for an empty store (nothing changes then).
        `extra` then holds the plain data saved with it."""
        state = self.state()
        done = self.checkpointer.load(state, step=step, strict=strict, fallback=fallback)
        if done is None:
            return None
        acc = self.accelerator
        saved = state.get("accelerate")
        if isinstance(saved, dict):
            acc.step = int(saved.get("step", acc.step))
            epochs = saved.get("samplers") or {}
            for i, s in _samplers(acc):
                if str(i) in epochs:
                    s.set_epoch(int(epochs[str(i)]))
        self.extra = state.get("extra")
        return done

    def fence(self):
        self.checkpointer.fence()

    def wait(self):
        """Blocks until the last save is durable; raises its failure."""
        self.checkpointer.wait()

    def latest(self):
        return self.checkpointer.latest()

    def close(self):
        self.checkpointer.close()
