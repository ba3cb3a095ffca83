"""One load, in two passes. plan() decodes everything that needs no tensor data and
checks it against the state (raising before anything changes), collecting the tensor
reads (into live tensors, or into new ones) and the updates that apply them; apply()
then reads the tensors and applies the updates. The reads go to a source's reader
(_source.py), which serves whole tensors or, for a DTensor, the box this rank holds.
"""

from collections import defaultdict
import torch
from torch.distributed.checkpoint import state_dict as dsd

import amber as _amber
from amber import AmberError

from . import _dtypes
from ._naming import Names, box, compat_fqns, compat_name, is_dtensor, local, model_state
from ._values import Decoder


class StateMismatchError(AmberError):
    """The checkpoint and the state given to load() differ at `key`."""

    def __init__(self, key, message):
        self.key = key
        super().__init__(_amber.EMISMATCH, f"{key}: {message}", name="AMBER_EMISMATCH")


class Load(Decoder):
    """A load's plan and its application (see the module's text). `reader` has
    tensors() and read_many([(index, address, size[, (offsets, shape)])]); with
    `boxes` it serves a DTensor's box of its global tensor."""

    def __init__(self, reader, strict: bool, step, boxes: bool = False):
        super().__init__(step)
        self.r = reader
        self.strict = strict
        self.boxes = boxes
        self.fresh = []     # reads into new tensors: (idx, tensor, box)
        self.inplace = []   # reads into live tensors: (idx, tensor, entry key, box)
        # box: None for the whole tensor, else (offsets, shape) of a DTensor's shard
        self.after = []     # (entry key, fn) run after the reads
        self.copies = []    # (live target, staging tensor): copy_ after the reads
        self.tensors = {t.name: t for t in reader.tensors()}
        self.key = None     # the entry being planned

    def mismatch(self, key, msg):
        if self.strict:
            raise StateMismatchError(key, msg)

    def tensor(self, name, target=None, device=None):
        """Plans the restore of tensor `name` into `target` (in place; returned) or
        into a new tensor (returned, filled by apply())."""
        if not isinstance(name, str):
            self.bad(name, "a tensor reference that is not a name")
        info = self.tensors.get(name)
        if info is None:
            raise AmberError(_amber.ECORRUPT, f"step {self.step}: the metadata names tensor "
                             f"'{name}', which the checkpoint does not hold", name="AMBER_ECORRUPT")
        dtype = _dtypes.TORCH.get(info.dtype)
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
            loc, bx = self.box(target)
            if loc.device.type == "cpu" and loc.is_contiguous():
                self.inplace.append((info.index, loc, self.key, bx))
            else:
                tmp = torch.empty(loc.shape, dtype=dtype)
                self.fresh.append((info.index, tmp, bx))
                self.copies.append((loc, tmp))
            return target
        t = torch.empty(info.shape, dtype=dtype)
        self.fresh.append((info.index, t, None))
        if device is not None and torch.device(device).type != "cpu":
            dev = torch.empty(info.shape, dtype=dtype, device=device)
            self.copies.append((dev, t))
            return dev
        return t

    def box(self, target):
        """(local tensor, box) of a live tensor: the whole of a plain one; a DTensor's
        shard (its offsets and shape in the global tensor) when the reader serves
        boxes."""
        if not is_dtensor(target):
            return target, None
        if not self.boxes:
            raise TypeError(f"{self.key}: a DTensor in the state, and this Checkpointer is not "
                            "distributed (pass process_group=)")
        loc, _, off, lshape, _, _ = box(target)
        return loc, (off, lshape)

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
        stored = compat_fqns(stored)
        sd = model_state(mod)
        self.keys(key, stored, sd)
        live = {local(t).data_ptr() for t in list(mod.parameters()) + list(mod.buffers())}
        restored = {}
        needs_load = False
        for k, e in stored.items():
            if k not in sd:
                continue
            v = self.dec(e, f"{key}/{k}", sd[k])
            if isinstance(sd[k], torch.Tensor) and not isinstance(v, torch.Tensor):
                self.bad(f"{key}/{k}", f"a {type(v).__name__} where the module has a tensor")
            restored[k] = v
            if not isinstance(v, torch.Tensor) or v is not sd[k] or local(v).data_ptr() not in live:
                needs_load = True
        if needs_load:  # e.g. extra state, or a state_dict that is not a view of the module
            self.after.append((key, lambda: dsd.set_model_state_dict(
                mod, restored, options=dsd.StateDictOptions(strict=False))))

    def optimizer(self, key, entry, opt, names):
        if not isinstance(entry.get("state"), dict) or not isinstance(entry.get("param_groups"), list):
            self.bad(key, "an optimizer entry without state and param_groups")
        params, pnames = names.optimizer_params(opt)
        pos = {id(p): i for i, p in enumerate(params)}
        by_name = dict(zip(pnames, params))
        stored_state = compat_fqns(entry["state"], slash=not names.single)
        stored_groups = entry["param_groups"]
        for gi, sg in enumerate(stored_groups):
            if not isinstance(sg, dict) or not isinstance(sg.get("params"), list):
                self.bad(f"{key}/param_groups/{gi}", "a parameter group without params")
            sg["params"] = [compat_name(n, slash=not names.single) for n in sg["params"]]
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
        self.after.append((key, lambda: set_optimizer(opt, params, new_state, groups)))

    def like(self, target, e, param):
        """The live target of a parameter's optimizer state: the current one, or,
        when there is none yet and the parameter is a DTensor, a new DTensor
        sharded as the parameter when the stored tensor has its shape (FSDP2's
        moments), so that each rank reads only its shard."""
        if target is not None or not is_dtensor(param) or not isinstance(e, dict) or \
                not isinstance(e.get("$t"), str) or len(e) != 1:
            return target
        info = self.tensors.get(e["$t"])
        if info is None or info.shape != tuple(param.shape) or info.dtype not in _dtypes.TORCH:
            return None
        with torch.no_grad():
            return torch.empty_like(param, dtype=_dtypes.TORCH[info.dtype]).detach()

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

    def plan(self, entries: dict, state: dict) -> None:
        """Plans every entry of `state` from the checkpoint's `entries`."""
        names = Names(state)
        for key, target in state.items():
            e = entries.get(key)
            if e is None:
                self.mismatch(key, f"not in the checkpoint of step {self.step}")
                continue
            self.entry(key, e, target, state, names)

    # -- the second pass --
    def apply(self):
        """Reads every planned tensor and applies the updates. Reads into new
        tensors come first: until they are done no live tensor has changed."""
        read_many(self.r, self.fresh)
        try:
            read_many(self.r, [(i, t, b) for i, t, _, b in self.inplace])
        except AmberError as err:
            keys = ", ".join(dict.fromkeys(k for _, _, k, _ in self.inplace))
            partial = AmberError(err.code, f"{err.message}; the live state is partially loaded: "
                                 f"tensors of {keys} may hold values of step {self.step} (where a "
                                 "chunk failed its check, its damaged bytes), the others their "
                                 "previous values, and nothing else was restored "
                                 "(load(..., fallback=True) verifies a step whole before "
                                 "restoring it)", name=err.name)
            partial.partial = True
            raise partial from err
        with torch.no_grad():
            for target, src in self.copies:
                target.copy_(src)
        for _, fn in self.after:
            fn()


def read_many(reader, items):
    """Reads (index, tensor, box) triples with one read_many (box: None for the
    whole tensor, else a region for a reader that serves regions). Tensors that
    share memory (tied weights) are read once: the library's buffers must not
    overlap."""
    once, later, seen = [], [], {}
    for idx, t, bx in items:
        n = t.numel() * t.element_size()
        if not n:
            continue
        it = (idx, t.data_ptr(), n) if bx is None else (idx, t.data_ptr(), n, bx)
        size = seen.setdefault(it[1], n)
        if size != n:
            later.append(it)  # another extent at the same address: after the rest
        elif len(seen) > len(once):
            once.append(it)
    reader.read_many(once)
    for it in later:
        reader.read_into(*it)


def set_optimizer(opt, params, new_state, groups):
    """Installs the restored state and param_groups, without copying tensors."""
    if type(opt).load_state_dict is torch.optim.Optimizer.load_state_dict:
        # what Optimizer.load_state_dict does, minus its casts (the tensors already
        # have the parameters' dtypes and devices)
        state = defaultdict(dict)
        state.update(new_state)
        opt.__setstate__({"state": state, "param_groups": groups})
    else:  # a custom optimizer: go through its own load_state_dict
        index = {id(p): i for i, p in enumerate(params)}
        opt.load_state_dict({
            "state": {index[id(p)]: s for p, s in new_state.items() if id(p) in index},
            "param_groups": [dict(g, params=[index[id(p)] for p in g["params"]])
                             for g in groups]})
