"""amber.torch - checkpoint PyTorch training state into an amber store.

    from amber.torch import Checkpointer
    with Checkpointer("runs/x", policy="lossy") as ck:
        start = ck.load({"model": model, "optim": opt, "sched": sched}) or 0
        for step in range(start + 1, steps + 1):
            train_one_step()                     # ends with opt.step(), sched.step()
            ck.save(step, {"model": model, "optim": opt, "sched": sched,
                           "extra": {"data_pos": pos}})
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
    it is above CAPTURE_BYTES bytes and not a module buffer (a model's parameters
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
save to save (param_groups, schedulers, plain values, RNG states): about a
millisecond for GPT-2 small's 1040 tensors, whose structure is not walked again. A
change of structure makes the save take the whole way, and plan again.

Policies. `policy=` is "exact" (the default: every restored tensor is bit-exact),
"lossy", "lossy-frequent", "lossy-compact" or "lossy-capped" (the presets LOSSY,
LOSSY_FREQUENT, LOSSY_COMPACT and LOSSY_CAPPED below, each with its
measured fidelity under repeated resumes and delta size), a single rule "SPEC" or
"PATTERN=SPEC", a list of rules, or a dict {PATTERN: SPEC}. SPEC is exact,
threshold:ABS[:REL][/SHARE:MULT] (with a share cap: at most SHARE of each chunk per
delta, the farthest over their bound first, and none left beyond MULT bounds) or
budget:FRAC[:CAP], optionally followed by a value code
(@q8, @q4, @bf16: quantized changes; +lead), ABS and CAP optionally in units of the
tensor's learning rate ("threshold:0.5u": see README); PATTERN is a glob on the
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

import itertools
import json
import os
import random
import threading
import time
import warnings
import weakref
from itertools import chain
from operator import attrgetter, is_, itemgetter

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

from torch.distributed.checkpoint import state_dict as _dsd  # noqa: E402

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed support
    _DTensor = None

import amber as _amber  # noqa: E402
from amber import AmberError, Store  # noqa: E402
from amber import device as _device  # noqa: E402

try:
    import numpy as _np
except ImportError:  # NumPy is optional: its RNG is then not saved
    _np = None

__all__ = ["Checkpointer", "StateMismatchError", "EXACT", "LOSSY", "LOSSY_FREQUENT",
           "LOSSY_COMPACT", "LOSSY_CAPPED", "PRESETS",
           "CAPTURE_BYTES"]

# The lossy presets, chosen by measurement on the demo's training (examples/demo_gpt.py:
# 3.3M-parameter GPT, AdamW with betas 0.9/0.95, saved every step, a full checkpoint
# every 50 deltas) and checked on a 4.3x larger GPT on other data (bench/fidelity.py
# --model large). W = weights and every other float tensor, M = exp_avg (and SGD's
# momentum), V = exp_avg_sq. A resume restores the writer's reference, so the changes
# not yet stored (up to each rule's bound) are lost at every failure, and that error
# adds up over many failures. bench/fidelity.py measures it: the run is SIGKILLed
# every K steps (K = 20: 9 resumes in 200 steps, each in a new process from the
# store), and its final held-out loss is compared with the uninterrupted run of the
# same seed; the seed-to-seed spread of uninterrupted runs (data order, dropout) is
# sd = 0.25%. The README's "Fidelity under repeated resumes" has the whole table.
#
# Since issue 22 the presets store quantized changes (docs/FORMAT.md, "Quantized
# sparse body"): 8-bit codes in steps of half the bound, the rounding kept in
# live - reference and stored later (error feedback). Their rules:
#   W: threshold:Nu@q8+lead, in units of the parameter's learning rate (amber.torch
#      sets each parameter's and its optimizer state's unit to its param group's lr at
#      every save): a weight is stored once it has moved N learning rates from what a
#      restore gives, and "+lead" stores it a step ahead of where it moves, so that a
#      restored weight is ahead as often as behind instead of always behind.
#   M: budget:F:1e-3@q8: the F largest changes of each chunk, coded in steps of half
#      the least of them; 1e-3 is a safety bound, far above Adam's first moments here.
#   V: threshold:0:R@q8+lead: within a share R of itself (it spans many orders of
#      magnitude), leading its decay.
# Tensors without a learning rate (buffers, tensors no optimizer owns) are exact
# under the W rule. The lr units and the lead fit Adam-type optimizers, whose update
# is about lr per element and step; measure other optimizers with bench/fidelity.py.
#
# "lossy": N = 1, F = 8%, R = 0.3. See README for its measured delta sizes and
#   fidelity at K = 10, 20, 50 on both models.
LOSSY = (
    "threshold:1u@q8+lead",
    "*/exp_avg=budget:0.08:1e-3@q8",
    "*/momentum_buffer=budget:0.08:1e-3@q8",
    "*/exp_avg_sq=threshold:0:0.3@q8+lead",
    "*/max_exp_avg_sq=threshold:0:0.3@q8+lead",
)
# "lossy-frequent": N = 0.7, F = 25%, R = 0.2: for runs resumed more often (every 10
#   steps of the demo). (F = 15% kept 0.5% on two seeds of three: +0.615% on seed 2.)
LOSSY_FREQUENT = (
    "threshold:0.7u@q8+lead",
    "*/exp_avg=budget:0.25:1e-3@q8",
    "*/momentum_buffer=budget:0.25:1e-3@q8",
    "*/exp_avg_sq=threshold:0:0.2@q8+lead",
    "*/max_exp_avg_sq=threshold:0:0.2@q8+lead",
)
# "lossy-compact": N = 1.5, F = 5%, R = 0.3: smaller deltas whose error adds up
#   faster: for runs that are rarely resumed, or checkpoints that are exported
#   rather than resumed from.
LOSSY_COMPACT = (
    "threshold:1.5u@q8+lead",
    "*/exp_avg=budget:0.05:1e-3@q8",
    "*/momentum_buffer=budget:0.05:1e-3@q8",
    "*/exp_avg_sq=threshold:0:0.3@q8+lead",
    "*/max_exp_avg_sq=threshold:0:0.3@q8+lead",
)
# "lossy-capped": W threshold:1u/0.15:8, M budget:0.1, V threshold:0:0.3/0.1:16: the
#   weights and second moments under share caps (at most 15% and 10% of a chunk a
#   delta, the farthest over their bound first, never beyond 8 and 16 bounds), so
#   that a delta's size is bounded by its rules, not only its mean: past the
#   warm-up's first deltas (where second moments grow many times over and are stored,
#   forced, beyond 16 bounds) every delta of the demo's runs was at most 3% of a full
#   checkpoint (on the 4.3x larger model none at K=20 on 3 seeds, but 3 of 960 at
#   K=50, up to 3.87%, and 5 at K=10, up to 32.3%: elements forced beyond MULT bounds
#   come on top of the shares). The caps defer changes past 1 lr (W) and 0.3 (V) when many move at
#   once (Adam's warm-up, spikes); the bytes they save buy first moments 10% (see
#   README for its fidelity).
LOSSY_CAPPED = (
    "threshold:1u/0.15:8@q8+lead",
    "*/exp_avg=budget:0.1:1e-3@q8",
    "*/momentum_buffer=budget:0.1:1e-3@q8",
    "*/exp_avg_sq=threshold:0:0.3/0.1:16@q8+lead",
    "*/max_exp_avg_sq=threshold:0:0.3/0.1:16@q8+lead",
)
EXACT = ("exact",)
PRESETS = {"exact": EXACT, "lossy": LOSSY, "lossy-frequent": LOSSY_FREQUENT,
           "lossy-compact": LOSSY_COMPACT, "lossy-capped": LOSSY_CAPPED}

# Tensors of at most this many bytes are copied at save() whoever owns them: their
# copy costs next to nothing against the scan, and no version counter is needed.
CAPTURE_BYTES = 256 << 10

_DTYPES = {
    torch.float32: _amber.F32, torch.float16: _amber.F16, torch.bfloat16: _amber.BF16,
    torch.float64: _amber.F64, torch.float8_e4m3fn: _amber.F8_E4M3,
    torch.float8_e5m2: _amber.F8_E5M2, torch.int64: _amber.I64, torch.int32: _amber.I32,
    torch.int16: _amber.I16, torch.int8: _amber.I8, torch.uint8: _amber.U8,
    torch.bool: _amber.BOOL, torch.uint16: _amber.U16, torch.uint32: _amber.U32,
    torch.uint64: _amber.U64,
}
_TORCH = {v: k for k, v in _DTYPES.items()}
# The dtypes that a "$dtype" value of the metadata may name: the torch dtypes, by the
# name save() writes for them (str(dtype) without "torch."). Nothing else is looked up.
_DTYPE_NAMES = {str(v).replace("torch.", ""): v for v in vars(torch).values()
                if isinstance(v, torch.dtype)}
_NP_KINDS = set("biuf")  # numpy arrays in metadata: booleans, integers, floats
_FORMAT = "amber.torch/1"
_DCP_FORMAT = "amber.dcp/1"  # amber.dcp's metadata, which load() also reads
_SKIP = object()  # an encoded value that is left out (code in a state_dict)


class StateMismatchError(AmberError):
    """The checkpoint and the state given to load() differ at `key`."""

    def __init__(self, key, message):
        self.key = key
        super().__init__(_amber.EMISMATCH, f"{key}: {message}", name="AMBER_EMISMATCH")


def _format_error(step, path, message):
    return AmberError(_amber.EFORMAT, f"step {step}: metadata at '{path}': {message}",
                      name="AMBER_EFORMAT")


def _parse_meta(raw, where):
    """The JSON value of a checkpoint's metadata `raw` (None when there is none or it
    is not JSON: the caller says whose metadata it expected). JSON nested beyond
    Python's recursion limit (a hostile file: "[" * 200000) raises AMBER_EFORMAT
    naming `where` (the store and step) instead of a bare RecursionError."""
    if not raw:
        return None
    try:
        return json.loads(raw)
    except ValueError:
        return None
    except RecursionError:
        raise AmberError(_amber.EFORMAT, f"{where}: its metadata nests JSON arrays or objects "
                         "beyond Python's recursion limit: not metadata that amber writes",
                         name="AMBER_EFORMAT") from None


def _rules(policy):
    if policy is None:
        return list(EXACT)
    if isinstance(policy, str):
        return list(PRESETS.get(policy, (policy,)))
    if isinstance(policy, dict):
        return [f"{k}={v}" for k, v in policy.items()]
    out = []
    for r in policy:
        out.extend(PRESETS.get(r, (r,)))
    return out


def _rules_have_units(rules):
    """Whether a rule writes a number in units ("threshold:0.5u", "budget:0.1:2u")."""
    for r in rules:
        parts = r.rpartition("=")[2].partition("@")[0].partition("/")[0].split(":")
        if (parts[0] == "threshold" and len(parts) > 1 and parts[1].endswith("u")) or \
                (parts[0] == "budget" and len(parts) > 2 and parts[2].endswith("u")):
            return True
    return False


# ---- naming: modules, FQNs and optimizers ------------------------------------------

def _plain(mod):
    """True when `mod` holds only plain tensors and no wrapper that renames or shards
    its state (DDP, FSDP, checkpoint wrappers: anything from torch.distributed):
    then its state_dict() with torch.compile's "_orig_mod." removed is exactly what
    get_model_state_dict gives, at a fraction of the cost (GPT-2 small: 0.4 ms
    against 5.5 ms per call; save() pays it at every step)."""
    for i, m in enumerate(mod.modules()):
        if type(m).__module__.startswith(("torch.distributed", "torch.nn.parallel")):
            return False
        if i and type(m).__name__ == "OptimizedModule":
            return False  # a compiled submodule: get_model_state_dict orders it last
    for t in itertools.chain(mod.parameters(), mod.buffers()):
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return False
    return True


def _plain_fqn(name):
    return ".".join(p for p in name.split(".") if p != "_orig_mod") if "_orig_mod" in name else name


def _fqn(module, name):
    """The fully qualified name that torch.distributed.checkpoint.state_dict gives the
    parameter or buffer `name` of `module` ("_orig_mod." of torch.compile and the
    "module." of DDP removed)."""
    try:
        fqns = _dsd._get_fqns(module, name)
        if len(fqns) == 1:
            return next(iter(fqns))
    except Exception:  # a private helper: fall back to the same rule by hand
        pass
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


class _Names:
    """The modules of one save/load call and the names of their parameters."""

    def __init__(self, state):
        self.modules = [(k, v) for k, v in state.items() if isinstance(v, torch.nn.Module)]
        self.single = len(self.modules) == 1
        self.by_id = {}  # id(parameter) -> name ("<FQN>" or "<module key>/<FQN>")
        self.aliases = {}  # id(parameter) -> every name (tied weights have several)
        self.plain = {}  # id(module) -> _plain(module)
        for key, mod in self.modules:
            plain = self.plain[id(mod)] = _plain(mod)
            for pname, p in mod.named_parameters(remove_duplicate=False):
                fqn = _plain_fqn(pname) if plain else _fqn(mod, pname)
                self.aliases.setdefault(id(p), []).append(fqn if self.single else f"{key}/{fqn}")
                if id(p) not in self.by_id:
                    self.by_id[id(p)] = fqn if self.single else f"{key}/{fqn}"

    def optimizer_params(self, opt):
        """The optimizer's parameters in state_dict order, and their names."""
        params, seen = [], set()
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params, [self.by_id.get(id(p), f"param{i}") for i, p in enumerate(params)]

    def owner(self, opt):
        """The module that get_optimizer_state_dict can name `opt`'s parameters
        against: the call's one module when it owns all of them; else None."""
        if not self.single:
            return None
        params, _ = self.optimizer_params(opt)
        mod = self.modules[0][1]
        own = {id(p) for p in mod.parameters()}
        return mod if all(id(p) in own for p in params) else None


def _model_state(mod, plain=None):
    """get_model_state_dict(mod): FQN -> value (the module's tensors themselves, not
    copies, for modules that are not FSDP1-wrapped). A plain module's comes from its
    own state_dict() (see _plain; tests/python/test_torch_v2.py checks that both agree)."""
    if plain if plain is not None else _plain(mod):
        return {_plain_fqn(k): v for k, v in mod.state_dict().items()}
    return _dsd.get_model_state_dict(mod)


def _optimizer_state(opt, names):
    """The optimizer's state_dict with parameters named: ({name: {k: v}}, groups).
    Through get_optimizer_state_dict when the call's module owns every parameter and
    the optimizer has state (it would otherwise take a zero-lr step to create it)."""
    params, pnames = names.optimizer_params(opt)
    mod = names.owner(opt)
    # for a plain module, the renaming below is what get_optimizer_state_dict does
    if mod is not None and opt.state and not names.plain[id(mod)]:
        osd = _dsd.get_optimizer_state_dict(mod, opt)
        return dict(osd["state"]), [dict(g) for g in osd["param_groups"]]
    sd = opt.state_dict()
    state = {}
    for idx, s in sd["state"].items():
        if not isinstance(idx, int) or idx >= len(pnames):
            raise TypeError(f"optimizer state key {idx!r} is not a parameter index")
        state[pnames[idx]] = s
    groups = [dict(g, params=[pnames[i] for i in g["params"]]) for g in sd["param_groups"]]
    return state, groups


# ---- save side: state -> (named tensors, JSON) ----------------------------------------

def _is_dtensor(t):
    return _DTensor is not None and isinstance(t, _DTensor)


def _local(t):
    """The tensor that holds `t`'s data on this rank: a DTensor's local shard, else `t`."""
    return t.to_local() if _is_dtensor(t) else t


class _Flat:
    """Tensors of one save in declaration order, and the JSON that describes the rest.
    `owned` holds the storages of the optimizers' parameters and state: those are
    read in place; every other tensor is captured (copied) at save(). With `dist`
    (the distributed Checkpointer) DTensors are taken as they are: shards of their
    global tensors."""

    def __init__(self, dist=False, reserved=frozenset()):
        self.tensors = []  # (name, tensor as given, detached)
        self.names = set()
        self.reserved = reserved  # names taken already (a save plan's cached tensors)
        self.dist = dist

    def tensor(self, name, t):
        if name in self.names or name in self.reserved:
            raise ValueError(f"{name}: two tensors of the state have this name")
        if _is_dtensor(t) and not self.dist:
            raise TypeError(f"{name}: a DTensor, and torch.distributed is not initialized with "
                            "more than one rank (the distributed Checkpointer saves DTensors; "
                            "pass process_group= to use it)")
        if self.dist and _is_dtensor(t):
            pass
        elif not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor and \
                not isinstance(t, torch.nn.Parameter):
            raise TypeError(f"{name}: {type(t).__name__} tensors are not supported "
                            "(DTensor and other tensor subclasses come with the distributed "
                            "Checkpointer)")
        if t.layout != torch.strided:
            raise TypeError(f"{name}: {t.layout} tensors are not supported")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported by amber")
        self.names.add(name)
        self.tensors.append((name, t.detach()))
        return {"$t": name}

    def enc(self, x, path, code_ok=False):
        """JSON for `x`; tensors become {"$t": name} references."""
        if isinstance(x, torch.Tensor):
            return self.tensor(path, x)
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if x == x and abs(x) != float("inf") else {"$f": repr(x)}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                out = {}
                for k, v in x.items():
                    e = self.enc(v, f"{path}/{k}", code_ok)
                    if e is not _SKIP:
                        out[k] = e
                return out
            items = []
            for k, v in x.items():
                e = self.enc(v, f"{path}/{k}", code_ok)
                if e is not _SKIP:
                    items.append([self.enc(k, f"{path}/<key>"), e])
            return {"$d": items}
        if isinstance(x, (list, tuple)):
            out = [self.enc(v, f"{path}/{i}", code_ok) for i, v in enumerate(x)]
            out = [None if e is _SKIP else e for e in out]
            return out if type(x) is list else {"$tuple": out}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).replace("torch.", "")}
        if _np is not None and isinstance(x, _np.generic):
            return self.enc(x.item(), path, code_ok)
        if _np is not None and isinstance(x, _np.ndarray):
            if x.dtype.kind not in _NP_KINDS:
                raise TypeError(f"{path}: numpy arrays of dtype {x.dtype} are not supported")
            return {"$np": {"dtype": x.dtype.str, "shape": list(x.shape), "data": x.ravel().tolist()}}
        if code_ok and callable(x):
            return _SKIP
        raise TypeError(f"{path}: cannot checkpoint a value of type {type(x).__name__} "
                        "(not a tensor, a state_dict holder or JSON-able data)")

    def optimizer(self, opt, key, names):
        state, groups = _optimizer_state(opt, names)
        out_state = {pn: self.enc(dict(s), f"{key}/{pn}") for pn, s in state.items()}
        out_groups = []
        for g in groups:
            e = self.enc({k: v for k, v in g.items() if k != "params"}, f"{key}/param_groups")
            e["params"] = list(g["params"])
            out_groups.append(e)
        return {"type": "optimizer", "class": type(opt).__name__, "state": out_state,
                "param_groups": out_groups}

    def rng(self):
        out, tensors = _rng_states()
        for name, t in tensors:
            self.tensor(name, t)
        return out


def _rng_states():
    """The RNG states: (their metadata, [(name, new tensor)]): the torch CPU generator,
    CUDA's (if in use), Python's `random` and NumPy's global generator."""
    out, tensors = {}, [("rng/torch", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.device_count()
        tensors += [(f"rng/cuda{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    version, mt, gauss = random.getstate()
    tensors.append(("rng/python", torch.from_numpy(_np.array(mt, dtype=_np.int64))
                    if _np is not None else torch.tensor(mt, dtype=torch.int64)))
    out["python"] = {"version": version, "gauss_next": gauss}
    if _np is not None:
        name, keys, pos, has_gauss, cached = _np.random.get_state()
        tensors.append(("rng/numpy", torch.from_numpy(keys.astype(_np.int64))))
        out["numpy"] = {"name": name, "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)}
    return out, tensors


def _storage_key(t):
    t = _local(t)
    return t.untyped_storage().data_ptr() if t.numel() else None


def _owned_storages(state):
    """Storages of the saved optimizers' parameters and state tensors."""
    out = set()
    for v in state.values():
        if isinstance(v, torch.optim.Optimizer):
            for g in v.param_groups:
                for p in g["params"]:
                    out.add(_storage_key(p))
            for s in v.state.values():
                for t in s.values():
                    if isinstance(t, torch.Tensor):
                        out.add(_storage_key(t))
    out.discard(None)
    return out


class _UnitMap:
    """Where each flattened tensor's unit (what "Nu" in a policy rule multiplies)
    comes from: the learning rate of the param group of the parameter it belongs to
    (the parameter itself, under each of its names, and its optimizer state); none (0)
    for everything else. Made once per state structure; a save then reads the few
    groups' learning rates (lrs) and spreads them over the tensors (units) in one
    C-level call."""

    def __init__(self, flat, state):
        names = _Names(state)
        where, groups = {}, {}
        for okey, opt in state.items():
            if not isinstance(opt, torch.optim.Optimizer):
                continue
            for gi, g in enumerate(opt.param_groups):
                for p in g["params"]:
                    pname = names.by_id.get(id(p))
                    if pname is None:
                        continue
                    at = groups.setdefault((okey, gi), len(groups))
                    where[f"{okey}/{pname}"] = at  # its state: "<optim key>/<param>/<key>"
                    for alias in names.aliases[id(p)]:  # the parameter, under each name
                        where[f"{names.modules[0][0]}/{alias}" if names.single else alias] = at
        self.groups = list(groups)
        none = len(self.groups)  # lrs() + (0.0,): the unit of a tensor of no group
        at = [where.get(n, where.get(n.rpartition("/")[0], none)) for n, _ in flat.tensors]
        pick = itemgetter(*at) if at else (lambda lrs: ())
        self._pick = pick if len(at) != 1 else (lambda lrs: (pick(lrs),))

    def lrs(self, state):
        """Each group's learning rate now (0: a group that is gone, which the save
        plan's structure check rules out but for misuse, or an lr that is not a
        number, e.g. a tensor: no unit, which is exact, never looser)."""
        out = []
        for okey, gi in self.groups:
            opt = state.get(okey)
            pg = getattr(opt, "param_groups", ())
            lr = pg[gi].get("lr") if gi < len(pg) else None
            out.append(float(lr) if isinstance(lr, (int, float)) else 0.0)
        return tuple(out)

    def units(self, lrs):
        return list(self._pick(lrs + (0.0,)))


def _entry(flat, names, key, value):
    """The metadata entry of state[key], its tensors added to `flat`."""
    if isinstance(value, torch.Tensor):
        return {"type": "tensor", "value": flat.tensor(key, value)}
    if isinstance(value, torch.nn.Module):
        return {"type": "module", "state": flat.enc(_model_state(value, names.plain[id(value)]), key)}
    if isinstance(value, torch.optim.Optimizer):
        return flat.optimizer(value, key, names)
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return {"type": "object", "class": type(value).__name__,
                "state": flat.enc(value.state_dict(), key, code_ok=True)}
    return {"type": "value", "value": flat.enc(value, key)}


def _check_key(key, rng):
    if not isinstance(key, str) or not key:
        raise TypeError(f"state keys must be non-empty strings, not {key!r}")
    if rng and key == "rng":
        raise ValueError("state key 'rng' is reserved for the RNG states (or pass rng=False)")


def _flatten(state, rng, dist=False, spans=None):
    """(_Flat of the state's tensors, metadata). `spans`, when given, gets each key's
    (first, end) positions in flat.tensors."""
    flat = _Flat(dist)
    names = _Names(state)
    entries = {}
    for key, value in state.items():
        _check_key(key, rng)
        first = len(flat.tensors)
        entries[key] = _entry(flat, names, key, value)
        if spans is not None:
            spans[key] = (first, len(flat.tensors))
    meta = {"format": _FORMAT, "entries": entries}
    if rng:
        meta["rng"] = flat.rng()
    return flat, meta


def _buffer_storages(state):
    """Storages of the module buffers of the state: a forward pass may change them in
    place (BatchNorm's running statistics), so they are captured at save()."""
    out = set()
    for v in state.values():
        if isinstance(v, torch.nn.Module):
            for b in v.buffers():
                out.add(_storage_key(b))
    out.discard(None)
    return out


def _in_place(t, nbytes, owned, buffers):
    """Whether save() reads `t` in place until the fence (else it copies it now): a
    contiguous CPU tensor whose version counter the fence can check (an inference
    tensor has none), when a saved optimizer owns it (its step is fenced: any size),
    or else when it is above CAPTURE_BYTES and not a module buffer (the next forward
    pass may change a buffer in place: BatchNorm's running statistics)."""
    if not (t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and
            not t.is_neg() and not t.is_inference()):
        return False
    key = _storage_key(t)
    if key in owned:
        return True
    return nbytes > CAPTURE_BYTES and key not in buffers


_version = attrgetter("_version")


class _Versions:
    """The version counters of the tensors a save reads in place, taken at save() and
    compared at the fence (one list each way: no per-tensor objects)."""
    __slots__ = ("names", "tensors", "seen")

    def __init__(self, names, tensors):
        self.names, self.tensors = names, tensors
        self.seen = list(map(_version, tensors))

    def __bool__(self):
        return bool(self.tensors)

    def changed(self):
        """The first tensor whose counter moved, or None."""
        now = list(map(_version, self.tensors))
        if now == self.seen:
            return None
        return next(n for n, a, b in zip(self.names, now, self.seen) if a != b)


# Registrations of parameters, buffers and submodules anywhere (torch's global
# registration hooks, installed by the first save plan): a plan is stale once a
# module gained one.
_REGISTRATIONS = [0, False]
_SEP = (",", ":")


def _registered(*_):
    _REGISTRATIONS[0] += 1


def _watch_registrations():
    if not _REGISTRATIONS[1]:
        from torch.nn.modules import module as _mm
        _mm.register_module_parameter_registration_hook(_registered)
        _mm.register_module_buffer_registration_hook(_registered)
        _mm.register_module_module_registration_hook(_registered)
        _REGISTRATIONS[1] = True


def _weak(x):
    return None if x is None else weakref.ref(x)


class _Gone:
    pass


_none = weakref.ref(_Gone())  # dead at once: a weak reference that gives None
call = weakref.ref.__call__   # what a weak reference refers to (None when it is gone)

_vars = attrgetter("__dict__")
_sd_hooks = itemgetter("_state_dict_hooks")
_sd_pre_hooks = itemgetter("_state_dict_pre_hooks")
_data_ptr = torch.Tensor.data_ptr
_contiguous = torch.Tensor.is_contiguous


def _module_slots(mod, mods, expect, prefix=""):
    """What mod.state_dict() holds, found where it lives: appends to `mods` each
    submodule (weakly) with those of its _parameters, _buffers and _modules that hold
    anything, and to `expect` a weak reference to each value they hold (what a later
    save compares by identity; an entry registered since is seen by torch's
    registration hooks); returns the state dict's (key, tensor) in its order, or None
    when it holds anything else (extra state)."""
    if type(mod).get_extra_state is not torch.nn.Module.get_extra_state:
        return None
    keys = []
    mods.append((weakref.ref(mod), tuple(a for a in ("_parameters", "_buffers", "_modules")
                                         if getattr(mod, a))))
    for a in mods[-1][1]:
        expect += [_none if o is None else weakref.ref(o) for o in getattr(mod, a).values()]
    for n, p in mod._parameters.items():
        if p is not None:
            keys.append((prefix + n, p))
    for n, b in mod._buffers.items():
        if b is not None and n not in mod._non_persistent_buffers_set:
            keys.append((prefix + n, b))
    for n, c in mod._modules.items():
        if c is not None:
            sub = _module_slots(c, mods, expect, prefix + n + ".")
            if sub is None:
                return None
            keys += sub
    return keys


def _plain_equal(a, b):
    """a == b for JSON-like values (dicts, lists, tuples, numbers, strings, None),
    False as soon as either holds anything else (a tensor's == is elementwise)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_plain_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_plain_equal(x, y) for x, y in zip(a, b))
    if a is None or isinstance(a, (bool, int, float, str)):
        return a == b or (a != a and b != b)  # NaN: the same encoding
    return False


def _tree(x):
    """(spec, leaves) of a value that is a tensor, or dicts (string keys) of dicts and
    tensors: what save() encodes the same way at every save while the same tensors sit
    at the same keys; (None, None) for anything else."""
    if isinstance(x, torch.Tensor):
        return _LEAF, [x]
    if type(x) is not dict or not all(isinstance(k, str) and k and not k.startswith("$")
                                      for k in x):
        return None, None
    if all(isinstance(v, torch.Tensor) for v in x.values()):
        return ("L", tuple(x)), list(x.values())
    specs, leaves = [], []
    for v in x.values():
        spec, sub = _tree(v)
        if spec is None:
            return None, None
        specs.append(spec)
        leaves += sub
    return ("D", tuple(x), specs), leaves


_LEAF = ("T",)


def _tree_now(x, spec, out):
    """Appends to `out` what sits now where spec's leaves sat; False when the shape of
    the tree changed."""
    if spec is _LEAF:
        out.append(x)
        return True
    if type(x) is not dict or tuple(x) != spec[1]:
        return False
    if spec[0] == "L":
        out += x.values()
        return True
    return all(_tree_now(v, sp, out) for v, sp in zip(x.values(), spec[2]))


class _Plan:
    """What save() learns once about a state whose structure stays the same from save
    to save (the same modules with the same parameters and buffers, the same
    optimizers with the same parameters and state tensors): those entries' tensors in
    declaration order, how each is read (in place, or copied into its staging
    buffer), their part of the metadata as JSON text, and what shows that nothing of
    that changed (the objects themselves, by identity through weak references: a plan
    keeps nothing alive; the tensors' addresses). param_groups, objects such as
    schedulers, plain values and RNG states are encoded at every save. A save whose
    check fails takes the full path, which makes a new plan."""

    def __init__(self):
        self.layout = []     # (key, weakref(value), kind, data) per state key, in order
        self.mods = []       # weakref of every submodule of the cached modules
        self.held = []       # (position in mods, dict name) of each non-empty dict of theirs
        self.expect = []     # weakref of each value those dicts hold, in that order
        self.opts = []       # (weakref(optimizer), data) of the optimizer entries
        self.trees = []      # (key, spec) of the entries of tensors in dicts (_tree)
        self.leaves = []     # weakref of each of their tensors, in order
        self.static = []     # where each cached tensor is among the slots check() compares
        self.ptrs = []       # their data_ptr at planning
        self.copy_at, self.copy_dst = [], []  # positions in static copied at save(), stages
        self.inplace_at, self.inplace_names = [], []  # positions read in place, names
        self.dynamic = []    # (name, dtype, shape) of the tensors encoded at every save
        self.names = frozenset()  # the cached tensors' names
        self.owned = self.buffers = frozenset()
        self.reg = _REGISTRATIONS[0]

    def check(self, state):
        """The cached tensors, when `state` still has the planned structure; else None.
        Written as whole-list operations (map, chain) rather than Python loops: it
        runs at every save, over every submodule and every tensor of the state."""
        if self.reg != _REGISTRATIONS[0] or len(state) != len(self.layout):
            return None
        for (key, ref, _, _), (k, v) in zip(self.layout, state.items()):
            if k != key or (ref is not None and v is not ref()):
                return None
        mods = list(map(call, self.mods))
        if None in mods:
            return None
        dicts = list(map(_vars, mods))
        if any(map(_sd_hooks, dicts)) or any(map(_sd_pre_hooks, dicts)):
            return None
        # what every planned slot holds now, and what it held: compared by identity at once
        cur = list(chain.from_iterable(map(dict.values, [dicts[i][a] for i, a in self.held])))
        expect = list(map(call, self.expect))
        for ref, data in self.opts:
            opt = ref()
            if opt is None or opt._optimizer_state_dict_pre_hooks or \
                    opt._optimizer_state_dict_post_hooks or \
                    len(opt.param_groups) != len(data["groups"]):
                return None
            for g, params in zip(opt.param_groups, data["groups"]):
                ps = g["params"]
                if len(ps) != len(params):
                    return None
                cur += ps
                expect += map(call, params)
            # the parameters that have state, in the state's order, then their state
            # tensors: no lookup by parameter (a tensor's hash is a Python call)
            cur += opt.state.keys()
            cur += chain.from_iterable(map(dict.values, opt.state.values()))
            expect += map(call, data["pkeys"])
            expect += map(call, data["pvals"])
        for key, spec in self.trees:
            if not _tree_now(state[key], spec, cur):
                return None
        expect += map(call, self.leaves)
        if len(cur) != len(expect) or not all(map(is_, cur, expect)):
            return None
        tensors = list(map(cur.__getitem__, self.static))  # they are among those slots
        # the same memory, laid out the same way (`.data = x` swaps both without a trace;
        # a transposed view of a square matrix keeps the address)
        if list(map(_data_ptr, tensors)) != self.ptrs or \
                not all(map(_contiguous, map(tensors.__getitem__, self.inplace_at))):
            return None
        return tensors


def _plan_of(state, flat, meta, spans, how, stage, rng):
    """A _Plan of the save just made (see _Plan), or None when the state has a part
    that must be encoded at every save after all (a module that is not plain, an
    optimizer with non-tensor state or state_dict hooks, a tensor on the device path)."""
    _watch_registrations()
    names = _Names(state)
    plan = _Plan()
    static = set()
    owners = {}
    for key, value in state.items():
        a, b = spans[key]
        entry = meta["entries"][key]
        kind, data = "dynamic", None
        if isinstance(value, torch.nn.Module):
            if not names.plain[id(value)]:
                return None
            mods, expect = [], []
            keys = _module_slots(value, mods, expect)
            st = entry["state"]
            if keys is None or len(keys) != b - a or len(st) != b - a or \
                    [_plain_fqn(k) for k, _ in keys] != list(st) or \
                    not all(isinstance(e, dict) and list(e) == ["$t"] for e in st.values()):
                return None
            for i, (_, t) in enumerate(keys):
                owners[a + i] = t
            for ref, attrs in mods:
                plan.held += [(len(plan.mods), a) for a in attrs]
                plan.mods.append(ref)
            plan.expect += expect
            kind = "module"
            data = {"json": (json.dumps(key) + ":" + json.dumps(entry, allow_nan=False,
                                                               separators=_SEP)).encode()}
        elif isinstance(value, torch.optim.Optimizer):
            mod = names.owner(value)
            if type(value).state_dict is not torch.optim.Optimizer.state_dict or \
                    value._optimizer_state_dict_pre_hooks or \
                    value._optimizer_state_dict_post_hooks or \
                    (mod is not None and value.state and not names.plain[id(mod)]):
                return None
            params, pnames = names.optimizer_params(value)
            by_name = dict(zip(pnames, params))
            st = value.state
            vals = []
            for pn, s in entry["state"].items():
                live = st.get(by_name.get(pn)) or {}
                if list(s) != list(live) or not all(isinstance(e, dict) and list(e) == ["$t"]
                                                    for e in s.values()) or \
                        not all(isinstance(v, torch.Tensor) for v in live.values()):
                    return None
                vals += list(live.values())
            pkeys, pvals = [], []
            for p, live in st.items():
                pkeys.append(weakref.ref(p))
                pvals += [weakref.ref(v) for v in live.values()]
            if len(vals) > b - a:
                return None
            for i, t in enumerate(vals):
                owners[a + i] = t
            n_static = len(vals)
            head = (json.dumps(key) + ':{"type":"optimizer","class":' +
                    json.dumps(type(value).__name__) + ',"state":' +
                    json.dumps(entry["state"], allow_nan=False, separators=_SEP) +
                    ',"param_groups":').encode()
            data = {"head": head, "n": n_static, "fields": None, "text": None,
                    "groups": [[weakref.ref(p) for p in g["params"]] for g in value.param_groups],
                    "gnames": [list(e["params"]) for e in entry["param_groups"]],
                    "pkeys": pkeys, "pvals": pvals}
            plan.opts.append((weakref.ref(value), data))
            kind = "optimizer"
            b = a + n_static  # the param_groups' tensors, if any, are encoded at every save
        elif not (hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
            spec, leaves = _tree(value)
            if spec is not None and len(leaves) == b - a:
                for i, t in enumerate(leaves):
                    owners[a + i] = t
                plan.trees.append((key, spec))
                plan.leaves += [weakref.ref(t) for t in leaves]
                kind = "tree"
                data = {"json": (json.dumps(key) + ":" + json.dumps(
                    entry, allow_nan=False, separators=_SEP)).encode(), "n": b - a}
        if kind != "dynamic":
            for i in range(a, b):
                t, (name, det) = owners[i], flat.tensors[i]
                if t.data_ptr() != det.data_ptr() or t.shape != det.shape or t.dtype != det.dtype \
                        or how[i] is None:
                    return None
                static.add(i)
            if kind == "module":
                data["n"] = b - a
        plan.layout.append((key, None if kind in ("dynamic", "tree") else weakref.ref(value),
                            kind, data))
    for i, (name, t) in enumerate(flat.tensors):
        if how[i] is None:  # the device path
            return None
        if i not in static:
            plan.dynamic.append((name, t.dtype, t.shape))
            continue
        k = len(plan.static)
        plan.static.append(owners[i])  # made a position below
        plan.ptrs.append(owners[i].data_ptr())
        if how[i] == "inplace":
            plan.inplace_at.append(k)
            plan.inplace_names.append(name)
        else:
            if owners[i].is_conj() or owners[i].is_neg():
                return None
            plan.copy_at.append(k)
            plan.copy_dst.append(stage[name])
    seq = [r() for r in plan.expect]  # the slots, in the order check() lists them
    for _, data in plan.opts:
        for params in data["groups"]:
            seq += [r() for r in params]
        seq += [r() for r in data["pkeys"]]
        seq += [r() for r in data["pvals"]]
    seq += [r() for r in plan.leaves]
    at = {}
    for i, o in enumerate(seq):
        at.setdefault(id(o), i)
    if any(id(t) not in at for t in plan.static):
        return None
    plan.static = [at[id(t)] for t in plan.static]
    plan.names = frozenset(flat.tensors[i][0] for i in static)
    plan.owned = frozenset(_owned_storages(state))
    plan.buffers = frozenset(_buffer_storages(state))
    return plan


# ---- load side: (reader, JSON) -> a plan, then the live state -------------------------

class _Load:
    """One load in two passes. plan() decodes everything that needs no tensor data
    and checks it against the state (raising before anything changes); it collects
    the tensor reads (into live tensors, or into new ones) and the updates that
    apply them. apply() then reads the tensors and applies the updates."""

    def __init__(self, reader, strict, step):
        self.r = reader
        self.strict = strict
        self.step = step
        self.fresh = []     # reads into new tensors: (idx, tensor, box)
        self.inplace = []   # reads into live tensors: (idx, tensor, entry key, box)
        # box: None for the whole tensor, else (offsets, shape) of a DTensor's shard
        # in its global tensor (the distributed Checkpointer's reader serves it)
        self.after = []     # (entry key, fn) run after the reads
        self.copies = []    # (live target, staging tensor): copy_ after the reads
        self.tensors = {t.name: t for t in reader.tensors()}
        self.key = None     # the entry being planned

    def mismatch(self, key, msg):
        if self.strict:
            raise StateMismatchError(key, msg)

    def bad(self, path, msg):
        raise _format_error(self.step, path, msg)

    def tensor(self, name, target=None, device=None):
        """Plans the restore of tensor `name` into `target` (in place; returned) or
        into a new tensor (returned, filled by apply())."""
        if not isinstance(name, str):
            self.bad(name, "a tensor reference that is not a name")
        info = self.tensors.get(name)
        if info is None:
            raise AmberError(_amber.ECORRUPT, f"step {self.step}: the metadata names tensor "
                             f"'{name}', which the checkpoint does not hold", name="AMBER_ECORRUPT")
        dtype = _TORCH.get(info.dtype)
        if dtype is None:
            raise TypeError(f"{name}: amber dtype {_amber.dtype_name(info.dtype)} has no torch dtype")
        if isinstance(target, torch.Tensor):
            # a skipped mismatch (strict=False) leaves the live tensor as it is
            if tuple(target.shape) != info.shape:
                self.mismatch(name, f"shape {list(info.shape)} in the checkpoint of step "
                              f"{self.step}, {list(target.shape)} in the state")
                return target
            if target.dtype != dtype:
                self.mismatch(name, f"dtype {dtype} in the checkpoint of step {self.step}, "
                              f"{target.dtype} in the state")
                return target
            local, box = self.box(target)
            if local.device.type == "cpu" and local.is_contiguous():
                self.inplace.append((info.index, local, self.key, box))
            else:
                tmp = torch.empty(local.shape, dtype=dtype)
                self.fresh.append((info.index, tmp, box))
                self.copies.append((local, tmp))
            return target
        t = torch.empty(info.shape, dtype=dtype)
        self.fresh.append((info.index, t, None))
        if device is not None and torch.device(device).type != "cpu":
            dev = torch.empty(info.shape, dtype=dtype, device=device)
            self.copies.append((dev, t))
            return dev
        return t

    def box(self, target):
        """(local tensor, box) of a live tensor: the whole of a plain one (DTensors
        come with the distributed Checkpointer, whose _Load overrides this)."""
        if _is_dtensor(target):
            raise TypeError(f"{self.key}: a DTensor in the state, and this Checkpointer is not "
                            "distributed (pass process_group=)")
        return target, None

    def dec(self, e, path, target=None, device=None):
        """The value that JSON `e` describes; tensors are planned into the tensor at
        the same place of `target` when there is one. Values nested beyond Python's
        recursion limit (hostile metadata) are a format error naming the step."""
        try:
            return self._dec(e, path, target, device)
        except RecursionError:
            raise _format_error(self.step, path, "values nested too deeply (beyond Python's "
                                "recursion limit): not metadata that amber writes") from None

    def _dec(self, e, path, target=None, device=None):
        if isinstance(e, list):
            tl = target if isinstance(target, (list, tuple)) else ()
            return [self._dec(v, f"{path}/{i}", tl[i] if i < len(tl) else None, device)
                    for i, v in enumerate(e)]
        if e is None or isinstance(e, (bool, int, float, str)):
            return e
        if not isinstance(e, dict):
            self.bad(path, f"a value of type {type(e).__name__}")
        if len(e) == 1:
            (tag, v), = e.items()
            if tag == "$t":
                return self.tensor(v, target, device)
            if tag == "$f":
                if not isinstance(v, str):
                    self.bad(path, "a float that is not a string")
                try:
                    return float(v)
                except ValueError:
                    self.bad(path, f"'{v}' is not a float")
            if tag == "$tuple":
                if not isinstance(v, list):
                    self.bad(path, "a tuple that is not a list")
                tl = target if isinstance(target, (list, tuple)) else ()
                return tuple(self._dec(x, f"{path}/{i}", tl[i] if i < len(tl) else None, device)
                             for i, x in enumerate(v))
            if tag == "$dtype":
                dt = _DTYPE_NAMES.get(v) if isinstance(v, str) else None
                if dt is None:
                    self.bad(path, f"{v!r} is not a torch dtype")
                return dt
            if tag == "$np":
                return self.numpy(v, path)
            if tag == "$d":
                if not isinstance(v, list) or not all(isinstance(i, list) and len(i) == 2 for i in v):
                    self.bad(path, "a dict that is not a list of pairs")
                td = target if isinstance(target, dict) else {}
                out = {}
                for k, x in v:
                    k = self._dec(k, path)
                    try:
                        hash(k)
                    except TypeError:
                        self.bad(path, f"a dict key of type {type(k).__name__}")
                    out[k] = self._dec(x, f"{path}/{k}", td.get(k), device)
                return out
        if any(k.startswith("$") for k in e):
            self.bad(path, f"unknown tag among {sorted(e)[:3]}")
        td = target if isinstance(target, dict) else {}
        return {k: self._dec(v, f"{path}/{k}", td.get(k), device) for k, v in e.items()}

    def numpy(self, a, path):
        if _np is None:
            self.bad(path, "a numpy array, and numpy is not installed")
        if not isinstance(a, dict) or set(a) != {"dtype", "shape", "data"}:
            self.bad(path, "a numpy array without dtype, shape and data")
        try:
            dt = _np.dtype(a["dtype"]) if isinstance(a["dtype"], str) else None
        except TypeError:
            dt = None
        if dt is None or dt.kind not in _NP_KINDS:
            self.bad(path, f"numpy dtype {a['dtype']!r} is not one amber writes")
        if not isinstance(a["shape"], list) or not all(isinstance(d, int) and d >= 0 for d in a["shape"]):
            self.bad(path, "a numpy shape that is not a list of sizes")
        if not isinstance(a["data"], list):
            self.bad(path, "numpy data that is not a list")
        try:
            return _np.array(a["data"], dtype=dt).reshape(a["shape"])
        except (ValueError, TypeError, OverflowError) as err:
            self.bad(path, f"numpy data does not decode: {err}")

    def keys(self, key, stored, current):
        """Mismatch on the first key present on one side only."""
        for k in stored:
            if k not in current:
                self.mismatch(f"{key}/{k}", f"in the checkpoint of step {self.step}, not in the state")
        for k in current:
            if k not in stored:
                self.mismatch(f"{key}/{k}", f"in the state, not in the checkpoint of step {self.step}")

    # -- entries --
    def module(self, key, entry, mod):
        stored = entry.get("state")
        if not isinstance(stored, dict):
            self.bad(key, "a module entry whose state is not a dict")
        stored = _compat_fqns(stored)
        sd = _model_state(mod)
        self.keys(key, stored, sd)
        live = {_local(t).data_ptr() for t in list(mod.parameters()) + list(mod.buffers())}
        restored = {}
        needs_load = False
        for k, e in stored.items():
            if k not in sd:
                continue
            v = self.dec(e, f"{key}/{k}", sd[k])
            if isinstance(sd[k], torch.Tensor) and not isinstance(v, torch.Tensor):
                self.bad(f"{key}/{k}", f"a {type(v).__name__} where the module has a tensor")
            restored[k] = v
            if not isinstance(v, torch.Tensor) or v is not sd[k] or _local(v).data_ptr() not in live:
                needs_load = True
        if needs_load:  # e.g. extra state, or a state_dict that is not a view of the module
            self.after.append((key, lambda: _dsd.set_model_state_dict(
                mod, restored, options=_dsd.StateDictOptions(strict=False))))

    def optimizer(self, key, entry, opt, names):
        if not isinstance(entry.get("state"), dict) or not isinstance(entry.get("param_groups"), list):
            self.bad(key, "an optimizer entry without state and param_groups")
        params, pnames = names.optimizer_params(opt)
        pos = {id(p): i for i, p in enumerate(params)}
        by_name = dict(zip(pnames, params))
        stored_state = _compat_fqns(entry["state"], slash=not names.single)
        stored_groups = entry["param_groups"]
        for gi, sg in enumerate(stored_groups):
            if not isinstance(sg, dict) or not isinstance(sg.get("params"), list):
                self.bad(f"{key}/param_groups/{gi}", "a parameter group without params")
            sg["params"] = [_compat_name(n, slash=not names.single) for n in sg["params"]]
        # param_groups must list the same parameters, by name, in the same order
        if len(stored_groups) != len(opt.param_groups):
            self.mismatch(f"{key}/param_groups", f"{len(stored_groups)} parameter groups in the "
                          f"checkpoint of step {self.step}, {len(opt.param_groups)} in the state")
        for gi, (sg, g) in enumerate(zip(stored_groups, opt.param_groups)):
            cur = [pnames[pos[id(p)]] for p in g["params"]]
            if sg["params"] != cur:
                only_ck = [n for n in sg["params"] if n not in cur]
                only_st = [n for n in cur if n not in sg["params"]]
                what = (f"parameter '{only_ck[0]}' of group {gi} is in the checkpoint only" if only_ck
                        else f"parameter '{only_st[0]}' of group {gi} is in the state only"
                        if only_st else f"group {gi} lists its parameters in another order")
                self.mismatch(f"{key}/param_groups", f"{what} (step {self.step})")
        new_state = {}
        for pn, e in stored_state.items():
            p = by_name.get(pn)
            if p is None:
                self.mismatch(f"{key}/{pn}", f"in the checkpoint of step {self.step}, but the "
                              f"optimizer has no parameter named '{pn}'")
                continue
            if not isinstance(e, dict):
                self.bad(f"{key}/{pn}", "parameter state that is not a dict")
            cur = opt.state.get(p) or {}
            if cur:
                self.keys(f"{key}/{pn}", e, cur)
            new_state[p] = {k: self.dec(v, f"{key}/{pn}/{k}", self.like(cur.get(k), v, p),
                                        p.device) for k, v in e.items()}
        for p, s in opt.state.items():
            if s and id(p) in pos and pnames[pos[id(p)]] not in stored_state:
                self.mismatch(f"{key}/{pnames[pos[id(p)]]}", "has optimizer state in the state, "
                              f"none in the checkpoint of step {self.step}")
        groups = []
        for i, g in enumerate(opt.param_groups):
            if i < len(stored_groups):
                ng = self.dec({k: v for k, v in stored_groups[i].items() if k != "params"},
                              f"{key}/param_groups/{i}")
            else:
                ng = {k: v for k, v in g.items() if k != "params"}
            ng["params"] = g["params"]
            groups.append(ng)
        self.after.append((key, lambda: _set_optimizer(opt, params, new_state, groups)))

    def like(self, target, e, param):
        """The live target of a parameter's optimizer state: the current one, or,
        when there is none yet and the parameter is a DTensor, a new DTensor
        sharded as the parameter when the stored tensor has its shape (FSDP2's
        moments), so that each rank reads only its shard."""
        if target is not None or not _is_dtensor(param) or not isinstance(e, dict) or \
                not isinstance(e.get("$t"), str) or len(e) != 1:
            return target
        info = self.tensors.get(e["$t"])
        if info is None or info.shape != tuple(param.shape) or info.dtype not in _TORCH:
            return None
        with torch.no_grad():
            return torch.empty_like(param, dtype=_TORCH[info.dtype]).detach()

    def value(self, key, e, target, state):
        if "value" not in e:
            self.bad(key, "a value entry without a value")
        v = self.dec(e["value"], key, target)

        def put():
            if isinstance(target, dict) and isinstance(v, dict):
                target.clear()
                target.update(v)
            elif isinstance(target, list) and isinstance(v, list):
                target[:] = v
            else:
                state[key] = v
        self.after.append((key, put))

    def entry(self, key, e, target, state, names):
        self.key = key
        if not isinstance(e, dict) or not isinstance(e.get("type"), str):
            self.bad(key, "an entry without a type")
        kind = e["type"]
        if kind == "module":
            if not isinstance(target, torch.nn.Module):
                return self.mismatch(key, f"a module in the checkpoint, a {type(target).__name__} in the state")
            self.module(key, e, target)
        elif kind == "optimizer":
            if not isinstance(target, torch.optim.Optimizer):
                return self.mismatch(key, f"an optimizer in the checkpoint, a {type(target).__name__} in the state")
            self.optimizer(key, e, target, names)
        elif kind == "object":
            if not hasattr(target, "load_state_dict"):
                return self.mismatch(key, f"a {e.get('class')} in the checkpoint, a "
                                     f"{type(target).__name__} in the state")
            cur = target.state_dict()
            stored = e.get("state")
            if isinstance(stored, dict) and isinstance(cur, dict) and "$d" not in stored:
                self.keys(key, stored, {k: v for k, v in cur.items() if not callable(v)})
            value = self.dec(stored, key, cur)
            self.after.append((key, lambda: target.load_state_dict(value)))
        elif kind == "tensor":
            ref = e.get("value")
            if not isinstance(ref, dict) or "$t" not in ref:
                self.bad(key, "a tensor entry without a tensor")
            v = self.tensor(ref["$t"], target if isinstance(target, torch.Tensor) else None)
            if v is not target:
                self.after.append((key, lambda: state.__setitem__(key, v)))
        elif kind == "value":
            self.value(key, e, target, state)
        else:
            self.bad(key, f"unknown entry type {kind!r}")

    def rng(self, meta):
        """Plans the RNG states; every field is checked here."""
        self.key = "rng"
        if not isinstance(meta, dict):
            self.bad("rng", "RNG states that are not a dict")
        t = self.tensor("rng/torch")
        n = meta.get("cuda", 0)
        if not isinstance(n, int) or n < 0:
            self.bad("rng/cuda", "a CUDA device count that is not a count")
        cuda = [self.tensor(f"rng/cuda{i}") for i in range(n)] if n else []
        py = meta.get("python")
        if not isinstance(py, dict) or not isinstance(py.get("version"), int) or \
                not (py.get("gauss_next") is None or isinstance(py.get("gauss_next"), (int, float))):
            self.bad("rng/python", "Python RNG state without version and gauss_next")
        mt = self.tensor("rng/python")
        npm = meta.get("numpy") if _np is not None else None
        if npm is not None:
            ok = isinstance(npm, dict) and isinstance(npm.get("name"), str) and \
                all(isinstance(npm.get(f), int) for f in ("pos", "has_gauss")) and \
                isinstance(npm.get("cached_gaussian"), (int, float))
            if not ok:
                self.bad("rng/numpy", "NumPy RNG state without name, pos, has_gauss, cached_gaussian")
            keys = self.tensor("rng/numpy")

        def put():
            torch.set_rng_state(t)
            if cuda and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(cuda)
            random.setstate((py["version"], tuple(mt.tolist()), py["gauss_next"]))
            if npm is not None:
                _np.random.set_state((npm["name"], keys.numpy().astype(_np.uint32), npm["pos"],
                                      npm["has_gauss"], npm["cached_gaussian"]))
        self.after.append(("rng", put))

    # -- the second pass --
    def apply(self):
        """Reads every planned tensor and applies the updates. Reads into new
        tensors come first: until they are done no live tensor has changed."""
        _read_many(self.r, self.fresh)
        done = []
        try:
            _read_many(self.r, [(i, t, b) for i, t, _, b in self.inplace])
        except AmberError as err:
            keys = ", ".join(dict.fromkeys(k for _, _, k, _ in self.inplace))
            partial = AmberError(err.code, f"{err.message}; the live state is partially loaded: "
                                 f"tensors of {keys} may hold values of step {self.step}, the "
                                 "others their previous values, and nothing else was restored "
                                 "(load(..., fallback=True) verifies a step whole before "
                                 "restoring it)", name=err.name)
            partial.partial = True
            raise partial from err
        with torch.no_grad():
            for target, src in self.copies:
                target.copy_(src)
        for key, fn in self.after:
            fn()
            done.append(key)


def _read_many(reader, items):
    """Reads (index, tensor, box) triples with one read_many (box: None for the
    whole tensor, else a region for a reader that serves regions). Tensors that
    share memory (tied weights) are read once: the library's buffers must not
    overlap."""
    once, later, seen = [], [], {}
    for idx, t, box in items:
        n = t.numel() * t.element_size()
        if not n:
            continue
        it = (idx, t.data_ptr(), n) if box is None else (idx, t.data_ptr(), n, box)
        size = seen.setdefault(it[1], n)
        if size != n:
            later.append(it)  # another extent at the same address: after the rest
        elif len(seen) > len(once):
            once.append(it)
    reader.read_many(once)
    for it in later:
        reader.read_into(*it)


def _compat_name(name, slash=False):
    """A stored parameter name in today's convention: names that amber.torch wrote
    for a torch.compile'd or DDP-wrapped module before it used FQNs carry
    "_orig_mod." / "module." components."""
    if not isinstance(name, str):
        return name
    head, sep, tail = name.rpartition("/") if slash else ("", "", name)
    parts = tail.split(".")
    if "_orig_mod" in parts:
        parts = [p for p in parts if p != "_orig_mod"]
    return head + sep + ".".join(parts)


def _compat_fqns(stored, slash=False):
    if not any(isinstance(k, str) and "_orig_mod" in k for k in stored):
        return stored
    return {_compat_name(k, slash): v for k, v in stored.items()}


def _set_optimizer(opt, params, new_state, groups):
    """Installs the restored state and param_groups, without copying tensors."""
    if type(opt).load_state_dict is torch.optim.Optimizer.load_state_dict:
        # what Optimizer.load_state_dict does, minus its casts (the tensors already
        # have the parameters' dtypes and devices)
        from collections import defaultdict
        state = defaultdict(dict)
        state.update(new_state)
        opt.__setstate__({"state": state, "param_groups": groups})
    else:  # a custom optimizer: go through its own load_state_dict
        index = {id(p): i for i, p in enumerate(params)}
        opt.load_state_dict({
            "state": {index[id(p)]: s for p, s in new_state.items() if id(p) in index},
            "param_groups": [dict(g, params=[index[id(p)] for p in g["params"]])
                             for g in groups]})


# ---- the Checkpointer -------------------------------------------------------------

def _prune_warning(status, last, what):
    """Warns (PruneWarning) that `what`, with the retention's failure message, once
    per distinct failure; `status` is a writer's prune_status(), `last` the message
    warned of last time. Returns the message to remember."""
    rc, _, msg = status
    if rc and msg != last:
        warnings.warn(f"amber: {what}: {msg}", _amber.PruneWarning, stacklevel=3)
    return msg if rc else None


class Checkpointer:
    """Saves and restores training state in the amber store at `path`.

    Checkpointer(path, policy=None, full_every=None, full_share=None, rng=True,
                 readonly=False, threads=0, chunk_elems=0, keep_last=None)
      policy: "exact" (default, also for None), "lossy", "lossy-frequent", "lossy-compact",
              "lossy-capped", a rule, a list of rules or a dict {pattern: spec} (see the module's documentation).
      full_every: a full checkpoint after this many deltas (None: library default,
              50). full_share: also once the deltas since the last full add up to
              this share of it (None: library default, 0.5; negative: never).
      rng: save and restore the RNG states (torch, random, numpy).
      keep_last: retention; after each committed save, remove every checkpoint
              but the newest keep_last and those their restores need (a delta's
              parents back to its full checkpoint). None: keep everything. Runs
              in the background with the save; a failure to remove a file does
              not fail the save: it is reported as an amber.PruneWarning and
              tried again after the next save.
      readonly: open the store without its lock, for load() only.
      threads, chunk_elems: passed to the library (0: its defaults).
      process_group: with torch.distributed initialized, the group whose ranks
              save and load together (default: the world). The Checkpointer is
              then the distributed one (amber._dist.DistCheckpointer): every rank
              constructs it on the same path and calls save()/load() collectively
              with its local state; DTensors are saved as shards of their global
              tensors and load at another world size. It is distributed whenever
              torch.distributed is initialized with more than one rank.

    The store is locked while the Checkpointer is open (AMBER_ELOCKED for a second
    writer). `timings` holds the last save's seconds: "save" (the save() call),
    "fence" (the wait for the scan), "wait" (the last wait for durability)."""

    def __new__(cls, *args, process_group=None, **kwargs):
        path = args[0] if args else kwargs.get("path")
        if cls is Checkpointer and (_distributed(process_group) or
                                    (path is not None and _amber.is_global_store(path))):
            # many ranks; or one process on a store that many ranks wrote (it loads and
            # saves that store at world size 1, as amber._dist does at any other)
            from amber._dist import DistCheckpointer
            return super().__new__(DistCheckpointer)
        return super().__new__(cls)

    def __init__(self, path, policy=None, full_every=None, full_share=None, rng=True,
                 readonly=False, threads=0, chunk_elems=0, keep_last=None, process_group=None):
        self._rules = _rules(policy)
        self._has_units, self._units = _rules_have_units(self._rules), None
        self._unit_map = self._unit_lrs = None  # with rules in units: _UnitMap, its lrs
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, not {keep_last!r}")
        self._wopts = {"chunk_elems": chunk_elems or 0, "full_every": full_every or 0,
                       "full_share": float(full_share or 0.0)}
        if keep_last:
            self._wopts["keep_last"] = keep_last
        self._prune_msg = None
        self.rng = rng
        self.readonly = readonly
        parent = os.path.dirname(os.path.abspath(os.fspath(path)))
        if not readonly:
            os.makedirs(parent, exist_ok=True)  # "runs/x" without a "runs/" yet
        self.store = Store(path, readonly=readonly, create=not readonly, threads=threads)
        self.path = self.store.path
        self._writer = None
        self._dev = None     # amber.device.DevicePath: the writer's accelerator tensors
        self._dev_job = None    # amber.device.Background: the device selection on a thread
        self._dev_error = None  # its failure, raised by wait()
        self._inplace = False   # the save in progress reads CPU tensors in place
        self._sig = None
        self._ptrs = []
        self._stage = {}     # name -> reused staging tensor for captured tensors
        self._pinned = None  # tensors the scan in progress reads; dropped at the fence
        self._versions = None  # [(name, tensor, version at save())] checked at the fence
        self._gated = False  # the save in progress waits for confirm()
        self._hooks = {}     # id(optimizer) -> (weakref(optimizer), undo)
        self._saveplan = None    # _Plan: what the last save learned of its state's structure
        self._seeding = None  # the background seed after a load: (thread, _Versions, outcome)
        self._global_hook = _fence_before_any_step(self)
        self.timings = {"save": 0.0, "fence": 0.0, "wait": 0.0}
        self.skipped = 0
        self.seeded = False  # the last load() seeded the writer's reference

    # -- context manager --
    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:  # do not hide the original exception behind a save's failure
            try:
                self.close()
            except AmberError:
                pass

    @property
    def closed(self):
        return self.store is None

    def _open(self):
        if self.store is None:
            raise ValueError("Checkpointer is closed")

    # -- saving --
    def save(self, step, state, full=False):
        """Checkpoints `state` (a dict, see the module's documentation) as `step`.
        Returns once the scan has started; what may happen before the fence is in
        the module's documentation. full=True forces a full checkpoint. Raises the
        failure of the previous background save, if any."""
        self._open()
        if self.readonly:
            raise AmberError(_amber.EREADONLY, f"store {self.path} is open read-only",
                             name="AMBER_EREADONLY")
        t0 = time.perf_counter()
        self.wait()
        if not self._save_planned(int(step), state, full):
            self._save_unplanned(int(step), state, full)
        self.timings["save"] = time.perf_counter() - t0

    def _save_planned(self, step, state, full):
        """save() through the plan of the previous save (_Plan): only what changes
        from save to save is encoded, copied and checked; the cached tensors' copies
        are one call. False (nothing done) when the state's structure changed."""
        plan, w = self._saveplan, self._writer
        if plan is None or w is None or os.environ.get("AMBER_DEVICE_PATH") == "1":
            return False
        tensors = plan.check(state)
        if tensors is None:
            return self._unplan()
        flat = _Flat(reserved=plan.names)
        parts, dyn, at = [], [], 0
        for key, _, kind, data in plan.layout:
            first = len(flat.tensors)
            if kind in ("module", "tree"):
                parts.append(data["json"])  # bytes: the metadata is sent as bytes
                at += data["n"]
            elif kind == "optimizer":
                at += data["n"]
                fields = [{k: v for k, v in g.items() if k != "params"}
                          for g in state[key].param_groups]
                if data["fields"] is None or not _plain_equal(fields, data["fields"]):
                    groups = []
                    for f, gn in zip(fields, data["gnames"]):
                        e = flat.enc(f, f"{key}/param_groups")
                        e["params"] = gn
                        groups.append(e)
                    text = (json.dumps(groups, allow_nan=False, separators=_SEP) + "}").encode()
                    # the same fields (no lr schedule, or a constant stretch of one)
                    # give the same text: kept while they stay equal
                    data["fields"], data["text"] = (fields, text) if len(flat.tensors) == \
                        first else (None, None)
                else:
                    text = data["text"]
                parts.append(data["head"] + text)
            else:
                _check_key(key, self.rng)
                parts.append((json.dumps(key) + ":" + json.dumps(
                    _entry(flat, None, key, state[key]), allow_nan=False,
                    separators=_SEP)).encode())
            for name, t in flat.tensors[first:]:
                dyn.append((at, name, t))
                at += 1
        rng, own = None, []
        if self.rng:  # new tensors that nothing else can write: read where they are
            rng, own = _rng_states()
            if any(n in flat.names for n, _ in own):
                return self._unplan()
            own = [(at + j, n, t) for j, (n, t) in enumerate(own)]
        if [(n, t.dtype, t.shape) for _, n, t in dyn + own] != plan.dynamic or \
                any(t.device.type != "cpu" for _, _, t in dyn):
            return self._unplan()
        names = list(plan.inplace_names)
        scanned = [tensors[k] for k in plan.inplace_at]
        for i, _, t in own:
            ptr = t.data_ptr()
            if ptr != self._ptrs[i]:
                w.set_data(i, ptr)
                self._ptrs[i] = ptr
        with torch.no_grad():
            if plan.copy_at:  # every small tensor and buffer of the cached entries: one call
                torch._foreach_copy_(plan.copy_dst, [tensors[k] for k in plan.copy_at])
            for i, name, t in dyn:
                nbytes = t.numel() * t.element_size()
                if _in_place(t, nbytes, plan.owned, plan.buffers):
                    ptr = t.data_ptr()
                    names.append(name)
                    scanned.append(t)
                else:
                    ptr = self._staged(name, t).data_ptr()
                if not t.numel():
                    ptr = 0
                if ptr != self._ptrs[i]:
                    w.set_data(i, ptr)
                    self._ptrs[i] = ptr
        if self._unit_map is not None:  # the learning rates of this step
            lrs = self._unit_map.lrs(state)
            if lrs != self._unit_lrs:  # the same structure: units move with the lrs only
                self._set_units(lrs)
        tail = ',"step":' + str(step) + "}"
        if rng is not None:
            tail = ',"rng":' + json.dumps(rng, allow_nan=False, separators=_SEP) + tail
        w.set_meta(b'{"format":"' + _FORMAT.encode() + b'","entries":{' + b",".join(parts) +
                   b"}" + tail.encode())
        self._inplace = bool(scanned) or bool(own)
        self._pinned = scanned + [t for _, _, t in own]
        self._versions = _Versions(names, scanned)
        for ref, _ in plan.opts:
            self._hook(ref())
        self._gated = bool(scanned)
        try:
            w.begin(step, full=bool(full), confirm=self._gated)
        except BaseException:
            self._pinned = self._versions = None
            self._gated = False
            raise
        return True

    def _set_units(self, lrs):
        units = self._unit_map.units(lrs)
        if units != self._units:
            self._writer.set_units(units)
            self._units = units
        self._unit_lrs = lrs

    def _unplan(self):
        self._saveplan = None
        return False

    def _staged(self, name, t):
        """t copied into its reused staging buffer (made or remade as needed)."""
        buf = self._stage.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype)
            self._stage[name] = buf
        buf.copy_(t.resolve_conj().resolve_neg())
        return buf

    def _save_unplanned(self, step, state, full):
        """save() the whole way: names, encodes and places every tensor; then plans
        the next save (_Plan)."""
        self._saveplan = None
        spans = {}
        flat, meta = _flatten(state, self.rng, spans=spans)
        meta["step"] = step
        scanned, how = self._prepare(flat, state)
        self._inplace = bool(scanned)  # the library reads tensors in place until the fence
        w = self._writer
        w.set_meta(json.dumps(meta, allow_nan=False, separators=(",", ":")))
        self._unit_map = None
        if self._has_units:
            self._unit_map = _UnitMap(flat, state)
            self._set_units(self._unit_map.lrs(state))
        self._pinned = [t for _, t in scanned]
        self._versions = _Versions([n for n, _ in scanned], [t for _, t in scanned])
        for v in state.values():
            if isinstance(v, torch.optim.Optimizer):
                self._hook(v)
        devs = [(n, t) for n, t in flat.tensors if self._dev is not None and n in self._dev.tensors]
        background = bool(devs) and _device.asynchronous()
        live = dict(devs)
        if background:
            # Read by the thread until the fence: what training may change before
            # the next optimizer step is captured on its device now, as _prepare
            # captures CPU tensors; the rest is read in place and checked.
            owned = _owned_storages(state)
            vn, vt = [], []
            with torch.no_grad():
                for n, t in devs:
                    small = t.numel() * t.element_size() <= CAPTURE_BYTES
                    if small or _storage_key(t) not in owned:
                        live[n] = t.clone()
                    else:
                        self._pinned.append(t)
                        vn.append(n)
                        vt.append(t)
            self._versions = _Versions(self._versions.names + vn, self._versions.tensors + vt)
        self._gated = bool(self._versions)
        try:
            flags = (_amber.SAVE_FULL if full else 0) | (_amber.SAVE_CONFIRM if self._gated else 0)
            kind = None
            if devs:  # the kind of save, and its errors, now (amber.device)
                flags, kind = self._dev.plan(w, self.store, step, flags, _amber.SAVE_FULL)

            def begin():
                if devs:
                    self._dev.select(w, kind, live)
                w.begin(step, full=bool(flags & _amber.SAVE_FULL), confirm=self._gated)
            if background:
                self._dev_job = _device.Background(begin, [t.device for _, t in devs])
            else:
                begin()
        except BaseException:
            self._pinned = self._versions = None
            self._gated = False
            if self._dev is not None:
                self._dev.rollback()
            raise
        if not devs:
            try:
                self._saveplan = _plan_of(state, flat, meta, spans, how, self._stage, self.rng)
            except Exception:  # a state the plan does not understand: every save the whole way
                self._saveplan = None

    def _prepare(self, flat, state):
        """Declares the tensors (a new writer when the set changed), copies those
        that are captured into the staging buffers and points the writer at every
        tensor's memory. Returns the (name, tensor) pairs read in place, and per
        tensor how it is read: "inplace", "copy", or None (on its device)."""
        dev = os.environ.get("AMBER_DEVICE_PATH") == "1"
        sig = [(n, _DTYPES[t.dtype], tuple(t.shape), dev or t.device.type != "cpu")
               for n, t in flat.tensors]
        owned = _owned_storages(state)
        buffers = _buffer_storages(state)
        ptrs, scanned, how = [], [], []
        with torch.no_grad():
            for (name, t), (_, _, _, wanted) in zip(flat.tensors, sig):
                nbytes = t.numel() * t.element_size()
                if wanted:  # selected on its device: nothing to read here
                    ptrs.append(None)
                    how.append(None)
                    continue
                if _in_place(t, nbytes, owned, buffers):
                    ptrs.append(t.data_ptr())
                    scanned.append((name, t))
                    how.append("inplace")
                    continue
                ptrs.append(self._staged(name, t).data_ptr())
                how.append("copy")
        if len(self._stage) > len(flat.tensors):  # drop buffers of tensors gone
            names = {n for n, _ in flat.tensors}
            self._stage = {n: b for n, b in self._stage.items() if n in names}
        ptrs = [p if t.numel() or p is None else 0 for p, (_, t) in zip(ptrs, flat.tensors)]
        if self._writer is None or sig != self._sig:
            self._reopen(sig, flat, state, ptrs)
        else:
            for i, p in enumerate(ptrs):
                if p is not None and p != self._ptrs[i]:
                    self._writer.set_data(i, p)
                    self._ptrs[i] = p
        return scanned, how

    def _reopen(self, sig, flat, state, ptrs):
        """A new writer for a new set of tensors; its first save is a full one."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        w = self.store.writer(**self._wopts)
        self._dev = _device.DevicePath()
        try:
            for (name, t), p in zip(flat.tensors, ptrs):
                if p is None:
                    self._dev.declare(w, name, _DTYPES[t.dtype], t)
                else:
                    w.add(name, _DTYPES[t.dtype], t.shape, p)
            for r in self._rules:
                w.add_policy(r)
            for k, v in state.items():  # step counters are never lossy
                if isinstance(v, torch.optim.Optimizer):
                    w.add_policy(f"{_glob_escape(k)}/*/step=exact")
        except BaseException:
            w.close()
            raise
        self._writer, self._sig = w, sig
        self._ptrs = list(ptrs)
        self._units = self._unit_lrs = None  # the new writer has none yet

    def _hook(self, opt):
        if id(opt) in self._hooks and self._hooks[id(opt)][0]() is opt:
            return
        ref = weakref.ref(self)

        def pre_hook(_opt, _args, _kwargs):
            ck = ref()
            if ck is not None:
                ck.fence()
        handle = opt.register_step_pre_hook(pre_hook)
        self._hooks[id(opt)] = (weakref.ref(opt), handle.remove)

    def _changed(self):
        """The first tensor read in place whose version counter moved since save()."""
        if isinstance(self._versions, _Versions):
            return self._versions.changed()
        for name, t, v in self._versions or ():
            if t._version != v:
                return name
        return None

    def fence(self):
        """Blocks until the save in progress (or the seed after a load) no longer
        reads the tensors; then they may change. Called by itself before the step
        of any optimizer."""
        if self._seeding is not None:
            t0 = time.perf_counter()
            self._settle_seed()
            self.timings["fence"] = time.perf_counter() - t0
        if self._pinned is None or self._writer is None:
            return
        t0 = time.perf_counter()
        try:
            job, self._dev_job = self._dev_job, None
            if job is not None:  # the device selection on its thread
                try:
                    job.join()
                except BaseException as e:  # nothing began: wait() raises it
                    self._dev_error = e
            if self._dev is not None:
                self._dev.fence()  # the device-side selection (an event on CUDA)
            if self._inplace or self._versions:  # else it reads only its own buffers
                self._writer.fence()
        finally:
            changed = self._changed()
            gated, self._gated = self._gated, False
            self._pinned = self._versions = None
            self.timings["fence"] = time.perf_counter() - t0
            if gated:
                why = "" if changed is None else (
                    f"tensor '{changed}' changed in place after save() and before the fence: "
                    "the checkpoint could hold a torn state, so it was not committed; call "
                    "fence() (or wait()) before changing saved tensors outside optimizer.step()")
                try:
                    self._writer.confirm(changed is None, why)
                except AmberError:
                    pass  # the save failed already; wait() reports it

    def wait(self):
        """Blocks until the save in progress is committed and durable; raises
        its failure."""
        if self.store is None or self._writer is None:
            return
        t0 = time.perf_counter()
        try:
            self.fence()
            if self._writer is None:  # a load's seed was dropped at the fence: no save
                return
            err, self._dev_error = self._dev_error, None
            if err is not None:
                if self._dev is not None:
                    self._dev.rollback()
                raise err
            if self._dev is not None:  # the device references move with the outcome
                self._dev.settle(self._writer.wait)
            else:
                self._writer.wait()
        finally:
            self.timings["wait"] = time.perf_counter() - t0
        if "keep_last" in self._wopts:
            self._prune_msg = _prune_warning(
                self._writer.prune_status(), self._prune_msg,
                f"a checkpoint was saved, but old ones could not be removed "
                f"(keep_last={self._wopts['keep_last']})")

    def close(self):
        """Waits for the save in progress, removes the optimizer hooks and
        releases the store; raises the save's failure, if any."""
        if self.store is None:
            return
        try:
            self.wait()
        finally:
            for _, undo in self._hooks.values():
                undo()
            self._hooks.clear()
            self._global_hook.remove()
            self._settle_seed()
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self.store.close()
            self.store = None
            self._pinned = self._versions = self._saveplan = None
            self._stage = {}

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- loading --
    def latest(self):
        """The store's latest step, or None when it is empty (waits for the save
        in progress first)."""
        self._open()
        self.wait()
        return self.store.latest()

    def steps(self):
        """The committed checkpoints (amber.CheckpointInfo: step, kind, parent,
        bytes), after waiting for the save in progress."""
        self._open()
        self.wait()
        return self.store.list()

    def load(self, state, step=None, strict=True, fallback=False):
        """Restores `state` (same shape of dict as for save) in place from `step`
        (default: the latest) and returns the restored step, or None for an empty
        store. Tensors are read straight into the live tensors' memory. Plain
        values (and objects that cannot be updated in place) are put back into the
        `state` dict; dicts and lists there are updated in place. strict=False
        skips mismatched entries instead of raising StateMismatchError.
        Everything but tensor data is checked before the live state changes (see
        the module's documentation). fallback=True: the step is verified whole
        before anything is restored, and if it is damaged the newest older step
        that verifies is restored instead (`skipped` then counts the steps passed
        over); without it a damaged header or index raises AmberError
        (AMBER_ECORRUPT, naming the file) before anything is restored."""
        self._open()
        self.wait()
        self.skipped = 0
        self.seeded = False
        if step is None and self.store.latest() is None:
            return None
        with self.store.reader(step, fallback=fallback) as r:
            done = r.step
            self.skipped = r.skipped
            meta = _parse_meta(r.meta(), f"step {done} of {self.path}")
            if isinstance(meta, dict) and meta.get("format") == _DCP_FORMAT:
                meta = {"format": _FORMAT, "entries": _dcp_entries(
                    meta.get("keys"), meta.get("objects"), state, done)}
            if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
                raise AmberError(_amber.EFORMAT, f"step {done} of {self.path} was not written by "
                                 "amber.torch (no amber.torch metadata)", name="AMBER_EFORMAT")
            entries = meta.get("entries")
            if not isinstance(entries, dict):
                raise _format_error(done, "entries", "not a dict")
            names = _Names(state)
            ld = _Load(r, strict, done)
            for key, target in state.items():
                e = entries.get(key)
                if e is None:
                    ld.mismatch(key, f"not in the checkpoint of step {done}")
                    continue
                ld.entry(key, e, target, state, names)
            if self.rng and "rng" in meta:
                ld.rng(meta["rng"])
            ld.apply()
        if strict and not self.readonly and step is None and not self.skipped:
            self._seed(state, done)
        return done

    def _seed(self, state, step):
        """After a load of the latest step: declare the state's tensors and seed the
        writer's reference from them (they hold exactly that step's restored state),
        so the first save after a resume is a delta that reads nothing back. The
        copy into the reference (the state's size, in freshly allocated memory) runs
        on a thread while training goes on; the fence before the next optimizer step
        waits for it, and if a tensor it read changed meanwhile (its version counter
        moved), the seed is dropped and the next save reads its reference from the
        store instead."""
        try:
            flat, _ = _flatten(state, self.rng)
            scanned, _ = self._prepare(flat, state)
            w = self._writer
            if self._dev is not None:
                self._dev.seed({n: t for n, t in flat.tensors if n in self._dev.tensors})
        except (AmberError, TypeError, ValueError):
            # the state is not what the step holds (strict=False skips, values that
            # are not state_dict holders...): the writer reads its reference instead
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            return
        versions = _Versions([n for n, _ in scanned], [t for _, t in scanned])
        out = [None]

        def run():
            try:
                w.seed_reference(step)
            except BaseException as e:  # raised nowhere: the writer then reads the store
                out[0] = e
        thread = threading.Thread(target=run, name="amber-seed", daemon=True)
        thread.start()
        self._seeding = (thread, versions, out)
        self.seeded = True

    def _settle_seed(self):
        """Waits for the seed that a load started (if any); keeps it only when it
        succeeded and none of the tensors it read changed meanwhile."""
        job, self._seeding = self._seeding, None
        if job is None:
            return
        thread, versions, out = job
        thread.join()
        if out[0] is not None:  # the library's seed failed: its next save reads the store
            self.seeded = False
        elif versions.changed() is not None:
            # a tensor changed while it was copied: the reference may not be the
            # loaded state; a new writer reads its reference from the store
            self.seeded = False
            self._saveplan = None
            if self._writer is not None:
                self._writer.close()
                self._writer = None


def _fence_before_any_step(ck):
    """A global step pre-hook of every optimizer (torch.optim's) that fences `ck`
    (held weakly): the tensors a save reads in place may be changed by an optimizer
    that the saved state does not hold (a model saved without its optimizer). The
    handle's remove() takes it away."""
    ref = weakref.ref(ck)

    def hook(_opt, _args, _kwargs):
        c = ref()
        if c is not None and (c._pinned is not None or c._seeding is not None):
            c.fence()
    from torch.optim.optimizer import register_optimizer_step_pre_hook
    return register_optimizer_step_pre_hook(hook)


def _distributed(process_group):
    """Whether a Checkpointer of `process_group` is the distributed one."""
    import torch.distributed as dist
    initialized = dist.is_available() and dist.is_initialized()
    if process_group is not None and not initialized:
        raise ValueError("process_group= given, but torch.distributed is not initialized")
    return initialized and (process_group is not None or dist.get_world_size() > 1)


def _dcp_entries(keys, objects, state, step):
    """The entries of amber.torch's metadata for `state`, from a step written through
    amber.dcp ({DCP key: name}, {name: encoded value}). amber.dcp names each item by its
    path in the state dict joined by "/" (an optimizer's state from get_state_dict is
    "<key>/state/<FQN>/exp_avg", its groups "<key>/param_groups/<i>/<field>"), so the
    names give each state key its part without parsing DCP's dotted keys."""
    if not isinstance(keys, dict) or not isinstance(objects, dict):
        raise _format_error(step, "keys", "amber.dcp metadata without keys and objects")
    by_key = {}
    for name in keys.values():
        if isinstance(name, str):
            head = name.split("/", 1)[0]
            by_key.setdefault(head, []).append(name)

    def value(name):
        return objects[name] if name in objects else {"$t": name}

    def nest(key, names):
        out = {}
        for n in names:
            parts = n.split("/")[1:]
            d = out
            for p in parts[:-1]:
                d = d.setdefault(p, {})
            d[parts[-1]] = value(n)
        return out

    entries = {}
    for key, target in state.items():
        names = by_key.get(key)
        if not names:
            continue
        if isinstance(target, torch.nn.Module):
            entries[key] = {"type": "module",
                            "state": {n.split("/", 1)[1]: value(n) for n in names if "/" in n}}
        elif isinstance(target, torch.optim.Optimizer):
            st, groups = {}, {}
            for n in names:
                parts = n.split("/")
                if len(parts) == 4 and parts[1] == "state":
                    st.setdefault(parts[2], {})[parts[3]] = value(n)
                elif len(parts) == 4 and parts[1] == "param_groups" and parts[2].isdigit():
                    groups.setdefault(int(parts[2]), {})[parts[3]] = value(n)
            entries[key] = {"type": "optimizer", "state": st,
                            "param_groups": [groups[i] for i in sorted(groups)]}
        elif names == [key]:
            entries[key] = {"type": "tensor" if key not in objects else "value",
                            "value": value(key)}
        elif hasattr(target, "load_state_dict"):
            entries[key] = {"type": "object", "state": nest(key, names)}
        else:
            entries[key] = {"type": "value", "value": nest(key, names)}
    return entries


def _glob_escape(s):
    return "".join(f"[{c}]" if c in "*?[" else c for c in s)
