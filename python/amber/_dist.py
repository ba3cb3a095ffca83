"""amber._dist - the distributed Checkpointer: many ranks of torch.distributed, one
global checkpoint per step (docs/DESIGN.md, "Many ranks").

amber.torch.Checkpointer becomes this class when torch.distributed is initialized
with more than one rank (or when process_group= is given), and when its path holds a
multi-rank store: one process without a process group (or in a world of one) then
loads any global step of it, whatever world size wrote it, and saves global steps of
world size 1 into it. Every rank constructs it on the same store and calls save()
and load() collectively with its local state:

  - A DTensor (FSDP2's parameters and optimizer states, tensor-parallel slices) is
    saved as its shard of the global tensor: the box that
    compute_local_shape_and_global_offset gives for its placements and device mesh.
    Where placements replicate a shard over mesh dimensions, the rank at coordinate 0
    of those dimensions writes it. A fully replicated DTensor, and every plain tensor
    (DDP's replicated parameters, step counters), is written once, by rank 0.
  - Non-tensor state (entries, param_groups, counters) and the RNG states are each
    rank's own: they go into that rank's metadata, so a rank gets its own back.
  - load() reads, for every live tensor, the box this rank holds now from the
    shards that overlap it: a step loads at another world size or sharding. Every
    box of every tensor is one call of the library (amber_global_reader_read_many),
    which restores all their chunks in parallel, each straight into the live tensor
    where it lies inside a contiguous run of the box (a row-sharded shard's rows). The
    RNG states of ranks that exist in both jobs come back; a rank that did not
    exist keeps its own, with a warning.

The library's collectives (the full/delta vote, the global commit) go through
torch.distributed on a gloo group (TorchComm): the group given, or a gloo group over
its ranks when its backend is not gloo (NCCL). They run on the calling thread, in
save() (begin) and in wait(), which are therefore collective; the fence before
optimizer.step() is not.

Before a step begins, every rank says whether it could prepare its part: a rank
whose state cannot be saved (a TypeError in a state_dict, ...) makes save() raise
on every rank, naming it, and nothing is written. A failure while writing (disk
full, I/O error) is reported the same way by the global commit, and the store
stays at the last global commit.
"""

import base64
import json
import os
import random
import socket
import time
import warnings

import torch
import torch.distributed as dist

import amber as _amber
from amber import AmberError, GlobalReader, GlobalWriter
from amber import device as _device
from amber import torch as _at

try:
    import numpy as _np
except ImportError:
    _np = None

_FORMAT = "amber.torch.dist/1"


class RankLostError(RuntimeError):
    """A collective of the Checkpointer failed because rank(s) `ranks` of its group
    are gone (their process no longer exists); the message names them and carries
    torch.distributed's own error, which is chained."""

    def __init__(self, ranks, message):
        super().__init__(message)
        self.ranks = ranks


def _dead(pid):
    """Whether process `pid` of this host has ended (gone, or a zombie: a SIGKILLed
    rank whose parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except OSError:
            return False


class TorchComm:
    """amber's collectives (see amber.GlobalWriter) over a torch.distributed group,
    which must have a CPU backend (gloo): allgather of equal-length blobs, broadcast
    from a group rank, barrier.

    A collective that fails because a rank died gives only the transport's words
    (gloo: "Connection reset by peer", with an address); so the first collective
    also gathers every rank's host and process id, and a failure then names the
    ranks of this host whose process has ended (RankLostError). Ranks on other hosts
    cannot be checked that way: the error then says so, with torch's message."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._peers = None  # [(host, pid)] by group rank, from the first collective

    def _call(self, what, fn):
        try:
            if self._peers is None:
                out = [None] * self.size
                dist.all_gather_object(out, (socket.gethostname(), os.getpid()),
                                       group=self.group)
                self._peers = out
            return fn()
        except RuntimeError as e:  # torch.distributed's errors (DistBackendError, ...)
            raise self._lost(what, e) from e

    def _lost(self, what, err):
        if not self._peers:
            return err
        host = socket.gethostname()
        time.sleep(0.2)  # the peer's death reaches the socket before its process table entry
        gone = [r for r, (h, pid) in enumerate(self._peers)
                if r != self.rank and h == host and _dead(pid)]
        if not gone:
            return err
        remote = sum(h != host for h, _ in self._peers)
        which = ", ".join(f"rank {r} (pid {self._peers[r][1]})" for r in gone)
        return RankLostError(gone, f"{which} of the group ended during a collective ({what}) "
                             f"on rank {self.rank}" +
                             (f"; {remote} rank(s) on other hosts not checked" if remote else "") +
                             f": torch.distributed: {str(err).strip()[:300]}")

    def allgather(self, data):
        if not data:
            return b""
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._call("all_gather", lambda: dist.all_gather(out, t, group=self.group))
        return b"".join(o.numpy().tobytes() for o in out)

    def broadcast(self, data, root):
        if not data:
            return b""
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._call("broadcast", lambda: dist.broadcast(t, group=self.group, group_src=root))
        return t.numpy().tobytes()

    def barrier(self):
        self._call("barrier", lambda: dist.barrier(group=self.group))

    def gather_objects(self, obj):
        """Every rank's `obj` (small, JSON-able), in rank order."""
        out = [None] * self.size
        self._call("all_gather_object",
                   lambda: dist.all_gather_object(out, obj, group=self.group))
        return out


class SoloComm:
    """amber's collectives for a job of one process without a process group (a
    Checkpointer or amber.dcp.Writer at world size 1 on a multi-rank store): every
    collective is this process's own data."""
    rank, size = 0, 1

    def allgather(self, data):
        return bytes(data)

    def broadcast(self, data, root):
        return bytes(data)

    def barrier(self):
        pass

    def gather_objects(self, obj):
        return [obj]


def cpu_group(process_group, own=False):
    """A group with a CPU backend over the ranks of `process_group` (None: the world):
    the group itself when it has gloo (unless `own`), else a new gloo group, made by
    the group's ranks alone (collective over them)."""
    if not own and "gloo" in str(dist.get_backend(process_group)):
        return process_group
    if process_group is None:
        return dist.new_group(backend="gloo")
    return dist.new_group(ranks=dist.get_process_group_ranks(process_group), backend="gloo",
                          use_local_synchronization=True)


def _box(t):
    """(local tensor, global shape, offsets, local shape, writes, replicated) of a
    DTensor: the region of its global tensor this rank holds, whether this rank is
    the one that writes it, and whether it is whole on every rank."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    placements = t.placements
    if any(p.is_partial() for p in placements):
        raise TypeError("a DTensor with Partial placements (pending reductions) cannot be "
                        "saved; redistribute it first")
    local = t.to_local()
    gshape = tuple(t.shape)
    if all(p.is_replicate() for p in placements):
        return local, gshape, (0,) * len(gshape), gshape, True, True
    coord = t.device_mesh.get_coordinate()
    lshape, off = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)
    writes = coord is not None and all(c == 0 for c, p in zip(coord, placements)
                                       if p.is_replicate())
    return local, gshape, tuple(off), tuple(lshape), writes, False


# ---- RNG states as JSON (each rank's own, in its metadata) -----------------------

def _b64(t):
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode()


def _rng_state():
    out = {"torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    version, mt, gauss = random.getstate()
    out["python"] = {"version": version, "state": list(mt), "gauss_next": gauss}
    if _np is not None:
        name, keys, pos, has_gauss, cached = _np.random.get_state()
        out["numpy"] = {"name": name, "keys": [int(k) for k in keys], "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return out


def _rng_plan(meta, step):
    """A function that restores the RNG states of `meta`, every field checked first."""
    def bad(what):
        raise _at._format_error(step, f"rng/{what}", "not an RNG state amber.torch writes")
    if not isinstance(meta, dict):
        bad("")
    try:
        t = torch.frombuffer(bytearray(base64.b64decode(meta["torch"], validate=True)),
                             dtype=torch.uint8)
        cuda = [torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)
                for s in meta.get("cuda", [])]
    except (KeyError, TypeError, ValueError):
        bad("torch")
    py = meta.get("python")
    if not isinstance(py, dict) or not isinstance(py.get("version"), int) or \
            not isinstance(py.get("state"), list) or \
            not all(isinstance(x, int) for x in py["state"]) or \
            not (py.get("gauss_next") is None or isinstance(py.get("gauss_next"), (int, float))):
        bad("python")
    npm = meta.get("numpy") if _np is not None else None
    if npm is not None and not (isinstance(npm, dict) and isinstance(npm.get("name"), str) and
                                isinstance(npm.get("keys"), list) and
                                all(isinstance(npm.get(f), int) for f in ("pos", "has_gauss")) and
                                isinstance(npm.get("cached_gaussian"), (int, float))):
        bad("numpy")

    def put():
        torch.set_rng_state(t)
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        if npm is not None:
            _np.random.set_state((npm["name"], _np.array(npm["keys"], dtype=_np.uint32),
                                  npm["pos"], npm["has_gauss"], npm["cached_gaussian"]))
    return put


# ---- load: the global reader as _Load's reader ---------------------------------

class _Boxes:
    """A GlobalReader as amber.torch's _Load reads: tensors() by global shape,
    read_many of (index, address, size[, (offsets, shape)]): a whole global tensor,
    or this rank's box of it, all in one call of the library (every chunk of every
    overlapping shard in parallel, decoded straight into the live tensors)."""

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
        self.g.read_many([self._item(index, address, size, box)])

    def read_many(self, items):
        self.g.read_many([self._item(*it) for it in items])


class _WholeBoxes(_Boxes):
    """A single-process store's Reader as _Load reads with boxes: each box is read
    out of its whole tensor by the library (only the chunks that hold part of it)."""

    def __init__(self, reader):
        self.g = reader

    def read_into(self, index, address, size, box=None):
        self.g.read_boxes([self._item(index, address, size, box)])

    def read_many(self, items):
        self.g.read_boxes([self._item(*it) for it in items])


class _DistLoad(_at._Load):
    def box(self, target):
        if not _at._is_dtensor(target):
            return target, None
        local, _, off, lshape, _, _ = _box(target)
        return local, (off, lshape)


def _from_dcp(g, state, step):
    """The metadata of a step written through amber.dcp, as the Checkpointer's: every
    rank's keys and values (each rank stored those of its own items)."""
    keys, objects = {}, {}
    for r in range(g.world_size):
        raw = g.meta(r)
        m = _at._parse_meta(raw, f"global step {step} of {g.path}, rank {r}") if raw else {}
        if not isinstance(m, dict) or not isinstance(m.get("keys", {}), dict) or \
                not isinstance(m.get("objects", {}), dict):
            raise _at._format_error(step, f"rank {r}", "amber.dcp metadata that does not decode")
        keys.update(m.get("keys", {}))
        objects.update(m.get("objects", {}))
    return {"format": _FORMAT, "entries": _at._dcp_entries(keys, objects, state, step)}


# ---- the Checkpointer ------------------------------------------------------------

class DistCheckpointer(_at.Checkpointer):
    """amber.torch.Checkpointer over many ranks (see the module's documentation and
    Checkpointer's: the same arguments, plus process_group)."""

    def __init__(self, path, policy=None, full_every=None, full_share=None, rng=True,
                 readonly=False, threads=0, chunk_elems=0, keep_last=None,
                 process_group=None):
        if keep_last is not None and (not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be an int >= 1 or None, not {keep_last!r}")
        self._rules = _at._rules(policy)
        self._has_units, self._units = _at._rules_have_units(self._rules), None
        self._wopts = {"chunk_elems": chunk_elems or 0, "full_every": full_every or 0,
                       "full_share": float(full_share or 0.0)}
        if keep_last:
            self._wopts["keep_last"] = keep_last
        self._prune_msg = None
        self.rng = rng
        self.readonly = bool(readonly)  # loads only: no writer is ever opened
        self.process_group = process_group
        # one process (torch.distributed not initialized, or a world of one) on a
        # multi-rank store: amber.torch.Checkpointer routes it here, with no group
        self._comm = TorchComm(cpu_group(process_group)) if _at._distributed(process_group) \
            else SoloComm()
        self.rank, self.world_size = self._comm.rank, self._comm.size
        self.path = str(path)
        self.store = None
        self._gw = None
        self._dev = None     # amber.device.DevicePath: this rank's shards on a device
        self._dev_error = None  # its selection's failure in the step in progress
        self._zeros = None      # what _stand_in hands over for a full step
        self._seeds = None   # DevicePath seeded by a load before the first save (_seed)
        self._sig = None
        self._ptrs = []
        self._stage = {}
        self._pinned = None
        self._versions = None
        self._gated = False
        self._busy = False   # a step begun and not yet waited for (its commit is collective)
        self._hooks = {}
        self._seeding = None  # (the single-process background seed: not used here)
        self._global_hook = _at._fence_before_any_step(self)
        self.timings = {"save": 0.0, "fence": 0.0, "wait": 0.0}
        self.skipped = 0
        self.seeded = False
        self._closed = False  # the global writer is opened by the first save (collective)

    def _open_writer(self):
        if self.rank == 0:
            os.makedirs(self.path, exist_ok=True)
        # a job of one: the library's own communicator (no Python in its collectives)
        self._gw = GlobalWriter(self.path, self._comm if self._comm.size > 1 else None,
                                **self._wopts)
        try:
            for r in self._rules:
                self._gw.add_policy(r)
        except BaseException:
            self._gw.close()
            raise

    @property
    def closed(self):
        return self._closed

    def _open(self):
        if self._closed:
            raise ValueError("Checkpointer is closed")

    def _single_store(self):
        """Whether `path` holds a store written by one process (no global step)."""
        return not _amber.is_global_store(self.path) and \
            os.path.exists(os.path.join(self.path, "LATEST"))

    # -- saving --
    def save(self, step, state, full=False):
        """Checkpoints this rank's `state` as global step `step`. Collective: every
        rank of the group calls it with the same step. Returns once this rank's
        scan has started; the global commit completes in the next wait(), save(),
        load() or close() (all collective)."""
        self._open()
        if self.readonly:
            raise AmberError(_amber.EREADONLY, f"store {self.path} is open read-only",
                             name="AMBER_EREADONLY")
        t0 = time.perf_counter()
        self.wait()
        err, decl = None, None
        try:
            if self.rng and "rng" in state:
                raise ValueError("state key 'rng' is reserved for the RNG states "
                                 "(or pass rng=False)")
            if self._single_store():
                raise ValueError(f"{self.path} holds a store written by one process, which "
                                 "many ranks load but do not save into: save to a new path")
            flat, meta = _at._flatten(state, False, dist=True)
            meta["format"] = _FORMAT
            meta["step"] = int(step)
            meta["rank"], meta["world_size"] = self.rank, self.world_size
            if self.rng:
                meta["rng"] = _rng_state()
            decl = self._declare(flat, state)
            meta_json = json.dumps(meta, allow_nan=False, separators=(",", ":"))
        except Exception as e:  # every rank must learn of it before anyone begins
            err = e
        sig = None if decl is None else [d[:6] + (d[6] is None,) for d in decl]
        devs = {d[0]: d[7] for d in decl or () if d[6] is None}
        votes = self._comm.gather_objects(
            {"err": None if err is None else f"{type(err).__name__}: {err}",
             "reopen": err is None and (self._sig is None or sig != self._sig),
             "dev": bool(devs)})
        bad = next((r for r, v in enumerate(votes) if v["err"]), None)
        if bad is not None:
            e = AmberError(_amber.ECANCELED, f"step {int(step)} not committed: rank {bad} failed: "
                           f"{votes[bad]['err']}", name="AMBER_ECANCELED")
            e.rank = bad
            raise e from err
        if any(v["reopen"] for v in votes):
            self._redeclare(decl, sig, state)
        else:
            self._point(decl)
        w = self._gw
        w.set_meta(meta_json)
        if self._has_units:
            m = _at._UnitMap(flat, state)
            units = m.units(m.lrs(state))
            if units != self._units:
                w.set_units(units)
                self._units = units
        scanned = [d for d in decl if d[8] and d[9]]
        self._pinned = [d[7] for d in scanned]
        # A DTensor's in-place ops (the optimizer's) move its own version counter, which
        # its detached aliases (a state dict's) share, not its local tensor's; writes
        # through to_local() move the local one's: both are checked.
        self._versions = [(d[0], t, t._version) for d in scanned for t in {id(x): x for x in
                                                                           (d[7], d[10])}.values()]
        for v in state.values():
            if isinstance(v, torch.optim.Optimizer):
                self._hook(v)
        self._gated = True
        self._busy = True
        try:
            flags = _amber.SAVE_CONFIRM | (_amber.SAVE_FULL if full else 0)
            if any(v["dev"] for v in votes):  # some rank selects on its device
                flags, kind = self._plan(int(step), flags)
                try:
                    self._dev.select(w, kind, devs)
                except Exception as e:  # begun all the same (begin is collective): the
                    self._dev_error = e  # fence refuses this rank's part, wait raises
                    self._stand_in(kind)
            w.begin(int(step), full=bool(flags & _amber.SAVE_FULL), confirm=True)
        except BaseException:
            self._pinned = self._versions = self._dev_error = None
            self._gated = self._busy = False
            if self._dev is not None:
                self._dev.rollback()
            raise
        self.timings["save"] = time.perf_counter() - t0

    def _stand_in(self, kind):
        """After a failed selection: selections that store nothing true (unchanged
        chunks, or zeros for a full step), so that this rank's part begins as every
        rank's must, and the fence refuses it with the selection's error. If even
        these cannot be handed over, the part fails at begin (no selection)."""
        try:
            for dt in self._dev.tensors.values():
                chunk, n, _ = _device.chunking(self._gw, dt.index)
                sels = (_device._ChunkSel * max(1, n))()
                if kind == _device.KIND_FULL:
                    size = chunk * torch.empty(0, dtype=dt.dtype).element_size()
                    if self._zeros is None or self._zeros.numel() < size:
                        self._zeros = torch.zeros(max(size, 1), dtype=torch.uint8)
                    for j in range(n):  # every chunk reads the same zeros
                        sels[j] = _device._ChunkSel(_device.SELECT_WHOLE, None,
                                                    self._zeros.data_ptr())
                _device.set_selection(self._gw, dt.index, sels, n)
        except Exception:
            pass

    def _plan(self, step, flags):
        """The kind of the step for the device path, the same on every rank, and the
        flags to begin it with (collective; DevicePath.plan_global)."""
        return self._dev.plan_global(self._gw, self._comm, self.path, step, flags)

    def _declare(self, flat, state):
        """Per tensor: (name, dtype, global shape, offsets, local shape, replicated,
        address, local tensor, writes, read in place, the tensor as given). Tensors this rank writes
        and that no optimizer of the state owns are copied into staging buffers,
        as amber.torch does; the others are read in place until the fence. Those
        that amber.device selects on their device (address None) are neither."""
        owned = _at._owned_storages(state)
        buffers = _at._buffer_storages(state)
        out = []
        with torch.no_grad():
            for name, t in flat.tensors:
                if _at._is_dtensor(t):
                    local, gshape, off, lshape, writes, repl = _box(t)
                else:
                    local, gshape = t, tuple(t.shape)
                    off, lshape, writes, repl = (0,) * t.dim(), gshape, True, True
                if local.dtype not in _at._DTYPES:
                    raise TypeError(f"{name}: dtype {local.dtype} is not supported by amber")
                if repl and self.rank != 0:
                    # declared replicated on every rank (the library takes rank 0's)
                    out.append((name, _at._DTYPES[local.dtype], gshape, off, lshape, repl, 0,
                                local, False, False, t))
                    continue
                if not writes:
                    continue  # a replica of a shard that another rank writes
                if _device.wanted(local):  # selected on its device: nothing to read here
                    out.append((name, _at._DTYPES[local.dtype], gshape, off, lshape, repl, None,
                                local, True, False, t))
                    continue
                nbytes = local.numel() * local.element_size()
                inplace = _at._in_place(local, nbytes, owned, buffers)
                if inplace:
                    src = local
                else:
                    src = self._stage.get(name)
                    if src is None or src.shape != local.shape or src.dtype != local.dtype:
                        src = torch.empty(local.shape, dtype=local.dtype)
                        self._stage[name] = src
                    src.copy_(local.resolve_conj().resolve_neg())
                addr = src.data_ptr() if src.numel() else 0
                out.append((name, _at._DTYPES[local.dtype], gshape, off, lshape, repl, addr,
                            src, True, inplace, t))
        if len(self._stage) > len(out):
            names = {d[0] for d in out}
            self._stage = {n: b for n, b in self._stage.items() if n in names}
        return out

    def _redeclare(self, decl, sig, state):
        """A new global writer for a new set of tensors (collective: every rank
        reopens when any rank's declarations changed)."""
        if self._gw is not None:
            self._gw.close()
            self._gw = None
        self._open_writer()
        self._dev = _device.DevicePath()
        try:
            for k, v in state.items():  # step counters are never lossy
                if isinstance(v, torch.optim.Optimizer):
                    self._gw.add_policy(f"{_at._glob_escape(k)}/*/step=exact")
            for name, dt, gshape, off, lshape, repl, addr, local, *_ in decl:
                if addr is None:  # this rank's box, selected on its device
                    self._dev.declare(self._gw, name, dt, local, global_shape=gshape,
                                      offsets=off, replicated=repl)
                    seeded = (self._seeds.tensors if self._seeds else {}).get(name)
                    dd = self._dev.tensors[name]
                    if seeded is not None and seeded.shape == dd.shape and \
                            seeded.dtype == dd.dtype and seeded.device == dd.device:
                        dd.ref, dd.valid = seeded.ref, True  # seeded by a load before
                else:
                    self._gw.add(name, dt, gshape, off, lshape, addr, replicated=repl)
        except BaseException:
            self._gw.close()
            self._gw = None
            raise
        self._sig = sig
        self._ptrs = [d[6] for d in decl]
        self._seeds = None
        self._units = None  # the new writer has none yet

    def _point(self, decl):
        for i, d in enumerate(decl):
            if d[6] != self._ptrs[i]:
                self._gw.set_data(i, d[6])
                self._ptrs[i] = d[6]

    def fence(self):
        """Blocks until this rank's save no longer reads its tensors (not collective;
        called by itself before optimizer.step())."""
        if self._pinned is None or self._gw is None:
            return
        t0 = time.perf_counter()
        try:
            if self._dev is not None:
                self._dev.fence()  # the device-side selection (an event on CUDA)
            self._gw.fence()
        finally:
            changed = self._changed()
            gated, self._gated = self._gated, False
            self._pinned = self._versions = None
            self.timings["fence"] = time.perf_counter() - t0
            if gated:
                err = self._dev_error
                why = "" if changed is None else (
                    f"tensor '{changed}' changed in place after save() and before the fence: "
                    "the checkpoint could hold a torn state, so it was not committed; call "
                    "fence() (or wait()) before changing saved tensors outside optimizer.step()")
                if err is not None:
                    why = f"its device selection failed: {type(err).__name__}: {err}"
                try:
                    self._gw.confirm(changed is None and err is None, why)
                except AmberError:
                    pass  # the step fails anyway; wait() reports it

    def wait(self):
        """Completes the step in progress: this rank's part durable, then the global
        commit. Collective. Raises the step's failure on every rank, naming the
        rank that failed."""
        if self._gw is None or not self._busy:
            return
        t0 = time.perf_counter()
        try:
            self.fence()
            self._busy = False
            err, self._dev_error = self._dev_error, None
            if self._dev is not None:  # the device references move with the outcome
                self._dev.settle(self._gw.wait, err)
            else:  # (a selection's failure needs device tensors)
                self._gw.wait()
        finally:
            self.timings["wait"] = time.perf_counter() - t0
        if "keep_last" in self._wopts:
            self._prune_msg = _at._prune_warning(
                self._gw.prune_status(), self._prune_msg,
                f"global step saved, but old ones could not be removed on rank {self.rank} "
                f"(keep_last={self._wopts['keep_last']})")

    def close(self):
        """Completes the step in progress (collective) and releases the writer."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._release()

    def _release(self):
        for _, undo in self._hooks.values():
            undo()
        self._hooks.clear()
        self._global_hook.remove()
        if self._gw is not None:
            self._gw.close()
            self._gw = None
        self._closed = True
        self._pinned = self._versions = None
        self._stage = {}

    def __del__(self):
        try:  # never a collective from the garbage collector
            self._release()
        except Exception:
            pass

    # -- reading --
    def latest(self):
        """The latest global step, or None (after completing the step in progress)."""
        self._open()
        self.wait()
        steps = _amber.global_steps(self.path)
        return steps[-1].step if steps else None

    def steps(self):
        """The committed global steps (amber.GlobalStepInfo)."""
        self._open()
        self.wait()
        return _amber.global_steps(self.path)

    def load(self, state, step=None, strict=True, fallback=False):
        """Restores this rank's `state` in place from global `step` (default: the
        latest) and returns it, or None for an empty store. Collective in that
        every rank should call it (it completes the step in progress first). Each
        live DTensor gets the box it holds now, read from the shards that overlap
        it, whatever world size and sharding wrote the step. fallback=True: the
        newest global step from `step` back that verifies whole on every rank, agreed
        by all (`skipped` counts the steps passed over)."""
        self._open()
        self.wait()
        self.skipped = 0
        latest = step is None
        if self._single_store():
            return self._load_single(state, step, strict, fallback)
        if step is None and not _amber.global_steps(self.path):
            return None
        if fallback:
            step = self._agree_on_step(step)
        with GlobalReader(self.path, step) as g:
            done = g.step
            own = self.rank < g.world_size
            meta = _at._parse_meta(g.meta(self.rank if own else 0),
                                   f"global step {done} of {self.path}")
            if isinstance(meta, dict) and meta.get("format") == _at._DCP_FORMAT:
                meta = _from_dcp(g, state, done)
            if not isinstance(meta, dict) or meta.get("format") != _FORMAT:
                raise AmberError(_amber.EFORMAT, f"global step {done} of {self.path} was not "
                                 "written by amber.torch's distributed Checkpointer",
                                 name="AMBER_EFORMAT")
            entries = meta.get("entries")
            if not isinstance(entries, dict):
                raise _at._format_error(done, "entries", "not a dict")
            names = _at._Names(state)
            ld = _DistLoad(_Boxes(g), strict, done)
            for key, target in state.items():
                e = entries.get(key)
                if e is None:
                    ld.mismatch(key, f"not in the checkpoint of step {done}")
                    continue
                ld.entry(key, e, target, state, names)
            if self.rng and "rng" in meta:
                if own:
                    ld.after.append(("rng", _rng_plan(meta["rng"], done)))
                else:
                    warnings.warn(f"amber: global step {done} was written by "
                                  f"{g.world_size} ranks: rank {self.rank} keeps its own RNG "
                                  "states", RuntimeWarning, stacklevel=2)
            ld.apply()
        if strict and latest and not self.skipped:
            self._seed(state)
        return done

    def _seed(self, state):
        """After a load of the latest global step: the live tensors hold exactly its
        restore of this rank's boxes, so the device references are seeded from them,
        as amber.torch seeds after load(). A Checkpointer that has not declared its
        tensors yet (a restart: its writer is opened, collectively, by the first
        save) keeps the seeds until that first save, whose declarations take those
        that match; a tensor without one reads its boxes back from the store."""
        try:
            flat, _ = _at._flatten(state, False, dist=True)
            live = {}
            for name, t in flat.tensors:  # the tensors _declare sends to the device path
                local, _, _, _, writes, repl = _box(t) if _at._is_dtensor(t) else \
                    (t, None, None, None, True, True)
                if writes and (self.rank == 0 or not repl) and local.dtype in _at._DTYPES \
                        and _device.wanted(local):
                    live[name] = local
        except (TypeError, ValueError):
            return
        if self._dev is not None and self._dev.tensors:
            self._seeds = None
            if all(n in live and tuple(live[n].shape) == dt.shape and live[n].dtype == dt.dtype
                   for n, dt in self._dev.tensors.items()):
                self._dev.seed({n: live[n] for n in self._dev.tensors})
            return
        self._seeds = _device.DevicePath()
        for name, local in live.items():
            dt = _device._Tensor(name, None, local, _at._DTYPES[local.dtype],
                                 self._seeds.host_ref)
            dt.seed(local)
            self._seeds.tensors[name] = dt

    def _agree_on_step(self, step):
        """load(fallback=True): the newest global step (from `step`, default the
        latest, back) that verifies whole on every rank, agreed collectively: each
        rank verifies each candidate (manifest and every rank's files it needs; the
        reads are repeated on each rank, which also covers ranks that see the store
        through different mounts), then all learn every rank's verdict. Sets
        `skipped`; raises AmberError naming each rank's reason when none verifies."""
        cands = [s.step for s in _amber.global_steps(self.path)
                 if step is None or s.step <= step]
        if step is not None and step not in cands:
            return step  # not a committed step: the load's GlobalReader says so
        why = []
        for s in reversed(cands):
            try:
                with GlobalReader(self.path, s) as g:
                    g.verify()
                mine = None
            except AmberError as e:
                mine = str(e)
            votes = self._comm.gather_objects(mine)
            bad = [(r, v) for r, v in enumerate(votes) if v]
            if not bad:
                if self.skipped:
                    warnings.warn(f"amber: {self.path}: loading global step {s}, the newest "
                                  f"that verifies on every rank ({'; '.join(why)})",
                                  RuntimeWarning, stacklevel=3)
                return s
            self.skipped += 1
            r, v = bad[0]
            why.append(f"step {s}: rank {r}: {v}")
        raise AmberError(_amber.ECORRUPT, f"{self.path}: no global step verifies on every "
                         f"rank: {'; '.join(why) or 'no step committed'}", name="AMBER_ECORRUPT")

    def _load_single(self, state, step, strict, fallback=False):
        """load() of a store written by one process (amber.torch or amber.dcp): every
        rank reads its boxes out of the whole tensors; rank 0 gets the RNG states,
        the others keep theirs."""
        with _amber.Store(self.path, readonly=True, create=False) as st, \
                st.reader(step, fallback=fallback) as r:
            done = r.step
            self.skipped = r.skipped
            meta = _at._parse_meta(r.meta(), f"step {done} of {self.path}")
            if isinstance(meta, dict) and meta.get("format") == _at._DCP_FORMAT:
                meta = {"format": _at._FORMAT, "entries": _at._dcp_entries(
                    meta.get("keys"), meta.get("objects"), state, done)}
            if not isinstance(meta, dict) or meta.get("format") != _at._FORMAT or \
                    not isinstance(meta.get("entries"), dict):
                raise AmberError(_amber.EFORMAT, f"step {done} of {self.path} was not written "
                                 "by amber.torch or amber.dcp", name="AMBER_EFORMAT")
            names = _at._Names(state)
            ld = _DistLoad(_WholeBoxes(r), strict, done)
            for key, target in state.items():
                e = meta["entries"].get(key)
                if e is None:
                    ld.mismatch(key, f"not in the checkpoint of step {done}")
                    continue
                ld.entry(key, e, target, state, names)
            if self.rng and "rng" in meta:
                if self.rank == 0:
                    ld.rng(meta["rng"])
                else:
                    warnings.warn(f"amber: step {done} of {self.path} was written by one "
                                  f"process: rank {self.rank} keeps its own RNG states",
                                  RuntimeWarning, stacklevel=3)
            ld.apply()
        return done
