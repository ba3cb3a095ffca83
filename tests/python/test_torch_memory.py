"""Ownership of tensor memory between Python and the library: after wait() (or
the fence) the library holds no Python tensor: the tensors can be freed and a
later save of new tensors reads the new memory; the fence runs by itself before
optimizer.step(), so LR schedulers still see the optimizer's steps, and
close() removes it (a step pre-hook)."""
import gc
import warnings
import weakref

import torch

import amber
from amber.torch import Checkpointer


def test_tensors_are_not_kept_alive_after_wait_and_new_memory_is_read(store):
    with Checkpointer(store, rng=False) as ck:
        t = torch.randn(100_000)
        ref = weakref.ref(t)
        ck.save(1, {"w": t})
        ck.wait()
        del t
        gc.collect()
        assert ref() is None
        for step in range(2, 5):  # new tensors at (likely) new addresses
            junk = [torch.full((100_000,), float(i)) for i in range(3)]  # reuse freed memory
            u = torch.randn(100_000)
            ck.save(step, {"w": u})
            del junk
            ck.wait()
            got = {"w": torch.empty(100_000)}
            assert ck.load(got, step=step) == step
            assert torch.equal(got["w"], u)


def test_tensors_are_released_at_the_fence(store):
    with Checkpointer(store, rng=False) as ck:
        t = torch.randn(1000)
        ref = weakref.ref(t)
        ck.save(1, {"w": t})
        ck.fence()
        del t
        gc.collect()
        assert ref() is None


def test_copies_of_non_contiguous_tensors_live_until_the_fence(store):
    with Checkpointer(store, rng=False) as ck:
        base = torch.randn(300, 200)
        ck.save(1, {"w": base.t()})
        del base
        gc.collect()
        ck.wait()
        got = {"w": torch.empty(200, 300)}
        ck.load(got)
    assert got["w"].is_contiguous()


def test_fence_runs_before_optimizer_step_and_close_removes_the_wrapper(store):
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    original = opt.step
    with Checkpointer(store, rng=False) as ck:
        model(torch.randn(2, 512)).sum().backward()
        before = model.weight.detach().clone()
        ck.save(1, {"model": model, "optim": opt})
        opt.step()  # would race with the scan without the fence
        assert ck._saver.pinned is None  # the fence ran
        ck.wait()
        got = torch.nn.Linear(512, 512)
        ck.load({"model": got})
        assert torch.equal(got.weight, before)
        assert not torch.equal(model.weight, before)
    assert opt.step == original and not opt._optimizer_step_pre_hooks  # close() removed the hook


def test_a_scheduler_created_after_the_first_save_still_counts_steps(store):
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Checkpointer(store, rng=False) as ck, warnings.catch_warnings():
        warnings.simplefilter("error")  # no "optimizer.step() overridden" warning
        ck.save(1, {"model": model, "optim": opt})
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for step in range(2, 4):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            sched.step()
            ck.save(step, {"model": model, "optim": opt, "sched": sched})
        assert getattr(opt, "_opt_called", False) and sched.get_last_lr() == [2.5e-3]


def test_failed_save_raises_on_wait_and_training_goes_on(store):
    model = torch.nn.Linear(4, 4)
    with Checkpointer(store, rng=False) as ck:
        ck.save(5, {"model": model})
        try:
            ck.save(5, {"model": model})  # not after the latest step
        except amber.AmberError as e:
            assert e.name == "AMBER_EEXIST"
        else:
            raise AssertionError("a save of an existing step must fail")
        ck.save(6, {"model": model})
        assert ck.latest() == 6
