"""amber.integrations.lightning - PyTorch Lightning's checkpoints in an amber store.

    from lightning.pytorch import Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint
    from amber.integrations.lightning import AmberCheckpointIO

    trainer = Trainer(max_steps=1000, plugins=[AmberCheckpointIO(policy="exact")],
                      callbacks=[ModelCheckpoint(dirpath="ckpt", every_n_train_steps=50,
                                                 save_last=True)])
    trainer.fit(model, ckpt_path="last")     # resumes from the newest last.ckpt, if any

AmberCheckpointIO is a Lightning CheckpointIO plug-in: everything Lightning puts into
a checkpoint (the model's state_dict, every optimizer's and LR scheduler's state, the
loops' progress, the callbacks' states, epoch, global_step, hyper-parameters, the
precision plug-in's state, what on_save_checkpoint adds) goes into an amber store, as
full checkpoints and, between them, deltas against the previous save. Lightning writes
no torch.save file.

How Lightning's files map to amber. Lightning names each checkpoint by a path and
keeps its own books by those paths: ModelCheckpoint's top-k removes old files by path,
save_last rewrites last.ckpt (or links it to the newest top-k file), and
fit(ckpt_path="last") lists the checkpoint directory for last*.ckpt files and takes
the newest by modification time. So that all of this keeps working unchanged, each
checkpoint directory holds one amber store (the folder "amber" next to the files, or
the store given as store=) and, at each path Lightning names, a pointer file of a few
hundred bytes (JSON): the store (relative to the file), the amber step and a random
token that the step's metadata repeats. One store per directory, rather than one per
file, is what makes deltas possible: consecutive saves (epoch=0-step=50.ckpt, then
last.ckpt, then epoch=0-step=100.ckpt ...) are consecutive steps of one store, so
each is a delta against the one before (a last.ckpt saved right after a top-k file
of the same training step costs next to nothing). amber steps count saves (1, 2,
3, ...), not Lightning's global_step, which two files of one training step share.

Crash safety. A pointer file is written (atomically: a temporary file renamed over
it) as soon as save_checkpoint() returns, as torch.save's file would be, while amber
commits the step in the background. A pointer therefore also names the step this
writer had committed before (its "fallback"): if the process dies before the new step
is committed (SIGKILL, power loss), loading that pointer loads the fallback step, the
newest complete checkpoint before it, with a warning. Loading checks the token, so
a pointer never loads a step that another run wrote under the same number.

Asynchronous saves. save_checkpoint() copies the checkpoint's tensors into staging
buffers that are reused from save to save (amber.torch's Checkpointer does it: the
tensors Lightning hands over belong to no optimizer that the Checkpointer could fence
on, so every one is captured) and returns; encoding and the durable write run in the
background while training goes on. The next save waits for the previous one first, so
at most one save is in flight; teardown() (end of fit, validate, test) waits for the
last one. There is nothing to fence: training may change every tensor at once. Do not
wrap the plug-in in Lightning's AsyncCheckpointIO: it would copy the state a second
time for nothing.

Retention. When Lightning removes a checkpoint (top-k, a replaced last.ckpt) its
pointer is removed at once, and the store is pruned at the next save (when no save
is in flight): every step older than the oldest step that a pointer file in the
store's directories still names is deleted, keeping what restores need. A
checkpoint that stays among the top-k for long (monitor=...) keeps every later step.

Values. Non-tensor values are kept exactly as plain data (JSON: ints, floats
bit-exact, strings, bools, None, lists, tuples, dicts with any hashable plain keys,
torch dtypes, small numpy arrays); anything else (a Path, an enum, an object among
the hyper-parameters) is refused with an error naming it, before anything is written:
amber never pickles. Tensors of the model and the optimizers are stored as amber
tensors under "checkpoint/<path>" (e.g. "checkpoint/state_dict/net.0.weight",
"checkpoint/optimizer_states/0/state/3/exp_avg"); small tensors elsewhere (at most
SMALL_ELEMS elements: logged metrics, ModelCheckpoint's scores, whose names change
from save to save) are kept in the metadata, exactly, so that the set of amber
tensors stays the same and saves stay deltas. Loaded tensors are on the CPU (or on
map_location). RNG states (torch, Python's random, NumPy) are saved and restored as
well (rng=True), which Lightning's own checkpoints do not do; under DDP they are
global rank 0's, restored on rank 0 only.

Policies. policy= is amber.torch's: "exact" (default: bit-exact restore), "lossy",
"lossy-frequent", "lossy-compact", "lossy-capped", rules or {pattern: spec} over the tensor names
above; optimizer step counters are always exact.

Many processes. Lightning's DDP strategies hand the checkpoint to the CheckpointIO on
global rank 0 only (DDP's state is replicated), so rank 0 writes the store; every
rank loads from it (ranks other than 0 read it without its lock). Strategies that
write their own sharded checkpoints (FSDP with sharded state, DeepSpeed) do not use a
CheckpointIO at all.

Loading outside the Trainer. LightningModule.load_from_checkpoint() reads files with
torch.load, not through a CheckpointIO, and fails on a pointer with torch's unpickling
error; call load_from_checkpoint(Model, path) here instead (the module, built as
Lightning builds it), or load(path) (the checkpoint dict), or export(path, out) (a
torch.save file that Model.load_from_checkpoint(out) reads). A pointer file names this
in its "load_with" field. A path that is
not an amber pointer (a .ckpt that Lightning wrote before the switch) is loaded by
Lightning's TorchCheckpointIO, so a run resumes from its old files.
"""

import atexit
import contextlib
import io
import json
import os
import secrets
import shutil
import threading
import warnings
import weakref

import torch
from lightning.pytorch.plugins.io import CheckpointIO, TorchCheckpointIO

import amber as _amber
from amber import AmberError
from amber.torch import Checkpointer
from amber.torch._source import StoreSource

__all__ = ["AmberCheckpointIO", "load", "export", "STORE_NAME", "SMALL_ELEMS"]

FORMAT = "amber-lightning"
VERSION = 1
STORE_NAME = "amber"       # the default store: this folder in each checkpoint directory
SMALL_ELEMS = 64           # tensors outside the model and optimizers kept in the metadata
_BULK = ("state_dict", "optimizer_states")  # checkpoint keys whose tensors stay tensors
_TAG = "__amber_tensor__"  # a small tensor kept in the metadata
_POINTER_MAX = 1 << 16     # a pointer file is a few hundred bytes
_STEP_RULE = "checkpoint/optimizer_states/*/step=exact"
# for someone who opens a pointer file after Model.load_from_checkpoint(path) failed
_LOAD_WITH = ("a pointer into an amber store: Trainer.fit(ckpt_path=...) with AmberCheckpointIO, "
              "or amber.integrations.lightning.load_from_checkpoint(Model, path)")


class _Local(Checkpointer):
    """amber.torch's one-process Checkpointer even where torch.distributed runs many
    ranks: Lightning hands the checkpoint to global rank 0 alone."""
    local_only = True


def _rank():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    from lightning.fabric.utilities.rank_zero import rank_zero_only
    return getattr(rank_zero_only, "rank", 0) or 0


def _policy(policy):
    if policy is None:
        rules = ["exact"]
    elif isinstance(policy, str):
        rules = [policy]
    elif isinstance(policy, dict):
        rules = [f"{k}={v}" for k, v in policy.items()]
    else:
        rules = list(policy)
    for r in rules:
        if not isinstance(r, str):
            raise TypeError(f"policy rules are strings, not {type(r).__name__}")
    return rules + [_STEP_RULE]


# ---- the checkpoint dict <-> what the Checkpointer stores ---------------------------

def _pack(x, bulk):
    """`x` with small tensors outside the model and optimizers turned into tagged
    plain data; dict subclasses (OrderedDict, AttributeDict) become dicts."""
    if isinstance(x, torch.Tensor):
        if bulk or x.numel() > SMALL_ELEMS:
            return x
        t = x.detach().cpu()
        return {_TAG: {"dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape),
                       "data": t.reshape(-1).tolist()}}
    if isinstance(x, dict):
        if len(x) == 1 and _TAG in x:
            raise ValueError(f"a dict whose only key is {_TAG!r} would read back as a tensor")
        return {k: _pack(v, bulk) for k, v in x.items()}
    if isinstance(x, list):
        return [_pack(v, bulk) for v in x]
    if isinstance(x, tuple):
        return tuple(_pack(v, bulk) for v in x)
    return x


def _unpack(x, device):
    if isinstance(x, dict):
        if len(x) == 1 and _TAG in x and isinstance(x[_TAG], dict):
            d = x[_TAG]
            dtype = getattr(torch, str(d.get("dtype")), None)
            try:
                if not isinstance(dtype, torch.dtype):
                    raise TypeError(f"dtype {d.get('dtype')!r}")
                t = torch.tensor(d["data"], dtype=dtype).reshape(d["shape"])
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise AmberError(_amber.EFORMAT, f"a small tensor in the metadata does not "
                                 f"decode: {e}", name="AMBER_EFORMAT") from None
            return t if device is None else t.to(device)
        return {k: _unpack(v, device) for k, v in x.items()}
    if isinstance(x, list):
        return [_unpack(v, device) for v in x]
    if isinstance(x, tuple):
        return tuple(_unpack(v, device) for v in x)
    if isinstance(x, torch.Tensor) and device is not None:
        return x.to(device)
    return x


def _local_path(path):
    path = os.fspath(path)
    if "://" in str(path):
        raise ValueError(f"AmberCheckpointIO writes its pointer files to local (or mounted) "
                         f"file systems, not {path}: keep ModelCheckpoint's dirpath local and "
                         "give the plug-in an s3:// store (AmberCheckpointIO(store=\"s3://...\"))")
    return os.path.abspath(path)


def _is_url(store):
    return "://" in str(store)


@contextlib.contextmanager
def _store_of(ck, writable=False):
    """The store behind Checkpointer `ck`, to list, read and prune: its own open store,
    or, for an s3:// store (which a writing Checkpointer writes through a local staging
    directory), the bucket's, opened for the call."""
    if not _is_url(ck.path):
        yield ck.store
        return
    with _amber.Store(ck.path, readonly=not writable, create=False) as st:
        yield st


# ---- pointer files ------------------------------------------------------------------

def _read_pointer(path):
    """The pointer at `path` (a dict with the store made absolute), or None when the
    file is not one (a torch.save file: zip or pickle). Malformed pointers raise."""
    with open(path, "rb") as f:
        head = f.read(_POINTER_MAX + 1)
    if not head.lstrip()[:1] == b"{":
        return None
    if len(head) > _POINTER_MAX:
        raise AmberError(_amber.EFORMAT, f"{path}: not an amber-lightning pointer (too large)",
                         name="AMBER_EFORMAT")
    try:
        p = json.loads(head)
    except (ValueError, RecursionError) as e:
        raise AmberError(_amber.EFORMAT, f"{path}: not an amber-lightning pointer ({e})",
                         name="AMBER_EFORMAT") from None
    ok = (isinstance(p, dict) and p.get("format") == FORMAT and isinstance(p.get("store"), str)
          and isinstance(p.get("step"), int) and isinstance(p.get("token"), str)
          and (p.get("fallback") is None or isinstance(p["fallback"], dict)
               and isinstance(p["fallback"].get("step"), int)
               and isinstance(p["fallback"].get("token"), str)))
    if not ok:
        raise AmberError(_amber.EFORMAT, f"{path}: not an amber-lightning pointer (fields missing)",
                         name="AMBER_EFORMAT")
    if p.get("version", 0) > VERSION:
        raise AmberError(_amber.EFORMAT, f"{path}: amber-lightning pointer version {p['version']}; "
                         f"this amber reads version {VERSION}", name="AMBER_EFORMAT")
    if not _is_url(p["store"]):  # a local store is named relative to the pointer
        base = os.path.dirname(os.path.realpath(path))
        p["store"] = os.path.realpath(os.path.join(base, p["store"]))
    return p


def _write_pointer(path, pointer):
    """Writes `pointer` at `path` atomically (a temporary file renamed over it)."""
    if os.path.isdir(path) and not os.path.islink(path):
        raise IsADirectoryError(f"the checkpoint path is a directory: {path}")
    d = os.path.dirname(path)
    tmp = os.path.join(d, f".{os.path.basename(path)}.amber-{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        json.dump(pointer, f, indent=1)
        f.write("\n")
    os.replace(tmp, path)


def _pointers(directory, store, committed):
    """Steps that the pointer files in `directory` pointing into `store` need: each
    one's own step once `committed` holds it, else its fallback."""
    steps = set()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return steps
    for e in entries:
        if not e.name.endswith(".ckpt") or not e.is_file(follow_symlinks=False):
            continue
        try:
            if e.stat().st_size > _POINTER_MAX:
                continue
            p = _read_pointer(e.path)
        except (OSError, AmberError):
            continue
        if p is not None and p["store"] == store:
            if p["step"] in committed or not p.get("fallback"):
                steps.add(p["step"])
            else:
                steps.add(p["fallback"]["step"])
    return steps


def _token_of(store, step):
    """The token that step `step` of `store` was saved with (None: not one of ours)."""
    with StoreSource(store.path, store).step(step) as s:
        raw = s.meta()
    try:
        meta = json.loads(raw) if raw else None
        return meta["entries"]["file"]["value"]["token"]
    except (ValueError, KeyError, TypeError, RecursionError):
        return None


def _resolve(store, pointer, path):
    """The step to load for `pointer` (read from `path`): its own step once committed
    with its token, else its fallback (with a warning), else an error."""
    committed = {i.step for i in store.list() if not i.damaged}
    if pointer["step"] in committed and _token_of(store, pointer["step"]) == pointer["token"]:
        return pointer["step"]
    fb = pointer.get("fallback")
    if fb and fb["step"] in committed and _token_of(store, fb["step"]) == fb["token"]:
        warnings.warn(f"amber: the save of {path} (step {pointer['step']} of {store.path}) did not "
                      f"complete (the process ended before amber committed it); loading the newest "
                      f"complete checkpoint before it, step {fb['step']}", stacklevel=3)
        return fb["step"]
    raise AmberError(_amber.ENOENT, f"{path}: step {pointer['step']} of {store.path} is not the "
                     "checkpoint saved as this file: it was not committed (the process ended before "
                     "its save completed) or was removed, and there is no complete checkpoint to "
                     "fall back to", name="AMBER_ENOENT")


def _load(ck, run, pointer, path, map_location):
    """Loads the step of `pointer` through Checkpointer `ck` (of `run` when this
    plug-in writes the store, else read-only) and returns Lightning's dict."""
    if run is not None:
        _settle(run)
    with _store_of(ck) as st:
        step = _resolve(st, pointer, path)
    state = {"checkpoint": None, "file": None}
    # the latest step loads as step=None: the writer's reference is then seeded from
    # what was read, and the next save is a delta that reads nothing back
    latest = ck.latest()
    ck.load(state, step=None if step == latest and run is not None else step)
    if run is not None:
        run.done = (step, state["file"]["token"])
        run.dirs.add(os.path.dirname(os.path.realpath(path)))
    return _unpack(state["checkpoint"], map_location)


# ---- the plug-in --------------------------------------------------------------------

def _settle(run):
    """Waits for the run's save in flight: committed, it becomes the fallback of the
    next pointer; failed, its error raises (and the save is forgotten)."""
    try:
        run.ck.wait()
    except BaseException:
        run.pending = None
        raise
    if run.pending is not None:
        run.done, run.pending = run.pending, None


class _Run:
    """One store this plug-in saves into: its long-lived Checkpointer (it keeps the
    reference state between saves, so saves are deltas), the step numbering and what
    the pointers need."""

    def __init__(self, ck):
        self.ck = ck
        latest = ck.latest()
        self.next = (latest or 0) + 1
        self.done = None      # (step, token) committed: the fallback of the next pointer
        self.pending = None   # (step, token) of the save in flight
        # real paths of directories with pointers into the store
        self.dirs = set() if _is_url(ck.path) else {os.path.dirname(ck.path)}
        self.prune_due = False


class AmberCheckpointIO(CheckpointIO):
    """Lightning CheckpointIO that saves into amber stores (see the module's text).

    AmberCheckpointIO(store=None, policy=None, full_every=None, full_share=None,
                      rng=True, threads=0, chunk_elems=0)
      store: one store for every checkpoint (a path, or an object store's URL,
          "s3://bucket/prefix": the checkpoints go there, written through a local staging
          directory and durable in the bucket when a save's commit completes; the pointer
          files stay in ModelCheckpoint's dirpath and name the URL); None (default): a
          store named STORE_NAME in each checkpoint directory.
      policy, full_every, full_share, threads, chunk_elems: as amber.torch.Checkpointer's
          (policy: "exact" default, "lossy", "lossy-frequent", "lossy-compact", "lossy-capped",
          rules).
      rng: save the RNG states (torch, random, NumPy) with each checkpoint and restore
          them at load (on global rank 0 under DDP).

    Thread safety: its methods may be called from several threads (one at a time)."""

    def __init__(self, store=None, policy=None, full_every=None, full_share=None, rng=True,
                 threads=0, chunk_elems=0):
        super().__init__()
        if store is not None:
            store = os.fspath(store)
            self.store = store.rstrip("/") if _is_url(store) else os.path.realpath(store)
        else:
            self.store = None
        self._rules = _policy(policy)
        self._opts = {"full_every": full_every, "full_share": full_share, "threads": threads,
                      "chunk_elems": chunk_elems}
        self.rng = rng
        self._runs = {}  # realpath of a store -> _Run
        self._lock = threading.RLock()
        ref = weakref.ref(self)
        atexit.register(lambda: ref() is not None and ref()._close_all(quiet=True))

    # -- stores --
    def _store_for(self, directory):
        return self.store or os.path.join(os.path.realpath(directory), STORE_NAME)

    def _run(self, store):
        """The writable run of `store` (opened on first use)."""
        run = self._runs.get(store)
        if run is None:
            ck = _Local(store, policy=self._rules, rng=self.rng, **self._opts)
            run = self._runs[store] = _Run(ck)
        return run

    def _prune(self, run):
        """Deletes the steps older than the oldest one a pointer (or this writer)
        still needs. Only with no save in flight."""
        run.prune_due = False
        with _store_of(run.ck) as st:
            steps = [i.step for i in st.list()]
        keep = set()
        for d in run.dirs:
            keep |= _pointers(d, run.ck.path, set(steps))
        for s in (run.done, run.pending):
            if s is not None:
                keep.add(s[0])
        needed = [s for s in steps if s in keep]
        if not needed:
            return
        n = sum(1 for s in steps if s >= min(needed))
        if n < len(steps):
            try:
                with _store_of(run.ck, writable=True) as st:
                    st.prune(n)
            except AmberError as e:  # a file that cannot go does not fail the save
                warnings.warn(f"amber: old checkpoints of {run.ck.path} could not be removed: "
                              f"{e.message}", _amber.PruneWarning, stacklevel=3)

    # -- CheckpointIO --
    def save_checkpoint(self, checkpoint, path, storage_options=None):
        """Saves Lightning's `checkpoint` dict as the next step of the directory's store
        and writes the pointer file at `path`. Returns once the tensors are copied; the
        store commits the step in the background. Raises the failure of the previous
        save, if it failed."""
        if storage_options is not None:
            raise TypeError("AmberCheckpointIO.save_checkpoint does not take storage_options "
                            f"(got {storage_options!r})")
        if _rank() != 0:
            raise RuntimeError("AmberCheckpointIO saves on global rank 0 only (Lightning's "
                               f"strategies call it there); it was called on rank {_rank()}")
        if not isinstance(checkpoint, dict):
            raise TypeError(f"a checkpoint is a dict, not {type(checkpoint).__name__}")
        path = _local_path(path)
        directory = os.path.realpath(os.path.dirname(path))
        packed = {k: _pack(v, k in _BULK) for k, v in checkpoint.items()}
        with self._lock:
            os.makedirs(directory, exist_ok=True)
            run = self._run(self._store_for(directory))
            ck = run.ck
            _settle(run)  # the previous save is committed, or its failure raises here
            if run.prune_due:
                self._prune(run)
            step, token = run.next, secrets.token_hex(8)
            try:
                ck.save(step, {"checkpoint": packed,
                               "file": {"name": os.path.basename(path), "token": token}})
            except TypeError as e:
                raise TypeError(f"AmberCheckpointIO: the checkpoint for {path} holds {e} "
                                "(amber keeps values other than tensors as plain data and never "
                                "pickles; e.g. save_hyperparameters(ignore=[...]) leaves such "
                                "an object out)") from None
            run.next, run.pending = step + 1, (step, token)
            run.dirs.add(directory)
            fb = run.done
            _write_pointer(path, {
                "format": FORMAT, "version": VERSION,
                "store": ck.path if _is_url(ck.path) else os.path.relpath(ck.path, directory),
                "step": step, "token": token,
                "fallback": None if fb is None else {"step": fb[0], "token": fb[1]},
                "epoch": checkpoint.get("epoch"), "global_step": checkpoint.get("global_step"),
                "load_with": _LOAD_WITH})

    def load_checkpoint(self, path, map_location=None, weights_only=None):
        """Lightning's checkpoint dict of the pointer at `path` (tensors on the CPU, or
        on map_location: a device or its name). A file that is not an amber pointer is
        loaded by Lightning's TorchCheckpointIO (weights_only applies to it only)."""
        path = os.fspath(path)
        if not os.path.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        pointer = _read_pointer(path)
        if pointer is None:
            kw = {} if map_location is None else {"map_location": map_location}
            return TorchCheckpointIO().load_checkpoint(path, weights_only=weights_only, **kw)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError("AmberCheckpointIO.load_checkpoint: map_location must be a device or "
                            f"its name (tensors are read on the CPU), not {type(map_location).__name__}")
        store = pointer["store"]
        with self._lock:
            if _rank() == 0:
                run = self._runs.get(store)
                if run is None:
                    try:
                        run = self._run(store)
                    except AmberError as e:
                        if e.code != _amber.ELOCKED:
                            raise
                if run is not None:
                    return _load(run.ck, run, pointer, path, map_location)
            with _Local(store, readonly=True, rng=self.rng and _rank() == 0) as ck:
                return _load(ck, None, pointer, path, map_location)

    def remove_checkpoint(self, path):
        """Removes the file at `path` (a pointer: its step goes at the next prune)."""
        path = os.fspath(path)
        with self._lock:
            if os.path.islink(path) or os.path.isfile(path):
                os.remove(path)
            elif os.path.isdir(path):
                shutil.rmtree(path)
            for run in self._runs.values():
                if os.path.realpath(os.path.dirname(os.path.abspath(path))) in run.dirs:
                    run.prune_due = True

    def wait(self):
        """Blocks until every save in flight is committed and durable; raises a
        save's failure. (Lightning never needs it: each save waits for the one
        before it, and teardown() for the last.)"""
        with self._lock:
            for run in self._runs.values():
                _settle(run)

    def teardown(self):
        """Waits until the last save is committed and durable, prunes, releases the
        stores; raises a save's failure."""
        self._close_all()

    def _close_all(self, quiet=False):
        with self._lock:
            runs, self._runs = self._runs, {}
            err = None
            for run in runs.values():
                try:
                    _settle(run)
                    if run.prune_due:
                        self._prune(run)
                except AmberError as e:
                    err = err or e
                finally:
                    try:
                        run.ck.close()
                    except AmberError as e:
                        err = err or e
            if err is not None and not quiet:
                raise err


# ---- outside the Trainer ----------------------------------------------------------

def load(path, map_location=None):
    """Lightning's checkpoint dict behind the pointer file `path` (read-only; e.g.
    model.load_state_dict(load("last.ckpt")["state_dict"]))."""
    pointer = _read_pointer(os.fspath(path))
    if pointer is None:
        raise AmberError(_amber.EFORMAT, f"{path}: not an amber-lightning pointer",
                         name="AMBER_EFORMAT")
    with _Local(pointer["store"], readonly=True, rng=False) as ck:
        return _load(ck, None, pointer, os.fspath(path), map_location)


def load_from_checkpoint(cls, path, map_location=None, **kwargs):
    """cls.load_from_checkpoint(path, ...) for an amber pointer file: the Lightning
    module (or data module) `cls` built from the checkpoint behind `path`.
    LightningModule.load_from_checkpoint reads files with torch.load, which cannot read
    a pointer; this hands it the checkpoint in memory (nothing is written). kwargs go
    to load_from_checkpoint (strict=, hparams_file=, hyper-parameter overrides)."""
    buf = io.BytesIO()
    torch.save(load(path, map_location), buf)  # in memory only: what torch.load expects
    buf.seek(0)
    return cls.load_from_checkpoint(buf, map_location=map_location, **kwargs)


def export(path, out):
    """Writes the checkpoint behind the pointer `path` as a torch.save file at `out`:
    a Lightning checkpoint that LightningModule.load_from_checkpoint(out) reads."""
    torch.save(load(path), out)
