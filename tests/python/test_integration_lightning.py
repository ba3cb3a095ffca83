"""PyTorch Lightning through amber (amber.integrations.lightning), with the real
Lightning (pinned in requirements-dev.txt): a run SIGKILLed twice and resumed with
fit(ckpt_path="last") ends bit-identical to an uninterrupted run under "exact"; a
lossy preset restores within its bound; DDP on 2 CPU processes (gloo) saves and
resumes through amber, every rank restoring exactly the saved state; Lightning
writes no torch.save file; the checkpoint dict round-trips exactly; an interrupted
save falls back to the step before it; files removed as ModelCheckpoint removes them
take their steps with them. (An s3:// store: tests/python/test_s3.py.)

Every subprocess runs in its own session, bounded by a timeout; its whole process
group (DDP's second rank included) is killed when it ends or times out."""
import collections
import json
import math
import os
import pathlib
import random
import signal
import subprocess
import warnings

import pytest
import torch

import amber
from amber.integrations.lightning import AmberCheckpointIO, export, load
from amber.torch import LOSSY
from conftest import HERE, PYTHON, ROOT, SEED, rules_bound

WORKER = os.path.join(HERE, "pl_worker.py")


def run(*args, timeout=120, check=True):
    """Runs `args` under this Python in a new session; returns (returncode, stdout,
    stderr). The session is killed afterwards."""
    p = subprocess.Popen([PYTHON, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"{args} timed out after {timeout} s:\n{err[-3000:]}")
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # a rank left behind
        except ProcessLookupError:
            pass
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}:\n{err[-3000:]}")
    return p.returncode, out, err


def worker(d, *args, **kw):
    """pl_worker.py: (returncode, its JSON line or None, stderr)."""
    rc, out, err = run(WORKER, str(d), *args, **kw)
    lines = out.strip().splitlines()
    return rc, (json.loads(lines[-1]) if lines and lines[-1].startswith("{") else None), err


def assert_only_pointers(d):
    """Lightning's own checkpoint files (torch.save: a zip or a pickle) are not
    written: each .ckpt is an amber pointer of a few hundred bytes, and nothing under
    `d` is a torch.save file."""
    ckpts = sorted(p for p in os.listdir(d) if p.endswith(".ckpt"))
    assert ckpts and "last.ckpt" in ckpts, ckpts
    for name in ckpts:
        path = os.path.join(d, name)
        assert os.path.getsize(path) < 1024, name
        with open(path) as f:
            assert json.load(f)["format"] == "amber-lightning", name
    for root, _, files in os.walk(d):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                head = f.read(4)
            assert head != b"PK\x03\x04" and head[:1] != b"\x80", os.path.join(root, name)


def store_steps(d):
    with amber.Store(os.path.join(d, "amber"), readonly=True, create=False) as st:
        return st.list()


# ---- whole runs in subprocesses ---------------------------------------------------------

def test_sigkilled_run_resumes_from_last_bit_identical_under_exact(tmp_path):
    """Killed twice (at a random step right after a save: the save may still be in
    flight), resumed each time with ckpt_path="last": the losses of every step run
    after a resume and the final model, optimizer and scheduler state equal the
    uninterrupted run's; the callback state, loader position and RNG came back."""
    rng = random.Random(SEED)
    k1, k2 = 2 * rng.randint(1, 3), 2 * rng.randint(4, 5)  # saves every 2 steps; 12 steps
    print(f"AMBER_SEED={SEED}: kills after steps {k1} and {k2}")
    _, ref, _ = worker(tmp_path / "ref", "--steps", "12")
    d = tmp_path / "run"
    losses = {}
    for i, kill in enumerate((k1, k2)):
        rc, _, err = worker(d, "--steps", "12", "--kill-at", str(kill),
                            *(["--resume"] if i else []), check=False)
        assert rc == -signal.SIGKILL, err[-3000:]
    _, got, err = worker(d, "--steps", "12", "--resume")
    # last.ckpt of step k2, or, when the kill came before amber committed it, its
    # fallback: the top-k file of the same step, saved (and committed) just before
    assert got["resumed_from"] == k2, got["resumed_from"]
    print("last.ckpt's save was interrupted: loaded its fallback" if "did not complete" in err
          else "last.ckpt's save was committed before the kill")
    losses.update(got["losses"])
    for step, loss in losses.items():
        assert loss == ref["losses"][step], f"step {step}: {loss} != {ref['losses'][step]}"
    assert got["global_step"] == ref["global_step"] == 12
    assert got["epoch"] == ref["epoch"]
    assert got["seen"] == 12  # Counter's state went through the checkpoint
    assert got["digest"] == ref["digest"]
    assert_only_pointers(d)
    # retention: old steps went with the files Lightning removed; every file loads
    steps = store_steps(d)
    assert len(steps) < 12 and {s.kind for s in steps} >= {"full", "delta"}, steps
    for name in got["files"]:
        if name.endswith(".ckpt"):
            ck = load(d / name)
            assert ck["global_step"] == json.loads((d / name).read_text())["global_step"]


def test_lossy_preset_restores_within_its_bound(tmp_path):
    """"lossy": the state restored after a SIGKILL, from a file named by its path,
    differs from the live state saved at that step by at most the preset's bounds, and
    by something (it is lossy). Lightning hands over a dict of tensors, no optimizer
    objects, so no tensor has a unit (a learning rate): the weight rule "1u" keeps the
    weights exact; first and second moments are lossy (budget CAP, relative bound);
    step counters exact."""
    d, dump = tmp_path / "run", tmp_path / "dump"
    dump.mkdir()
    args = ("--policy", "lossy", "--every", "1", "--dump", str(dump), "--lr", "1e-4")
    rc, _, err = worker(d, "--steps", "8", "--kill-at", "6", *args, check=False)
    assert rc == -signal.SIGKILL, err[-3000:]
    # fit(ckpt_path=PATH) of the top-k file of step 6 (committed: last.ckpt's save,
    # which the kill may have cut short, began after it)
    top = [p for p in d.glob("epoch=*.ckpt") if json.loads(p.read_text())["global_step"] == 6]
    assert len(top) == 1, sorted(os.listdir(d))
    _, got, _ = worker(d, "--steps", "8", "--ckpt", str(top[0]), *args)
    start = got["resumed_from"]
    assert start == 6 and got["global_step"] == 8
    saved = torch.load(dump / f"step{start}.pt")
    restored = torch.load(dump / "resumed.pt")
    assert saved.keys() == restored.keys()
    lossy = 0
    for name, live in saved.items():
        back = restored[name]
        err = (back.double() - live.double()).abs()
        if name.endswith("/step") or not live.is_floating_point():
            bound = torch.zeros_like(err)
        else:
            abs_, rel = rules_bound(LOSSY, name, unit=0.0)
            bound = abs_ + rel * back.double().abs()
        assert (err <= bound * (1 + 1e-6)).all(), f"{name}: max error {err.max().item()}"
        lossy += int((err > 0).sum())
    assert lossy > 0  # the deltas dropped changes under the bounds
    assert "delta" in {s.kind for s in store_steps(d)}


def test_ddp_two_cpu_processes_save_and_resume_through_amber(tmp_path):
    """strategy="ddp", 2 CPU processes (gloo): rank 0 saves into amber; after a SIGKILL
    of both, each rank restores exactly the state saved (the model, its BatchNorm
    buffers as rank 0 had them, the optimizer) and the run completes."""
    d, dump = tmp_path / "run", tmp_path / "dump"
    dump.mkdir()
    args = ("--steps", "8", "--ddp", "--dump", str(dump))
    rc, _, err = worker(d, *args, "--kill-at", "5", timeout=180, check=False)
    assert rc == -signal.SIGKILL, err[-3000:]
    _, got, _ = worker(d, *args, "--resume", timeout=180)
    assert got["resumed_from"] == 4 and got["global_step"] == 8 and got["seen"] == 8
    saved = torch.load(dump / "step4.pt")
    for name in ("resumed.pt", "resumed-rank1.pt"):
        restored = torch.load(dump / name)
        assert restored.keys() == saved.keys(), name
        for k, v in saved.items():
            assert torch.equal(restored[k], v), (name, k)
    assert_only_pointers(d)


def test_example_runs_as_written(tmp_path):
    d = tmp_path / "ex"
    _, out, _ = run(os.path.join(ROOT, "examples", "lightning_train.py"), "--dir", str(d),
                    "--steps", "4", "--every", "2")
    assert "resumed from global step 4" in out and "trained to global step 8" in out, out
    assert_only_pointers(d)


# ---- the plug-in in this process ----------------------------------------------------------

def odd_checkpoint():
    """A checkpoint dict with what Lightning and users put there."""
    return {
        "epoch": 3, "global_step": 41, "pytorch-lightning_version": "2.6.6",
        "state_dict": collections.OrderedDict(
            w=torch.randn(300, 7), b=torch.randn(7).to(torch.bfloat16),
            n=torch.tensor(5, dtype=torch.int64)),
        "optimizer_states": [{"state": {0: {"step": torch.tensor(41.0), "m": torch.randn(300, 7)}},
                              "param_groups": [{"lr": 0.1, "betas": (0.9, 0.95), "params": [0]}]}],
        "lr_schedulers": [{"last_epoch": 41, "_last_lr": [0.1 / 3]}],
        "callbacks": {"ModelCheckpoint{'monitor': 'loss'}": {
            "best_model_score": torch.tensor(0.123456789), "best_k_models": {
                "/x/epoch=1.ckpt": torch.tensor(0.5, dtype=torch.float64)},
            "mask": torch.tensor([True, False]), "none": None}},
        "hyper_parameters": {"lr": 1e-3, "nan": float("nan"), "inf": -math.inf, "neg0": -0.0,
                             "big": 2 ** 70, "dtype": torch.float16, "pair": (1, "a"),
                             "$odd": {1: "int key", (2, 3): "tuple key"}},
        "loops": {"fit_loop": {"state_dict": {"combined_loader": [{"pos": 3}]}}},
    }


def same(a, b, path=""):
    """a == b, bit for bit, with the same types (a dict subclass may come back a dict)."""
    assert type(a) is type(b) or isinstance(a, dict) and type(b) is dict, (path, type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{path}/{i}")
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b), path
    else:
        assert a == b and repr(a) == repr(b), (path, a, b)


def test_checkpoint_dict_round_trips_exactly(tmp_path):
    ck = odd_checkpoint()
    io = AmberCheckpointIO()
    io.save_checkpoint(ck, tmp_path / "a.ckpt")
    io.teardown()
    same(ck, io.load_checkpoint(tmp_path / "a.ckpt"))
    same(ck, load(tmp_path / "a.ckpt"))
    export(tmp_path / "a.ckpt", tmp_path / "plain.pt")  # a torch.save file, for load_from_checkpoint
    same(ck, torch.load(tmp_path / "plain.pt", weights_only=False))
    io.teardown()


def test_optimizer_step_counters_stay_exact_under_a_lossy_policy(tmp_path):
    """A policy that would drop every change below 10 keeps the weights within 10
    but Adam's step counters exact (their own rule comes after the user's)."""
    io = AmberCheckpointIO(policy="threshold:10")
    ck = odd_checkpoint()
    io.save_checkpoint(ck, tmp_path / "a.ckpt")
    st = ck["optimizer_states"][0]["state"][0]
    st["step"] += 1
    st["m"] += 0.5
    io.save_checkpoint(ck, tmp_path / "b.ckpt")
    io.teardown()
    got = io.load_checkpoint(tmp_path / "b.ckpt")["optimizer_states"][0]["state"][0]
    assert got["step"].item() == 42.0
    assert not torch.equal(got["m"], st["m"]) and (got["m"] - st["m"]).abs().max() <= 10
    io.teardown()


def test_a_value_that_is_not_plain_data_is_refused_before_anything_is_written(tmp_path):
    ck = odd_checkpoint()
    ck["hyper_parameters"]["root"] = pathlib.Path("/data")
    io = AmberCheckpointIO()
    with pytest.raises(TypeError, match="hyper_parameters/root.*PosixPath"):
        io.save_checkpoint(ck, tmp_path / "a.ckpt")
    assert not (tmp_path / "a.ckpt").exists()
    io.teardown()
    assert store_steps(tmp_path) == []


def test_an_interrupted_save_loads_the_step_before_it(tmp_path):
    """A pointer whose step never committed (the process died first; here made by
    hand) loads its fallback, with a warning; one without a fallback, or whose token
    names another run's step, is a clear error."""
    io = AmberCheckpointIO()
    first, second = odd_checkpoint(), odd_checkpoint()
    second["global_step"] = 42
    io.save_checkpoint(first, tmp_path / "a.ckpt")
    io.save_checkpoint(second, tmp_path / "b.ckpt")
    io.teardown()
    b = json.loads((tmp_path / "b.ckpt").read_text())
    assert b["step"] == 2 and b["fallback"]["step"] == 1
    dangling = dict(b, step=7)
    (tmp_path / "c.ckpt").write_text(json.dumps(dangling))
    with pytest.warns(UserWarning, match="did not complete.*step 1"):
        assert io.load_checkpoint(tmp_path / "c.ckpt")["global_step"] == 41
    (tmp_path / "d.ckpt").write_text(json.dumps(dict(b, token="0" * 16, fallback=None)))
    with pytest.raises(amber.AmberError, match="not the checkpoint saved as this file") as e:
        io.load_checkpoint(tmp_path / "d.ckpt")
    assert e.value.code == amber.ENOENT
    (tmp_path / "e.ckpt").write_text('{"format": "amber-lightning"}')
    with pytest.raises(amber.AmberError, match="not an amber-lightning pointer"):
        io.load_checkpoint(tmp_path / "e.ckpt")
    io.teardown()


def kept_beyond_chains(infos, oldest):
    """The steps kept from `oldest` on; every older step kept must be a parent (along
    the delta chain) of one of them, and the oldest's chain must be whole."""
    parent = {i.step: i.parent for i in infos}
    needed, s = set(), oldest
    while s is not None:
        needed.add(s)
        s = parent[s]
    assert all(s >= oldest or s in needed for s in parent), (oldest, infos)
    return sorted(s for s in parent if s >= oldest)


def test_links_removal_and_pruning_as_model_checkpoint_does_them(tmp_path):
    """What ModelCheckpoint does with files: save_last="link" makes last.ckpt a
    symlink to the newest top-k file; top-k removes old files. Links load; a removed
    file's step is pruned at the next save unless a remaining file needs it."""
    io = AmberCheckpointIO()
    for g in range(1, 5):
        ck = odd_checkpoint()
        ck["global_step"] = g
        io.save_checkpoint(ck, tmp_path / f"step={g}.ckpt")
        if (tmp_path / "last.ckpt").is_symlink():
            os.remove(tmp_path / "last.ckpt")
        os.symlink(f"step={g}.ckpt", tmp_path / "last.ckpt")
        if g > 2:
            io.remove_checkpoint(tmp_path / f"step={g - 2}.ckpt")  # top-2
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 4
    assert kept_beyond_chains(store_steps(tmp_path), oldest=2) == [2, 3, 4]  # 1 pruned
    io.teardown()
    infos = store_steps(tmp_path)
    assert kept_beyond_chains(infos, oldest=3) == [3, 4] and len(infos) < 4  # 2 at teardown
    assert sorted(os.listdir(tmp_path)) == ["amber", "last.ckpt", "step=3.ckpt", "step=4.ckpt"]
    # pointer files are local; the store may be an object store (test_s3.py runs one)
    with pytest.raises(ValueError, match="local.*s3:// store"):
        io.save_checkpoint(odd_checkpoint(), "s3://bucket/x.ckpt")


def test_a_torch_save_checkpoint_still_loads(tmp_path):
    """A .ckpt that Lightning wrote before the switch to amber loads through
    Lightning's TorchCheckpointIO."""
    ck = {"state_dict": {"w": torch.randn(3)}, "global_step": 5}
    torch.save(ck, tmp_path / "old.ckpt")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = AmberCheckpointIO().load_checkpoint(tmp_path / "old.ckpt")
    assert torch.equal(got["state_dict"]["w"], ck["state_dict"]["w"]) and got["global_step"] == 5
