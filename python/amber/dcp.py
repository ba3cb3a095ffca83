"""amber.dcp - an amber store as the storage of PyTorch Distributed Checkpoint (DCP).

    import torch.distributed.checkpoint as dcp
    from amber.dcp import Writer, Reader
    writer = Writer(policy="exact")     # one per run: it keeps the reference between saves
    dcp.save(state_dict, storage_writer=writer, checkpoint_id="runs/x/step-10")
    dcp.async_save(state_dict, storage_writer=writer, checkpoint_id="runs/x/step-11")
    dcp.load(state_dict, storage_reader=Reader(), checkpoint_id="runs/x/step-10")
    dcp.load(state_dict, storage_reader=Reader(), checkpoint_id="runs/x")  # latest
    writer.close()

checkpoint_id: "STORE/step-N" names store STORE and step N (torchtitan's ids);
"STORE" alone is the latest step for a load and the step after it for a save.

The Writer is long-lived, like amber.torch's Checkpointer: it keeps its reference
state between saves, so each DCP save is a full or a delta checkpoint under the
same policies, presets ("exact", "lossy", "lossy-frequent", "lossy-compact",
"lossy-capped") and cadence (full_every, full_share).
Tensors are named by their path in the state dict, joined by "/" (an optimizer
state from get_state_dict is "optim/state/<FQN>/exp_avg"), so the Checkpointer's
patterns such as "*/exp_avg_sq" apply; optimizer step counters stay exact.

What is stored: the tensors as amber tensors, and, in the checkpoint's JSON
metadata, which DCP key each tensor is and the non-tensor values (DCP's "bytes"
items: param_groups, counters, ...) encoded as amber.torch encodes plain data.
No pickle is ever written: a non-tensor value that is not plain data (numbers,
strings, None, lists, tuples, dicts, dtypes, small numpy arrays) is refused with a
TypeError before anything is written. DCP's Metadata is rebuilt from that JSON
and the store's tensor table on load.

Commit: a save is written and made durable, but becomes visible only in finish(),
DCP's last step; a save that fails anywhere before makes nothing visible.

Async saves (dcp.async_save, thread-based): the Writer is DCP's AsyncStager.
stage() starts amber's scan of the live tensors (no copy of the bulk: contiguous
CPU tensors are read in place) and returns a Future that completes at amber's
fence, when the scan no longer reads them; async_save's `staging_completion`
is that Future. Do not change the tensors before it completes: the Writer fences by
itself before the step of any torch.optim optimizer, and checks the version counters
of the tensors it reads in place at the fence; a tensor changed in place before then
makes the step fail uncommitted with AMBER_ECHANGED (raised by upload_completion),
never commit torn. The upload (encode, write, commit) runs in DCP's thread. AsyncCheckpointerType.PROCESS is
refused: it pickles the Writer, whose reference cannot cross processes.

Many ranks: under a process group of more than one rank (Writer(process_group=...),
default the world) the store is a multi-rank store (amber's global writer): each
rank writes the shards of its final plan (DTensor shards, and the replicated items
DCP's planner gave it) in its own files, and the step commits on every rank at the
end of write_data, through amber's collectives on a gloo group of the Writer's own
(DCP calls finish() on the coordinator alone, so the collective commit cannot wait
for it). The Reader offers each global tensor as one chunk, so DCP's planner asks
for any region at any world size, and serves it from the shards that overlap it.
"""

import io
import json
import os
import re
import sys
import threading
from concurrent.futures import Future

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
    TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import WriteItemType, LoadItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

import amber as _amber
from amber import AmberError, Store
from amber import _dist
from amber import device as _device
from amber import torch as _at

__all__ = ["Writer", "Reader", "parse_checkpoint_id"]

_FORMAT = _at._DCP_FORMAT  # "amber.dcp/1"
_STEP = re.compile(r"^step-(\d+)$")


def parse_checkpoint_id(checkpoint_id):
    """(store path, step or None) of a checkpoint_id "STORE/step-N" or "STORE"."""
    if checkpoint_id is None:
        raise ValueError("amber.dcp needs a checkpoint_id: \"STORE/step-N\" or \"STORE\"")
    if not isinstance(checkpoint_id, (str, os.PathLike)):
        raise TypeError(f"checkpoint_id must be a str or os.PathLike, not "
                        f"{type(checkpoint_id).__name__}")
    path = os.fspath(checkpoint_id).rstrip("/")
    if not path:
        raise ValueError(f"checkpoint_id {checkpoint_id!r} names no store")
    head, base = os.path.split(path)
    m = _STEP.match(base)
    if m:
        if not head:
            raise ValueError(f"checkpoint_id {checkpoint_id!r}: \"step-N\" needs a store "
                             "before it (\"STORE/step-N\")")
        return head, int(m.group(1))
    if base.startswith("step-"):
        raise ValueError(f"checkpoint_id {checkpoint_id!r}: \"{base}\" is not \"step-N\" "
                         "with N a non-negative integer")
    return path, None


def _world(group=None):
    """The number of ranks of `group` (None: the world); 1 without torch.distributed."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _name(path):
    return "/".join(str(p) for p in path)


def _units_of(names, objects):
    """Each tensor's unit for rules in units ("threshold:1u"), as amber.torch gives
    them: the learning rate of the param group of the parameter the tensor is or
    belongs to, 0 (none) elsewhere. The groups are those of an optimizer state dict
    in the state (get_optimizer_state_dict's, flattened: "<key>/param_groups/<i>/lr"
    and ".../params", the parameters' FQNs); its state tensors are
    "<key>/state/<FQN>/<name>", a parameter "<module key>/<FQN>" (or "<FQN>")."""
    groups = {}
    for name, v in objects.items():
        head, _, field = name.rpartition("/")
        pg, _, i = head.rpartition("/")
        if field in ("lr", "params") and i.isdigit() and \
                (pg == "param_groups" or pg.endswith("/param_groups")):
            groups.setdefault((pg[:-len("param_groups")], i), {})[field] = v
    state, params = {}, {}
    for (prefix, _), g in groups.items():
        lr, fqns = g.get("lr"), g.get("params")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or \
                not isinstance(fqns, (list, tuple)):
            continue
        for fqn in fqns:
            if isinstance(fqn, str):
                state[f"{prefix}state/{fqn}"] = float(lr)
                params[fqn] = float(lr)
    out = []
    for n in names:
        u = state.get(n.rpartition("/")[0])
        if u is None:
            u = params.get(n, params.get(n.partition("/")[2], 0.0))
        out.append(u)
    return out


def _async_save_args():
    """The checkpoint_id and async_checkpointer_type that dcp.async_save received:
    it calls stage() before it hands the id to the writer (reset())."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name == "async_save" and "checkpoint_id" in f.f_locals:
            return f.f_locals.get("checkpoint_id"), f.f_locals.get("async_checkpointer_type")
        f = f.f_back
    return None, None


class Writer(StorageWriter, AsyncStager):
    """DCP StorageWriter (and AsyncStager) into an amber store.

    Writer(checkpoint_id=None, policy=None, full_every=None, full_share=None,
           threads=0, chunk_elems=0, process_group=None)
      policy, full_every, full_share, threads, chunk_elems: as for
      amber.torch.Checkpointer ("exact" by default, "lossy", rules...).
      checkpoint_id: optional default id; DCP's checkpoint_id= overrides it.
      process_group: the ranks that save together, the group given to dcp.save
              (default: the world); with more than one rank the store is a
              multi-rank store (see the module's documentation). Every rank
              makes its Writer, and the first save is collective (it makes the
              Writer's gloo group).
    Keep one Writer for the run and close() it at the end (it holds the store's
    lock while open; with many ranks close() completes a staged save, which is
    collective). Not thread-safe beyond what DCP does with it."""

    _synchronize_after_execute = False  # staging completes with stage()'s Future

    def __init__(self, checkpoint_id=None, policy=None, full_every=None, full_share=None,
                 threads=0, chunk_elems=0, process_group=None):
        super().__init__()
        self._pg = process_group
        self._comm = None     # amber's collectives, on a gloo group of its own (many ranks)
        self._gw = None       # the global writer (many ranks)
        self._rules = _at._rules(policy) + ["*/state/*/step=exact"]
        self._has_units, self._units = _at._rules_have_units(self._rules), None
        self._wopts = {"chunk_elems": chunk_elems or 0, "full_every": full_every or 0,
                       "full_share": float(full_share or 0.0)}
        self._threads = threads
        self._store = None
        self._w = None
        self._sig = None
        self._ptrs = []
        self._bufs = {}
        self._id = None if checkpoint_id is None else os.fspath(checkpoint_id)
        self._target = None   # (store path, step) of the save in progress
        self._begun = None    # {fqn: name}, objects of a save whose scan has started
        self._staged = None   # Future of the fence of a staged save
        self._pinned = None
        self._dev = None      # amber.device.DevicePath: tensors selected on their device
        self._gdev = None     # the same for this rank's shards (many ranks)
        self._versions = None  # _Versions of the tensors a save reads in place
        self._torn = None     # why the save in progress must not commit (set at the fence)
        self._seeding = None  # (amber.torch's fence hook reads it; the Writer never seeds)
        self._global_hook = _at._fence_before_any_step(self)
        if self._id is not None:
            parse_checkpoint_id(self._id)

    # -- the store and its writer --
    def _open(self, path):
        path = os.path.abspath(path)
        if self._store is not None and self._store.path == path:
            return
        self._drop()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self._store = Store(path, threads=self._threads)

    def _drop(self):
        if self._gw is not None:
            self._gw.close()
            self._gw = None
        if self._w is not None:
            self._w.close()
            self._w = None
        if self._store is not None:
            self._store.close()
            self._store = None
        self._sig = None

    def close(self):
        """Releases the store (a save in progress that was not finished is dropped,
        uncommitted)."""
        self._abort()
        self._drop()
        hook, self._global_hook = getattr(self, "_global_hook", None), None
        if hook is not None:
            hook.remove()

    def fence(self):
        """Blocks until the staged save no longer reads the tensors (its staging is
        complete); then they may change. Called by itself before the step of any
        torch.optim optimizer, so an optimizer.step() right after dcp.async_save
        waits for the staging instead of tearing the checkpoint. A failure is not
        raised here: the upload reports it."""
        staged = self._staged
        if staged is not None:
            try:
                staged.result()
            except BaseException:
                pass

    def __enter__(self):
        return self

    def __exit__(self, *_):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __reduce__(self):
        raise TypeError("amber.dcp.Writer cannot be pickled: it keeps its reference state in "
                        "this process (AsyncCheckpointerType.PROCESS is not supported; use the "
                        "default THREAD)")

    # -- StorageWriter --
    def reset(self, checkpoint_id=None):
        cid = self._id if checkpoint_id is None else os.fspath(checkpoint_id)
        path, step = parse_checkpoint_id(cid)
        if _world(self._pg) > 1 or _amber.is_global_store(path):
            # many ranks; or one process saving into a store that many ranks wrote
            # (a step of world size 1, which every world size loads)
            return self._reset_global(cid, path, step)
        if self._begun is not None:
            if self._target[0] != os.path.abspath(path) or \
                    (step is not None and step != self._target[1]):
                self._abort()
                raise ValueError(f"amber.dcp.Writer: the staged save is {self._target}, "
                                 f"not {cid!r}")
            return
        self._open(path)
        if step is None:
            latest = self._store.latest()
            step = 0 if latest is None else latest + 1
        self._target = (self._store.path, step)

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def storage_meta(self):
        return None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        try:
            parse_checkpoint_id(checkpoint_id)
            return True
        except (TypeError, ValueError):
            return False

    def write_data(self, plan, planner):
        if self._gw is not None:
            return self._write_data_global(plan, planner)
        fut = torch.futures.Future()
        try:
            if self._begun is None:  # dcp.save: scan the planner's data now
                self._begin_plan(plan, planner)
            names, _ = self._begun
            if self._staged is not None:
                self._staged.result()
            else:
                self._fence()
            results = []
            for item in plan.items:
                fqn = item.index.fqn
                if fqn not in names:
                    raise ValueError(f"amber.dcp.Writer: {fqn}: not in the staged state")
                size = 0
                if item.type != WriteItemType.BYTE_IO:
                    size = item.tensor_data.size.numel() * item.tensor_data.properties.dtype.itemsize
                results.append(WriteResult(index=item.index, size_in_bytes=size,
                                           storage_data=names[fqn]))
            fut.set_result(results)
        except BaseException as e:
            self._abort()
            fut.set_exception(e)
        return fut

    def finish(self, metadata, results):
        """The commit point: the step becomes visible here, or nothing does. (With
        many ranks the global commit is collective and DCP calls finish() on the
        coordinator alone: the step commits at the end of write_data on every rank.)"""
        if self._gw is not None:
            return
        if self._begun is None:
            raise RuntimeError("amber.dcp.Writer.finish: no save in progress")
        try:
            self._w.confirm(self._torn is None, self._torn or "")
            self._w.wait()
        except BaseException:
            self._abort()
            raise
        self._settled(True)
        self._begun = None
        self._staged = None

    # -- AsyncStager --
    def stage(self, state_dict):
        """Starts the scan of `state_dict` and returns a Future that completes at
        amber's fence, when the live tensors may change again."""
        cid, kind = _async_save_args()
        if kind is not None and getattr(kind, "name", str(kind)).upper().endswith("PROCESS"):
            raise ValueError("amber.dcp.Writer does not support AsyncCheckpointerType.PROCESS: "
                             "that pickles the writer into another process, where its reference "
                             "state (what makes saves deltas) does not exist; use the default "
                             "AsyncCheckpointerType.THREAD")
        if cid is None and self._id is None:
            raise ValueError("amber.dcp.Writer.stage: pass checkpoint_id=\"STORE/step-N\" to "
                             "dcp.async_save (or to Writer())")
        self._abort()
        self.reset(cid)
        if self._gw is not None:
            return self._stage_global(state_dict)
        flat, mappings = flatten_state_dict(state_dict)
        tensors, objects, names = [], {}, {}
        for fqn, v in flat.items():
            name = _name(mappings.get(fqn, (fqn,)))
            if isinstance(v, torch.Tensor):
                tensors.append((name, v))
            else:
                objects[name] = v
            names[fqn] = name
        self._begin(tensors, objects, names)
        fut = Future()
        self._staged = fut

        def fence():
            try:
                self._fence()
                fut.set_result(state_dict)
            except BaseException as e:
                fut.set_exception(e)
        threading.Thread(target=fence, name="amber-dcp-fence", daemon=True).start()
        return fut

    def synchronize_staging(self):
        if self._staged is not None:
            self._staged.result()

    # -- the save --
    def _begin_plan(self, plan, planner):
        mappings = getattr(planner, "mappings", None) or {}
        state = getattr(planner, "state_dict", None) or {}
        tensors, objects, names = [], {}, {}
        for item in plan.items:
            fqn = item.index.fqn
            name = _name(mappings.get(fqn, (fqn,)))
            if item.type == WriteItemType.BYTE_IO:
                if fqn not in state:
                    raise TypeError(f"amber.dcp.Writer: {fqn}: a non-tensor value that the "
                                    "planner gives only as bytes; amber stores no pickles")
                objects[name] = state[fqn]
            else:
                t = planner.resolve_data(item)
                full = item.tensor_data.size
                if tuple(item.tensor_data.chunk.sizes) != tuple(full):
                    raise NotImplementedError(f"amber.dcp.Writer: {fqn}: a shard of a tensor; "
                                              "sharded tensors come with the distributed core")
                tensors.append((name, t))
            names[fqn] = name
        self._begin(tensors, objects, names)

    def _begin(self, tensors, objects, names):
        enc = _at._Flat()
        meta_objects = {}
        for name, v in objects.items():
            e = enc.enc(v, name)
            if enc.tensors:
                raise TypeError(f"amber.dcp.Writer: {name}: tensors inside a non-tensor value")
            meta_objects[name] = e
        meta = {"format": _FORMAT, "step": self._target[1],
                "keys": {fqn: n for fqn, n in names.items()}, "objects": meta_objects}
        flat = _at._Flat()
        for name, t in tensors:
            flat.tensor(name, t)
        sig = [(n, _at._DTYPES[t.dtype], tuple(t.shape), _device.wanted(t))
               for n, t in flat.tensors]
        ptrs, pinned, inplace = [], [], []
        with torch.no_grad():
            for name, t in flat.tensors:
                if _device.wanted(t):  # selected on its device (amber.device)
                    ptrs.append(None)
                    continue
                if t.device.type == "cpu" and t.is_contiguous() and not t.is_conj() \
                        and not t.is_neg() and not t.is_inference():
                    src = t  # read in place until the fence: its version is checked there
                    inplace.append((name, t))
                else:
                    src = self._bufs.get(name)
                    if src is None or src.shape != t.shape or src.dtype != t.dtype:
                        src = self._bufs[name] = torch.empty(t.shape, dtype=t.dtype)
                    src.copy_(t.resolve_conj().resolve_neg())
                pinned.append(src)
                ptrs.append(src.data_ptr() if src.numel() else 0)
        if self._w is None or sig != self._sig:
            if self._w is not None:
                self._w.close()
                self._w = None
            w = self._store.writer(**self._wopts)
            self._dev = _device.DevicePath()
            try:
                for (name, t), p in zip(flat.tensors, ptrs):
                    if p is None:
                        self._dev.declare(w, name, _at._DTYPES[t.dtype], t)
                    else:
                        w.add(name, _at._DTYPES[t.dtype], t.shape, p)
                for r in self._rules:
                    w.add_policy(r)
            except BaseException:
                w.close()
                raise
            self._w, self._sig, self._ptrs = w, sig, list(ptrs)
            self._units = None  # the new writer has none yet
        else:
            for i, p in enumerate(ptrs):
                if p is not None and p != self._ptrs[i]:
                    self._w.set_data(i, p)
                    self._ptrs[i] = p
        self._w.set_meta(json.dumps(meta, allow_nan=False, separators=(",", ":")))
        if self._has_units:
            units = _units_of([n for n, _ in flat.tensors], objects)
            if units != self._units:
                self._w.set_units(units)
                self._units = units
        self._pinned = pinned
        self._versions = _at._Versions([n for n, _ in inplace], [t for _, t in inplace])
        self._torn = None
        step, flags = self._target[1], 0
        if self._dev.tensors:  # plan, select on the devices, hand the selections over
            live = {n: t for n, t in flat.tensors if n in self._dev.tensors}
            flags, kind = self._dev.plan(self._w, self._store, step, 0, _amber.SAVE_FULL)
            self._dev.select(self._w, kind, live)
        try:
            self._w.begin(step, full=bool(flags & _amber.SAVE_FULL), confirm=True)
        except BaseException:
            self._dev.rollback()
            raise
        self._begun = (names, meta_objects)

    def _fence(self):
        """amber's fence: the scan no longer reads the live tensors. A tensor read in
        place whose version counter moved since the save began (an in-place op before
        the staging completed: the next optimizer step, a write by another thread)
        makes the step torn: it is then not committed (AMBER_ECHANGED at the commit)."""
        try:
            dev = self._dev if self._gw is None else self._gdev
            if dev is not None:
                dev.fence()  # the device-side selection (an event on CUDA)
            (self._gw or self._w).fence()
        finally:
            changed = self._versions.changed() if self._versions else None
            if changed is not None:
                self._torn = (
                    f"tensor '{changed}' changed in place after the save began and before "
                    "its staging completed: the checkpoint could hold a torn state, so it was "
                    "not committed; wait on async_save's staging_completion before changing "
                    "the state (an optimizer.step() waits by itself)")
            self._pinned = self._versions = None

    def _settled(self, ok):
        """The device references after the save's outcome."""
        dev = self._dev if self._gw is None else self._gdev
        if dev is not None:
            dev.commit() if ok else dev.rollback()

    def _abort(self):
        """Drops the save in progress uncommitted."""
        if self._begun is None:
            return
        self._begun = None
        staged, self._staged = self._staged, None
        try:
            if staged is not None:
                try:
                    staged.result()
                except BaseException:
                    pass
            (self._gw or self._w).confirm(False, "the DCP save failed before finish()")
        except AmberError:
            pass
        try:
            (self._gw or self._w).wait()  # with many ranks: the collective commit, failing
        except AmberError:
            pass
        self._settled(False)
        self._pinned = self._versions = self._torn = None

    # -- many ranks: each rank writes its shards through the global writer --
    def _reset_global(self, cid, path, step):
        path = os.path.abspath(path)
        if self._begun is not None:
            if self._target[0] != path or (step is not None and step != self._target[1]):
                self._abort()
                raise ValueError(f"amber.dcp.Writer: the staged save is {self._target}, "
                                 f"not {cid!r}")
            return
        if self._gw is None or self._gw.path != path:
            self._drop()
            if self._comm is None:
                # a gloo group of amber's own: async saves commit from DCP's thread while
                # training uses the job's groups on its own (collective, every rank)
                self._comm = _dist.TorchComm(_dist.cpu_group(self._pg, own=True)) \
                    if _world(self._pg) > 1 else _dist.SoloComm()
            self._open_global(path)
        if step is None:
            steps = _amber.global_steps(path)
            step = steps[-1].step + 1 if steps else 0
        self._target = (path, step)

    def _open_global(self, path):
        self._gw = _amber.GlobalWriter(path, self._comm if self._comm.size > 1 else None,
                                       **self._wopts)
        self._sig = None
        self._units = None
        for r in self._rules:
            self._gw.add_policy(r)

    def _stage_global(self, state_dict):
        """stage() with many ranks: see _declare_global."""
        try:
            flat, mappings = flatten_state_dict(state_dict)
            part, err = self._declare_global(flat, mappings), None
        except Exception as e:  # still a vote: the other ranks wait for it
            part, err = ([], {}, {}), e
        self._begin_global(*part, err=err)
        fut = Future()
        self._staged = fut

        def fence():
            try:
                self._fence()
                fut.set_result(state_dict)
            except BaseException as e:
                fut.set_exception(e)
        threading.Thread(target=fence, name="amber-dcp-fence", daemon=True).start()
        return fut

    @staticmethod
    def _declare_global(flat, mappings):
        """This rank's part of a flattened state dict: each DTensor's shard (written by
        the rank at coordinate 0 of the mesh dimensions that replicate it) and plain
        tensors written once, by rank 0. Taken from the state dict, not from DCP's
        plan, so that the declarations stay the same from save to save (the planner
        may move replicated items between ranks) and async and plain saves agree:
        each save is then a delta against the previous one."""
        decl, objects, names = [], {}, {}
        for fqn, v in flat.items():
            name = _name(mappings.get(fqn, (fqn,)))
            names[fqn] = name
            if _at._is_dtensor(v):
                local, gshape, off, lshape, writes, repl = _dist._box(v)
                if writes or repl:
                    decl.append((name, local, gshape, off, lshape, repl, v))
            elif isinstance(v, torch.Tensor):
                decl.append((name, v, tuple(v.shape), (0,) * v.dim(), tuple(v.shape), True))
            else:
                objects[name] = v
        return decl, objects, names

    def _plan_global(self, plan, planner):
        """dcp.save with many ranks: the planner's (flattened) state dict, declared as
        stage() declares it; every item of the plan must be in it."""
        mappings = getattr(planner, "mappings", None) or {}
        state = getattr(planner, "state_dict", None)
        if state is None:
            raise TypeError("amber.dcp.Writer: the planner has no state_dict (a planner "
                            "other than DCP's DefaultSavePlanner?)")
        for item in plan.items:
            if item.index.fqn not in state:
                raise ValueError(f"amber.dcp.Writer: {item.index.fqn}: in the plan, not in the "
                                 "planner's state dict")
        return self._declare_global(state, mappings)

    def _begin_global(self, decl, objects, names, err=None):
        """Declares this rank's shards (a new global writer, on every rank, when any
        rank's changed), sets its metadata and begins the step (collective). `err`:
        this rank could not even list its part; every rank learns of it here."""
        rows, pinned, meta_json, devs, inplace = [], [], None, {}, []
        dt_of = {d[0]: d[6] for d in decl if len(d) > 6}
        try:
            if err is not None:
                raise err
            enc = _at._Flat()
            meta_objects = {}
            for name, v in objects.items():
                e = enc.enc(v, name)
                if enc.tensors:
                    raise TypeError(f"amber.dcp.Writer: {name}: tensors inside a non-tensor value")
                meta_objects[name] = e
            with torch.no_grad():
                for name, t, gshape, off, lshape, repl, *_ in decl:
                    if t.dtype not in _at._DTYPES:
                        raise TypeError(f"{name}: dtype {t.dtype} is not supported by amber")
                    writes = not repl or self._comm.rank == 0
                    src = t
                    if writes:  # a DTensor's ops move its own counter, to_local()'s its local's
                        for x in {id(x): x for x in (t, dt_of.get(name, t))}.values():
                            if not x.is_inference():
                                inplace.append((name, x))
                    if writes and _device.wanted(t):  # selected on its device
                        devs[name] = t
                        rows.append((name, _at._DTYPES[t.dtype], gshape, off, lshape, repl, None))
                        continue
                    if writes and not (t.device.type == "cpu" and t.is_contiguous() and
                                       not t.is_conj() and not t.is_neg()):
                        src = self._bufs.get(name)
                        if src is None or src.shape != t.shape or src.dtype != t.dtype:
                            src = self._bufs[name] = torch.empty(t.shape, dtype=t.dtype)
                        src.copy_(t.resolve_conj().resolve_neg())
                        inplace = [(n, x) for n, x in inplace if n != name]  # a copy
                    pinned.append(src)
                    rows.append((name, _at._DTYPES[t.dtype], gshape, off, lshape, repl,
                                 src.data_ptr() if writes and src.numel() else 0))
            meta = {"format": _FORMAT, "step": self._target[1], "rank": self._comm.rank,
                    "keys": names, "objects": meta_objects}
            meta_json = json.dumps(meta, allow_nan=False, separators=(",", ":"))
        except Exception as e:  # every rank learns of it before any begins
            err = e
        sig = [r[:6] + (r[6] is None,) for r in rows]
        votes = self._comm.gather_objects(  # every rank's readiness, before any begins
            {"err": None if err is None else f"{type(err).__name__}: {err}",
             "reopen": self._sig is None or sig != self._sig, "dev": bool(devs)})
        bad = next((r for r, v in enumerate(votes) if v["err"]), None)
        if bad is not None:
            raise AmberError(_amber.ECANCELED, f"step {self._target[1]} not saved: rank {bad} "
                             f"failed: {votes[bad]['err']}", name="AMBER_ECANCELED") from err
        if any(v["reopen"] for v in votes):
            self._gw.close()
            self._open_global(self._target[0])
            self._gdev = _device.DevicePath()
            for name, dt, gshape, off, lshape, repl, p in rows:
                if p is None:
                    self._gdev.declare(self._gw, name, dt, devs[name], global_shape=gshape,
                                       offsets=off, replicated=repl)
                else:
                    self._gw.add(name, dt, gshape, off, lshape, p, replicated=repl)
            self._sig, self._ptrs = sig, [r[6] for r in rows]
        else:
            for i, r in enumerate(rows):
                if r[6] is not None and r[6] != self._ptrs[i]:
                    self._gw.set_data(i, r[6])
                    self._ptrs[i] = r[6]
        self._gw.set_meta(meta_json)
        if self._has_units:
            units = _units_of([r[0] for r in rows], objects)
            if units != self._units:
                self._gw.set_units(units)
                self._units = units
        self._pinned = pinned
        self._versions = _at._Versions([n for n, _ in inplace], [x for _, x in inplace])
        self._torn = None
        step, flags = self._target[1], _amber.SAVE_CONFIRM
        try:
            if any(v["dev"] for v in votes):  # some rank selects on its device (collective)
                flags, kind = self._gdev.plan_global(self._gw, self._comm, self._target[0],
                                                     step, flags)
                self._gdev.select(self._gw, kind, devs)
            self._gw.begin(step, full=bool(flags & _amber.SAVE_FULL), confirm=True)
        except BaseException:
            if self._gdev is not None:
                self._gdev.rollback()
            raise
        self._begun = (names, meta_objects)

    def _write_data_global(self, plan, planner):
        fut = torch.futures.Future()
        try:
            if self._begun is None:  # dcp.save: this rank's final plan, begun now
                try:
                    part, err = self._plan_global(plan, planner), None
                except Exception as e:  # still a vote: the other ranks wait for it
                    part, err = ([], {}, {}), e
                self._begin_global(*part, err=err)
            names, _ = self._begun
            if self._staged is not None:
                self._staged.result()
            else:
                self._fence()
            results = []
            for item in plan.items:
                size = 0
                if item.type != WriteItemType.BYTE_IO:
                    size = item.tensor_data.chunk.sizes.numel() * \
                        item.tensor_data.properties.dtype.itemsize
                results.append(WriteResult(index=item.index, size_in_bytes=size,
                                           storage_data=names.get(item.index.fqn)))
            self._gw.confirm(self._torn is None, self._torn or "")
            self._begun = self._staged = None
            if self._gdev is not None:  # the device references move with the outcome
                self._gdev.settle(self._gw.wait)  # the global commit: collective
            else:
                self._gw.wait()
            fut.set_result(results)
        except BaseException as e:
            self._abort()
            fut.set_exception(e)
        return fut


class _Boxless:
    """A reader with no tensors, for decoding plain values with amber.torch's _Load."""

    def tensors(self):
        return []


class _Ref:
    """A tensor of the store, by name, in a state dict rebuilt from metadata."""
    __slots__ = ("name",)

    def __init__(self, name):
        self.name = name


class _Refs(_at._Load):
    """Decodes amber.torch's metadata with each tensor left as a _Ref."""

    def __init__(self, step):
        super().__init__(_Boxless(), True, step)

    def tensor(self, name, target=None, device=None):
        if not isinstance(name, str):
            self.bad(name, "a tensor reference that is not a name")
        return _Ref(name)


def _checkpointer_view(meta, step):
    """A store written by amber.torch's Checkpointer (one or many ranks) as amber.dcp
    metadata, {"keys": {DCP key: name}, "objects": {name: encoded value}}: each entry
    rebuilt as the state dict DCP users pass (a module's {FQN: tensor}, an
    optimizer's {"state": {FQN: {...}}, "param_groups": [...]} as get_state_dict
    gives them, an object's state_dict, a value) and flattened as DCP flattens it."""
    entries = meta.get("entries")
    if not isinstance(entries, dict):
        raise _at._format_error(step, "entries", "not a dict")
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
    keys, objects, enc = {}, {}, _at._Flat()
    for fqn, v in flat.items():
        if isinstance(v, _Ref):
            keys[fqn] = v.name
            continue
        name = "dcp:" + _name(mappings.get(fqn, (fqn,)))  # apart from the tensors' names
        try:
            objects[name] = enc.enc(v, name)
        except TypeError:
            raise AmberError(_amber.EFORMAT, f"step {step}: {fqn}: a value holding tensors, "
                             "which DCP's flattening keeps whole", name="AMBER_EFORMAT") from None
        keys[fqn] = name
    return {"keys": keys, "objects": objects}


class Reader(StorageReader):
    """DCP StorageReader of an amber store: checkpoint_id "STORE/step-N" or "STORE"
    (latest). Reads each requested region after every checksum of the tensors it
    needs has been checked, so a damaged step raises before the live state changes."""

    def __init__(self, checkpoint_id=None):
        super().__init__()
        self._id = None if checkpoint_id is None else os.fspath(checkpoint_id)
        self._path = self._step = None
        self._meta = None

    def reset(self, checkpoint_id=None):
        cid = self._id if checkpoint_id is None else os.fspath(checkpoint_id)
        path, step = parse_checkpoint_id(cid)
        if not os.path.isdir(path):
            raise FileNotFoundError(f"amber.dcp.Reader: no amber store at {path!r} "
                                    f"(checkpoint_id {cid!r})")
        self._path, self._step, self._meta = path, step, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return Writer.validate_checkpoint_id(checkpoint_id)

    def _reader(self, store):
        if self._step is None and store.latest() is None:
            raise FileNotFoundError(f"amber.dcp.Reader: the store {self._path!r} holds no "
                                    "checkpoint")
        return store.reader(self._step)

    def read_metadata(self, *args, **kwargs):
        if self._path is None:
            self.reset()
        if _amber.is_global_store(self._path):
            return self._read_metadata_global()
        with Store(self._path, readonly=True, create=False) as st, self._reader(st) as r:
            self._step = r.step
            meta = _at._parse_meta(r.meta(), f"step {r.step} of {self._path}")
            if isinstance(meta, dict) and meta.get("format") == _at._FORMAT:
                meta = _checkpointer_view(meta, r.step)
            elif not isinstance(meta, dict) or meta.get("format") != _FORMAT or \
                    not isinstance(meta.get("keys"), dict) or \
                    not isinstance(meta.get("objects"), dict):
                raise AmberError(_amber.EFORMAT, f"step {r.step} of {self._path} was not "
                                 "written by amber.dcp or amber.torch (no amber metadata)",
                                 name="AMBER_EFORMAT")
            infos = {i.name: i for i in r.tensors()}
            sd_meta, storage = {}, {}
            for fqn, name in meta["keys"].items():
                if name in meta["objects"]:
                    sd_meta[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = name
                    continue
                info = infos.get(name)
                if info is None:
                    raise AmberError(_amber.EFORMAT, f"step {r.step} of {self._path}: "
                                     f"tensor {name!r} of {fqn!r} is missing",
                                     name="AMBER_EFORMAT")
                dt = _at._TORCH.get(info.dtype)
                size = torch.Size(info.shape)
                zero = torch.Size([0] * len(size))
                sd_meta[fqn] = TensorStorageMetadata(
                    TensorProperties(dtype=dt), size, [ChunkStorageMetadata(zero, size)])
                storage[MetadataIndex(fqn, zero)] = name
        self._meta = meta
        return Metadata(state_dict_metadata=sd_meta, storage_data=storage)

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def _read_metadata_global(self):
        """Metadata of a step written by many ranks: the union of the ranks' keys and
        values; each tensor is offered as one chunk, its global shape, so that the
        planner asks for any region and read_data serves it from the shards."""
        if self._step is None and not _amber.global_steps(self._path):
            raise FileNotFoundError(f"amber.dcp.Reader: the store {self._path!r} holds no "
                                    "checkpoint")
        with _amber.GlobalReader(self._path, self._step) as g:
            self._step = g.step
            keys, objects = {}, {}
            for r in range(g.world_size):
                raw = g.meta(r)
                if raw is None:
                    continue
                m = _at._parse_meta(raw, f"global step {g.step} of {self._path}, rank {r}")
                if isinstance(m, dict) and m.get("format") == _dist._FORMAT:
                    if r == 0:  # the Checkpointer's entries: the same on every rank
                        m = _checkpointer_view(m, g.step)
                        keys.update(m["keys"])
                        objects.update(m["objects"])
                    continue
                if not isinstance(m, dict) or m.get("format") != _FORMAT or \
                        not isinstance(m.get("keys"), dict) or \
                        not isinstance(m.get("objects"), dict):
                    raise AmberError(_amber.EFORMAT, f"step {g.step} of {self._path}: rank {r} "
                                     "was not written by amber.dcp (no amber.dcp metadata)",
                                     name="AMBER_EFORMAT")
                keys.update(m["keys"])
                objects.update(m["objects"])
            infos = {i.name: i for i in g.tensors()}
            sd_meta, storage = {}, {}
            for fqn, name in keys.items():
                if name in objects:
                    sd_meta[fqn] = BytesStorageMetadata()
                    storage[MetadataIndex(fqn)] = name
                    continue
                info = infos.get(name)
                if info is None or info.dtype not in _at._TORCH:
                    raise AmberError(_amber.EFORMAT, f"step {g.step} of {self._path}: tensor "
                                     f"{name!r} of {fqn!r} is missing", name="AMBER_EFORMAT")
                size = torch.Size(info.shape)
                zero = torch.Size([0] * len(size))
                sd_meta[fqn] = TensorStorageMetadata(TensorProperties(dtype=_at._TORCH[info.dtype]),
                                                     size, [ChunkStorageMetadata(zero, size)])
                storage[MetadataIndex(fqn, zero)] = name
        self._meta = {"keys": keys, "objects": objects, "global": True}
        return Metadata(state_dict_metadata=sd_meta, storage_data=storage)

    def _read_global(self, plan):
        """Every region the plan asks for, read from the shards that overlap it (every
        checksum checked) before anything live changes; then the values."""
        regions, values, items = {}, {}, []
        with _amber.GlobalReader(self._path, self._step) as g:
            for req in plan.items:
                name = self._storage[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    continue
                i = g.find(name)
                if i is None:
                    raise AmberError(_amber.EFORMAT, f"step {g.step} of {self._path}: no "
                                     f"tensor {name!r}", name="AMBER_EFORMAT")
                info = g.tensors()[i]
                t = torch.empty(tuple(req.lengths), dtype=_at._TORCH[info.dtype])
                items.append((i, tuple(req.storage_offsets), tuple(req.lengths),
                              t.data_ptr() if t.numel() else 0, t.numel() * t.element_size()))
                regions[id(req)] = t
            g.read_many(items)  # every region at once: all their chunks in parallel
            ld = _at._Load(_Boxless(), True, g.step)
            objects = self._meta["objects"]
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    name = self._storage[req.storage_index]
                    if name not in objects:
                        raise AmberError(_amber.EFORMAT, f"step {g.step}: no value {name!r}",
                                         name="AMBER_EFORMAT")
                    values[name] = ld.dec(objects[name], name)
        return regions, values

    def read_data(self, plan, planner):
        if self._meta is None:
            self.read_metadata()
        if self._meta.get("global"):
            regions, values = self._read_global(plan)
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    buf = io.BytesIO()
                    torch.save(values[self._storage[req.storage_index]], buf)  # in memory only
                    buf.seek(0)
                    planner.load_bytes(req, buf)
                    continue
                dst = planner.resolve_tensor(req).detach()
                dst.copy_(regions[id(req)])
                planner.commit_tensor(req, dst)
            fut = torch.futures.Future()
            fut.set_result(None)
            return fut
        objects = self._meta["objects"]
        with Store(self._path, readonly=True, create=False) as st, st.reader(self._step) as r:
            # everything first (checksums checked), then into the live state: each
            # region the plan asks for, read out of its tensor (only the chunks that
            # hold part of it), all in one call
            loaded, jobs = {}, []
            for req in plan.items:
                name = self._storage[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    continue
                i = r.find(name)
                if i is None:
                    raise AmberError(_amber.EFORMAT, f"step {r.step} of {self._path}: no "
                                     f"tensor {name!r}", name="AMBER_EFORMAT")
                info = r.info(i)
                t = torch.empty(tuple(req.lengths), dtype=_at._TORCH[info.dtype])
                loaded[id(req)] = t
                jobs.append((i, tuple(req.storage_offsets), tuple(req.lengths),
                             t.data_ptr() if t.numel() else 0, t.numel() * t.element_size()))
            r.read_boxes(jobs)
            ld = _at._Load(r, True, r.step)
            values = {}
            for req in plan.items:
                if req.type == LoadItemType.BYTE_IO:
                    name = self._storage[req.storage_index]
                    if name not in objects:
                        raise AmberError(_amber.EFORMAT, f"step {r.step}: no value {name!r}",
                                         name="AMBER_EFORMAT")
                    values[name] = ld.dec(objects[name], name)
        for req in plan.items:
            name = self._storage[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(values[name], buf)  # in memory only: what load_bytes expects
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            dst = planner.resolve_tensor(req).detach()
            dst.copy_(loaded[id(req)])
            planner.commit_tensor(req, dst)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut
