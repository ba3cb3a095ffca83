"""The save plan: what a save learns once about a state whose structure stays the same
from save to save, so that the next saves only check that nothing of it changed and
encode what does (param_groups, schedulers, plain values, RNG states). This is what
makes a delta's save() cost about a millisecond for GPT-2 small's 1040 tensors, at
any world size.

The structure is checked by identity through weak references (a plan keeps nothing
alive) and by the tensors' addresses; torch's registration hooks see parameters,
buffers and submodules added since. A save whose check fails takes the whole way,
which makes a new plan.
"""

import json
import weakref
from itertools import chain
from operator import attrgetter, is_, itemgetter
from typing import Optional

import torch

from ._capture import buffer_storages, owned_storages
from ._meta import SEP
from ._naming import Names, is_dtensor, plain_fqn

# Registrations of parameters, buffers and submodules anywhere (torch's global
# registration hooks, installed by the first save plan): a plan is stale once a
# module gained one.
_REGISTRATIONS = [0, False]


def _registered(*_):
    _REGISTRATIONS[0] += 1


def _watch_registrations():
    if not _REGISTRATIONS[1]:
        from torch.nn.modules import module as _mm
        _mm.register_module_parameter_registration_hook(_registered)
        _mm.register_module_buffer_registration_hook(_registered)
        _mm.register_module_module_registration_hook(_registered)
        _REGISTRATIONS[1] = True


class _Gone:
    pass


_none = weakref.ref(_Gone())  # dead at once: a weak reference that gives None
call = weakref.ref.__call__   # what a weak reference refers to (None when it is gone)

_vars = attrgetter("__dict__")
_sd_hooks = itemgetter("_state_dict_hooks")
_sd_pre_hooks = itemgetter("_state_dict_pre_hooks")
_data_ptr = torch.Tensor.data_ptr
_contiguous = torch.Tensor.is_contiguous
_local_of = attrgetter("_local_tensor")


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


def plain_equal(a, b) -> bool:
    """a == b for JSON-like values (dicts, lists, tuples, numbers, strings, None),
    False as soon as either holds anything else (a tensor's == is elementwise)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(plain_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(plain_equal(x, y) for x, y in zip(a, b))
    if a is None or isinstance(a, (bool, int, float, str)):
        return a == b or (a != a and b != b)  # NaN: the same encoding
    return False


_LEAF = ("T",)
INPLACE, COPY = "inplace", "copy"


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


class Plan:
    """What a save of a state with this structure reuses (see the module's text):
    the entries' tensors (the Items of the save that made the plan: declarations,
    staging buffers), their part of the metadata as JSON text, and what shows that
    nothing of that changed. param_groups, objects such as schedulers, plain values
    and RNG states are encoded at every save."""

    def __init__(self):
        self.layout = []     # (key, weakref(value), kind, data) per state key, in order
        self.mods = []       # weakref of every submodule of the cached modules
        self.held = []       # (position in mods, dict name) of each non-empty dict of theirs
        self.expect = []     # weakref of each value those dicts hold, in that order
        self.opts = []       # (weakref(optimizer), data) of the optimizer entries
        self.trees = []      # (key, spec) of the entries of tensors in dicts (_tree)
        self.leaves = []     # weakref of each of their tensors, in order
        self.static = []     # where each cached tensor is among the slots check() compares
        self.names_at = []   # per cached tensor: its name
        self.decls = []      # its Decl (None: not declared on this rank)
        self.how = []        # INPLACE, COPY, or None (declared, written by another rank)
        self.ptrs = []       # the data_ptr of what the library reads, at planning
        self.dist = False    # some cached tensor is a DTensor: it reads the shard's local
        self.copy_at, self.copy_dst = [], []  # which are copied at save(), their buffers
        self.inplace_at = []  # which are read in place (version-checked)
        self.dynamic = []    # (name, dtype, shape) of the tensors encoded at every save
        self.dyn_index = []  # their declaration index (None: not declared on this rank)
        self.names = frozenset()  # the cached tensors' names
        self.owned = self.buffers = frozenset()
        self.reg = _REGISTRATIONS[0]

    def check(self, state: dict):
        """(the cached tensors as the state holds them, what the library reads of
        each: the same, or a DTensor's local shard) when `state` still has the
        planned structure; else None. Written as whole-list operations (map, chain)
        rather than Python loops: it runs at every save, over every submodule and
        every tensor of the state."""
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
        reads = [_local_of(t) if is_dtensor(t) else t for t in tensors] if self.dist else tensors
        # the same memory, laid out the same way (`.data = x` swaps both without a trace;
        # a transposed view of a square matrix keeps the address)
        if list(map(_data_ptr, reads)) != self.ptrs or \
                not all(map(_contiguous, map(reads.__getitem__, self.inplace_at))):
            return None
        return tensors, reads


def _ptr(t):
    return (_local_of(t) if is_dtensor(t) else t).data_ptr()


def plan_of(state: dict, flat, meta: dict, spans: dict, items: list) -> Optional[Plan]:
    """A Plan of the save just made, or None when the state has a part that must be
    encoded at every save after all (a module that is not plain, an optimizer with
    non-tensor state or state_dict hooks, a tensor on the device path). `items[i]` is
    flat.tensors[i]'s Item, or None when this rank does not declare it."""
    _watch_registrations()
    names = Names(state)
    plan = Plan()
    static = set()
    owners = {}
    for key, value in state.items():
        a, b = spans[key]
        entry = meta["entries"][key]
        kind, data = "dynamic", None
        if isinstance(value, torch.nn.Module):
            # any module whose state dict is its parameters and buffers under the names
            # encoded (FSDP2's sharded DTensors too), checked below; not DDP's "module."
            mods, expect = [], []
            keys = _module_slots(value, mods, expect)
            st = entry["state"]
            if keys is None or len(keys) != b - a or len(st) != b - a or \
                    [plain_fqn(k) for k, _ in keys] != list(st) or \
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
                                                               separators=SEP)).encode()}
        elif isinstance(value, torch.optim.Optimizer):
            if type(value).state_dict is not torch.optim.Optimizer.state_dict or \
                    value._optimizer_state_dict_pre_hooks or \
                    value._optimizer_state_dict_post_hooks:
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
                    json.dumps(entry["state"], allow_nan=False, separators=SEP) +
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
                    entry, allow_nan=False, separators=SEP)).encode(), "n": b - a}
        if kind != "dynamic":
            for i in range(a, b):
                t, det = owners[i], flat.tensors[i][1]
                if t.shape != det.shape or t.dtype != det.dtype or is_dtensor(t) != is_dtensor(det) \
                        or (items[i] is not None and items[i].decl.on_device):
                    return None
                if _ptr(t) != _ptr(det):
                    return None
                static.add(i)
            if kind == "module":
                data["n"] = b - a
        plan.layout.append((key, None if kind in ("dynamic", "tree") else weakref.ref(value),
                            kind, data))
    declared = 0
    for i, (name, t) in enumerate(flat.tensors):
        it = items[i]
        if it is not None and it.decl.on_device:  # the device path
            return None
        if i not in static:
            plan.dynamic.append((name, t.dtype, t.shape))
            plan.dyn_index.append(None if it is None else declared)
            declared += it is not None
            continue
        declared += it is not None
        owner = owners[i]
        loc = _local_of(owner) if is_dtensor(owner) else owner
        plan.dist |= is_dtensor(owner)
        k = len(plan.static)
        plan.static.append(owner)  # made a position below
        plan.names_at.append(name)
        plan.decls.append(None if it is None else it.decl)
        plan.ptrs.append(loc.data_ptr())
        how = None if it is None or not it.writes else INPLACE if it.in_place else COPY
        plan.how.append(how)
        if how is INPLACE:
            plan.inplace_at.append(k)
        elif how is COPY:
            if loc.is_conj() or loc.is_neg():
                return None
            plan.copy_at.append(k)
            plan.copy_dst.append(it.source)
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
    plan.owned = frozenset(owned_storages(state))
    plan.buffers = frozenset(buffer_storages(state))
    return plan
