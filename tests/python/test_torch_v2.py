"""amber.torch on PyTorch 2.x: every dtype torch and amber share round-trips (bf16,
f16, float8), objects of DCP's Stateful protocol are saved like anything with
state_dict(), optimizer state is keyed by FQN exactly as
torch.distributed.checkpoint.state_dict names it, a torch.compile'd module and the
plain one load each other's checkpoints, a torch older than supported is refused
at import, and stores written by amber.torch before the FQN change still load."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict
from torch.distributed.checkpoint.stateful import Stateful

import amber
from amber.torch import Checkpointer

GOLDEN = os.path.join(os.path.dirname(__file__), "..", "golden", "torch-v1")


def model_and_adamw(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, opt, n=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()


def dtypes():
    out = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.float8_e4m3fn,
           torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
           torch.bool, torch.uint16, torch.uint32, torch.uint64]
    return out


def random_tensor(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g) * 4
        if dtype.itemsize == 1:  # float8: every bit pattern but NaN is a value
            return x.to(dtype)
        return x.to(dtype)
    info = torch.iinfo(dtype)
    lo, hi = max(info.min, -2**62), min(info.max, 2**62)
    return torch.randint(lo, hi, shape, generator=g, dtype=torch.int64).to(dtype) \
        if dtype not in (torch.uint32, torch.uint64) else \
        torch.randint(0, 2**31, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("policy", ["exact", "threshold:0.5"])
def test_every_shared_dtype_round_trips_bit_exactly(store, policy):
    ts = {str(dt).replace("torch.", ""): random_tensor(dt, (7, 33), i) for i, dt in enumerate(dtypes())}
    with Checkpointer(store, rng=False, policy=policy) as ck:
        ck.save(1, dict(ts))
        ck.wait()
        for t in ts.values():  # a second step: a delta of every dtype
            if t.dtype == torch.bool:
                t[0] = ~t[0]
            else:
                t[0] = t[1]
        ck.save(2, dict(ts))
        ck.wait()
        got = {k: torch.zeros_like(v) for k, v in ts.items()}
        assert ck.load(got) == 2
    for k, t in ts.items():
        assert got[k].dtype == t.dtype
        if policy == "exact" or not t.dtype.is_floating_point:  # integers, bools: always exact
            assert torch.equal(got[k].view(torch.uint8), t.view(torch.uint8)), k
        else:
            err = (got[k].double() - t.double()).abs().max().item()
            assert err <= 0.5, (k, err)


def test_stateful_objects_are_saved_and_loaded(store):
    class Loader:
        """A data loader position, as torchdata's stateful loaders keep it."""

        def __init__(self):
            self.pos, self.epoch = 0, 0

        def state_dict(self):
            return {"pos": self.pos, "epoch": self.epoch, "order": torch.arange(5)}

        def load_state_dict(self, sd):
            self.pos, self.epoch = sd["pos"], sd["epoch"]
            assert torch.equal(sd["order"], torch.arange(5))

    src = Loader()
    assert isinstance(src, Stateful)
    src.pos, src.epoch = 17, 3
    with Checkpointer(store, rng=False) as ck:
        ck.save(1, {"loader": src})
        dst = Loader()
        ck.load({"loader": dst})
    assert (dst.pos, dst.epoch) == (17, 3)


def test_optimizer_state_is_keyed_by_the_fqns_of_get_optimizer_state_dict(store):
    model, opt = model_and_adamw()
    step(model, opt, 2)
    want = get_optimizer_state_dict(model, opt)
    with Checkpointer(store, rng=False) as ck:
        ck.save(1, {"model": model, "optim": opt})
    with amber.Store(store, readonly=True) as st, st.reader() as r:
        names = {t.name for t in r.tensors()}
        meta = json.loads(r.meta())
    for fqn, s in want["state"].items():
        for k in s:
            assert f"optim/{fqn}/{k}" in names
    assert meta["entries"]["optim"]["param_groups"][0]["params"] == want["param_groups"][0]["params"]


def test_a_compiled_and_a_plain_module_load_each_others_checkpoints(tmp_path):
    model, opt = model_and_adamw()
    compiled = torch.compile(model)  # shares the parameters; never run, so nothing compiles
    assert any("_orig_mod" in k for k in compiled.state_dict())
    step(model, opt, 2)
    for i, (saved, loaded) in enumerate([(compiled, "plain"), (model, "compiled")]):
        store = str(tmp_path / f"s{i}")
        with Checkpointer(store, rng=False) as ck:
            ck.save(1, {"model": saved, "optim": opt})
        m2, o2 = model_and_adamw(seed=1)
        target = m2 if loaded == "plain" else torch.compile(m2)
        with Checkpointer(store, rng=False) as ck:
            assert ck.load({"model": target, "optim": o2}) == 1
        for (k, a), b in zip(model.state_dict().items(), m2.state_dict().values()):
            assert torch.equal(a, b), k
        for p, q in zip(model.parameters(), m2.parameters()):
            for k in opt.state[p]:
                assert torch.equal(opt.state[p][k], o2.state[q][k]), k


def test_a_store_of_the_first_amber_torch_still_loads():
    expected = load_file(os.path.join(GOLDEN, "expected.safetensors"))
    meta = json.load(open(os.path.join(GOLDEN, "expected.json")))
    for stp in (1, 2, 3):
        torch.manual_seed(5)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.ReLU(),
                                    torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        state = {"model": model, "optim": opt, "sched": sched, "extra": {}}
        with Checkpointer(os.path.join(GOLDEN, "store"), readonly=True, rng=False) as ck:
            assert ck.load(state, step=stp) == stp
        for k, v in model.state_dict().items():
            assert torch.equal(v, expected[f"{stp}/model/{k}"]), k
        for name, p in model.named_parameters():
            for k, v in opt.state[p].items():
                assert torch.equal(v.reshape(-1), expected[f"{stp}/optim/{name}/{k}"].reshape(-1)), k
        m = meta[str(stp)]
        assert opt.param_groups[0]["lr"] == m["lr"] and sched.last_epoch == m["sched"]
        assert state["extra"] == {"data_pos": m["data_pos"]}


def test_a_torch_older_than_supported_is_refused_at_import():
    code = ("import torch; torch.__version__ = '2.10.1+cpu'\n"
            "try:\n    import amber.torch\nexcept ImportError as e:\n    print('refused:', e)\n")
    env = dict(os.environ)
    pkg = os.path.dirname(os.path.dirname(amber.__file__))  # where this amber is imported from
    env["PYTHONPATH"] = pkg + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env=env)
    assert "refused:" in p.stdout and "2.11" in p.stdout and "2.10.1" in p.stdout, p.stdout + p.stderr


@pytest.mark.parametrize("policy", ["exact", "lossy"])
def test_a_load_of_the_latest_step_seeds_the_next_delta(tmp_path, policy):
    """After load() of the latest step the writer's reference comes from what the
    load read: the first save is a delta, and restoring it gives the same state as a
    writer that read its reference back from the store (a run that never resumed)."""
    model, opt = model_and_adamw()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    a, b = str(tmp_path / "resumed"), str(tmp_path / "straight")
    for path in (a, b):
        with Checkpointer(path, policy=policy, rng=False) as ck:
            m, o = model_and_adamw()
            s = torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.9)
            for i in range(1, 4):
                step(m, o, seed=i)
                s.step()
                ck.save(i, {"model": m, "optim": o, "sched": s})
    m2, o2 = model_and_adamw(seed=3)
    s2 = torch.optim.lr_scheduler.StepLR(o2, step_size=1, gamma=0.9)
    with Checkpointer(a, policy=policy, rng=False) as ck:
        assert ck.load({"model": m2, "optim": o2, "sched": s2}) == 3 and ck.seeded
        step(m2, o2, seed=4)
        s2.step()
        ck.save(4, {"model": m2, "optim": o2, "sched": s2})
        ck.wait()
        assert ck.steps()[-1].kind == "delta"
    with Checkpointer(b, policy=policy, rng=False) as ck:  # the same step without a resume
        step(m, o, seed=4)
        s.step()
        ck.save(4, {"model": m, "optim": o, "sched": s}, full=False)
    for path in (a, b):
        with amber.Store(path, readonly=True) as st, st.reader(4) as r:
            got = {t.name: bytes(r.read(t.index)) for t in r.tensors()}
        if path == a:
            first = got
    assert got == first
    del model, opt, sched


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(11, 4)
        self.head = torch.nn.Linear(4, 11, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2's LM head
        self.norm = torch.nn.BatchNorm1d(4)
        self.register_buffer("scratch", torch.zeros(3), persistent=False)


@pytest.mark.parametrize("kind", ["plain", "tied", "compiled", "nested_compiled"])
def test_the_fast_state_dict_of_a_plain_module_is_what_dcp_state_dict_gives(kind):
    """save() names plain modules' tensors from state_dict() instead of
    get_model_state_dict/get_optimizer_state_dict (much cheaper); both must agree on
    names, tensors (the same memory) and optimizer state."""
    from torch.distributed.checkpoint import state_dict as dsd
    from amber.torch._naming import Names as _Names, model_state as _model_state, \
        optimizer_state as _optimizer_state
    torch.manual_seed(0)
    mod = _Tied() if kind == "tied" else torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 3))
    if kind == "compiled":
        mod = torch.compile(mod)
    if kind == "nested_compiled":
        mod = torch.nn.ModuleDict({"a": torch.compile(mod), "b": torch.nn.Linear(2, 2)})
    opt = torch.optim.AdamW(mod.parameters(), lr=1e-2)
    for p in mod.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    names = _Names({"m": mod, "o": opt})
    # a compiled submodule takes the slow path (DCP orders its tensors differently)
    assert names.plain[id(mod)] == (kind != "nested_compiled")
    fast, slow = _model_state(mod, names.plain[id(mod)]), dsd.get_model_state_dict(mod)
    assert list(fast) == list(slow)
    for k in slow:
        assert fast[k].data_ptr() == slow[k].data_ptr() and fast[k].shape == slow[k].shape, k
    state, groups = _optimizer_state(opt, names)
    osd = dsd.get_optimizer_state_dict(mod, opt)
    assert list(state) == list(osd["state"])
    for fqn, s in osd["state"].items():
        assert list(state[fqn]) == list(s)
        for k, v in s.items():
            assert torch.equal(state[fqn][k], v), (fqn, k)
    assert [g["params"] for g in groups] == [g["params"] for g in osd["param_groups"]]
    assert [{k: v for k, v in g.items() if k != "params"} for g in groups] == \
        [{k: v for k, v in g.items() if k != "params"} for g in osd["param_groups"]]
