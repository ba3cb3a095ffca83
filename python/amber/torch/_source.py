"""The load side of the pipeline: where a load reads from.

  StoreSource   a store of one process: whole tensors, and for a DTensor of a job of
                many ranks the box it holds, read out of its whole tensor.
  GlobalSource  a multi-rank store: any box of any global tensor, assembled from the
                shards that overlap it, whatever world size wrote the step.

step() opens a committed step as stored (Step: its tensors, each rank's metadata,
reads of any box): what the DCP Reader and hf.export read through. open() builds on
it for the Checkpointer: the step's metadata as the Checkpointer loads it (whatever
front end wrote it: _meta converts), a reader for _load.Load, and which RNG states
this rank gets back. source_for() picks the source of a path.
"""

import os
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional

import amber as _amber
from amber import AmberError, GlobalReader, Store

from . import _meta


# ---- what a store holds (a directory or an s3:// URL) ----

def is_url(path) -> bool:
    """Whether a store path names an object store ("s3://..."), which os.path must not
    touch (amber.is_url)."""
    return isinstance(path, (str, os.PathLike)) and _amber.is_url(os.fspath(path))


def latest_of(path: str, many: bool = False) -> Optional[int]:
    """The latest step of the store of one process at `path` (`many`: of the
    multi-rank store), or None (no store, or an empty or unreadable one)."""
    try:
        if many or _amber.is_global_store(path):
            steps = _amber.global_steps(path) if _amber.is_global_store(path) else []
            return steps[-1].step if steps else None
        if not is_url(path) and not os.path.exists(os.path.join(path, "LATEST")):
            return None
        with _amber.Store(path, readonly=True, create=False) as st:
            return st.latest()
    except _amber.AmberError:
        return None


def single_store(path) -> bool:
    """Whether `path` holds a store of one process (its LATEST), not a multi-rank one."""
    if is_url(path):
        return not _amber.is_global_store(path) and latest_of(path) is not None
    return not _amber.is_global_store(path) and os.path.exists(os.path.join(path, "LATEST"))


def steps_of(path) -> list:
    """The committed checkpoints of the store of one process at `path` (CheckpointInfo),
    [] when there is none."""
    if is_url(path) and latest_of(path) is None:  # an empty prefix, or none readable
        return []
    if not is_url(path) and not os.path.exists(os.path.join(path, "LATEST")):
        return []
    with _amber.Store(path, readonly=True, create=False) as st:
        return st.list()


def holds(path: str, step: Optional[int]) -> bool:
    """Whether the store of one process at `path` holds committed `step` (None: any)."""
    try:
        return any(i.step == step or step is None for i in steps_of(path))
    except _amber.AmberError:
        return False



class Step:
    """One committed step opened for reading as it is stored, whatever front end wrote
    it: its tensors (a multi-rank store's by global shape), each rank's metadata, and
    reads of any box of any tensor, every chunk's checksum checked before a byte is
    handed over, all in one call of the library. What the Checkpointer's load, the DCP
    Reader and hf.export read through (StoreSource.step, GlobalSource.step)."""

    def __init__(self, reader, many: bool, where: str, skipped: int = 0):
        self.reader = reader    # amber.Reader, or amber.GlobalReader when `many`
        self.many = many
        self.step = reader.step
        self.skipped = skipped  # steps passed over by fallback=True
        self.where = where      # "step N of PATH", for messages
        self.world = reader.world_size if many else 1

    def tensors(self) -> list:
        """TensorInfo of every tensor (global shapes for a multi-rank store)."""
        return self.reader.tensors()

    def find(self, name: str) -> Optional[int]:
        return self.reader.find(name)

    def info(self, index: int):
        return self.reader.tensors()[index] if self.many else self.reader.info(index)

    def meta(self, rank: int = 0):
        """The metadata rank `rank` saved (bytes, or None; a store of one process has
        rank 0's alone)."""
        if self.many:
            return self.reader.meta(rank)
        return self.reader.meta() if rank == 0 else None

    def read_boxes(self, items) -> None:
        """Reads [(index, offsets, shape, address, nbytes)]: each box of its tensor
        into the memory at `address` (a whole tensor: zero offsets, its shape)."""
        if self.many:
            self.reader.read_many(items)
        else:
            self.reader.read_boxes(items)

    def read_whole(self, tensors) -> None:
        """Reads [(index, torch tensor)]: each whole tensor into the tensor given (its
        shape and dtype, contiguous)."""
        self.read_boxes([(i, (0,) * t.dim(), tuple(t.shape), t.data_ptr() if t.numel() else 0,
                          t.numel() * t.element_size()) for i, t in tensors])


class TieredStep:
    """A global step read from this host's memory tier first, and from the durable
    tier where a read needs a file the memory tier lacks (a rank of another host) or
    finds damaged: the files are the same (the drain copies them), so every read gets
    the same bytes. `steps`: the Steps of the tiers that hold the step, fastest first.
    `used` (a list, kept by the caller across the steps it opens) gets the name of each
    tier that served a read."""

    FALL_BACK = (_amber.ENOENT, _amber.ECORRUPT)

    def __init__(self, steps: list, tiers: list, used: list):
        self.steps, self.tiers, self.used = steps, tiers, used
        first = steps[0]
        self.step, self.many, self.world, self.where = first.step, True, first.world, first.where
        self.skipped = 0

    def _each(self, call):
        first = None
        for k, s in enumerate(self.steps):
            try:
                out = call(s)
            except AmberError as e:
                if e.code not in self.FALL_BACK:
                    raise
                first = first or e
                continue
            if self.tiers[k] not in self.used:
                self.used.append(self.tiers[k])
            return out
        if len(self.steps) == 1:
            raise AmberError(first.code, f"{first.message} (the {self.tiers[0]} tier here lacks the "
                             f"file or holds it damaged, and the durable tier does not hold "
                             f"global step {self.step}: `amber drain` finishes a drain)",
                             name=first.name) from first
        raise first

    def tensors(self) -> list:
        return self._each(lambda s: s.tensors())

    def find(self, name: str) -> Optional[int]:
        return self._each(lambda s: s.find(name))

    def info(self, index: int):
        return self._each(lambda s: s.info(index))

    def meta(self, rank: int = 0):
        return self._each(lambda s: s.meta(rank))

    def read_boxes(self, items) -> None:
        self._each(lambda s: s.read_boxes(items))

    read_whole = Step.read_whole  # through read_boxes above


def source_for(path: str):
    """The source of whatever store `path` holds: a StoreSource for a store of one
    process, a GlobalSource for a multi-rank one; FileNotFoundError when neither."""
    if _amber.is_global_store(path):
        return GlobalSource(path)
    if single_store(path):
        return StoreSource(path)
    raise FileNotFoundError(f"{path} is not an amber store")


@dataclass
class Opened:
    """A step opened for a load."""
    step: int
    skipped: int                # steps passed over by fallback=True
    reader: object              # tensors(), read_many(items), read_into(*item)
    boxes: bool                 # the reader serves a DTensor's box
    meta: dict                  # {"entries": ..., "rng": ...}, the Checkpointer's view
    rng_form: Optional[str]     # "tensors", "json", or None: this rank keeps its own
    rng_note: Optional[str] = None  # why this rank keeps its own RNG states


class _Boxes:
    """A GlobalReader as Load reads: tensors() by global shape, read_many of (index,
    address, size[, (offsets, shape)]): a whole global tensor, or this rank's box of
    it, all in one call of the library (every chunk of every overlapping shard in
    parallel, decoded straight into the live tensors)."""

    def __init__(self, reader):
        self.g = reader

    def _item(self, index, address, size, box=None):
        if box is None:
            shape = self.g.tensors()[index].shape
            box = ((0,) * len(shape), shape)
        return (index, box[0], box[1], address, size)

    def tensors(self):
        return self.g.tensors()

    def read_into(self, index, address, size, box=None):
        self._read([self._item(index, address, size, box)])

    def read_many(self, items):
        self._read([self._item(*it) for it in items])

    def _read(self, items):
        self.g.read_many(items)


class _WholeBoxes(_Boxes):
    """A store's Reader of one process as Load reads with boxes: each box is read out
    of its whole tensor by the library (only the chunks that hold part of it)."""

    def _read(self, items):
        self.g.read_boxes(items)


class StoreSource:
    """Loads from the store of one process at `path` (`store`: the sink's open Store,
    else one is opened read-only for each load)."""
    kind = "store"

    def __init__(self, path: str, store: Optional[Store] = None):
        self.path = path
        self.store = store

    def empty(self) -> bool:
        if self.store is not None:
            return self.store.latest() is None
        if _amber.is_url(self.path):  # an empty prefix is an empty store, not "no store"
            return latest_of(self.path) is None
        with Store(self.path, readonly=True, create=False) as st:
            return st.latest() is None

    @contextmanager
    def step(self, step: Optional[int] = None, fallback: bool = False):
        """The committed step `step` (None: the latest; fallback: the newest that
        verifies whole from there back) as a Step."""
        own = self.store is None
        st = Store(self.path, readonly=True, create=False) if own else self.store
        try:
            with st.reader(step, fallback=fallback) as r:
                yield Step(r, False, f"step {r.step} of {self.path}", r.skipped)
        finally:
            if own:
                st.close()

    @contextmanager
    def open(self, step, fallback, comm, state, rank):
        """The step to load (None: the latest; fallback: the newest that verifies
        whole); with many ranks each reads its boxes, and rank 0 gets the RNG states."""
        with self.step(step, fallback) as s:
            r = s.reader
            meta = _meta.checkpointer_meta(_meta.parse(s.meta(), s.where), state, s.step,
                                           s.where, dist=False)
            many = comm.size > 1
            note = None if rank == 0 else (
                f"amber: step {s.step} of {self.path} was written by one process: rank "
                f"{rank} keeps its own RNG states")
            yield Opened(s.step, s.skipped, _WholeBoxes(r) if many else r, many, meta,
                         "tensors" if rank == 0 else None, note)


class GlobalSource:
    """Loads global steps of the multi-rank store at `path`, at any world size."""
    kind = "global"

    def __init__(self, path: str):
        self.path = path

    def empty(self) -> bool:
        return not _amber.global_steps(self.path)

    @contextmanager
    def open(self, step, fallback, comm, state, rank):
        """The global step to load (None: the latest; fallback: the newest that
        verifies whole on every rank, agreed collectively)."""
        skipped = 0
        if fallback:
            step, skipped = self._agree_on_step(step, comm)
        with self.step(step) as s:
            done, where = s.step, s.where
            own = rank < s.world
            meta = _meta.parse(s.meta(rank if own else 0), where)
            ranks = None
            if isinstance(meta, dict) and meta.get("format") == _meta.DCP:
                ranks = [_meta.parse(s.meta(r), f"{where}, rank {r}") for r in range(s.world)]
            meta = _meta.checkpointer_meta(meta, state, done, where, dist=True, dcp_ranks=ranks)
            note = None if own else (f"amber: global step {done} was written by {s.world} "
                                     f"ranks: rank {rank} keeps its own RNG states")
            s.skipped = skipped
            yield Opened(done, skipped, _Boxes(s.reader), True, meta, "json" if own else None,
                         note)

    @contextmanager
    def step(self, step: Optional[int] = None, fallback: bool = False):
        """The committed global step `step` (None: the latest) as a Step. (A load's
        fallback is agreed across ranks: open() does it; here it is refused.)"""
        if fallback:
            raise ValueError("GlobalSource.step: fallback is agreed across ranks by open()")
        with GlobalReader(self.path, step) as g:
            yield Step(g, True, f"global step {g.step} of {self.path}")

    def _agree_on_step(self, step, comm):
        """load(fallback=True): the newest global step (from `step`, default the
        latest, back) that verifies whole on every rank, agreed collectively: each
        rank verifies each candidate (manifest and every rank's files it needs; the
        reads are repeated on each rank, which also covers ranks that see the store
        through different mounts), then all learn every rank's verdict. Returns
        (step, skipped); raises AmberError naming each rank's reason when none
        verifies."""
        cands = [s.step for s in _amber.global_steps(self.path)
                 if step is None or s.step <= step]
        if step is not None and step not in cands:
            return step, 0  # not a committed step: the load's GlobalReader says so
        why, skipped = [], 0
        for s in reversed(cands):
            try:
                with GlobalReader(self.path, s) as g:
                    g.verify()
                mine = None
            except AmberError as e:
                mine = str(e)
            votes = comm.gather_objects(mine)
            bad = [(r, v) for r, v in enumerate(votes) if v]
            if not bad:
                if skipped:
                    warnings.warn(f"amber: {self.path}: loading global step {s}, the newest "
                                  f"that verifies on every rank ({'; '.join(why)})",
                                  RuntimeWarning, stacklevel=5)
                return s, skipped
            skipped += 1
            r, v = bad[0]
            why.append(f"step {s}: rank {r}: {v}")
        raise AmberError(_amber.ECORRUPT, f"{self.path}: no global step verifies on every "
                         f"rank: {'; '.join(why) or 'no step committed'}", name="AMBER_ECORRUPT")
