"""The capture rule: what a save may read in place until the fence, what it copies
before save() returns, and how a change in between is caught. One rule for every
front end (amber.torch's Checkpointer at any world size, amber.dcp's Writer).

  - Read in place by the scan, until the fence: a contiguous CPU tensor whose
    version counter the fence can check (all but inference tensors) when a saved
    optimizer owns it (its step is fenced: any size), or else when it is above
    `capture_bytes` and not a module buffer.
  - Copied into staging buffers reused from save to save: everything else (module
    buffers that no saved optimizer owns, which the next forward pass may change in
    place; small tensors; inference tensors; tensors that are not contiguous CPU
    tensors).
  - Checked: each tensor read in place has its version counter read when the save
    begins and compared at the fence (Versions); a moved counter makes the save
    fail uncommitted (AMBER_ECHANGED). The fence runs by itself before the step of
    any torch.optim optimizer (FenceHooks).
"""

import weakref
from operator import attrgetter
from typing import Callable, Optional

import torch

from ._naming import local

CAPTURE_BYTES = 256 << 10  # the default of capture_bytes (AMBER_CAPTURE_BYTES)


def storage_key(t) -> Optional[int]:
    t = local(t)
    return t.untyped_storage().data_ptr() if t.numel() else None


def owned_storages(state: dict) -> set:
    """Storages of the saved optimizers' parameters and state tensors."""
    out = set()
    for v in state.values():
        if isinstance(v, torch.optim.Optimizer):
            for g in v.param_groups:
                for p in g["params"]:
                    out.add(storage_key(p))
            for s in v.state.values():
                for t in s.values():
                    if isinstance(t, torch.Tensor):
                        out.add(storage_key(t))
    out.discard(None)
    return out


def buffer_storages(state: dict) -> set:
    """Storages of the module buffers of the state."""
    out = set()
    for v in state.values():
        if isinstance(v, torch.nn.Module):
            for b in v.buffers():
                out.add(storage_key(b))
    out.discard(None)
    return out


def readable_in_place(t: torch.Tensor) -> bool:
    """Whether the library can read `t` where it lies and the fence can check it."""
    return (t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() and
            not t.is_neg() and not t.is_inference())


def in_place(t: torch.Tensor, nbytes: int, owned, buffers, capture_bytes: int) -> bool:
    """Whether a save reads `t` in place until the fence (else it copies it now)."""
    if not readable_in_place(t):
        return False
    key = storage_key(t)
    if key in owned:
        return True
    return nbytes > capture_bytes and key not in buffers


_version = attrgetter("_version")


class Versions:
    """The version counters of the tensors a save reads in place, taken when it
    begins and compared at the fence (one list each way: no per-tensor objects)."""
    __slots__ = ("names", "tensors", "seen")

    def __init__(self, names: list, tensors: list):
        self.names, self.tensors = names, tensors
        self.seen = list(map(_version, tensors))

    def __bool__(self):
        return bool(self.tensors)

    def changed(self) -> Optional[str]:
        """The first tensor whose counter moved, or None."""
        now = list(map(_version, self.tensors))
        if now == self.seen:
            return None
        return next(n for n, a, b in zip(self.names, now, self.seen) if a != b)


def torn_message(name: str, what: str) -> str:
    """Why a save was not committed: tensor `name` changed in place before the fence."""
    return (f"tensor '{name}' changed in place after {what} and before the fence: the "
            "checkpoint could hold a torn state, so it was not committed")


class Staging:
    """Staging buffers by key (a tensor's name and box offsets: one rank may hold
    several boxes of one tensor), reused from save to save."""

    def __init__(self):
        self.bufs: dict = {}

    def copy(self, name, t: torch.Tensor) -> torch.Tensor:
        """`t` copied into its buffer (made or remade as needed)."""
        buf = self.bufs.get(name)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype)
            self.bufs[name] = buf
        buf.copy_(t.resolve_conj().resolve_neg())
        return buf

    def keep_only(self, names) -> None:
        """Drops the buffers whose keys are not in `names`."""
        if len(self.bufs) > len(names):
            names = set(names)
            self.bufs = {n: b for n, b in self.bufs.items() if n in names}


class FenceHooks:
    """Runs `fence` (when `busy()` says a save or a seed reads the tensors) before
    the step of every torch.optim optimizer: a global step pre-hook, since an
    optimizer that the saved state does not hold may change what a save reads (a
    model saved without its optimizer). The owner is held weakly."""

    def __init__(self, owner, fence: Callable[[object], None], busy: Callable[[object], bool]):
        ref = weakref.ref(owner)

        def hook(_opt, _args, _kwargs):
            o = ref()
            if o is not None and busy(o):
                fence(o)
        from torch.optim.optimizer import register_optimizer_step_pre_hook
        self._handle = register_optimizer_step_pre_hook(hook)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
