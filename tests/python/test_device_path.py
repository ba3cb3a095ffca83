"""The accelerator path (amber.device, issue 15) on CPU tensors, as AMBER_DEVICE_PATH=1
forces it: the reference lives with the tensors and the selection is made with
torch operations, so only the selection crosses to the host.

- A trajectory saved through the device path restores, at every step, to exactly
  the state that the same trajectory saved through the CPU path restores: exact,
  threshold, budget with a CAP (so the same bounds and the same share), the lossy
  preset, over f32, bf16, f16, f64 and integer tensors, a change to NaN and back,
  and a Checkpointer reopened halfway (its device reference is read from the store);
  and over every other dtype (f8, bool, u16, u64), a scalar, a transposed view and
  an empty tensor.
- Under policies with a value code (@q8, @q4, @bf16, +lead: quantized deltas) the
  device path quantizes on the device as src/quant.c does: threshold (ABS, REL, REL
  only) and budget (with and without CAP) rules restore bit for bit what the CPU
  path restores, over the same tensors (several chunks, NaN and back, changes large
  enough that codes cannot carry them: escapes), store the same chunk encodings
  (QSPARSE, RAW for whole chunks; f8 tensors plain SPARSE, as the CPU path stores
  them), keep the bound, and do so with the reference in host memory, through the
  ring, and after a failed save.
- Only the selection crosses: a sparse delta copies a small share of the state.
- A failed save puts the device reference back as it was (error feedback stays exact).
- Full saves stream each reference out through a ring of one reused buffer per worker
  (never a host copy of the whole state) and a delta's copies are taken by the library
  through the same source once made, as CUDA tensors' are: restores are the same; a
  source that fails fails the save, commits nothing and names its cause; the fence
  waits for the selection only, not for the library's encoding.
- With AMBER_DEVICE_REFERENCE=host the references live in host memory, compared chunk
  by chunk, and restores are the same.
- With AMBER_DEVICE_ASYNC=1 the selection runs on a thread while training goes on
  (the fence waits for it): restores are the same, errors of the plan still come from
  save(), and a tensor changed in place before the fence fails the save.
The whole PyTorch suite also runs a second time with AMBER_DEVICE_PATH=1
(scripts/run-tests)."""
import os
import struct

import pytest
import torch

import amber
from amber import _quant, _select, device
from amber.torch import Checkpointer

QSPARSE, SPARSE, RAW = 5, 3, 0  # chunk encodings (docs/FORMAT.md, "Encodings")


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(40, 130)                            # f32
        self.b = torch.nn.Linear(130, 30).to(torch.bfloat16)         # bf16
        self.c = torch.nn.Parameter(torch.randn(777, dtype=torch.float16))
        self.d = torch.nn.Parameter(torch.randn(333, dtype=torch.float64))
        self.register_buffer("count", torch.zeros(50, dtype=torch.int64))

    def forward(self, x):
        h = self.b(self.a(x).to(torch.bfloat16)).float()
        return h.sum() + self.c.float().sum() * 1e-3 + self.d.sum().float() * 1e-3


def restored(path):
    with amber.Store(path, readonly=True) as st, st.reader() as r:
        return {t.name: bytes(r.read(t.index)) for t in r.tensors()}


def check_references(ck, path):
    """The device path's references hold exactly what the latest step restores
    (under a quantized policy: what the codes decode to, not the live values)."""
    want = restored(path)
    for name, dt in ck._saver.dev.tensors.items():
        got = dt.ref.contiguous().view(torch.uint8).numpy().tobytes()
        assert got == want[name], f"{name}: the device reference is not the restore"


def encodings(path, step):
    """{tensor name: its chunks' encodings} in the index of checkpoint `step`
    (docs/FORMAT.md: the footer locates the index; tensor entries, then chunk
    entries of 40 bytes with the encoding at offset 24)."""
    with open(os.path.join(path, f"ckpt-{step:020d}.amber"), "rb") as f:
        data = f.read()
    off, size = struct.unpack_from("<QQ", data, len(data) - 56)
    ix = data[off:off + size]
    assert ix[:4] == b"AIDX"
    (ntensors,) = struct.unpack_from("<Q", ix, 8)
    p, tensors = 32, []
    for _ in range(ntensors):
        (nlen,), ndim = struct.unpack_from("<H", ix, p), ix[p + 3]
        first, nchunks = struct.unpack_from("<QQ", ix, p + 16)
        p += 32 + 8 * ndim
        name = ix[p:p + nlen].decode()
        p += nlen
        p += 2 + struct.unpack_from("<H", ix, p)[0]  # the policy
        tensors.append((name, first, nchunks))
    return {name: [ix[p + 40 * (first + j) + 24] for j in range(nchunks)]
            for name, first, nchunks in tensors}


def trajectory(path, policy, monkeypatch, on, steps=12, reopen_at=7, full_every=100):
    """Saves one seeded AdamW trajectory; returns per step the restored bytes
    of every tensor, the kinds of the checkpoints and the bytes copied out. Through
    the device path, checks after each step that the references are the restore."""
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1" if on else "0")
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-2)
    out, copied, live_a = [], [], []
    ck = Checkpointer(path, policy=policy, chunk_elems=1500, full_every=full_every, rng=False)
    for step in range(1, steps + 1):
        opt.zero_grad()
        net(torch.randn(6, 40)).backward()
        opt.step()
        with torch.no_grad():
            net.count[step % 50] += step
            if step == 4:
                net.a.weight[3, 5] = float("nan")
            if step == 5:
                net.a.weight[3, 5] = 0.25
        if step == reopen_at:  # a new Checkpointer: its reference comes from the store
            ck.close()
            ck = Checkpointer(path, policy=policy, chunk_elems=1500, full_every=full_every,
                              rng=False)
        ck.save(step, {"net": net, "optim": opt})
        ck.wait()
        copied.append(ck._saver.dev.copied if ck._saver.dev is not None else None)
        out.append(restored(path))
        if on:
            check_references(ck, path)
        live_a.append(net.a.weight.detach().clone())
    kinds = [i.kind for i in ck.steps()]
    assert ck._saver.dev.host_ref == (os.environ.get("AMBER_DEVICE_REFERENCE") == "host")
    ck.close()
    return out, kinds, copied, live_a


@pytest.mark.parametrize("policy", ["exact", "threshold:1e-3:1e-2", "budget:0.05:2e-2",
                                    "budget:0.02", "lossy", "lossy-compact",
                                    "threshold:1e-4:1e-3/0.05:4", "lossy-capped"])
def test_device_path_restores_what_the_cpu_path_restores(tmp_path, monkeypatch, policy):
    cpu, kinds_cpu, _, _ = trajectory(str(tmp_path / "cpu"), policy, monkeypatch, False)
    dev, kinds_dev, copied, _ = trajectory(str(tmp_path / "dev"), policy, monkeypatch, True)
    assert kinds_dev == kinds_cpu and "delta" in kinds_dev
    assert copied[0] > 0  # the device path ran
    for step, (a, b) in enumerate(zip(cpu, dev), 1):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name] == b[name], f"{policy}: step {step}, tensor {name} differs"


def test_budget_with_cap_keeps_its_bound_through_the_device_path(tmp_path, monkeypatch):
    cap = 2e-2
    out, kinds, _, live_a = trajectory(str(tmp_path / "s"), f"budget:0.05:{cap}", monkeypatch,
                                       True, steps=10, reopen_at=0)
    assert kinds.count("delta") >= 5
    for step, (got, live) in enumerate(zip(out, live_a), 1):
        got = torch.frombuffer(bytearray(got["net/a.weight"]), dtype=torch.float32).view(130, 40)
        err = (got - live).abs().nan_to_num(0.0).max().item()
        assert err <= cap, f"step {step}: {err} above the CAP"
        if kinds[step - 1] == "delta":
            assert not torch.equal(got, live)  # a lossy delta: something was deferred


QUANTIZED = ["threshold:1e-3@q8", "threshold:1e-3:1e-2@q4+lead", "threshold:0:0.3@q4+lead",
             "threshold:2e-3:5e-2@bf16", "budget:0.05:2e-2@q8", "budget:0.1@q4",
             "budget:0.2:1e-2@q8+lead", "budget:0.05:1e-3@bf16",
             "threshold:1e-4:1e-2/0.05:4@q8+lead", "threshold:0:0.3/0.1:2@q4+lead"]


def counting_escapes(monkeypatch):
    """Wraps amber._quant.quantize to count (quantized elements, escapes, dtypes)."""
    seen = {"k": 0, "esc": 0, "dtypes": set()}
    real = _quant.quantize

    def counted(rl, x, r, cid, nchunks):
        out = real(rl, x, r, cid, nchunks)
        seen["k"] += x.numel()
        seen["esc"] += int(out.esc.sum())
        seen["dtypes"].add(x.dtype)
        return out
    monkeypatch.setattr(_quant, "quantize", counted)
    return seen


@pytest.mark.parametrize("policy", QUANTIZED)
def test_quantized_deltas_restore_what_the_cpu_path_restores(tmp_path, monkeypatch, policy):
    """f32 (4 chunks), bf16 (3 chunks), f16, f64 and int64 tensors of an AdamW
    trajectory, a weight set to NaN and back, a Checkpointer reopened halfway: the
    device path quantizes (escapes included: AdamW's steps are far above these
    bounds) and every step restores as through the CPU path, chunk encodings alike."""
    cpu, kinds_cpu, _, live_cpu = trajectory(str(tmp_path / "cpu"), policy, monkeypatch, False)
    seen = counting_escapes(monkeypatch)
    dev, kinds_dev, _, _ = trajectory(str(tmp_path / "dev"), policy, monkeypatch, True)
    assert kinds_dev == kinds_cpu and kinds_dev.count("delta") >= 5
    assert seen["dtypes"] == set(_quant.DTYPES) and 0 < seen["esc"] < seen["k"], seen
    qsparse = 0
    for step, (a, b) in enumerate(zip(cpu, dev), 1):
        for name in a:
            assert a[name] == b[name], f"{policy}: step {step}, tensor {name} differs"
        enc = encodings(str(tmp_path / "dev"), step)
        assert enc == encodings(str(tmp_path / "cpu"), step), f"{policy}: step {step}"
        qsparse += sum(e == QSPARSE for es in enc.values() for e in es)
        assert {n for n, es in enc.items() if SPARSE in es} <= {"net/count"}  # int64: exact
    assert qsparse >= 10
    kind, abs_, rel = _select.parse(policy)
    mult = (_select.share(policy) or (1, 1.0))[1]  # a share cap: MULT bounds
    abs_, rel = mult * abs_, mult * rel
    if kind == "threshold":  # the bound, on the f32 weight
        for step, (got, live) in enumerate(zip(dev, live_cpu), 1):
            v = torch.frombuffer(bytearray(got["net/a.weight"]), dtype=torch.float32).double()
            x = live.reshape(-1).double()
            nan = torch.isnan(x)  # the weight set to NaN at step 4 restores as NaN
            assert torch.equal(nan, torch.isnan(v)), f"{policy}: step {step}"
            err = (v - x).abs()[~nan]
            assert (err <= abs_ + rel * v[~nan].abs()).all(), f"{policy}: step {step}"


# bit patterns: NaNs (quiet, payload, negative), Infs, subnormals, signed zeros, the
# largest finite (changes that overflow), 1
SPECIAL = {
    torch.float32: [0x7FC00000, 0xFFC00001, 0x7F800000, 0xFF800000, 0x00000001, 0x80000001,
                    0x00000000, 0x80000000, 0x007FFFFF, 0x7F7FFFFF, 0xFF7FFFFF, 0x3F800000],
    torch.float16: [0x7E00, 0xFE01, 0x7C00, 0xFC00, 0x0001, 0x8001, 0x0000, 0x8000, 0x03FF,
                    0x7BFF, 0xFBFF, 0x3C00],
    torch.bfloat16: [0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x0001, 0x8001, 0x0000, 0x8000, 0x007F,
                     0x7F7F, 0xFF7F, 0x3F80],
    torch.float64: [0x7FF8000000000000, 0xFFF8000000000001, 0x7FF0000000000000,
                    0xFFF0000000000000, 1, 0x8000000000000001, 0, 0x8000000000000000,
                    0x000FFFFFFFFFFFFF, 0x7FEFFFFFFFFFFFFF, 0xFFEFFFFFFFFFFFFF,
                    0x3FF0000000000000],
}


def special_trajectory(path, policy, monkeypatch, on, steps=4):
    """Per quantized dtype one tensor whose first elements go through every pair of
    SPECIAL patterns from step to step, the rest random with small changes and a
    share of large ones; the restored bytes per step (the device path's references
    checked to be the restore)."""
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1" if on else "0")
    g = torch.Generator().manual_seed(7)
    base = {dt: torch.randn(3000, generator=g, dtype=torch.float64) * 0.1 for dt in SPECIAL}
    live = {str(dt).split(".")[1]: torch.zeros(3000, dtype=dt) for dt in SPECIAL}
    out = []
    with Checkpointer(path, policy=policy, chunk_elems=1000, rng=False, full_every=100) as ck:
        for step in range(steps):
            for (dt, pats), t in zip(SPECIAL.items(), live.values()):
                d = torch.randn(3000, generator=g, dtype=torch.float64) * 1e-3
                d[torch.rand(3000, generator=g) < 0.05] *= 100
                base[dt] += d
                t.copy_(base[dt].to(dt))
                m = len(pats)
                p = torch.arange(m * m)
                pick = [p // m, p % m, (p // m + p % m) % m, (p // m + 2 * (p % m)) % m][step]
                bt = _select.bits(t)
                top = 1 << (8 * t.element_size() - 1)
                bt[:m * m] = torch.tensor([v - 2 * top if v >= top else v for v in pats])[pick]
            ck.save(step + 1, {"x": live})
            ck.wait()
            out.append(restored(path))
            if on:
                check_references(ck, path)
    return out


@pytest.mark.parametrize("policy", ["threshold:1e-3@q8", "threshold:0:0.3@q4+lead",
                                    "budget:0.5@q4", "budget:1@q4", "budget:0.2:1e-2@q8+lead",
                                    "threshold:2e-3:5e-2@bf16", "budget:0.05:1e-3@bf16"])
def test_quantized_special_values_restore_what_the_cpu_path_restores(tmp_path, monkeypatch,
                                                                     policy):
    cpu = special_trajectory(str(tmp_path / "cpu"), policy, monkeypatch, False)
    dev = special_trajectory(str(tmp_path / "dev"), policy, monkeypatch, True)
    for step, (a, b) in enumerate(zip(cpu, dev), 1):
        for name in a:
            assert a[name] == b[name], f"{policy}: step {step}, tensor {name} differs"


@pytest.mark.parametrize("policy", ["budget:0.05:1.0009765625", "budget:0.05:1.0009765625@q8"])
def test_a_cluster_at_a_budgets_cap_restores_the_same(tmp_path, monkeypatch, policy):
    """A cluster of changes of 1 (the band's top 1 + 2^-10 is CAP) and a few changes
    on the band's top, forced by CAP: the fill from the band takes none of them twice,
    through either path (the C path once wrote duplicate indices under a quantized
    policy: a delta that did not decode)."""
    out = []
    for on in (False, True):
        monkeypatch.setenv("AMBER_DEVICE_PATH", "1" if on else "0")
        path = str(tmp_path / str(on))
        ts = {str(dt): torch.zeros(4096, dtype=dt) for dt in (torch.float16, torch.float32)}
        with Checkpointer(path, policy=policy, chunk_elems=4096, rng=False) as ck:
            ck.save(1, {"x": ts})
            ck.wait()
            for t in ts.values():
                t.fill_(1.0)
                t[:4] = 1.0 + 2.0 ** -10
            ck.save(2, {"x": ts})
            ck.wait()
        out.append(restored(path))
    assert out[0] == out[1]
    for name, got in out[0].items():
        n = 4096 * (2 if "16" in name else 4)
        assert len(got) == n and sum(got) > 0, name


def test_only_the_selection_crosses_to_the_host(tmp_path, monkeypatch):
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1")
    p = torch.nn.Parameter(torch.zeros(1 << 20))
    opt = torch.optim.SGD([p], lr=1.0)
    with Checkpointer(str(tmp_path / "s"), policy="threshold:1e-3", rng=False) as ck:
        ck.save(1, {"p": p, "optim": opt})
        ck.wait()
        assert ck._saver.dev.copied == p.numel() * 4  # a full save copies everything
        with torch.no_grad():
            p[::1000] += 1.0  # 0.1% of the elements change beyond the bound
            p += 1e-5        # every element changes within it
        ck.save(2, {"p": p, "optim": opt})
        ck.wait()
        assert [i.kind for i in ck.steps()] == ["full", "delta"]
        assert 0 < ck._saver.dev.copied <= 0.01 * p.numel() * 4


@pytest.mark.parametrize("policy", ["threshold:0.5", "threshold:0.5@q8"])
@pytest.mark.parametrize("host_ref", [False, True])
def test_a_failed_save_puts_the_device_reference_back(tmp_path, host_ref, policy):
    path = str(tmp_path / "s")
    x = torch.arange(5000, dtype=torch.float32)
    with amber.Store(path) as st:
        w = st.writer(chunk_elems=2048)
        dp = device.DevicePath(host_ref=host_ref)
        dp.declare(w, "x", amber.F32, x)
        w.add_policy(policy)
        flags = dp.before_begin(w, st, 1, 0, {"x": x}, amber.SAVE_FULL)
        w.begin(1)
        w.wait()
        dp.commit()
        ref1 = dp.tensors["x"].ref.clone()
        x[::7] += 1.0    # stored: beyond the bound
        x[1::7] += 0.25  # deferred: within it
        x[:2048] += 2.0  # a dense chunk goes whole
        flags = dp.before_begin(w, st, 2, amber.SAVE_CONFIRM, {"x": x}, amber.SAVE_FULL)
        assert flags == amber.SAVE_CONFIRM  # a delta
        assert not torch.equal(dp.tensors["x"].ref, ref1)  # the selection moved it
        w.begin(2, confirm=True)
        w.confirm(False, "vetoed by the test")
        with pytest.raises(amber.AmberError) as e:
            w.wait()
        assert e.value.name == "AMBER_ECHANGED"
        dp.rollback()
        assert torch.equal(dp.tensors["x"].ref, ref1)  # as it was before step 2
        # the next save selects against the committed state again
        dp.before_begin(w, st, 2, 0, {"x": x}, amber.SAVE_FULL)
        w.begin(2)
        w.wait()
        dp.commit()
        with st.reader() as r:
            got = torch.frombuffer(bytearray(r.read(r.find("x"))), dtype=torch.float32)
        assert torch.equal(got, dp.tensors["x"].ref)
        assert (got - x).abs().max().item() <= 0.5
        assert got[2052] == 2052.0 and got[2051] == x[2051]  # deferred, stored
        w.close()


@pytest.mark.parametrize("policy", ["threshold:1e-3:1e-2", "budget:0.05:2e-2",
                                    "threshold:1e-3:1e-2@q4+lead", "budget:0.05:2e-2@q8"])
def test_a_reference_in_host_memory_restores_the_same(tmp_path, monkeypatch, policy):
    """AMBER_DEVICE_REFERENCE=host: the references in (pinned) host memory, each
    chunk's copied in for the comparison, moved from the host copies of the selection."""
    cpu, _, _, _ = trajectory(str(tmp_path / "cpu"), policy, monkeypatch, False)
    monkeypatch.setenv("AMBER_DEVICE_REFERENCE", "host")
    dev, _, copied, _ = trajectory(str(tmp_path / "dev"), policy, monkeypatch, True)
    assert copied[0] > 0
    for step, (a, b) in enumerate(zip(cpu, dev), 1):
        for name in a:
            assert a[name] == b[name], f"{policy}: step {step}, tensor {name} differs"


def every_dtype_trajectory(path, policy, monkeypatch, on):
    """f8 (both), f16 with NaN, bool, u16, u64, a scalar, a transposed view and an
    empty tensor, as plain tensors of the state; the restored bytes per step."""
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1" if on else "0")
    g = torch.Generator().manual_seed(3)
    base = torch.randn(4000, generator=g)
    st = {"e4": base.to(torch.float8_e4m3fn), "e5": base.to(torch.float8_e5m2),
          "h": base.half(), "b": torch.zeros(3000, dtype=torch.bool),
          "u16": torch.zeros(100, dtype=torch.uint16), "u64": torch.zeros(70, dtype=torch.uint64),
          "s": torch.tensor(1.5), "t": torch.randn(60, 50, generator=g).t(), "z": torch.zeros(0)}
    out = []
    with Checkpointer(path, policy=policy, chunk_elems=1024, rng=False, full_every=100) as ck:
        for step in range(1, 9):
            base += torch.randn(4000, generator=g) * 0.05
            st["e4"].copy_(base.to(torch.float8_e4m3fn))
            st["e5"].copy_(base.to(torch.float8_e5m2))
            st["h"].copy_(base.half())
            if step == 3:
                st["h"][5] = float("nan")
                st["e4"][6] = float("nan")
            st["b"][step * 11] = True
            st["u16"][step] = step * 1000
            st["u64"][step] = 2 ** 40 + step
            st["s"] += 0.25
            st["t"] += torch.randn(60, 50, generator=g).t() * 0.01
            ck.save(step, {"x": st})
            ck.wait()
            out.append(restored(path))
        assert ck._saver.dev is not None and bool(ck._saver.dev.tensors) == on
    return out


@pytest.mark.parametrize("policy", ["exact", "threshold:0.02:0.01", "budget:0.05:0.1",
                                    "threshold:0.02:0.01@q8", "budget:0.05:0.1@q4+lead",
                                    "threshold:0.02@bf16", "threshold:1e-3:1e-3/0.05:4",
                                    "threshold:1e-3/0.1:3@q8+lead"])
def test_every_dtype_restores_as_through_the_cpu_path(tmp_path, monkeypatch, policy):
    cpu = every_dtype_trajectory(str(tmp_path / "cpu"), policy, monkeypatch, False)
    dev = every_dtype_trajectory(str(tmp_path / "dev"), policy, monkeypatch, True)
    for step, (a, b) in enumerate(zip(cpu, dev), 1):
        for name in a:
            assert a[name] == b[name], f"{policy}: step {step}, tensor {name} differs"


def test_quantized_rules_store_qsparse_through_the_device_path(tmp_path, monkeypatch):
    """The device path's deltas under a quantized rule: QSPARSE chunks (never SPARSE)
    for f16 and f32 tensors, and for f8 tensors, which have no quantized encoding,
    SPARSE (plain values) as the CPU path stores them; a scalar goes whole (RAW)."""
    path = str(tmp_path / "dev")
    every_dtype_trajectory(path, "threshold:0.02:0.01@q8", monkeypatch, True)
    seen = {}
    for step in range(2, 9):
        for name, es in encodings(path, step).items():
            seen.setdefault(name, set()).update(es)
    for name in ("x/h", "x/t"):
        assert QSPARSE in seen[name] and SPARSE not in seen[name], (name, seen[name])
    for name in ("x/e4", "x/e5"):
        assert SPARSE in seen[name] and QSPARSE not in seen[name], (name, seen[name])
    assert seen["x/s"] == {RAW}


def overlapped_trajectory(path, monkeypatch, on, asynchronous):
    """Saves while training goes on: no wait() between steps; the optimizer's fence
    hook is what orders each save before the next step. Returns each step's restore."""
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1" if on else "0")
    monkeypatch.setenv("AMBER_DEVICE_ASYNC", "1" if asynchronous else "0")
    torch.manual_seed(0)
    net = Net()
    opt = torch.optim.AdamW(net.parameters(), lr=3e-2)
    with Checkpointer(path, policy="budget:0.05:2e-2", chunk_elems=1500, rng=False) as ck:
        for step in range(1, 9):
            opt.zero_grad()
            net(torch.randn(6, 40)).backward()  # the forward pass of the next step
            opt.step()  # fences the save in flight first
            ck.save(step, {"net": net, "optim": opt})
            if asynchronous and on:
                assert ck._saver.dev_job is not None  # the selection runs on its thread
            with torch.no_grad():
                net.count.add_(step)  # as a forward pass changes buffers: captured at save()
    out = []
    with amber.Store(path, readonly=True) as st:
        for step in range(1, 9):
            with st.reader(step) as r:
                out.append({t.name: bytes(r.read(t.index)) for t in r.tensors()})
    return out


def test_selecting_on_a_thread_overlaps_training_and_restores_the_same(tmp_path, monkeypatch):
    cpu = overlapped_trajectory(str(tmp_path / "cpu"), monkeypatch, False, False)
    dev = overlapped_trajectory(str(tmp_path / "dev"), monkeypatch, True, True)
    for step, (a, b) in enumerate(zip(cpu, dev), 1):
        for name in a:
            assert a[name] == b[name], f"step {step}, tensor {name} differs"


def test_selecting_on_a_thread_keeps_the_errors_and_the_gate(tmp_path, monkeypatch):
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1")
    monkeypatch.setenv("AMBER_DEVICE_ASYNC", "1")
    p = torch.nn.Parameter(torch.zeros(1 << 18))
    opt = torch.optim.SGD([p], lr=1.0)
    with Checkpointer(str(tmp_path / "s"), rng=False) as ck:
        ck.save(1, {"p": p, "optim": opt})
        with pytest.raises(amber.AmberError) as e:  # planned in save(): raised there
            ck.save(1, {"p": p, "optim": opt})
        assert e.value.name == "AMBER_EEXIST"
        ck.save(2, {"p": p, "optim": opt})
        with torch.no_grad():
            p.add_(1.0)  # read by the thread until the fence: the gate refuses step 2
        with pytest.raises(amber.AmberError) as e:
            ck.wait()
        assert e.value.name == "AMBER_ECHANGED" and "'p'" in str(e.value)
        assert ck.latest() == 1
        ck.save(3, {"p": p, "optim": opt})  # the reference went back: step 3 is right
        ck.wait()
        q = torch.empty(1 << 18)
        assert ck.load({"p": q}, strict=False) == 3 and torch.equal(q, p.detach())


@pytest.mark.parametrize("policy", ["exact", "budget:0.05:2e-2", "threshold:1e-3:1e-2@q8+lead"])
def test_saves_through_the_ring_restore_the_same(tmp_path, monkeypatch, policy):
    """As CUDA tensors go (forced here on CPU tensors): full saves stream through the
    ring, deltas' copies are made after the selection and handed over by the source."""
    cpu, kinds_cpu, _, _ = trajectory(str(tmp_path / "cpu"), policy, monkeypatch, False,
                                      full_every=3)
    monkeypatch.setattr(device, "_RING_ON_CPU", True)
    dev, kinds_dev, copied, _ = trajectory(str(tmp_path / "dev"), policy, monkeypatch, True,
                                           full_every=3)
    assert kinds_dev == kinds_cpu and kinds_dev.count("full") >= 3 and "delta" in kinds_dev
    for step, (a, b) in enumerate(zip(cpu, dev), 1):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name] == b[name], f"{policy}: step {step}, tensor {name} differs"


def test_a_full_save_never_holds_the_whole_state_in_host_memory(tmp_path, monkeypatch):
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1")
    monkeypatch.setattr(device, "_RING_ON_CPU", True)
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(1 << 18)) for _ in range(4)]  # 4 MiB of f32
    opt = torch.optim.SGD(ps, lr=0.1)
    chunk = 1 << 14  # 64 KiB
    with Checkpointer(str(tmp_path / "s"), chunk_elems=chunk, threads=2, rng=False) as ck:
        for step in range(1, 4):
            ck.save(step, {"p": ps, "optim": opt}, full=True)
            ck.wait()
            saved = [p.detach().clone() for p in ps]
            with torch.no_grad():
                for p in ps:
                    p.add_(0.5)
        ring = ck._saver.dev.ring_bytes
        assert 0 < ring <= 2 * max(chunk * 4, 4096), ring  # a chunk per worker at most
        assert ck._saver.dev.copied >= 4 * (1 << 18) * 4  # every byte went out, through the ring
        got = [torch.empty(1 << 18) for _ in range(4)]
        ck.load({"p": got}, strict=False)
    for g, p in zip(got, saved):
        assert torch.equal(g, p)


def test_a_failing_source_fails_the_save_and_keeps_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1")
    monkeypatch.setattr(device, "_RING_ON_CPU", True)
    p = torch.nn.Parameter(torch.arange(1 << 16, dtype=torch.float32))
    opt = torch.optim.SGD([p], lr=1.0)
    real = device._Tensor.chunk_ptr

    def lost(self, j, slot):
        if j == 3:
            raise OSError("the device was lost")
        return real(self, j, slot)
    with Checkpointer(str(tmp_path / "s"), chunk_elems=4096, rng=False) as ck:
        ck.save(1, {"p": p, "optim": opt})
        ck.wait()
        monkeypatch.setattr(device._Tensor, "chunk_ptr", lost)
        with torch.no_grad():
            p.add_(1.0)
        ck.save(2, {"p": p, "optim": opt}, full=True)
        with pytest.raises(amber.AmberError) as e:
            ck.wait()
        assert "chunk 3: its chunk source failed" in str(e.value)
        assert isinstance(e.value.__cause__, OSError)
        assert ck.latest() == 1
        monkeypatch.setattr(device._Tensor, "chunk_ptr", real)
        with torch.no_grad():
            p[7] = -1.0
        ck.save(3, {"p": p, "optim": opt})  # the reference is reloaded from step 1
        ck.wait()
        q = torch.empty(1 << 16)
        assert ck.load({"p": q}, strict=False) == 3 and torch.equal(q, p.detach())


@pytest.mark.parametrize("on", [True, False])
def test_the_fence_waits_for_the_selection_only(tmp_path, monkeypatch, on):
    """Through the device path the library reads only its own buffers after save(),
    so the optimizer's fence does not wait for its encoding; the CPU path reads the
    tensors in place and must."""
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1" if on else "0")
    calls = []
    real = amber.Writer.fence

    def counted(self):
        calls.append(1)
        return real(self)
    monkeypatch.setattr(amber.Writer, "fence", counted)
    p = torch.nn.Parameter(torch.randn(1 << 18))
    opt = torch.optim.SGD([p], lr=0.1)
    with Checkpointer(str(tmp_path / "s"), rng=False) as ck:
        for step in range(1, 4):
            p.grad = torch.ones_like(p)
            ck.save(step, {"p": p, "optim": opt})
            saved = p.detach().clone()
            opt.step()  # fences the save in flight
        ck.wait()
        q = torch.empty(1 << 18)
        ck.load({"p": q}, strict=False)
        assert torch.equal(q, saved) and not torch.equal(q, p.detach())
    assert (len(calls) == 0) == on


def dcp_trajectory(path, policy, monkeypatch, on, staged):
    """dcp.save (or async_save) through amber.dcp.Writer in one process; the restored
    bytes per step, and whether the device path held the tensors."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from amber.dcp import Writer
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1" if on else "0")
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 300), torch.nn.GELU(), torch.nn.Linear(300, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    out = []
    with Writer(policy=policy, chunk_elems=2048, full_every=4, full_share=-1) as w:
        for step in range(1, 8):
            m(torch.randn(16, 32)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            msd, osd = get_state_dict(m, opt)
            sd, cid = {"model": msd, "optim": osd}, f"{path}/step-{step}"
            if staged:
                resp = dcp.async_save(sd, storage_writer=w, checkpoint_id=cid)
                resp.staging_completion.result(timeout=30)
                resp.upload_completion.result(timeout=30)
            else:
                dcp.save(sd, storage_writer=w, checkpoint_id=cid)
            out.append(restored(path))
        held = bool(w._saver.dev is not None and w._saver.dev.tensors)
    return out, held


@pytest.mark.parametrize("policy,staged", [("exact", False), ("budget:0.05:2e-2", True)])
def test_the_dcp_writer_takes_the_device_path(tmp_path, monkeypatch, policy, staged):
    """amber.dcp.Writer selects device tensors on their device too: restores equal
    those of the CPU path, through dcp.save and dcp.async_save."""
    cpu, held_cpu = dcp_trajectory(str(tmp_path / "cpu"), policy, monkeypatch, False, staged)
    dev, held_dev = dcp_trajectory(str(tmp_path / "dev"), policy, monkeypatch, True, staged)
    assert held_dev and not held_cpu
    for step, (a, b) in enumerate(zip(cpu, dev), 1):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name] == b[name], f"{policy}: step {step}, tensor {name} differs"
