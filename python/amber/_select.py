"""The selection rules of a delta, in torch operations, exactly as src/scan.c makes
them (the device path's reference: amber.device runs them on any device, and
amber._cuda's kernels follow the same rules and fall back to them): which elements a
policy stores, per chunk, with the same bounds, rounding and ties as the C scan.
A leaf module: amber.device and amber._cuda both use it."""

import numpy as np
import torch

from amber import _quant


SHRINK = 1.0 - 1.0 / 1048576.0
TINY = 2.0 ** -149
FORCED = 0xFFFFFFFF
EXP32 = 0x7F800000
EXP64 = 0x7FF0000000000000
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
SMALL = (torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2)
FLOAT = SMALL + (torch.float32, torch.float64)
RUNS, RUN = 8, 256


def bits(t):
    return t.view(INT[t.element_size()])


def f32_down(v):
    """float(v * SHRINK) rounded to f32 and never above it (scan.c's bounds)."""
    if v == float("inf"):
        return v
    s = v * SHRINK
    f = np.float32(s)
    if float(f) > s:
        f = np.nextafter(f, np.float32(0))
    return float(f)


def parse(spec):
    """(kind, a, b) of a policy spec as amber__policy_parse reads it: threshold
    (ABS, REL), budget (FRAC, CAP); a value code after '@' does not change what is
    selected (amber._quant reads it)."""
    if spec == "exact":
        return "exact", 0.0, 0.0
    kind, _, args = _quant.split(spec)[0].partition(":")
    a, _, b = args.partition("/")[0].partition(":")
    if kind == "threshold":
        return kind, float(a), float(b) if b else 0.0
    if kind == "budget":
        return kind, float(a), float(b) if b else float("inf")
    raise ValueError(f"unknown policy {spec!r}")


def hist_keep(bucket, forced, budget):
    """scan.c's hist_cut and its keep rule: of candidates with 12-bit `bucket`s, the
    forced ones and the `budget` in the highest buckets, ties in the cut bucket in
    index order (a bool mask)."""
    hist = torch.bincount(bucket[~forced], minlength=4096)
    ge = hist.flip(0).cumsum(0).flip(0)  # ge[b]: the non-forced in buckets >= b
    cut = int((ge > budget).sum()) - 1
    partial = 0
    if cut >= 0:
        partial = budget - (int(ge[cut + 1]) if cut < 4095 else 0)
    eq = (bucket == cut) & ~forced
    return forced | (bucket > cut) | (eq & (eq.cumsum(0) <= partial))


def share(spec):
    """(SHARE, MULT) of a threshold's share cap ("threshold:ABS:REL/SHARE:MULT"), or
    None."""
    base = _quant.split(spec)[0]
    if not base.startswith("threshold:") or "/" not in base:
        return None
    share, _, mult = base.partition("/")[2].partition(":")
    return float(share), float(mult)


def share_trim(x, r, idx, chunk, nchunks, a, b, share, mult):
    """scan.c's share_trim, chunk by chunk: of the indices a threshold selected
    (increasing, into flat x and its reference r), a chunk of m elements with more
    than max(1, floor(SHARE * m)) keeps the forced ones (beyond MULT bounds, or to
    or from NaN or Inf) and the farthest over their bound by the 12-bit histogram of
    the f32 bits of change / bound, ties in index order; decided in f64 as in C."""
    if not idx.numel():
        return idx
    n = x.numel()
    cid = idx // chunk
    counts = torch.bincount(cid, minlength=nchunks).tolist()
    limits = [max(1, int(share * min(chunk, n - j * chunk))) for j in range(nchunks)]
    over = [j for j in range(nchunks) if counts[j] > limits[j]]
    if not over:
        return idx
    xd, rd = x[idx].double(), r[idx].double()
    d = (xd - rd).abs()
    e = rd.abs().mul_(b).add_(a)
    forced = ~(d <= e * mult) | torch.isinf(d)
    t = (d / e).float()
    key = (t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF) >> 20
    keep = torch.ones_like(forced)
    for j in over:
        inside = (cid == j).nonzero().squeeze(1)
        fj = forced[inside]
        keep[inside] = hist_keep(key[inside], fj, max(limits[j] - int(fj.sum()), 0))
    return idx[keep]


def flags(x, r, abs_b, rel_b, cap_b):
    """(selected, key, f32 change) of flags_f32 / flags_f64 for flat float tensors x
    and r (same dtype); abs_b may be a tensor (one bound per element)."""
    if x.dtype == torch.float64:
        xb, rb = x.view(torch.int64), r.view(torch.int64)
        d = (x - r).abs()
        b = abs_b + rel_b * r.abs()
        nf = ((xb & EXP64) == EXP64) | ((rb & EXP64) == EXP64)
        forced = (nf & (xb != rb)) | (d > cap_b)
        sel = (d > b) | forced
        df = torch.where(d > 3e38, torch.full_like(d, 3e38), d).float()
    else:
        fx, fr = (x.float(), r.float()) if x.dtype != torch.float32 else (x, r)
        xb, rb = fx.view(torch.int32), fr.view(torch.int32)
        d = (fx - fr).abs()
        b = (abs_b + rel_b * fr.abs()) - TINY  # the order of scan.c's f32 arithmetic
        b = torch.where(b > 0, b, torch.zeros_like(b))  # NaN is not > 0: 0, as in C
        nf = ((xb & EXP32) == EXP32) | ((rb & EXP32) == EXP32)
        forced = (nf & (xb != rb)) | (d > cap_b)
        sel = (d > b) | forced
        df = d
        if x.dtype != torch.float32:  # distinct NaNs of a small float may widen alike
            extra = ~sel & torch.isnan(fx) & (bits(x) != bits(r))
            sel = sel | extra
            forced = forced | extra
    kb = df.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    key = torch.where(forced, torch.full_like(kb, FORCED),
                      torch.where(nf, torch.zeros_like(kb), kb))
    return sel, key, df


def candidates(x, r, abs_b, rel_b, cap_b, keys):
    """(indices, keys or None, change) of what flags selects, in fewer passes: for a
    finite change the rule is `d > min(bound, cap)` (a reference that is not finite
    makes the change not finite), so only the rare elements whose change is not
    finite (NaN, Inf, overflow) take flags' full rule. `change` is |x - r| in the
    precision of the comparison (f32 for every dtype but f64)."""
    f64 = x.dtype == torch.float64
    fx, fr = (x, r) if x.dtype in (torch.float32, torch.float64) else (x.float(), r.float())
    d = fx - fr
    d.abs_()
    if rel_b:
        b = fr.abs()
        b.mul_(rel_b).add_(abs_b)
        if not f64:
            b.sub_(TINY).clamp_min_(0.0)
        lim = b.clamp_max_(cap_b) if cap_b != float("inf") else b
    else:
        lim = min(abs_b if f64 else max(abs_b - TINY, 0.0), cap_b)
    sel = d > lim
    special = None
    if d.numel() and not torch.isfinite(d.amax()):  # NaN propagates through amax
        special = (~torch.isfinite(d)).nonzero().squeeze(1)
        sel[special] = False
    idx = sel.nonzero().squeeze(1)
    key = None
    if keys:
        dk = d[idx]
        if f64:
            dk = torch.where(dk > 3e38, torch.full_like(dk, 3e38), dk).float()
        kb = dk.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
        key = torch.where(d[idx] > cap_b, torch.full_like(kb, FORCED), kb)
    if special is not None and special.numel():
        ssel, skey, _ = flags(x[special], r[special], abs_b, rel_b, cap_b)
        idx = torch.cat([idx, special[ssel]])
        order = idx.argsort()
        idx = idx[order]
        if keys:
            key = torch.cat([key, skey[ssel]])[order]
    return idx, key, d


def sample_d(x, r):
    """budget_threshold's sampled changes as f32: f32 in f32, the rest via f64."""
    if x.dtype == torch.float32:
        v = (x - r).abs()
        return torch.where(torch.isfinite(v), v, torch.zeros_like(v))
    v = (x.double() - r.double()).abs()
    return torch.where(torch.isfinite(v), v, torch.zeros_like(v)).float()


def budget_threshold(d, n, budget):
    """(thr, strict, lo, hi) from the sampled changes `d` (numpy f32) of a chunk of
    n elements, as budget_threshold computes them."""
    m = len(d)
    in_sample = float(budget) * float(m) / float(n)
    want = int(1.25 * in_sample) or 1
    if want >= m:
        return 0.0, False, 0.0, 0.0
    kth = np.sort(d)[::-1][want]
    thr = float(np.nextafter(kth, np.float32(0))) if kth > 0 else 0.0
    if not (kth > 0) or not np.isfinite(kth):
        return thr, False, 0.0, 0.0
    lo = np.float32(kth) * np.float32(1.0 - 2.0 ** -10)
    hi = np.float32(kth) * np.float32(1.0 + 2.0 ** -10)
    near = int(np.count_nonzero((d > lo) & (d <= hi)))
    if near >= 8 and near >= 4 * in_sample:
        return thr, True, float(lo), float(hi)
    return thr, False, 0.0, 0.0


def sample_positions(n):
    if n <= RUNS * RUN:
        return torch.arange(n)
    step = (n - RUN) // (RUNS - 1)
    return torch.cat([torch.arange(step * k, step * k + RUN) for k in range(RUNS)])


def budget_chunk(x, r, frac, cap):
    """Indices (int64, increasing) that a budget selects in one chunk."""
    n = x.numel()
    budget = int(frac * n)
    if budget == 0 and frac > 0:
        budget = 1
    strict, lo, hi = False, 0.0, 0.0
    if budget >= n:
        abs_ = 0.0
    else:
        pos = sample_positions(n).to(x.device)
        d = sample_d(x[pos], r[pos]).cpu().numpy()
        abs_, strict, lo, hi = budget_threshold(d, n, budget)
    if abs_ > cap or hi > cap:
        abs_ = min(abs_, cap)
        strict = False
    if x.dtype == torch.float64:
        strict = False
        idx, key, df = candidates(x, r, abs_, 0.0, cap, True)
    else:
        abs_f = hi if strict else f32_down(abs_)
        idx, key, df = candidates(x, r, abs_f, 0.0, f32_down(cap), True)
    k = idx.numel()
    if k > budget:  # budget_cut: keep forced, the largest by 12-bit buckets, ties first
        forced = key == FORCED
        return idx[hist_keep(key >> 20, forced, budget)]
    if strict and k < budget:  # fill_band: more from the cluster, in index order
        band = (df > lo) & (df <= hi)
        band[idx] = False  # candidates are in the reference already
        more = band.nonzero().squeeze(1)[:budget - k]
        return torch.cat([idx, more]).sort().values
    return idx
