"""The save side of the pipeline: where a save's tensors and metadata go.

  StoreSink   a store of one process: an amber.Writer on an amber.Store.
  GlobalSink  a multi-rank store: this rank's amber.GlobalWriter over the job's
              communicator (a one-process job on such a store has a communicator
              of one), whose commit is global.

Both take the same declarations (Decl: every tensor as the box of its global tensor
that this rank holds; a tensor of one process is the whole of itself) and the same
calls, so the Checkpointer and the DCP Writer run one pipeline over either.
"""

import os
import warnings
from dataclasses import dataclass
from typing import Optional

import torch

import amber as _amber
from amber import AmberError, GlobalWriter, Store
from amber import device as _device

from ._source import single_store
from ._meta import TORCH, TORCH_DIST


@dataclass(frozen=True)
class Decl:
    """One tensor as a sink declares it: this rank's box (offsets, local shape) of
    global tensor `name`; `replicated`: whole on every rank (written by rank 0);
    `on_device`: selected on its device by amber.device (no address)."""
    name: str
    dtype: int
    global_shape: tuple
    offsets: tuple
    local_shape: tuple
    replicated: bool
    on_device: bool


@dataclass
class Item:
    """One tensor of one save: its declaration and what the library reads for it.
    `tensor` is the tensor as the state holds it (a DTensor for a shard), `local` the
    part this rank holds; `source` what the library reads (`local` itself when it is
    read in place, else its staging copy; None when it is on its device or written
    by another rank)."""
    decl: Decl
    tensor: torch.Tensor
    local: torch.Tensor
    writes: bool = True
    source: Optional[torch.Tensor] = None
    in_place: bool = False

    @property
    def address(self) -> Optional[int]:
        if self.decl.on_device:
            return None
        s = self.source
        return s.data_ptr() if s is not None and s.numel() else 0


@dataclass(frozen=True)
class WriterOptions:
    """The writer's options, as amber.Writer and amber.GlobalWriter take them."""
    chunk_elems: int = 0
    full_every: int = 0
    full_share: float = 0.0
    keep_last: int = 0

    def kwargs(self) -> dict:
        return {"chunk_elems": self.chunk_elems, "full_every": self.full_every,
                "full_share": self.full_share, "keep_last": self.keep_last}


def prune_warning(status, last, what):
    """Warns (amber.PruneWarning) that `what`, with the retention's failure message,
    once per distinct failure; `status` is a writer's prune_status(), `last` the
    message warned of last time. Returns the message to remember."""
    rc, _, msg = status
    if rc and msg != last:
        warnings.warn(f"amber: {what}: {msg}", _amber.PruneWarning, stacklevel=4)
    return msg if rc else None


class _Sink:
    """What both sinks share: the writer's calls and retention warnings; `tiers` (a
    _tiers.Tiers) when the sink's store is a memory tier, kicked after each commit
    (an s3:// store's is always one: see _tiers), and closed with the sink."""
    writer = None
    tiers = None

    def __init__(self, path: str, opts: WriterOptions, rules: tuple):
        self.path = path
        self.opts = opts
        self.rules = rules
        self._prune_msg = None

    def _declare_on(self, w, items: list, dev, extra_rules):
        for it in items:
            d = it.decl
            if d.on_device:
                self._declare_device(w, dev, it)
            else:
                self._add(w, it)
        for r in tuple(self.rules) + tuple(extra_rules):
            w.add_policy(r)

    def point(self, index: int, address: int) -> None:
        self.writer.set_data(index, address)

    def set_meta(self, meta) -> None:
        self.writer.set_meta(meta)

    def set_units(self, units: list) -> None:
        self.writer.set_units(units)

    def begin(self, step: int, full: bool, confirm: bool, voted: bool = False) -> None:
        self.step = step  # what wait() commits
        if voted:  # the ranks agreed on full or delta in their own vote (global writer)
            self.writer.begin(step, full=full, confirm=confirm, voted=True)
        else:
            self.writer.begin(step, full=full, confirm=confirm)

    def fence(self) -> None:
        self.writer.fence()

    def confirm(self, ok: bool, why: str = "") -> None:
        self.writer.confirm(ok, why)

    def wait(self) -> None:
        self.writer.wait()

    def committed(self) -> None:
        """After the writer's wait: the drain takes the step on (kicked; flushed for an
        s3:// store's staging directory), raising its failure. The step is committed
        in the memory tier whatever this raises."""
        if self.tiers is not None:
            self.tiers.committed(self.step)

    def wants_full(self) -> bool:
        """Whether the next save should be full: the memory tier is over its budget."""
        return self.tiers is not None and self.tiers.wants_full()

    def warn_prune(self, what: str) -> None:
        if self.opts.keep_last and self.writer is not None:
            self._prune_msg = prune_warning(self.writer.prune_status(), self._prune_msg,
                                            f"{what} (keep_last={self.opts.keep_last})")

    def close_writer(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def close_tiers(self, flush: bool = True) -> None:
        """Stops the drain of the memory tier (after waiting until the durable tier
        holds every committed step, with `flush`); raises the drain's failure."""
        tiers, self.tiers = self.tiers, None
        if tiers is not None:
            tiers.close(flush=flush)

    def newest(self, mine: Optional[int]) -> Optional[int]:
        """The newer of `mine` (the sink's own store's latest) and the durable tier's."""
        d = self.tiers.durable_latest() if self.tiers is not None else None
        return mine if d is None else d if mine is None else max(mine, d)


class StoreSink(_Sink):
    """A store of one process (STORE/LATEST, STORE/ckpt-*.amber). The store is opened,
    and locked, at construction; `readonly` opens it for loads only, unlocked."""
    dist = False            # DTensors are refused: every tensor is whole
    meta_format = TORCH
    rng_tensors = True      # the RNG states' arrays are tensors of the checkpoint
    background_ok = True    # a device selection may run on a thread (AMBER_DEVICE_ASYNC)

    def __init__(self, path, opts: WriterOptions, rules, readonly=False, threads=0):
        if not readonly and not _amber.is_url(os.fspath(path)):
            os.makedirs(os.path.dirname(os.path.abspath(os.fspath(path))), exist_ok=True)
        self.store = Store(path, readonly=readonly, create=not readonly, threads=threads)
        super().__init__(self.store.path, opts, rules)

    @staticmethod
    def _add(w, it):
        w.add(it.decl.name, it.decl.dtype, it.decl.local_shape, it.address)

    @staticmethod
    def _declare_device(w, dev, it):
        dev.declare(w, it.decl.name, it.decl.dtype, it.local)

    def open(self, items: list, dev, extra_rules=()) -> None:
        """A new writer declaring `items` (its first save is a full one)."""
        self.close_writer()
        w = self.store.writer(**self.opts.kwargs())
        try:
            self._declare_on(w, items, dev, extra_rules)
        except BaseException:
            w.close()
            raise
        self.writer = w

    def check_save(self) -> None:
        pass

    def plan_device(self, dev, step, flags):
        return dev.plan(self.writer, self.store, step, flags, _amber.SAVE_FULL)

    def seed_reference(self, step: int) -> None:
        self.writer.seed_reference(step)

    def latest(self) -> Optional[int]:
        """The latest step (with a memory tier: of either tier)."""
        return self.newest(self.store.latest())

    def steps(self) -> list:
        """The committed checkpoints (with a memory tier: of both tiers, the memory
        tier's where both hold a step)."""
        if self.tiers is None:
            return self.store.list()
        got = {i.step: i for i in self.tiers.durable_steps()}
        got.update((i.step, i) for i in self.store.list())
        return [got[k] for k in sorted(got)]

    def close(self) -> None:
        self.close_writer()
        try:
            self.close_tiers(flush=False)
        except AmberError:
            pass  # raised by the close that flushed, or by the next save's kick
        if self.store is not None:
            self.store.close()
            self.store = None


class GlobalSink(_Sink):
    """A multi-rank store (STORE/GLOBAL, manifests, STORE/rank-RRRRR/), this rank's part
    through an amber.GlobalWriter over `comm`. The writer is opened by the first save
    (collectively: every rank of `comm` opens it), so a Checkpointer that only loads
    changes nothing."""
    dist = True
    meta_format = TORCH_DIST
    rng_tensors = False     # each rank's RNG states are in its own metadata
    background_ok = False   # begin is collective: on the calling thread
    store = None

    def __init__(self, path, opts: WriterOptions, rules, comm, local: bool = False):
        path = os.fspath(path)
        super().__init__(path if _amber.is_url(path) else os.path.abspath(path), opts, rules)
        self.comm = comm
        self.local = local  # `path` is this rank's own (a memory tier): local mode

    @staticmethod
    def _add(w, it):
        d = it.decl
        w.add(d.name, d.dtype, d.global_shape, d.offsets, d.local_shape, it.address,
              replicated=d.replicated)

    @staticmethod
    def _declare_device(w, dev, it):
        d = it.decl
        dev.declare(w, d.name, d.dtype, it.local, global_shape=d.global_shape,
                    offsets=d.offsets, replicated=d.replicated)

    def open(self, items: list, dev, extra_rules=()) -> None:
        """A new global writer declaring `items` (collective: every rank reopens when
        any rank's declarations changed)."""
        self.close_writer()
        if self.comm.rank == 0:
            os.makedirs(self.path, exist_ok=True)
        # a job of one: the library's own communicator (no Python in its collectives)
        w = GlobalWriter(self.path, self.comm if self.comm.size > 1 else None,
                         local=self.local, **self.opts.kwargs())
        try:
            self._declare_on(w, items, dev, extra_rules)
        except BaseException:
            w.close()
            raise
        self.writer = w

    def check_save(self) -> None:
        for path in (self.path,) + ((self.tiers.durable,) if self.tiers is not None else ()):
            if single_store(path):
                raise ValueError(f"{path} holds a store written by one process, which "
                                 "many ranks load but do not save into: save to a new path")

    def plan_device(self, dev, step, flags):
        return dev.plan_global(self.writer, self.comm, self.path, step, flags)

    def seed_reference(self, step: int) -> None:
        """This rank's part (amber_global_writer_seed_reference): not collective."""
        self.writer.seed_reference(step)

    def latest(self) -> Optional[int]:
        steps = _amber.global_steps(self.path) if _amber.is_global_store(self.path) else []
        return self.newest(steps[-1].step if steps else None)

    def steps(self) -> list:
        return _amber.global_steps(self.path) if _amber.is_global_store(self.path) else []

    def committed(self) -> None:
        """Each rank's part drained; for an s3:// store's staging directory the ranks
        then agree (one all_gather), so that wait() returns on every rank once the
        global step is durable in the object store (rank 0's drain moves GLOBAL), or
        raises on every rank, naming the rank whose drain failed."""
        if self.tiers is None or not self.tiers.opts.staging:
            return super().committed()
        why = None
        try:
            self.tiers.committed(self.step)
        except AmberError as e:
            why = (e.code, e.message)
        votes = self.comm.gather_objects(why)
        bad = [(r, v) for r, v in enumerate(votes) if v]
        if bad:
            r, (code, msg) = bad[0]
            raise AmberError(code, f"rank {r}: {msg}")

    def close(self) -> None:
        self.close_writer()
        try:
            self.close_tiers(flush=False)
        except AmberError:
            pass  # raised by the close that flushed, or by the next save's wait


def device_wanted(t: torch.Tensor, forced: bool) -> bool:
    """Whether tensor `t` is selected on its device (amber.device): it is not on the
    CPU, or the options force the device path (AMBER_DEVICE_PATH=1)."""
    return forced or t.device.type != "cpu"


def new_device_path(host_ref: Optional[bool]):
    return _device.DevicePath(host_ref=host_ref)
