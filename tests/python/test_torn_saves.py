"""Saves that race with training, in one process: through amber.dcp (dcp.async_save with
a change between the call and the end of its staging: an in-place op, an optimizer
step, a thread) a committed step is the state at the call, or the save fails with
AMBER_ECHANGED; and through both front ends, a raced save that no check can see (a
write through `.data`) cannot poison the writer's reference: the next, correct save
restores exactly its state. The 2-rank cases are in test_dist_torn_saves.py."""

import threading
import warnings

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.state_dict import get_state_dict  # noqa: E402

import amber  # noqa: E402
from amber.dcp import Reader, Writer  # noqa: E402
from amber.torch import Checkpointer  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
N = 4_000_000


def dcp_load(cid, like):
    out = {k: torch.zeros_like(v) for k, v in like.items()}
    dcp.load(out, storage_reader=Reader(), checkpoint_id=cid)
    return out


def amber_error(e):
    """The AmberError that a DCP failure carries: DCP wraps what a storage writer
    raises in a CheckpointException, with each rank's exception in `failures`."""
    if isinstance(e, amber.AmberError):
        return e
    for exc, _ in getattr(e, "failures", {}).values():
        if isinstance(exc, amber.AmberError):
            return exc
    raise AssertionError(f"not an amber error: {e!r}")


def saved_or_refused(resp, cid, pre):
    """The async save's outcome: True when it committed exactly `pre`, False when it
    was refused as torn (AMBER_ECHANGED); anything else fails the test."""
    try:
        resp.upload_completion.result()
    except BaseException as e:  # CheckpointException is a BaseException
        err = amber_error(e)
        assert err.name == "AMBER_ECHANGED", err
        assert "changed in place" in str(err)
        return False
    got = dcp_load(cid, pre)
    for k in pre:
        assert torch.equal(got[k], pre[k]), f"{k}: the committed step is not the state at the call"
    return True


def test_async_save_then_in_place_change_is_the_state_at_the_call_or_echanged(tmp_path):
    """The probe's reproduction: t.add_(1) right after dcp.async_save returns. Each
    step commits the values at the call or fails with AMBER_ECHANGED, never a mix;
    after a refused save the next one is correct."""
    w = Writer(policy="exact")
    t = torch.randn(N)
    refused = 0
    for step in range(1, 5):
        pre = {"w": t.clone()}
        cid = f"{tmp_path}/x/step-{step}"
        r = dcp.async_save({"w": t}, storage_writer=w, checkpoint_id=cid)
        t.add_(1.0)
        refused += not saved_or_refused(r, cid, pre)
    # a save that waits for its staging is never refused
    pre = {"w": t.clone()}
    r = dcp.async_save({"w": t}, storage_writer=w, checkpoint_id=f"{tmp_path}/x/step-9")
    r.staging_completion.result()
    t.add_(1.0)
    assert saved_or_refused(r, f"{tmp_path}/x/step-9", pre)
    w.close()
    print(f"{refused} of 4 raced saves refused")


def test_async_save_then_optimizer_step_saves_the_state_at_the_call(tmp_path):
    """get_state_dict(model, AdamW), dcp.async_save, then optimizer.step() at once: the
    step waits for the save's staging (amber fences before any optimizer step), so
    the committed moments are those at the call, not partly the next step's."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    w = Writer(policy="exact")
    m(torch.randn(8, 1024)).square().mean().backward()
    for step in range(1, 4):
        opt.step()
        opt.zero_grad()
        m(torch.randn(8, 1024)).square().mean().backward()  # the next step's gradients
        msd, osd = get_state_dict(m, opt)
        sd = {"model": msd, "optim": osd}
        pre = {f"m/{k}": v.clone() for k, v in msd.items()}
        pre.update({f"o/{p}/{k}": v.clone() for p, st in osd["state"].items()
                    for k, v in st.items() if torch.is_tensor(v)})
        cid = f"{tmp_path}/x/step-{step}"
        r = dcp.async_save(sd, storage_writer=w, checkpoint_id=cid)
        opt.step()  # no wait on staging_completion: amber's hook fences first
        opt.zero_grad()
        m(torch.randn(8, 1024)).square().mean().backward()
        r.upload_completion.result()
        msd2, osd2 = get_state_dict(m, opt)
        back = {"model": {k: torch.zeros_like(v) for k, v in msd2.items()},
                "optim": {"state": {p: {k: torch.zeros_like(v) if torch.is_tensor(v) else v
                                        for k, v in st.items()}
                                    for p, st in osd2["state"].items()},
                          "param_groups": osd2["param_groups"]}}
        dcp.load(back, storage_reader=Reader(), checkpoint_id=cid)
        got = {f"m/{k}": v for k, v in back["model"].items()}
        got.update({f"o/{p}/{k}": v for p, st in back["optim"]["state"].items()
                    for k, v in st.items() if torch.is_tensor(v)})
        for k in pre:
            assert torch.equal(got[k], pre[k]), f"step {step}: {k} is not the state at the call"
    w.close()


def test_async_save_raced_by_a_thread_is_the_state_at_the_call_or_echanged(tmp_path):
    """A thread changes the tensor in place (t.add_ of some elements) while the save
    stages: the step is the state at the call or refused, and the next, unraced save
    is exact. (A version counter moves when an in-place op ends: an op still running on
    another thread when the staging completes is not seen; docs/dcp.md says so.)"""
    w = Writer(policy="exact")
    t = torch.randn(N)
    for step in range(1, 4):
        pre = {"w": t.clone()}
        cid = f"{tmp_path}/x/step-{step}"
        go = threading.Event()
        th = threading.Thread(target=lambda: (go.wait(), t[::997].add_(0.5)))
        th.start()
        r = dcp.async_save({"w": t}, storage_writer=w, checkpoint_id=cid)
        go.set()
        th.join()
        saved_or_refused(r, cid, pre)
    pre = {"w": t.clone()}
    dcp.save({"w": t}, storage_writer=w, checkpoint_id=f"{tmp_path}/x/step-9")
    assert torch.equal(dcp_load(f"{tmp_path}/x/step-9", pre)["w"], pre["w"])
    w.close()


def test_checkpointer_raced_save_does_not_poison_the_reference(tmp_path):
    """The probe's reproduction through the Checkpointer: a save raced through `.data`
    (which no version counter sees), then a correct save: the correct one restores
    exactly what was saved, every time."""
    path = str(tmp_path / "y")
    ck = Checkpointer(path, policy="exact", full_share=1.0, full_every=1000)
    torch.manual_seed(0)
    t = torch.randn(N)
    s = 0
    for k in range(8):
        s += 1
        t.add_(1.0)
        ck.save(s, {"w": t})
        t.data.add_(1.0)  # raced: the step's content is undefined
        try:
            ck.wait()
        except amber.AmberError:
            pass
        s += 1
        t[k % 5::5].add_(0.5)
        pre = t.clone()
        ck.save(s, {"w": t})
        ck.wait()
        with Checkpointer(path, readonly=True) as rd:
            got = {"w": torch.zeros_like(t)}
            assert rd.load(got, step=s) == s
        assert torch.equal(got["w"], pre), \
            f"k={k}: step {s} restores {(got['w'] != pre).sum().item()} elements wrong"
    ck.close()


def test_dcp_raced_save_does_not_poison_the_reference(tmp_path):
    """The same through amber.dcp: an async save raced through `.data` before its
    staging completes, then a correct save, which must load exactly."""
    w = Writer(policy="exact", full_share=1.0, full_every=1000)
    torch.manual_seed(0)
    t = torch.randn(N)
    s = 0
    for k in range(6):
        s += 1
        t.add_(1.0)
        r = dcp.async_save({"w": t}, storage_writer=w, checkpoint_id=f"{tmp_path}/z/step-{s}")
        t.data.add_(1.0)
        try:
            r.upload_completion.result()
        except BaseException as e:  # torn: refused, or committed by luck
            amber_error(e)
        s += 1
        t[k % 5::5].add_(0.5)
        pre = {"w": t.clone()}
        dcp.save({"w": t}, storage_writer=w, checkpoint_id=f"{tmp_path}/z/step-{s}")
        got = dcp_load(f"{tmp_path}/z/step-{s}", pre)
        assert torch.equal(got["w"], pre["w"]), \
            f"k={k}: step {s} loads {(got['w'] != pre['w']).sum().item()} elements wrong"
    w.close()
