"""amber.dcp in one process: dcp.save / async_save / load through the plug-in, deltas,
policies, ids, failures, no pickle in the store, and the CLI on a DCP-written store."""

import json
import os
import pickletools
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict  # noqa: E402

import amber  # noqa: E402
from amber.dcp import Reader, Writer  # noqa: E402
from conftest import rules_bound, spec_bound  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
AMBER = os.path.join(os.path.dirname(sys.executable), "amber")


def raises(exc, text, fn, *args, **kw):
    """fn raises exc whose message (or that of the rank failure DCP wraps) holds text."""
    with pytest.raises(exc) as ei:
        fn(*args, **kw)
    e = ei.value
    msg = str(e) + " ".join(str(v) for v in getattr(e, "failures", {}).values())
    assert text in msg, msg
    return e


def make():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    return m, opt


def train(m, opt, n=1):
    for _ in range(n):
        m(torch.randn(16, 32)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def state(m, opt, **extra):
    msd, osd = get_state_dict(m, opt)
    return {"model": msd, "optim": osd, **extra}


def snapshot(m, opt):
    msd, osd = get_state_dict(m, opt)
    out = {f"model/{k}": v.clone() for k, v in msd.items()}
    for p, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim/{p}/{k}"] = v.clone()
    return out


def equal(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k].view(torch.uint8) if a[k].dtype.itemsize == 1
                                                         else a[k], b[k] if a[k].dtype.itemsize != 1
                                                         else b[k].view(torch.uint8)), k


def load_into(m, opt, cid, **extra):
    sd = state(m, opt, **extra)
    dcp.load(sd, storage_reader=Reader(), checkpoint_id=cid)
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return sd


def ls(path):
    out = subprocess.run([AMBER, "ls", "--json", path], capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def test_save_load_roundtrip_is_bit_exact_with_adamw(tmp_path):
    m, opt = make()
    train(m, opt, 2)
    saved = snapshot(m, opt)
    with Writer() as w:
        dcp.save(state(m, opt), storage_writer=w, checkpoint_id=f"{tmp_path}/run/step-1")
    train(m, opt, 2)
    assert not torch.equal(snapshot(m, opt)["model/0.weight"], saved["model/0.weight"])
    load_into(m, opt, f"{tmp_path}/run/step-1")
    equal(snapshot(m, opt), saved)


def test_saves_become_deltas_and_older_steps_restore_exactly(tmp_path):
    m, opt = make()
    train(m, opt)
    store = f"{tmp_path}/run"
    w = Writer(policy="exact", full_share=-1)
    snaps = {}
    for s in range(1, 5):
        train(m, opt)
        dcp.save(state(m, opt, extra={"pos": s}), storage_writer=w, checkpoint_id=f"{store}/step-{s}")
        snaps[s] = snapshot(m, opt)
    w.close()
    rows = ls(store)
    assert [r["kind"] for r in rows] == ["full", "delta", "delta", "delta"]
    assert [r["parent"] for r in rows[1:]] == [1, 2, 3]
    train(m, opt)
    sd = load_into(m, opt, f"{store}/step-2", extra={"pos": -1})
    equal(snapshot(m, opt), snaps[2])
    assert sd["extra"] == {"pos": 2}
    load_into(m, opt, store, extra={"pos": -1})  # "STORE" alone: the latest
    equal(snapshot(m, opt), snaps[4])


def test_lossy_preset_restores_within_its_bound_and_writes_smaller_deltas(tmp_path):
    from amber.torch import LOSSY
    m, opt = make()
    train(m, opt)
    store = f"{tmp_path}/run"
    w = Writer(policy="lossy", full_share=-1)
    for s in range(1, 4):
        train(m, opt)
        dcp.save(state(m, opt), storage_writer=w, checkpoint_id=f"{store}/step-{s}")
    truth = snapshot(m, opt)
    w.close()
    rows = ls(store)
    assert rows[-1]["kind"] == "delta" and rows[-1]["bytes"] < rows[0]["bytes"]
    m2, opt2 = make()
    train(m2, opt2)
    load_into(m2, opt2, store)
    got = snapshot(m2, opt2)
    # the units of the preset's weight rule are each param group's lr, read from the
    # optimizer state dict's param_groups (1e-2 here): weights are lossy within 1 lr
    lossy = 0
    for k, v in truth.items():
        if k.endswith("/step"):
            assert torch.equal(got[k], v), k
            continue
        a, rel = rules_bound(LOSSY, k, unit=1e-2)
        err = (got[k].double() - v.double()).abs()
        assert torch.all(err <= (a + rel * got[k].double().abs()) * (1 + 1e-6) + 1e-30), k
        lossy += k.startswith("model/") and bool((err > 0).any())
    assert lossy, "no weight was lossy: the units did not reach the writer"
    with amber.Store(store, readonly=True) as st, st.reader() as r:
        rec = {t.name: spec_bound(t.policy) for t in r.tensors()}
    assert rec["model/0.weight"] == pytest.approx((1e-2, 0.0))
    assert rec["optim/state/0.weight/exp_avg"] == pytest.approx(rules_bound(LOSSY, "o/exp_avg"))
    assert rec["optim/state/0.weight/step"] == (0.0, 0.0)


def test_units_of_two_param_groups_follow_their_lr(tmp_path):
    """Each param group's lr is the unit of its parameters and their state, at every
    save (a schedule changes it); a tensor of no group has none (exact)."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW([{"params": m[0].parameters(), "lr": 1e-2},
                             {"params": list(m[1].parameters()) + list(m[2].parameters()),
                              "lr": 3e-3}])
    store = f"{tmp_path}/run"
    w = Writer(policy="threshold:2u", full_share=-1)
    for s in range(1, 4):
        train(m, opt)
        dcp.save(state(m, opt), storage_writer=w, checkpoint_id=f"{store}/step-{s}")
        with amber.Store(store, readonly=True) as st, st.reader(s) as r:
            rec = {t.name: spec_bound(t.policy) for t in r.tensors()}
        lr0, lr1 = (g["lr"] for g in opt.param_groups)
        assert rec["model/0.weight"] == pytest.approx((2 * lr0, 0.0)), s
        assert rec["optim/state/0.weight/exp_avg"] == pytest.approx((2 * lr0, 0.0)), s
        assert rec["model/2.bias"] == pytest.approx((2 * lr1, 0.0)), s
        assert rec["model/1.running_mean"] == (0.0, 0.0), s
        for g in opt.param_groups:
            g["lr"] *= 0.5
    w.close()


def test_async_save_stages_at_the_fence_and_round_trips(tmp_path):
    m, opt = make()
    train(m, opt)
    store = f"{tmp_path}/run"
    w = Writer()
    dcp.save(state(m, opt), storage_writer=w, checkpoint_id=f"{store}/step-1")
    train(m, opt)
    saved = snapshot(m, opt)
    resp = dcp.async_save(state(m, opt), storage_writer=w, checkpoint_id=f"{store}/step-2")
    resp.staging_completion.result(timeout=30)
    train(m, opt)  # after staging the live tensors may change
    resp.upload_completion.result(timeout=30)
    w.close()
    assert [r["kind"] for r in ls(store)] == ["full", "delta"]
    load_into(m, opt, f"{store}/step-2")
    equal(snapshot(m, opt), saved)


def test_async_save_process_type_is_refused(tmp_path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    m, opt = make()
    w = Writer()
    with pytest.raises(ValueError, match="PROCESS"):
        dcp.async_save(state(m, opt), storage_writer=w, checkpoint_id=f"{tmp_path}/run/step-1",
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    w.close()
    assert not os.path.exists(f"{tmp_path}/run") or ls(f"{tmp_path}/run") == []


def pickle_opcodes(data):
    """True when `data` holds a pickle stream (protocol 2+ starts with PROTO)."""
    i = data.find(b"\x80")
    while i != -1:
        if i + 1 < len(data) and 2 <= data[i + 1] <= 5:
            try:
                ops = [op.name for op, _, _ in pickletools.genops(data[i:])]
                if ops and ops[-1] == "STOP" and len(ops) > 3:
                    return True
            except Exception:
                pass
        i = data.find(b"\x80", i + 1)
    return False


def test_store_holds_no_pickle_and_json_metadata(tmp_path):
    m, opt = make()
    train(m, opt)
    store = f"{tmp_path}/run"
    with Writer() as w:
        dcp.save(state(m, opt, extra={"betas": (0.9, 0.95), "name": "x"}), storage_writer=w,
                 checkpoint_id=f"{store}/step-1")
    assert pickle_opcodes(b"junk" + __import__("pickle").dumps({"a": (1, 2)}, protocol=4))
    files = [os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs]
    assert files
    for f in files:
        assert not pickle_opcodes(open(f, "rb").read()), f
    with amber.Store(store, readonly=True, create=False) as st, st.reader() as r:
        meta = json.loads(r.meta())
    assert meta["format"] == "amber.dcp/1"
    assert meta["objects"]["extra/betas"] == {"$tuple": [0.9, 0.95]}


def test_a_value_that_cannot_be_stored_fails_the_save_and_nothing_becomes_visible(tmp_path):
    """A value DCP's planner cannot serialize (a lambda) and a tensor of a dtype amber does
    not store fail the save before anything is written; the next save works."""
    m, opt = make()
    store = f"{tmp_path}/run"
    w = Writer()
    dcp.save(state(m, opt), storage_writer=w, checkpoint_id=f"{store}/step-1")
    raises(BaseException, "lambda", dcp.save, state(m, opt, extra={"o": lambda: 0}),
           storage_writer=w, checkpoint_id=f"{store}/step-2")
    raises(BaseException, "complex64", dcp.save,
           state(m, opt, extra={"c": torch.zeros(2, dtype=torch.complex64)}),
           storage_writer=w, checkpoint_id=f"{store}/step-2")
    assert [r["step"] for r in ls(store)] == [1]
    dcp.save(state(m, opt), storage_writer=w, checkpoint_id=f"{store}/step-3")  # still works
    w.close()
    assert [r["step"] for r in ls(store)] == [1, 3]


def test_bad_ids_missing_store_and_corrupt_file_leave_live_state_untouched(tmp_path):
    m, opt = make()
    train(m, opt)
    store = f"{tmp_path}/run"
    with Writer() as w:
        dcp.save(state(m, opt), storage_writer=w, checkpoint_id=f"{store}/step-1")
        raises(BaseException, "step-x", dcp.save, state(m, opt), storage_writer=w,
               checkpoint_id=f"{store}/step-x")
    train(m, opt)
    live = snapshot(m, opt)
    raises(BaseException, "no amber store", load_into, m, opt, f"{tmp_path}/nothing/step-1")
    raises(BaseException, "step-x", load_into, m, opt, f"{store}/step-x")
    raises(BaseException, "7", load_into, m, opt, f"{store}/step-7")
    files = sorted(os.path.join(d, f) for d, _, fs in os.walk(store) for f in fs
                   if os.path.getsize(os.path.join(d, f)) > 10000)
    data = bytearray(open(files[0], "rb").read())
    data[len(data) // 2] ^= 0x40
    open(files[0], "wb").write(bytes(data))
    raises(BaseException, "AMBER_ECORRUPT", load_into, m, opt, f"{store}/step-1")
    equal(snapshot(m, opt), live)


def test_cli_ls_verify_export_on_a_dcp_store(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    m, opt = make()
    train(m, opt)
    store = f"{tmp_path}/run"
    with Writer() as w:
        for s in (1, 2):
            train(m, opt)
            dcp.save(state(m, opt), storage_writer=w, checkpoint_id=f"{store}/step-{s}")
    assert subprocess.run([AMBER, "verify", store]).returncode == 0
    out = f"{tmp_path}/x.safetensors"
    subprocess.run([AMBER, "export", store, "-o", out], check=True)
    got = safetensors.load_file(out)
    want = snapshot(m, opt)
    for k, v in want.items():
        name = k if k.startswith("model/") else k.replace("optim/", "optim/state/", 1)
        assert torch.equal(got[name], v), k


def test_bf16_float8_and_plain_tensors_round_trip(tmp_path):
    g = torch.Generator().manual_seed(1)
    sd = {"a": torch.randn(100, generator=g).bfloat16(),
          "b": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
          "c": torch.randn(64, generator=g).to(torch.float8_e5m2),
          "d": torch.arange(10), "t": torch.randn(4, 6, generator=g).t(),  # not contiguous
          "cfg": {"lr": 0.1, "tags": ["x", None], "inf": float("inf")}}
    want = {k: v.clone() for k, v in sd.items() if isinstance(v, torch.Tensor)}
    store = f"{tmp_path}/run"
    with Writer() as w:
        dcp.save(sd, storage_writer=w, checkpoint_id=f"{store}/step-5")
    back = {k: torch.zeros_like(v) for k, v in want.items()}
    back["cfg"] = {"lr": 0.0, "tags": None, "inf": 0.0}
    dcp.load(back, storage_reader=Reader(), checkpoint_id=store)
    for k, v in want.items():
        assert back[k].dtype == v.dtype
        assert torch.equal(back[k].view(torch.uint8) if v.dtype.itemsize == 1 else back[k],
                           v.view(torch.uint8) if v.dtype.itemsize == 1 else v), k
    assert back["cfg"] == {"lr": 0.1, "tags": ["x", None], "inf": float("inf")}


def test_reader_serves_narrowed_regions(tmp_path):
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem
    from torch.distributed.checkpoint.metadata import MetadataIndex
    store = f"{tmp_path}/run"
    x = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    with Writer() as w:
        dcp.save({"x": x}, storage_writer=w, checkpoint_id=f"{store}/step-1")
    r = Reader()
    r.reset(store)
    md = r.read_metadata()
    r.set_up_storage_reader(md, True)
    dst = torch.zeros(2, 3)

    class Planner:
        def resolve_tensor(self, req):
            return dst

        def commit_tensor(self, req, t):
            pass
    item = ReadItem(type=LoadItemType.TENSOR, storage_index=MetadataIndex("x", torch.Size([0, 0])),
                    storage_offsets=torch.Size([2, 4]), dest_index=MetadataIndex("x"),
                    dest_offsets=torch.Size([0, 0]), lengths=torch.Size([2, 3]))
    from torch.distributed.checkpoint.planner import LoadPlan
    r.read_data(LoadPlan([item]), Planner()).wait()
    assert torch.equal(dst, x[2:4, 4:7])


def test_reader_loads_a_store_written_by_the_checkpointer(tmp_path):
    from amber.torch import Checkpointer
    m, opt = make()
    train(m, opt, 2)
    saved = snapshot(m, opt)
    with Checkpointer(f"{tmp_path}/ck") as ck:
        ck.save(7, {"model": m, "optim": opt, "extra": {"epoch": 3, "name": "run"}})
    train(m, opt, 2)
    sd = load_into(m, opt, f"{tmp_path}/ck", extra={"epoch": 0, "name": ""})
    equal(snapshot(m, opt), saved)
    assert sd["extra"] == {"epoch": 3, "name": "run"}
    assert opt.param_groups[0]["lr"] == 1e-2


def test_checkpointer_loads_a_store_written_through_dcp(tmp_path):
    from amber.torch import Checkpointer
    m, opt = make()
    train(m, opt, 2)
    saved = snapshot(m, opt)
    with Writer() as w:
        dcp.save(state(m, opt, extra={"epoch": 3, "name": "run"}), storage_writer=w,
                 checkpoint_id=f"{tmp_path}/run/step-4")
    train(m, opt, 2)
    st = {"model": m, "optim": opt, "extra": {"epoch": 0, "name": ""}}
    with Checkpointer(f"{tmp_path}/run", rng=False) as ck:
        assert ck.load(st) == 4
    equal(snapshot(m, opt), saved)
    assert st["extra"] == {"epoch": 3, "name": "run"}
    assert opt.param_groups[0]["lr"] == 1e-2
