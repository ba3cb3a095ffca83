"""The save pipeline that every front end runs (amber.torch's Checkpointer, amber.dcp's
Writer), for one process and for many ranks alike:

  items()   each tensor as this rank saves it: its declaration (the box of its global
            tensor that this rank holds) and what the library reads, under the capture
            rule (_capture: read in place until the fence and version-checked, or
            copied into a staging buffer reused from save to save);
  begin()   every rank votes (it could prepare its part; its declarations changed; it
            selects on a device), the sink's writer is reopened everywhere when any
            rank's declarations changed, or else pointed at the tensors' memory; the
            metadata and units are set, the device selection made, and the save begun;
  fence()   the scan no longer reads the tensors; a tensor read in place whose version
            counter moved makes the save torn: its verdict is "not committed";
  verdict() the verdict handed to the writer (at the fence for the Checkpointer; at
            DCP's commit point for the Writer);
  wait()    the save committed and durable (with many ranks: the global commit), or
            its failure raised.

A job of one process runs the same steps: its communicator votes with itself.
"""

from typing import Callable, Optional

import torch

import amber as _amber
from amber import AmberError
from amber import device as _device

from . import _comm, _dtypes
from ._capture import Staging, Versions, buffer_storages, in_place, owned_storages, \
    storage_key, torn_message
from ._naming import box, is_dtensor
from ._options import Options
from ._sink import Decl, Item, device_wanted, new_device_path

_FLAG_REOPEN, _FLAG_DEVICE, _FLAG_FULL = 1, 2, 4


class Saver:
    """One front end's saves into `sink` over `comm` (see the module's text).
    `confirm_at_fence`: the verdict goes to the writer at the fence (the
    Checkpointer); else the front end hands it over with verdict() (DCP's finish)."""

    def __init__(self, sink, comm, options: Options, confirm_at_fence: bool = True):
        self.sink, self.comm, self.options = sink, comm, options
        self.rank = comm.rank
        self.confirm_at_fence = confirm_at_fence
        self.dev = None        # amber.device.DevicePath: the writer's tensors on a device
        self.dev_job = None    # amber.device.Background: the device selection on a thread
        self.dev_error = None  # its failure, or the selection's, in the save in progress
        self.seeds = None      # device references seeded by a load before the writer opened
        self._zeros = None     # what _stand_in hands over for a full step
        self.sig = None        # the open writer's declarations
        self.ptrs = []         # and the addresses it reads
        self.stage = Staging()
        self.pinned = None     # what the scan in progress reads; dropped at the fence
        self.versions = None   # Versions checked at the fence
        self.reads = False     # the save in progress reads CPU memory (its fence waits)
        self.gated = False     # the save in progress waits for a verdict
        self.busy = False      # a save begun and not yet waited for
        self.torn = None       # why the save in progress must not commit (set at the fence)
        self.units = None      # the units the writer has
        self.voted = False     # the last vote decided full or delta (see vote)
        self.vote_full = False
        self._any_dev = False
        self._dev_names = set()  # names declared on the device path (see item)

    # -- declarations --
    def item(self, name: str, t: torch.Tensor, owned, buffers, at=None) -> Optional[Item]:
        """Tensor `t` as this rank saves it (None: another rank writes it), read in
        place or copied into its staging buffer (the capture rule). Its box: a
        DTensor's shard, a plain tensor whole (replicated with many ranks: rank 0
        writes it); or `at` = (local tensor, global shape, offsets, local shape,
        writes, replicated), a box that the caller's plan gives (DCP's write items)."""
        if at is not None:
            loc, gshape, off, lshape, writes, repl = at
        elif is_dtensor(t):
            loc, gshape, off, lshape, writes, repl = box(t)
        else:
            loc, gshape = t, tuple(t.shape)
            off, lshape, writes, repl = (0,) * t.dim(), gshape, True, self.sink.dist
        code = _dtypes.code(loc, name)
        if repl and self.rank != 0:  # declared on every rank, written by rank 0
            return Item(Decl(name, code, gshape, off, lshape, True, False), t, loc, writes=False)
        if not writes:
            return None  # a replica of a shard that another rank writes
        # The device path keeps one reference per name: a rank's later boxes of one
        # tensor (DCP's write items) take the host path.
        dev = device_wanted(loc, self.options.device_path) and name not in self._dev_names
        if dev:
            self._dev_names.add(name)
        it = Item(Decl(name, code, gshape, off, lshape, repl, dev), t, loc)
        if not dev:
            nbytes = loc.numel() * loc.element_size()
            it.in_place = in_place(loc, nbytes, owned, buffers, self.options.capture_bytes)
            it.source = loc if it.in_place else self.stage.copy((name, tuple(off)), loc)
        return it

    def items(self, tensors: list, state: Optional[dict] = None) -> list:
        """Every (name, tensor[, box]) of `tensors` as an Item (None where this rank
        declares none; box: see item()). `state`: the state dict whose optimizers'
        tensors are read in place at any size and whose module buffers are copied."""
        owned = owned_storages(state) if state else set()
        buffers = buffer_storages(state) if state else set()
        self._dev_names = set()
        with torch.no_grad():
            out = [self.item(n, t, owned, buffers, *at) for n, t, *at in tensors]
        self.stage.keep_only([(it.decl.name, tuple(it.decl.offsets))
                              for it in out if it is not None])
        return out

    def changed(self, items: list) -> bool:
        """Whether `items`' declarations differ from the open writer's."""
        return self.sink.writer is None or [it.decl for it in items] != self.sig

    # -- a save --
    def vote(self, step: int, err: Optional[BaseException], changed: bool, dev: bool,
             full: bool = False):
        """Every rank's readiness before any begins (one small all_gather; nothing with
        one process): a rank that could not prepare its part fails the step on every
        rank, naming it (with one process its own error is raised as it is). It also
        carries whether the rank wants the step full (its global writer's answer),
        so that the writer's begin need not vote again. Returns (reopen: some rank's
        declarations changed, device: some rank selects on its device); sets `voted`
        (begin may take the vote's full) and `vote_full`."""
        if err is not None and self.comm.size == 1:
            raise err
        wants = False
        if err is None and not changed and self.sink.dist and self.sink.writer is not None:
            wants = self.sink.writer.wants_full(step, full)
        got, failure = _comm.vote(self.comm, None if err is None else
                                  f"{type(err).__name__}: {err}",
                                  (_FLAG_REOPEN if changed else 0) | (_FLAG_DEVICE if dev else 0)
                                  | (_FLAG_FULL if wants else 0))
        if failure is not None:
            e = AmberError(_amber.ECANCELED, f"step {step} not committed: rank {failure[0]} "
                           f"failed: {failure[1]}", name="AMBER_ECANCELED")
            e.rank = failure[0]
            raise e from err
        reopen, any_dev = any(f & _FLAG_REOPEN for f in got), any(f & _FLAG_DEVICE for f in got)
        # every rank kept its writer and votes no device plan: every rank's full is known
        self.voted = self.sink.dist and not reopen and not any_dev
        self.vote_full = any(f & _FLAG_FULL for f in got)
        return reopen, any_dev

    def reopen(self, items: list, extra_rules=()) -> None:
        """A new writer for a new set of tensors (collective with many ranks: every rank
        reopens when any rank's declarations changed); its first save is a full one."""
        self.sink.close_writer()
        self.dev = new_device_path(self.options.device_host_ref)
        self.sink.open(items, self.dev, extra_rules)
        for name, dt in self.dev.tensors.items():  # seeded by a load before the writer opened
            seeded = (self.seeds.tensors if self.seeds else {}).get(name)
            if seeded is not None and seeded.shape == dt.shape and seeded.dtype == dt.dtype \
                    and seeded.device == dt.device:
                dt.ref, dt.valid = seeded.ref, True
        self.seeds = None
        self.sig = [it.decl for it in items]
        self.ptrs = [it.address for it in items]
        self.units = None  # the new writer has none yet

    def point(self, points) -> None:
        """Points the writer at new addresses: (declaration index, address) pairs."""
        for i, addr in points:
            if addr is not None and addr != self.ptrs[i]:
                self.sink.point(i, addr)
                self.ptrs[i] = addr

    def declare(self, step: int, items: Optional[list], err, extra_rules=(),
                items_fn: Optional[Callable[[], list]] = None, points=None,
                full: bool = False) -> None:
        """Votes, then reopens the writer or points it. `items`: this save's
        declarations; a save that knows its declarations are unchanged passes
        `points` (the addresses that may have moved) and `items_fn` (its items, should
        another rank's change make every rank reopen)."""
        changed = items is not None and self.changed(items)
        dev = bool(items) and any(it.decl.on_device for it in items)
        reopen, self._any_dev = self.vote(step, err, changed, dev, full)
        if reopen:
            self.reopen(items if items is not None else items_fn(), extra_rules)
        else:
            self.point(points if points is not None else
                       ((i, it.address) for i, it in enumerate(items)))

    def set_units(self, units: list) -> None:
        if units != self.units:
            self.sink.set_units(units)
            self.units = units

    def begin(self, step: int, full: bool, versions: Versions, pinned: list, reads: bool,
              devs: dict, state: Optional[dict] = None, gate: bool = False) -> None:
        """Begins the save declared by declare(): the versions armed, the device
        selection (when some rank has device tensors: planned collectively with many
        ranks), then the writer's begin. `gate`: the save waits for a verdict even
        when nothing is read in place."""
        sink = self.sink
        self.reads, self.pinned, self.versions, self.torn = reads, pinned, versions, None
        live = dict(devs)
        background = bool(devs) and self.options.device_async and sink.background_ok
        if background:
            # Read by the thread until the fence: what training may change before the
            # next optimizer step is captured on its device now, as the capture rule
            # copies CPU tensors; the rest is read in place and checked.
            owned = owned_storages(state) if state else set()
            names, tensors = list(versions.names), list(versions.tensors)
            with torch.no_grad():
                for n, t in devs.items():
                    small = t.numel() * t.element_size() <= self.options.capture_bytes
                    if small or storage_key(t) not in owned:
                        live[n] = t.clone()
                    else:
                        self.pinned.append(t)
                        names.append(n)
                        tensors.append(t)
            self.versions = Versions(names, tensors)
        self.gated = gate or bool(self.versions) or sink.dist
        self.busy = True
        flags = (_amber.SAVE_FULL if full else 0) | (_amber.SAVE_CONFIRM if self.gated else 0)
        try:
            kind = None
            if self._any_dev:  # the kind of save, and its errors, now (amber.device)
                flags, kind = sink.plan_device(self.dev, step, flags)

            voted = self.voted and not self._any_dev

            def start():
                if devs:
                    self.dev.select(sink.writer, kind, live)
                if voted:  # the vote decided full or delta on every rank alike
                    sink.begin(step, self.vote_full, self.gated, voted=True)
                else:
                    sink.begin(step, bool(flags & _amber.SAVE_FULL), self.gated)
            if background:
                self.dev_job = _device.Background(start, [t.device for t in devs.values()])
            elif devs and sink.dist:
                try:
                    self.dev.select(sink.writer, kind, live)
                except Exception as e:  # begun all the same (begin is collective): the
                    self.dev_error = e  # fence refuses this rank's part, wait raises
                    self._stand_in(kind)
                sink.begin(step, bool(flags & _amber.SAVE_FULL), self.gated)
            else:
                start()
        except BaseException:
            self.pinned = self.versions = self.dev_error = None
            self.gated = self.busy = False
            if self.dev is not None:
                self.dev.rollback()
            raise

    def _stand_in(self, kind):
        """After a failed selection: selections that store nothing true (unchanged
        chunks, or zeros for a full step), so that this rank's part begins as every
        rank's must, and the fence refuses it with the selection's error. If even
        these cannot be handed over, the part fails at begin (no selection)."""
        try:
            for dt in self.dev.tensors.values():
                chunk, n, _ = _device.chunking(self.sink.writer, dt.index)
                sels = (_device._ChunkSel * max(1, n))()
                if kind == _device.KIND_FULL:
                    size = chunk * torch.empty(0, dtype=dt.dtype).element_size()
                    if self._zeros is None or self._zeros.numel() < size:
                        self._zeros = torch.zeros(max(size, 1), dtype=torch.uint8)
                    for j in range(n):  # every chunk reads the same zeros
                        sels[j] = _device._ChunkSel(_device.SELECT_WHOLE, None,
                                                    self._zeros.data_ptr())
                _device.set_selection(self.sink.writer, dt.index, sels, n)
        except Exception:
            pass

    def fence(self, what: str = "save()", advice: str = "") -> None:
        """Blocks until the save in progress no longer reads the tensors (not
        collective). A tensor read in place whose version counter moved since the
        save began makes its verdict "not committed" (why names the tensor)."""
        if self.pinned is None or self.sink.writer is None:
            return
        try:
            job, self.dev_job = self.dev_job, None
            if job is not None:  # the device selection on its thread
                try:
                    job.join()
                except BaseException as e:  # nothing began: wait() raises it
                    self.dev_error = e
            if self.dev is not None:
                self.dev.fence()  # the device-side selection (an event on CUDA)
            if self.sink.dist or self.reads:  # else it reads only its own buffers
                self.sink.fence()
        finally:
            changed = self.versions.changed() if self.versions else None
            self.pinned = self.versions = None
            if changed is not None:
                self.torn = torn_message(changed, what) + advice
            if self.confirm_at_fence:
                self.verdict()

    def verdict(self) -> None:
        """Hands the save's verdict to the writer: committed unless the fence found it
        torn or this rank's device selection failed."""
        if not self.gated:
            return
        self.gated = False
        err = self.dev_error if self.sink.dist else None
        why = self.torn or ""
        if err is not None:
            why = f"its device selection failed: {type(err).__name__}: {err}"
        try:
            self.sink.confirm(self.torn is None and err is None, why)
        except AmberError:
            pass  # the save failed already; wait() reports it

    def wait(self, prune_what: str = "") -> None:
        """Blocks until the save in progress is committed and durable (with many ranks:
        the global commit, collective); raises its failure."""
        self.fence()
        if not self.busy or self.sink.writer is None:
            return
        self.busy = False
        self.verdict()
        err, self.dev_error = self.dev_error, None
        if err is not None and not self.sink.dist:  # nothing began
            if self.dev is not None:
                self.dev.rollback()
            raise err
        if self.dev is not None:  # the device references move with the outcome
            self.dev.settle(self.sink.wait, err)
        else:
            self.sink.wait()
        self.sink.committed()  # then the durable tier's part (its failure is raised)
        if prune_what:
            self.sink.warn_prune(prune_what)

    def abort(self, why: str) -> None:
        """Drops the save in progress uncommitted (with many ranks: the global commit,
        failing, is collective)."""
        if not self.busy:
            return
        self.fence()
        self.torn = self.torn or why
        try:
            self.verdict()
            self.wait()
        except (AmberError, RuntimeError):
            pass
        self.busy = False
        self.pinned = self.versions = self.torn = None

    def close(self) -> None:
        self.sink.close()
        self.pinned = self.versions = None
        self.stage = Staging()


def in_place_names(items: list):
    """(names, tensors) of the version counters that guard `items` read in place: a
    DTensor's ops move its own counter, to_local()'s its local's, so both."""
    names, tensors = [], []
    for it in items:
        if it.writes and it.in_place:
            for x in (it.local,) if it.local is it.tensor else (it.local, it.tensor):
                names.append(it.decl.name)
                tensors.append(x)
    return names, tensors
