"""amber.torch - checkpoint PyTorch training state into an amber store.

    from amber.torch import Checkpointer
    with Checkpointer("runs/x", policy="lossy") as ck:
        state = {"model": model, "optim": opt, "sched": sched, "extra": {"data_pos": 0}}
        start = ck.load(state) or 0              # state["extra"] comes back too
        for step in range(start + 1, steps + 1):
            train_one_step()                     # ends with opt.step(), sched.step()
            state["extra"]["data_pos"] = pos
            ck.save(step, state)
    # leaving the block waits until the last save is durable, then releases the store

Supported PyTorch: 2.11 and newer (tested with 2.13); an older torch raises
ImportError at import.

What a state holds. `save(step, state)` takes a dict of named values:
  - nn.Module: its state dict as torch.distributed.checkpoint.state_dict's
    get_model_state_dict gives it, keyed by fully qualified name (FQN): the names
    FSDP2 and DCP use, without the "_orig_mod." of a torch.compile'd module, so a
    compiled and a plain module save and load interchangeably. Tensors are named
    "<key>/<FQN>", e.g. "model/blocks.0.attn.weight".
  - torch.optim.Optimizer: per-parameter state keyed by the parameter's FQN, as
    get_optimizer_state_dict gives it: "<key>/<FQN>/<state name>", e.g.
    "optim/blocks.0.attn.weight/exp_avg". The FQN comes from the nn.Module of the
    same save/load call that owns the parameter; when the dict holds more than one
    module the name is qualified by the module's key, "<module key>/<FQN>"; a
    parameter that no module of the call owns is named "param<i>" after its
    position. So pass the model in the same call as its optimizer, in save and in
    load. param_groups (lr, betas, ...) are kept with the FQNs they list.
  - anything else with state_dict()/load_state_dict() (DCP's Stateful protocol: LR
    schedulers, GradScaler, data loaders' state, ...): its state_dict; tensors in
    it are named by their path ("<key>/<k1>/<k2>"). Functions and bound methods in
    a state_dict (e.g. OneCycleLR's anneal function) are code, not state: they are
    skipped and the object keeps its own.
  - a tensor: named "<key>".
  - plain data (numbers, strings, None, lists, tuples, dicts, small numpy arrays),
    possibly holding tensors: kept exactly in the checkpoint's metadata; tensors
    in it are named by their path.
  - RNG states (rng=True, the default): the torch CPU generator (tensor "rng/torch"),
    CUDA generators if CUDA is in use ("rng/cuda<i>"), Python's `random` and NumPy's
    global generator ("rng/python", "rng/numpy"). The key "rng" is then reserved.

Supported dtypes: float32, float16, bfloat16, float64, float8_e4m3fn, float8_e5m2,
int64, int32, int16, int8, uint8, uint16, uint32, uint64, bool.

What the library reads, and when (the rule of the time between save() and the
fence). save() returns once the scan of the tensors has started; encoding and the
durable write run in the background.
  - Read in place by the scan, until the fence: every contiguous CPU tensor whose
    version counter the fence can check (all but inference tensors) when a saved
    optimizer owns it (its parameters and state, whatever their size), or else when
    it is above CAPTURE_BYTES bytes (the option's default; AMBER_CAPTURE_BYTES) and not
    a module buffer (a model's parameters
    saved without their optimizer, plain tensors in dicts: weights, moments, ...).
    They may be read, not written, by forward and backward passes in between. The
    Checkpointer fences by itself before the step of any torch.optim optimizer (a
    global step pre-hook: also one that the saved state does not hold); save(),
    load(), wait() and close() fence too. Anything else that changes them in place
    (assigning weights, model.load_state_dict, an in-place op under
    torch.no_grad, an EMA written into them) must call ck.fence() first.
  - Copied before save() returns, into staging buffers reused from save to save:
    module buffers that no saved optimizer owns (the next forward pass may change
    them in place: BatchNorm's running statistics and num_batches_tracked), tensors
    of at most CAPTURE_BYTES that no saved optimizer owns, inference tensors (they
    have no version counter), and tensors that are not contiguous CPU tensors.
  - Checked: each tensor read in place has its version counter (`t._version`,
    bumped by every in-place op through autograd's view of it; a view shares its
    base's) read at save() and compared at the fence; the commit of the save waits
    for that comparison. If a tensor changed, the save fails (AmberError
    AMBER_ECHANGED naming the tensor, raised by the next save(), wait() or close()),
    nothing of it becomes visible, and the next save is correct. Not seen by any
    counter: writes through `.data` (an alias with a counter of its own), NumPy or
    DLPack views, raw pointers and other processes; avoid them before the fence.
So a committed checkpoint always holds the state at its save() call. After the
fence the library holds no reference to Python memory.

The cost of save() on the training thread. A save learns the structure of its state
(names, tensors, where each is read, the metadata of modules and optimizer state) and
keeps it as a plan; the next save with the same structure only checks that nothing
of it changed (the same modules, parameters, buffers and optimizer state tensors, by
identity through weak references, and the same addresses; torch's registration hooks
see parameters, buffers and submodules added since), and encodes what changes from
save to save (param_groups, schedulers, plain values, RNG states), at any world
size. A change of structure makes the save take the whole way, and plan again.

Policies. `policy=` is "exact" (the default: every restored tensor is bit-exact),
"lossy", "lossy-frequent", "lossy-compact" or "lossy-capped" (the presets LOSSY,
LOSSY_FREQUENT, LOSSY_COMPACT and LOSSY_CAPPED; docs/fidelity.md has their
measured fidelity under repeated resumes and delta sizes), a single rule "SPEC" or
"PATTERN=SPEC", a list of rules, or a dict {PATTERN: SPEC}. SPEC is exact,
threshold:ABS[:REL][/SHARE:MULT] (with a share cap: at most SHARE of each chunk per
delta, the farthest over their bound first, and none left beyond MULT bounds) or
budget:FRAC[:CAP], optionally followed by a value code
(@q8, @q4, @bf16: quantized changes; +lead), ABS and CAP optionally in units of the
tensor's learning rate ("threshold:0.5u": see docs/policies.md); PATTERN is a glob on the
tensor names above ("*/exp_avg_sq" matches every Adam second moment); the last
matching rule wins.
Integer and bool tensors, and optimizer step counters ("<optim key>/*/step", a
float tensor in Adam), are always exact.

The set of tensors may change between saves (Adam's state appears after its first
step, a layer is added, ...). The Checkpointer then closes its writer and opens a
new one, whose first checkpoint is a full one. Each save with the same tensors
(names, dtypes, shapes) as the store's latest checkpoint is a delta, also in a new
process after a restart, subject to the cadence (full_every, full_share). After a
load() of the store's latest step, the writer's reference state is seeded from
what the load read, so the first save after a resume is a delta that reads nothing
back from the store. That copy (the state's size, into freshly allocated memory) runs
on a thread after load() returns, while training goes on; the fence before the next
optimizer step waits for it, and a tensor changed in place before then (its version
counter moved) drops the seed: the next save then reads its reference from the store.

Loading is all or nothing where it can be. load() first decodes and checks
everything that needs no tensor data: the metadata, every name, shape and dtype,
the presence of every tensor, the value types of every entry, and (when the
reader opens the step) every header and index checksum. Any failure there raises
before one byte of live state changes. Tensor data is checked as it is read,
without a second copy of the state: a checksum that fails there raises AmberError
(AMBER_ECORRUPT) whose message says that the live state is partially loaded and
which entries were being restored; with fallback=True the step is verified
completely before anything is restored, and the load falls back to the newest
intact step.

Errors. Library failures raise amber.AmberError (code, name, message). The failure
of a background save is raised by the next save(), wait() or close(); the store
keeps its earlier checkpoints and later saves work again. load() raises
StateMismatchError (an AmberError with code AMBER_EMISMATCH and a `key` attribute)
naming the first tensor or entry whose presence, shape or dtype differs between the
checkpoint and the state; with strict=False such entries are skipped instead.
Entries of the checkpoint that the load state does not ask for are ignored. Store
metadata that does not decode (a dtype amber does not write, a value of the wrong
type) raises AmberError AMBER_EFORMAT before anything is restored. Step numbers
must increase: a save of a step at or below the store's latest raises AMBER_EEXIST.
"""

import torch


def _torch_version(v):
    parts = []
    for p in v.split("+")[0].split(".")[:2]:
        digits = "".join(c for c in p if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


MIN_TORCH = (2, 11)
if _torch_version(torch.__version__) < MIN_TORCH:
    raise ImportError(f"amber.torch supports PyTorch {MIN_TORCH[0]}.{MIN_TORCH[1]} and newer "
                      f"(tested with 2.13); this is torch {torch.__version__}")

from ._capture import CAPTURE_BYTES  # noqa: E402
from ._checkpointer import Checkpointer  # noqa: E402
from ._load import StateMismatchError  # noqa: E402
from ._presets import (EXACT, LOSSY, LOSSY_CAPPED, LOSSY_COMPACT,  # noqa: E402
                       LOSSY_FREQUENT, PRESETS)

__all__ = ["Checkpointer", "StateMismatchError", "EXACT", "LOSSY", "LOSSY_FREQUENT",
           "LOSSY_COMPACT", "LOSSY_CAPPED", "PRESETS", "CAPTURE_BYTES"]
