"""What save() reads in place and what it copies (issue 23), and the save plan that
lets a save skip re-learning an unchanged state:

- a tensor that no optimizer owns is read in place when its version counter can be
  checked at the fence: not copied, and a change before the fence fails the save
  with AMBER_ECHANGED naming it, committing nothing; a model saved without its
  optimizer is fenced before any optimizer's step; module buffers and inference
  tensors are still copied at save();
- the plan is reused from save to save, and every structural change between saves
  (a parameter replaced, `.data` swapped, optimizer state replaced or added, a new
  parameter group or buffer, a submodule removed) is seen: each step holds exactly
  the state at its save();
- the seed after a load runs in the background and is waited for at the fence; a
  tensor changed before it finished drops it, and the next save is still right.

Under AMBER_DEVICE_PATH=1 (make test runs this file again that way) every tensor is
selected on its device at save(): nothing is read in place, so the in-place checks
are skipped there and the saved values are checked as everywhere."""
import os

import pytest
import torch

import amber
import amber.torch._dtypes
from amber.torch import CAPTURE_BYTES, Checkpointer

DEVICE_PATH = os.environ.get("AMBER_DEVICE_PATH") == "1"
BIG = (CAPTURE_BYTES // 4) * 4  # elements: 4x the bytes that are copied whoever owns them


def stored(store, step):
    """Every tensor of `step`, read back raw, by name."""
    with amber.Store(store, readonly=True) as st, st.reader(step) as r:
        out = {}
        for info in r.tensors():
            buf = r.read(info.index)
            dtype = amber.torch._dtypes.TORCH[info.dtype]
            out[info.name] = torch.frombuffer(buf, dtype=dtype).reshape(info.shape).clone() \
                if info.nbytes else torch.empty(info.shape, dtype=dtype)
        return out


def live(model, opt, key="model", okey="optim"):
    """What a save of {key: model, okey: opt} holds now, by stored name."""
    out = {f"{key}/{k}": v.detach().clone() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        for k, v in s.items():
            if isinstance(v, torch.Tensor):
                out[f"{okey}/{names[id(p)]}/{k}"] = v.detach().clone()
    return out


def same(got, want):
    assert set(want) <= set(got), sorted(set(want) - set(got))[:3]
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def test_an_unowned_tensor_is_read_in_place_and_a_change_before_the_fence_fails_the_save(store):
    w = torch.randn(BIG)  # a plain tensor in a dict: no optimizer owns it
    state = {"weights": {"w": w}}
    with Checkpointer(store, rng=False) as ck:
        ck.save(1, state)
        ck.wait()
        ck.save(2, state)
        if not DEVICE_PATH:
            # read in place: the writer points at the tensor's own memory, no copy
            assert ck._saver.ptrs == [w.data_ptr()]
            assert "weights/w" not in ck._saver.stage.bufs
            assert [t.data_ptr() for t in ck._saver.pinned] == [w.data_ptr()]  # kept to the fence
        at_save = w.clone()
        with torch.no_grad():
            w.add_(1.0)  # before the fence (no optimizer step: nothing fences)
        if DEVICE_PATH:  # selected at save(): step 2 holds the state at save()
            ck.wait()
            assert torch.equal(stored(store, 2)["weights/w"], at_save)
            return
        with pytest.raises(amber.AmberError) as e:
            ck.wait()
        assert e.value.code == amber.ECHANGED and "'weights/w'" in e.value.message
        assert ck.latest() == 1  # nothing of step 2 is visible
        ck.save(3, state)  # and the next save is right again
        ck.wait()
    assert [c.step for c in amber.Store(store, readonly=True).list()] == [1, 3]
    assert torch.equal(stored(store, 3)["weights/w"], w)


def test_a_model_saved_without_its_optimizer_is_fenced_before_any_optimizer_step(store):
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 512)  # weight 512 KiB: above CAPTURE_BYTES
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    with Checkpointer(store, rng=False) as ck:
        for step in range(1, 4):
            want = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
            ck.save(step, {"model": model})  # the optimizer is not in the state
            if not DEVICE_PATH:
                assert model.weight.data_ptr() in ck._saver.ptrs  # read in place
            model(torch.randn(4, 256)).pow(2).sum().backward()
            opt.step()  # fences first (a global step pre-hook): then changes the weights
            opt.zero_grad()
            ck.wait()  # committed: no change before the fence
            same(stored(store, step), want)


def test_buffers_and_inference_tensors_are_copied_at_save(store):
    bn = torch.nn.BatchNorm1d(BIG // 4)  # running statistics above CAPTURE_BYTES
    with torch.inference_mode():
        inf = torch.randn(BIG)  # no version counter
    state = {"bn": bn, "extra": {"inf": inf}}
    with Checkpointer(store, rng=False) as ck:
        want = {"bn/running_mean": bn.running_mean.clone(), "extra/inf": inf.clone()}
        ck.save(1, state)
        if not DEVICE_PATH:
            assert bn.running_mean.data_ptr() not in ck._saver.ptrs
            assert inf.data_ptr() not in ck._saver.ptrs
        bn.train()
        bn(torch.randn(8, BIG // 4))  # a forward pass changes the buffers in place
        with torch.inference_mode():
            inf.add_(1.0)
        ck.wait()
        same(stored(store, 1), want)


def test_the_plan_is_reused_and_every_change_of_structure_between_saves_is_seen(store):
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(),
                                torch.nn.Linear(300, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)

    def train():
        model(torch.randn(16, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        sched.step()

    def replace_weight():  # a new Parameter in the model and in the optimizer
        old, new = model[0].weight, torch.nn.Parameter(torch.randn(300, 64))
        model[0].weight = new
        ps = opt.param_groups[0]["params"]
        ps[next(i for i, p in enumerate(ps) if p is old)] = new
        opt.state[new] = opt.state.pop(old)

    changes = [
        None, None,  # the plan is made, then reused
        replace_weight,
        lambda: setattr(model[2].weight, "data", torch.randn(8, 300)),  # new storage
        lambda: setattr(square, "data", square.data.t()),  # same address, transposed
        lambda: opt.state[model[2].bias].__setitem__("exp_avg", torch.full((8,), 7.0)),
        lambda: model[2].register_buffer("scale", torch.full((3,), 2.0)),
        lambda: (model.append(torch.nn.Linear(8, 4)),  # a new layer, in a new group
                 opt.add_param_group({"params": list(model[3].parameters()), "lr": 1e-3})),
        lambda: delattr(model, "1"),  # a submodule removed without any hook
        lambda: tree["b"].__setitem__("c", torch.full((3,), 5.0)),  # a tensor in a dict
        lambda: tree.__setitem__("d", torch.ones(2)),  # a new key
        None,
    ]
    tree = {"a": torch.randn(BIG), "b": {"c": torch.zeros(3)}}  # tensors in dicts only
    square = torch.randn(512, 512)  # read in place (above CAPTURE_BYTES)
    tree["sq"] = square
    plans = []
    with Checkpointer(store, rng=True) as ck:
        for step, change in enumerate(changes, start=1):
            train()
            if change is not None:
                change()
            want = live(model, opt)
            with torch.no_grad():
                tree["a"].add_(1.0)  # changes between saves, as training does
            want.update({"tree/a": tree["a"].clone(), "tree/b/c": tree["b"]["c"].clone(),
                         "tree/sq": square.clone()})
            if "d" in tree:
                want["tree/d"] = tree["d"].clone()
            ck.save(step, {"model": model, "optim": opt, "sched": sched, "tree": tree,
                           "extra": {"step": step, "t": torch.full((2,), float(step))}})
            ck.wait()
            plans.append(ck._saveplan)
            got = stored(store, step)
            same(got, want)
            assert torch.equal(got["extra/t"], torch.full((2,), float(step)))
            assert ("model/2.scale" in got) == (step >= 7)  # registered at step 7
        if not DEVICE_PATH:
            assert plans[0] is not None and plans[1] is plans[0]  # reused, not remade
            for i, change in enumerate(changes[2:-1], start=2):  # each change: a new plan
                assert plans[i] is not None and plans[i] is not plans[i - 1], i
            assert plans[-1] is plans[-2]  # after the last change, reused again
    # the latest step loads into the model as it is now (lr schedule included)
    lr = [g["lr"] for g in opt.param_groups]
    with Checkpointer(store, rng=True) as ck:
        assert ck.load({"model": model, "optim": opt, "sched": sched, "tree": tree,
                        "extra": {}}) == len(changes)
    assert [g["lr"] for g in opt.param_groups] == lr


def test_the_seed_after_a_load_runs_until_the_fence_and_a_change_before_it_drops_it(store):
    torch.manual_seed(2)
    model = torch.nn.Linear(128, 1024)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train():
        model(torch.randn(8, 128)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    train()
    with Checkpointer(store, rng=False, full_share=-1) as ck:
        ck.save(1, {"model": model, "optim": opt})
    for step, tamper in ((2, False), (3, True)):
        with Checkpointer(store, rng=False, full_share=-1) as ck:  # deltas, however dense
            assert ck.load({"model": model, "optim": opt}) == step - 1 and ck.seeded
            if tamper:  # in place, no optimizer step: nothing fences before this
                with torch.no_grad():
                    model.weight.mul_(-1.0)
            else:
                train()  # the step's pre-hook waits for the seed
            want = live(model, opt)
            ck.save(step, {"model": model, "optim": opt})
            ck.wait()
            assert ck.seeded == (not tamper or DEVICE_PATH)
            kinds = {c.step: c.kind for c in ck.steps()}
        assert kinds[step] == "delta"  # seeded, or its reference read from the store
        same(stored(store, step), want)


def test_a_planned_save_writes_the_metadata_the_whole_path_writes(store):
    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.LayerNorm(32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    state = {"model": model, "optim": opt, "tree": {"w": torch.randn(BIG)},
             "extra": {"note": "x", "pos": 7}}
    metas = []
    with Checkpointer(store, rng=True) as ck:
        for step in (1, 2, 3):
            ck.save(step, state)
            ck.wait()
            if not DEVICE_PATH:
                assert ck._saveplan is not None  # made by step 1, used by 2 and 3
            with amber.Store(store, readonly=True) as st, st.reader(step) as r:
                metas.append(__import__("json").loads(r.meta()))
    for m in metas:
        m.pop("step")
        m.pop("rng")
    assert metas[0] == metas[1] == metas[2]  # step 1 the whole way, 2 and 3 planned
