"""amber.device - the accelerator path: the reference and the selection live on the
tensors' device, and only what a delta stores crosses to host memory.

For a tensor on a GPU, copying all of it to the host at every save is the cost
that selective checkpointing exists to remove. Here the reference (exactly what
restoring the latest committed checkpoint yields) is a torch tensor on the
tensor's own device; each delta selects on that device, with torch tensor
operations, exactly the elements that the C library's scan (src/scan.c) would
select under the same policy; only their indices and values are compacted and
copied into reused host buffers (pinned for CUDA), which the library takes as
pre-selected chunks (amber_writer_set_selection, or per chunk through a source:
amber_writer_set_source) and encodes, writes and commits like any delta. A full save
copies each tensor into its reference on the device and streams the reference out
chunk by chunk through a ring of one reused host buffer per worker of the save. On
CUDA a delta's copies run on a side stream after the selection, so the fence waits
only for the selection's event. amber.torch uses this path for every tensor that is not on the
CPU, and for every tensor when the environment variable AMBER_DEVICE_PATH=1 is
set, so that the same tests cover it on any machine.

The selection follows src/scan.c step by step, because a restore through this path
must equal a restore through the CPU path:
  - exact (and every integer or bool tensor): the elements whose bits changed;
  - threshold:ABS:REL: |x - r| > ABS + REL*|r| in f32 for f32, f16, bf16 and f8
    (the bound shrunk by 2^-20 and less the smallest subnormal, so that rounding
    only ever stores more) and in f64 for f64; with a share cap (/SHARE:MULT) the
    same trim per chunk as share_trim: forced beyond MULT bounds, then the same
    12-bit histogram cut of change / bound in f64, ties in index order (torch
    operations; libamber_cuda's fused pass is not used for such a rule);
  - budget:FRAC:CAP per chunk: the threshold estimated from the same 8 runs of
    256 elements, the same cluster rule, the same 12-bit histogram cut with ties
    in index order, the same fill from a cluster's band;
  - a change to or from NaN or Inf is always stored;
  - a chunk whose selection would not be smaller than the chunk goes whole, and
    the reference takes the whole chunk, as the C path stores it RAW.
Under a policy with a value code (`@q8`, `@q4`, `@bf16`, `+lead`; f32, f16, bf16
and f64 tensors) the selection is the same, and its changes are then quantized on
the device as src/quant.c quantizes them (amber._quant: codes, one step per chunk,
escapes stored whole); the library takes codes and escapes instead of values
(amber_chunk_qsel) and stores QSPARSE chunks, and the reference takes what a
restore decodes. A chunk goes whole when its QSPARSE body would not be smaller than
the chunk, the C path's rule (amber._quant.stored_whole). f8 tensors keep plain
values, as in the C path.
The reference moves only by what is stored (error feedback). The old values of
what a save moved are kept until the save commits: a failed save puts them back.
With AMBER_DEVICE_REFERENCE=host (for tight device memory) the references live in
pinned host memory instead: each chunk's reference is copied to the device for the
comparison, and the reference takes the selection from its host copy.
A failed full save cannot (it replaced every value), so it marks the reference
stale, and the next delta reloads it from the store, as the C writer does.

Each step is a few torch operations per tensor (budget: per chunk), so it runs
on any device. For CUDA tensors, libamber_cuda (src/cuda/select.cu, built by nvcc;
amber._cuda) compares, selects, compacts and moves the reference in one pass over
live and reference instead (budget: the per-chunk estimate and the cut stay torch
operations), and quantizes the compacted selection in its own kernels; it is used
with AMBER_CUDA_KERNEL=1 until tests/gpu/run.sh has checked it on a GPU.
"""
import itertools
import os
import threading
from ctypes import CFUNCTYPE, POINTER, Structure, addressof, byref, c_char_p, c_float, c_int, \
    c_int64, c_size_t, c_uint32, c_uint64, c_void_p

import torch

import amber as _amber
from amber import _H, _TensorInfo, _check, _cuda, _fn, _name_bytes, _quant
from amber import _select as sel

SELECT_WHOLE = (1 << 64) - 1
KIND_FULL, KIND_DELTA = 0, 1


class _ChunkQSel(Structure):  # amber_chunk_qsel
    _fields_ = [("mode", c_uint32), ("group_log2", c_uint32), ("rel_step", c_float),
                ("steps", c_void_p), ("codes", c_void_p), ("nesc", c_uint64), ("esc", c_void_p),
                ("esc_vals", c_void_p)]


class _ChunkSel(Structure):  # amber_chunk_sel
    _fields_ = [("count", c_uint64), ("idx", c_void_p), ("vals", c_void_p),
                ("quant", c_void_p)]


_add_preselected = _fn("amber_writer_add_preselected", c_int, _H, c_char_p, c_int, c_uint32,
                       POINTER(c_int64), POINTER(c_size_t))
_plan = _fn("amber_writer_plan", c_int, _H, c_uint64, c_uint32, POINTER(c_uint32))
_info = _fn("amber_writer_info", c_int, _H, c_size_t, POINTER(_TensorInfo))
_set_selection = _fn("amber_writer_set_selection", c_int, _H, c_size_t, POINTER(_ChunkSel),
                     c_uint64)
# amber_chunk_source: (user, worker, index, chunk, sel) -> 0 or an AMBER_E* code
_SOURCE = CFUNCTYPE(c_int, c_void_p, c_int, c_size_t, c_uint64, POINTER(_ChunkSel))
_set_source = _fn("amber_writer_set_source", c_int, _H, c_size_t, _SOURCE, c_void_p)


# ---- the C entry points, on an amber.Writer or an amber.GlobalWriter ----------------
#
# A GlobalWriter's tensors are this rank's shards of global tensors: each function
# goes to its amber_global_writer_* counterpart (plan is then collective: every rank
# calls it, in the same order, and gets the same kind).

def _global(writer):
    return isinstance(writer, _amber.GlobalWriter)


def add_preselected(writer, name, dtype, shape, global_shape=None, offsets=None,
                    replicated=False):
    """Declares a pre-selected tensor on `writer` (amber_writer_add_preselected);
    returns its index. On a GlobalWriter, `shape` is this rank's box of global
    tensor `name`, at `offsets` (default: zeros) of `global_shape` (default:
    `shape`), or the whole of it when `replicated`."""
    if _global(writer):
        shape = tuple(int(d) for d in shape)
        return writer.add_preselected(name, dtype, shape if global_shape is None else global_shape,
                                      (0,) * len(shape) if offsets is None else offsets, shape,
                                      replicated)
    with writer._lock:
        shape = tuple(int(d) for d in shape)
        arr = (c_int64 * max(1, len(shape)))(*shape)
        idx = c_size_t()
        _check(_add_preselected(writer._handle(), _name_bytes(name), dtype, len(shape), arr,
                                byref(idx)), writer._h)
        writer.count += 1
        return idx.value


def plan(writer, step, flags):
    """The kind (KIND_FULL or KIND_DELTA) of the next save of `step` with `flags`,
    fixed for it (amber_writer_plan; on a GlobalWriter amber_global_writer_plan,
    collective)."""
    if _global(writer):
        if flags & ~(_amber.SAVE_FULL | _amber.SAVE_CONFIRM):
            raise ValueError(f"a global save takes SAVE_FULL and SAVE_CONFIRM, not {flags:#x}")
        return writer.plan(step, full=bool(flags & _amber.SAVE_FULL),
                           confirm=bool(flags & _amber.SAVE_CONFIRM))
    kind = c_uint32()
    with writer._lock:
        _check(_plan(writer._handle(), step, flags, byref(kind)), writer._h)
    return kind.value


def chunking(writer, index):
    """(chunk_elems, nchunks, policy spec) of tensor `index`, as planned."""
    if _global(writer):
        i = writer.info(index)
        return i.chunk_elems, i.nchunks, i.policy
    i = _TensorInfo()
    with writer._lock:
        _check(_info(writer._handle(), index, byref(i)), writer._h)
    return i.chunk_elems, i.nchunks, i.policy.decode()


def set_selection(writer, index, sels, count):
    """Hands tensor `index`'s `count` chunk selections (a ctypes array of _ChunkSel)
    to the next save; what they point to must stay until the fence."""
    if _global(writer):
        writer.set_selection(index, sels, count)
        return
    with writer._lock:
        _check(_set_selection(writer._handle(), index, sels, count), writer._h)


def set_source(writer, index, fn):
    """Gives tensor `index` a source of chunk selections (a _SOURCE callback, or None
    to remove it): the save asks it per chunk when no selection was set
    (amber_writer_set_source). The caller keeps `fn` alive."""
    if _global(writer):
        writer.set_source(index, fn if fn is not None else _SOURCE())
        return
    with writer._lock:
        _check(_set_source(writer._handle(), index, fn if fn is not None else _SOURCE(), None),
               writer._h)


# ---- the CUDA kernels (libamber_cuda, src/cuda/select.cu, called by amber._cuda) ---

def _cuda_lib():
    """libamber_cuda through ctypes (amber._cuda.lib()), or None."""
    return _cuda.lib()


def _kernel_wanted(x):
    """The fused kernel runs for CUDA tensors with AMBER_CUDA_KERNEL=1: it has not yet
    been checked on a GPU (tests/gpu/run.sh does), so the portable path is the
    default."""
    return x.device.type == "cuda" and os.environ.get("AMBER_CUDA_KERNEL") == "1" and \
        _cuda_lib() is not None


def _kernel_indices(x, r, kind, code, a, b, chunk=0, nchunks=0):
    """The selected indices (int64, increasing) by libamber_cuda's fused pass, on the
    current stream, the reference untouched; None when it does not cover (kind,
    dtype). threshold: (a, b) already shrunk; budget: (a, b) = (FRAC, CAP), per chunk
    (amber._cuda.indices)."""
    return _cuda.indices(x, r, kind, code, a, b, chunk, nchunks)


class _Host:
    """A reused host buffer (pinned when the tensors are on CUDA) that only grows."""

    def __init__(self, pinned):
        self.pinned = pinned
        self.buf = torch.empty(0, dtype=torch.uint8)

    def get(self, nbytes):
        if self.buf.numel() < nbytes:
            cap = max(nbytes, 2 * self.buf.numel(), 4096)
            self.buf = torch.empty(cap, dtype=torch.uint8, pin_memory=self.pinned)
        return self.buf


class _Tensor:
    """One pre-selected tensor: its reference on the device and its host buffers."""

    def __init__(self, name, index, t, code, host_ref=False):
        self.name, self.index, self.code = name, index, code
        # host_ref: the reference lives in (pinned) host memory, for tight device
        # memory; each save compares chunk by chunk, each chunk's reference copied in
        self.host_ref = host_ref
        self.dtype, self.shape, self.device = t.dtype, tuple(t.shape), t.device
        self.n = t.numel()
        self.w = t.element_size()
        self.ref = None     # the reference, flat, on the device (or the host: host_ref)
        self.valid = False  # it equals the restore of the latest committed step
        pinned = t.device.type == "cuda"
        self.hidx, self.hvals, self.hwhole = _Host(pinned), _Host(pinned), _Host(pinned)
        self.undo = None    # what the save in flight moved: (idx, old values, whole chunks)
        self.copied = 0     # bytes copied to the host by the last selection
        self.sels = None    # the ctypes array handed to the library
        self.qsels = None   # and the quantized selections it points to
        self.hq = {part: _Host(pinned) for part in ("codes", "esc", "escv", "steps")}
        self.pending = None  # host_ref: what the reference takes once the copies are done

    def _new_ref(self, like):
        if not self.host_ref:
            return torch.empty_like(like)
        return torch.empty(self.n, dtype=self.dtype, pin_memory=self.device.type == "cuda")

    def seed(self, live):
        self.ref = self._new_ref(live.reshape(-1))
        self.ref.copy_(live.detach().reshape(-1))
        self.valid = True

    def _flat(self, live):
        x = live.detach()
        if x.is_conj():
            x = x.resolve_conj()
        if x.is_neg():
            x = x.resolve_neg()
        return x.reshape(-1)  # a copy only when not contiguous

    def select(self, live, full, chunk, nchunks, spec, direct):
        """Selects this save's chunks and moves the reference. A full save: the
        reference takes every value (on the device: a device-to-device copy), and
        the save streams it out chunk by chunk (DevicePath's source, chunk_ptr);
        returns (None, []). A delta: returns (the selections, the copies that fill
        them: (host view, device tensor) pairs); `direct` makes them now, else the
        caller does, after the selection, on a side stream. Under a policy with a
        value code the selected changes are quantized (amber._quant) and the
        reference takes what a restore decodes."""
        x = self._flat(live)
        self.chunk = chunk
        if full:
            if self.ref is None or self.ref.numel() != self.n:
                self.ref = self._new_ref(x)
            if self.n:
                self.ref.copy_(x)  # to pinned host memory (host_ref): waits for the copy
            self.undo = "full"
            self.valid = True
            self.copied = self.n * self.w
            self.sels = None
            return None, []
        kind, a, b = sel.parse(spec)
        q = _quant.rule(kind, a, b, spec, self.dtype)
        idx, vals, olds, moved = self._pick(x, chunk, nchunks, spec, q is not None)
        cid = idx // chunk
        qz, nesc = None, [0] * nchunks
        if q is not None:
            qz, moved = self._quantize(q, x, idx, vals, olds, cid, chunk, nchunks)
            if nchunks:  # one sync for both counts
                both = [torch.bincount(c, minlength=nchunks) for c in (cid, cid[qz.esc])]
                counts, nesc = torch.stack(both).tolist()
            else:
                counts = []
        else:
            counts = torch.bincount(cid, minlength=nchunks).tolist() if nchunks else []
        sizes = [min(chunk, self.n - j * chunk) for j in range(nchunks)]

        def selection(j):  # chunk j's indices and escape ordinals (rarely asked)
            inside = cid == j
            return idx[inside] - j * chunk, qz.esc[inside].nonzero().squeeze(1)

        whole = [j for j in range(nchunks) if counts[j] and self._goes_whole(
            q, sizes[j], counts[j], nesc[j], lambda j=j: selection(j))]
        xb = sel.bits(x)
        rb = None if self.host_ref else sel.bits(self.ref)
        wold = []  # the old values of whole chunks: the moved ones put back
        for j in whole if rb is not None else []:
            lo, hi = j * chunk, j * chunk + sizes[j]
            old, inside = rb[lo:hi].clone(), cid == j
            old[idx[inside] - lo] = olds[inside]
            wold.append((lo, hi, old))
        if whole:
            keep = ~torch.isin(cid, torch.tensor(whole, device=cid.device))
            idx, cid, vals = idx[keep], cid[keep], vals[keep]
            olds = olds[keep] if olds is not None else None
            if qz is not None:
                qz = qz._replace(codes=qz.codes[keep], esc=qz.esc[keep], new=qz.new[keep])
        takes = vals if qz is None else qz.new  # what the reference takes at idx
        wsrc = xb  # where whole chunks are copied from
        if rb is not None:
            if not moved:
                rb[idx] = takes  # the reference takes what is stored, and only that
            for lo, hi, _ in wold:
                rb[lo:hi] = xb[lo:hi]
            self.undo = (idx, olds, wold)
            wsrc = rb  # equal to live there now, and unchanged by training until the save ends
        # compact and copy out: indices within their chunk (u32), values (or codes and
        # escapes), whole chunks
        k = idx.numel()
        hidx = self.hidx.get(4 * k)[:4 * k].view(torch.int32)
        copies = [(hidx, (idx - cid * chunk).to(torch.int32))]
        hvals = None  # the stored values (not quantized), or host_ref's reference update
        if qz is None or self.host_ref:
            hvals = self.hvals.get(k * self.w)[:k * self.w].view(xb.dtype)
            copies.append((hvals, takes))
        kept = [0 if j in whole else counts[j] for j in range(nchunks)]
        qsels = None
        if qz is not None:
            qcopies, qsels = self._quant_parts(q, qz, vals, cid, kept, nesc)
            copies += qcopies
        nwhole = sum(sizes[j] for j in whole)
        hwhole = self.hwhole.get(nwhole * self.w)[:nwhole * self.w].view(xb.dtype)
        woff, at = {}, 0
        for j in whole:
            copies.append((hwhole[at:at + sizes[j]], wsrc[j * chunk:j * chunk + sizes[j]]))
            woff[j] = at
            at += sizes[j]
        copies = [(dst, src) for dst, src in copies if src.numel()]
        self.copied = sum(dst.numel() * dst.element_size() for dst, _ in copies)
        if direct:
            for dst, src in copies:
                dst.copy_(src, non_blocking=True)
            copies = []
        if self.host_ref:  # moved by finish(), from the host copies, once they are done
            self.pending = (idx.to("cpu", non_blocking=True), hvals,
                            [(j * chunk, j * chunk + sizes[j], hwhole[woff[j]:woff[j] + sizes[j]])
                             for j in whole])
        sels = (_ChunkSel * max(1, nchunks))()
        ip, off = hidx.data_ptr(), 0
        for j in range(nchunks):
            if j in woff:
                sels[j] = _ChunkSel(SELECT_WHOLE, None, hwhole.data_ptr() + woff[j] * self.w)
            elif kept[j]:
                vp = hvals.data_ptr() + self.w * off if qz is None else None
                sels[j] = _ChunkSel(kept[j], ip + 4 * off, vp,
                                    addressof(qsels[j]) if qz is not None else None)
            off += kept[j]
        self.sels, self.qsels = sels, qsels
        return sels, copies

    def _goes_whole(self, q, m, k, nesc, selection):
        """Whether a chunk of m elements with k selected (nesc of them escapes) goes
        whole: plain values when the sparse body would not be smaller than the
        chunk, as the C path stores it RAW; quantized ones as amber._quant.stored_whole
        decides (`selection()`: the chunk's indices and escape ordinals)."""
        if q is None:
            return 1 + (m + 7) // 8 + k * self.w >= m * self.w
        return _quant.stored_whole(q.mode, m, self.w, k, nesc, selection)

    def _pick(self, x, chunk, nchunks, spec, need_olds):
        """This delta's selection from flat live `x`: (idx, vals, olds, moved): the
        selected indices (int64, increasing, global), the live bits there, the
        reference's bits there before it (host_ref: only with need_olds, else None),
        and whether the reference holds vals there already (the fused kernel)."""
        xb = sel.bits(x)
        if not self.host_ref and _kernel_wanted(x) and sel.share(spec) is None:
            fused = _cuda.select(x, self.ref, spec, self.code, chunk, nchunks)
            if fused is not None:  # libamber_cuda's one pass, the reference moved
                idx, vals, olds = fused
                return idx, vals.view(xb.dtype), olds.view(xb.dtype), True
        if self.host_ref:  # chunk by chunk, each chunk's reference copied in
            parts = [self._select_indices(x[o:o + chunk], self.ref[o:o + chunk].to(x.device),
                                          chunk, 1, spec) + o for o in range(0, self.n, chunk)]
            idx = torch.cat(parts) if parts else x.new_zeros(0, dtype=torch.int64)
            olds = sel.bits(self.ref)[idx.cpu()].to(x.device) if need_olds else None
        else:
            idx = self._select_indices(x, self.ref, chunk, nchunks, spec)
            olds = sel.bits(self.ref)[idx]
        return idx, xb[idx], olds, False

    def _quantize(self, q, x, idx, vals, olds, cid, chunk, nchunks):
        """The selected changes quantized under Rule q: (amber._quant.Quantized,
        whether the reference took its `new` already). By libamber_cuda's kernel for
        CUDA tensors with AMBER_CUDA_KERNEL=1 (which moves the reference), else by
        torch operations."""
        if not self.host_ref and _kernel_wanted(x):
            return _cuda.quantize(q, self.code, vals, olds, idx, chunk, nchunks, self.ref), True
        return _quant.quantize(q, vals.view(self.dtype), olds.view(self.dtype), cid, nchunks), False

    def _quant_parts(self, q, qz, vals, cid, kept, nesc):
        """The host side of a quantized selection: (the copies that fill its codes,
        escapes and steps, and an amber_chunk_qsel per chunk that has kept[j] > 0
        selected elements, nesc[j] of them escapes). `vals` are the selected live bits
        (the escapes' values)."""
        k, w, dev = cid.numel(), self.w, cid.device
        cw = qz.codes.element_size()
        first = torch.tensor([0, *itertools.accumulate(kept)][:-1], dtype=torch.int64, device=dev)
        ords = (torch.arange(k, device=dev) - first[cid])[qz.esc].to(torch.int32)  # in the chunk
        evals = vals[qz.esc]
        e = ords.numel()
        hq = self.hq
        codes = hq["codes"].get(k * cw)[:k * cw].view(qz.codes.dtype)
        hesc = hq["esc"].get(4 * e)[:4 * e].view(torch.int32)
        hescv = hq["escv"].get(e * w)[:e * w].view(vals.dtype)
        copies = [(codes, qz.codes), (hesc, ords), (hescv, evals)]
        steps = None
        if qz.steps is not None:
            steps = hq["steps"].get(4 * len(kept))[:4 * len(kept)].view(torch.float32)
            copies.append((steps, qz.steps))
        bf = q.mode == _quant.BF16
        qsels = (_ChunkQSel * max(1, len(kept)))()
        off = eoff = 0
        for j, c in enumerate(kept):
            if not c:
                continue
            ne = nesc[j]
            qsels[j] = _ChunkQSel(q.mode, 0 if bf else 24, qz.rel_step,
                                  None if bf else steps.data_ptr() + 4 * j,
                                  codes.data_ptr() + cw * off, ne,
                                  hesc.data_ptr() + 4 * eoff if ne else None,
                                  hescv.data_ptr() + w * eoff if ne else None)
            off += c
            eoff += ne
        return copies, qsels

    def chunk_ptr(self, j, slot):
        """The address of chunk j of the reference, for a full save: in place when
        the reference is in host memory, else copied into `slot` (a _Slot)."""
        lo = j * self.chunk
        n = min(self.chunk, self.n - lo)
        if self.ref.device.type == "cpu" and not _RING_ON_CPU:
            return self.ref.data_ptr() + lo * self.w
        src = sel.bits(self.ref)[lo:lo + n]
        return slot.fill(src, n * self.w)

    def finish(self):
        """host_ref, after the copies: the reference takes what is stored."""
        if self.pending is None:
            return
        idx, vals, whole = self.pending
        self.pending = None
        rb = sel.bits(self.ref)
        self.undo = (idx, rb[idx], [(lo, hi, rb[lo:hi].clone()) for lo, hi, _ in whole])
        rb[idx] = vals
        for lo, hi, v in whole:
            rb[lo:hi] = v

    def _select_indices(self, x, r, chunk, nchunks, spec):
        idx = self._select_raw(x, r, chunk, nchunks, spec)
        share = sel.share(spec)
        if share is None or self.dtype not in sel.FLOAT:
            return idx
        _, a, b = sel.parse(spec)
        return sel.share_trim(x, r, idx, chunk, nchunks, a, b, *share)

    def _select_raw(self, x, r, chunk, nchunks, spec):
        kind, a, b = sel.parse(spec)
        n = x.numel()
        if kind == "exact" or self.dtype not in sel.FLOAT:
            kind = "exact"
        if _kernel_wanted(x):
            if kind == "threshold" and self.dtype != torch.float64:
                a, b = sel.f32_down(a), sel.f32_down(b)
            idx = _kernel_indices(x, r, kind, self.code, a, b, chunk, nchunks)
            if idx is not None:
                return idx
            kind, a, b = sel.parse(spec)  # not covered: the portable path
        if kind == "exact" or self.dtype not in sel.FLOAT:
            return (sel.bits(x) != sel.bits(r)).nonzero().squeeze(1)
        if kind == "threshold":
            if self.dtype != torch.float64:
                a, b = sel.f32_down(a), sel.f32_down(b)
            # On a CPU, in slices whose temporaries stay in cache (fresh large
            # allocations cost page faults); on a GPU, in slices that bound the
            # temporaries (a few bytes per element of a slice) of a huge tensor.
            step = 1 << 17 if x.device.type == "cpu" else 1 << 26
            parts = [sel.candidates(x[o:o + step], r[o:o + step], a, b, float("inf"), False)[0] + o
                     for o in range(0, n, step)]
            return torch.cat(parts) if parts else x.new_zeros(0, dtype=torch.int64)
        parts = [sel.budget_chunk(x[j * chunk:(j + 1) * chunk], r[j * chunk:(j + 1) * chunk], a, b)
                 + j * chunk for j in range(nchunks)]
        return torch.cat(parts) if parts else x.new_zeros(0, dtype=torch.int64)

    def commit(self):
        self.undo = self.sels = self.qsels = self.pending = None

    def rollback(self):
        """After a failed save: the reference as it was before it."""
        if self.undo == "full":
            self.valid = False  # reloaded from the store by the next delta
        elif self.undo is not None:
            idx, olds, wold = self.undo
            rb = sel.bits(self.ref)
            rb[idx] = olds
            for lo, hi, old in wold:
                rb[lo:hi] = old
        self.undo = self.sels = self.qsels = self.pending = None


# Tests set this to run full saves of CPU tensors through the ring too (as CUDA
# tensors' go), and deltas through the source after copies made later.
_RING_ON_CPU = False


class _Slot:
    """One worker's buffer of the ring: a reused host buffer (pinned for CUDA) that
    holds the chunk the worker is writing, and the stream its copies go on."""

    def __init__(self, pinned):
        self.host = _Host(pinned)
        self.stream = None
        self.ready = None  # the event the copies wait for (the reference's copy)

    def fill(self, src, nbytes):
        """Copies `src` (a flat tensor of nbytes) into the slot; returns its address."""
        buf = self.host.get(nbytes)
        dst = buf[:nbytes].view(src.dtype)
        if src.device.type != "cuda":
            dst.copy_(src)
            return buf.data_ptr()
        if self.stream is None:
            self.stream = torch.cuda.Stream(src.device)
        with torch.cuda.device(src.device):
            if self.ready is not None:
                self.stream.wait_event(self.ready)
            with torch.cuda.stream(self.stream):
                dst.copy_(src, non_blocking=True)
            self.stream.synchronize()  # the worker writes it next
        return buf.data_ptr()


class DevicePath:
    """The pre-selected tensors of one amber.Writer, by name.

    A full save copies each tensor into its reference on its device and hands the
    library a source (amber_writer_set_source) that streams the reference out
    chunk by chunk through a ring of reused host buffers, one per worker of the
    save: no host copy of the whole state is ever held. A delta selects on the
    device; on CUDA its copies to host memory run on a side stream after the
    selection, and the library's workers wait for them through the same source,
    so that fence() waits only for the selection (an event)."""

    def __init__(self, host_ref=None):
        # AMBER_DEVICE_REFERENCE=host: references in pinned host memory
        self.host_ref = os.environ.get("AMBER_DEVICE_REFERENCE") == "host" \
            if host_ref is None else host_ref
        self.tensors = {}  # name -> _Tensor
        self.by_index = {}  # the writer's index -> _Tensor
        self.hold = None   # host buffers of the save in flight
        self.copied = 0    # bytes the last save copied from the devices to the host
        self.ring = {}     # worker -> _Slot
        self.full = False  # the save in flight is a full one
        self.selected = None  # CUDA events: the selection of the save in flight is done
        self.ready = {}       # the same, kept for the ring until the save ends
        self.copies = None    # CUDA events: its copies to host memory are done
        self.source_error = None  # what the source raised, for the save's failure
        self._lock = threading.Lock()
        self._sides = {}      # device -> the side stream of a delta's copies
        self._source = _SOURCE(self._ask)  # kept alive with the writer's tensors

    def declare(self, writer, name, dtype_code, t, **box):
        """Declares tensor `t` pre-selected on `writer` (on a GlobalWriter, `box`:
        global_shape, offsets, replicated, as add_preselected takes them)."""
        index = add_preselected(writer, name, dtype_code, t.shape, **box)
        self.tensors[name] = _Tensor(name, index, t, dtype_code, self.host_ref)
        self.by_index[index] = self.tensors[name]
        set_source(writer, index, self._source)
        return index

    @property
    def ring_bytes(self):
        """Host memory the ring holds (its buffers only grow: the most it has held)."""
        return sum(s.host.buf.numel() for s in list(self.ring.values()))

    def _ask(self, _user, worker, index, j, sel):
        """amber_chunk_source: chunk j of tensor `index` for the save in flight."""
        try:
            dt = self.by_index[index]
            if self.full:
                slot = self.ring.get(worker)
                if slot is None:
                    with self._lock:
                        slot = self.ring[worker] = _Slot(dt.device.type == "cuda")
                slot.ready = self.ready.get(dt.device)
                sel[0] = _ChunkSel(SELECT_WHOLE, None, dt.chunk_ptr(j, slot))
                return 0
            if dt.sels is None:
                raise RuntimeError(f"tensor '{dt.name}': no selection for this save")
            self._await_copies()
            sel[0] = dt.sels[j]
            return 0
        except BaseException as e:  # noqa: BLE001 - never raised into C
            self.source_error = e
            return _amber.EIO

    def _await_copies(self):
        with self._lock:
            events, self.copies = self.copies, None
        for e in (events or {}).values():
            e.synchronize()

    def seed(self, live):
        """The live tensors (name -> tensor) hold exactly the latest committed step."""
        for name, dt in self.tensors.items():
            dt.seed(live[name])

    def load_refs(self, store, step):
        """Reads the references from committed step `step` (the store's latest);
        False when a tensor is missing or differs. `store` is an amber.Store, or the
        amber.GlobalWriter that declared the tensors: each reference is then this
        rank's box of its global tensor in global step `step`, read from the shards
        that hold it (whatever world size wrote them)."""
        glob = _global(store)
        try:
            with _amber.GlobalReader(store.path, step) if glob else store.reader(step) as r:
                for name, dt in self.tensors.items():
                    i = r.find(name)
                    if i is None or r.tensors()[i].dtype != dt.code:
                        raise KeyError(name)
                    host = torch.empty(dt.n, dtype=dt.dtype)
                    if dt.n and glob:
                        off, shape = store.box(dt.index)
                        r.read_into(i, off, shape, host.data_ptr(), dt.n * dt.w)
                    elif dt.n:
                        r.read_into(i, host.data_ptr(), dt.n * dt.w)
                    dt.ref = host if dt.host_ref else host.to(dt.device)
                    dt.valid = True
        except (_amber.AmberError, KeyError, ValueError):
            return False
        return True

    def before_begin(self, writer, store, step, flags, live, full_flag):
        """plan() then select(): returns the flags the save must be begun with."""
        flags, kind = self.plan(writer, store, step, flags, full_flag)
        self.select(writer, kind, live)
        return flags

    def plan(self, writer, store, step, flags, full_flag):
        """Plans the save of `step`: (flags, kind), the flags the save must be begun
        with (a full one when a reference could not be had from the store)."""
        if not self.tensors:
            return flags, None
        kind = plan(writer, step, flags)
        if kind == KIND_DELTA and not all(dt.valid for dt in self.tensors.values()):
            latest = store.latest()
            if latest is None or not self.load_refs(store, latest):
                flags |= full_flag
                kind = plan(writer, step, flags)
        return flags, kind

    def plan_global(self, gw, comm, path, step, flags):
        """plan() for a GlobalWriter (collective: every rank calls it, also one with
        no device tensors): (flags, kind), the same kind on every rank. A delta needs
        every rank's references: a rank whose references are not valid (a new writer,
        a failed full step) reads its boxes of the latest global step of the store at
        `path`; if any rank cannot, the step is full everywhere. `comm` has
        allgather(bytes) over the ranks (amber.torch._comm's)."""
        kind = plan(gw, step, flags)
        if kind != KIND_DELTA:
            return flags, kind
        ok = all(dt.valid for dt in self.tensors.values())
        if not ok:
            steps = _amber.global_steps(path)
            ok = bool(steps) and self.load_refs(gw, steps[-1].step)
        if all(comm.allgather(b"\x01" if ok else b"\x00")):
            return flags, kind
        flags |= _amber.SAVE_FULL
        return flags, plan(gw, step, flags)

    def select(self, writer, kind, live):
        """Selects every pre-selected tensor of `live` (name -> tensor) for the
        planned save and hands the selections to the writer: a full save's and
        those copied later (CUDA) through the source, the others at once."""
        if not self.tensors:
            return
        self.full = kind == KIND_FULL
        self.source_error = None
        hold, later = [], []
        cuda = {dt.device for dt in self.tensors.values() if dt.device.type == "cuda"}
        try:
            for name, dt in self.tensors.items():
                chunk, nchunks, spec = chunking(writer, dt.index)
                # host_ref moves its reference from the host copies: made at once
                direct = not _RING_ON_CPU and (dt.device.type != "cuda" or dt.host_ref)
                sels, copies = dt.select(live[name], self.full, chunk, nchunks, spec, direct)
                hold.append((sels, copies))
                if sels is not None and not copies and direct:
                    set_selection(writer, dt.index, sels, nchunks)
                later += copies
        except BaseException:
            self.rollback()
            raise
        self.selected = {}
        for d in cuda:  # the selection is queued on each device's current stream
            e = torch.cuda.Event()
            e.record(torch.cuda.current_stream(d))
            self.selected[d] = e
        self.ready = dict(self.selected)
        if later:
            self.copies = self._copy_out(later)
        for d in cuda:  # host_ref and direct copies: the library reads them next
            if any(dt.host_ref or dt.pending for dt in self.tensors.values() if dt.device == d):
                torch.cuda.current_stream(d).synchronize()
        for dt in self.tensors.values():
            dt.finish()
        self.hold = hold
        self.copied = sum(dt.copied for dt in self.tensors.values())

    def _copy_out(self, copies):
        """The copies of a delta's selection to host memory: on CUDA on a side
        stream of each device after its selection (events returned), else now."""
        events = {}
        for dst, src in copies:
            if src.device.type != "cuda":
                dst.copy_(src)
                continue
            d = src.device
            if d not in events:
                side = self._side(d)
                side.wait_event(self.selected[d])
                events[d] = side
            with torch.cuda.stream(events[d]):
                dst.copy_(src, non_blocking=True)
            src.record_stream(events[d])  # not reused before the copy, whatever happens
        out = {}
        for d, side in events.items():
            e = torch.cuda.Event()
            e.record(side)
            out[d] = e
        return out

    def _side(self, d):
        if d not in self._sides:
            self._sides[d] = torch.cuda.Stream(d)
        return self._sides[d]

    def fence(self):
        """Waits until the device-side selection of the save in flight is done:
        then training may change the tensors (the copies read other buffers)."""
        events, self.selected = self.selected, None
        for e in (events or {}).values():
            e.synchronize()

    def commit(self):
        for dt in self.tensors.values():
            dt.commit()
        self.hold = self.copies = None
        self.ready = {}

    def settle(self, wait, cause=None):
        """Runs `wait` (the writer's wait) and moves the references with its outcome:
        kept when the save committed; else put back, and the failure raised chained
        to `cause` (or to what the source raised, if it did)."""
        try:
            wait()
        except BaseException as e:
            cause = cause if cause is not None else self.source_error
            self.source_error = None
            self.rollback()
            if cause is not None:
                raise e from cause
            raise
        self.commit()

    def rollback(self):
        for dt in self.tensors.values():
            dt.rollback()
        self.hold = self.copies = None
        self.ready = {}


class Background:
    """The device part of a save on its own thread (AMBER_DEVICE_ASYNC=1): save()
    returns at once and the selection, its copy to the host and the begin of the save
    run while training computes; fence() waits (join) until they are done, so the
    optimizer step waits only for the selection. On CUDA the thread selects on a side
    stream that first waits for what the caller's stream had queued at save() (the
    optimizer step that made the state)."""

    def __init__(self, fn, devices):
        self.error = None
        self.ready = self.device = None
        cuda = [d for d in devices if d.type == "cuda"]
        if cuda:
            self.device = cuda[0]
            self.ready = torch.cuda.Event()
            self.ready.record(torch.cuda.current_stream(self.device))
        self.thread = threading.Thread(target=self._run, args=(fn,), name="amber-device",
                                       daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            if self.device is None:
                fn()
                return
            torch.cuda.set_device(self.device)
            side = torch.cuda.Stream(self.device)
            with torch.cuda.stream(side):
                side.wait_event(self.ready)
                fn()
        except BaseException as e:  # raised by join() on the caller's thread
            self.error = e

    def join(self):
        """Waits for the thread and raises its failure, once."""
        self.thread.join()
        e, self.error = self.error, None
        if e is not None:
            raise e
