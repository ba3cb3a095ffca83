"""The seed of the writer's reference after a load: the live tensors hold exactly
the restore of the latest step, so the writer copies them as its reference (on a
thread, while training goes on) and the first save after a resume is a delta that
reads nothing back. One process: the store's writer. Many ranks: every rank writer,
decided by one vote (the global writer's open is collective), and the device
references of the device path. The fence before the next optimizer step settles the
seed: kept when nothing it read changed in place meanwhile (version counters)."""

import os
import threading
from typing import Callable

from amber import AmberError
from amber import device as _device

from . import _comm, _dtypes
from ._capture import Versions
from ._encode import flatten
from ._naming import box, is_dtensor
from ._sink import device_wanted, new_device_path
from ._source import GlobalSource, is_url


def same_store(a, b) -> bool:
    """Whether store paths `a` and `b` name the same store (URLs as written)."""
    if a is None or b is None:
        return False
    if is_url(a) or is_url(b):
        return os.fspath(a) == os.fspath(b)
    return os.path.abspath(a) == os.path.abspath(b)


class Seeder:
    """The seed after a load, for a Checkpointer's `saver` (its sink's writer),
    `comm`, RNG choice `rng` and `options`; `step_rules(state)` gives the rules a
    reopened writer takes. `seeded`: whether the last load's seed holds."""

    def __init__(self, saver, comm, rng: bool, options, step_rules: Callable):
        self.saver, self.comm, self.rng, self.options = saver, comm, rng, options
        self.step_rules = step_rules
        self.job = None       # (thread, Versions, outcome) of the seed in progress
        self.seeded = False

    def one_process(self, state, step, source):
        """After a load of the latest step: the live tensors hold exactly its restore,
        so the writer's reference is seeded from them and the first save after a
        resume is a delta that reads nothing back. In a store of one process the
        tensors are declared and the library copies them into its reference on a
        thread while training goes on; the fence before the next optimizer step waits
        for it, and if a tensor it read changed meanwhile (its version counter moved)
        the seed is dropped and the next save reads its reference from the store."""
        if isinstance(source, GlobalSource):  # a multi-rank store loaded by one process
            self._devices(state)
            return
        sv = self.saver
        opening = None
        try:
            flat, _ = flatten(state, self.rng)
            items = [it for it in sv.items(flat.tensors, state) if it is not None]
            if sv.changed(items):
                rules = self.step_rules(state)
                if any(it.decl.on_device for it in items):
                    sv.reopen(items, rules)
                else:  # the writer's open reads only the declarations: on the seed's thread
                    def opening():
                        sv.reopen(items, rules)
            else:
                sv.point((i, it.address) for i, it in enumerate(items))
            if sv.dev is not None and opening is None:
                sv.dev.seed({it.decl.name: it.local for it in items if it.decl.on_device})
        except (AmberError, TypeError, ValueError):
            # the state is not what the step holds (strict=False skips, values that are
            # not state_dict holders...): the writer reads its reference instead
            self.saver.sink.close_writer()
            return
        self._start(items, step, opening)

    def many_ranks(self, state, step, source, own):
        """The seed of a multi-rank sink after a load of the latest global step, on
        every rank: the device references where this rank's tier is its own (taken by
        the next save's declarations), then the host references of every rank writer:
        every rank declares what its next save would, one vote decides (a rank that
        cannot, or whose step is not its own store's, makes every rank skip, since the
        writer's open is collective: it is opened now, as the first save would), then
        each rank seeds its own from its tensors on a thread. The library refuses a
        step written at another world size or with other boxes; that rank's next save
        then reads its files."""
        if own:
            self._devices(state)
        sv, sink = self.saver, self.saver.sink
        err = items = None
        try:
            if not own or not same_store(getattr(source, "path", None), sink.path):
                raise ValueError("the step was not read from this rank's own store")
            flat, _ = flatten(state, self.rng and sink.rng_tensors, dist=True)
            items = [it for it in sv.items(flat.tensors, state) if it is not None]
            if any(it.decl.on_device for it in items):
                raise ValueError("device tensors: their references are seeded on the device")
        except (AmberError, TypeError, ValueError) as e:
            err = e
        changed = items is not None and sv.changed(items)
        got, failure = _comm.vote(self.comm, None if err is None else str(err),
                                  1 if changed else 0)
        if failure is not None:
            return  # some rank cannot declare: the first save reads the references
        try:
            if any(got):
                sv.reopen(items, self.step_rules(state))  # collective, as in a save
            else:
                sv.point((i, it.address) for i, it in enumerate(items))
        except AmberError:
            self.saver.sink.close_writer()  # the next save's vote makes every rank reopen
            return
        self._start(items, step)

    def _start(self, items, step, opening=None):
        """The seed of the writer's reference from `items`' tensors, on a thread, after
        `opening()` (the writer's open, where it is done there). The staging copies
        and the version counters are taken before: what the load restored. Until
        settle() joins the thread, nothing else touches the saver: every call of the
        Checkpointer that does settles first (fence, wait, load, close)."""
        sink = self.saver.sink
        scanned = [it for it in items if it.in_place]
        versions = Versions([it.decl.name for it in scanned], [it.local for it in scanned])
        out = [None]

        def run():
            try:
                if opening is not None:
                    opening()
                sink.writer.seed_reference(step)
            except BaseException as e:  # raised nowhere: the writer then reads the store
                out[0] = e
        thread = threading.Thread(target=run, name="amber-seed", daemon=True)
        thread.start()
        self.job = (thread, versions, out)
        self.seeded = True

    def _devices(self, state):
        """The device references of this rank's boxes, seeded from the live tensors
        after a load of the latest global step (see one_process)."""
        try:
            flat, _ = flatten(state, False, dist=True)
            live = {}
            for name, t in flat.tensors:  # the tensors a save sends to the device path
                loc, _, _, _, writes, repl = box(t) if is_dtensor(t) else \
                    (t, None, None, None, True, True)
                if writes and (self.comm.rank == 0 or not repl) and loc.dtype in _dtypes.DTYPES \
                        and device_wanted(loc, self.options.device_path):
                    live[name] = loc
        except (TypeError, ValueError):
            return
        sv = self.saver
        if sv.dev is not None and sv.dev.tensors:
            sv.seeds = None
            if all(n in live and tuple(live[n].shape) == dt.shape and live[n].dtype == dt.dtype
                   for n, dt in sv.dev.tensors.items()):
                sv.dev.seed({n: live[n] for n in sv.dev.tensors})
            return
        sv.seeds = new_device_path(self.options.device_host_ref)
        for name, loc in live.items():
            dt = _device._Tensor(name, None, loc, _dtypes.DTYPES[loc.dtype], sv.seeds.host_ref)
            dt.seed(loc)
            sv.seeds.tensors[name] = dt

    def settle(self) -> bool:
        """Waits for the seed that a load started (if any); keeps it only when it
        succeeded and none of the tensors it read changed meanwhile. True when it was
        dropped with the writer (the save plan then goes too)."""
        job, self.job = self.job, None
        if job is None:
            return False
        thread, versions, out = job
        thread.join()
        if out[0] is not None:  # the library's seed failed: its next save reads the store
            self.seeded = False
            return False
        elif versions.changed() is not None:
            # a tensor changed while it was copied: the reference may not be the
            # loaded state; a new writer reads its reference from the store
            self.seeded = False
            self.saver.sink.close_writer()
            return True
        return False
