"""Promises users rely on without reading the fine print (issue 11):

- a committed checkpoint is the state at save(), or there is no checkpoint: a tensor
  changed in place after save() and before the fence fails the save (naming it),
  and state that a forward pass changes (BatchNorm's buffers) is captured at save();
- a failed load leaves the live state as it was: hostile metadata (a dtype that is
  not a dtype, broken RNG state, a missing tensor, a module entry of the wrong type)
  is refused before anything changes; damaged tensor data says the state is
  partially loaded, and fallback=True restores the newest intact step;
- store metadata cannot plant objects ({"$dtype": "load"} is an error).
The race tests run AMBER_TRIALS times (default 3; conftest.trials)."""
import ctypes
import glob
import json
import os

import pytest
import torch

import amber
from amber.torch import Checkpointer


def snapshot(*objs):
    out = []
    for o in objs:
        if isinstance(o, torch.nn.Module):
            out.append({k: v.clone() for k, v in o.state_dict().items()})
        elif isinstance(o, torch.optim.Optimizer):
            sd = o.state_dict()
            out.append(({i: {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in s.items()}
                         for i, s in sd["state"].items()}, json.dumps(sd["param_groups"], default=str)))
    return out


def same(a, b):
    if isinstance(a, torch.Tensor):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


def trained(seed=0, width=12):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, width), torch.nn.BatchNorm1d(width),
                                torch.nn.Linear(width, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 6)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    return model, opt


# ---- torn saves ----------------------------------------------------------------

def test_an_in_place_change_before_the_fence_fails_the_save_and_names_the_tensor(store, trials):
    n = 16 << 20  # 16M elements, as in the report: the scan takes long enough to race
    for trial in trials:
        p = torch.nn.Parameter(torch.zeros(n))
        opt = torch.optim.SGD([p], lr=0.1)
        path = f"{store}-{trial}"
        with Checkpointer(path, rng=False) as ck:
            ck.save(1, {"p": p, "optim": opt})
            ck.wait()
            with torch.no_grad():
                p.fill_(1.0)
            ck.save(2, {"p": p, "optim": opt})
            with torch.no_grad():
                p.add_(1.0)  # no optimizer step, so no automatic fence: the scan may see it
            if os.environ.get("AMBER_DEVICE_PATH") == "1" and \
                    os.environ.get("AMBER_DEVICE_ASYNC") != "1":
                # the device path selects before save() returns (unless it selects
                # on a thread): the change is not in step 2, which commits the
                # state at save()
                ck.wait()
                q = torch.empty(n)
                assert ck.load({"p": q}, strict=False) == 2
                assert torch.equal(q, torch.full((n,), 1.0))
                continue
            with pytest.raises(amber.AmberError) as e:
                ck.wait()
            assert e.value.name == "AMBER_ECHANGED" and "'p'" in str(e.value) and "fence()" in str(e.value)
            assert ck.latest() == 1  # nothing of step 2 is visible
            ck.save(3, {"p": p, "optim": opt})  # the next save is correct again
            ck.wait()
            q = torch.empty(n)
            assert ck.load({"p": q}, strict=False) == 3
            assert torch.equal(q, torch.full((n,), 2.0))


def test_a_change_after_the_fence_is_fine_and_a_change_by_the_optimizer_is_fenced(store):
    model, opt = trained()
    with Checkpointer(store, rng=False) as ck:
        for step in range(1, 4):
            want = {k: v.clone() for k, v in model.state_dict().items()}
            ck.save(step, {"model": model, "optim": opt})
            model(torch.randn(8, 6)).pow(2).mean().backward()
            opt.step()  # fences first
            opt.zero_grad()
            with torch.no_grad():
                model[0].weight.mul_(0.5)  # after the fence: not in this checkpoint
            ck.wait()
            got, _ = trained(seed=9)
            ck.load({"model": got}, step=step, strict=False)
            for k, v in want.items():
                assert torch.equal(got.state_dict()[k], v), (step, k)


def test_buffers_changed_by_the_next_forward_pass_are_captured_at_save(store):
    model, opt = trained()
    model.train()
    with Checkpointer(store, rng=False) as ck:
        wants = {}
        for step in range(1, 21):
            wants[step] = {k: v.clone() for k, v in model.state_dict().items() if "1." in k}
            ck.save(step, {"model": model, "optim": opt})
            loss = model(torch.randn(8, 6)).pow(2).mean()  # updates BatchNorm's buffers in place
            loss.backward()
            opt.step()
            opt.zero_grad()
        ck.wait()
        for step, want in wants.items():
            got, _ = trained(seed=3)
            ck.load({"model": got}, step=step, strict=False)
            for k, v in want.items():
                assert torch.equal(got.state_dict()[k], v), (step, k)


# ---- failed loads touch nothing ------------------------------------------------

def rewrite(store, edit_meta, drop=()):
    """Writes the store's next step with the latest step's tensors (minus `drop`)
    and its metadata passed through edit_meta."""
    with amber.Store(store) as st:
        with st.reader() as r:
            latest = r.step
            meta = json.loads(r.meta())
            tensors = [(t, r.read(t.index)) for t in r.tensors() if t.name not in drop]
        w = st.writer()
        try:
            for t, buf in tensors:
                addr = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf)) if len(buf) else 0
                w.add(t.name, t.dtype, t.shape, addr)
            edit_meta(meta)
            w.set_meta(json.dumps(meta))
            w.save(latest + 1, full=True)
        finally:
            w.close()


def hostile_cases():
    def group_dtype(name):
        def f(m):
            m["entries"]["optim"]["param_groups"][0]["lr"] = {"$dtype": name}
        return f

    def broken_rng(m):
        m["rng"]["python"] = {"version": "three", "gauss_next": []}

    def module_int(m):
        k = next(iter(m["entries"]["model"]["state"]))
        m["entries"]["model"]["state"][k] = 5

    def module_state_int(m):
        m["entries"]["model"]["state"] = 5

    def np_object(m):
        m["entries"]["extra"]["value"]["arr"] = {"$np": {"dtype": "|O", "shape": [1], "data": [1]}}

    return {
        "param_groups holds a $dtype that is not an attribute": (group_dtype("no_such_attr"), ()),
        "param_groups holds a $dtype naming torch.load": (group_dtype("load"), ()),
        "broken rng metadata": (broken_rng, ()),
        "a missing rng/torch tensor": (lambda m: None, ("rng/torch",)),
        "a module entry whose value is an int": (module_int, ()),
        "a module entry whose state is an int": (module_state_int, ()),
        "a numpy array of objects": (np_object, ()),
    }


@pytest.mark.parametrize("case", list(hostile_cases()))
def test_hostile_metadata_is_refused_before_anything_changes(store, case):
    edit, drop = hostile_cases()[case]
    model, opt = trained()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    import numpy as np
    with Checkpointer(store) as ck:
        ck.save(1, {"model": model, "optim": opt, "sched": sched,
                    "extra": {"pos": 3, "arr": np.arange(3)}})
    rewrite(store, edit, drop)
    model2, opt2 = trained(seed=7)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=1)
    extra = {"pos": 0}
    rng_before = torch.get_rng_state()
    before = snapshot(model2, opt2)
    sched_before = sched2.state_dict()
    with Checkpointer(store) as ck:
        with pytest.raises(amber.AmberError) as e:
            ck.load({"model": model2, "optim": opt2, "sched": sched2, "extra": extra})
    assert e.value.name in ("AMBER_EFORMAT", "AMBER_ECORRUPT"), e.value
    assert same(snapshot(model2, opt2), before)
    assert sched2.state_dict() == sched_before and extra == {"pos": 0}
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert opt2.param_groups[0]["lr"] == 1e-2  # nothing planted


def test_damaged_tensor_data_says_the_state_is_partially_loaded_and_fallback_restores(store):
    model, opt = trained(width=4096)  # tensor data is most of the file
    with Checkpointer(store, rng=False) as ck:
        ck.save(1, {"model": model, "optim": opt}, full=True)
        ck.wait()
        want = snapshot(model, opt)
        model(torch.randn(8, 6)).pow(2).mean().backward()
        opt.step()
        ck.save(2, {"model": model, "optim": opt}, full=True)
    last = sorted(glob.glob(os.path.join(store, "ckpt-*2.amber")))[-1]
    with open(last, "r+b") as f:  # a byte of tensor data, far from header and index
        f.seek(os.path.getsize(last) // 3)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x40]))
    model2, opt2 = trained(seed=5, width=4096)
    with Checkpointer(store, rng=False) as ck:
        with pytest.raises(amber.AmberError) as e:
            ck.load({"model": model2, "optim": opt2})
        assert e.value.name == "AMBER_ECORRUPT" and "partially loaded" in str(e.value)
        assert ck.load({"model": model2, "optim": opt2}, fallback=True) == 1
    assert same(snapshot(model2, opt2), want)
