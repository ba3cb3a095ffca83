"""A state dict as a checkpoint: its tensors, named, in declaration order, and the JSON
metadata that describes the rest (entries by key; docs/DESIGN.md, "amber.torch's
metadata"), and each tensor's unit for rules in units of the learning rate."""

from operator import itemgetter

import torch

from . import _dtypes, _rng
from ._naming import Names, is_dtensor, model_state, optimizer_state
from ._values import Encoder


class Flat(Encoder):
    """Tensors of one save in declaration order, and the JSON that describes the rest.
    With `dist` (many ranks, or a multi-rank store) DTensors are taken as they are:
    shards of their global tensors."""

    def __init__(self, dist: bool = False, reserved=frozenset()):
        self.tensors: list[tuple[str, torch.Tensor]] = []  # (name, tensor, detached)
        self.names: set[str] = set()
        self.reserved = reserved  # names taken already (a save plan's cached tensors)
        self.dist = dist

    def tensor(self, name, t):
        if name in self.names or name in self.reserved:
            raise ValueError(f"{name}: two tensors of the state have this name")
        if is_dtensor(t) and not self.dist:
            raise TypeError(f"{name}: a DTensor, and torch.distributed is not initialized with "
                            "more than one rank (the distributed Checkpointer saves DTensors; "
                            "pass process_group= to use it)")
        if self.dist and is_dtensor(t):
            pass
        elif not isinstance(t, torch.Tensor) or type(t) is not torch.Tensor and \
                not isinstance(t, torch.nn.Parameter):
            raise TypeError(f"{name}: {type(t).__name__} tensors are not supported "
                            "(DTensor and other tensor subclasses come with the distributed "
                            "Checkpointer)")
        if t.layout != torch.strided:
            raise TypeError(f"{name}: {t.layout} tensors are not supported")
        _dtypes.code(t, name)
        self.names.add(name)
        self.tensors.append((name, t.detach()))
        return {"$t": name}

    def optimizer(self, opt, key, names):
        state, groups = optimizer_state(opt, names)
        out_state = {pn: self.enc(dict(s), f"{key}/{pn}") for pn, s in state.items()}
        out_groups = []
        for g in groups:
            e = self.enc({k: v for k, v in g.items() if k != "params"}, f"{key}/param_groups")
            e["params"] = list(g["params"])
            out_groups.append(e)
        return {"type": "optimizer", "class": type(opt).__name__, "state": out_state,
                "param_groups": out_groups}

    def rng(self):
        out, tensors = _rng.tensor_form()
        for name, t in tensors:
            self.tensor(name, t)
        return out


def entry(flat: Flat, names, key, value):
    """The metadata entry of state[key], its tensors added to `flat`."""
    if isinstance(value, torch.Tensor):
        return {"type": "tensor", "value": flat.tensor(key, value)}
    if isinstance(value, torch.nn.Module):
        return {"type": "module", "state": flat.enc(model_state(value, names.plain[id(value)]), key)}
    if isinstance(value, torch.optim.Optimizer):
        return flat.optimizer(value, key, names)
    if hasattr(value, "state_dict") and hasattr(value, "load_state_dict"):
        return {"type": "object", "class": type(value).__name__,
                "state": flat.enc(value.state_dict(), key, code_ok=True)}
    return {"type": "value", "value": flat.enc(value, key)}


def check_key(key, rng: bool) -> None:
    if not isinstance(key, str) or not key:
        raise TypeError(f"state keys must be non-empty strings, not {key!r}")
    if rng and key == "rng":
        raise ValueError("state key 'rng' is reserved for the RNG states (or pass rng=False)")


def flatten(state: dict, rng_tensors: bool, dist: bool = False, spans=None):
    """(Flat of the state's tensors, {"entries": ...}). `rng_tensors`: the RNG states
    in their tensor form (a store of one process). `spans`, when given, gets each
    key's (first, end) positions in flat.tensors."""
    flat = Flat(dist)
    names = Names(state)
    entries = {}
    for key, value in state.items():
        check_key(key, rng_tensors)
        first = len(flat.tensors)
        entries[key] = entry(flat, names, key, value)
        if spans is not None:
            spans[key] = (first, len(flat.tensors))
    meta = {"entries": entries}
    if rng_tensors:
        meta["rng"] = flat.rng()
    return flat, meta


class UnitMap:
    """Where each flattened tensor's unit (what "Nu" in a policy rule multiplies)
    comes from: the learning rate of the param group of the parameter it belongs to
    (the parameter itself, under each of its names, and its optimizer state); none (0)
    for everything else. Made once per state structure; a save then reads the few
    groups' learning rates (lrs) and spreads them over the tensors (units) in one
    C-level call."""

    def __init__(self, tensor_names: list, state: dict):
        names = Names(state)
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
        at = [where.get(n, where.get(n.rpartition("/")[0], none)) for n in tensor_names]
        pick = itemgetter(*at) if at else (lambda lrs: ())
        self._pick = pick if len(at) != 1 else (lambda lrs: (pick(lrs),))

    def lrs(self, state: dict) -> tuple:
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

    def units(self, lrs: tuple) -> list:
        return list(self._pick(lrs + (0.0,)))
