"""How the tensors of a state are named: modules by fully qualified name (FQN), as
torch.distributed.checkpoint.state_dict names them; optimizer state by its
parameter's FQN; DTensors as boxes of their global tensors."""

import itertools
from typing import Optional

import torch
from torch.distributed.checkpoint import state_dict as dsd

try:
    from torch.distributed.tensor import DTensor as _DTensor
except ImportError:  # a torch built without distributed support
    _DTensor = None


def is_dtensor(t) -> bool:
    return _DTensor is not None and isinstance(t, _DTensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The tensor that holds `t`'s data on this rank: a DTensor's local shard, else `t`."""
    return t.to_local() if is_dtensor(t) else t


def box(t):
    """(local tensor, global shape, offsets, local shape, writes, replicated) of a
    DTensor: the region of its global tensor this rank holds, whether this rank is
    the one that writes it (the rank at coordinate 0 of the mesh dimensions that
    replicate it), and whether it is whole on every rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    placements = t.placements
    if any(p.is_partial() for p in placements):
        raise TypeError("a DTensor with Partial placements (pending reductions) cannot be "
                        "saved; redistribute it first")
    loc = t.to_local()
    gshape = tuple(t.shape)
    if all(p.is_replicate() for p in placements):
        return loc, gshape, (0,) * len(gshape), gshape, True, True
    coord = t.device_mesh.get_coordinate()
    lshape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)
    writes = coord is not None and all(c == 0 for c, p in zip(coord, placements)
                                       if p.is_replicate())
    return loc, gshape, tuple(off), tuple(lshape), writes, False


def plain(mod: torch.nn.Module) -> bool:
    """True when `mod` holds only plain tensors and no wrapper that renames or shards
    its state (DDP, FSDP, checkpoint wrappers: anything from torch.distributed):
    then its state_dict() with torch.compile's "_orig_mod." removed is exactly what
    get_model_state_dict gives, at a fraction of the cost (save() pays it at every
    step)."""
    for i, m in enumerate(mod.modules()):
        if type(m).__module__.startswith(("torch.distributed", "torch.nn.parallel")):
            return False
        if i and type(m).__name__ == "OptimizedModule":
            return False  # a compiled submodule: get_model_state_dict orders it last
    for t in itertools.chain(mod.parameters(), mod.buffers()):
        if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter:
            return False
    return True


def plain_fqn(name: str) -> str:
    return ".".join(p for p in name.split(".") if p != "_orig_mod") if "_orig_mod" in name else name


def fqn(module: torch.nn.Module, name: str) -> str:
    """The fully qualified name that torch.distributed.checkpoint.state_dict gives the
    parameter or buffer `name` of `module` ("_orig_mod." of torch.compile and the
    "module." of DDP removed)."""
    try:
        fqns = dsd._get_fqns(module, name)
        if len(fqns) == 1:
            return next(iter(fqns))
    except Exception:  # a private helper: fall back to the same rule by hand
        pass
    return ".".join(p for p in name.split(".") if p != "_orig_mod")


class Names:
    """The modules of one save/load call and the names of their parameters."""

    def __init__(self, state: dict):
        self.modules = [(k, v) for k, v in state.items() if isinstance(v, torch.nn.Module)]
        self.single = len(self.modules) == 1
        self.by_id = {}  # id(parameter) -> name ("<FQN>" or "<module key>/<FQN>")
        self.aliases = {}  # id(parameter) -> every name (tied weights have several)
        self.plain = {}  # id(module) -> plain(module)
        for key, mod in self.modules:
            is_plain = self.plain[id(mod)] = plain(mod)
            for pname, p in mod.named_parameters(remove_duplicate=False):
                f = plain_fqn(pname) if is_plain else fqn(mod, pname)
                self.aliases.setdefault(id(p), []).append(f if self.single else f"{key}/{f}")
                if id(p) not in self.by_id:
                    self.by_id[id(p)] = f if self.single else f"{key}/{f}"

    def optimizer_params(self, opt):
        """The optimizer's parameters in state_dict order, and their names."""
        params, seen = [], set()
        for g in opt.param_groups:
            for p in g["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params, [self.by_id.get(id(p), f"param{i}") for i, p in enumerate(params)]

    def owner(self, opt) -> Optional[torch.nn.Module]:
        """The module that get_optimizer_state_dict can name `opt`'s parameters
        against: the call's one module when it owns all of them; else None."""
        if not self.single:
            return None
        params, _ = self.optimizer_params(opt)
        mod = self.modules[0][1]
        own = {id(p) for p in mod.parameters()}
        return mod if all(id(p) in own for p in params) else None


def model_state(mod: torch.nn.Module, is_plain: Optional[bool] = None) -> dict:
    """get_model_state_dict(mod): FQN -> value (the module's tensors themselves, not
    copies, for modules that are not FSDP1-wrapped). A plain module's comes from its
    own state_dict() (see plain(); tests/python/test_torch_v2.py checks that both agree)."""
    if is_plain if is_plain is not None else plain(mod):
        return {plain_fqn(k): v for k, v in mod.state_dict().items()}
    return dsd.get_model_state_dict(mod)


def optimizer_state(opt, names: Names):
    """The optimizer's state_dict with parameters named: ({name: {k: v}}, groups).
    Through get_optimizer_state_dict when the call's module owns every parameter and
    the optimizer has state (it would otherwise take a zero-lr step to create it)."""
    params, pnames = names.optimizer_params(opt)
    mod = names.owner(opt)
    # for a plain module, the renaming below is what get_optimizer_state_dict does
    if mod is not None and opt.state and not names.plain[id(mod)]:
        osd = dsd.get_optimizer_state_dict(mod, opt)
        return dict(osd["state"]), [dict(g) for g in osd["param_groups"]]
    sd = opt.state_dict()
    state = {}
    for idx, s in sd["state"].items():
        if not isinstance(idx, int) or idx >= len(pnames):
            raise TypeError(f"optimizer state key {idx!r} is not a parameter index")
        state[pnames[idx]] = s
    groups = [dict(g, params=[pnames[i] for i in g["params"]]) for g in sd["param_groups"]]
    return state, groups


def compat_name(name, slash: bool = False):
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


def compat_fqns(stored: dict, slash: bool = False) -> dict:
    if not any(isinstance(k, str) and "_orig_mod" in k for k in stored):
        return stored
    return {compat_name(k, slash): v for k, v in stored.items()}
