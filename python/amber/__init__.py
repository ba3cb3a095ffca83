"""amber - Python binding of libamber through ctypes (no compiled extension).

This module mirrors the C API of include/amber.h: a Store (one directory per
training run), a Writer that saves checkpoints from memory the caller owns, and a
Reader that restores them into memory the caller owns. Tensor data never passes
through Python: the binding hands raw addresses to the library. `amber.torch`
builds the PyTorch Checkpointer on top of this module.

Every failure raises AmberError, which carries the C error code, its symbolic
name (e.g. "AMBER_ENOENT") and the library's message for the failure (which file,
which step, what was expected).

The shared library is found, in this order, through the AMBER_LIBRARY
environment variable (a path), inside this package (amber/libamber.so, found with
importlib.resources: what `pip install .` and `pip install -e .` put there), in the
build/ directory of the source tree that holds this package
(python/amber/../../build/libamber.so), and finally by the system's loader
(libamber.so.0, e.g. after `make install`).

Thread safety: as in C, one handle must not be used by two threads at once; each
handle here holds a lock so that Python threads cannot do that by accident.
Separate handles may be used from separate threads.
"""

import ctypes
import ctypes.util
import logging
import os
import threading
import weakref
from ctypes import (POINTER, Structure, byref, c_char_p, c_double, c_int, c_int32,
                    c_int64, c_size_t, c_uint32, c_uint64, c_void_p)
from importlib import metadata as _metadata


# The logger "amber" (and its children) says what amber does: INFO when a load restores
# a step, WARNING when it falls back past a damaged step, DEBUG per save. Silent unless
# the application configures logging, as a library's logger should be.
logging.getLogger("amber").addHandler(logging.NullHandler())


def __getattr__(name):
    """amber.__version__: the version of the installed distribution amber-ckpt (what pip
    installed, wheel or editable), or, from a source tree that is not installed, the
    version the loaded libamber reports. Looked up on first use (the metadata lookup
    costs a scan of sys.path, which `import amber` need not pay)."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        v = _metadata.version("amber-ckpt")
    except _metadata.PackageNotFoundError:
        v = version()
    globals()["__version__"] = v
    return v


__all__ = [
    "AmberError", "PruneWarning", "Store", "Writer", "Reader", "CheckpointInfo", "TensorInfo",
    "version", "library_path", "check_policy", "dtype_size", "dtype_name", "dtype_from_name",
    "F32", "F16", "BF16", "F64", "F8_E4M3", "F8_E5M2", "I64", "I32", "I16", "I8",
    "U8", "BOOL", "U16", "U32", "U64", "LATEST", "NO_STEP", "HAS_ASYNC", "SAVE_CONFIRM",
    "EINVAL", "ENOMEM", "EIO", "ENOSPC", "ENOENT", "EEXIST", "ECORRUPT", "EFORMAT", "ELOCKED",
    "EMISMATCH", "EPARENT", "ERANGE", "EBUSY", "ECANCELED", "EPERM", "EREADONLY", "ECHANGED",
    "ETIMEDOUT",
    "GlobalWriter", "GlobalReader", "GlobalStepInfo", "GlobalTensorInfo", "is_global_store",
    "global_steps", "global_prune", "SHARD_REPLICATED",
    "Drain", "DrainStatus", "drain", "tier_durable", "tier_staging", "sweep", "is_url",
    "Replicas", "ReplicaStats", "TiersRestore", "tiers_restore",
]

# ---- constants (values are part of the C ABI and of the file format) ----------

F32, F16, BF16, F64, F8_E4M3, F8_E5M2, I64, I32, I16, I8, U8, BOOL, U16, U32, U64 = range(1, 16)
MAX_DIMS = 8
OPEN_READONLY = 1 << 0
OPEN_NOCREATE = 1 << 1
CKPT_DAMAGED = 1 << 0
WRITER_COMPRESS_FULL = 1 << 0
WRITER_NO_DIRECT_IO = 1 << 1
WRITER_GLOBAL_LOCAL = 1 << 2
SAVE_FULL = 1 << 0
SAVE_NO_REFERENCE = 1 << 1
SAVE_CONFIRM = 1 << 2
SAVE_VOTED = 1 << 3
READER_FALLBACK = 1 << 0
READER_FILES = 1 << 1  # the step's own files, never a memory tier's image of it
KIND_FULL, KIND_DELTA = 0, 1
NO_STEP = LATEST = (1 << 64) - 1
# Error codes, mirrored from AMBER_ERRNO_MAP in amber.h (tests/python/test_binding.py
# checks that the two agree). ECHANGED: a save refused because its tensors changed
# while it read them (see Writer.confirm).
EINVAL, ENOMEM, EIO, ENOSPC, ENOENT, EEXIST, ECORRUPT, EFORMAT = range(-1, -9, -1)
ELOCKED, EMISMATCH, EPARENT, ERANGE, EBUSY, ECANCELED, EPERM, EREADONLY = range(-9, -17, -1)
ECHANGED = -17
ETIMEDOUT = -18  # amber_drain_flush: the durable tier did not catch up in time

# ---- C structs, mirrored field by field -----------------------------------------


class _StoreOpts(Structure):
    _fields_ = [("flags", c_uint32), ("threads", c_uint32), ("reserved", c_uint64 * 6)]


class _WriterOpts(Structure):
    _fields_ = [("chunk_elems", c_uint64), ("flags", c_uint32), ("zstd_level", c_int32),
                ("full_every", c_uint32), ("reserved0", c_uint32), ("full_share", c_double),
                ("stage_bytes", c_uint64), ("keep_last", c_uint64), ("reserved", c_uint64 * 4)]


class _ReaderOpts(Structure):
    _fields_ = [("flags", c_uint32), ("reserved0", c_uint32), ("reserved", c_uint64 * 6)]


class _CkptInfo(Structure):
    _fields_ = [("step", c_uint64), ("kind", c_uint32), ("flags", c_uint32),
                ("parent", c_uint64), ("bytes", c_uint64), ("hash", c_uint64),
                ("reserved", c_uint64 * 3)]


class _TensorInfo(Structure):
    _fields_ = [("name", c_char_p), ("dtype", c_int), ("ndim", c_uint32),
                ("shape", c_int64 * MAX_DIMS), ("nelems", c_uint64), ("nbytes", c_uint64),
                ("stored_bytes", c_uint64), ("stored_elems", c_uint64),
                ("chunk_elems", c_uint64), ("nchunks", c_uint64), ("policy", c_char_p)]


# ---- loading the library --------------------------------------------------------

def _packaged_library():
    """libamber.so shipped inside this package (wheel or editable install)."""
    try:
        from importlib.resources import files, as_file
    except ImportError:  # Python < 3.9
        return None
    try:
        res = files(__name__).joinpath("libamber.so")
        if not res.is_file():
            return None
        # A wheel installs a real file; as_file only copies out of a zip, which pip never
        # makes, so the path stays valid for the life of the process.
        with as_file(res) as path:
            return str(path)
    except (OSError, TypeError, ModuleNotFoundError):
        return None


def _candidates():
    env = os.environ.get("AMBER_LIBRARY")
    if env:
        yield env
        return  # an explicit choice is not second-guessed
    packaged = _packaged_library()
    if packaged:
        yield packaged
    here = os.path.dirname(os.path.abspath(__file__))
    yield os.path.normpath(os.path.join(here, "..", "..", "build", "libamber.so"))
    found = ctypes.util.find_library("amber")
    if found:
        yield found


def _load():
    tried = []
    for path in _candidates():
        if os.sep in path and not os.path.exists(path):
            tried.append(f"{path} (missing)")
            continue
        try:
            return ctypes.CDLL(path), path
        except OSError as e:
            tried.append(f"{path} ({e})")
    raise ImportError("amber: cannot load libamber; tried: " + "; ".join(tried or ["nothing"]) +
                      ". Install the package (`pip install .`), build it with `make`, or set "
                      "AMBER_LIBRARY to its path.")


_lib, _lib_path = _load()
_H = c_void_p  # every handle is opaque


def _fn(name, restype, *argtypes):
    try:
        f = getattr(_lib, name)
    except AttributeError:
        raise ImportError(f"amber: {_lib_path} has no {name}: it is not the libamber of this "
                          "package (set AMBER_LIBRARY to a library of the same version)") from None
    f.restype = restype
    f.argtypes = list(argtypes)
    return f


_version = _fn("amber_version", c_uint32)
_policy_check = _fn("amber_policy_check", c_int, c_char_p)
_version_string = _fn("amber_version_string", c_char_p)
_strerror = _fn("amber_strerror", c_char_p, c_int)
_err_name = _fn("amber_err_name", c_char_p, c_int)
_last_error = _fn("amber_last_error", c_char_p, c_void_p)
_dtype_size = _fn("amber_dtype_size", c_size_t, c_int)
_dtype_name = _fn("amber_dtype_name", c_char_p, c_int)
_dtype_from_name = _fn("amber_dtype_from_name", c_int, c_char_p)
_free = _fn("amber_free", None, c_void_p)

_store_opts_init = _fn("amber_store_opts_init", None, POINTER(_StoreOpts))
_store_open = _fn("amber_store_open", c_int, POINTER(_H), c_char_p, POINTER(_StoreOpts))
_store_close = _fn("amber_store_close", None, _H)
_store_list = _fn("amber_store_list", c_int, _H, POINTER(POINTER(_CkptInfo)), POINTER(c_size_t))
_store_latest = _fn("amber_store_latest", c_int, _H, POINTER(c_uint64))
_store_compact = _fn("amber_store_compact", c_int, _H, c_uint64)
_store_prune = _fn("amber_store_prune", c_int, _H, c_uint64, POINTER(c_size_t))

_writer_opts_init = _fn("amber_writer_opts_init", None, POINTER(_WriterOpts))
_writer_open = _fn("amber_writer_open", c_int, POINTER(_H), _H, POINTER(_WriterOpts))
_writer_add = _fn("amber_writer_add", c_int, _H, c_char_p, c_int, c_uint32, POINTER(c_int64),
                  c_void_p, POINTER(c_size_t))
_writer_set_data = _fn("amber_writer_set_data", c_int, _H, c_size_t, c_void_p)
_writer_add_policy = _fn("amber_writer_add_policy", c_int, _H, c_char_p)
_writer_set_meta = _fn("amber_writer_set_meta", c_int, _H, c_char_p, c_size_t)
_writer_set_units = _fn("amber_writer_set_units", c_int, _H, POINTER(c_double), c_size_t)
_writer_save = _fn("amber_writer_save", c_int, _H, c_uint64, c_uint32)
_writer_close = _fn("amber_writer_close", None, _H)
_writer_begin = _fn("amber_writer_begin", c_int, _H, c_uint64, c_uint32)
_writer_fence = _fn("amber_writer_fence", c_int, _H)
_writer_wait = _fn("amber_writer_wait", c_int, _H)
_writer_confirm = _fn("amber_writer_confirm", c_int, _H, c_int, c_char_p)
_writer_seed_reference = _fn("amber_writer_seed_reference", c_int, _H, c_uint64)
_writer_prune_status = _fn("amber_writer_prune_status", c_int, _H, POINTER(c_size_t),
                           POINTER(c_char_p))
HAS_ASYNC = True  # the split save (begin/fence/wait); always there, kept for old callers

_reader_opts_init = _fn("amber_reader_opts_init", None, POINTER(_ReaderOpts))
_reader_open = _fn("amber_reader_open", c_int, POINTER(_H), _H, c_uint64, POINTER(_ReaderOpts))
_reader_close = _fn("amber_reader_close", None, _H)
_reader_skipped = _fn("amber_reader_skipped", c_size_t, _H)
_reader_step = _fn("amber_reader_step", c_uint64, _H)
_reader_ckpt_info = _fn("amber_reader_ckpt_info", c_int, _H, POINTER(_CkptInfo))
_reader_count = _fn("amber_reader_count", c_size_t, _H)
_reader_info = _fn("amber_reader_info", c_int, _H, c_size_t, POINTER(_TensorInfo))
_reader_find = _fn("amber_reader_find", c_int, _H, c_char_p, POINTER(c_size_t))
_reader_read = _fn("amber_reader_read", c_int, _H, c_size_t, c_void_p, c_uint64)
_reader_read_many = _fn("amber_reader_read_many", c_int, _H, c_size_t, POINTER(c_size_t),
                        POINTER(c_void_p), POINTER(c_uint64))
_reader_read_boxes = _fn("amber_reader_read_boxes", c_int, _H, c_size_t, POINTER(c_size_t),
                         POINTER(c_int64), POINTER(c_int64), POINTER(c_void_p),
                         POINTER(c_uint64))
_reader_meta = _fn("amber_reader_meta", c_int, _H, POINTER(c_void_p), POINTER(c_size_t))
_reader_verify = _fn("amber_reader_verify", c_int, _H)


def library_path():
    """Path of the loaded libamber."""
    return _lib_path


def version():
    """The linked library's version string, e.g. "0.2.0"."""
    return _version_string().decode()


def check_policy(rule):
    """Raises AmberError (AMBER_EINVAL, with the reason) unless `rule` ("SPEC" or
    "PATTERN=SPEC") is a policy rule that Writer.add_policy takes."""
    if not isinstance(rule, str):
        raise TypeError(f"a policy rule is a str, not {type(rule).__name__}")
    _check(_policy_check(rule.encode()), None)


def dtype_size(dtype):
    """Bytes per element of an amber dtype; 0 for an unknown one."""
    return _dtype_size(dtype)


def dtype_name(dtype):
    """Lower-case name of an amber dtype ("f32", "bf16", ...); None if unknown."""
    s = _dtype_name(dtype)
    return s.decode() if s else None


def dtype_from_name(name):
    """The amber dtype of a name as dtype_name() returns it; 0 if unknown."""
    return _dtype_from_name(name.encode())


# ---- errors -----------------------------------------------------------------------

class AmberError(Exception):
    """A libamber failure: `code` (negative AMBER_E* value), `name`
    ("AMBER_ENOENT", ...) and `message` (what failed: file, step, expectation).
    `partial` is True when a load failed after it had changed some live tensors."""

    partial = False

    def __init__(self, code, message, name=None):
        self.code = code
        self.name = name if name is not None else (_err_name(code) or b"").decode()
        self.message = message
        super().__init__(f"{self.name}: {message}" if self.name else message)

    def __reduce__(self):
        # picklable (DCP gathers a rank's exception to the coordinator), with the
        # attributes a plain Exception's pickle would lose
        return (_rebuild_error, (type(self), self.code, self.message, self.name, self.__dict__))


def _rebuild_error(cls, code, message, name, attrs):
    e = AmberError.__new__(cls)
    AmberError.__init__(e, code, message, name)
    e.__dict__.update(attrs)
    return e


class PruneWarning(UserWarning):
    """A checkpoint was committed, but removing old ones (keep_last) failed."""


def _error(code, handle):
    msg = (_last_error(handle) or b"").decode("utf-8", "replace")
    if not msg and handle is not None:
        msg = (_last_error(None) or b"").decode("utf-8", "replace")
    return AmberError(code, msg or (_strerror(code) or b"").decode())


def _check(rc, handle):
    if rc < 0:
        raise _error(rc, handle)
    return rc


def _name_bytes(name):
    b = name.encode("utf-8")
    if b"\0" in b:
        raise ValueError(f"name {name!r} contains a NUL character")
    return b


# ---- results ----------------------------------------------------------------------

class CheckpointInfo:
    """One committed checkpoint: step, kind ("full"/"delta"), parent (step or None),
    bytes (its file's size), hash (its state id) and damaged (its header or footer
    cannot be read: kind, parent and hash only as far as known; verify says why)."""
    __slots__ = ("step", "kind", "parent", "bytes", "hash", "damaged")

    def __init__(self, c):
        self.step = c.step
        self.kind = "full" if c.kind == KIND_FULL else "delta"
        self.parent = None if c.parent == NO_STEP else c.parent
        self.bytes = c.bytes
        self.hash = c.hash
        self.damaged = bool(c.flags & CKPT_DAMAGED)

    def __repr__(self):
        return (f"CheckpointInfo(step={self.step}, kind={self.kind!r}, parent={self.parent}, "
                f"bytes={self.bytes}{', damaged' if self.damaged else ''})")


class TensorInfo:
    """A tensor of an opened checkpoint: index, name, dtype (amber code), shape,
    nelems, nbytes, stored_bytes/stored_elems (in that step's file), chunking and
    the policy in effect at that step."""
    __slots__ = ("index", "name", "dtype", "shape", "nelems", "nbytes", "stored_bytes",
                 "stored_elems", "chunk_elems", "nchunks", "policy")

    def __init__(self, index, c):
        self.index = index
        self.name = c.name.decode("utf-8")
        self.dtype = c.dtype
        self.shape = tuple(c.shape[i] for i in range(c.ndim))
        self.nelems = c.nelems
        self.nbytes = c.nbytes
        self.stored_bytes = c.stored_bytes
        self.stored_elems = c.stored_elems
        self.chunk_elems = c.chunk_elems
        self.nchunks = c.nchunks
        self.policy = c.policy.decode() if c.policy else None

    def __repr__(self):
        return (f"TensorInfo({self.name!r}, {dtype_name(self.dtype)}, {self.shape}, "
                f"stored {self.stored_bytes} bytes, policy {self.policy!r})")


# ---- handles ----------------------------------------------------------------------

class _Handle:
    """An owned C handle: closed once, by close(), the context manager or the
    garbage collector; calls are serialized by a lock."""

    def __init__(self):
        self._h = None
        self._lock = threading.RLock()

    def _handle(self):
        if self._h is None:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._h

    @property
    def closed(self):
        return self._h is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class Store(_Handle):
    """A store: one directory of committed checkpoints.

    Store(path, readonly=False, create=True, threads=0). A writable store takes an
    exclusive lock (AmberError AMBER_ELOCKED if another process holds it) and clears
    what a crashed writer left behind. threads: workers for encode and restore,
    0 = online CPUs. Closing the store closes its writers and readers first."""

    def __init__(self, path, readonly=False, create=True, threads=0):
        super().__init__()
        opts = _StoreOpts()
        _store_opts_init(byref(opts))
        opts.flags = (OPEN_READONLY if readonly else 0) | (0 if create else OPEN_NOCREATE)
        opts.threads = threads
        h = _H()
        _check(_store_open(byref(h), os.fsencode(os.fspath(path)), byref(opts)), None)
        self._h = h.value
        self.path = os.fspath(path)
        self.readonly = readonly
        self._children = weakref.WeakSet()

    def close(self):
        with self._lock:
            if self._h is None:
                return
            for child in list(self._children):
                child.close()
            _store_close(self._h)
            self._h = None

    def list(self):
        """Committed checkpoints in increasing step order, as CheckpointInfo."""
        with self._lock:
            arr = POINTER(_CkptInfo)()
            n = c_size_t()
            _check(_store_list(self._handle(), byref(arr), byref(n)), self._h)
            try:
                return [CheckpointInfo(arr[i]) for i in range(n.value)]
            finally:
                _free(arr)

    def latest(self):
        """The latest committed step, or None for an empty store."""
        with self._lock:
            s = c_uint64()
            rc = _store_latest(self._handle(), byref(s))
            if rc == ENOENT:  # empty store
                return None
            _check(rc, self._h)
            return s.value

    def compact(self, step=None):
        """Rewrites `step` (default: latest) as a full checkpoint."""
        with self._lock:
            _check(_store_compact(self._handle(), LATEST if step is None else step), self._h)

    def prune(self, keep_last):
        """Deletes all but the newest `keep_last` checkpoints and what they need;
        returns the number of files removed."""
        with self._lock:
            n = c_size_t()
            _check(_store_prune(self._handle(), keep_last, byref(n)), self._h)
            return n.value

    def writer(self, **opts):
        """A Writer on this store; see Writer for the options."""
        return Writer(self, **opts)

    def reader(self, step=None, fallback=False):
        """A Reader of `step` (default: latest); see Reader for fallback."""
        return Reader(self, step, fallback)


class Writer(_Handle):
    """Saves checkpoints of tensors that live in caller-owned host memory.

    Writer(store, chunk_elems=0, compress_full=False, zstd_level=0, full_every=0,
    full_share=0.0, stage_bytes=0, direct_io=True, keep_last=0); zero means the
    library's default (full_every: a full checkpoint after 50 deltas; full_share: or
    once the deltas since the last full add up to 0.5 of it; UINT32_MAX / a negative
    share mean never; stage_bytes: host memory for encoded data waiting for the
    disk, 32 MiB; keep_last: keep every checkpoint). keep_last=K: after each
    committed save, remove all checkpoints but the newest K and those their
    restores need (see prune_status()).

    Ownership: add() and set_data() take a raw address (an int). The library reads
    that memory during save(), and from begin() until fence() (or wait/close)
    returns; the caller must keep it alive and unchanged for that long. It never
    reads it otherwise."""

    def __init__(self, store, chunk_elems=0, compress_full=False, zstd_level=0,
                 full_every=0, full_share=0.0, stage_bytes=0, direct_io=True, keep_last=0):
        super().__init__()
        opts = _WriterOpts()
        _writer_opts_init(byref(opts))
        opts.chunk_elems = chunk_elems
        opts.flags = (WRITER_COMPRESS_FULL if compress_full else 0) | \
            (0 if direct_io else WRITER_NO_DIRECT_IO)
        opts.zstd_level = zstd_level
        opts.full_every = full_every
        opts.full_share = full_share
        opts.stage_bytes = stage_bytes
        opts.keep_last = keep_last
        h = _H()
        with store._lock:
            _check(_writer_open(byref(h), store._handle(), byref(opts)), None)
            store._children.add(self)
        self._h = h.value
        self.store = store  # the store must outlive the writer
        self.count = 0

    def close(self):
        """Waits for a save in progress and releases the writer. Errors of that
        save are lost here: call wait() first to see them."""
        with self._lock:
            if self._h is None:
                return
            _writer_close(self._h)
            self._h = None

    def add(self, name, dtype, shape, address):
        """Declares a tensor (before the first save); returns its index."""
        with self._lock:
            shape = tuple(int(d) for d in shape)
            arr = (c_int64 * max(1, len(shape)))(*shape)
            idx = c_size_t()
            _check(_writer_add(self._handle(), _name_bytes(name), dtype, len(shape), arr,
                               address or None, byref(idx)), self._h)
            self.count += 1
            return idx.value

    def set_data(self, index, address):
        """Points tensor `index` at new memory of the same size."""
        with self._lock:
            _check(_writer_set_data(self._handle(), index, address or None), self._h)

    def add_policy(self, rule):
        """Adds a policy rule "SPEC" or "PATTERN=SPEC" (last match wins)."""
        with self._lock:
            _check(_writer_add_policy(self._handle(), rule.encode()), self._h)

    def set_units(self, units):
        """Sets the units of the declared tensors (in declaration order) for later
        saves: a rule's "Nu" means N times the tensor's unit; 0 = no unit (the tensor
        is exact under such a rule)."""
        arr = (c_double * max(1, len(units)))(*units)
        with self._lock:
            _check(_writer_set_units(self._handle(), arr, len(units)), self._h)

    def set_meta(self, data):
        """Sets the metadata (UTF-8 JSON, bytes or str) of later saves; copied."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        with self._lock:
            _check(_writer_set_meta(self._handle(), data, len(data)), self._h)

    def save(self, step, full=False, no_reference=False):
        """Saves and commits checkpoint `step`; durable when this returns.
        full: force a full checkpoint. no_reference: a one-off full save that
        keeps no reference state (AMBER_SAVE_NO_REFERENCE)."""
        with self._lock:
            _check(_writer_save(self._handle(), step, _save_flags(full, no_reference)), self._h)

    def begin(self, step, full=False, no_reference=False, confirm=False):
        """Starts saving `step` and returns once the scan is under way.
        confirm=True (AMBER_SAVE_CONFIRM): the save is written and made durable but commits
        only after confirm(True); confirm(False, why), or wait()/close() without
        a verdict, make it fail with AMBER_ECHANGED."""
        flags = _save_flags(full, no_reference)
        if confirm:
            flags |= SAVE_CONFIRM
        with self._lock:
            _check(_writer_begin(self._handle(), step, flags), self._h)

    def fence(self):
        """Blocks until the save in progress no longer reads the tensors."""
        with self._lock:
            _check(_writer_fence(self._handle()), self._h)

    def wait(self):
        """Blocks until the save in progress is durable; raises its failure."""
        with self._lock:
            _check(_writer_wait(self._handle()), self._h)

    def confirm(self, ok, why=""):
        """The verdict on the save begun with confirm=True: ok lets it commit;
        not ok makes it fail (wait() raises AmberError AMBER_ECHANGED whose
        message ends with `why`). Waits for the scan first, as fence() does.
        Raises AMBER_EINVAL when no save awaits a verdict."""
        with self._lock:
            _check(_writer_confirm(self._handle(), 1 if ok else 0,
                                   why.encode("utf-8", "replace") if why else None), self._h)

    def seed_reference(self, step):
        """States that the declared tensors' memory holds exactly the restored
        state of `step`, the store's latest committed step (as after a load of
        it): the writer copies it as its reference now, so the next save is a
        delta against `step` without reading the store. Raises AmberError
        (AMBER_EINVAL, AMBER_EMISMATCH, AMBER_ENOENT) naming what differs."""
        with self._lock:
            _check(_writer_seed_reference(self._handle(), step), self._h)


    def prune_status(self):
        """With keep_last: (code, removed, message) of the prune after the last
        committed save. A failed prune (code < 0, message says why) does not fail
        the save; the next save's prune tries again."""
        with self._lock:
            n, msg = c_size_t(), c_char_p()
            rc = _writer_prune_status(self._handle(), byref(n), byref(msg))
            return (rc, n.value, msg.value.decode("utf-8", "replace") if msg.value else None)


def _save_flags(full, no_reference):
    return (SAVE_FULL if full else 0) | (SAVE_NO_REFERENCE if no_reference else 0)


class Reader(_Handle):
    """Reads checkpoint `step` (default: latest) of a store: its tensors' infos,
    their restored bytes into caller memory, its metadata; verify().

    fallback=True verifies the step completely first and, if it is damaged, opens
    the newest older step that verifies instead (AMBER_READER_FALLBACK); `step`
    is then the step opened and `skipped` the number of newer steps passed over."""

    def __init__(self, store, step=None, fallback=False):
        super().__init__()
        opts = _ReaderOpts()
        _reader_opts_init(byref(opts))
        if fallback:
            opts.flags = READER_FALLBACK
        h = _H()
        with store._lock:
            _check(_reader_open(byref(h), store._handle(), LATEST if step is None else step,
                                byref(opts)), None)
            store._children.add(self)
        self._h = h.value
        self.store = store
        self.step = _reader_step(self._h)
        self.skipped = _reader_skipped(self._h) if fallback else 0
        self._infos = None

    def close(self):
        with self._lock:
            if self._h is None:
                return
            _reader_close(self._h)
            self._h = None

    def checkpoint(self):
        """CheckpointInfo of the opened step."""
        with self._lock:
            c = _CkptInfo()
            _check(_reader_ckpt_info(self._handle(), byref(c)), self._h)
            return CheckpointInfo(c)

    def __len__(self):
        with self._lock:
            return _reader_count(self._handle())

    def info(self, index):
        with self._lock:
            c = _TensorInfo()
            _check(_reader_info(self._handle(), index, byref(c)), self._h)
            return TensorInfo(index, c)

    def tensors(self):
        """TensorInfo of every tensor, in declaration order (cached)."""
        if self._infos is None:
            self._infos = [self.info(i) for i in range(len(self))]
        return self._infos

    def find(self, name):
        """Index of tensor `name`, or None if the checkpoint has none."""
        with self._lock:
            idx = c_size_t()
            rc = _reader_find(self._handle(), _name_bytes(name), byref(idx))
            if rc == ENOENT:
                return None
            _check(rc, self._h)
            return idx.value

    def read_into(self, index, address, size):
        """Restores tensor `index` into `size` bytes at `address` (size must equal
        its nbytes); every checksum is verified before this returns."""
        with self._lock:
            _check(_reader_read(self._handle(), index, address or None, size), self._h)

    def read_many(self, items):
        """Restores several tensors in one call: `items` is a sequence of
        (index, address, size) as for read_into. Every chunk of every tensor is a
        job for the library's threads, so many small tensors load in parallel."""
        items = list(items)
        if not items:
            return
        n = len(items)
        idx = (c_size_t * n)(*[i for i, _, _ in items])
        bufs = (c_void_p * n)(*[a or None for _, a, _ in items])
        sizes = (c_uint64 * n)(*[s for _, _, s in items])
        with self._lock:
            _check(_reader_read_many(self._handle(), n, idx, bufs, sizes), self._h)

    def read_boxes(self, items):
        """Restores several boxes of tensors in one call: `items` is a sequence of
        (index, offsets, shape, address, size): the region of tensor `index` at
        `offsets` of `shape` into `size` bytes at `address`, row-major. Only the
        chunks that hold part of a box are read; all of them in parallel."""
        items = list(items)
        if not items:
            return
        arrays = _box_arrays(items)
        with self._lock:
            _check(_reader_read_boxes(self._handle(), len(items), *arrays), self._h)

    def read(self, index):
        """Restores tensor `index` into a new bytearray."""
        n = self.info(index).nbytes
        buf = bytearray(n)
        addr = ctypes.addressof((ctypes.c_char * n).from_buffer(buf)) if n else 0
        self.read_into(index, addr, n)
        return buf

    def meta(self):
        """The checkpoint's metadata as bytes, or None when it has none."""
        with self._lock:
            p = c_void_p()
            n = c_size_t()
            _check(_reader_meta(self._handle(), byref(p), byref(n)), self._h)
            if not p.value or n.value == 0:
                return None
            return ctypes.string_at(p.value, n.value)

    def verify(self):
        """Checks everything this step's restore needs; raises AmberError
        naming the first damaged file."""
        with self._lock:
            _check(_reader_verify(self._handle()), self._h)


# ---- many ranks: the global writer and reader --------------------------------------

SHARD_REPLICATED = 1 << 0
_ALLGATHER = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_void_p)
_BROADCAST = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_int)
_BARRIER = ctypes.CFUNCTYPE(c_int, c_void_p)
_SENDRECV = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_size_t, c_int, c_void_p, c_size_t,
                             c_int)


class _Comm(Structure):
    _fields_ = [("rank", c_int), ("size", c_int), ("allgather", _ALLGATHER),
                ("broadcast", _BROADCAST), ("barrier", _BARRIER), ("ctx", c_void_p),
                ("flags", c_uint64), ("reserved", c_uint64 * 3)]
    # flags stays 0: a Python communicator is called on the thread that saves (the
    # commit of a split save runs in wait), never from the library's own threads


class _P2P(Structure):
    _fields_ = [("sendrecv", _SENDRECV), ("ctx", c_void_p), ("flags", c_uint64),
                ("reserved", c_uint64 * 3)]


class _GlobalStepInfo(Structure):
    _fields_ = [("step", c_uint64), ("kind", c_uint32), ("world_size", c_uint32),
                ("parent", c_uint64), ("bytes", c_uint64), ("flags", c_uint32),
                ("reserved0", c_uint32), ("reserved", c_uint64 * 3)]


class _GlobalTensor(Structure):
    _fields_ = [("name", c_char_p), ("dtype", c_int), ("ndim", c_uint32),
                ("shape", c_int64 * MAX_DIMS), ("nshards", c_uint32), ("flags", c_uint32),
                ("reserved", c_uint64 * 2)]


_comm_self = _fn("amber_comm_self", POINTER(_Comm))
_gw_open = _fn("amber_global_writer_open", c_int, POINTER(_H), c_char_p, POINTER(_Comm),
               POINTER(_WriterOpts))
_gw_add = _fn("amber_global_writer_add", c_int, _H, c_char_p, c_int, c_uint32, POINTER(c_int64),
              POINTER(c_int64), POINTER(c_int64), c_void_p, c_uint32)
_gw_set_data = _fn("amber_global_writer_set_data", c_int, _H, c_size_t, c_void_p)
_gw_set_meta = _fn("amber_global_writer_set_meta", c_int, _H, c_char_p, c_size_t)
_gw_add_policy = _fn("amber_global_writer_add_policy", c_int, _H, c_char_p)
_gw_set_units = _fn("amber_global_writer_set_units", c_int, _H, POINTER(c_double), c_size_t)
_gw_save = _fn("amber_global_writer_save", c_int, _H, c_uint64, c_uint32)
_gw_begin = _fn("amber_global_writer_begin", c_int, _H, c_uint64, c_uint32)
_gw_wants_full = _fn("amber_global_writer_wants_full", c_int, _H, c_uint64, c_uint32,
                     POINTER(c_int))
_gw_fence = _fn("amber_global_writer_fence", c_int, _H)
_gw_wait = _fn("amber_global_writer_wait", c_int, _H)
_gw_confirm = _fn("amber_global_writer_confirm", c_int, _H, c_int, c_char_p)
_gw_seed = _fn("amber_global_writer_seed_reference", c_int, _H, c_uint64)
_gw_close = _fn("amber_global_writer_close", None, _H)
_gw_prune_status = _fn("amber_global_writer_prune_status", c_int, _H, POINTER(c_size_t),
                       POINTER(c_char_p))
_gw_add_preselected = _fn("amber_global_writer_add_preselected", c_int, _H, c_char_p, c_int,
                          c_uint32, POINTER(c_int64), POINTER(c_int64), POINTER(c_int64),
                          c_uint32)
_gw_plan = _fn("amber_global_writer_plan", c_int, _H, c_uint64, c_uint32, POINTER(c_uint32))
_gw_info = _fn("amber_global_writer_info", c_int, _H, c_size_t, POINTER(_TensorInfo))
# the selections: a ctypes array of amber.device's amber_chunk_sel
_gw_set_selection = _fn("amber_global_writer_set_selection", c_int, _H, c_size_t, c_void_p,
                        c_uint64)
_gw_set_source = _fn("amber_global_writer_set_source", c_int, _H, c_size_t, c_void_p, c_void_p)
_g_is_store = _fn("amber_global_is_store", c_int, c_char_p)
_g_list = _fn("amber_global_list", c_int, c_char_p, POINTER(POINTER(_GlobalStepInfo)),
              POINTER(c_size_t))
_g_prune = _fn("amber_global_prune", c_int, c_char_p, c_uint64, POINTER(c_size_t))
_gr_open = _fn("amber_global_reader_open", c_int, POINTER(_H), c_char_p, c_uint64)
_gr_close = _fn("amber_global_reader_close", None, _H)
_gr_step = _fn("amber_global_reader_step", c_uint64, _H)
_gr_world = _fn("amber_global_reader_world_size", c_uint32, _H)
_gr_count = _fn("amber_global_reader_count", c_size_t, _H)
_gr_tensor = _fn("amber_global_reader_tensor", c_int, _H, c_size_t, POINTER(_GlobalTensor))
_gr_find = _fn("amber_global_reader_find", c_int, _H, c_char_p, POINTER(c_size_t))
_gr_read = _fn("amber_global_reader_read", c_int, _H, c_size_t, POINTER(c_int64),
               POINTER(c_int64), c_void_p, c_uint64)
_gr_read_many = _fn("amber_global_reader_read_many", c_int, _H, c_size_t, POINTER(c_size_t),
                    POINTER(c_int64), POINTER(c_int64), POINTER(c_void_p), POINTER(c_uint64))
_gr_meta = _fn("amber_global_reader_meta", c_int, _H, c_uint32, POINTER(c_void_p),
               POINTER(c_size_t))
_gr_verify = _fn("amber_global_reader_verify", c_int, _H)


class _ReplicasOpts(Structure):
    _fields_ = [("host", c_char_p), ("keep_last", c_uint64), ("flags", c_uint32),
                ("reserved0", c_uint32), ("reserved", c_uint64 * 4)]


class _ReplicasStats(Structure):
    _fields_ = [("step", c_uint64), ("sent_bytes", c_uint64), ("received_bytes", c_uint64),
                ("total_sent", c_uint64), ("total_received", c_uint64), ("seconds", c_double),
                ("reserved", c_uint64 * 4)]


class _TiersResult(Structure):
    _fields_ = [("step", c_uint64), ("tier", c_uint32), ("world_size", c_uint32),
                ("dir", c_void_p), ("fetched_bytes", c_uint64), ("ranks_memory", c_uint32),
                ("ranks_peer", c_uint32), ("ranks_durable", c_uint32), ("reserved0", c_uint32),
                ("reserved", c_uint64 * 4)]


_rep_opts_init = _fn("amber_replicas_opts_init", None, POINTER(_ReplicasOpts))
_rep_open = _fn("amber_replicas_open", c_int, POINTER(_H), c_char_p, POINTER(_Comm),
                POINTER(_P2P), c_uint32, POINTER(_ReplicasOpts))
_rep_step = _fn("amber_replicas_step", c_int, _H, c_uint64)
_rep_peers = _fn("amber_replicas_peers", c_int, _H, POINTER(c_int), c_size_t, POINTER(c_size_t))
_rep_stats = _fn("amber_replicas_stats_get", c_int, _H, POINTER(_ReplicasStats))
_rep_close = _fn("amber_replicas_close", None, _H)
_tiers_restore = _fn("amber_tiers_restore", c_int, c_char_p, c_char_p, POINTER(_Comm),
                     POINTER(_P2P), POINTER(_TiersResult))
_RESTORE_TIERS = {0: None, 1: "memory", 2: "peer", 3: "durable"}


def _dims(values):
    values = tuple(int(d) for d in values)
    return (c_int64 * max(1, len(values)))(*values), len(values)


def _box_arrays(items):
    """The C arrays of a read of boxes: (index, offsets, shape, address, size) each;
    offsets and shapes at a stride of MAX_DIMS."""
    n = len(items)
    idx, bufs, sizes = (c_size_t * n)(), (c_void_p * n)(), (c_uint64 * n)()
    off, shp = (c_int64 * (n * MAX_DIMS))(), (c_int64 * (n * MAX_DIMS))()
    for i, (index, o, s, address, size) in enumerate(items):
        if len(o) > MAX_DIMS or len(s) != len(o):
            raise ValueError(f"a box of {len(o)} offsets and {len(s)} sizes")
        idx[i], bufs[i], sizes[i] = index, address or None, size
        off[i * MAX_DIMS:i * MAX_DIMS + len(o)] = [int(x) for x in o]
        shp[i * MAX_DIMS:i * MAX_DIMS + len(s)] = [int(x) for x in s]
    return idx, off, shp, bufs, sizes


class _Bridge:
    """What the ctypes callbacks over a Python object share: an exception inside one is
    kept (`error`) and reported to the library as AMBER_EIO, so that it never unwinds
    through C; `check` then raises it, named and chained."""

    what = "collective"

    def __init__(self):
        self.error = None

    def guard(self, fn):
        def call(*args):
            try:
                fn(*args)
                return 0
            except BaseException as e:  # never let an exception cross the C frames
                if self.error is None:
                    self.error = e
                return EIO
        return call

    def check(self, rc, handle):
        """_check, with the callback's own exception named and chained."""
        err, self.error = self.error, None
        if rc < 0 and err is not None:
            e = _error(rc, handle)
            if getattr(err, "ranks", None):  # the comm knows which ranks are gone
                e = AmberError(rc, f"{e.message}: {err}", name=e.name)
                e.rank = err.ranks[0]
            else:
                e = AmberError(rc, f"{e.message} ({self.what} failed: {type(err).__name__}: "
                               f"{err})", name=e.name)
            raise e from err
        return _check(rc, handle)


def _check_bridges(rc, handle, *bridges):
    """_check after a call through several bridges: the first callback exception
    (any bridge's) is raised, named and chained, and every bridge is reset."""
    failed = next((b for b in bridges if b.error is not None), None)
    for b in bridges:
        if b is not failed:
            b.error = None
    return failed.check(rc, handle) if failed is not None else _check(rc, handle)


class _CommBridge(_Bridge):
    """An amber_comm whose collectives are the methods of a Python object:
    `rank`, `size`, `allgather(data: bytes) -> bytes` (every rank's bytes, rank
    order), `broadcast(data: bytes, root) -> bytes` and `barrier()`. The library
    calls them on the thread that called it. The ctypes callbacks live as long as
    this object."""

    def __init__(self, comm):
        super().__init__()
        self.comm = comm

        def allgather(_ctx, send, n, recv):
            out = comm.allgather(ctypes.string_at(send, n) if n else b"")
            if len(out) != n * comm.size:
                raise RuntimeError(f"allgather returned {len(out)} bytes, not {n * comm.size}")
            if n:
                ctypes.memmove(recv, out, len(out))

        def broadcast(_ctx, buf, n, root):
            out = comm.broadcast(ctypes.string_at(buf, n) if n else b"", root)
            if len(out) != n:
                raise RuntimeError(f"broadcast returned {len(out)} bytes, not {n}")
            if n:
                ctypes.memmove(buf, out, n)

        self._cbs = (_ALLGATHER(self.guard(allgather)), _BROADCAST(self.guard(broadcast)),
                     _BARRIER(self.guard(lambda _ctx: comm.barrier())))
        self.c = _Comm(rank=comm.rank, size=comm.size, allgather=self._cbs[0],
                       broadcast=self._cbs[1], barrier=self._cbs[2], ctx=None)


class _P2PBridge(_Bridge):
    """An amber_p2p whose exchange is the method of a Python object:
    `sendrecv(data: bytes, dest, rlen, src) -> bytes` sends `data` to rank `dest` and
    returns the `rlen` bytes that rank `src` sent, both at once (as MPI_Sendrecv: post
    the receive before waiting on the send, so that a ring cannot deadlock); `dest`
    None: nothing to send (data is b""); `src` None: nothing to receive (return b"").
    An object that also has `sendrecv_into(send, dest, recv, src)` gets that instead,
    with memoryviews of the library's own buffers (valid during the call): it sends
    `send` and fills `recv` in place, copying nothing (a replica or a restore moves a
    rank's whole chain this way). Ranks as the communicator beside it numbers them.
    Called on the thread that called the library."""

    what = "sendrecv"

    def __init__(self, p2p):
        super().__init__()
        self.p2p = p2p

        def view(address, n):
            return memoryview((ctypes.c_ubyte * n).from_address(address)).cast("B")

        def sendrecv(_ctx, send, slen, dest, recv, rlen, src):
            data = ctypes.string_at(send, slen) if slen and dest >= 0 else b""
            out = p2p.sendrecv(data, dest if dest >= 0 else None, rlen if src >= 0 else 0,
                               src if src >= 0 else None)
            want = rlen if src >= 0 else 0
            if out is None:
                out = b""
            if len(out) != want:
                raise RuntimeError(f"sendrecv returned {len(out)} bytes, not {want}")
            if want:
                ctypes.memmove(recv, bytes(out), want)

        def sendrecv_into(_ctx, send, slen, dest, recv, rlen, src):
            empty = memoryview(b"")
            p2p.sendrecv_into(view(send, slen) if slen and dest >= 0 else empty,
                              dest if dest >= 0 else None,
                              view(recv, rlen) if rlen and src >= 0 else empty,
                              src if src >= 0 else None)

        fast = callable(getattr(p2p, "sendrecv_into", None))
        self._cb = _SENDRECV(self.guard(sendrecv_into if fast else sendrecv))
        self.c = _P2P(sendrecv=self._cb, ctx=None)


class GlobalWriter(_Handle):
    """This rank's global writer of the multi-rank store at `path`.

    GlobalWriter(path, comm=None, **writer options as for Writer, local=False). `comm`
    is an object with `rank`, `size`, `allgather(bytes) -> bytes`, `broadcast(bytes,
    root) -> bytes` and `barrier()` (amber.torch's distributed Checkpointer gives
    one over torch.distributed); None is a job of one rank. local=True: `path` is this
    rank's own or its host's (a memory tier), and every rank's path gets each step's
    manifest and GLOBAL (AMBER_WRITER_GLOBAL_LOCAL; docs/DESIGN.md, "Local mode"). Opening, save, begin,
    plan and wait are collective (every rank calls them, in the same order); add,
    add_preselected, set_data, set_meta, info, set_selection, fence and confirm are
    this rank's alone. Ownership of the tensors' memory as for Writer; pre-selected
    tensors (add_preselected, driven by amber.device) as for amber.device."""

    def __init__(self, path, comm=None, chunk_elems=0, compress_full=False, zstd_level=0,
                 full_every=0, full_share=0.0, stage_bytes=0, direct_io=True, keep_last=0,
                 local=False):
        super().__init__()
        opts = _WriterOpts()
        _writer_opts_init(byref(opts))
        opts.chunk_elems = chunk_elems
        opts.flags = (WRITER_COMPRESS_FULL if compress_full else 0) | \
            (0 if direct_io else WRITER_NO_DIRECT_IO) | (WRITER_GLOBAL_LOCAL if local else 0)
        opts.zstd_level, opts.full_every, opts.full_share = zstd_level, full_every, full_share
        opts.stage_bytes, opts.keep_last = stage_bytes, keep_last
        self._bridge = _CommBridge(comm) if comm is not None else None
        c = byref(self._bridge.c) if self._bridge else _comm_self()
        self.rank = comm.rank if comm is not None else 0
        self.size = comm.size if comm is not None else 1
        h = _H()
        self._call(_gw_open(byref(h), os.fsencode(os.fspath(path)), c, byref(opts)), None)
        self._h = h.value
        self.path = os.fspath(path)
        self.count = 0
        self._boxes = []  # (offsets, local shape) of each declaration, by index

    def _call(self, rc, handle):
        if self._bridge is not None:
            return self._bridge.check(rc, handle)
        return _check(rc, handle)

    def close(self):
        """Releases the writer (waiting for this rank's save in progress, whose
        result is lost: call wait() first). Not collective."""
        with self._lock:
            if self._h is None:
                return
            _gw_close(self._h)
            self._h = None

    def add(self, name, dtype, global_shape, offsets, local_shape, address, replicated=False):
        """Declares this rank's box of global tensor `name` (before the first
        save); replicated=True: the whole tensor, written by rank 0 alone. A rank
        holding several shards of a tensor calls it once per box (disjoint boxes of
        one dtype and global shape). Returns its index (declaration order) for
        set_data, box, info and set_selection."""
        with self._lock:
            g, n = _dims(global_shape)
            o, _ = _dims(offsets if not replicated else [0] * n)
            s, _ = _dims(local_shape if not replicated else global_shape)
            _check(_gw_add(self._handle(), _name_bytes(name), dtype, n, g, o, s, address or None,
                           SHARD_REPLICATED if replicated else 0), self._h)
            return self._declared(o, s, n)

    def add_preselected(self, name, dtype, global_shape, offsets, local_shape, replicated=False):
        """Declares this rank's box of global tensor `name` as pre-selected (the
        caller selects it on its device: amber.device); as add() without memory.
        Returns its index."""
        with self._lock:
            g, n = _dims(global_shape)
            o, _ = _dims(offsets if not replicated else [0] * n)
            s, _ = _dims(local_shape if not replicated else global_shape)
            _check(_gw_add_preselected(self._handle(), _name_bytes(name), dtype, n, g, o, s,
                                       SHARD_REPLICATED if replicated else 0), self._h)
            return self._declared(o, s, n)

    def _declared(self, offsets, shape, ndim):
        self._boxes.append((tuple(offsets[:ndim]), tuple(shape[:ndim])))
        self.count += 1
        return self.count - 1

    def box(self, index):
        """(offsets, local shape) of declaration `index`: the box of its global
        tensor that this rank holds (the whole of a replicated one)."""
        return self._boxes[index]

    def plan(self, step, full=False, confirm=False):
        """The kind (KIND_FULL or KIND_DELTA) of the next save of `step`, the same
        on every rank, fixed for a begin() or save() with the same arguments
        (collective: amber_global_writer_plan)."""
        flags = (SAVE_FULL if full else 0) | (SAVE_CONFIRM if confirm else 0)
        kind = c_uint32()
        with self._lock:
            self._call(_gw_plan(self._handle(), step, flags, byref(kind)), self._h)
        return kind.value

    def info(self, index):
        """TensorInfo of tensor `index` as this rank's writer saves it (its shard's
        chunking; the policy resolved by the last plan). Not collective."""
        c = _TensorInfo()
        with self._lock:
            _check(_gw_info(self._handle(), index, byref(c)), None)
        return TensorInfo(index, c)

    def set_selection(self, index, sels, count):
        """Hands pre-selected tensor `index`'s `count` chunk selections (a ctypes
        array of amber.device's amber_chunk_sel) to the next save; what they point
        to must stay until the fence. Not collective."""
        with self._lock:
            _check(_gw_set_selection(self._handle(), index, sels, count), self._h)

    def set_source(self, index, fn):
        """Gives pre-selected tensor `index` a source of selections (a ctypes
        amber_chunk_source callback, kept alive by the caller; None removes it), asked
        per chunk by the save when no selection was set. Not collective."""
        with self._lock:
            ptr = ctypes.cast(fn, c_void_p) if fn else None
            _check(_gw_set_source(self._handle(), index, ptr, None), self._h)

    def set_data(self, index, address):
        with self._lock:
            _check(_gw_set_data(self._handle(), index, address or None), self._h)

    def add_policy(self, rule):
        with self._lock:
            _check(_gw_add_policy(self._handle(), rule.encode()), self._h)

    def set_units(self, units):
        """As Writer.set_units, for the tensors in declaration order (not collective)."""
        arr = (c_double * max(1, len(units)))(*units)
        with self._lock:
            _check(_gw_set_units(self._handle(), arr, len(units)), self._h)

    def set_meta(self, data):
        """This rank's metadata (UTF-8 JSON) of later saves, in its own file; copied."""
        if isinstance(data, str):
            data = data.encode("utf-8")
        with self._lock:
            _check(_gw_set_meta(self._handle(), data, len(data)), self._h)

    def save(self, step, full=False):
        """Saves and commits global step `step` (collective)."""
        with self._lock:
            self._call(_gw_save(self._handle(), step, SAVE_FULL if full else 0), self._h)

    def begin(self, step, full=False, confirm=False, voted=False):
        """Starts this rank's part of `step` (collective: one allgather, which decides
        full or delta; none with voted=True: the ranks agreed already, every rank
        passing the same `full`, see wants_full)."""
        flags = (SAVE_FULL if full else 0) | (SAVE_CONFIRM if confirm else 0) | \
            (SAVE_VOTED if voted else 0)
        with self._lock:
            self._call(_gw_begin(self._handle(), step, flags), self._h)

    def wants_full(self, step, full=False):
        """Whether this rank wants `step` to be full (what begin's own vote carries;
        not collective)."""
        out = c_int()
        with self._lock:
            _check(_gw_wants_full(self._handle(), step, SAVE_FULL if full else 0, byref(out)),
                   self._h)
        return bool(out.value)

    def fence(self):
        with self._lock:
            _check(_gw_fence(self._handle()), self._h)

    def confirm(self, ok, why=""):
        """The verdict on this rank's part of a save begun with confirm=True."""
        with self._lock:
            _check(_gw_confirm(self._handle(), 1 if ok else 0,
                               why.encode("utf-8", "replace") if why else None), self._h)

    def seed_reference(self, step):
        """As Writer.seed_reference, for this rank's part after a load of `step`, the
        latest global step, at the world size and sharding that wrote it: the next
        save is a delta against it without reading the rank's files. Not collective.
        Raises AmberError (AMBER_EMISMATCH: another world size, other boxes) naming
        what differs; the next save then reads its reference."""
        with self._lock:
            _check(_gw_seed(self._handle(), step), self._h)

    def wait(self):
        """The global commit (collective); raises the step's failure, the same on
        every rank, naming the rank that failed."""
        with self._lock:
            self._call(_gw_wait(self._handle()), self._h)

    def prune_status(self):
        """With keep_last: (code, removed, message) of this rank's part of the prune
        after the last committed step (rank 0 removes the older steps' manifests,
        every rank its files that no kept step needs). A failed prune (code < 0)
        does not fail the save; the next step's prune tries again. Not collective."""
        with self._lock:
            n, msg = c_size_t(), c_char_p()
            rc = _gw_prune_status(self._handle(), byref(n), byref(msg))
            return (rc, n.value, msg.value.decode("utf-8", "replace") if msg.value else None)


class GlobalStepInfo:
    """A committed global step: step, kind ("full"/"delta"), world_size, parent,
    bytes (every rank's files and the manifest), damaged: its manifest cannot be
    read (then kind and world_size are None; GlobalReader says why)."""
    __slots__ = ("step", "kind", "world_size", "parent", "bytes", "damaged")

    def __init__(self, c):
        self.step, self.world_size, self.bytes = c.step, c.world_size, c.bytes
        self.damaged = bool(c.flags & CKPT_DAMAGED)
        self.kind = None if self.damaged else "full" if c.kind == KIND_FULL else "delta"
        self.world_size = None if self.damaged else c.world_size
        self.parent = None if c.parent == NO_STEP else c.parent

    def __repr__(self):
        return (f"GlobalStepInfo(step={self.step}, kind={self.kind!r}, "
                f"world_size={self.world_size}, parent={self.parent}, bytes={self.bytes}"
                f"{', damaged=True' if self.damaged else ''})")


class GlobalTensorInfo:
    """A global tensor of a step: index, name, dtype, (global) shape, nshards, replicated."""
    __slots__ = ("index", "name", "dtype", "shape", "nshards", "replicated")

    def __init__(self, index, c):
        self.index = index
        self.name = c.name.decode("utf-8")
        self.dtype = c.dtype
        self.shape = tuple(c.shape[i] for i in range(c.ndim))
        self.nshards = c.nshards
        self.replicated = bool(c.flags & SHARD_REPLICATED)

    @property
    def nbytes(self):
        n = dtype_size(self.dtype)
        for d in self.shape:
            n *= d
        return n

    def __repr__(self):
        return f"GlobalTensorInfo({self.name!r}, {dtype_name(self.dtype)}, {self.shape})"


def is_global_store(path):
    """True when `path` is a multi-rank store."""
    return bool(_g_is_store(os.fsencode(os.fspath(path))))


def global_steps(path):
    """The committed global steps of multi-rank store `path`, oldest first."""
    arr = POINTER(_GlobalStepInfo)()
    n = c_size_t()
    _check(_g_list(os.fsencode(os.fspath(path)), byref(arr), byref(n)), None)
    try:
        return [GlobalStepInfo(arr[i]) for i in range(n.value)]
    finally:
        _free(arr)


def global_prune(path, keep_last):
    """Keeps the newest `keep_last` global steps; returns the number removed."""
    n = c_size_t()
    _check(_g_prune(os.fsencode(os.fspath(path)), keep_last, byref(n)), None)
    return n.value


class GlobalReader(_Handle):
    """Reads global step `step` (default: latest) of a multi-rank store at any
    world size: its global tensor table, any box of a global tensor, each rank's
    metadata. Not collective."""

    def __init__(self, path, step=None):
        super().__init__()
        h = _H()
        _check(_gr_open(byref(h), os.fsencode(os.fspath(path)),
                        LATEST if step is None else step), None)
        self._h = h.value
        self.path = os.fspath(path)
        self.step = _gr_step(self._h)
        self.world_size = _gr_world(self._h)
        self._infos = None

    def close(self):
        with self._lock:
            if self._h is None:
                return
            _gr_close(self._h)
            self._h = None

    def tensors(self):
        """GlobalTensorInfo of every global tensor (cached)."""
        if self._infos is None:
            with self._lock:
                out = []
                for i in range(_gr_count(self._handle())):
                    c = _GlobalTensor()
                    _check(_gr_tensor(self._h, i, byref(c)), self._h)
                    out.append(GlobalTensorInfo(i, c))
                self._infos = out
        return self._infos

    def find(self, name):
        """Index of global tensor `name`, or None."""
        with self._lock:
            idx = c_size_t()
            rc = _gr_find(self._handle(), _name_bytes(name), byref(idx))
            if rc == ENOENT:
                return None
            _check(rc, None)
            return idx.value

    def read_into(self, index, offsets, shape, address, size):
        """Reads the box at `offsets` of `shape` of tensor `index` (row-major,
        `size` bytes) into `address`; every checksum checked."""
        with self._lock:
            o, n = _dims(offsets)
            s, _ = _dims(shape)
            _check(_gr_read(self._handle(), index, o, s, address or None, size), self._h)

    def read_many(self, items):
        """Reads several boxes in one call: `items` is a sequence of (index,
        offsets, shape, address, size) as for read_into. Every chunk of every shard
        that holds part of a box is restored in parallel, straight into the box's
        memory where it maps to a contiguous run of it; boxes must not overlap."""
        items = list(items)
        if not items:
            return
        arrays = _box_arrays(items)
        with self._lock:
            _check(_gr_read_many(self._handle(), len(items), *arrays), self._h)

    def meta(self, rank):
        """Rank `rank`'s metadata as bytes, or None when it stored none."""
        with self._lock:
            p, n = c_void_p(), c_size_t()
            _check(_gr_meta(self._handle(), rank, byref(p), byref(n)), self._h)
            return ctypes.string_at(p.value, n.value) if p.value and n.value else None

    def verify(self):
        with self._lock:
            _check(_gr_verify(self._handle()), self._h)


# ---- storage tiers: the drain from a memory tier to its durable tier ------------


class _DrainOpts(Structure):
    _fields_ = [("max_lag_steps", c_uint64), ("max_lag_bytes", c_uint64),
                ("memory_budget", c_uint64), ("rank", c_int32), ("flags", c_uint32),
                ("reserved", c_uint64 * 4)]


class _DrainStatus(Structure):
    _fields_ = [("memory_step", c_uint64), ("durable_step", c_uint64),
                ("lag_steps", c_uint64), ("lag_bytes", c_uint64), ("memory_bytes", c_uint64),
                ("drained_bytes", c_uint64), ("drained_files", c_uint64), ("error", c_int),
                ("wants_full", c_int), ("image_step", c_uint64), ("reserved", c_uint64 * 3)]


_drain_opts_init = _fn("amber_drain_opts_init", None, POINTER(_DrainOpts))
_drain_start = _fn("amber_drain_start", c_int, POINTER(_H), c_char_p, c_char_p,
                   POINTER(_DrainOpts))
_drain_kick = _fn("amber_drain_kick", c_int, _H)
_drain_wants_full = _fn("amber_drain_wants_full", c_int, _H)
_drain_flush = _fn("amber_drain_flush", c_int, _H, c_double)
_drain_status = _fn("amber_drain_get_status", c_int, _H, POINTER(_DrainStatus))
_drain_close = _fn("amber_drain_close", c_int, _H)
_drain_run = _fn("amber_drain_run", c_int, c_char_p, c_char_p, POINTER(_DrainOpts))
_tier_durable = _fn("amber_tier_durable", c_int, c_char_p, POINTER(c_void_p))
_tier_staging = _fn("amber_tier_staging", c_int, c_char_p, POINTER(c_void_p))
_store_sweep = _fn("amber_store_sweep", c_int, c_char_p, c_uint64, POINTER(c_size_t))


DRAIN_IMAGE = 1  # AMBER_DRAIN_IMAGE


def _drain_opts(max_lag_steps, max_lag_bytes, memory_budget, rank, image=False):
    o = _DrainOpts()
    _drain_opts_init(byref(o))
    o.max_lag_steps, o.max_lag_bytes = int(max_lag_steps or 0), int(max_lag_bytes or 0)
    o.memory_budget, o.rank = int(memory_budget or 0), int(rank)
    o.flags = DRAIN_IMAGE if image else 0
    return o


def _opt_path(path):
    return None if path is None else os.fsencode(os.fspath(path))


class DrainStatus:
    """Where a drain stands: `memory_step` and `durable_step` (None when none), the
    lag (`lag_steps`, `lag_bytes`), `memory_bytes` the memory tier holds, what this
    drain copied (`drained_bytes`, `drained_files`), `error` (its sticky AMBER_E*
    code, or 0), `wants_full`, and `image_step`: the step the memory tier's image
    holds (Drain(..., image=True); None when there is none)."""

    def __init__(self, st):
        none = lambda v: None if v == NO_STEP else v  # noqa: E731
        self.memory_step, self.durable_step = none(st.memory_step), none(st.durable_step)
        self.lag_steps, self.lag_bytes = st.lag_steps, st.lag_bytes
        self.memory_bytes = st.memory_bytes
        self.drained_bytes, self.drained_files = st.drained_bytes, st.drained_files
        self.error, self.wants_full = st.error, bool(st.wants_full)
        self.image_step = none(st.image_step)

    def __repr__(self):
        return (f"DrainStatus(memory_step={self.memory_step}, durable_step="
                f"{self.durable_step}, lag_steps={self.lag_steps}, error={self.error})")


class Drain(_Handle):
    """Drains the committed steps of the store at `memory` (the memory tier) to the
    store at `durable` (the durable tier) on a thread of the library, in commit
    order, each step's files first and its pointer last (amber_drain_start).

    Drain(memory, durable=None, max_lag_steps=0, max_lag_bytes=0, memory_budget=0,
          rank=-1, image=False). durable None: the one the memory tier's TIERS file
    records. 0 means no bound. rank: a multi-rank memory tier's rank store that this
    process drains (rank 0 also drains the manifests and GLOBAL); -1 for a store of
    one process, or every rank store the directory holds. image: keep an image of
    each drained store's newest step (AMBER_DRAIN_IMAGE), so that a restart from the
    memory tier reads one file.

    kick() after each commit (back-pressure, and the drain's sticky error raised);
    wants_full(); flush(timeout=None); status(); close() (stops after the file in
    progress; what is left resumes at the next start or with `amber drain`)."""

    def __init__(self, memory, durable=None, max_lag_steps=0, max_lag_bytes=0,
                 memory_budget=0, rank=-1, image=False):
        super().__init__()
        o = _drain_opts(max_lag_steps, max_lag_bytes, memory_budget, rank, image)
        h = _H()
        _check(_drain_start(byref(h), _opt_path(memory), _opt_path(durable), byref(o)), None)
        self._h = h
        self.memory, self.durable = os.fspath(memory), durable

    def kick(self):
        """Wakes the drain after a commit, waits while it lags beyond its bounds or the
        memory tier is over budget, and raises its sticky error (AmberError)."""
        h = self._handle()  # no lock: the library's calls are thread safe
        _check(_drain_kick(h), h)

    def wants_full(self):
        return bool(_drain_wants_full(self._handle()))

    def flush(self, timeout=None):
        """Waits until every step committed so far is durable (AMBER_ETIMEDOUT after
        `timeout` seconds; None: no limit)."""
        h = self._handle()
        _check(_drain_flush(h, -1.0 if timeout is None else float(timeout)), h)

    def status(self):
        st = _DrainStatus()
        h = self._handle()
        _drain_status(h, byref(st))
        return DrainStatus(st)

    def close(self):
        with self._lock:
            h, self._h = self._h, None
            if h is not None:
                rc = _drain_close(h)
                if rc < 0:
                    raise _error(rc, None)


def drain(memory, durable=None, rank=-1):
    """Drains everything committed to the memory tier `memory` to `durable` (None: the
    recorded one), in this thread (what `amber drain` runs)."""
    o = _drain_opts(0, 0, 0, rank)
    _check(_drain_run(_opt_path(memory), _opt_path(durable), byref(o)), None)


def is_url(path):
    """Whether `path` names a store in an object store ("s3://bucket/prefix") rather
    than a directory: the library reads and drains such stores over S3, and a writer
    writes them through a local directory (tier_staging)."""
    return isinstance(path, str) and path.startswith("s3://")


def tier_staging(url):
    """The local directory through which the s3:// store `url` is written when no
    memory tier is named: $AMBER_STAGING, else /dev/shm, else $TMPDIR or /tmp, with
    "amber-<uid>-<hash of the URL>" (amber_tier_staging); not created here."""
    p = c_void_p()
    _check(_tier_staging(os.fsencode(url), byref(p)), None)
    try:
        return os.fsdecode(ctypes.string_at(p.value))
    finally:
        _free(p)


def sweep(path, grace=3600):
    """Removes from the s3:// store `path` what interrupted uploads left that no
    pointer reaches, once older than `grace` seconds (amber_store_sweep; what `amber
    prune` does besides retention); returns how many. Nothing for a directory."""
    n = c_size_t()
    _check(_store_sweep(os.fsencode(os.fspath(path)), int(grace), byref(n)), None)
    return n.value


def tier_durable(memory):
    """The durable tier that memory tier `memory` records, or None when it records
    none."""
    p = c_void_p()
    rc = _tier_durable(_opt_path(memory), byref(p))
    if rc == ENOENT:
        return None
    _check(rc, None)
    try:
        return os.fsdecode(ctypes.string_at(p.value))
    finally:
        _free(p)


# ---- peer replicas and the restore from the tiers ---------------------------------


class ReplicaStats:
    """This rank's replication: step (the last replicated, None before the first),
    sent_bytes and received_bytes of that step, total_sent and total_received since
    the open, seconds (that step's replication)."""
    __slots__ = ("step", "sent_bytes", "received_bytes", "total_sent", "total_received",
                 "seconds")

    def __init__(self, c):
        self.step = None if c.step == NO_STEP else c.step
        self.sent_bytes, self.received_bytes = c.sent_bytes, c.received_bytes
        self.total_sent, self.total_received = c.total_sent, c.total_received
        self.seconds = c.seconds

    def __repr__(self):
        return (f"ReplicaStats(step={self.step}, sent_bytes={self.sent_bytes}, "
                f"received_bytes={self.received_bytes}, seconds={self.seconds:.6f})")


class Replicas(_Handle):
    """This rank's replicator of memory directory `memory` (its local-mode
    GlobalWriter's path): after each committed step, step(n) sends the files that
    step added to this rank's store to `replicas` peers on other hosts, which keep
    them under this rank's store in their memory directories (docs/DESIGN.md, "Peer
    replicas and the restore").

    Replicas(memory, comm, p2p, replicas=1, host=None, keep_last=0). `comm` as for
    GlobalWriter, `p2p` an object with `sendrecv(data: bytes, dest, rlen, src) ->
    bytes` over the same ranks (dest/src None: no peer that way); both must be amber's
    own (a gloo group of its own: replication runs beside training, on one thread).
    host: this rank's host (None: $AMBER_HOST, else the host name). keep_last: steps
    each replica keeps (0: 2). Opening and step() are collective; an error of any
    rank raises on every rank and is sticky (open a new Replicas to go on)."""

    def __init__(self, memory, comm, p2p, replicas=1, host=None, keep_last=0):
        super().__init__()
        opts = _ReplicasOpts()
        _rep_opts_init(byref(opts))
        self._host = host.encode() if isinstance(host, str) else host
        opts.host, opts.keep_last = self._host, keep_last
        self._comm, self._p2p = _CommBridge(comm), _P2PBridge(p2p)
        h = _H()
        self._call(_rep_open(byref(h), os.fsencode(os.fspath(memory)), byref(self._comm.c),
                             byref(self._p2p.c), replicas, byref(opts)), None)
        self._h = h.value
        self.memory = os.fspath(memory)

    def _call(self, rc, handle):
        return _check_bridges(rc, handle, self._comm, self._p2p)

    def step(self, step):
        """Replicates committed global step `step` (increasing). Collective."""
        with self._lock:
            h = self._handle()
            self._call(_rep_step(h, step), h)

    def peers(self):
        """The ranks that hold this rank's replicas (a list)."""
        with self._lock:
            arr, n = (c_int * 64)(), c_size_t()
            _check(_rep_peers(self._handle(), arr, 64, byref(n)), self._h)
            return [arr[i] for i in range(min(n.value, 64))]

    def stats(self):
        """This rank's ReplicaStats."""
        with self._lock:
            st = _ReplicasStats()
            _check(_rep_stats(self._handle(), byref(st)), self._h)
            return ReplicaStats(st)

    def close(self):
        """Releases the replicator (not collective)."""
        with self._lock:
            if self._h is None:
                return
            _rep_close(self._h)
            self._h = None


class TiersRestore:
    """What tiers_restore decided for this rank: step (None: nothing to restore, a
    new job), tier ("memory", "peer" or "durable": where this rank's files came
    from), path (the store to open with GlobalReader at `step`), world_size (the
    step's), fetched_bytes (what this rank received into its memory directory), and
    ranks_memory, ranks_peer, ranks_durable (how many ranks each tier served)."""
    __slots__ = ("step", "tier", "path", "world_size", "fetched_bytes", "ranks_memory",
                 "ranks_peer", "ranks_durable")

    def __repr__(self):
        return (f"TiersRestore(step={self.step}, tier={self.tier!r}, path={self.path!r}, "
                f"world_size={self.world_size})")


def tiers_restore(memory, durable, comm, p2p):
    """Restores from the fastest tier that holds a step every rank can restore
    (amber_tiers_restore): `memory` is this rank's memory directory, `durable` the
    durable tier every rank reads (None: none); `comm` and `p2p` as for Replicas.
    Collective; returns a TiersRestore, the same step on every rank. A host whose
    memory was wiped gets its files from the peer that keeps them; with every
    memory directory lost, every rank gets the durable tier's newest step; at
    another world size than the memory tier's, the durable tier serves as it is."""
    cb, pb = _CommBridge(comm), _P2PBridge(p2p)
    res = _TiersResult()
    mem = os.fsencode(os.fspath(memory))
    dur = os.fsencode(os.fspath(durable)) if durable is not None else None
    _check_bridges(_tiers_restore(mem, dur, byref(cb.c), byref(pb.c), byref(res)), None, cb,
                   pb)
    out = TiersRestore()
    out.step = None if res.step == NO_STEP else res.step
    out.tier = _RESTORE_TIERS.get(res.tier)
    # the memory directory at the job's world size, else the durable tier as it is
    out.path = None if out.step is None else (
        os.fspath(memory) if res.world_size == comm.size else os.fspath(durable))
    out.world_size, out.fetched_bytes = res.world_size, res.fetched_bytes
    out.ranks_memory, out.ranks_peer = res.ranks_memory, res.ranks_peer
    out.ranks_durable = res.ranks_durable
    return out
