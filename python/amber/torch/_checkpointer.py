"""The Checkpointer: one save pipeline and one load pipeline, for one process and for
many ranks, over three parts: a sink (_sink: one store, or this rank's global writer),
a source (_source: whole tensors or boxes of global tensors, at any world size) and a
communicator (_comm: torch.distributed, or the stand-in of one process). Nothing
below asks which world size it runs at: a job of one process votes with itself.

A save: the state is encoded (_encode) into tensors and metadata, each tensor
becomes an Item under the capture rule (_capture: read in place and version-checked,
or copied), every rank votes (it could prepare its part, its declarations changed,
it selects on a device), the sink's writer is reopened (everywhere, when any rank's
declarations changed) or pointed at the tensors' memory, and the save begins. A save
of a state whose structure did not change goes through the plan of the previous one
(_plan) and touches only what changes from save to save.
"""

import logging
import os
import time
import warnings
from typing import Optional

import torch

import amber as _amber
from amber import AmberError

from . import _comm, _meta, _presets, _rng
from ._capture import FenceHooks, Versions
from ._encode import Flat, UnitMap, check_key, entry, flatten
from ._load import Load
from ._options import Options
from ._plan import INPLACE, plain_equal, plan_of
from ._save import Saver, in_place_names
from ._seed import Seeder
from ._sink import GlobalSink, Item, StoreSink
from ._source import GlobalSource, StoreSource, is_url, single_store
from ._tiers import RankTiers, TierOptions, Tiers, both_steps, rank_sources, sources

log = logging.getLogger("amber.torch")

# A load that fails with these before it changed anything tries the next tier.
_TIER_FALLBACK = (_amber.ECORRUPT, _amber.ENOENT, _amber.EIO, _amber.EFORMAT, _amber.EPARENT)


class Checkpointer:
    """Saves and restores training state in the amber store at `path`.

    Checkpointer(path, policy=None, full_every=None, full_share=None, rng=True,
                 readonly=False, threads=0, chunk_elems=0, keep_last=None,
                 process_group=None, memory=None, replicas=0, memory_budget=None,
                 max_lag=None, max_lag_bytes=None)

    Args:
      path: the store's directory (made, with its parents, if missing), or an object
          store, "s3://bucket/prefix" (endpoint, region and credentials from the AWS
          environment variables and files, as the AWS CLI reads them). An s3:// store
          is written through a memory tier: `memory` when given, else the library's
          staging directory of the URL (amber.tier_staging: /dev/shm/amber-UID-HASH),
          drained at each commit, so that wait() returns once the step is durable in
          the object store; loads read its objects by ranges, straight into the
          tensors.
      policy: "exact" (default, also for None), "lossy", "lossy-frequent",
          "lossy-compact", "lossy-capped", a rule, a list of rules or a dict
          {pattern: spec} (see amber.torch's documentation).
      full_every: a full checkpoint after this many deltas (None: the library's
          default, 50). full_share: also once the deltas since the last full add up
          to this share of it (None: 0.5; negative: never).
      rng: save and restore the RNG states (torch, random, numpy).
      readonly: open the store without its lock, for load() only.
      threads, chunk_elems: passed to the library (0: its defaults).
      keep_last: retention; after each committed save, remove every checkpoint but
          the newest keep_last and those their restores need. None: keep all. A
          failure to remove a file does not fail the save: it is reported as an
          amber.PruneWarning and tried again after the next save.
      process_group: with torch.distributed initialized, the group whose ranks save
          and load together (default: the world). Every rank constructs the
          Checkpointer on the same path and calls save()/load() collectively with its
          local state; DTensors are saved as shards of their global tensors and load
          at another world size. It is distributed whenever torch.distributed is
          initialized with more than one rank. One process on a store that many
          ranks wrote loads any global step of it and saves global steps of world
          size 1.
      memory: the memory tier, a directory on a memory file system (such as
          /dev/shm/run1), which outlives the training process: every save goes there
          and the library drains each committed step to `path` (the durable tier) on a
          thread of its own, in commit order, a step visible there once its whole
          chain is durable; load() restores from the fastest tier that holds the
          newest intact step; close() waits until the durable tier holds everything.
          memory_budget: bytes the memory tier may hold (None: half of its file
          system); it keeps the chain its newest step needs and what is not durable
          yet, and makes a save full when only that lets it shrink. max_lag,
          max_lag_bytes: how far the durable tier may lag (steps, bytes; None: as far
          as the budget allows); beyond, save() waits for the drain. A failed drain
          (a full disk) is raised by the next save(), wait() or close(), naming the
          file; nothing committed is lost, and `amber drain MEMORY` finishes it.
      replicas: with many ranks, how many other ranks keep a copy of each rank's
          committed files in their memory tiers.

    The store is locked while the Checkpointer is open (AMBER_ELOCKED for a second
    writer). `timings` holds the last save's seconds: "save" (the save() call),
    "fence" (the wait for the scan), "wait" (the last wait for durability).

    A subclass that saves on one rank of a distributed job alone (a framework's
    rank-0 checkpoint hook) sets the class attribute `local_only = True`: it is then a
    Checkpointer of one process whatever torch.distributed runs."""

    local_only = False

    def __init__(self, path, policy=None, full_every=None, full_share=None, rng=True,
                 readonly=False, threads=0, chunk_elems=0, keep_last=None, process_group=None,
                 memory=None, replicas=0, memory_budget=None, max_lag=None,
                 max_lag_bytes=None):
        self.options = opts = Options.make(policy, full_every, full_share, rng, readonly,
                                           threads, chunk_elems, keep_last)
        self.tier_options = TierOptions.make(path, memory, replicas, memory_budget, max_lag,
                                             max_lag_bytes)
        self.rng, self.readonly = opts.rng, opts.readonly
        self.process_group = process_group
        many = not self.local_only and _comm.distributed(process_group)
        self._comm = _comm.comm_for(process_group) if many else _comm.SoloComm()
        self.rank, self.world_size = self._comm.rank, self._comm.size
        self._tiers = None      # _tiers.Tiers: the drain of the memory tier
        self.served_by = None   # the tier the last load read ("memory", "durable", ...)
        self.restored = None    # many ranks with tiers: the last load's amber.TiersRestore
        tiers = self.tier_options if not opts.readonly else None
        if many and tiers is not None and not tiers.staging:
            # this rank's memory tier (its host's: a local-mode global store), drained to
            # the global store at `path`; replication and restore on a group of their own
            self.path = os.fspath(path) if is_url(path) else os.path.abspath(os.fspath(path))
            sink = GlobalSink(tiers.memory, opts.writer, opts.rules, self._comm, local=True)
            self.store = None
            self._tiers = sink.tiers = RankTiers(tiers, self.path,
                                                 _comm.comm_for(process_group, own=True))
        elif many or _amber.is_global_store(path):
            if tiers is not None and not tiers.staging:
                raise NotImplementedError("memory= for one process on a store of many ranks")
            self.store = None
            self.path = os.fspath(path)
            if tiers is None:
                sink = GlobalSink(path, opts.writer, opts.rules, self._comm)
            else:  # an s3:// store: this rank's part through the host's staging directory
                sink = GlobalSink(tiers.memory, opts.writer, opts.rules, self._comm, local=True)
                self._tiers = sink.tiers = Tiers(tiers, self.path, rank=self.rank)
        elif tiers is not None:
            # the writer's store is the memory tier's; the run's path is the durable tier
            sink = StoreSink(tiers.memory, opts.writer, opts.rules, False, opts.threads)
            self.store = sink.store
            self.path = os.fspath(path) if is_url(path) else os.path.abspath(os.fspath(path))
            try:
                self._tiers = sink.tiers = Tiers(tiers, self.path)
            except BaseException:
                sink.close()
                raise
        else:
            sink = StoreSink(path, opts.writer, opts.rules, opts.readonly, opts.threads)
            self.store = sink.store
            self.path = self.store.path
        self._saver = Saver(sink, self._comm, opts)
        self._seeder = Seeder(self._saver, self._comm, self.rng, opts, self._step_rules)
        self._saveplan = None   # _plan.Plan: what the last save learned of its state
        self._unit_map = self._unit_lrs = None
        self._closed = False
        self._hooks = FenceHooks(self, Checkpointer.fence,
                                 lambda c: c._saver.pinned is not None or c._seeder.job is not None)
        self.timings = {"save": 0.0, "fence": 0.0, "wait": 0.0}
        self.skipped = 0
        self._step = None    # the step of the save in progress (for the log)

    # -- context manager, life cycle --
    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:  # do not hide the original exception behind a save's failure
            try:
                self.close()
            except AmberError:
                pass

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def _sink(self):
        return self._saver.sink

    def _open(self):
        if self._closed:
            raise ValueError("Checkpointer is closed")

    def close(self) -> None:
        """Waits for the save in progress (collective with many ranks), removes the
        fence hook and releases the store; raises the save's failure, if any. With a
        memory tier it first waits until the durable tier holds every committed step
        (raising the drain's failure: what is not durable stays in the memory tier,
        and `amber drain` or the next Checkpointer on it finishes the drain)."""
        if self._closed:
            return
        try:
            self.wait()
            if self._tiers is not None:
                tiers, self._tiers = self._tiers, None
                tiers.close(flush=True)
        finally:
            self._release()

    def _release(self):
        self._hooks.remove()
        self._settle_seed()
        if self._tiers is not None:
            tiers, self._tiers = self._tiers, None
            try:
                tiers.close(flush=False)
            except AmberError:
                pass
        self._saver.close()
        self._closed = True
        self.store = None
        self._saveplan = None

    def __del__(self):
        try:
            if self._comm.size > 1:  # never a collective from the garbage collector
                self._release()
            else:
                self.close()
        except Exception:
            pass

    # -- saving --
    def save(self, step: int, state: dict, full: bool = False) -> None:
        """Checkpoints `state` (a dict, see amber.torch's documentation) as `step`.
        Returns once the scan has started; what may happen before the fence is in
        amber.torch's documentation. full=True forces a full checkpoint. Raises the
        failure of the previous save, if any. With many ranks it is collective: every
        rank calls it with the same step, and the step commits in the next wait(),
        save(), load() or close()."""
        self._open()
        if self.readonly:
            raise AmberError(_amber.EREADONLY, f"store {self.path} is open read-only",
                             name="AMBER_EREADONLY")
        t0 = time.perf_counter()
        self.wait()
        if self._tiers is not None:  # a memory tier that lost its steps starts after the durable's
            self._tiers.check_step(int(step))
        full = full or self._sink.wants_full()
        planned = self._save_planned(int(step), state, full)
        if not planned:
            self._save_unplanned(int(step), state, full)
        self.timings["save"] = time.perf_counter() - t0
        self._step = int(step)
        log.debug("step %d of %s: save() %.2f ms (%s)", step, self.path,
                  1e3 * self.timings["save"], "planned" if planned else "the structure walked")

    def _meta_tail(self, step: int) -> dict:
        tail = {"step": step, "policy": self.options.policy_label}
        if self._sink.dist:
            tail["rank"], tail["world_size"] = self.rank, self.world_size
            if self.rng:
                tail["rng"] = _rng.json_form()
        return tail

    @staticmethod
    def _step_rules(state):
        return _presets.step_rules([k for k, v in state.items()
                                    if isinstance(v, torch.optim.Optimizer)])

    def _save_unplanned(self, step, state, full):
        """save() the whole way: names, encodes and places every tensor; then plans
        the next save."""
        self._saveplan = None
        sv, sink = self._saver, self._sink
        err = items = None
        try:
            sink.check_save()
            if self.rng and not sink.rng_tensors and "rng" in state:
                check_key("rng", True)
            spans = {}
            flat, meta = flatten(state, self.rng and sink.rng_tensors, dist=sink.dist,
                                 spans=spans)
            meta = {"format": sink.meta_format, **meta, **self._meta_tail(step)}
            all_items = sv.items(flat.tensors, state)
            items = [it for it in all_items if it is not None]
            text = _meta.dumps(meta)
        except Exception as e:  # with many ranks, every rank must learn of it first
            err = e
        sv.declare(step, items, err, self._step_rules(state), full=full)
        sink.set_meta(text)
        self._unit_map = None
        if self.options.has_units:
            self._unit_map = UnitMap([it.decl.name for it in items], state)
            self._set_units(self._unit_map.lrs(state))
        names, tensors = in_place_names(items)
        devs = {it.decl.name: it.local for it in items if it.decl.on_device}
        sv.begin(step, full, Versions(names, tensors),
                 [it.source for it in items if it.source is not None],
                 any(it.in_place for it in items), devs, state)
        if not devs:
            try:
                self._saveplan = plan_of(state, flat, meta, spans, all_items)
            except Exception:  # a state the plan does not understand: every save the whole way
                self._saveplan = None

    def _save_planned(self, step, state, full) -> bool:
        """save() through the plan of the previous save: only what changes from save to
        save is encoded, copied and checked; the cached tensors' copies are one call.
        False (nothing done) when the state's structure changed."""
        plan, sv, sink = self._saveplan, self._saver, self._sink
        if plan is None or sink.writer is None or self.options.device_path:
            return False
        got = plan.check(state)
        if got is None:
            return self._unplan()
        tensors, reads = got
        flat = Flat(dist=sink.dist, reserved=plan.names)
        parts, dyn = [], []
        for key, _, kind, data in plan.layout:
            first = len(flat.tensors)
            if kind in ("module", "tree"):
                parts.append(data["json"])  # bytes: the metadata is sent as bytes
            elif kind == "optimizer":
                fields = [{k: v for k, v in g.items() if k != "params"}
                          for g in state[key].param_groups]
                if data["fields"] is None or not plain_equal(fields, data["fields"]):
                    groups = []
                    for f, gn in zip(fields, data["gnames"]):
                        e = flat.enc(f, f"{key}/param_groups")
                        e["params"] = gn
                        groups.append(e)
                    text = (_meta.dumps(groups) + "}").encode()
                    # the same fields (no lr schedule, or a constant stretch of one)
                    # give the same text: kept while they stay equal
                    data["fields"], data["text"] = (fields, text) if len(flat.tensors) == \
                        first else (None, None)
                else:
                    text = data["text"]
                parts.append(data["head"] + text)
            else:
                check_key(key, self.rng and sink.rng_tensors)
                parts.append((_meta.dumps(key) + ":" + _meta.dumps(
                    entry(flat, None, key, state[key]))).encode())
            dyn += flat.tensors[first:]
        rng = None
        if self.rng and sink.rng_tensors:  # new tensors that nothing else can write
            rng, own = _rng.tensor_form()
            if any(n in flat.names for n, _ in own):
                return self._unplan()
            dyn += own
        if [(n, t.dtype, t.shape) for n, t in dyn] != plan.dynamic or \
                any(t.device.type != "cpu" for _, t in dyn):
            return self._unplan()
        with torch.no_grad():
            if plan.copy_at:  # every small tensor and buffer of the cached entries: one call
                torch._foreach_copy_(plan.copy_dst, list(map(reads.__getitem__, plan.copy_at)))
            dyn_items = [sv.item(n, t, plan.owned, plan.buffers) for n, t in dyn]
        at = [(i, it) for i, it in zip(plan.dyn_index, dyn_items) if i is not None]
        scanned = list(map(reads.__getitem__, plan.inplace_at))
        names = list(map(plan.names_at.__getitem__, plan.inplace_at))
        checked = list(scanned)
        if plan.dist:  # a DTensor's ops move its own counter, to_local()'s its local's
            for k in plan.inplace_at:
                if tensors[k] is not reads[k]:
                    names.append(plan.names_at[k])
                    checked.append(tensors[k])
        dn, dt = in_place_names([it for _, it in at])
        tail = self._meta_tail(step)
        if rng is not None:
            tail = {"rng": rng, **tail}
        meta = b'{"format":"' + sink.meta_format.encode() + b'","entries":{' + \
            b",".join(parts) + b"}," + _meta.dumps(tail)[1:].encode()

        def items():  # every declaration, should another rank's change make all reopen
            copies = dict(zip(plan.copy_at, plan.copy_dst))
            static = iter(Item(d, tensors[k], reads[k], h is not None,
                               reads[k] if h == INPLACE else copies.get(k), h == INPLACE)
                          for k, (d, h) in enumerate(zip(plan.decls, plan.how)) if d is not None)
            dyn_at = dict(at)
            return [dyn_at[i] if i in dyn_at else next(static) for i in range(len(sv.sig))]
        sv.declare(step, None, None, self._step_rules(state), items_fn=items,
                   points=[(i, it.address) for i, it in at], full=full)
        sink.set_meta(meta)
        if self._unit_map is not None:  # the learning rates of this step
            lrs = self._unit_map.lrs(state)
            if lrs != self._unit_lrs:  # the same structure: units move with the lrs only
                self._set_units(lrs)
        sv.begin(step, full, Versions(names + dn, checked + dt),
                 plan.copy_dst + scanned + [it.source for _, it in at if it.source is not None],
                 bool(scanned or dn), {}, state)
        return True

    def _unplan(self):
        self._saveplan = None
        return False

    def _set_units(self, lrs):
        self._saver.set_units(self._unit_map.units(lrs))
        self._unit_lrs = lrs

    def fence(self) -> None:
        """Blocks until the save in progress (or the seed after a load) no longer
        reads the tensors; then they may change. Runs by itself before the step of
        any torch.optim optimizer. Not collective."""
        t0 = time.perf_counter()
        if self._seeder.job is not None:
            self._settle_seed()
        if self._saver.pinned is not None:
            self._saver.fence("save()", "; call fence() (or wait()) before changing saved "
                              "tensors outside optimizer.step()")
        self.timings["fence"] = time.perf_counter() - t0

    def wait(self) -> None:
        """Blocks until the save in progress is committed and durable (with many ranks:
        the global commit, collective); raises its failure, naming the rank that
        failed."""
        if self._closed:
            return
        t0 = time.perf_counter()
        busy = self._saver.busy
        try:
            self.fence()
            self._saver.wait(f"global step saved, but old ones could not be removed on rank "
                             f"{self.rank}" if self._sink.dist else
                             "a checkpoint was saved, but old ones could not be removed")
        finally:
            self.timings["wait"] = time.perf_counter() - t0
        if busy:
            log.debug("step %d of %s committed (wait %.2f ms)", self._step, self.path,
                      1e3 * self.timings["wait"])

    # -- loading --
    def latest(self) -> Optional[int]:
        """The store's latest step, or None when it is empty (after the save in
        progress). With a memory tier: the newest step of either tier."""
        self._open()
        self.wait()
        if self._memory_tier() is None:
            return self._sink.latest()
        steps = [s.step for s in self.steps()]
        return steps[-1] if steps else None

    def steps(self) -> list:
        """The committed checkpoints (amber.CheckpointInfo, or amber.GlobalStepInfo for
        a multi-rank store), after the save in progress. With a memory tier: those of
        both tiers, the memory tier's where both hold a step."""
        self._open()
        self.wait()
        mem = self._memory_tier()
        if mem is None and self._sink.dist and self.tier_options is not None and \
                self.tier_options.staging:  # many ranks on an s3:// store: drained at each commit
            return _amber.global_steps(self.path) if _amber.is_global_store(self.path) else []
        return self._sink.steps() if mem is None else both_steps(self.path, mem)

    def _memory_tier(self) -> Optional[str]:
        """The memory tier's directory (a store of one process), or None."""
        t = self.tier_options
        return t.memory if t is not None and not self._sink.dist else None

    def _sources(self, step):
        """[(tier, source)] that a load tries in turn: with a memory tier, the
        fastest tier holding the step first (_tiers.sources); else the store itself."""
        t = self.tier_options
        if isinstance(self._tiers, RankTiers) or (self._sink.dist and t and not t.staging):
            out, self.restored = rank_sources(self._tiers, self.tier_options.memory,
                                              self.path, step)
            return out
        mem = self._memory_tier()
        if mem is None:
            return [(None, self._source())]
        return sources(mem, self.path, self.store, step)

    def _source(self):
        if self.store is not None:
            return StoreSource(self.path, self.store)
        if single_store(self.path):
            return StoreSource(self.path)  # a store of one process, loaded at many ranks
        return GlobalSource(self.path)

    def load(self, state: dict, step: Optional[int] = None, strict: bool = True,
             fallback: bool = False) -> Optional[int]:
        """Restores `state` (same shape of dict as for save) in place from `step`
        (default: the latest) and returns the restored step, or None for an empty
        store. Tensors are read straight into the live tensors' memory (a DTensor:
        the box this rank holds now, whatever world size and sharding wrote the
        step). Plain values (and objects that cannot be updated in place) are put
        back into the `state` dict; dicts and lists there are updated in place.

        Args:
          strict: False skips mismatched entries instead of raising
              StateMismatchError.
          fallback: verify the step whole before anything is restored (with many
              ranks: on every rank, agreed collectively) and, if it is damaged,
              restore the newest older step that verifies instead (`skipped` then
              counts the steps passed over). Without it a damaged header or index
              raises AmberError (AMBER_ECORRUPT, naming the file) before anything is
              restored.

        Everything but tensor data is checked before the live state changes. With
        many ranks every rank calls it (it completes the save in progress first)."""
        self._open()
        self.wait()
        self.skipped = 0
        self._seeder.seeded = False
        self.served_by = None
        sources = self._sources(step)
        for i, (tier, source) in enumerate(sources):
            try:
                return self._load_from(tier, source, state, step, strict, fallback)
            except AmberError as e:
                if i + 1 == len(sources) or e.partial or e.code not in _TIER_FALLBACK:
                    raise
                log.warning("%s: the %s tier could not serve the load (%s): trying the %s "
                            "tier", self.path, tier, e, sources[i + 1][0])

    def _load_from(self, tier, source, state, step, strict, fallback):
        if step is None and source.empty():
            log.info("%s holds no checkpoint: nothing loaded", self.path)
            return None
        t0 = time.perf_counter()
        with source.open(step, fallback, self._comm, state, self.rank) as s:
            done = s.step
            self.skipped = s.skipped
            ld = Load(s.reader, strict, done, boxes=s.boxes)
            ld.plan(s.meta["entries"], state)
            if self.rng and "rng" in s.meta:
                ld.key = "rng"
                if s.rng_form == "tensors":
                    ld.after.append(("rng", _rng.plan_tensor_form(s.meta["rng"], ld.tensor,
                                                                  ld.bad)))
                elif s.rng_form == "json":
                    ld.after.append(("rng", _rng.plan_json_form(s.meta["rng"], done)))
                else:
                    warnings.warn(s.rng_note, RuntimeWarning, stacklevel=2)
            ld.apply()
        nbytes = sum(t.numel() * t.element_size() for _, t, *_ in ld.fresh + ld.inplace)
        if self.skipped:
            log.warning("%s: loaded step %d, the newest intact one: %d newer step(s) were "
                        "damaged and skipped (amber verify %s says why)", self.path, done,
                        self.skipped, self.path)
        self.served_by = tier
        log.info("loaded step %d of %s%s in %.2f s (%.1f MB read)", done, self.path,
                 f" from the {tier} tier ({source.path})" if tier else "",
                 time.perf_counter() - t0, nbytes / 1e6)
        # the writer's reference is seeded only from a step of its own store (a step
        # of the durable tier is not in the memory tier's chain). With many ranks the
        # tier that served a rank is its own: every rank goes on to the seed's vote,
        # which a rank that cannot seed fails for all (its writer's open is collective)
        if strict and not self.readonly and step is None and not self.skipped:
            own = tier in (None, "memory")
            if self._sink.dist:
                self._seeder.many_ranks(state, done, source, own)
            elif own:
                self._seeder.one_process(state, done, source)
        return done

    @property
    def seeded(self) -> bool:
        """Whether the last load() seeded the writer's reference (and it still holds)."""
        return self._seeder.seeded

    def _settle_seed(self):
        if self._seeder.settle():  # dropped with the writer: so is the save plan
            self._saveplan = None
