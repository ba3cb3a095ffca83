"""Storage tiers: every save goes to a memory tier (a store in a directory on a memory
file system, /dev/shm/..., which outlives the training process), the library drains
each committed step to the durable tier (the run's path) on a thread of its own, and
a load restores from the fastest tier that holds an intact newest step.

  TierOptions  what Checkpointer(path, memory=DIR, replicas=N, memory_budget=...,
               max_lag=...) asks for, checked before anything is created.
  Tiers        the drain of one sink: kicked after each commit (back-pressure, the
               drain's sticky error), asked whether the next save must be full (the
               memory tier over its budget), flushed at close.
  pick_source  which tier a load of one process reads: the newest step of either,
               the memory tier on a tie, the durable tier when the memory tier's
               step cannot be opened.

The sinks and sources are _sink's and _source's: the memory tier is an ordinary store
at DIR, so every front end (the Checkpointer, amber.dcp's Writer and Reader) gets
the tiers through the same calls.

An object store ("s3://bucket/prefix") is always written through a memory tier: the
one given, drained in the background; or, without one, the library's staging
directory of the URL (amber.tier_staging), drained at each commit, so that a save's
wait() returns once the step is durable in the object store.
"""

import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Optional

import amber as _amber

from ._source import GlobalSource, StoreSource, is_url, latest_of, steps_of

log = logging.getLogger("amber.torch")

# The memory file systems a memory tier is meant for; another one works, at its speed.
_MEMORY_FS = ("tmpfs", "ramfs", "hugetlbfs")


@dataclass(frozen=True)
class TierOptions:
    """The tiers a front end was asked for. memory: the memory tier's directory;
    replicas: how many other ranks keep a copy of each rank's files; memory_budget:
    bytes the memory tier may hold (None: half of its file system's size);
    max_lag / max_lag_bytes: how far the durable tier may lag (steps, bytes; None: no
    bound but the budget)."""
    memory: str
    replicas: int = 0
    memory_budget: Optional[int] = None
    max_lag: Optional[int] = None
    max_lag_bytes: Optional[int] = None
    # the memory tier is the staging directory of an s3:// store that named none:
    # every commit is drained before the save's wait() returns
    staging: bool = False

    @staticmethod
    def make(path, memory, replicas=0, memory_budget=None, max_lag=None, max_lag_bytes=None):
        """The options, or None without a memory tier (a directory store written
        directly); ValueError or TypeError for arguments that cannot work (nothing is
        created)."""
        url = is_url(path)
        if memory is None:
            if replicas:
                raise ValueError("replicas= needs a memory tier (memory=DIR): replicas are "
                                 "kept in the peers' memory tiers")
            if memory_budget is not None or max_lag is not None or max_lag_bytes is not None:
                raise ValueError("memory_budget= and max_lag= need a memory tier (memory=DIR)")
            return TierOptions(_amber.tier_staging(path), staging=True) if url else None
        if not isinstance(memory, (str, os.PathLike)):
            raise TypeError(f"memory= is a directory path, not {type(memory).__name__}")
        for name, v in (("replicas", replicas), ("memory_budget", memory_budget),
                        ("max_lag", max_lag), ("max_lag_bytes", max_lag_bytes)):
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
                raise ValueError(f"{name}= must be an int >= 0, not {v!r}")
        mem = os.path.abspath(os.fspath(memory))
        dur = os.path.abspath(os.fspath(path)) if not url else None
        if dur is not None and (mem == dur or mem.startswith(dur + os.sep) or
                                dur.startswith(mem + os.sep)):
            raise ValueError(f"the memory tier {mem} and the durable tier {dur} must be "
                             "separate directories, neither inside the other")
        return TierOptions(mem, int(replicas or 0), memory_budget, max_lag, max_lag_bytes)


def fs_type(path: str) -> Optional[str]:
    """The type of the file system that holds `path` (its nearest existing parent),
    from /proc/self/mounts; None where that cannot be read."""
    p = os.path.realpath(path)
    while not os.path.exists(p):
        p = os.path.dirname(p)
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 3:
                    continue
                mnt = parts[1].replace("\\040", " ")
                if (p == mnt or p.startswith(mnt.rstrip("/") + "/")) and len(mnt) > len(best):
                    best, kind = mnt, parts[2]
    except OSError:
        return None
    return kind


def default_budget(memory: str) -> int:
    """Half of the size of the file system that holds `memory` (tmpfs at /dev/shm is
    half the machine's memory by default, so a quarter of it)."""
    p = memory
    while not os.path.exists(p):
        p = os.path.dirname(p)
    st = os.statvfs(p)
    return st.f_blocks * st.f_frsize // 2


class Tiers:
    """The drain of one sink's memory tier to its durable tier. `rank`: the rank
    store this process drains in a multi-rank memory tier (rank 0 also drains the
    manifests and GLOBAL), -1 for a store of one process.

    A drain's failure is sticky: raised by every later call, what is not durable
    staying in the memory tier. For an s3:// store's staging directory, whose commits
    are each drained before wait() returns, the failed drain is dropped instead, so
    that the next save (or close) starts a new one, which resumes where it stopped:
    a fault that outlasts the client's retries fails that save, not the run."""

    def __init__(self, opts: TierOptions, durable: str, rank: int = -1):
        self.opts = opts
        self.memory = opts.memory
        self.rank = rank
        url = is_url(durable)
        self.durable = os.fspath(durable) if url else os.path.abspath(os.fspath(durable))
        self._durable_latest = False  # not read yet
        self._closed = False
        kind = fs_type(self.memory)
        if kind is not None and kind not in _MEMORY_FS and not opts.staging:
            log.warning("the memory tier %s is on a %s file system, not in memory (tmpfs, "
                        "such as /dev/shm): saves and restores go at its pace", self.memory,
                        kind)
        self.budget = default_budget(self.memory) if opts.memory_budget is None \
            else opts.memory_budget
        if not url:
            os.makedirs(os.path.dirname(self.durable), exist_ok=True)
        os.makedirs(os.path.dirname(self.memory), exist_ok=True)
        self.drain = self._start()

    def _start(self):
        o = self.opts
        return _amber.Drain(self.memory, self.durable, max_lag_steps=o.max_lag or 0,
                            max_lag_bytes=o.max_lag_bytes or 0, memory_budget=self.budget,
                            rank=self.rank, image=not o.staging)

    def _drop(self):
        drain, self.drain = self.drain, None
        try:
            drain.close()
        except _amber.AmberError:
            pass  # its failure, raised already

    def committed(self, step: Optional[int] = None) -> None:
        """After a commit to the memory tier: wakes the drain; waits while the durable
        tier lags beyond its bound or the memory tier is over its budget (and, for an
        s3:// store's staging directory, until the step is durable there); raises the
        drain's failure (AmberError, naming the file and the tier)."""
        if self.drain is None:  # the staging directory's last drain failed
            self.drain = self._start()
        try:
            self.drain.kick()
            if self.opts.staging:
                self.drain.flush()
        except _amber.AmberError:
            if self.opts.staging:
                self._drop()
            raise

    def durable_latest(self) -> Optional[int]:
        """The durable tier's latest step when first asked (read once): a memory tier
        that lost its steps (wiped, or a new host's staging directory) must not commit
        steps at or below it, which the drain would never make durable."""
        if self._durable_latest is False:
            self._durable_latest = latest_of(self.durable, self.rank >= 0)
        return self._durable_latest

    def check_step(self, step: int) -> None:
        """Raises AmberError (AMBER_EEXIST) for a step that is not after the durable
        tier's latest."""
        d = self.durable_latest()
        if d is not None and step <= d:
            raise _amber.AmberError(_amber.EEXIST, f"step {step} is not after the latest "
                                    f"step {d} of {self.durable}", name="AMBER_EEXIST")

    def wants_full(self) -> bool:
        """Whether the next save must be full: the memory tier is over its budget and
        only a full checkpoint lets it drop the chain that fills it."""
        return self.drain is not None and self.drain.wants_full()

    def status(self):
        if self.drain is None:
            self.drain = self._start()
        return self.drain.status()

    def durable_steps(self) -> list:
        return steps_of(self.durable)

    def flush(self, timeout: Optional[float] = None) -> None:
        if self.drain is None:
            self.drain = self._start()
        self.drain.flush(timeout)

    def close(self, flush: bool = True) -> None:
        """Waits for the durable tier to hold every committed step (unless `flush` is
        False), then stops the drain; raises its failure. Once only."""
        if self._closed:
            return
        self._closed = True
        if self.drain is None:
            if not flush:
                return
            self.drain = self._start()  # a last try at what the failed one left
        try:
            if flush:
                self.drain.flush()
        except BaseException:
            self._drop()
            raise
        self.drain.close()


def pick(memory: str, durable: str, memory_latest: Optional[int], step: Optional[int]):
    """The tiers a load of one process tries, fastest first: [(tier name, path)].
    `step` None: the newest step of either (the memory tier on a tie); a given step:
    the memory tier when it holds that step, then the durable tier."""
    d = latest_of(durable)
    m = memory_latest
    if step is None:
        if m is None:
            return [("durable", durable)] if d is not None else []
        if d is None or m >= d:
            return [("memory", memory)] + ([("durable", durable)] if d is not None else [])
        return [("durable", durable), ("memory", memory)]
    return [("memory", memory), ("durable", durable)]


class RankTiers(Tiers):
    """The tiers of one rank of many: this rank's drain (rank 0's also moves the
    durable tier's manifests and GLOBAL), and with `replicas` its replicator, which
    sends each committed step's new files to its peers on other hosts from a thread of
    its own, in commit order, over `comm` (a communicator of amber's own: a gloo group
    that no other thread uses, which also serves the restore). Collective to make."""

    def __init__(self, opts: TierOptions, durable: str, comm):
        super().__init__(opts, durable, rank=comm.rank)
        self.comm = comm
        self.replicas = None
        self._queue = None
        self._error = None
        if opts.replicas:
            try:
                self.replicas = _amber.Replicas(self.memory, comm, comm, replicas=opts.replicas)
            except BaseException:
                self.drain.close()
                raise
            self._queue = queue.Queue()
            self._thread = threading.Thread(target=self._replicate, name="amber-replicas",
                                            daemon=True)
            self._thread.start()

    def _replicate(self):
        while True:
            step = self._queue.get()
            try:
                if step is None:
                    return
                if self._error is None:
                    self.replicas.step(step)  # collective: every rank's thread, in order
            except BaseException as e:  # sticky: raised by the next save, wait or close
                self._error = e
            finally:
                self._queue.task_done()

    def _raise(self):
        if self._error is not None:
            raise self._error

    def committed(self, step: Optional[int] = None) -> None:
        super().committed(step)
        if self._queue is not None:
            self._raise()
            self._queue.put(step)

    def settle(self) -> None:
        """Waits until every committed step was replicated; raises the replicator's
        failure."""
        if self._queue is not None:
            self._queue.join()
            self._raise()

    def restore(self):
        """Which tier serves a load (amber.tiers_restore, collective): the newest step
        every rank can restore from some tier, files fetched from peers where a
        rank's memory lacks them. A TiersRestore."""
        self.settle()
        return _amber.tiers_restore(self.memory, self.durable, self.comm, self.comm)

    def stats(self):
        return None if self.replicas is None else self.replicas.stats()

    def close(self, flush: bool = True) -> None:
        try:
            if self._queue is not None:
                if flush:
                    self.settle()
                self._queue.put(None)
                self._thread.join()
                self._queue = None
        finally:
            if self.replicas is not None:
                self.replicas.close()
                self.replicas = None
            super().close(flush=flush)


def both_steps(durable: str, memory: str) -> list:
    """The committed checkpoints of both stores of one process (CheckpointInfo), the
    memory tier's where both hold a step."""
    got = {}
    for path in (durable, memory):
        got.update((i.step, i) for i in steps_of(path))
    return [got[k] for k in sorted(got)]


def sources(memory: str, durable: str, store, step):
    """[(tier, StoreSource)] that a load of one process tries in turn (pick), the
    memory tier through `store` when that is the sink's open store."""
    mine = store is not None and store.path == memory
    latest = store.latest() if mine else latest_of(memory)
    out = [(tier, StoreSource(path, store if mine and path == memory else None))
           for tier, path in pick(memory, durable, latest, step)]
    return out or [("durable", StoreSource(durable))]


class Pinned:
    """A source whose latest step is the one the ranks agreed on (a load of step None
    reads `step`)."""

    def __init__(self, source, step):
        self.source, self.step, self.path = source, step, source.path

    def empty(self):
        return self.step is None

    def open(self, step, *args):
        return self.source.open(self.step if step is None else step, *args)


def rank_sources(tiers: Optional[RankTiers], memory: str, durable: str, step):
    """([(tier, source)], TiersRestore or None) of a load at many ranks with a memory
    tier: for the latest step, what every rank agrees on (RankTiers.restore: its own
    memory, a peer's replica fetched into it, or the durable tier); a given step from
    the durable tier when it holds it, else from the memory tier. One source: every
    rank reads the same step."""
    if step is not None or tiers is None:
        held = step is not None and _amber.is_global_store(durable) and \
            any(s.step == step for s in _amber.global_steps(durable))
        if step is None or held or not _amber.is_global_store(memory):
            return [("durable", GlobalSource(durable))], None
        return [("memory", GlobalSource(memory))], None
    got = tiers.restore()
    if got.step is None:
        return [("durable", Pinned(GlobalSource(durable), None))], got
    return [(got.tier, Pinned(GlobalSource(got.path), got.step))], got
