"""The metadata formats of the checkpoints amber's Python front ends write, and their
conversions. One owner for all four:

  amber.torch/1       the Checkpointer's, in a store of one process: {"entries": {key:
                      entry}, "rng": the RNG states' small fields, "step"}; the RNG
                      states' arrays are tensors "rng/...".
  amber.torch.dist/1  the Checkpointer's, per rank of a multi-rank store: the same
                      entries, and "rank", "world_size", "rng" (that rank's states as
                      JSON).
  amber.dcp/1         amber.dcp's, in a store of one process or per rank: {"keys":
                      {DCP key: tensor or value name}, "objects": {name: encoded value},
                      "paths": {DCP key: its path in the nested state dict (DCP's
                      planner_data)}, "bytes": [names of values stored as the bytes
                      DCP's planner made of them, as u8 tensors]}.

Each side loads the other's stores: a Checkpointer load converts amber.dcp's keys and
objects to entries (dcp_entries); the DCP Reader converts entries to keys and objects
(dcp_view). Item names are paths in the state dict joined by "/" in both.
"""

import json
from typing import Optional

import torch

import amber as _amber
from amber import AmberError

from ._values import Decoder, Encoder, format_error

TORCH = "amber.torch/1"
TORCH_DIST = "amber.torch.dist/1"
DCP = "amber.dcp/1"
SEP = (",", ":")


def dumps(meta: dict) -> str:
    return json.dumps(meta, allow_nan=False, separators=SEP)


def parse(raw, where: str):
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


def not_ours(where: str, whose: str) -> AmberError:
    return AmberError(_amber.EFORMAT, f"{where} was not written by {whose} (no amber "
                      "metadata)", name="AMBER_EFORMAT")


def dcp_parts(meta, step, where) -> tuple[dict, dict]:
    """(keys, objects) of amber.dcp metadata, checked."""
    if not isinstance(meta, dict) or meta.get("format") != DCP or \
            not isinstance(meta.get("keys"), dict) or not isinstance(meta.get("objects"), dict):
        raise not_ours(where, "amber.dcp")
    return meta["keys"], meta["objects"]


def dcp_entries(keys, objects, state: dict, step, pickled=()) -> dict:
    """The entries of amber.torch's metadata for `state`, from a step written through
    amber.dcp ({DCP key: name}, {name: encoded value}). amber.dcp names each item by its
    path in the state dict joined by "/" (an optimizer's state from get_state_dict is
    "<key>/state/<FQN>/exp_avg", its groups "<key>/param_groups/<i>/<field>"), so the
    names give each state key its part without parsing DCP's dotted keys."""
    if not isinstance(keys, dict) or not isinstance(objects, dict):
        raise format_error(step, "keys", "amber.dcp metadata without keys and objects")
    by_key = {}
    for name in keys.values():
        if isinstance(name, str):
            head = name.split("/", 1)[0]
            by_key.setdefault(head, []).append(name)

    pickled = set(pickled)

    def value(name):
        if name in pickled:
            return {"$pickled": name}
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
            entries[key] = {"type": "value" if key in objects or key in pickled else "tensor",
                            "value": value(key)}
        elif hasattr(target, "load_state_dict"):
            entries[key] = {"type": "object", "state": nest(key, names)}
        else:
            entries[key] = {"type": "value", "value": nest(key, names)}
    return entries


def checkpointer_meta(meta, state: dict, step, where: str, dist: bool,
                      dcp_ranks: Optional[list] = None) -> dict:
    """A step's metadata as the Checkpointer loads it: {"entries", "rng", ...}, from
    the Checkpointer's own format (TORCH, or TORCH_DIST when `dist`) or from
    amber.dcp's (converted; with many ranks `dcp_ranks` holds every rank's parsed
    metadata, each of which stored its own items)."""
    if isinstance(meta, dict) and meta.get("format") == DCP:
        keys, objects, pickled = {}, {}, []
        for i, m in enumerate(dcp_ranks if dcp_ranks is not None else [meta]):
            if m is None:
                continue
            k, o = dcp_parts(m, step, f"{where}, rank {i}" if dcp_ranks is not None else where)
            keys.update(k)
            objects.update(o)
            pickled += m.get("bytes", []) if isinstance(m.get("bytes"), list) else []
        return {"entries": dcp_entries(keys, objects, state, step, pickled)}
    want = TORCH_DIST if dist else TORCH
    if not isinstance(meta, dict) or meta.get("format") != want:
        raise not_ours(where, "amber.torch's distributed Checkpointer" if dist else "amber.torch")
    if not isinstance(meta.get("entries"), dict):
        raise format_error(step, "entries", "not a dict")
    return meta


class _Ref:
    """A tensor of the store, by name, in a state dict rebuilt from metadata."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


class _Refs(Decoder):
    """Decodes amber.torch's values with each tensor left as a _Ref."""

    def tensor(self, name, target=None, device=None):
        if not isinstance(name, str):
            self.bad(name, "a tensor reference that is not a name")
        return _Ref(name)


def dcp_paths(meta: dict, keys: dict) -> dict:
    """{DCP key: its path in the nested state dict} of amber.dcp metadata: as stored, or,
    for a step written before amber.dcp stored them, split from the names (a path
    joined by "/", an all-digit part a list index)."""
    paths = meta.get("paths")
    if isinstance(paths, dict):
        return {k: tuple(p) for k, p in paths.items() if isinstance(p, list)}
    return {k: tuple(int(p) if p.isdigit() else p for p in n.split("/"))
            for k, n in keys.items() if isinstance(n, str)}


def dcp_view(meta: dict, step) -> tuple[dict, dict, dict]:
    """A step written by amber.torch's Checkpointer (either format) as amber.dcp's
    (keys {DCP key: name}, objects {name: encoded value}, paths {DCP key: path in the
    nested state dict}): each entry rebuilt as the
    state dict DCP users pass (a module's {FQN: tensor}, an optimizer's {"state":
    {FQN: {...}}, "param_groups": [...]} as get_state_dict gives them, an object's
    state_dict, a value) and flattened as DCP flattens it."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    entries = meta.get("entries")
    if not isinstance(entries, dict):
        raise format_error(step, "entries", "not a dict")
    ld = _Refs(step)
    nested = {}
    for key, e in entries.items():
        kind = e.get("type") if isinstance(e, dict) else None
        if kind == "optimizer":
            groups = e.get("param_groups")
            if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
                ld.bad(key, "an optimizer entry without param_groups")
            nested[key] = {"state": ld.dec(e.get("state"), key), "param_groups": [
                dict(ld.dec({k: v for k, v in g.items() if k != "params"}, key),
                     params=list(g.get("params", []))) for g in groups]}
        elif kind in ("module", "object"):
            nested[key] = ld.dec(e.get("state"), key)
        elif kind in ("value", "tensor"):
            nested[key] = ld.dec(e.get("value"), key)
        else:
            ld.bad(key, "an entry without a known type")
    flat, mappings = flatten_state_dict(nested)
    keys, objects, enc = {}, {}, Encoder()
    paths = {k: tuple(mappings.get(k, (k,))) for k in flat}
    for fqn, v in flat.items():
        if isinstance(v, _Ref):
            keys[fqn] = v.name
            continue
        # apart from the tensors' names
        name = "dcp:" + "/".join(str(p) for p in mappings.get(fqn, (fqn,)))
        try:
            objects[name] = enc.enc(v, name)
        except TypeError:
            raise AmberError(_amber.EFORMAT, f"step {step}: {fqn}: a value holding tensors, "
                             "which DCP's flattening keeps whole", name="AMBER_EFORMAT") from None
        keys[fqn] = name
    return keys, objects, paths
