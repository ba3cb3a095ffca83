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

The Writer is long-lived, like amber.torch's Checkpointer, and runs the same save
pipeline (amber.torch._save: the capture rule, the vote, the declarations, the
device path, the commit): it keeps its reference state between saves, so each DCP
save is a full or a delta checkpoint under the same policies, presets ("exact",
"lossy", "lossy-frequent", "lossy-compact", "lossy-capped") and cadence
(full_every, full_share). Tensors are named by their path in the state dict, joined
by "/" (an optimizer state from get_state_dict is "optim/state/<FQN>/exp_avg"), so
the Checkpointer's patterns such as "*/exp_avg_sq" apply; optimizer step counters
stay exact.

What is stored: one amber tensor per write item that DCP's planner makes of the state
dict (a plain tensor whole, each local shard of a DTensor or a ShardedTensor, any
tensor of DCP's checkpointable protocol), with the data the planner's resolve_data
gives (dcp.save; dcp.async_save reads the staged state dict as DCP's default planner
would); in the checkpoint's JSON metadata (amber.dcp/1, amber.torch._meta) which DCP
key each item is, its path in the nested state dict (DCP's planner_data, so that
DCP's loaders rebuild nested state dicts), and the non-tensor values that are plain
data (numbers, strings, None, lists, tuples, dicts, dtypes, small numpy arrays),
encoded as amber.torch encodes them. Any other value (bytes, a BytesIO, an object) is
stored as the bytes DCP's planner makes of it (its torch.save), exactly and
checksummed, as a u8 tensor, by rank 0 of many (DCP keeps one rank's value of a key):
amber itself never pickles or unpickles; dcp.load hands the bytes back to DCP's
planner, which does, and amber.torch's Checkpointer refuses such a value. DCP's
Metadata is rebuilt from that JSON and the store's tensor table on load.

Commit: a save is written and made durable, but becomes visible only in finish(),
DCP's last step; a save that fails anywhere before makes nothing visible.

Async saves (dcp.async_save, thread-based): the Writer is DCP's AsyncStager.
stage() starts amber's scan of the live tensors (large contiguous CPU tensors are
read in place, as the Checkpointer reads them) and returns a Future that completes at
amber's fence, when the scan no longer reads them; async_save's `staging_completion`
is that Future. Do not change the tensors before it completes: the Writer fences by
itself before the step of any torch.optim optimizer, and checks the version counters
of the tensors it reads in place at the fence; a tensor changed in place before then
makes the step fail uncommitted with AMBER_ECHANGED (raised by upload_completion),
never commit torn. The upload (encode, write, commit) runs in DCP's thread.
AsyncCheckpointerType.PROCESS is refused: it pickles the Writer, whose reference
cannot cross processes.

Many ranks: under a process group of more than one rank (Writer(process_group=...),
default the world) the store is a multi-rank store (amber's global writer): each
rank writes its DTensor shards and rank 0 the replicated items, in its own files,
and the step commits on every rank at the end of write_data, through amber's
collectives on a gloo group of the Writer's own (DCP calls finish() on the
coordinator alone, so the collective commit cannot wait for it). The Reader offers
each global tensor as one chunk, so DCP's planner asks for any region at any world
size, and serves it from the shards that overlap it.
"""

import io
import logging
import os
import re
import sys
import threading
import time
from concurrent.futures import Future
from contextlib import ExitStack, contextmanager

import torch
import torch.distributed as dist
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._sharded_tensor_utils import _flatten_sharded_tensors
from torch.distributed.checkpoint.default_planner import (DefaultSavePlanner,
                                                          create_default_local_save_plan)
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex,
    TensorProperties, TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.checkpoint.utils import find_state_dict_object

import amber as _amber
from amber import AmberError
from amber.torch import _comm, _dtypes, _meta
from amber.torch._capture import FenceHooks, Versions
from amber.torch._naming import box, is_dtensor
from amber.torch._options import Options
from amber.torch._save import Saver, in_place_names
from amber.torch._sink import GlobalSink, StoreSink
from amber.torch._source import GlobalSource, TieredStep, holds, latest_of, source_for
from amber.torch._tiers import RankTiers, TierOptions, Tiers, pick
from amber.torch._values import Decoder, Encoder

__all__ = ["Writer", "Reader", "parse_checkpoint_id"]

log = logging.getLogger("amber.dcp")
_STEP = re.compile(r"^step-(\d+)$")
_STEP_RULE = "*/state/*/step=exact"  # optimizer step counters ("optim/state/<FQN>/step")
_TORN_ADVICE = ("; wait on async_save's staging_completion before changing the state "
                "(an optimizer.step() waits by itself)")


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


def _check_async_planner(planner):
    """An asynchronous save is staged (read, then released to training at amber's
    fence) before DCP plans it, so what it writes is what DCP's default planner
    resolves: a planner that resolves or transforms data otherwise is refused, rather
    than have its decisions silently ignored (dcp.save follows them)."""
    kind = type(planner)
    for name in ("resolve_data", "transform_object"):
        if getattr(kind, name, None) is not getattr(DefaultSavePlanner, name):
            raise NotImplementedError(
                f"amber.dcp.Writer: dcp.async_save with a planner that overrides {name} "
                f"({kind.__name__}): the asynchronous save stages the state dict before DCP "
                "plans it, as DCP's default planner resolves it; use dcp.save for this "
                "planner, or async_save with a planner that resolves data as the default "
                "one does")


class Writer(StorageWriter, AsyncStager):
    """DCP StorageWriter (and AsyncStager) into an amber store.

    Writer(checkpoint_id=None, policy=None, full_every=None, full_share=None,
           threads=0, chunk_elems=0, process_group=None, overwrite=True, memory=None,
           memory_budget=None, max_lag=None, max_lag_bytes=None)
      policy, full_every, full_share, threads, chunk_elems: as for
      amber.torch.Checkpointer ("exact" by default, "lossy", rules...).
      checkpoint_id: the default id ("STORE" or "STORE/step-N"), used by every save
              that DCP gives no checkpoint_id= (DCP's overrides it for that save).
      overwrite: False makes a save to "STORE/step-N" whose step N is committed
              raise FileExistsError before anything is written (DCP's
              FileSystemWriter(overwrite=False)). amber's committed steps are
              immutable, so with True such a save raises too, with a message that
              says so; "STORE" always names the next step.
      process_group: the ranks that save together, the group given to dcp.save
              (default: the world); with more than one rank the store is a
              multi-rank store (see the module's documentation). Every rank
              makes its Writer, and the first save is collective (it makes the
              Writer's gloo group).
      memory, memory_budget, max_lag, max_lag_bytes: a memory tier, as for
              amber.torch.Checkpointer: every save goes to the directory `memory`
              (on /dev/shm), and the library drains each committed step to the
              store in the background; close() waits until the store holds them.
              Read it back with Reader(checkpoint_id, memory=...).
    Keep one Writer for the run and close() it at the end (it holds the store's
    lock while open; with many ranks close() completes a staged save, which is
    collective). Not thread-safe beyond what DCP does with it."""

    _synchronize_after_execute = False  # staging completes with stage()'s Future

    def __init__(self, checkpoint_id=None, policy=None, full_every=None, full_share=None,
                 threads=0, chunk_elems=0, process_group=None, overwrite=True, memory=None,
                 memory_budget=None, max_lag=None, max_lag_bytes=None):
        super().__init__()
        # the memory tier (amber.torch.Checkpointer's memory=...): checked now when the
        # store is known, else at the first save
        self._tier_args = dict(memory=memory, memory_budget=memory_budget, max_lag=max_lag,
                               max_lag_bytes=max_lag_bytes)
        if checkpoint_id is not None and any(v is not None for v in self._tier_args.values()):
            TierOptions.make(parse_checkpoint_id(checkpoint_id)[0], **self._tier_args)
        self._tier_store = None  # the durable store the memory tier drains to
        self._pg = process_group
        self._overwrite = bool(overwrite)
        self._ready = False   # reset() ran for the save in progress
        self._options = Options.make(policy, full_every, full_share, threads=threads,
                                     chunk_elems=chunk_elems)
        self._comm = None     # amber's collectives, on a gloo group of its own (many ranks)
        self._saver = None    # the save pipeline over the store of the save in progress
        self._id = None if checkpoint_id is None else os.fspath(checkpoint_id)
        self._path = None     # the store the saver writes (as named: a path or an s3:// URL)
        self._target = None   # (store path, step) of the save in progress
        self._begun = None    # ({fqn: name}, objects) of a save whose scan has started
        self._staged = None   # Future of the fence of a staged save
        self._hooks = FenceHooks(self, Writer.fence, lambda w: w._staged is not None)
        if self._id is not None:
            parse_checkpoint_id(self._id)

    # -- the store and its saver --
    def _use(self, path, many):
        """The saver of the store at `path` (a multi-rank store when `many`); with
        memory=, or for an s3:// store (through its staging directory, drained at each
        commit), the sink writes a memory tier that drains to `path`."""
        if self._saver is not None and self._path == path and self._saver.sink.dist == many:
            return
        self._drop()
        opts = self._options
        if self._tier_args["memory"] is not None:
            if self._tier_store not in (None, path):
                raise ValueError(f"amber.dcp.Writer: its memory tier drains to {self._tier_store}"
                                 f", not {path}: one Writer with memory= saves to one store")
            self._tier_store = path
        tiers = TierOptions.make(path, **self._tier_args)  # None: a directory, written directly
        where = tiers.memory if tiers is not None else path
        if many:
            if self._comm is None:
                # a gloo group of amber's own: async saves commit from DCP's thread while
                # training uses the job's groups on its own (collective, every rank)
                self._comm = _comm.comm_for(self._pg, own=True) if _world(self._pg) > 1 \
                    else _comm.SoloComm()
            # with a memory tier (or an s3:// store's staging directory) each rank's part
            # goes to its host's directory, a local-mode global store (as the
            # Checkpointer's), drained by each rank (rank 0 also the manifests, GLOBAL)
            sink = GlobalSink(where, opts.writer, opts.rules, self._comm,
                              local=tiers is not None)
        else:
            sink = StoreSink(where, opts.writer, opts.rules, threads=opts.threads)
        if tiers is not None:
            try:
                sink.tiers = RankTiers(tiers, path, self._comm) if many and not tiers.staging \
                    else Tiers(tiers, path, rank=self._comm.rank if many else -1)
            except BaseException:
                sink.close()
                raise
        self._path = path
        self._saver = Saver(sink, self._comm or _comm.SoloComm(), opts, confirm_at_fence=False)

    def _drop(self, flush=False):
        if self._saver is not None:
            saver, self._saver = self._saver, None
            try:
                if flush:
                    saver.sink.close_tiers(flush=True)
            finally:
                saver.close()

    def close(self):
        """Releases the store (a save in progress that was not finished is dropped,
        uncommitted). With memory=, first waits until the durable store holds every
        committed step (raising the drain's failure)."""
        self._abort()
        self._drop(flush=True)
        hooks = getattr(self, "_hooks", None)
        if hooks is not None:
            hooks.remove()

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
        if cid is None:
            raise ValueError("amber.dcp.Writer needs a checkpoint_id: Writer(\"STORE\") or "
                             "dcp.save(..., checkpoint_id=\"STORE/step-N\")")
        path, step = parse_checkpoint_id(cid)
        # many ranks; or one process saving into a store that many ranks wrote (a step
        # of world size 1, which every world size loads)
        many = _world(self._pg) > 1 or _amber.is_global_store(path)
        path = path if _amber.is_url(path) else os.path.abspath(path)
        if self._begun is not None:
            if self._target[0] != path or (step is not None and step != self._target[1]):
                self._abort()
                raise ValueError(f"amber.dcp.Writer: the staged save is {self._target}, "
                                 f"not {cid!r}")
            return
        self._use(path, many)
        latest = self._saver.sink.latest()
        if step is None:
            step = 0 if latest is None else latest + 1
        elif latest is not None and step <= latest:
            taken = any(s.step == step for s in self._saver.sink.steps())
            if taken and not self._overwrite:
                raise FileExistsError(f"amber.dcp.Writer: checkpoint {cid!r} exists and "
                                      "overwrite=False")
            raise FileExistsError(
                f"amber.dcp.Writer: checkpoint {cid!r}: step {step} is "
                f"{'committed' if taken else 'below'} the store's latest step {latest}, and "
                "amber's committed steps are immutable (a later step can only follow the "
                "latest; overwrite cannot replace one): save to a later step, or to "
                f"checkpoint_id={path!r} for the next one")
        self._target = (path, step)
        self._ready = True

    def set_up_storage_writer(self, is_coordinator, *args, **kwargs):
        # dcp.save calls reset() only when it is given a checkpoint_id: every other save
        # goes to the Writer's own id, the next step of its store for "STORE"
        if not self._ready:
            self.reset()

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
        fut = torch.futures.Future()
        try:
            if self._begun is None:  # dcp.save: the planner's state dict, begun now
                state = getattr(planner, "state_dict", None)
                if state is None:
                    raise TypeError("amber.dcp.Writer: the planner has no state_dict (a "
                                    "planner other than DCP's DefaultSavePlanner?)")
                self._begin_items(state, getattr(planner, "mappings", None) or {},
                                  planner.resolve_data)
            else:  # dcp.async_save: staged before DCP planned, as its default planner resolves
                _check_async_planner(planner)
            names, _ = self._begun
            self._check_plan(plan)
            if self._staged is not None:
                self._staged.result()
            else:
                self._saver.fence("the save began", _TORN_ADVICE)
            results = []
            for item in plan.items:
                fqn = item.index.fqn
                size = 0
                if item.type != WriteItemType.BYTE_IO:
                    size = item.tensor_data.chunk.sizes.numel() * \
                        item.tensor_data.properties.dtype.itemsize
                results.append(WriteResult(index=item.index, size_in_bytes=size,
                                           storage_data=names[fqn]))
            if self._saver.sink.dist:  # the global commit: collective, here on every rank
                self._saver.verdict()
                self._begun = self._staged = None
                self._ready = False
                self._saver.wait()
            fut.set_result(results)
        except BaseException as e:
            self._abort()
            fut.set_exception(e)
        return fut

    def finish(self, metadata, results):
        """The commit point: the step becomes visible here, or nothing does. (With
        many ranks the global commit is collective and DCP calls finish() on the
        coordinator alone: the step commits at the end of write_data on every rank.)"""
        if self._saver is not None and self._saver.sink.dist:
            return
        if self._begun is None:
            raise RuntimeError("amber.dcp.Writer.finish: no save in progress")
        try:
            self._saver.verdict()
            self._saver.wait()
        except BaseException:
            self._abort()
            raise
        log.debug("step %d of %s committed", self._target[1], self._target[0])
        self._begun = self._staged = None
        self._ready = False

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
        flat, mappings = flatten_state_dict(state_dict)
        flat = _flatten_sharded_tensors(flat)

        def resolve(item):  # what DCP's default planner resolves, read at staging
            obj = find_state_dict_object(flat, item.index)
            if item.type != WriteItemType.BYTE_IO:
                return obj
            buf = io.BytesIO()
            torch.save(obj, buf)  # DCP's own serialization of a value (no amber pickle)
            return buf
        self._begin_items(flat, mappings, resolve)
        fut = Future()
        self._staged = fut

        def fence():
            try:
                self._saver.fence("the save began", _TORN_ADVICE)
                fut.set_result(state_dict)
            except BaseException as e:
                fut.set_exception(e)
        threading.Thread(target=fence, name="amber-dcp-fence", daemon=True).start()
        return fut

    def synchronize_staging(self):
        if self._staged is not None:
            self._staged.result()

    # -- the save --
    def _begin_items(self, flat, mappings, resolve):
        """Begins the save of a DCP state dict (flattened, with DCP's `mappings`) through
        the shared pipeline: one declaration per write item that DCP's planner makes of
        it (create_default_local_save_plan: a plain tensor whole, a DTensor's or a
        ShardedTensor's local shards, any tensor that implements DCP's checkpointable
        protocol), its data as `resolve` (the planner's resolve_data) gives it. A plain
        tensor, and a fully replicated DTensor, is written by rank 0 of many; a value
        that is plain data goes into the metadata as JSON, any other value as the bytes
        DCP's planner makes of it (rank 0's), a u8 tensor. A failure here is this
        rank's vote: with many ranks every rank learns of it before any begins."""
        sv = self._saver
        step = self._target[1]
        err = items = text = None
        names, paths, encoded, pickled = {}, {}, {}, []
        try:
            tensors, enc = [], Encoder()
            for wi in create_default_local_save_plan(flat, True).items:
                fqn = wi.index.fqn
                path = tuple(mappings.get(fqn, (fqn,)))
                name = _name(path)
                names[fqn], paths[fqn] = name, list(path)
                if wi.type == WriteItemType.BYTE_IO:
                    try:
                        encoded[name] = enc.enc(flat[fqn], name)  # plain data: JSON
                    except TypeError:
                        pickled.append(name)
                        if sv.rank == 0:  # DCP keeps one rank's bytes of a value
                            data = resolve(wi).getvalue()
                            t = torch.frombuffer(bytearray(data), dtype=torch.uint8) \
                                if data else torch.empty(0, dtype=torch.uint8)
                            tensors.append((name, t, (t, (t.numel(),), (0,), (t.numel(),),
                                                      True, False)))
                    continue
                tensors.append((name, flat[fqn], self._box_of(wi, flat[fqn], resolve(wi))))
            if not sv.sink.dist:
                tensors = self._whole(tensors)
            items = [it for it in sv.items(tensors) if it is not None]
            meta = {"format": _meta.DCP, "step": step, "keys": names, "objects": encoded,
                    "paths": paths, "bytes": pickled}
            if sv.sink.dist:
                meta["rank"] = sv.rank
            text = _meta.dumps(meta)
        except Exception as e:
            err = e
        sv.declare(step, items, err, (_STEP_RULE,))
        sv.sink.set_meta(text)
        if self._options.has_units:
            sv.set_units(_units_of([it.decl.name for it in items], encoded))
        vnames, vtensors = in_place_names(items)
        sv.begin(step, False, Versions(vnames, vtensors),
                 [it.source for it in items if it.source is not None],
                 any(it.in_place for it in items),
                 {it.decl.name: it.local for it in items if it.decl.on_device}, gate=True)
        self._begun = (names, encoded)

    def _box_of(self, wi, obj, t):
        """(tensor read, global shape, offsets, local shape, writes, replicated) of
        write item `wi` of value `obj`, whose data is `t`."""
        td = wi.tensor_data
        gshape, off, lshape = tuple(td.size), tuple(td.chunk.offsets), tuple(td.chunk.sizes)
        many = self._saver.sink.dist
        if wi.type == WriteItemType.TENSOR:  # a plain tensor: the same on every rank
            return t, gshape, off, lshape, True, many
        if is_dtensor(obj):  # its replicas of a shard: the rank at coordinate 0 writes it
            _, _, _, _, writes, repl = box(obj)
            if repl:
                return t, gshape, off, lshape, True, many
        else:
            writes = True
        return t, gshape, off, lshape, writes, False

    def _whole(self, tensors):
        """A store of one process holds whole tensors: the local shards of one tensor
        (a wrapper of several, as LocalShardsWrapper) are assembled into a staging
        buffer of the whole, when they tile it; else the save is refused."""
        by, out = {}, []
        for name, obj, at in tensors:
            if not any(at[2]) and tuple(at[3]) == tuple(at[1]):
                out.append((name, obj, at))
            else:
                by.setdefault(name, []).append(at)
        for name, parts in by.items():
            gshape, dtype = tuple(parts[0][1]), parts[0][0].dtype
            volume = 1
            for d in gshape:
                volume *= d
            if sum(p[0].numel() for p in parts) != volume or \
                    any(p[0].dtype != dtype or tuple(p[1]) != gshape for p in parts):
                raise NotImplementedError(
                    f"amber.dcp.Writer: {name}: shards that do not make up the whole tensor "
                    f"{list(gshape)} in a store of one process, which holds whole tensors: save "
                    "under a process group, or into a multi-rank store")
            buf = self._saver.stage.bufs.get(name)
            if buf is None or tuple(buf.shape) != gshape or buf.dtype != dtype:
                buf = self._saver.stage.bufs[name] = torch.empty(gshape, dtype=dtype)
            with torch.no_grad():
                for t, _, off, lshape, _, _ in parts:
                    buf[tuple(slice(o, o + n) for o, n in zip(off, lshape))].copy_(t)
            out.append((name, buf, (buf, gshape, (0,) * len(gshape), gshape, True, False)))
        return out

    def _check_plan(self, plan):
        """DCP's final plan asks this rank to write only what it declared (a planner
        that adds items of its own cannot have them written by amber)."""
        names = self._begun[0]
        for item in plan.items:
            if item.index.fqn not in names:
                raise ValueError(f"amber.dcp.Writer: {item.index.fqn}: in DCP's plan, not in "
                                 "the state dict amber staged")

    def _abort(self):
        """Drops the save in progress uncommitted."""
        self._ready = False
        if self._begun is None:
            return
        self._begun = None
        staged, self._staged = self._staged, None
        if staged is not None:
            try:
                staged.result()
            except BaseException:
                pass
        self._saver.abort("the DCP save failed before finish()")


def _pickled(meta):
    b = meta.get("bytes") if isinstance(meta, dict) else None
    return [n for n in b if isinstance(n, str)] if isinstance(b, list) else []


class Reader(StorageReader):
    """DCP StorageReader of an amber store: checkpoint_id "STORE/step-N" or "STORE"
    (latest). Reads each requested region after every checksum of the tensors it
    needs has been checked, so a damaged step raises before the live state changes.

    Reader(checkpoint_id=None, memory=None, process_group=None): with `memory`, the
    memory tier that a Writer(memory=...) saved to: each load reads the fastest tier
    that holds the step (for "STORE", the newest step of either; the memory tier on a
    tie); `served_by` then names it. With many ranks (a multi-rank store) the ranks of
    `process_group` (default: the world) agree on the step in read_metadata (the
    newest that every rank can read from its host's memory tier or the durable tier;
    one all_gather), each rank reads it from its host's memory tier, and what that
    lacks (the files of another host's ranks) from the durable tier: `served_by` is
    then "memory", "durable" or "memory+durable"."""

    def __init__(self, checkpoint_id=None, memory=None, process_group=None):
        super().__init__()
        self._id = None if checkpoint_id is None else os.fspath(checkpoint_id)
        self._memory = None if memory is None else os.path.abspath(os.fspath(memory))
        self._pg = process_group
        self.served_by = None  # the tier the last read_metadata chose ("memory", "durable")
        self._path = self._step = None
        self._meta = None  # {"keys", "objects", "pickled"} of the step being read
        self._tiers = None  # [(tier, path)] of a multi-rank step, fastest first
        self._durable = None  # the durable store of a multi-rank memory tier
        self._comm = None     # its ranks' communicator (read_metadata's one all_gather)

    def reset(self, checkpoint_id=None):
        cid = self._id if checkpoint_id is None else os.fspath(checkpoint_id)
        if cid is None:
            raise ValueError("amber.dcp.Writer needs a checkpoint_id: Writer(\"STORE\") or "
                             "dcp.save(..., checkpoint_id=\"STORE/step-N\")")
        path, step = parse_checkpoint_id(cid)
        self.served_by = None
        self._tiers = self._durable = None
        if self._memory is not None and (_amber.is_global_store(self._memory) or
                                         _amber.is_global_store(path)):
            # a multi-rank store: the ranks agree on the step in read_metadata
            self._durable = path if _amber.is_url(path) else os.path.abspath(path)
            self._path, self._step, self._meta = self._memory, step, None
            return
        if self._memory is not None and not _amber.is_global_store(path):
            # the fastest tier that holds the step (the newest of either for "STORE")
            for tier, where in pick(self._memory, path if _amber.is_url(path) else os.path.abspath(path),
                                    latest_of(self._memory), step):
                if holds(where, step):
                    path, self.served_by = where, tier
                    break
        if not _amber.is_url(path) and not os.path.isdir(path):
            raise FileNotFoundError(f"amber.dcp.Reader: no amber store at {path!r} "
                                    f"(checkpoint_id {cid!r})")
        self._path, self._step, self._meta = path, step, None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id):
        return Writer.validate_checkpoint_id(checkpoint_id)

    def _empty(self):
        return FileNotFoundError(f"amber.dcp.Reader: the store {self._path!r} holds no "
                                 "checkpoint")

    def _source(self):
        if not _amber.is_url(self._path) and not _amber.is_global_store(self._path) and \
                not os.path.exists(os.path.join(self._path, "LATEST")):
            raise self._empty()  # a directory without a store yet
        return source_for(self._path)

    def _agree(self):
        """The multi-rank step to read with a memory tier (see the class): every rank's
        readable steps (its host's memory tier's and the durable tier's) exchanged, the
        newest common one (or the one asked for) taken, and where this rank reads it."""
        mine = err = None
        try:
            mem = {g.step for g in _amber.global_steps(self._memory)} \
                if _amber.is_global_store(self._memory) else set()
            dur = {g.step for g in _amber.global_steps(self._durable)} \
                if _amber.is_global_store(self._durable) else set()
            mine = sorted(mem | dur)
        except AmberError as e:
            err = str(e)
        if self._comm is None:  # a gloo group made once (collective: every rank is here)
            self._comm = _comm.comm_for(self._pg)
        comm = self._comm
        got = comm.gather_objects([mine, err]) if comm.size > 1 else [[mine, err]]
        bad = next(((r, e) for r, (_, e) in enumerate(got) if e), None)
        if bad:
            raise AmberError(_amber.EIO, f"amber.dcp.Reader: rank {bad[0]}: {bad[1]}",
                             name="AMBER_EIO")
        common = set.intersection(*(set(m) for m, _ in got))
        step = self._step if self._step is not None else max(common, default=None)
        if step is None or step not in common:
            what = "no global step" if step is None else f"global step {step} is not one"
            raise FileNotFoundError(f"amber.dcp.Reader: {what} that every rank can read from "
                                    f"its memory tier ({self._memory}) or the durable tier "
                                    f"({self._durable})")
        self._step = step
        self._tiers = [(t, p) for t, p, have in (("memory", self._memory, mem),
                                                 ("durable", self._durable, dur))
                       if step in have]
        self.served_by = self._tiers[0][0]
        self._used = []

    @contextmanager
    def _open_step(self):
        """The step being read: a Step of its store, or with a memory tier at many ranks
        a TieredStep over the tiers that hold it."""
        if self._tiers is None:
            with self._source().step(self._step) as s:
                yield s
            return
        with ExitStack() as stack:
            steps = [stack.enter_context(GlobalSource(p).step(self._step))
                     for _, p in self._tiers]
            try:
                yield TieredStep(steps, [t for t, _ in self._tiers], self._used)
            finally:
                # every tier that served this step's reads so far, fastest first
                self.served_by = "+".join(t for t, _ in self._tiers if t in self._used) \
                    or self._tiers[0][0]

    def read_metadata(self, *args, **kwargs):
        if self._path is None:
            self.reset()
        if self._durable is not None:
            self._agree()
        else:
            source = self._source()
            if self._step is None and source.empty():
                raise self._empty()
        with self._open_step() as s:
            self._step = s.step
            keys, objects, paths, pickled = {}, {}, {}, []
            for r in range(s.world):
                where = s.where if s.world == 1 else f"{s.where}, rank {r}"
                raw = s.meta(r)
                if raw is None and s.many:
                    continue
                m = _meta.parse(raw, where)
                if isinstance(m, dict) and m.get("format") in (_meta.TORCH, _meta.TORCH_DIST):
                    # the Checkpointer's entries (the same on every rank: rank 0's)
                    keys, objects, paths = _meta.dcp_view(m, s.step)
                    break
                k, o = _meta.dcp_parts(m, s.step, where)
                keys.update(k)
                objects.update(o)
                paths.update(_meta.dcp_paths(m, k))
                pickled += _pickled(m)
            infos = s.tensors()
            where = s.where
        self._meta = {"keys": keys, "objects": objects, "pickled": set(pickled)}
        return self._metadata(keys, objects, paths, pickled, infos, where)

    @staticmethod
    def _metadata(keys, objects, paths, pickled, infos, where):
        """DCP's Metadata: each tensor one chunk of its (global) shape; each value a
        bytes item; planner_data the keys' paths in the nested state dict (what
        DCP's loaders, dcp_to_torch_save among them, unflatten by)."""
        infos = {i.name: i for i in infos}
        pickled = set(pickled)
        sd_meta, storage = {}, {}
        for fqn, name in keys.items():
            if name in objects or name in pickled:
                sd_meta[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = name
                continue
            info = infos.get(name)
            if info is None or info.dtype not in _dtypes.TORCH:
                raise AmberError(_amber.EFORMAT, f"{where}: tensor {name!r} of {fqn!r} is "
                                 "missing", name="AMBER_EFORMAT")
            size = torch.Size(info.shape)
            zero = torch.Size([0] * len(size))
            sd_meta[fqn] = TensorStorageMetadata(TensorProperties(dtype=_dtypes.TORCH[info.dtype]),
                                                 size, [ChunkStorageMetadata(zero, size)])
            storage[MetadataIndex(fqn, zero)] = name
        return Metadata(state_dict_metadata=sd_meta, storage_data=storage,
                        planner_data={k: p for k, p in paths.items() if k in sd_meta})

    def set_up_storage_reader(self, metadata, is_coordinator, *args, **kwargs):
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def _regions(self, s, plan):
        """Every region the plan asks for, read from Step `s` (every checksum checked)
        into new tensors before anything live changes, in one call of the library; and
        the plain values the plan asks for, decoded."""
        regions, values, items = {}, {}, []
        pickled = self._meta["pickled"]
        for req in plan.items:
            name = self._storage[req.storage_index]
            if req.type == LoadItemType.BYTE_IO and name not in pickled:
                continue
            i = s.find(name)
            if i is None:
                raise AmberError(_amber.EFORMAT, f"step {self._step} of {self._path}: no "
                                 f"tensor {name!r}", name="AMBER_EFORMAT")
            shape = tuple(req.lengths)
            offsets = tuple(req.storage_offsets)
            info = s.info(i)
            if req.type == LoadItemType.BYTE_IO:  # the bytes of a value, whole
                shape, offsets = tuple(info.shape), (0,)
            t = torch.empty(shape, dtype=_dtypes.TORCH[info.dtype])
            items.append((i, offsets, shape, t.data_ptr() if t.numel() else 0,
                          t.numel() * t.element_size()))
            regions[id(req)] = t
        s.read_boxes(items)
        dec, objects = Decoder(self._step), self._meta["objects"]
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO and id(req) not in regions:
                name = self._storage[req.storage_index]
                if name not in objects:
                    raise AmberError(_amber.EFORMAT, f"step {self._step}: no value {name!r}",
                                     name="AMBER_EFORMAT")
                values[name] = dec.dec(objects[name], name)
        return regions, values

    def read_data(self, plan, planner):
        t0 = time.perf_counter()
        if self._meta is None:
            self.read_metadata()
        with self._open_step() as s:
            regions, values = self._regions(s, plan)
        for req in plan.items:
            if req.type == LoadItemType.BYTE_IO:
                if id(req) in regions:  # the bytes DCP's planner made, exactly
                    buf = io.BytesIO(regions[id(req)].numpy().tobytes())
                else:  # a plain value: handed over as DCP's own loader expects it
                    buf = io.BytesIO()
                    torch.save(values[self._storage[req.storage_index]], buf)  # in memory
                    buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            dst = planner.resolve_tensor(req).detach()
            dst.copy_(regions[id(req)])
            planner.commit_tensor(req, dst)
        log.info("loaded step %d of %s in %.2f s (%.1f MB read)", self._step, self._path,
                 time.perf_counter() - t0,
                 sum(t.numel() * t.element_size() for t in regions.values()) / 1e6)
        fut = torch.futures.Future()
        fut.set_result(None)
        return fut
