#!/usr/bin/env python3
"""fidelity_screen.py - a fast, in-process screen of delta policies under repeated
resumes (issue 22), to pick candidates before bench/fidelity.py measures them.

It trains the demo's GPT exactly as bench/fidelity.py does (same data order, dropout
and schedule per seed) in one process, without amber: it keeps a reference per weight
(W), first moment (M) and second moment (V) tensor, applies each class's rule after
every step (the selection, then the stored value or code, and the reference moved to
what a restore would give: error feedback), estimates the delta's bytes (the body
compressed by zstd -1, as the library's QSPARSE/SPARSE bodies, plus 40 bytes a chunk),
and every K steps "resumes": the live W, M, V are set to their references. RNG, data
position and step counters are what a real resume restores, so a screen and a real
run differ only by what this model of the rules leaves out (the budget's exact cut
and its cluster fill, the f32 shrink of bounds, file metadata). On the demo its
numbers matched bench/fidelity.py's within 0.02% of eval loss and 0.1% of delta size
(issue-16 presets: +0.43% at 20.1% against +0.42% at 20.1%; +1.98% at 3.23% against
+2.00% at 3.2%, seed 0, K=20). Real measurements come from bench/fidelity.py.

The quantizers follow src/quant.c (steps of half the bound, a budget's cut, the lead
to the bound's edge, escapes) in torch; "group" is the rejected per-64-codes step.
Needs the `zstandard` package (pip install zstandard; not in requirements-dev.txt:
this is a research tool, not part of the tests).

    fidelity_screen.py POLICY [--seeds 0,1,2] [--ks 20] [--steps 200] [--list]
"""
import argparse
import json
import math
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import demo_gpt as demo  # noqa: E402

CHUNK_OVERHEAD = 40  # a chunk entry of the index


def R(sel="exact", **kw):
    """A class's rule. sel: exact, thr (ABS abs [* lr if unit="lr"] + REL rel*|r|; or
    abs*sqrt(V) with rank="sqrtv"), budget (frac, cap). q: None (whole values),
    "bf16", "step" (threshold: half the bound), "cut" (budget: half the cut, or the
    largest change over qmax), "group" (per 64 codes: their largest over qmax, at most
    half the least bound). bits: 8 or 4. lead: the farthest code within the bound."""
    r = dict(sel=sel, abs=0.0, rel=0.0, frac=0.0, cap=math.inf, unit=None, rank=None, q=None,
             bits=8, lead=False)
    r.update(kw)
    return r


def W_lr(n, **kw):
    return R("thr", abs=n, unit="lr", q="step", **kw)


def V_rel(x, **kw):
    return R("thr", rel=x, q="step", **kw)


def M_bud(f, **kw):
    return R("budget", frac=f, cap=kw.pop("cap", 1e-3), q="cut", **kw)


# name -> (W, M, V). The ones docs/fidelity.md and docs/DESIGN.md cite.
POLICIES = {
    "v1-lossy-compact": (R("budget", frac=0.02, cap=2e-3), R("budget", frac=0.02, cap=2e-4),
                         R("thr", rel=0.5)),
    "v1-lossy": (R("budget", frac=0.04, cap=2.5e-4), R("budget", frac=0.04, cap=2.5e-5),
                 R("thr", rel=0.15)),
    # v1-lossy's selections with codes instead of values
    "v1-lossy-q8": (R("budget", frac=0.04, cap=2.5e-4, q="group"),
                    R("budget", frac=0.04, cap=2.5e-5, q="group"), R("thr", rel=0.15, q="bf16")),
    "v1-lossy-q4": (R("budget", frac=0.04, cap=2.5e-4, q="group", bits=4),
                    R("budget", frac=0.04, cap=2.5e-5, q="group", bits=4),
                    R("thr", rel=0.15, q="step", bits=4)),
    # W in lr units, M in units of sqrt(V) (not decodable without V: group steps)
    "s-nolead": (W_lr(1.0, bits=4), R("thr", abs=0.2, rank="sqrtv", q="group", bits=4),
                 V_rel(0.3, bits=4)),
    "s-lead": (W_lr(1.0, bits=4, lead=True), R("thr", abs=0.2, rank="sqrtv", q="group", bits=4),
               V_rel(0.3, bits=4)),
    # M as a budget instead (decodable), at 6% and 10%; V at 0.5
    "s-M6": (W_lr(1.0, bits=4, lead=True), M_bud(0.06, bits=4), V_rel(0.3, bits=4, lead=True)),
    "s-M10": (W_lr(1.0, bits=4, lead=True), M_bud(0.10, bits=4), V_rel(0.3, bits=4, lead=True)),
    "s-V0.5": (W_lr(1.0, bits=4, lead=True), M_bud(0.08, bits=4), V_rel(0.5, bits=4, lead=True)),
    # Q8 codes
    "s-M10-q8": (W_lr(1.0, bits=4, lead=True), M_bud(0.10), V_rel(0.3, lead=True)),
    "lossy": (W_lr(1.0, lead=True), M_bud(0.08), V_rel(0.3, lead=True)),
    "lossy-frequent": (W_lr(0.7, lead=True), M_bud(0.15), V_rel(0.2, lead=True)),
    "lossy-compact": (W_lr(1.5, lead=True), M_bud(0.05), V_rel(0.3, lead=True)),
    # tighter than lossy-frequent, for resumes every 10 steps
    "f-W0.5-M20": (W_lr(0.5, lead=True), M_bud(0.20), V_rel(0.2, lead=True)),
    "f-W0.7-M25": (W_lr(0.7, lead=True), M_bud(0.25), V_rel(0.2, lead=True)),
    "f-W0.5-M25-V0.15": (W_lr(0.5, lead=True), M_bud(0.25), V_rel(0.15, lead=True)),
}


def varint_gaps(idx):
    g = (np.diff(np.concatenate([[-1], np.asarray(idx, dtype=np.int64)])) - 1).astype(np.uint64)
    ln = np.ones(len(g), np.int64)
    for b in (7, 14, 21, 28):
        ln += g >= (1 << b)
    out = np.zeros(int(ln.sum()), np.uint8)
    pos = np.concatenate([[0], np.cumsum(ln)[:-1]])
    for j in range(5):
        m = ln > j
        byte = (g[m] >> np.uint64(7 * j)) & np.uint64(0x7F)
        cont = (ln[m] > j + 1).astype(np.uint64) << np.uint64(7)
        out[pos[m] + j] = (byte | cont).astype(np.uint8)
    return out.tobytes()


def positions(idx, n):
    """The smaller of a bitmap and varint gaps, as the library picks."""
    if len(idx) < (n + 7) // 8:
        vg = varint_gaps(idx)
        if len(vg) < (n + 7) // 8:
            return vg
    bm = np.zeros(n, dtype=np.uint8)
    bm[idx] = 1
    return np.packbits(bm, bitorder="little").tobytes()


def shuffled(a):
    return a.view(np.uint8).reshape(len(a), a.itemsize).T.copy().tobytes()


def bf16(x):
    u = x.view(torch.int32)
    return ((u + ((u >> 16) & 1) + 0x7FFF) & ~0xFFFF).view(torch.float32)


class Screen:
    def __init__(self, zc):
        self.zc = zc
        self.stored = self.escapes = 0

    def bound(self, rule, ref, lr, v):
        """Each element's bound under `rule` (threshold), or the CAP (budget)."""
        unit = lr if rule["unit"] == "lr" else 1.0
        if rule["sel"] == "thr" and rule["rank"] == "sqrtv":
            return rule["abs"] * (v.sqrt() + 1e-8) + rule["rel"] * ref.abs()
        if rule["sel"] == "thr":
            return rule["abs"] * unit + rule["rel"] * ref.abs()
        return torch.full_like(ref, rule["cap"] * unit)

    def select(self, rule, live, ref, E):
        if rule["sel"] == "exact":
            return live != ref
        d = (live - ref).abs()
        if rule["sel"] == "thr":
            sel = d > E
        else:
            sel = d > E
            kk = max(1, int(rule["frac"] * live.numel()))
            sel |= d >= torch.topk(d.flatten(), kk).values[-1] if kk < live.numel() else d > 0
        return sel | (~torch.isfinite(live) & (live != ref))

    def quantize(self, rule, lsel, rsel, Esel, lr):
        """Codes and restored values of the selected elements (src/quant.c's rules);
        returns (new values, code bytes, escape mask)."""
        qmax = (1 << (rule["bits"] - 1)) - 1
        dsel = lsel - rsel
        k = len(dsel)
        pre = ~torch.isfinite(lsel) | ~torch.isfinite(rsel) | ~torch.isfinite(dsel)
        unit = lr if rule["unit"] == "lr" else 1.0
        if rule["q"] == "cut":
            fin = dsel.abs()[~pre]
            cut = fin.min() if len(fin) else torch.tensor(0.0)
            step = torch.maximum(0.5 * cut, (fin.max() if len(fin) else cut) / qmax)
            step = torch.minimum(step, torch.tensor(rule["cap"] * unit, dtype=torch.float32))
            s = torch.full((k,), float(step))
            lead_lim = torch.full((k,), float(cut), dtype=torch.float64)
            within = lambda v: (lsel.double() - v.double()).abs() <= Esel.double()  # noqa: E731
        elif rule["q"] == "group":
            pad = (-k) % 64
            m = torch.cat([torch.where(pre, 0.0, dsel.abs()), torch.zeros(pad)]).view(-1, 64)
            e = torch.cat([Esel, torch.full((pad,), math.inf)]).view(-1, 64)
            s = torch.minimum(m.max(1).values / qmax, 0.5 * e.min(1).values)
            s = s.repeat_interleave(64)[:k]
            lead_lim = Esel.double()
            within = lambda v: (lsel.double() - v.double()).abs() <= Esel.double()  # noqa: E731
        else:  # step: half the bound, the bound at the restored value
            a = torch.tensor(0.5 * rule["abs"] * unit, dtype=torch.float32)
            b = torch.tensor(0.5 * rule["rel"], dtype=torch.float32)
            s = a + b * rsel.abs()
            lead_lim = None

            def within(v):
                return (lsel.double() - v.double()).abs() <= rule["abs"] * unit + \
                    rule["rel"] * v.double().abs()
        t = dsel / s
        c = torch.round(t)
        bad = pre | ~(t.abs() <= qmax + 0.5) | (c.abs() > qmax)
        c = torch.where(bad, torch.zeros_like(c), c)
        if rule["lead"]:
            sg = torch.where(dsel > 0, 1.0, -1.0)
            ef = lead_lim.float() if lead_lim is not None else \
                torch.tensor(rule["abs"] * unit, dtype=torch.float32) + \
                torch.tensor(rule["rel"], dtype=torch.float32) * rsel.abs()
            f = torch.trunc((dsel.abs() + ef) / s).clamp(max=qmax)
            f = torch.where(torch.isfinite(f), f, torch.zeros_like(f))
            best, done = c.clone(), bad.clone()
            for _ in range(4):
                v = rsel + (f * sg) * s
                ok = ~done & (f > sg * c) & within(v)
                if lead_lim is not None:
                    ok &= (lsel.double() - v.double()).abs() <= lead_lim
                best = torch.where(ok, f * sg, best)
                done |= ok | ~(f > sg * c)
                f = f - 1
            c = best
        new = rsel + c * s
        esc = bad | ~torch.isfinite(new) | ~within(new)
        c = torch.where(esc, torch.zeros_like(c), c)
        codes = c.to(torch.int8).numpy()
        if rule["bits"] == 4:
            u = np.append(codes & 0xF, 0)[:len(codes) + len(codes) % 2].astype(np.uint8)
            codes_b = (u[0::2] | (u[1::2] << 4)).tobytes()
        else:
            codes_b = codes.tobytes()
        return torch.where(esc, lsel, new), codes_b, esc

    def delta(self, rule, live, ref, lr, v):
        """One tensor's delta: moves ref, returns its bytes."""
        E = self.bound(rule, ref, lr, v)
        idx = self.select(rule, live, ref, E).flatten().nonzero().flatten()
        k = len(idx)
        if k == 0:
            return CHUNK_OVERHEAD
        lsel, rsel = live.flatten()[idx], ref.flatten()[idx]
        if rule["q"] is None:
            new, body = lsel, shuffled(lsel.numpy())
        elif rule["q"] == "bf16":
            dq = bf16(lsel - rsel)
            new, body = rsel + dq, shuffled((dq.view(torch.int32) >> 16).to(torch.int16).numpy())
        else:
            new, codes, esc = self.quantize(rule, lsel, rsel, E.flatten()[idx], lr)
            eidx = esc.nonzero().flatten().numpy()
            body = codes + b"\0" * 16 + (varint_gaps(eidx) if len(eidx) else b"") + \
                lsel[esc].numpy().tobytes()
            self.escapes += len(eidx)
        ref.view(-1)[idx] = new
        self.stored += k
        return CHUNK_OVERHEAD + min(4 * live.numel(),
                                    len(self.zc.compress(positions(idx.numpy(), live.numel()) + body)))


def run(policy, seed, k, steps, full_every=50):
    import zstandard
    rules = dict(zip("WMV", POLICIES[policy]))
    torch.set_num_threads(1)
    train, held, _ = demo.corpus()
    model, opt, sched = demo.build(steps)
    torch.manual_seed(1000 + seed)
    sc = Screen(zstandard.ZstdCompressor(level=-1))
    refs, since_full, fulls, deltas, per, errs = None, 0, [], [], {"W": 0, "M": 0, "V": 0}, []
    for step in range(1, steps + 1):
        x, y = demo.batch(train, step + 1_000_003 * seed, demo.BATCH)
        loss = demo.loss_of(model, x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        lr = sched.get_last_lr()[0]
        tens = []
        for p in model.parameters():
            st = opt.state[p]
            tens += [("W", p.data, st["exp_avg_sq"]), ("M", st["exp_avg"], st["exp_avg_sq"]),
                     ("V", st["exp_avg_sq"], st["exp_avg_sq"])]
        if refs is None or since_full >= full_every:
            refs, since_full = [t.detach().clone() for _, t, _ in tens], 0
            fulls.append(sum(4 * t.numel() for _, t, _ in tens))
        else:
            since_full += 1
            tot = 0
            for (c, t, v), r in zip(tens, refs):
                b = sc.delta(rules[c], t.detach(), r, lr, v.detach())
                tot += b
                per[c] += b
            deltas.append(tot)
        if k and step % k == 0 and step < steps:  # a resume: live <- reference
            with torch.no_grad():
                ew = em = 0.0
                nw, vl = 0, []
                for (c, t, v), r in zip(tens, refs):
                    if c == "W":
                        ew += float(((r - t) / lr).pow(2).sum())
                        nw += t.numel()
                    elif c == "M":
                        em += float(((r - t) / (v.sqrt() + 1e-8)).pow(2).sum())
                    else:
                        ok = (t > 0) & (r > 0)
                        vl.append((r[ok] / t[ok]).log())
                errs.append({"W": math.sqrt(ew / nw), "M": math.sqrt(em / nw),
                             "Vlog": float(torch.cat(vl).mean())})
                for (_, t, _), r in zip(tens, refs):
                    t.copy_(r)
    full = float(np.mean(fulls))
    return {"eval": demo.eval_loss(model, held), "delta_pct": 100 * float(np.mean(deltas)) / full,
            "delta_max_pct": 100 * max(deltas) / full,
            "delta_max_late_pct": 100 * max(deltas[19:]) / full,
            "share": {c: per[c] / max(1, sum(per.values())) for c in per},
            "escapes": sc.escapes / max(1, sc.stored),
            "error": {e: float(np.mean([x[e] for x in errs])) for e in ("W", "M", "Vlog")}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("policy", nargs="?")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--ks", default="20")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(HERE), "bench-out", "screen"))
    a = ap.parse_args()
    if a.list or not a.policy:
        for n, rs in POLICIES.items():
            parts = []
            for c, r in zip("WMV", rs):
                set_ = {k: v for k, v in r.items() if k == "sel" or v not in (None, False, 0.0, math.inf)}
                parts.append(f"{c} {set_}")
            print(f"{n:18} " + "; ".join(parts))
        return
    if a.policy not in POLICIES:
        sys.exit(f"fidelity_screen: unknown policy {a.policy} (--list)")
    os.makedirs(a.out, exist_ok=True)
    base = {}  # uninterrupted runs, cached like the others
    for k in [int(x) for x in a.ks.split(",")]:
        for s in [int(x) for x in a.seeds.split(",")]:
            if s not in base:
                path = os.path.join(a.out, f"uninterrupted-s{s}-n{a.steps}.json")
                if not os.path.exists(path):
                    train, held, _ = demo.corpus()
                    torch.set_num_threads(1)
                    model, opt, sched = demo.build(a.steps)
                    torch.manual_seed(1000 + s)
                    for step in range(1, a.steps + 1):
                        x, y = demo.batch(train, step + 1_000_003 * s, demo.BATCH)
                        loss = demo.loss_of(model, x, y)
                        opt.zero_grad(set_to_none=True)
                        loss.backward()
                        opt.step()
                        sched.step()
                    json.dump({"eval": demo.eval_loss(model, held)}, open(path, "w"))
                base[s] = json.load(open(path))["eval"]
            path = os.path.join(a.out, f"{a.policy}-s{s}-k{k}-n{a.steps}.json")
            if not os.path.exists(path):
                t = time.time()
                r = run(a.policy, s, k, a.steps)
                r["seconds"] = time.time() - t
                json.dump(r, open(path, "w"))
            r = json.load(open(path))
            e = r["error"]
            print(f"{a.policy:18} seed {s} K={k:<3} delta {r['delta_pct']:5.2f}% (max "
                  f"{r['delta_max_pct']:.1f}%, after step 20 {r['delta_max_late_pct']:.1f}%)  "
                  f"eval {100 * (r['eval'] - base[s]) / base[s]:+.3f}%  share "
                  + " ".join(f"{c} {v:.2f}" for c, v in r["share"].items())
                  + f"  escapes {r['escapes']:.4f}  error W {e.get('W', 0):.2f} lr, M "
                    f"{e.get('M', 0):.3f}, log V {e.get('Vlog', 0):+.3f}", flush=True)


if __name__ == "__main__":
    main()
