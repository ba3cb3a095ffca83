"""amber._cuda - libamber_cuda (src/cuda/select.cu) through ctypes: the fused CUDA
selection of amber.device for tensors on a CUDA GPU.

The library is plain CUDA C, built by nvcc, never against PyTorch: it is called here
with raw device pointers (torch tensors' data_ptr()) and the current stream
(torch.cuda.current_stream().cuda_stream); every buffer it writes (outputs, the
count, scratch) is allocated here with torch on the tensors' device, so that torch's
caching allocator orders their reuse on the stream.

One call of the kernel reads live and reference once and writes, for every selected
element in index order, its global index (int64), its live bits and the reference's
old bits, and (on request) moves the live bits into the reference. The number
selected is known only after the pass, so outputs are sized by a guess (the tensor's
last count, else n/16, never above n): the kernel writes the count to device memory
(read here, which synchronizes the stream: the caller needs it on the host anyway) and
writes only what fits; after an overflow (rare) the moved elements are put back from
their olds and the pass runs again with the exact size. What is returned is trimmed
(copied) when the guess was much too large.

Entry points:
  - indices(x, r, kind, code, a, b): what device._kernel_indices returns, the selected
    indices only (the reference untouched): exact, threshold (bounds already shrunk)
    and budget (a, b = FRAC, CAP);
  - select(x, r, spec, code, chunk, nchunks): (idx, vals, olds) of a delta's selection
    under policy `spec`, with the reference `r` moved (error feedback) - everything a
    save needs from one pass over live and reference;
  - quantize(rl, code, vals, olds, idx, chunk, nchunks, ref): what amber._quant.quantize
    returns for a selection under a quantized policy (codes, escapes, the values the
    reference takes, steps), computed by the library's quantizer (src/quant.c step by
    step), the reference moved at the selected indices;
  - budget(x, r, code, frac, cap, chunk, nchunks, update): the budget policy, per
    chunk. What stays in torch: the threshold's estimation from each chunk's sample
    (device._sample_positions / _sample_d / _budget_threshold, as device._budget_chunk
    does; one gather and one copy to the host for all chunks), the cut over the
    candidates only (a stable sort by (chunk, bucket descending), which keeps exactly
    what the 12-bit histogram cut keeps: the forced ones, every bucket above the cut
    and the cut bucket's first ones in index order), the band fill of a strict chunk
    that got fewer candidates than its budget (torch operations over that chunk: the
    rare case that reads a chunk again), and the reference's move by the result (a
    scatter of the selected elements only).
The kernels are opt-in (AMBER_CUDA_KERNEL=1, see device._kernel_wanted) until
tests/gpu/run.sh has checked them on a GPU.
"""
import contextlib
import ctypes
import os
from ctypes import POINTER, Structure, byref, c_double, c_int, c_uint64, c_void_p

import torch

import amber as _amber
from amber import _quant
from amber import _select as sel

KIND_EXACT, KIND_COMPARE = 0, 1
EINVAL = 1  # amber_cuda_select: bad arguments (CUDA errors come negated)
_FORCED = 0xFFFFFFFF
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_SMALL = 1 << 16  # tensors this small get outputs for every element


class Args(Structure):  # amber_cuda_args
    _fields_ = [("kind", c_int), ("dtype", c_int), ("width", c_int), ("update", c_int),
                ("live", c_void_p), ("ref", c_void_p), ("n", c_uint64),
                ("abs_b", c_double), ("rel_b", c_double), ("cap_b", c_double),
                ("chunk_abs", c_void_p), ("chunk_elems", c_uint64), ("capacity", c_uint64),
                ("idx", c_void_p), ("vals", c_void_p), ("olds", c_void_p), ("keys", c_void_p),
                ("count", c_void_p), ("scratch", c_void_p), ("scratch_bytes", c_uint64)]


class QArgs(Structure):  # amber_cuda_qargs
    _fields_ = [("dtype", c_int), ("mode", c_int), ("budget", c_int), ("lead", c_int),
                ("abs", c_double), ("rel", c_double), ("cap", c_double), ("k", c_uint64),
                ("idx", c_void_p), ("vals", c_void_p), ("olds", c_void_p),
                ("chunk_elems", c_uint64), ("nchunks", c_uint64), ("ref", c_void_p),
                ("codes", c_void_p), ("esc", c_void_p), ("news", c_void_p), ("steps", c_void_p),
                ("scratch", c_void_p), ("scratch_bytes", c_uint64)]


# the entry points: (name, restype, argtypes)
_SIGNATURES = [("amber_cuda_tile", c_uint64, []),
               ("amber_cuda_scratch_bytes", c_uint64, [c_uint64]),
               ("amber_cuda_supports", c_int, [c_int, c_int]),
               ("amber_cuda_select", c_int, [POINTER(Args), c_void_p]),
               ("amber_cuda_args_bytes", c_uint64, []), ("amber_cuda_qargs_bytes", c_uint64, []),
               ("amber_cuda_qscratch_bytes", c_uint64, [c_uint64]),
               ("amber_cuda_quantize", c_int, [POINTER(QArgs), c_void_p])]


def declare(lb):
    """Gives the entry points of library `lb` (a ctypes.CDLL) their signatures; False
    when it lacks one (an older build) or lays out amber_cuda_args or amber_cuda_qargs
    otherwise than Args and QArgs."""
    try:
        for name, res, args in _SIGNATURES:
            getattr(lb, name).restype = res
            getattr(lb, name).argtypes = args
    except AttributeError:
        return False
    return lb.amber_cuda_args_bytes() == ctypes.sizeof(Args) and \
        lb.amber_cuda_qargs_bytes() == ctypes.sizeof(QArgs)


_lib = None  # the loaded library, False when there is none


def lib():
    """libamber_cuda through ctypes, or None: AMBER_CUDA_LIBRARY, else next to the
    loaded libamber (the package or the build directory). A library that declare()
    refuses (an older build, another layout) counts as none."""
    global _lib
    if _lib is None:
        _lib = False
        paths = [os.environ.get("AMBER_CUDA_LIBRARY"),
                 os.path.join(os.path.dirname(_amber.library_path()), "libamber_cuda.so")]
        for path in paths:
            if not path or not os.path.exists(path):
                continue
            try:
                lb = ctypes.CDLL(path)
            except OSError:
                continue
            if declare(lb):
                _lib = lb
                break
    return _lib or None


def supports(kind, code):
    """Whether the kernel selects amber dtype `code` under KIND_EXACT or KIND_COMPARE."""
    lb = lib()
    return lb is not None and bool(lb.amber_cuda_supports(kind, code))


def tile():
    """Elements per tile of the kernel."""
    return int(lib().amber_cuda_tile())


def _bits(t):
    return t.view(_BITS[t.element_size()])


def _ptr(t):
    return t.data_ptr() if t is not None else None


@contextlib.contextmanager
def _on(dev):
    """With device `dev` current: its current stream (None off CUDA: only a model of
    the library, the tests' own)."""
    if dev.type != "cuda":
        yield None
        return
    with torch.cuda.device(dev):
        yield torch.cuda.current_stream(dev).cuda_stream


def _call(name, args, stream):
    """Entry point `name` of the library with `args` (by reference) on `stream`;
    raises for its failures."""
    rc = getattr(lib(), name)(byref(args), stream)
    if rc == EINVAL:
        raise ValueError(f"{name}: bad arguments")
    if rc:
        raise RuntimeError(f"{name} failed: CUDA error {-rc}")


_seen = {}  # (device, reference address, n) -> its last count: the next guess


def _guess(key, n):
    if n <= _SMALL:
        return n
    last = _seen.get(key)
    g = n >> 4 if last is None else last + (last >> 2) + 4096
    return min(n, max(g, _SMALL))


def run(x, r, kind, code, abs_b=0.0, rel_b=0.0, cap_b=float("inf"), chunk_abs=None, chunk=0,
        update=False, vals=False, olds=False, keys=False, capacity=None):
    """One fused pass over flat contiguous live `x` and reference `r` (same dtype, on
    one CUDA device), on the current stream: (idx, vals, olds, keys), each None unless
    asked for (idx always is): the selected global indices (int64, increasing), their
    live bits and the reference's bits before (int dtypes of the element width), and
    their budget keys (int32 holding u32 bits). With `update` the reference takes the
    live bits of what is returned. KIND_COMPARE: bounds abs_b, rel_b and cap_b already
    shrunk as device.py shrinks them; chunk_abs (f64 on the device, one per chunk of
    `chunk` elements) replaces abs_b per chunk. `capacity`: the outputs' first size
    (tests force an overflow with it)."""
    lb = lib()
    n, w, dev = x.numel(), x.element_size(), x.device
    if r.dtype != x.dtype or r.numel() != n or not (x.is_contiguous() and r.is_contiguous()):
        raise ValueError("amber._cuda.run: live and reference must be flat alike")
    bits = _BITS[w]
    key = (dev, r.data_ptr(), n)
    cap = _guess(key, n) if capacity is None else min(int(capacity), n)
    olds = olds or update  # an overflow puts the moved elements back
    with _on(dev) as stream:
        count = torch.empty(1, dtype=torch.int64, device=dev)
        scratch = torch.empty(int(lb.amber_cuda_scratch_bytes(n)), dtype=torch.uint8,
                              device=dev)
        while True:
            oi = torch.empty(cap, dtype=torch.int64, device=dev)
            ov = torch.empty(cap, dtype=bits, device=dev) if vals else None
            oo = torch.empty(cap, dtype=bits, device=dev) if olds else None
            ok = torch.empty(cap, dtype=torch.int32, device=dev) if keys else None
            a = Args(kind, code, w, 1 if update else 0, x.data_ptr(), r.data_ptr(), n,
                     abs_b, rel_b, cap_b, _ptr(chunk_abs), chunk if chunk_abs is not None else 0,
                     cap, oi.data_ptr(), _ptr(ov), _ptr(oo), _ptr(ok), count.data_ptr(),
                     scratch.data_ptr(), scratch.numel())
            _call("amber_cuda_select", a, stream)
            k = int(count.item())
            if k <= cap:
                break
            if update:  # put back what moved, then again with the exact size
                _bits(r)[oi] = oo
            cap = k
    if len(_seen) > 4096:  # temporaries (a host reference's chunks) come and go
        _seen.clear()
    _seen[key] = k
    outs = [oi, ov, oo if olds else None, ok]
    trim = cap > 2 * k + _SMALL  # release a much too large guess
    return tuple(None if t is None else (t[:k].clone() if trim else t[:k]) for t in outs)


def indices(x, r, kind, code, a, b, chunk=0, nchunks=0):
    """The selected indices (int64, increasing) on the current stream, the reference
    untouched; None when the kernel does not cover (kind, code). kind "exact" or
    "threshold" (a, b: ABS and REL already shrunk as device.py shrinks them, f32 for
    all but f64), or "budget" (a, b: the policy's FRAC and CAP; chunk, nchunks)."""
    if kind == "budget":
        out = budget(x, r, code, a, b, chunk, nchunks)
        return None if out is None else out[0]
    k = KIND_EXACT if kind == "exact" else KIND_COMPARE
    if not supports(k, code):
        return None
    return run(x, r, k, code, a, b)[0]


def select(x, r, spec, code, chunk, nchunks):
    """A delta's selection of flat `x` against its reference `r` under policy `spec`
    (the tensor's chunking: chunk, nchunks): (idx, vals, olds) with `r` moved, r[idx]
    having taken vals, or None when the kernel does not cover it (nothing moved).
    idx: int64, increasing, global; vals, olds: the live bits and the reference's bits
    before (int dtypes of the element width). Selects exactly what
    device._Tensor._select_indices selects (whole chunks are the caller's)."""
    kind, a, b = sel.parse(spec)
    if kind == "exact" or x.dtype not in sel.FLOAT:
        kind = "exact"
    if kind == "budget":
        return budget(x, r, code, a, b, chunk, nchunks, update=True)
    k = KIND_EXACT if kind == "exact" else KIND_COMPARE
    if not supports(k, code):
        return None
    if kind == "threshold" and x.dtype != torch.float64:
        a, b = sel.f32_down(a), sel.f32_down(b)
    idx, vals, olds, _ = run(x, r, k, code, a, b, update=True, vals=True, olds=True)
    return idx, vals, olds


def _budget_plan(x, r, frac, cap, chunk, nchunks):
    """Per chunk, as device._budget_chunk decides them: (sizes, budgets, thresholds for
    the kernel, strict, bands)."""
    n = x.numel()
    sizes = [min(chunk, n - j * chunk) for j in range(nchunks)]
    budgets = []
    for m in sizes:
        bud = int(frac * m)
        if bud == 0 and frac > 0:
            bud = 1
        budgets.append(bud)
    sampled = [j for j in range(nchunks) if budgets[j] < sizes[j]]
    samples = {}
    if sampled:  # every chunk's sample in one gather and one copy
        pos = [sel.sample_positions(sizes[j]) + j * chunk for j in sampled]
        d = sel.sample_d(*(t[torch.cat(pos).to(x.device)] for t in (x, r))).cpu().numpy()
        at = 0
        for j, p in zip(sampled, pos):
            samples[j] = d[at:at + p.numel()]
            at += p.numel()
    f64 = x.dtype == torch.float64
    thr, strict, bands = [], [], []
    for j in range(nchunks):
        s, lo, hi = False, 0.0, 0.0
        if budgets[j] >= sizes[j]:
            t = 0.0
        else:
            t, s, lo, hi = sel.budget_threshold(samples[j], sizes[j], budgets[j])
        if t > cap or hi > cap:
            t = min(t, cap)
            s = False
        if f64:
            s = False
        thr.append(t if f64 else (hi if s else sel.f32_down(t)))
        strict.append(s)
        bands.append((lo, hi))
    return sizes, budgets, thr, strict, bands


def budget(x, r, code, frac, cap, chunk, nchunks, update=False):
    """budget:FRAC:CAP over the chunks of flat `x` against `r`: (idx, vals, olds) as
    in select(), the reference moved only with `update`; None when the kernel does not
    cover `code`. Selects exactly what device._budget_chunk selects, chunk by chunk."""
    if not supports(KIND_COMPARE, code):
        return None
    n, dev = x.numel(), x.device
    bits = _BITS[x.element_size()]
    if n == 0 or nchunks == 0:
        e = torch.zeros(0, dtype=torch.int64, device=dev)
        return e, torch.zeros(0, dtype=bits, device=dev), torch.zeros(0, dtype=bits, device=dev)
    sizes, budgets, thr, strict, bands = _budget_plan(x, r, frac, cap, chunk, nchunks)
    f64 = x.dtype == torch.float64
    cap_b = cap if f64 else sel.f32_down(cap)
    chunk_abs = torch.tensor(thr, dtype=torch.float64).to(dev)
    # the candidates: compare with each chunk's threshold and CAP, REL 0, with keys
    idx, vals, olds, keys = run(x, r, KIND_COMPARE, code, 0.0, 0.0, cap_b, chunk_abs, chunk,
                                vals=True, olds=True, keys=True)
    cid = idx // chunk
    bud = torch.tensor(budgets, dtype=torch.int64).to(dev)
    # the cut: keep the forced ones and, per chunk, the first `budget` others by
    # (bucket descending, index): the 12-bit histogram cut's choice, ties in index order
    key = keys.to(torch.int64) & 0xFFFFFFFF
    forced = key == _FORCED
    free = (~forced).nonzero().squeeze(1)
    cf = cid[free]
    order = torch.sort(cf * 4096 + (4095 - (key[free] >> 20)), stable=True).indices
    nfree = torch.bincount(cf, minlength=nchunks)
    cs = cf[order]
    rank = torch.arange(order.numel(), device=dev) - (nfree.cumsum(0) - nfree)[cs]
    keep = forced.clone()
    keep[free[order[rank < bud[cs]]]] = True
    idx, vals, olds = idx[keep], vals[keep], olds[keep]
    # the fill: a strict chunk with fewer candidates than its budget takes more from
    # its band, in index order (the candidates excluded), as fill_band does
    fill = []
    if any(strict):  # candidates per chunk: a sync, only where a fill may be needed
        cl = torch.bincount(cid, minlength=nchunks).tolist()
        fill = [j for j in range(nchunks) if strict[j] and cl[j] < budgets[j]]
    if fill:
        xb, rb = _bits(x), _bits(r)
        more = []
        for j in fill:
            lo_j, m = j * chunk, sizes[j]
            xs, rs = x[lo_j:lo_j + m], r[lo_j:lo_j + m]
            fx, fr = (xs, rs) if xs.dtype == torch.float32 else (xs.float(), rs.float())
            d = (fx - fr).abs()
            lo, hi = bands[j]
            band = (d > lo) & (d <= hi)
            band[idx[(idx >= lo_j) & (idx < lo_j + m)] - lo_j] = False
            more.append(band.nonzero().squeeze(1)[:budgets[j] - cl[j]] + lo_j)
        more = torch.cat(more)
        idx, order = torch.cat([idx, more]).sort()
        vals = torch.cat([vals, xb[more]])[order]
        olds = torch.cat([olds, rb[more]])[order]
    if update:
        _bits(r)[idx] = vals
    return idx, vals, olds


def quantize(rl, code, vals, olds, idx, chunk, nchunks, ref=None):
    """amber._quant.quantize(rl, ...) by the library's quantizer, on the current
    stream: `vals` and `olds` are the live and old reference bits of the selected
    elements at global indices `idx` (int64, increasing) of a tensor of amber dtype
    `code` in chunks of `chunk` elements (nchunks of them). Returns
    amber._quant.Quantized; with `ref` (the flat reference) the reference takes its
    `new` at idx."""
    lb = lib()
    k, dev = idx.numel(), vals.device
    bf = rl.mode == _quant.BF16
    codes = torch.empty(k, dtype=torch.int16 if bf else torch.int8, device=dev)
    esc = torch.empty(k, dtype=torch.bool, device=dev)
    news = torch.empty_like(vals)
    steps = None if bf else torch.empty(nchunks, dtype=torch.float32, device=dev)
    budget = rl.kind == "budget"
    scratch = torch.empty(int(lb.amber_cuda_qscratch_bytes(nchunks)) if budget and not bf else 0,
                          dtype=torch.uint8, device=dev)
    a = QArgs(code, rl.mode, int(budget), int(rl.lead), rl.abs, rl.rel, rl.cap, k,
              idx.data_ptr(), vals.data_ptr(), olds.data_ptr(), chunk, nchunks, _ptr(ref),
              codes.data_ptr(), esc.data_ptr(), news.data_ptr(), _ptr(steps), scratch.data_ptr(),
              scratch.numel())
    with _on(dev) as stream:
        _call("amber_cuda_quantize", a, stream)
    return _quant.Quantized(codes, esc, news, steps, _quant.rel_step_of(rl))
