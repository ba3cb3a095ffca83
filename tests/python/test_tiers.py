"""Storage tiers in one process (Checkpointer(path, memory=DIR)): every save goes to
the memory tier, the durable tier gets each committed step in the background, a
load restores from the fastest tier holding the newest intact step.

Each run is a real training process (train_worker.py: dropout, data noise, AdamW,
a scheduler; policy exact, so a restored state is the saved one bit for bit),
SIGKILLed from outside at random moments where the test says so; the memory tier is
a directory under /dev/shm (a memory file system, as in production), removed after
each test."""
import os
import random
import shutil
import signal
import subprocess
import time
import uuid

import pytest
import torch

import amber
from amber.torch import Checkpointer
from conftest import HERE, PYTHON, run_python, step_log
from test_dist_checkpointer import cli

WORKER = os.path.join(HERE, "train_worker.py")


@pytest.fixture
def memory():
    """A fresh memory tier directory under /dev/shm (or the temp dir without it)."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    d = os.path.join(base or "/tmp", f"amber-test-{uuid.uuid4().hex[:12]}")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def worker(store, memory, *args, check=True, timeout=120):
    p = run_python(WORKER, store, "--memory", memory, *args, check=check, timeout=timeout)
    import json
    return p, (json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else None)


def load_only(store, memory):
    return worker(store, memory, "--load-only", "-1")[1]


def durable_only(store):
    """The durable tier's latest step and its digest, loaded without a memory tier."""
    return run_json(WORKER, store, "--load-only", "-1")


def run_json(*args):
    import json
    p = run_python(*args)
    return json.loads(p.stdout.strip().splitlines()[-1])


def steps_of(store):
    with amber.Store(store, readonly=True, create=False) as st:
        return [i.step for i in st.list()]


def test_every_step_reaches_the_durable_tier_and_restores_from_memory(tmp_path, memory):
    store = str(tmp_path / "run")
    _, out = worker(store, memory, "--steps", "12", "--log", str(tmp_path / "log"))
    saved = step_log(str(tmp_path / "log"))
    assert sorted(saved) == list(range(1, 13))
    # close() waited for the drain: the durable tier holds every step, in order
    assert steps_of(store) == list(range(1, 13))
    assert cli("verify", store).returncode == 0
    # the memory tier kept only the chain its newest step needs
    mem_steps = steps_of(memory)
    assert mem_steps[-1] == 12 and len(mem_steps) < 12, mem_steps
    # a restart restores from the memory tier, bit-identical to what step 12 saved
    got = load_only(store, memory)
    assert got["served_by"] == "memory" and got["start"] == 12
    assert got["digests"]["12"] == saved[12]
    # from the image of step 12 alone (one file): with the chain's full checkpoint moved
    # away the memory tier still serves it, bit-identical; the files verify as ever
    with open(os.path.join(memory, "image.amber"), "rb") as f:
        assert int.from_bytes(f.read(32)[24:32], "little") == 12
    assert len(mem_steps) > 1, mem_steps  # 12 is a delta: else the image proves nothing
    full = os.path.join(memory, f"ckpt-{mem_steps[0]:020d}.amber")
    os.rename(full, full + ".away")
    try:
        got = load_only(store, memory)
        assert got["served_by"] == "memory" and got["digests"]["12"] == saved[12]
    finally:
        os.rename(full + ".away", full)
    assert cli("verify", memory).returncode == 0
    # memory lost (a rebooted node): the durable tier serves the same step
    shutil.rmtree(memory)
    got = load_only(store, memory)
    assert got["served_by"] == "durable" and got["start"] == 12
    assert got["digests"]["12"] == saved[12]
    # and training goes on into a new memory tier: its first save is full, drained after 12
    _, out = worker(store, memory, "--steps", "15", "--resume")
    assert out["start"] == 12 and out["served_by"] == "durable"
    assert steps_of(store) == list(range(1, 16))
    with amber.Store(store, readonly=True, create=False) as st:
        assert [i.kind for i in st.list() if i.step == 13] == ["full"]


def test_sigkill_at_random_moments_restores_from_memory_bit_identical(tmp_path, memory, trials):
    """SIGKILL the training process at a random moment (during a save, a commit or a
    drain): a restart restores the memory tier's newest step bit-identically, the
    durable tier holds only whole steps (each restores to what it saved), and the
    restarted job finishes the drain."""
    for seed in trials:
        rng = random.Random(seed)
        store, log = str(tmp_path / f"run-{seed}"), str(tmp_path / f"log-{seed}")
        mem = f"{memory}-{seed}"
        try:
            p = subprocess.Popen([PYTHON, WORKER, store, "--memory", mem, "--steps", "400",
                                  "--log", log, "--sleep", "0.01"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            deadline = time.time() + 60
            want = rng.randint(3, 25)  # steps saved before the kill, at least
            while len(step_log(log)) < want and p.poll() is None and time.time() < deadline:
                time.sleep(0.005)
            time.sleep(rng.uniform(0, 0.05))
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=30)
            assert p.returncode == -9, p.stderr.read().decode()[-2000:]
            saved = step_log(log)
            last = max(saved)
            # the durable tier: whole steps only, each restoring what it saved
            assert cli("verify", store).returncode == 0 or not os.path.exists(store), \
                cli("verify", store).stdout
            if os.path.exists(os.path.join(store, "LATEST")):
                d = durable_only(store)
                assert d["digests"][str(d["start"])] == saved[d["start"]], (seed, d["start"])
            # a restart from memory: the newest committed step, bit-identical
            got = load_only(store, mem)
            k = got["start"]
            assert got["served_by"] == "memory", (seed, got)
            assert last - 1 <= k <= last, (seed, k, last)
            assert got["digests"][str(k)] == saved[k], (seed, k)
            # opening the tiers again resumed the drain: the durable tier caught up
            assert steps_of(store)[-1] == k, (seed, steps_of(store)[-3:], k)
            assert cli("verify", store).returncode == 0
        finally:
            shutil.rmtree(mem, ignore_errors=True)


def test_a_budget_too_small_for_a_full_checkpoint_is_a_clear_error(tmp_path, memory):
    p, _ = worker(str(tmp_path / "run"), memory, "--steps", "3", "--budget", "4096",
                  check=False)
    assert p.returncode != 0
    assert "AMBER_ENOSPC" in p.stderr and "budget" in p.stderr, p.stderr[-2000:]
    # nothing committed is lost: the memory tier holds the steps, the drain went on
    assert steps_of(memory)[-1] >= 1
    amber.drain(memory)
    assert cli("verify", str(tmp_path / "run")).returncode == 0


def test_the_budget_makes_a_save_full_when_only_that_lets_the_memory_tier_shrink(tmp_path,
                                                                             memory):
    """No cadence would write a full (full_every 1000, no share): the memory tier's
    chain grows until it is over its budget, then a save is full and the old chain
    leaves the memory tier once durable; the durable tier keeps every step."""
    store = str(tmp_path / "run")
    worker(store, memory, "--steps", "3", "--full-every", "1000")
    full = os.path.getsize(os.path.join(memory, sorted(
        f for f in os.listdir(memory) if f.startswith("ckpt-"))[0]))
    budget = int(full * 1.8)
    shutil.rmtree(memory)
    shutil.rmtree(store)
    worker(store, memory, "--steps", "20", "--full-every", "1000", "--budget", str(budget))
    with amber.Store(store, readonly=True, create=False) as st:
        infos = st.list()
    assert [i.step for i in infos] == list(range(1, 21))
    fulls = [i.step for i in infos if i.kind == "full"]
    assert len(fulls) >= 2, [(i.step, i.parent) for i in infos]
    held = sum(os.path.getsize(os.path.join(memory, f)) for f in os.listdir(memory)
               if f.startswith("ckpt-"))
    assert held <= budget + full, (held, budget)


def _mount_small_tmpfs(path, size):
    os.makedirs(path, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", path],
                       capture_output=True, text=True)
    return r.returncode == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
def test_a_full_durable_disk_is_a_clear_error_and_loses_nothing(tmp_path, memory):
    disk = str(tmp_path / "disk")
    if not _mount_small_tmpfs(disk, "600k"):
        pytest.skip("cannot mount a tmpfs here")
    try:
        store = os.path.join(disk, "run")
        p, _ = worker(store, memory, "--steps", "30", "--log", str(tmp_path / "log"),
                      check=False)
        assert p.returncode != 0
        assert "AMBER_ENOSPC" in p.stderr and disk in p.stderr, p.stderr[-2000:]
        saved = step_log(str(tmp_path / "log"))
        # the memory tier holds every committed step not yet durable: a restart restores
        # the newest one bit-identically
        # (its close() raises the drain's error again: the durable disk is still full)
        p, got = worker(store, memory, "--load-only", "-1", check=False)
        assert "AMBER_ENOSPC" in p.stderr
        assert got["served_by"] == "memory"
        assert got["digests"][str(got["start"])] == saved[got["start"]]
        # room again: amber drain finishes, the durable tier serves the same step
        subprocess.run(["mount", "-o", "remount,size=64m", disk], check=True)
        r = cli("drain", memory)
        assert r.returncode == 0, r.stderr
        assert cli("verify", store).returncode == 0
        d = durable_only(store)
        assert d["start"] == got["start"] and d["digests"][str(d["start"])] == saved[d["start"]]
    finally:
        subprocess.run(["umount", "-l", disk], capture_output=True)


def test_tier_arguments_are_checked_before_anything_is_made(tmp_path, memory):
    store = str(tmp_path / "run")
    with pytest.raises(ValueError, match="separate directories"):
        Checkpointer(store, memory=store)
    with pytest.raises(ValueError, match="separate directories"):
        Checkpointer(store, memory=os.path.join(store, "mem"))
    with pytest.raises(ValueError, match="needs a memory tier"):
        Checkpointer(store, replicas=1)
    with pytest.raises(ValueError, match="memory_budget"):
        Checkpointer(store, memory=memory, memory_budget=-1)
    assert not os.path.exists(store) and not os.path.exists(memory)


def test_cli_lists_the_tiers_and_drains_what_a_crashed_job_left(tmp_path, memory):
    store = str(tmp_path / "run")
    torch.manual_seed(0)
    w = torch.randn(1000)
    ck = Checkpointer(store, memory=memory)
    for step in range(1, 6):
        w.add_(0.01)
        ck.save(step, {"w": w})
    ck.wait()
    # a crash: the drain stops where it is (close without flush)
    ck._release()
    r = cli("ls", memory)
    assert r.returncode == 0 and "memory" in r.stdout, r.stdout
    r = cli("drain", memory)
    assert r.returncode == 0, r.stderr
    assert steps_of(store)[-1] == 5
    r = cli("ls", memory)
    assert "durable" in r.stdout, r.stdout
    back = {"w": torch.zeros(1000)}
    with Checkpointer(store, readonly=True) as rd:
        assert rd.load(back) == 5
    assert torch.equal(back["w"], w)


def test_dcp_writer_and_reader_reach_the_memory_tier(tmp_path, memory):
    """amber.dcp.Writer(path, memory=DIR) saves through the memory tier (the store
    gets every step once the Writer closes); Reader(path, memory=DIR) reads the
    fastest tier holding the step, and the durable tier when the memory is gone."""
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Reader, Writer
    store = str(tmp_path / "dcp")
    m = torch.nn.Linear(32, 32)
    saved = []
    with Writer(store, memory=memory) as w:
        for _ in range(4):
            with torch.no_grad():
                m.weight.add_(0.5)
            dcp.save({"m": m.state_dict()}, storage_writer=w)
            saved.append(m.weight.clone())
    assert steps_of(store) == [0, 1, 2, 3]
    assert steps_of(memory)[-1] == 3 and len(steps_of(memory)) < 4
    for sid, tier, want in ((store, "memory", saved[3]), (f"{store}/step-3", "memory", saved[3]),
                            (f"{store}/step-0", "durable", saved[0])):
        back = torch.nn.Linear(32, 32)
        sd = {"m": back.state_dict()}
        r = Reader(sid, memory=memory)
        dcp.load(sd, storage_reader=r)
        assert r.served_by == tier, (sid, r.served_by)
        assert torch.equal(back.weight, want), sid
    shutil.rmtree(memory)
    back = torch.nn.Linear(32, 32)
    sd = {"m": back.state_dict()}
    r = Reader(store, memory=memory)
    dcp.load(sd, storage_reader=r)
    assert r.served_by == "durable" and torch.equal(back.weight, saved[3])
    with pytest.raises(ValueError, match="separate directories"):
        Writer(store, memory=store)


def test_dcp_writer_takes_each_tier_argument_as_named(tmp_path, memory):
    """Writer(memory=, max_lag=, memory_budget=) means what Checkpointer's arguments of
    those names mean (they once went into the wrong parameters: max_lag=2 became a
    budget of 2 bytes, which no full checkpoint fits)."""
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Writer
    store = str(tmp_path / "dcp")
    m = torch.nn.Linear(16, 16)
    with Writer(store, memory=memory, max_lag=2, memory_budget=1 << 30) as w:
        for _ in range(3):
            with torch.no_grad():
                m.weight.add_(0.5)
            dcp.save({"m": m.state_dict()}, storage_writer=w)
        t = w._saver.sink.tiers
        assert (t.opts.max_lag, t.opts.memory_budget, t.opts.replicas) == (2, 1 << 30, 0)
        assert t.budget == 1 << 30
    assert steps_of(store) == [0, 1, 2]
    with pytest.raises(ValueError, match="max_lag_bytes"):
        Writer(store, memory=memory, max_lag_bytes=-1)
