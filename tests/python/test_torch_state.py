"""What Checkpointer.save/load keep and restore: optimizers (Adam, AdamW, SGD with
momentum: state, step counters, param_groups) keyed by parameter name, LR
schedulers, RNG states, tensors and plain values; an earlier step restores exactly
that step's state; mismatched state raises an error naming the key, or is
skipped with strict=False; a change of the tensor set starts a full checkpoint."""
import os
import random
import warnings

import amber
import numpy as np
import pytest
import torch

from amber.torch import Checkpointer, StateMismatchError


def mlp(seed=0, hidden=8):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, hidden), torch.nn.Tanh(), torch.nn.Linear(hidden, 2))


def train(model, opt, steps, sched=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=g)
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if sched is not None:
            sched.step()


def snapshot(model, opt):
    """Deep copies of the module's and optimizer's state_dicts."""
    def clone(x):
        if isinstance(x, torch.Tensor):
            return x.clone()
        if isinstance(x, dict):
            return {k: clone(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clone(v) for v in x]
        return x
    return clone(model.state_dict()), clone(opt.state_dict())


def assert_same(a, b, path="state"):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), path
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw_amsgrad": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "sgd_momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizer_state_step_counters_and_param_groups_are_restored(store, name):
    model = mlp()
    opt = OPTIMIZERS[name](model.parameters())
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
    with Checkpointer(store) as ck:
        train(model, opt, 3, sched)
        ck.save(3, {"model": model, "optim": opt, "sched": sched})
        want = snapshot(model, opt)
        want_sched = sched.state_dict()
        train(model, opt, 2, sched, seed=1)
        opt.param_groups[0]["weight_decay"] = 0.5  # a hyper-parameter changed later
        ck.save(5, {"model": model, "optim": opt, "sched": sched})
        assert ck.load({"model": model, "optim": opt, "sched": sched}, step=3) == 3
        assert_same(snapshot(model, opt), want)
        assert sched.state_dict() == want_sched
    # a fresh model and optimizer (no state yet) in the same way
    model2 = mlp(seed=5)
    opt2 = OPTIMIZERS[name](model2.parameters())
    sched2 = torch.optim.lr_scheduler.ExponentialLR(opt2, gamma=0.5)
    with Checkpointer(store) as ck:
        assert ck.load({"model": model2, "optim": opt2, "sched": sched2}, step=3) == 3
    assert_same(snapshot(model2, opt2), want)
    assert sched2.state_dict() == want_sched
    # and both continue identically
    train(model, opt, 2, sched, seed=9)
    train(model2, opt2, 2, sched2, seed=9)
    assert_same(snapshot(model2, opt2), snapshot(model, opt))


def test_optimizer_state_is_keyed_by_parameter_name_not_position(store):
    model = mlp()
    opt = torch.optim.Adam([{"params": [model[0].weight, model[0].bias]},
                            {"params": [model[2].weight, model[2].bias], "lr": 1e-3}], lr=1e-2)
    train(model, opt, 2)
    with Checkpointer(store) as ck:
        ck.save(1, {"model": model, "optim": opt})
        ck.wait()
        names = [t.name for t in ck.store.reader().tensors()]
    assert "optim/0.weight/exp_avg" in names and "optim/2.bias/step" in names
    # the same groups, built in another process-like way: the module's parameter
    # objects differ, their names are what matches them
    model2 = mlp(seed=3)
    opt2 = torch.optim.Adam([{"params": [model2[0].weight, model2[0].bias]},
                             {"params": [model2[2].weight, model2[2].bias], "lr": 1e-3}], lr=1e-2)
    with Checkpointer(store) as ck:
        ck.load({"model": model2, "optim": opt2})
    assert torch.equal(opt2.state[model2[2].weight]["exp_avg"], opt.state[model[2].weight]["exp_avg"])
    assert opt2.param_groups[1]["lr"] == 1e-3


def test_earlier_step_restores_exactly_that_step_no_later_update_leaks(store):
    # a large tensor makes the scan take long enough that a missing fence would show
    torch.manual_seed(0)
    model = torch.nn.Linear(2048, 1024)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    snaps = {}
    with Checkpointer(store) as ck:
        for step in range(1, 5):
            model(torch.randn(4, 2048)).sum().backward()
            opt.step()  # with a save in flight: must fence first, by itself
            opt.zero_grad()
            ck.save(step, {"model": model, "optim": opt})
            snaps[step] = snapshot(model, opt)
        for step in (2, 1, 4, 3):
            ck.load({"model": model, "optim": opt}, step=step)
            assert_same(snapshot(model, opt), snaps[step], f"step {step}")


def test_rng_states_are_restored(store):
    with Checkpointer(store) as ck:
        ck.save(1, {})
        want = (torch.rand(3), random.random(), np.random.rand(), torch.randn(2))
        torch.rand(100), random.random(), np.random.rand(7)
        assert ck.load({}) == 1
        got = (torch.rand(3), random.random(), np.random.rand(), torch.randn(2))
    assert torch.equal(want[0], got[0]) and want[1] == got[1] and want[2] == got[2]
    assert torch.equal(want[3], got[3])


def test_rng_false_neither_saves_nor_restores(store):
    with Checkpointer(store, rng=False) as ck:
        ck.save(1, {"rng": 5})  # the key is free then
        ck.wait()
        assert all(not t.name.startswith("rng/") for t in ck.store.reader().tensors())
        state = {"rng": None}
        ck.load(state)
        assert state["rng"] == 5


def test_tensors_plain_values_and_schedulers(store):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    onecycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1.0, total_steps=20)
    train(model, opt, 3, onecycle)
    t = torch.arange(12, dtype=torch.int16).reshape(3, 4).t()  # not contiguous: copied
    extra = {"epoch": 2, "name": "run", "nan": float("nan"), "pair": (1, -float("inf")),
             "ints": {1: "a", 2: None}, "nested": [torch.ones(2, dtype=torch.bfloat16), 3.5],
             "arr": np.arange(3, dtype=np.uint32), "dtype": torch.float16}
    with Checkpointer(store) as ck:
        ck.save(1, {"model": model, "optim": opt, "sched": onecycle, "t": t, "extra": extra,
                    "count": 7})
        sched_want = {k: v for k, v in onecycle.state_dict().items() if not callable(v)}
        train(model, opt, 2, onecycle)
        got_extra = {}
        t2 = torch.zeros(4, 3, dtype=torch.int16)
        state = {"model": model, "optim": opt, "sched": onecycle, "t": t2, "extra": got_extra,
                 "count": None}
        ck.load(state)
    assert torch.equal(t2, t) and state["count"] == 7
    assert {k: v for k, v in onecycle.state_dict().items() if not callable(v)} == sched_want
    onecycle.step()  # the scheduler still works (its code was not replaced by the load)
    assert got_extra["epoch"] == 2 and got_extra["name"] == "run" and got_extra["nan"] != got_extra["nan"]
    assert got_extra["pair"] == (1, -float("inf")) and got_extra["ints"] == {1: "a", 2: None}
    assert got_extra["nested"][0].dtype == torch.bfloat16 and got_extra["nested"][1] == 3.5
    assert got_extra["arr"].dtype == np.uint32 and list(got_extra["arr"]) == [0, 1, 2]
    assert got_extra["dtype"] is torch.float16


def test_load_of_an_empty_store_returns_none(store):
    with Checkpointer(store) as ck:
        assert ck.load({"model": mlp()}) is None
        assert ck.latest() is None and ck.steps() == []


def test_unsupported_values_are_refused_naming_the_key(store):
    with Checkpointer(store) as ck:
        with pytest.raises(TypeError, match="extra/f"):
            ck.save(1, {"extra": {"f": object()}})
        with pytest.raises(TypeError, match="c: dtype torch.complex64"):
            ck.save(1, {"c": torch.zeros(2, dtype=torch.complex64)})


def _saved(store):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 1)
    with Checkpointer(store) as ck:
        ck.save(1, {"model": model, "optim": opt, "t": torch.ones(3)})
    return model, opt


def test_missing_key_is_an_error_naming_it(store):
    _saved(store)
    bigger = torch.nn.Sequential(*mlp(), torch.nn.Linear(2, 2))
    with Checkpointer(store) as ck:
        with pytest.raises(StateMismatchError) as e:
            ck.load({"model": bigger})
        assert e.value.key == "model/3.weight" and "not in the checkpoint" in str(e.value)
        assert e.value.name == "AMBER_EMISMATCH"
        with pytest.raises(StateMismatchError, match="absent: not in the checkpoint"):
            ck.load({"absent": torch.zeros(1)})


def test_extra_key_is_an_error_naming_it(store):
    _saved(store)
    smaller = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with Checkpointer(store) as ck:
        with pytest.raises(StateMismatchError) as e:
            ck.load({"model": smaller})
        assert e.value.key == "model/2.weight" and "not in the state" in str(e.value)


def test_wrong_shape_or_dtype_is_an_error_naming_the_key(store):
    _saved(store)
    wide = mlp(hidden=9)
    with Checkpointer(store) as ck:
        with pytest.raises(StateMismatchError) as e:
            ck.load({"model": wide})
        assert e.value.key == "model/0.weight" and "[8, 4]" in str(e.value) and "[9, 4]" in str(e.value)
        with pytest.raises(StateMismatchError, match=r"^AMBER_EMISMATCH: t: dtype torch.float32"):
            ck.load({"t": torch.ones(3, dtype=torch.float64)})


def test_optimizer_over_other_parameters_is_an_error_naming_them(store):
    _saved(store)
    model = mlp()
    opt = torch.optim.Adam(model[0].parameters(), lr=1e-2)  # only the first layer
    with Checkpointer(store) as ck:
        with pytest.raises(StateMismatchError) as e:
            ck.load({"model": model, "optim": opt})
        assert e.value.key == "optim/param_groups" and "2.weight" in str(e.value)


def test_strict_false_skips_mismatches_and_restores_the_rest(store):
    model, _ = _saved(store)
    other = torch.nn.Sequential(*mlp(seed=4), torch.nn.Linear(2, 2))
    with torch.no_grad():
        other[2].weight.zero_()
        shaped = torch.full((4,), 7.0)
    before = other[3].weight.clone()
    with Checkpointer(store) as ck:
        ck.load({"model": other, "t": shaped}, strict=False)
    assert torch.equal(other[0].weight, model[0].weight) and torch.equal(other[2].weight, model[2].weight)
    assert torch.equal(other[3].weight, before)  # not in the checkpoint: untouched
    assert torch.equal(shaped, torch.full((4,), 7.0))  # other shape: untouched


def test_a_new_tensor_set_starts_a_full_checkpoint_then_deltas(store):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with Checkpointer(store, full_share=-1) as ck:
        ck.save(1, {"model": model, "optim": opt})  # no optimizer state yet
        for step in range(2, 5):
            train(model, opt, 1)
            ck.save(step, {"model": model, "optim": opt})
        ck.wait()
        assert [c.kind for c in ck.steps()] == ["full", "full", "delta", "delta"]
    # a new process (here: a new Checkpointer) continues with deltas
    with Checkpointer(store, full_share=-1) as ck:
        train(model, opt, 1)
        ck.save(5, {"model": model, "optim": opt})
        ck.wait()
        assert ck.steps()[-1].kind == "delta"


def test_a_readonly_checkpointer_loads_while_the_store_is_locked(store):
    model, opt = _saved(store)
    with Checkpointer(store) as writer_side:
        with Checkpointer(store, readonly=True) as ck:
            m2 = mlp(seed=1)
            assert ck.load({"model": m2}) == 1
            assert torch.equal(m2[0].weight, model[0].weight)
            with pytest.raises(Exception, match="read-only"):
                ck.save(2, {"model": m2})
        assert writer_side.latest() == 1


def test_a_damaged_latest_step_is_an_error_or_falls_back(store):
    import glob
    import os
    model = mlp()
    with Checkpointer(store, rng=False) as ck:
        for step in (1, 2, 3):
            with torch.no_grad():
                model[0].weight.add_(1.0)
            ck.save(step, {"model": model}, full=True)
            if step == 2:
                ck.wait()
                want = model[0].weight.clone()
    last = sorted(glob.glob(os.path.join(store, "*3*.amber")))[-1]
    with open(last, "r+b") as f:  # flip a bit in the middle of the file
        f.seek(os.path.getsize(last) // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    got = mlp(seed=1)
    before = got[0].weight.clone()
    with Checkpointer(store, rng=False) as ck:
        with pytest.raises(Exception) as e:
            ck.load({"model": got})
        assert getattr(e.value, "name", "") == "AMBER_ECORRUPT" and os.path.basename(last) in str(e.value)
        assert ck.load({"model": got}, fallback=True) == 2 and ck.skipped == 1
    assert torch.equal(got[0].weight, want) and not torch.equal(before, want)


def test_a_strict_mismatch_changes_nothing(store):
    model, opt = _saved(store)
    other = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    before = {k: v.clone() for k, v in other.state_dict().items()}
    with Checkpointer(store) as ck:
        with pytest.raises(StateMismatchError, match="model/2.weight"):
            ck.load({"model": other})  # the first layer matches, the last does not
    assert all(torch.equal(v, before[k]) for k, v in other.state_dict().items())


def test_the_interface_of_the_design_document(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "runs/" does not exist yet
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 2)
    train(model, optimizer, 2, scheduler)
    ck = Checkpointer("runs/x", policy="threshold:1e-6:1e-3", full_every=50)
    ck.save(2, {"model": model, "optim": optimizer, "sched": scheduler, "extra": {"epoch": 1}})
    ck.wait()
    step = ck.load({"model": model, "optim": optimizer, "sched": scheduler})
    ck.close()
    assert step == 2
    with Checkpointer("runs/x") as ck:
        assert ck.load({"model": model}, step=2) == 2
    assert ck.closed


class _Tied(torch.nn.Module):
    """An embedding tied to the output layer, as in GPT-2: two state_dict keys,
    one tensor."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb = torch.nn.Embedding(300, 64)
        self.out = torch.nn.Linear(64, 300, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x):
        return self.out(self.emb(x))


def test_tied_weights_restore_bit_exactly_from_dense_exact_deltas(store):
    # exact policy under Adam: dense changes, so deltas are XOR payloads, which a
    # double application would corrupt; the tied tensor must be read once
    model = _Tied()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    with Checkpointer(store, policy="exact", full_share=-1) as ck:
        for step in range(1, 5):
            x = torch.randint(0, 300, (32,), generator=g)
            loss = model(x).logsumexp(-1).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            ck.save(step, {"model": model, "optim": opt})
        ck.wait()
        assert [c.kind for c in ck.steps()] == ["full", "delta", "delta", "delta"]
        want = snapshot(model, opt)
    fresh = _Tied()
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-3)
    with Checkpointer(store, readonly=True) as ck:
        assert ck.load({"model": fresh, "optim": fopt}) == 4
    assert fresh.out.weight.data_ptr() == fresh.emb.weight.data_ptr()
    assert_same(want, snapshot(fresh, fopt))


def test_load_reads_a_module_and_an_optimizer_in_batches(store, monkeypatch):
    import amber
    model = mlp(hidden=32)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 2)
    with Checkpointer(store) as ck:
        ck.save(1, {"model": model, "optim": opt})
        ck.wait()
    calls = {"one": 0, "many": 0, "tensors": 0}
    one, many = amber.Reader.read_into, amber.Reader.read_many

    def count_one(self, *a):
        calls["one"] += 1
        return one(self, *a)

    def count_many(self, items):
        items = list(items)
        calls["many"] += 1
        calls["tensors"] += len(items)
        return many(self, items)

    monkeypatch.setattr(amber.Reader, "read_into", count_one)
    monkeypatch.setattr(amber.Reader, "read_many", count_many)
    fresh = mlp(seed=1, hidden=32)
    fopt = torch.optim.Adam(fresh.parameters(), lr=1e-2)
    with Checkpointer(store, readonly=True, rng=False) as ck:
        ck.load({"model": fresh, "optim": fopt})
    # 4 parameters in one call, their 2 x 4 moments + 4 step counters in another
    assert calls["many"] == 2 and calls["tensors"] == 16, calls
    assert calls["one"] == 0, calls
    assert_same(snapshot(model, opt), snapshot(fresh, fopt))


def test_keep_last_keeps_the_newest_steps_and_their_chain(store):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 1)  # the optimizer has its state: step 2 is a delta
    snaps = {}
    with Checkpointer(store, keep_last=2, full_every=3, full_share=-1) as ck:
        for step in range(1, 10):  # fulls at 1, 5, 9; deltas between
            train(model, opt, 1, seed=step)
            ck.save(step, {"model": model, "optim": opt})
            snaps[step] = snapshot(model, opt)
            ck.wait()
            kept = [c.step for c in ck.steps()]
            # the newest two and the chain back to the oldest one's full checkpoint
            oldest = max(1, step - 1)
            full = max(f for f in (1, 5, 9) if f <= oldest)
            assert kept == list(range(full, step + 1)), (step, kept)
        for step in (8, 9, 5):
            ck.load({"model": model, "optim": opt}, step=step)
            assert_same(snapshot(model, opt), snaps[step], f"step {step}")
    with pytest.raises(ValueError, match="keep_last"):
        Checkpointer(store, keep_last=0)


def test_a_failed_prune_warns_and_training_goes_on(store):
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    train(model, opt, 1)  # the optimizer has its state: step 2 is a delta
    with Checkpointer(store, keep_last=1, full_every=2, full_share=-1) as ck:
        ck.save(1, {"model": model, "optim": opt})
        ck.wait()
        # a directory under step 1's name cannot be removed (unlink: EISDIR)
        path = os.path.join(ck.path, "ckpt-%020d.amber" % 1)
        os.remove(path)
        os.mkdir(path)
        for step in range(2, 5):  # full at 4: steps 1..3 are no longer needed
            train(model, opt, 1)
            ck.save(step, {"model": model, "optim": opt})
        with pytest.warns(amber.PruneWarning, match="ckpt-00000000000000000001.amber"):
            ck.wait()
        steps = ck.steps()
        assert [c.step for c in steps] == [1, 4]  # 2 and 3 went; 1 could not
        assert steps[1].kind == "full"
        os.rmdir(path)
        train(model, opt, 1)
        ck.save(5, {"model": model, "optim": opt})
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ck.wait()
        assert [c.step for c in ck.steps()] == [4, 5]
