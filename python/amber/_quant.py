"""amber._quant - the quantizer of src/quant.c in torch operations, for the
accelerator path (amber.device): a delta's selected changes become codes on the
tensors' device, and the device reference moves to exactly what a restore decodes.

A policy with a value code (`threshold:ABS[:REL]@q8`, `budget:FRAC:CAP@q4+lead`,
`...@bf16`) stores each selected change as a small integer code times a step (or
a bf16 delta) instead of the new value; the reference then takes the restored
value, so the rounding error stays in live - reference (error feedback). A change
that no code carries within the policy's bound is stored whole (an escape) and the
reference takes the live value there. docs/FORMAT.md ("Quantized sparse body")
defines the restore; src/quant.c is the specification of the encoder, and this
file repeats it operation by operation, so that a delta saved through the device
path restores, bit for bit, what the CPU path restores:
  - every operation is one torch operation, rounded by itself: f32 arithmetic for
    f32, bf16 and f16 tensors (their values widened exactly), f64 for f64; nothing
    fused or reordered; torch.round rounds half to even, as nearbyint;
  - a division's divisor is always a tensor on the operands' device (CUDA divides
    by a host scalar as a multiplication by its reciprocal, which rounds otherwise);
  - bf16 and f16 restores are rounded to the dtype by torch's conversion (to
    nearest, ties to even, as src/half.h);
  - bounds are checked in f64 at the restored value, as quant.c's within().
Steps (AMBER__QSTEP_SHARE = 0.5 of the bound): a threshold's element step is
a + b*|r| with a = f32(0.5*ABS), b = f32(0.5*REL); a budget has one step per chunk,
max(0.5*lo, hi/qmax) at most f32(CAP), where lo and hi are the least and largest
finite |change| selected in the chunk (lo is the chunk's cut, which +lead keeps to).
"""
from collections import namedtuple

import numpy as np
import torch

Q8, Q4, BF16 = 1, 2, 3  # AMBER_QV_*
_CODES = {"q8": Q8, "q4": Q4, "bf16": BF16}
_QMAX = {Q8: 127, Q4: 7}
SHARE = 0.5  # AMBER__QSTEP_SHARE
DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)  # amber__quant_dtype

# A quantized policy, as amber__policy holds it: kind "threshold" (abs, rel) or
# "budget" (cap); mode (Q8, Q4, BF16) and lead.
Rule = namedtuple("Rule", "kind abs rel cap mode lead")
# What quantize() returns for k selected elements: codes (int8 for Q8 and Q4, bf16
# bits as int16 for BF16; 0 where escaped), esc (bool: stored whole), new (the bits
# the reference takes: the restored value, or the live one where escaped, as an
# integer tensor of the element width) and steps (f32 per chunk, Q8 and Q4; None for
# BF16) with rel_step, the b of every step.
Quantized = namedtuple("Quantized", "codes esc new steps rel_step")


def split(spec):
    """(the spec without its value code, mode (0 when none), lead) of a policy spec
    as amber__policy_parse reads it."""
    base, at, code = spec.partition("@")
    if not at:
        return spec, 0, False
    name, plus, lead = code.partition("+")
    if name not in _CODES or (plus and lead != "lead") or (plus and name == "bf16"):
        raise ValueError(f"bad value code in policy {spec!r}")
    return base, _CODES[name], bool(plus)


def rule(kind, a, b, spec, dtype):
    """The quantized Rule of policy `spec` (already parsed to (kind, a, b) as
    amber.device._parse returns it) for a tensor of `dtype`, or None when its deltas
    store plain values: no value code, an exact policy, or a dtype without a
    quantized encoding (f8: as amber__quant_dtype)."""
    _, mode, lead = split(spec)
    if not mode or kind not in ("threshold", "budget") or dtype not in DTYPES:
        return None
    if kind == "threshold":
        return Rule(kind, a, b, float("inf"), mode, lead)
    return Rule(kind, 0.0, 0.0, b, mode, lead)


def _fixed(k, mode):
    """The bytes of a QSPARSE body that do not depend on positions and escapes:
    value_mode .. n_escapes, the step (one per chunk: chunks hold at most 2^24
    elements) and the codes."""
    codes = (k + 1) // 2 if mode == Q4 else 2 * k if mode == BF16 else k
    return 12 + (4 if mode != BF16 and k else 0) + codes


def body_bound(n, k, nesc, w, mode):
    """amber__qsparse_bound: the largest QSPARSE body of k of n elements of width w
    with nesc escapes."""
    return 1 + (n + 7) // 8 + _fixed(k, mode) + nesc * (5 + w)


def _varints(gaps):
    """The bytes of the LEB128 varints of `gaps` (an int64 tensor)."""
    size = torch.ones_like(gaps)
    for shift in (7, 14, 21, 28):
        size += gaps >= 1 << shift
    return int(size.sum())


def _gaps(ix):
    """FORMAT.md's varint gaps of increasing indices: the first, then each index
    less the one before it, less 1."""
    g = ix.clone()
    g[1:] -= ix[:-1] + 1
    return g


def body_size(n, idx, ords, w, mode):
    """The size of the QSPARSE body that amber__qsparse_encode writes for the k
    selected elements `idx` (increasing, within a chunk of n) of width w, those at
    ordinals `ords` escaped: the positions as bitmap or varint gaps, whichever is
    smaller."""
    positions = 1 + min((n + 7) // 8, _varints(_gaps(idx)))
    return positions + _fixed(idx.numel(), mode) + _varints(_gaps(ords)) + ords.numel() * w


def stored_whole(mode, n, w, k, nesc, selection):
    """Whether a quantized chunk of n elements of width w, k of them selected and
    nesc of those escaped, is stored whole (RAW) rather than as QSPARSE, as
    src/chunk.c decides it: whole when its body is not smaller than the chunk, or
    may be larger than the chunk by more than 16 bytes (amber_writer_set_selection
    refuses those). `selection()` gives (the chunk's selected indices, the escapes'
    ordinals), asked only when the bound alone does not decide."""
    bound = body_bound(n, k, nesc, w, mode)
    if bound > n * w + 16:
        return True
    if bound < n * w:
        return False
    return body_size(n, *selection(), w, mode) >= n * w


def _f32(v):
    """(float)v, as C rounds a double to f32 (to nearest; overflow to Inf)."""
    with np.errstate(over="ignore"):
        return float(np.float32(v))


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class _Elements:
    """The k selected elements widened as quant.c's load() does: x, r and their
    change d in the arithmetic type ft (f32, or f64 for f64), and the restore."""

    def __init__(self, x, r):
        self.dtype = x.dtype
        self.f64 = x.dtype == torch.float64
        self.ft = torch.float64 if self.f64 else torch.float32
        self.fx, self.fr = x.to(self.ft), r.to(self.ft)
        self.d = self.fx - self.fr
        self.x64 = self.fx.double()
        self.ok = torch.isfinite(self.fx) & torch.isfinite(self.fr) & torch.isfinite(self.d)

    def restore(self, s, code):
        """quant.c's restore(): r + code * s (Q8, Q4: code a float tensor of integers,
        s the steps) or r + code (BF16: s None, code the bf16 deltas), in ft, rounded
        to the dtype. Returns (the value in the dtype, widened to f64)."""
        if s is None:
            v = self.fr + code.to(self.ft)
        else:
            v = self.fr + code * s
        if self.dtype in (torch.bfloat16, torch.float16):
            v = v.to(self.dtype)
        return v, v.double()

    def within(self, rl, v64):
        """quant.c's within(): the restore v64 is finite and |x - v| <= the bound at v
        (threshold: ABS + REL*|v|; budget: CAP), in f64."""
        bound = rl.abs + rl.rel * v64.abs() if rl.kind == "threshold" else rl.cap
        return torch.isfinite(v64) & ((self.x64 - v64).abs() <= bound)


def rel_step_of(rl):
    """The b of every step (the body's rel_step): f32(0.5*REL) for a threshold with
    Q8 or Q4 codes, else 0."""
    return _f32(SHARE * rl.rel) if rl.kind == "threshold" and rl.mode != BF16 else 0.0


def _budget_steps(e, cid, nchunks, qmax, cap):
    """budget_step() per chunk: (steps, cuts), f32 tensors of nchunks."""
    ad = e.d.abs() if not e.f64 else e.d.abs().float()
    fin = torch.isfinite(e.fx) & torch.isfinite(e.fr) & torch.isfinite(ad)
    inf = float("inf")
    f32 = dict(dtype=torch.float32, device=ad.device)
    lo = torch.full((nchunks,), inf, **f32).scatter_reduce(
        0, cid, torch.where(fin, ad, inf), "amin")
    hi = torch.zeros(nchunks, **f32).scatter_reduce(
        0, cid, torch.where(fin, ad, 0.0), "amax")
    lo = torch.where(torch.isfinite(lo), lo, 0.0)  # nothing finite: every element escapes
    s = lo * SHARE
    m = hi / torch.full_like(hi, qmax)
    s = torch.where(m > s, m, s)
    capf = _f32(cap)
    return torch.where(s > capf, capf, s), lo


def _codes(e, s, qmax):
    """code_of(): the nearest code of d / s (ties to even) and whether it is one
    (|code| <= qmax; the change and its elements finite)."""
    t = e.d / s
    c = torch.round(t)
    valid = e.ok & (t.abs() <= qmax + 0.5) & (c.abs() <= qmax)
    # codes are integers: a change that rounds to -0 has code 0, which restores
    # r + 0*s (+0 for r = -0), as in C
    return torch.where(valid, c, 0.0).to(torch.int32).to(t.dtype), valid


def _lead(rl, e, s, c, valid, qmax, cut):
    """lead_code(): from the farthest code in the change's direction that the bound
    could allow back towards c, the first (of at most 4) whose restore is within the
    bound (a budget's: within its cut too); c where none is."""
    one = torch.ones_like(e.d)
    sgn = torch.where(e.d > 0, one, -one)
    if rl.kind == "threshold":
        ef = (rl.abs + rl.rel * e.fr.abs()) if e.f64 else \
            (_f32(rl.abs) + _f32(rl.rel) * e.fr.abs())
    else:
        ef = cut.to(e.ft)
    far = (e.d.abs() + ef) / s
    f = torch.where(far >= qmax, float(qmax), far.trunc())  # NaN: no try (f > ... is False)
    out, searching = c, valid
    for _ in range(4):
        searching = searching & (f > sgn * c)
        cand = f * sgn
        _, v64 = e.restore(s, cand)
        good = searching & e.within(rl, v64)
        if rl.kind == "budget":
            good = good & ((e.x64 - v64).abs() <= cut.double())
        out = torch.where(good, cand, out)
        searching = searching & ~good
        f = f - 1
    return out


def quantize(rl, x, r, cid, nchunks):
    """amber__quantize over the k selected elements of a tensor's chunks: x and r
    are their live and reference values (k elements of a quantized dtype, on one
    device), cid each one's chunk (int64, non-decreasing, below nchunks). Returns
    Quantized (see there); the caller moves the reference at the elements to `new`."""
    e = _Elements(x, r)
    steps, rel_step = None, rel_step_of(rl)
    if rl.mode == BF16:
        code = (e.d.float() if e.f64 else e.d).bfloat16()
        v, v64 = e.restore(None, code)
        good = e.ok & e.within(rl, v64)
        codes = torch.where(good, _bits(code), 0)
    else:
        qmax = _QMAX[rl.mode]
        cut = None
        if rl.kind == "threshold":
            ae = _f32(SHARE * rl.abs)
            steps = torch.full((nchunks,), ae, dtype=torch.float32, device=x.device)
        else:
            steps, cuts = _budget_steps(e, cid, nchunks, qmax, rl.cap)
            ae, cut = steps[cid], cuts[cid]
        if e.f64:  # step_of(): (double)a + (double)b * |r|
            ae = ae.double() if torch.is_tensor(ae) else ae
        s = ae + rel_step * e.fr.abs()
        c, valid = _codes(e, s, qmax)
        if rl.lead:
            c = _lead(rl, e, s, c, valid, qmax, cut)
        v, v64 = e.restore(s, c)
        good = valid & e.within(rl, v64)
        codes = torch.where(good, c, 0.0).to(torch.int8)
    new = torch.where(good, _bits(v), _bits(x))
    return Quantized(codes, ~good, new, steps, rel_step)
