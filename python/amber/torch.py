"""amber.torch - checkpoint PyTorch training state into an amber store.

    from amber.torch import Checkpointer
    with Checkpointer("runs/x", policy="lossy") as ck:
        start = ck.load({"model": model, "optim": opt, "sched": sched}) or 0
        for step in range(start + 1, steps + 1):
            train_one_step()                     # ends with opt.step(), sched.step()
            ck.save(step, {"model": model, "optim": opt, "sched": sched,
                           "extra": {"data_pos": pos}})
    # leaving the block waits until the last save is durable, then releases the store

What a state holds. `save(step, state)` takes a dict of named values:
  - nn.Module: its state_dict(); tensors are named "<key>/<state_dict name>",
    e.g. "model/blocks.0.attn.weight".
  - torch.optim.Optimizer: per-parameter state keyed by PARAMETER NAME, not by
    position: "<key>/<param name>/<state name>", e.g. "optim/blocks.0.attn.weight/
    exp_avg". A parameter's name is the one it has in the nn.Module of the same
    save/load call that owns it (the first such module in the dict's order); when
    the dict holds more than one module the name is qualified by the module's key,
    "<module key>/<param name>"; a parameter that no module of the call owns is named
    "param<i>" after its position. So pass the model in the same call as its
    optimizer, in save and in load. param_groups (lr, betas, ...) are kept with the
    parameter names they list.
  - anything else with state_dict()/load_state_dict() (LR schedulers, GradScaler,
    ...): its state_dict; tensors in it are named by their path ("<key>/<k1>/<k2>").
    Functions and bound methods in a state_dict (e.g. OneCycleLR's anneal_func) are
    code, not state: they are skipped and the object keeps its own.
  - a tensor: named "<key>".
  - plain data (numbers, strings, None, lists, tuples, dicts, small numpy arrays),
    possibly holding tensors: kept exactly in the checkpoint's metadata; tensors
    in it are named by their path.
  - RNG states (rng=True, the default): the torch CPU generator (tensor "rng/torch"),
    CUDA generators if CUDA is in use ("rng/cuda<i>"), Python's `random` and NumPy's
    global generator ("rng/python", "rng/numpy"). The key "rng" is then reserved.

Tensors are saved zero-copy: the library reads each tensor's memory where it is.
A tensor that is not a contiguous CPU tensor is first copied to one (documented
exception; parameters and optimizer state are contiguous). Supported dtypes:
float32, float16, bfloat16, float64, int64, int32, int16, int8, uint8, bool.

Policies. `policy=` is "exact" (the default: every restored tensor is bit-exact),
"lossy" (the preset LOSSY below), a single rule "SPEC" or "PATTERN=SPEC", a list of
rules, or a dict {PATTERN: SPEC}. SPEC is exact, threshold:ABS[:REL] or
budget:FRAC[:CAP] (see README); PATTERN is a glob on the tensor names above
("*/exp_avg_sq" matches every Adam second moment); the last matching rule wins.
Integer and bool tensors, and optimizer step counters ("<optim key>/*/step", a
float tensor in Adam), are always exact.

Overlap. With a library that has the split save (amber_writer_begin/fence/wait),
save() returns as soon as the scan of the tensors has started; encoding and the
durable write run in the background. The tensors must not change until the scan
is over: the Checkpointer therefore fences (waits for the scan) before the next
optimizer.step() of every optimizer in the saved state by itself - through
Optimizer.register_step_pre_hook where torch has it (>= 2.0), and on torch 1.13 by
replacing the optimizer's `step` attribute with a wrapper that fences and then
calls the original (LR schedulers' step counting keeps working; close() removes
the wrapper). If you modify saved tensors any other way (assigning weights,
model.load_state_dict, ...), call ck.fence() first. save(), load(), wait() and
close() fence too. So a checkpoint always holds the state at its save() call.
After the fence the library holds no reference to Python memory: it works on its
own copies, and Python drops the tensors it kept alive for the scan.

The set of tensors may change between saves (Adam's state appears after its first
step, a layer is added, ...). The Checkpointer then closes its writer and opens a
new one, whose first checkpoint is a full one. Each save with the same tensors
(names, dtypes, shapes) as the store's latest checkpoint is a delta, also in a new
process after a restart, subject to the cadence (full_every, full_share).

Errors. Library failures raise amber.AmberError (code, name, message). The failure
of a background save is raised by the next save(), wait() or close(); the store
keeps its earlier checkpoints and later saves work again. load() raises
StateMismatchError (an AmberError with code AMBER_EMISMATCH and a `key` attribute)
naming the first tensor or entry whose presence, shape or dtype differs between the
checkpoint and the state, before it restores anything of that entry; with
strict=False such entries are skipped instead. Entries of the checkpoint that the
load state does not ask for are ignored. Damage found while reading (a checksum)
raises AMBER_ECORRUPT naming the file; tensors restored before that point keep
their new values, so resume with load(..., fallback=True), which verifies the
whole step before restoring anything and falls back to the newest intact one.
Step numbers must increase: a save of a step at or below the store's latest
raises AMBER_EEXIST.
"""

import json
import os
import random
import time
import warnings
import weakref

import torch

import amber as _amber
from amber import AmberError, Store

try:
    import numpy as _np
except ImportError:  # NumPy is optional: its RNG is then not saved
    _np = None

__all__ = ["Checkpointer", "StateMismatchError", "EXACT", "LOSSY", "PRESETS"]

# The lossy preset ("lossy"), chosen by measurement on the demo's training
# (examples/demo_gpt.py: 3.3M-parameter GPT, AdamW with betas 0.9/0.95, saved every
# step, restored at step K, trained on to step N; final held-out loss against the
# uninterrupted run; median delta size against a full checkpoint). W = weights and
# every other float tensor, M = exp_avg, V = exp_avg_sq:
#   W budget:0.02:1e-3, M budget:0.02:1e-4, V threshold:0:0.05  N240 K120 +0.05%  16.3%
#   W budget:0.02:1e-2, M budget:0.02:1e-3, V threshold:0:0.25  N240 K120 +0.08%   3.9%
#   W budget:0.01:1e-2, M budget:0.01:1e-3, V threshold:0:0.25  N240 K120 +0.14%   3.5%
#   W budget:0.005:1e-2, M budget:0.005:1e-3, V thr.:0:0.25     N240 K120 +0.33%   3.0%
#   W budget:0.01:3e-3, M budget:0.01:3e-4, V threshold:0:0.5   N240 K120 +0.06%   2.1%
#                                                               N200 K100 +0.42%
#                                                               N200 K99  +0.39%
#                                                               N200 K60  +0.12%
#   W budget:0.01:1e-3, M budget:0.01:1e-4, V threshold:0:0.5   N200 K100 +0.17%   4.4%
#   W budget:0.02:2e-3, M budget:0.02:2e-4, V threshold:0:0.5   N200 K100 +0.05%   3.1%  <-
#                                                               N200 K60  +0.07%   3.5%
# The runs above take a full checkpoint whenever the deltas add up to half of one
# (the default cadence), so K restores a short chain. Restoring the 47th delta
# after a full (full_share=-1, what the demo does: the worst case, as pending
# changes have built up), N200 K99:
#   W budget:0.02:2e-3, M budget:0.02:2e-4, V threshold:0:0.5             +0.27%   4.4%  <-
#   W budget:0.02:1e-3, M budget:0.02:1e-4, V threshold:0:0.5             +0.16%   6.7%
#   W budget:0.04:2e-3, M budget:0.04:2e-4, V threshold:0:0.5             +0.20%   5.1%
# So: weights (and every other float tensor) keep the 2% largest pending changes
# per step plus every change above 2e-3; Adam's first moment and SGD's momentum
# likewise with a cap of 2e-4; Adam's second moments are restored within 50%
# (an Adam step size within 0.71x..1.22x until they are stored). The second
# moment's rule is relative because its values span many orders of magnitude.
# On a GPT-2-small state in mid-training (bench/torch_bench.py) a delta is 1.6%
# of a full checkpoint. Step counters stay exact (see above).
LOSSY = (
    "budget:0.02:2e-3",
    "*/exp_avg=budget:0.02:2e-4",
    "*/momentum_buffer=budget:0.02:2e-4",
    "*/exp_avg_sq=threshold:0:0.5",
    "*/max_exp_avg_sq=threshold:0:0.5",
)
EXACT = ("exact",)
PRESETS = {"exact": EXACT, "lossy": LOSSY}

_DTYPES = {
    torch.float32: _amber.F32, torch.float16: _amber.F16, torch.bfloat16: _amber.BF16,
    torch.float64: _amber.F64, torch.int64: _amber.I64, torch.int32: _amber.I32,
    torch.int16: _amber.I16, torch.int8: _amber.I8, torch.uint8: _amber.U8,
    torch.bool: _amber.BOOL,
}
_TORCH = {v: k for k, v in _DTYPES.items()}
_EMISMATCH = -10
_FORMAT = "amber.torch/1"
_SKIP = object()  # an encoded value that is left out (code in a state_dict)


class StateMismatchError(AmberError):
    """The checkpoint and the state given to load() differ at `key`."""

    def __init__(self, key, message):
        self.key = key
        super().__init__(_EMISMATCH, f"{key}: {message}", name="AMBER_EMISMATCH")


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


# ---- naming parameters ---------------------------------------------------------------

def _param_names(state):
    """id(parameter) -> name, from the modules of one save/load call."""
    modules = [(k, v) for k, v in state.items() if isinstance(v, torch.nn.Module)]
    names = {}
    for key, mod in modules:
        for pname, p in mod.named_parameters():
            if id(p) not in names:
                names[id(p)] = pname if len(modules) == 1 else f"{key}/{pname}"
    return names


def _optim_params(opt, names):
    """The optimizer's parameters in state_dict order, and their names."""
    params, seen = [], set()
    for g in opt.param_groups:
        for p in g["params"]:
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    return params, [names.get(id(p), f"param{i}") for i, p in enumerate(params)]


# ---- save side: state -> (named tensors, JSON) ----------------------------------------

class _Flat:
    """Tensors of one save in declaration order, and the JSON that describes the rest."""

    def __init__(self):
        self.tensors = []  # (name, contiguous CPU tensor)
        self.names = set()

    def tensor(self, name, t):
        if name in self.names:
            raise ValueError(f"{name}: two tensors of the state have this name")
        if t.layout != torch.strided:
            raise TypeError(f"{name}: {t.layout} tensors are not supported")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name}: dtype {t.dtype} is not supported by amber")
        if t.requires_grad:
            t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()  # documented copy
        if not t.is_contiguous() or t.is_conj() or t.is_neg():
            t = t.resolve_conj().resolve_neg().contiguous()  # documented copy
        self.names.add(name)
        self.tensors.append((name, t))
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
            return {"$np": {"dtype": x.dtype.str, "shape": list(x.shape), "data": x.ravel().tolist()}}
        if code_ok and callable(x):
            return _SKIP
        raise TypeError(f"{path}: cannot checkpoint a value of type {type(x).__name__} "
                        "(not a tensor, a state_dict holder or JSON-able data)")

    def optimizer(self, opt, key, names):
        params, pnames = _optim_params(opt, names)
        sd = opt.state_dict()
        state = {}
        for idx, s in sd["state"].items():
            if not isinstance(idx, int) or idx >= len(pnames):
                raise TypeError(f"{key}: optimizer state key {idx!r} is not a parameter index")
            pn = pnames[idx]
            state[pn] = self.enc(dict(s), f"{key}/{pn}")
        groups = []
        for g in sd["param_groups"]:
            e = self.enc({k: v for k, v in g.items() if k != "params"}, f"{key}/param_groups")
            e["params"] = [pnames[i] for i in g["params"]]
            groups.append(e)
        return {"type": "optimizer", "class": type(opt).__name__, "state": state,
                "param_groups": groups}

    def rng(self):
        out = {}
        self.tensor("rng/torch", torch.get_rng_state())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            out["cuda"] = torch.cuda.device_count()
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                self.tensor(f"rng/cuda{i}", s)
        version, mt, gauss = random.getstate()
        self.tensor("rng/python", torch.tensor(mt, dtype=torch.int64))
        out["python"] = {"version": version, "gauss_next": gauss}
        if _np is not None:
            name, keys, pos, has_gauss, cached = _np.random.get_state()
            self.tensor("rng/numpy", torch.from_numpy(keys.astype(_np.int64)))
            out["numpy"] = {"name": name, "pos": int(pos), "has_gauss": int(has_gauss),
                            "cached_gaussian": float(cached)}
        return out


def _flatten(state, rng):
    flat = _Flat()
    names = _param_names(state)
    entries = {}
    for key, value in state.items():
        if not isinstance(key, str) or not key:
            raise TypeError(f"state keys must be non-empty strings, not {key!r}")
        if rng and key == "rng":
            raise ValueError("state key 'rng' is reserved for the RNG states (or pass rng=False)")
        if isinstance(value, torch.Tensor):
            entries[key] = {"type": "tensor", "value": flat.tensor(key, value)}
        elif isinstance(value, torch.nn.Module):
            entries[key] = {"type": "module", "state": flat.enc(value.state_dict(), key)}
        elif isinstance(value, torch.optim.Optimizer):
            entries[key] = flat.optimizer(value, key, names)
        elif hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
            entries[key] = {"type": "object", "class": type(value).__name__,
                            "state": flat.enc(value.state_dict(), key, code_ok=True)}
        else:
            entries[key] = {"type": "value", "value": flat.enc(value, key)}
    meta = {"format": _FORMAT, "entries": entries}
    if rng:
        meta["rng"] = flat.rng()
    return flat, meta


# ---- load side: (reader, JSON) -> state, in place -------------------------------------

class _Restore:
    """One load. With dry=True it only checks names, shapes and dtypes against
    the checkpoint (raising the first mismatch) and changes nothing: a strict
    load runs a dry pass first, so that a mismatch leaves the state untouched."""

    def __init__(self, reader, strict, step, dry=False):
        self.r = reader
        self.strict = strict
        self.step = step
        self.dry = dry
        # Inside module() and optimizer(), reads into CPU tensors are collected and
        # done by one read_many (all chunks of all tensors in parallel) before
        # anything uses the tensors; everywhere else a read happens at once.
        self.defer = False
        self.pending = []

    def flush(self):
        """Does the collected reads. Tensors that share memory (tied weights) are
        read once: the library's buffers must not overlap."""
        if self.pending:
            items, self.pending, seen = self.pending, [], {}
            once, later = [], []
            for it in items:
                size = seen.setdefault(it[1], it[2])
                if size != it[2]:
                    later.append(it)  # another extent at the same address: after the rest
                elif len(seen) > len(once):
                    once.append(it)
            self.r.read_many(once)
            for it in later:
                self.r.read_into(*it)

    def mismatch(self, key, msg):
        if self.strict:
            raise StateMismatchError(key, msg)

    def skip(self, target, key, msg):
        self.mismatch(key, msg)
        return target

    def tensor(self, name, target=None, device=None):
        """Restores tensor `name` into `target` (in place; returned) or into a new
        tensor."""
        idx = self.r.find(name)
        if idx is None:
            raise AmberError(-7, f"step {self.step}: the metadata names tensor '{name}', "
                             "which the checkpoint does not hold", name="AMBER_ECORRUPT")
        info = self.r.tensors()[idx]
        dtype = _TORCH.get(info.dtype)
        if dtype is None:
            raise TypeError(f"{name}: amber dtype {_amber.dtype_name(info.dtype)} has no torch dtype")
        if isinstance(target, torch.Tensor):
            # a skipped mismatch (strict=False) leaves the live tensor as it is
            if tuple(target.shape) != info.shape:
                return self.skip(target, name, f"shape {list(info.shape)} in the checkpoint of step "
                                     f"{self.step}, {list(target.shape)} in the state")
            if target.dtype != dtype:
                return self.skip(target, name, f"dtype {dtype} in the checkpoint of step {self.step}, "
                                     f"{target.dtype} in the state")
            if self.dry:
                return target
            if target.device.type == "cpu" and target.is_contiguous():
                self._read(idx, info, target)  # straight into the live tensor's memory
            else:
                tmp = torch.empty(info.shape, dtype=dtype)
                self._read(idx, info, tmp, now=True)
                with torch.no_grad():
                    target.copy_(tmp)
            return target
        if self.dry:
            return None
        t = torch.empty(info.shape, dtype=dtype)
        if device is None or torch.device(device).type == "cpu":
            self._read(idx, info, t)
            return t
        self._read(idx, info, t, now=True)
        return t.to(device)

    def _read(self, idx, info, t, now=False):
        if not info.nbytes:
            return
        if self.defer and not now:
            self.pending.append((idx, t.data_ptr(), info.nbytes))
        else:
            self.r.read_into(idx, t.data_ptr(), info.nbytes)

    def dec(self, e, path, target=None, device=None):
        """The value that JSON `e` describes; tensors are read into the tensor at
        the same place of `target` when there is one."""
        if isinstance(e, list):
            tl = target if isinstance(target, (list, tuple)) else ()
            return [self.dec(v, f"{path}/{i}", tl[i] if i < len(tl) else None, device)
                    for i, v in enumerate(e)]
        if not isinstance(e, dict):
            return e
        if "$t" in e and len(e) == 1:
            return self.tensor(e["$t"], target, device)
        if "$f" in e and len(e) == 1:
            return float(e["$f"])
        if "$tuple" in e and len(e) == 1:
            tl = target if isinstance(target, (list, tuple)) else ()
            return tuple(self.dec(v, f"{path}/{i}", tl[i] if i < len(tl) else None, device)
                         for i, v in enumerate(e["$tuple"]))
        if "$dtype" in e and len(e) == 1:
            return getattr(torch, e["$dtype"])
        if "$np" in e and len(e) == 1:
            a = e["$np"]
            return _np.array(a["data"], dtype=_np.dtype(a["dtype"])).reshape(a["shape"])
        td = target if isinstance(target, dict) else {}
        if "$d" in e and len(e) == 1:
            out = {}
            for k, v in e["$d"]:
                k = self.dec(k, path)
                out[k] = self.dec(v, f"{path}/{k}", td.get(k), device)
            return out
        return {k: self.dec(v, f"{path}/{k}", td.get(k), device) for k, v in e.items()}

    def keys(self, key, stored, current):
        """Mismatch on the first key present on one side only."""
        for k in stored:
            if k not in current:
                self.mismatch(f"{key}/{k}", f"in the checkpoint of step {self.step}, not in the state")
        for k in current:
            if k not in stored:
                self.mismatch(f"{key}/{k}", f"in the state, not in the checkpoint of step {self.step}")

    def module(self, key, entry, mod):
        stored = entry["state"]
        sd = mod.state_dict()
        self.keys(key, stored, sd)
        live = {t.data_ptr() for t in list(mod.parameters()) + list(mod.buffers())}
        needs_load = False
        restored = {}
        self.defer = True
        try:
            for k, e in stored.items():
                if k not in sd:
                    continue
                v = self.dec(e, f"{key}/{k}", sd[k])
                restored[k] = v
                if not isinstance(v, torch.Tensor) or v is not sd[k] or v.data_ptr() not in live:
                    needs_load = True
        finally:
            self.defer = False
        self.flush()
        if needs_load and not self.dry:  # e.g. extra state, or a state_dict that is not a view of the module
            mod.load_state_dict(restored, strict=False)

    def optimizer(self, key, entry, opt, names):
        params, pnames = _optim_params(opt, names)
        pos = {id(p): i for i, p in enumerate(params)}
        by_name = dict(zip(pnames, params))
        # param_groups must list the same parameters, by name, in the same order
        stored_groups = entry["param_groups"]
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
        new_state = dict(opt.state)
        for pn, e in entry["state"].items():
            p = by_name.get(pn)
            if p is None:
                self.mismatch(f"{key}/{pn}", f"in the checkpoint of step {self.step}, but the "
                              f"optimizer has no parameter named '{pn}'")
                continue
            cur = opt.state.get(p) or {}
            if cur:
                self.keys(f"{key}/{pn}", e, cur)
            self.defer = True
            try:
                new_state[p] = {k: self.dec(v, f"{key}/{pn}/{k}", cur.get(k), p.device)
                                for k, v in e.items()}
            finally:
                self.defer = False
        self.flush()  # before anything below can look at the state's tensors
        for p, s in opt.state.items():
            if s and id(p) in pos and pnames[pos[id(p)]] not in entry["state"]:
                self.mismatch(f"{key}/{pnames[pos[id(p)]]}", "has optimizer state in the state, "
                              f"none in the checkpoint of step {self.step}")
        if self.dry:
            return
        groups = []
        for i, g in enumerate(opt.param_groups):
            if i < len(stored_groups):
                ng = self.dec({k: v for k, v in stored_groups[i].items() if k != "params"},
                              f"{key}/param_groups")
            else:
                ng = {k: v for k, v in g.items() if k != "params"}
            ng["params"] = g["params"]
            groups.append(ng)
        if type(opt).load_state_dict is torch.optim.Optimizer.load_state_dict:
            # what Optimizer.load_state_dict does, minus its deep copy of every tensor
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

    def rng(self, meta):
        torch.set_rng_state(self.tensor("rng/torch"))
        n = meta.get("cuda", 0)
        if n and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([self.tensor(f"rng/cuda{i}") for i in range(n)])
        py = meta["python"]
        mt = tuple(self.tensor("rng/python").tolist())
        random.setstate((py["version"], mt, py["gauss_next"]))
        if _np is not None and "numpy" in meta:
            nm = meta["numpy"]
            keys = self.tensor("rng/numpy").numpy().astype(_np.uint32)
            _np.random.set_state((nm["name"], keys, nm["pos"], nm["has_gauss"],
                                  nm["cached_gaussian"]))


# ---- the optimizer step hook ------------------------------------------------------

class _FencedStep:
    """Stands in for optimizer.step on torch without step pre-hooks: fences the
    Checkpointer's save in progress, then steps. Looks like a bound method
    (__self__, __func__) so that LR schedulers can still wrap it."""

    def __init__(self, opt, orig, ck):
        self._opt = weakref.ref(opt)
        self._orig = orig  # an instance attribute it replaced, or None for the class's
        self._ck = weakref.ref(ck)
        if getattr(orig, "_with_counter", False):
            self._with_counter = True

    @property
    def __self__(self):
        return self._opt()

    @property
    def __func__(self):
        fenced = self

        def step(opt, *args, **kwargs):
            return fenced(*args, **kwargs)
        return step

    def __call__(self, *args, **kwargs):
        ck = self._ck()
        if ck is not None:
            ck.fence()
        if self._orig is not None:
            return self._orig(*args, **kwargs)
        opt = self._opt()
        return type(opt).step(opt, *args, **kwargs)


# ---- the Checkpointer -------------------------------------------------------------

class Checkpointer:
    """Saves and restores training state in the amber store at `path`.

    Checkpointer(path, policy=None, full_every=None, full_share=None, rng=True,
                 readonly=False, threads=0, chunk_elems=0, keep_last=None)
      policy: "exact" (default, also for None), "lossy", a rule, a list of rules or
              a dict {pattern: spec} (see the module's documentation).
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

    The store is locked while the Checkpointer is open (AMBER_ELOCKED for a second
    writer). `timings` holds the last save's seconds: "save" (the save() call),
    "fence" (the wait for the scan), "wait" (the last wait for durability)."""

    def __init__(self, path, policy=None, full_every=None, full_share=None, rng=True,
                 readonly=False, threads=0, chunk_elems=0, keep_last=None):
        self._rules = _rules(policy)
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
        self._sig = None
        self._ptrs = []
        self._pinned = None  # tensors the scan in progress reads; dropped at the fence
        self._hooks = {}     # id(optimizer) -> (weakref(optimizer), undo)
        self.timings = {"save": 0.0, "fence": 0.0, "wait": 0.0}
        self.skipped = 0

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
        Returns once the scan has started (or, with a library without the split
        save, once the checkpoint is durable). full=True forces a full checkpoint.
        Raises the failure of the previous background save, if any."""
        self._open()
        if self.readonly:
            raise AmberError(-16, f"store {self.path} is open read-only", name="AMBER_EREADONLY")
        t0 = time.perf_counter()
        self.wait()
        flat, meta = _flatten(state, self.rng)
        meta["step"] = int(step)
        sig = [(n, _DTYPES[t.dtype], tuple(t.shape)) for n, t in flat.tensors]
        if self._writer is None or sig != self._sig:
            self._reopen(sig, flat, state)
        w = self._writer
        for i, (_, t) in enumerate(flat.tensors):
            p = t.data_ptr() if t.numel() else 0
            if p != self._ptrs[i]:
                w.set_data(i, p)
                self._ptrs[i] = p
        w.set_meta(json.dumps(meta, allow_nan=False, separators=(",", ":")))
        self._pinned = [t for _, t in flat.tensors]
        for v in state.values():
            if isinstance(v, torch.optim.Optimizer):
                self._hook(v)
        try:
            w.begin(int(step), full=full)
        finally:
            if not _amber.HAS_ASYNC:
                self._pinned = None
        self.timings["save"] = time.perf_counter() - t0

    def _reopen(self, sig, flat, state):
        """A new writer for a new set of tensors; its first save is a full one."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        w = self.store.writer(**self._wopts)
        try:
            for name, t in flat.tensors:
                w.add(name, _DTYPES[t.dtype], t.shape, t.data_ptr() if t.numel() else 0)
            for r in self._rules:
                w.add_policy(r)
            for k, v in state.items():  # step counters are never lossy
                if isinstance(v, torch.optim.Optimizer):
                    w.add_policy(f"{_glob_escape(k)}/*/step=exact")
        except BaseException:
            w.close()
            raise
        self._writer, self._sig = w, sig
        self._ptrs = [t.data_ptr() if t.numel() else 0 for _, t in flat.tensors]

    def _hook(self, opt):
        if id(opt) in self._hooks and self._hooks[id(opt)][0]() is opt:
            return
        ref = weakref.ref(self)
        if hasattr(opt, "register_step_pre_hook"):  # torch >= 2.0
            def pre_hook(_opt, _args, _kwargs):
                ck = ref()
                if ck is not None:
                    ck.fence()
            handle = opt.register_step_pre_hook(pre_hook)
            self._hooks[id(opt)] = (weakref.ref(opt), handle.remove)
            return
        orig = opt.__dict__.get("step")
        fenced = _FencedStep(opt, orig, self)
        opt.step = fenced
        opt_ref = weakref.ref(opt)

        def undo():
            o = opt_ref()
            if o is not None and o.__dict__.get("step") is fenced:
                if orig is None:
                    del o.__dict__["step"]
                else:
                    o.step = orig
        self._hooks[id(opt)] = (opt_ref, undo)

    def fence(self):
        """Blocks until the save in progress no longer reads the tensors; then
        they may change. Called by itself before optimizer.step()."""
        if self._pinned is None or self._writer is None:
            return
        t0 = time.perf_counter()
        try:
            self._writer.fence()
        finally:
            self._pinned = None
            self.timings["fence"] = time.perf_counter() - t0

    def wait(self):
        """Blocks until the save in progress is committed and durable; raises
        its failure."""
        if self.store is None or self._writer is None:
            return
        t0 = time.perf_counter()
        try:
            self.fence()
            self._writer.wait()
        finally:
            self.timings["wait"] = time.perf_counter() - t0
        if "keep_last" in self._wopts:
            rc, _, msg = self._writer.prune_status()
            if rc and msg != self._prune_msg:  # once per distinct failure
                warnings.warn(f"amber: a checkpoint was saved, but old ones could not be "
                              f"removed (keep_last={self._wopts['keep_last']}): {msg}",
                              _amber.PruneWarning, stacklevel=2)
            self._prune_msg = msg if rc else None

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
            if self._writer is not None:
                self._writer.close()
                self._writer = None
            self.store.close()
            self.store = None
            self._pinned = None

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
        fallback=True: if the step is damaged, restore the newest older step that
        verifies instead (`skipped` then counts the steps passed over); without
        it a damaged step raises AmberError (AMBER_ECORRUPT, naming the file)
        before anything is restored."""
        self._open()
        self.wait()
        self.skipped = 0
        if step is None and self.store.latest() is None:
            return None
        with self.store.reader(step, fallback=fallback) as r:
            done = r.step
            self.skipped = r.skipped
            raw = r.meta()
            try:
                meta = json.loads(raw) if raw else None
            except ValueError:
                meta = None
            if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
                raise AmberError(-8, f"step {done} of {self.path} was not written by "
                                 "amber.torch (no amber.torch metadata)", name="AMBER_EFORMAT")
            entries = meta["entries"]
            names = _param_names(state)
            for dry in ((True, False) if strict else (False,)):
                rs = _Restore(r, strict, done, dry)
                for key, target in state.items():
                    e = entries.get(key)
                    if e is None:
                        rs.mismatch(key, f"not in the checkpoint of step {done}")
                        continue
                    self._restore(rs, key, e, target, state, names)
            if self.rng and "rng" in meta:
                rs.rng(meta["rng"])
        return done

    @staticmethod
    def _restore(rs, key, e, target, state, names):
        kind = e["type"]
        if kind == "module":
            if not isinstance(target, torch.nn.Module):
                return rs.mismatch(key, f"a module in the checkpoint, a {type(target).__name__} in the state")
            rs.module(key, e, target)
        elif kind == "optimizer":
            if not isinstance(target, torch.optim.Optimizer):
                return rs.mismatch(key, f"an optimizer in the checkpoint, a {type(target).__name__} in the state")
            rs.optimizer(key, e, target, names)
        elif kind == "object":
            if not hasattr(target, "load_state_dict"):
                return rs.mismatch(key, f"a {e['class']} in the checkpoint, a {type(target).__name__} "
                                   "in the state")
            cur = target.state_dict()
            stored = e["state"]
            if isinstance(stored, dict) and isinstance(cur, dict) and "$d" not in stored:
                rs.keys(key, stored, {k: v for k, v in cur.items() if not callable(v)})
            value = rs.dec(stored, key, cur)
            if not rs.dry:
                target.load_state_dict(value)
        elif kind == "tensor":
            v = rs.tensor(e["value"]["$t"], target if isinstance(target, torch.Tensor) else None)
            if v is not target and not rs.dry:
                state[key] = v
        else:
            v = rs.dec(e["value"], key, target)
            if rs.dry:
                return
            if isinstance(target, dict) and isinstance(v, dict):
                target.clear()
                target.update(v)
            elif isinstance(target, list) and isinstance(v, list):
                target[:] = v
            else:
                state[key] = v


def _glob_escape(s):
    return "".join(f"[{c}]" if c in "*?[" else c for c in s)
