"""One rank of the distributed Checkpointer's device-path tests
(tests/python/test_dist_device.py).

    python dist_device_worker.py SCENARIO RANK WORLD INIT_FILE DIR

As dist_worker.py (whose model, training step and helpers it uses), with
AMBER_DEVICE_PATH=1 in the environment: every local shard goes through amber.device
(selected against a reference the rank keeps, handed to the global writer as
pre-selected chunks). A scenario sets AMBER_DEVICE_PATH=0 itself for the runs it
compares with the CPU path.
"""
import os

import torch
import torch.distributed as dist

import amber
from amber import device as _device
from amber.torch import Checkpointer
from dist_worker import build, full_state, run, train_step


def _path(dev):
    os.environ["AMBER_DEVICE_PATH"] = "1" if dev else "0"


def trajectory(path, rank, last, dev, policy=None, first_ck=None):
    """Trains steps 1..last from the same seeds, saving every step; returns the live
    state and the steps' kinds. dev: through the device path, else the CPU path."""
    _path(dev)
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    with Checkpointer(path, policy=policy, full_share=-1) as ck:
        run(model, opt, ck, 1, last)
        held = ck._saver.dev.tensors if ck._saver.dev is not None else {}
        assert bool(held) == dev, (dev, sorted(held))
        kinds = [s.kind for s in ck.steps()]
    return full_state(model, opt), kinds


def restore(path, rank, step=None, process_group=None):
    """The state of `step` of `path`, loaded into a fresh model (live DTensors)."""
    torch.manual_seed(5 + rank)
    model, opt = build(11)
    train_step(model, opt)
    with Checkpointer(path, process_group=process_group) as ck:
        ck.load({"model": model, "optim": opt, "extra": {}}, step)
    return full_state(model, opt)


def same(a, b, what):
    assert set(a) == set(b), (what, sorted(set(a) ^ set(b)))
    for k in a:
        assert torch.equal(a[k], b[k]), f"{what}: {k} differs"


def scenario_device(rank, world, d):
    # exact: the device path and the CPU path restore the same states, bit for bit
    live, kinds = trajectory(f"{d}/a", rank, 5, dev=True)
    assert kinds == ["full"] + ["delta"] * 4, kinds
    live_cpu, _ = trajectory(f"{d}/c", rank, 5, dev=False)
    same(live, live_cpu, "the two trajectories")
    _path(True)
    for step in (3, 5):
        got = restore(f"{d}/a", rank, step)
        same(got, restore(f"{d}/c", rank, step), f"step {step}: device path against CPU path")
    same(got, live, "step 5 against the live state")
    if rank == 0:
        torch.save(live, f"{d}/a.pt")

    # a restart: the load seeds each rank's references, so its first step is a delta
    # that reads nothing back; a load of the latest step in a Checkpointer that has
    # saved seeds them too; a reopen without a load reads them back from the store
    reads = []
    load_refs = _device.DevicePath.load_refs

    def counted(self, *args):
        reads.append(args[1])
        return load_refs(self, *args)
    _device.DevicePath.load_refs = counted
    trajectory(f"{d}/b", rank, 3, dev=True)
    torch.manual_seed(999)
    model, opt = build(7)
    with Checkpointer(f"{d}/b", full_share=-1) as ck:
        state = {"model": model, "optim": opt, "extra": {}}
        assert ck.load(state) == 3
        run(model, opt, ck, 4, 5)
        assert [s.kind for s in ck.steps()][3:] == ["delta"] * 2
        assert not reads, reads
        for dt in ck._saver.dev.tensors.values():
            dt.valid = False  # as after a failed full step: only a seed makes them valid
        assert ck.load(state) == 5
        assert all(dt.valid for dt in ck._saver.dev.tensors.values())
        same(full_state(model, opt), live, "the restart")
        run(model, opt, ck, 6, 6)
        # a write that fails on rank 1: the step fails everywhere, the references go
        # back, and the next step (full) restores the live state
        blocker = f"{d}/b/rank-00001/ckpt-{7:020d}.amber"
        if rank == 1:
            os.mkdir(blocker)
        dist.barrier()
        train_step(model, opt)
        ck.save(7, {"model": model, "optim": opt, "extra": {}})
        try:
            ck.wait()
            raise AssertionError("a step whose write failed on rank 1 committed")
        except amber.AmberError as e:
            assert "step 7 not committed: rank 1 failed" in e.message, e.message
        run(model, opt, ck, 8, 9)
        # a selection that fails on rank 1 (a device error), in a delta step and in
        # the full one after it: every rank begins the step all the same, and it
        # fails everywhere, naming rank 1 and the error
        select = ck._saver.dev.select
        for step in (10, 11):
            if rank == 1:
                def broken(*_):
                    raise RuntimeError("device lost")
                ck._saver.dev.select = broken
            train_step(model, opt)
            ck.save(step, {"model": model, "optim": opt, "extra": {}})
            ck._saver.dev.select = select
            try:
                ck.wait()
                raise AssertionError("a step whose selection failed on rank 1 committed")
            except amber.AmberError as e:
                assert f"step {step} not committed: rank 1 failed" in e.message, e.message
                assert "device lost" in e.message, e.message
                assert rank != 1 or isinstance(e.__cause__, RuntimeError), e.__cause__
        run(model, opt, ck, 12, 12)
        assert [s.kind for s in ck.steps()][5:] == ["delta", "full", "delta", "full"]
    same(restore(f"{d}/b", rank), full_state(model, opt), "step 12 after the restart")
    with Checkpointer(f"{d}/b", full_share=-1) as ck:
        run(model, opt, ck, 13, 13)
        assert ck.steps()[-1].kind == "delta"
    assert reads == [12], reads
    _device.DevicePath.load_refs = load_refs
    same(restore(f"{d}/b", rank), full_state(model, opt), "step 13 after a reopen")

    # threshold: within its bound of the live state, and the CPU path's restore
    pol = "threshold:1e-3"
    live, kinds = trajectory(f"{d}/t", rank, 4, dev=True, policy=pol)
    assert kinds == ["full"] + ["delta"] * 3, kinds
    trajectory(f"{d}/tc", rank, 4, dev=False, policy=pol)
    _path(True)
    got = restore(f"{d}/t", rank)
    same(got, restore(f"{d}/tc", rank), "threshold: device path against CPU path")
    lossy = 0
    for k, v in live.items():
        err = (got[k].double() - v.double()).abs().max().item() if v.numel() else 0.0
        assert err <= 1e-3, f"threshold: {k} off by {err}"
        lossy += err > 0
    assert lossy, "the threshold stored every change"


def scenario_device1(rank, world, d):
    """One rank loads what two wrote through the device path, and saves on."""
    want = torch.load(f"{d}/a.pt")
    group = dist.group.WORLD
    same(restore(f"{d}/a", rank, process_group=group), want, "2 -> 1")
    torch.manual_seed(5)
    model, opt = build(11)
    with Checkpointer(f"{d}/a", full_share=-1, process_group=group) as ck:
        ck.load({"model": model, "optim": opt, "extra": {}})
        run(model, opt, ck, 6, 7)
        assert ck._saver.dev.tensors
        assert [s.kind for s in ck.steps()][5:] == ["full", "delta"]
    same(restore(f"{d}/a", rank, process_group=group), full_state(model, opt), "1 rank, step 7")


if __name__ == "__main__":  # dist_worker.py's main, with these scenarios
    import dist_worker
    dist_worker.scenario_device = scenario_device
    dist_worker.scenario_device1 = scenario_device1
    dist_worker.main()
