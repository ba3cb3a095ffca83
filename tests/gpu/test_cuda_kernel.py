"""libamber_cuda's fused kernel and amber._cuda against the portable path (run by
tests/gpu/run.sh on a GPU machine; the CUDA tests are skipped without one).

- The kernel selects exactly what the portable path selects (which
  tests/python/test_device_path.py holds to the C scan) for every dtype (f32, f16,
  bf16, f64, f8 e4m3fn and e5m2, integers, bool) under exact, threshold and budget
  with and without CAP, with NaN (several encodings), Inf, subnormals, signed zeros,
  overflowing changes and changes on the bound, for sizes 0, 1, a tile - 1, a tile, a
  tile + 1, many tiles, and budget chunks larger and smaller than a tile, with and
  without clusters of equal changes; and it returns the selected elements' live
  values and the reference's old ones, and moves the reference by exactly them (also
  after an output overflow that makes it run again).
- The kernel's quantizer (amber_cuda_quantize) returns, for a selection under every
  quantized policy (threshold with ABS, ABS and REL, REL only; budget with and
  without CAP; Q8, Q4, BF16; +lead) of f32, f16, bf16 and f64 tensors with NaN, Inf,
  overflowing and large changes (escapes), the codes, escapes, steps and restored
  values of the torch quantizer (amber._quant, which tests/python/test_device_path.py
  holds to the C path), and moves the reference by exactly them.
- A trajectory of CUDA tensors saved through the device path (kernel on and off)
  restores at every step exactly what the same trajectory of CPU tensors saved through
  the CPU path restores, quantized policies included.
- Everywhere, also without a GPU: amber._cuda's glue (budget's per-chunk plan, the
  cut, the band fill, the reference's move, the overflow's second run, whole chunks,
  the quantizer's arguments and outputs, the kernel branches of amber.device in whole
  trajectories) over a model of the kernel on CPU memory (Model, written from the
  contract in src/cuda/select.cu) selects and quantizes what the portable path does;
  with AMBER_CUDA_EMU the same tests run the kernel's own source on a CPU emulator."""
import ctypes
import os

import pytest
import torch

import amber
from amber import _cuda, _quant, _select, device
from amber.torch import Checkpointer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
lib = pytest.mark.skipif(_cuda.lib() is None, reason="libamber_cuda was not built")
TILE = 4096  # src/cuda/select.cu (checked against the library below)
CODES = {torch.float32: amber.F32, torch.float16: amber.F16, torch.bfloat16: amber.BF16,
         torch.float64: amber.F64, torch.float8_e4m3fn: amber.F8_E4M3,
         torch.float8_e5m2: amber.F8_E5M2, torch.int64: amber.I64, torch.int32: amber.I32,
         torch.int16: amber.I16, torch.int8: amber.I8, torch.uint8: amber.U8,
         torch.bool: amber.BOOL}
FLOATS = [t for t in CODES if t.is_floating_point]
SIZES = [0, 1, TILE - 1, TILE, TILE + 1, 100_003, 3 << 20]
# bit patterns of every float dtype: NaNs (quiet, payload, negative, signalling),
# Infs, subnormals, zeros of both signs, the largest finite (changes that overflow)
SPECIAL = {
    torch.float32: [0x7FC00000, 0x7FC00001, 0xFFC00000, 0x7F800001, 0x7F800000, 0xFF800000,
                    0x00000001, 0x80000001, 0x00000000, 0x80000000, 0x007FFFFF, 0x7F7FFFFF,
                    0xFF7FFFFF, 0x3F800000],
    torch.float16: [0x7E00, 0x7E01, 0xFE00, 0x7C01, 0x7C00, 0xFC00, 0x0001, 0x8001, 0x0000,
                    0x8000, 0x03FF, 0x7BFF, 0xFBFF, 0x3C00],
    torch.bfloat16: [0x7FC0, 0x7FC1, 0xFFC0, 0x7F81, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x0000,
                     0x8000, 0x007F, 0x7F7F, 0xFF7F, 0x3F80],
    torch.float64: [0x7FF8000000000000, 0x7FF8000000000001, 0xFFF8000000000000,
                    0x7FF0000000000001, 0x7FF0000000000000, 0xFFF0000000000000, 1,
                    0x8000000000000001, 0, 0x8000000000000000, 0x000FFFFFFFFFFFFF,
                    0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF, 0x3FF0000000000000],
    torch.float8_e4m3fn: [0x7F, 0xFF, 0x7E, 0xFE, 0x01, 0x81, 0x00, 0x80, 0x07, 0x08, 0x38],
    torch.float8_e5m2: [0x7E, 0x7D, 0xFE, 0x7F, 0x7C, 0xFC, 0x01, 0x81, 0x00, 0x80, 0x03,
                        0x7B, 0xFB, 0x3C],
}
POLICIES = ["exact", "threshold:1e-3", "threshold:1e-4:1e-2"]
BUDGETS = ["budget:0.05", "budget:0.05:1e-2", "budget:0.001:0.1", "budget:0.5"]
QUANTIZED = ["threshold:1e-3@q8", "threshold:1e-4:1e-2@q4+lead", "threshold:0:0.3@q4+lead",
             "threshold:2e-3:5e-2@bf16", "budget:0.05:1e-2@q8", "budget:0.5@q4",
             "budget:0.2:2e-2@q8+lead", "budget:0.05:1e-3@bf16"]
QFLOATS = list(_quant.DTYPES)


def bits(t):
    return _select.bits(t)


def signed(v, bt):
    """An unsigned bit pattern as the value a tensor of bits dtype `bt` stores."""
    w = torch.empty(0, dtype=bt).element_size()
    return v - (1 << 8 * w) if bt.is_signed and v >= 1 << (8 * w - 1) else v


def pair(n, dtype, seed, cluster=False):
    """(live, reference) on the CPU: random changes, a share of large ones, every pair
    of special bit patterns at the start and at the end, a change on the bound of
    threshold:1e-3; `cluster`: changes of one size (a sign-based optimizer's)."""
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        r = torch.rand(n, generator=g) < 0.5
        return r ^ (torch.rand(n, generator=g) < 0.1), r
    if not dtype.is_floating_point:
        r = torch.randint(0, 100, (n,), generator=g).to(dtype)
        x = r.clone()
        x[torch.rand(n, generator=g) < 0.1] += 1
        return x, r
    r = torch.randn(n, generator=g, dtype=torch.float64)
    if cluster:
        d = torch.sign(torch.randn(n, generator=g, dtype=torch.float64)) * 1e-3
        d[torch.rand(n, generator=g) < 0.01] *= 3
    else:
        d = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
        d[torch.rand(n, generator=g) < 0.05] *= 100
    x, r = (r + d).float().to(dtype), r.float().to(dtype)
    if n > 20:
        r[20], x[20] = 1.0, 1.0 + 1e-3  # on the bound of threshold:1e-3
    xb, rb = bits(x), bits(r)
    sp = [signed(v, xb.dtype) for v in SPECIAL[dtype]]
    pairs = [(a, b) for a in sp for b in sp]
    for k, (a, b) in enumerate(pairs[:n]):
        xb[k], rb[k] = a, b
    if n >= 2 * len(pairs) + 30:
        for k, (a, b) in enumerate(pairs):
            xb[n - 1 - k], rb[n - 1 - k] = a, b
    return x, r


def chunks_of(n, chunk):
    return (n + chunk - 1) // chunk if n else 0


def want_indices(x, r, spec, chunk):
    """What the portable path selects (on the CPU)."""
    kind, a, b = _select.parse(spec)
    if kind == "exact" or x.dtype not in _select.FLOAT:
        return (bits(x) != bits(r)).nonzero().squeeze(1)
    if kind == "threshold":
        if x.dtype != torch.float64:
            a, b = _select.f32_down(a), _select.f32_down(b)
        return _select.candidates(x, r, a, b, float("inf"), False)[0]
    parts = [_select.budget_chunk(x[o:o + chunk], r[o:o + chunk], a, b) + o
             for o in range(0, x.numel(), chunk)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def kernel_indices(x, r, spec, chunk):
    """device._kernel_indices as device._Tensor._select_indices calls it."""
    kind, a, b = _select.parse(spec)
    if kind == "exact" or x.dtype not in _select.FLOAT:
        kind = "exact"
    if kind == "threshold" and x.dtype != torch.float64:
        a, b = _select.f32_down(a), _select.f32_down(b)
    return device._kernel_indices(x, r, kind, CODES[x.dtype], a, b, chunk,
                                  chunks_of(x.numel(), chunk))


def check(x, r, spec, chunk, dev):
    """The kernel's indices, values, olds and moved reference equal the portable
    path's, on device `dev` (CUDA, or the CPU under Model)."""
    want = want_indices(x, r, spec, chunk)
    label = f"{x.dtype} n={x.numel()} {spec} chunk={chunk}"
    xg, rg = x.to(dev, copy=True), r.to(dev, copy=True)
    got = kernel_indices(xg, rg, spec, chunk)
    assert got is not None, label
    assert torch.equal(got.cpu(), want), label
    assert torch.equal(bits(rg).cpu(), bits(r)), f"{label}: indices moved the reference"
    out = _cuda.select(xg, rg, spec, CODES[x.dtype], chunk, chunks_of(x.numel(), chunk))
    assert out is not None, label
    idx, vals, olds = (t.cpu() for t in out)
    assert torch.equal(idx, want), label
    assert torch.equal(vals, bits(x)[want]), f"{label}: values"
    assert torch.equal(olds, bits(r)[want]), f"{label}: olds"
    moved = bits(r).clone()
    moved[want] = bits(x)[want]
    assert torch.equal(bits(rg).cpu(), moved), f"{label}: the reference"


def check_overflow(x, r, spec, dev):
    """A capacity far too small: the second run returns the same, the reference moved
    once, by exactly the selection."""
    kind, a, b = _select.parse(spec)
    if kind == "exact" or x.dtype not in _select.FLOAT:
        kind = "exact"
    if kind == "threshold" and x.dtype != torch.float64:
        a, b = _select.f32_down(a), _select.f32_down(b)
    want = want_indices(x, r, spec, x.numel() or 1)
    xg, rg = x.to(dev, copy=True), r.to(dev, copy=True)
    k = _cuda.KIND_EXACT if kind == "exact" else _cuda.KIND_COMPARE
    idx, vals, olds, _ = _cuda.run(xg, rg, k, CODES[x.dtype], a, b, update=True, vals=True,
                                   olds=True, capacity=3)
    assert torch.equal(idx.cpu(), want)
    assert torch.equal(vals.cpu(), bits(x)[want]) and torch.equal(olds.cpu(), bits(r)[want])
    moved = bits(r).clone()
    moved[want] = bits(x)[want]
    assert torch.equal(bits(rg).cpu(), moved)


def check_quant(x, r, spec, chunk, dev):
    """The kernel's quantizer over the portable path's selection of (x, r) under `spec`
    returns what amber._quant.quantize returns, and moves the reference at the
    selection to exactly its `new` values, on device `dev`."""
    idx = want_indices(x, r, spec, chunk)
    nchunks = chunks_of(x.numel(), chunk)
    kind, a, b = _select.parse(spec)
    rl = _quant.rule(kind, a, b, spec, x.dtype)
    want = _quant.quantize(rl, x[idx], r[idx], idx // chunk, nchunks)
    label = f"{x.dtype} n={x.numel()} {spec} chunk={chunk} k={idx.numel()}"
    assert 0 < int(want.esc.sum()) < idx.numel(), f"{label}: no escapes, or only escapes"
    rg = r.to(dev, copy=True)
    got = _cuda.quantize(rl, CODES[x.dtype], bits(x)[idx].to(dev), bits(r)[idx].to(dev),
                         idx.to(dev), chunk, nchunks, bits(rg))
    for part in ("codes", "esc", "new", "steps"):
        w, g = getattr(want, part), getattr(got, part)
        assert (w is None) == (g is None), f"{label}: {part}"
        if w is not None:
            assert torch.equal(g.cpu().view(w.dtype), w), f"{label}: {part}"
    assert got.rel_step == want.rel_step, label
    moved = bits(r).clone()
    moved[idx] = want.new
    assert torch.equal(bits(rg).cpu(), moved), f"{label}: the reference"


# ---- with the library, a GPU or not -------------------------------------------------

@lib
def test_glue_the_library_refuses_bad_arguments_before_any_cuda_call():
    lb = _cuda.lib()
    assert lb.amber_cuda_args_bytes() == ctypes.sizeof(_cuda.Args)
    n = 10_000
    buf = ctypes.create_string_buffer(8 * n)  # never read: refused first
    p = ctypes.addressof(buf)

    def args(**kw):
        a = _cuda.Args(kind=1, dtype=amber.F32, width=4, live=p, ref=p, n=n, cap_b=float("inf"),
                       capacity=n, idx=p, count=p, scratch=p,
                       scratch_bytes=lb.amber_cuda_scratch_bytes(n))
        for k, v in kw.items():
            setattr(a, k, v)
        return a

    for bad in [dict(dtype=amber.I32), dict(width=3), dict(width=2), dict(count=None),
                dict(scratch=None), dict(scratch_bytes=8), dict(live=None), dict(idx=None),
                dict(kind=2), dict(chunk_abs=p, chunk_elems=0), dict(kind=0, width=5)]:
        assert lb.amber_cuda_select(ctypes.byref(args(**bad)), None) == _cuda.EINVAL, bad

    def qargs(**kw):
        a = _cuda.QArgs(dtype=amber.F32, mode=_quant.Q8, budget=1, abs=0.0, rel=0.0, cap=1.0,
                        k=n, idx=p, vals=p, olds=p, chunk_elems=n, nchunks=1, codes=p, esc=p,
                        news=p, steps=p, scratch=p, scratch_bytes=lb.amber_cuda_qscratch_bytes(1))
        for k, v in kw.items():
            setattr(a, k, v)
        return a

    for bad in [dict(dtype=amber.F8_E4M3), dict(dtype=amber.I32), dict(mode=0), dict(mode=4),
                dict(mode=_quant.BF16, lead=1), dict(idx=None), dict(vals=None), dict(olds=None),
                dict(codes=None), dict(esc=None), dict(news=None), dict(steps=None),
                dict(chunk_elems=0), dict(nchunks=0), dict(scratch=None), dict(scratch_bytes=11)]:
        assert lb.amber_cuda_quantize(ctypes.byref(qargs(**bad)), None) == _cuda.EINVAL, bad
    # a threshold needs no scratch, bf16 codes no steps: refused only for what is bad
    assert lb.amber_cuda_quantize(ctypes.byref(qargs(k=0)), None) == 0


@lib
@pytest.mark.skipif(torch.cuda.is_available(), reason="without a GPU only")
def test_glue_without_a_gpu_a_call_fails_with_a_cuda_error():
    lb = _cuda.lib()
    host = ctypes.create_string_buffer(8)  # not device memory either
    a = _cuda.Args(kind=0, dtype=amber.U8, width=1, count=ctypes.addressof(host))
    rc = lb.amber_cuda_select(ctypes.byref(a), None)  # n = 0: only the count's memset
    assert rc < 0


# ---- on a GPU ------------------------------------------------------------------------

@cuda
@lib
def test_the_library_is_the_one_described():
    assert _cuda.tile() == TILE
    assert all(_cuda.supports(_cuda.KIND_EXACT, c) for c in CODES.values())
    assert [_cuda.supports(_cuda.KIND_COMPARE, CODES[t]) for t in CODES] == \
        [t.is_floating_point for t in CODES]


@cuda
@lib
@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spec", POLICIES)
def test_exact_and_threshold_select_what_the_portable_path_selects(dtype, n, spec):
    x, r = pair(n, dtype, n + len(spec))
    check(x, r, spec, 65536, "cuda")


@cuda
@lib
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("n", [1, TILE - 1, TILE + 1, 100_003, 3 << 20])
@pytest.mark.parametrize("spec", BUDGETS)
@pytest.mark.parametrize("chunk", [65536, 1000])
@pytest.mark.parametrize("cluster", [False, True])
def test_budget_selects_what_the_portable_path_selects(dtype, n, spec, chunk, cluster):
    if chunk < 65536 and n > 100_003:
        pytest.skip("small chunks on smaller tensors only (the portable path is slow)")
    x, r = pair(n, dtype, n + 7, cluster)
    check(x, r, spec, chunk, "cuda")


@cuda
@lib
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int32])
@pytest.mark.parametrize("spec", ["exact", "threshold:1e-3"])
def test_an_output_overflow_runs_again(dtype, spec):
    x, r = pair(100_003, dtype, 5)
    check_overflow(x, r, spec, "cuda")


@cuda
@lib
def test_many_tiles_in_order():
    """32M elements (8192 tiles): the look-back and the tickets under load."""
    x, r = pair(1 << 25, torch.float32, 11)
    want = want_indices(x, r, "threshold:1e-3", 65536)
    got = kernel_indices(x.cuda(), r.cuda(), "threshold:1e-3", 65536)
    assert torch.equal(got.cpu(), want)


@cuda
@lib
def test_the_current_stream_is_used():
    x, r = pair(1 << 20, torch.float32, 3)
    want = want_indices(x, r, "threshold:1e-3", 65536)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        xg, rg = x.cuda(), r.cuda()  # queued on s: the kernel must follow them
        got = kernel_indices(xg, rg, "threshold:1e-3", 65536).cpu()
    assert torch.equal(got, want)


@cuda
@lib
@pytest.mark.parametrize("dtype", QFLOATS)
@pytest.mark.parametrize("n", [TILE + 1, 100_003, 3 << 20])
@pytest.mark.parametrize("spec", QUANTIZED)
def test_the_quantizer_quantizes_as_the_portable_path(dtype, n, spec):
    x, r = pair(n, dtype, n + 3)
    check_quant(x, r, spec, 65536, "cuda")


def run(path, dev, policy, monkeypatch, kernel):
    monkeypatch.setenv("AMBER_CUDA_KERNEL", "1" if kernel else "0")
    g = torch.Generator().manual_seed(1)
    ts = {"a": torch.randn(300_000, generator=g), "b": torch.randn(5000, generator=g).half(),
          "c": torch.randn(7000, generator=g).double(), "d": torch.zeros(999, dtype=torch.int32),
          "e": torch.randn(3000, generator=g).to(torch.float8_e4m3fn)}
    live = {k: v.to(dev) for k, v in ts.items()}
    out = []
    with Checkpointer(path, policy=policy, chunk_elems=65536, rng=False, full_every=100) as ck:
        for step in range(1, 10):
            for k, v in ts.items():
                if v.dtype.is_floating_point:
                    v.copy_((v.float() + torch.randn(v.shape, generator=g) * 1e-3).to(v.dtype))
                else:
                    v[step * 7] += step
                live[k].copy_(v)
            ck.save(step, {"s": live})
            ck.wait()
            with amber.Store(path, readonly=True) as st, st.reader() as r:
                out.append({t.name: bytes(r.read(t.index)) for t in r.tensors()})
    return out


@cuda
@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("policy", ["exact", "threshold:1e-3:1e-2", "budget:0.05:1e-2", "lossy",
                                    "threshold:1e-3:1e-2@q4+lead", "budget:0.05:1e-2@q8",
                                    "threshold:0:0.3@bf16"])
def test_cuda_tensors_restore_what_the_cpu_path_restores(tmp_path, monkeypatch, kernel, policy):
    if kernel and device._cuda_lib() is None:
        pytest.skip("libamber_cuda was not built")
    monkeypatch.setenv("AMBER_DEVICE_PATH", "0")
    want = run(str(tmp_path / "cpu"), "cpu", policy, monkeypatch, False)
    got = run(str(tmp_path / "gpu"), "cuda", policy, monkeypatch, kernel)
    for step, (a, b) in enumerate(zip(want, got), 1):
        for name in a:
            assert a[name] == b[name], f"step {step}: {name} differs"


# ---- everywhere: amber._cuda's glue over a model of the kernel -----------------------

FLOAT_OF = {amber.F32: torch.float32, amber.F16: torch.float16, amber.BF16: torch.bfloat16,
            amber.F64: torch.float64, amber.F8_E4M3: torch.float8_e4m3fn,
            amber.F8_E5M2: torch.float8_e5m2}


def _mem(addr, n, dtype):
    """n elements of `dtype` at host address addr, shared."""
    if not n:
        return torch.zeros(0, dtype=dtype)
    w = torch.empty(0, dtype=dtype).element_size()
    buf = (ctypes.c_uint8 * (n * w)).from_address(addr)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype)


class Model:
    """libamber_cuda's contract (src/cuda/select.cu) on CPU memory: the per-element rule
    is _select.flags (what the kernel mirrors), the compaction in index order, outputs
    written up to the capacity, the count past it, the reference moved by what is
    written. Only amber._cuda's glue is checked with it, not the kernel."""

    def amber_cuda_tile(self):
        return TILE

    def amber_cuda_scratch_bytes(self, n):
        return 8 * ((n + TILE - 1) // TILE + 1)

    def amber_cuda_supports(self, kind, code):
        return int(kind == 0 or (kind == 1 and code in FLOAT_OF))

    def amber_cuda_select(self, ref, stream):
        a = ref._obj
        assert stream is None and a.scratch and a.scratch_bytes >= \
            self.amber_cuda_scratch_bytes(a.n)
        n, w = a.n, a.width
        bt = _cuda._BITS[w]
        xb, rb = _mem(a.live or 0, n, bt), _mem(a.ref or 0, n, bt)
        if a.kind == 0:
            sel = xb != rb
            key = torch.zeros(n, dtype=torch.int64)
        else:
            ft = FLOAT_OF[a.dtype]
            x, r = xb.view(ft), rb.view(ft)
            ab = torch.full((n,), a.abs_b, dtype=torch.float64)
            if a.chunk_abs:
                ch = _mem(a.chunk_abs, (n + a.chunk_elems - 1) // a.chunk_elems, torch.float64)
                ab = ch[torch.arange(n) // a.chunk_elems]
            if ft != torch.float64:
                ab = ab.float()
            sel, key, _ = _select.flags(x, r, ab, a.rel_b, a.cap_b)
        idx = sel.nonzero().squeeze(1)
        k = idx.numel()
        _mem(a.count, 1, torch.int64)[0] = k
        m = min(k, a.capacity)
        idx = idx[:m]
        if m:
            _mem(a.idx, m, torch.int64).copy_(idx)
            if a.vals:
                _mem(a.vals, m, bt).copy_(xb[idx])
            if a.olds:
                _mem(a.olds, m, bt).copy_(rb[idx])
            if a.keys:
                kk = key[idx]
                _mem(a.keys, m, torch.int32).copy_(torch.where(kk >= 1 << 31, kk - (1 << 32), kk))
            if a.update:
                rb[idx] = xb[idx]
        return 0

    def amber_cuda_qscratch_bytes(self, nchunks):
        return 12 * nchunks

    def amber_cuda_quantize(self, ref, stream):
        """The quantizer's contract: amber._quant.quantize's outputs written to the
        caller's buffers, the reference moved by them."""
        a = ref._obj
        assert stream is None
        ft = FLOAT_OF[a.dtype]
        bt = _cuda._BITS[torch.empty(0, dtype=ft).element_size()]
        k, kind = a.k, "budget" if a.budget else "threshold"
        rl = _quant.Rule(kind, a.abs, a.rel, a.cap, a.mode, bool(a.lead))
        idx = _mem(a.idx, k, torch.int64)
        out = _quant.quantize(rl, _mem(a.vals, k, bt).view(ft), _mem(a.olds, k, bt).view(ft),
                              idx // a.chunk_elems, a.nchunks)
        _mem(a.codes, k, out.codes.dtype).copy_(out.codes)
        _mem(a.esc, k, torch.bool).copy_(out.esc)
        _mem(a.news, k, bt).copy_(out.new)
        if out.steps is not None:
            _mem(a.steps, a.nchunks, torch.float32).copy_(out.steps)
        if a.ref:
            rb = _mem(a.ref, int(idx.max()) + 1 if k else 0, bt)
            rb[idx] = out.new
        return 0


def _emulated(path):
    """libamber_cuda's real source built for the CPU emulator (tests/gpu/emu/build.sh),
    with the signatures amber._cuda gives the real library."""
    emu = ctypes.CDLL(path)
    assert _cuda.declare(emu)  # every entry point, laid out as amber._cuda's mirrors
    assert emu.amber_cuda_tile() == TILE
    return emu


@pytest.fixture
def model(monkeypatch):
    """The kernel's contract on the CPU: the Model above, or, with AMBER_CUDA_EMU set to
    a library built by tests/gpu/emu/build.sh, the kernel's own source emulated."""
    emu = os.environ.get("AMBER_CUDA_EMU")
    monkeypatch.setattr(_cuda, "_lib", _emulated(emu) if emu else Model())


@pytest.mark.parametrize("dtype", FLOATS + [torch.int32, torch.bool])
@pytest.mark.parametrize("n", [0, 1, TILE + 1, 100_003])
@pytest.mark.parametrize("spec", POLICIES + BUDGETS)
@pytest.mark.parametrize("chunk", [65536, 1000])
@pytest.mark.parametrize("cluster", [False, True])
def test_glue_selects_what_the_portable_path_selects(model, dtype, n, spec, chunk, cluster):
    if not spec.startswith("budget") and (cluster or chunk < 65536):
        pytest.skip("chunks and clusters matter to budget only")
    if chunk < 65536 and n > TILE + 1:
        pytest.skip("covered by the other cases")
    x, r = pair(n, dtype, n + 7, cluster)
    check(x, r, spec, chunk, "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int32])
@pytest.mark.parametrize("spec", ["exact", "threshold:1e-3"])
def test_glue_runs_again_after_an_overflow(model, dtype, spec):
    x, r = pair(100_003, dtype, 5)
    check_overflow(x, r, spec, "cpu")


@pytest.mark.parametrize("dtype", QFLOATS)
@pytest.mark.parametrize("n,chunk", [(TILE + 1, 1000), (100_003, 65536)])
@pytest.mark.parametrize("spec", QUANTIZED)
def test_glue_quantizes_as_the_portable_path(model, dtype, n, chunk, spec):
    x, r = pair(n, dtype, n + 3)
    check_quant(x, r, spec, chunk, "cpu")


def test_glue_budget_fills_from_a_cluster(model):
    """A strict chunk that the pass leaves short takes the rest from its band."""
    x, r = pair(100_003, torch.float32, 9, cluster=True)
    out = _cuda._budget_plan(x, r, 0.05, float("inf"), 65536, 2)
    assert any(out[3]), "no strict chunk: the case is not tested"
    check(x, r, "budget:0.05", 65536, "cpu")


def same_as_cpu_path_through(tmp_path, monkeypatch, policy, *entries):
    """run()'s trajectory on CPU tensors through the device path, the kernel branch
    forced and amber._cuda's `entries` (over the model) counted, restores at every step
    what the CPU path restores."""
    monkeypatch.setenv("AMBER_DEVICE_PATH", "0")  # (AMBER_DEVICE_REFERENCE is then unused)
    want = run(str(tmp_path / "cpu"), "cpu", policy, monkeypatch, False)
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1")
    monkeypatch.setattr(device, "_kernel_wanted", lambda x: True)
    calls = {}
    for entry in entries:
        real = getattr(_cuda, entry)
        monkeypatch.setattr(_cuda, entry, lambda *a, entry=entry, real=real: calls.update(
            {entry: 1}) or real(*a))
    got = run(str(tmp_path / "dev"), "cpu", policy, monkeypatch, False)
    assert sorted(calls) == sorted(entries), f"amber._cuda: only {sorted(calls)} were used"
    for step, (a, b) in enumerate(zip(want, got), 1):
        for name in a:
            assert a[name] == b[name], f"step {step}: {name} differs"


@pytest.mark.parametrize("policy", ["exact", "budget:0.05:1e-2", "lossy"])
def test_glue_with_the_reference_on_the_host_restores_what_the_cpu_path_restores(
        tmp_path, monkeypatch, model, policy):
    """With AMBER_DEVICE_REFERENCE=host, _Tensor._select_indices' kernel branch
    (indices only, chunk by chunk; the model standing in for the kernel, on CPU
    tensors) restores at every step what the CPU path restores."""
    monkeypatch.setenv("AMBER_DEVICE_REFERENCE", "host")
    same_as_cpu_path_through(tmp_path, monkeypatch, policy, "indices")


@pytest.mark.parametrize("policy", ["threshold:1e-3:1e-2@q4+lead", "budget:0.05:1e-2@q8"])
def test_glue_quantized_deltas_through_the_kernels_restore_what_the_cpu_path_restores(
        model, tmp_path, monkeypatch, policy):
    """amber.device under a quantized policy with the fused select and the kernel's
    quantizer (here over the model, or the emulated source; CPU tensors made to take
    them): every step restores as through the CPU path."""
    same_as_cpu_path_through(tmp_path, monkeypatch, policy, "select", "quantize")


@pytest.mark.parametrize("policy", ["exact", "threshold:1e-3:1e-2", "budget:0.05:1e-2", "lossy"])
def test_the_fused_select_in_the_device_path_restores_what_the_cpu_path_restores(
        model, tmp_path, monkeypatch, policy):
    """amber.device's _Tensor.select takes (indices, values, olds) from the fused pass
    with the reference moved (here over the model, CPU tensors made to take it):
    the trajectory restores as through the CPU path, dense chunks included, and a
    failed save puts the reference back as the last committed step restores it."""
    same_as_cpu_path_through(tmp_path, monkeypatch, policy, "select")
    # a failed save: the references go back to what the store restores
    path = str(tmp_path / "dev")
    x = torch.randn(300_000, generator=torch.Generator().manual_seed(5))
    with Checkpointer(path + "2", policy=policy, chunk_elems=65536, rng=False) as ck:
        ck.save(1, {"x": x})
        ck.wait()
        x += 0.5 * (torch.rand(x.shape) < 0.01)
        ck.save(2, {"x": x})
        ck.wait()
        ref2 = ck._saver.dev.tensors["x"].ref.clone()
        x += 1e-2 * torch.randn(x.shape)
        monkeypatch.setattr(amber.Writer, "begin", lambda *a, **k: (_ for _ in ()).throw(
            OSError("disk gone")))
        with pytest.raises(OSError):
            ck.save(3, {"x": x})
        assert torch.equal(ck._saver.dev.tensors["x"].ref.view(torch.int32), ref2.view(torch.int32))
