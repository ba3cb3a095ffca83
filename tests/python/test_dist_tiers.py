"""Storage tiers at many ranks through amber.torch (tests/python/tiers_worker.py):
Checkpointer(path, memory=HOST_DIR, replicas=1) on gloo ranks, each rank a "host" of
its own (its own memory directory and AMBER_HOST), so that its replica lives on
another rank. Every run is bounded in time and its processes are killed with their
groups at the end.

  - a restart restores from memory; a host wiped (its memory directory gone) restores
    from its peer's replica; all memory gone restores from the durable tier; each
    bit-identical to what the step saved on every rank, and training goes on;
  - every rank SIGKILLed at random moments (a save, a commit, a drain or a
    replication in flight): no torn or partial step in the durable tier, a restart
    restores the newest committed step bit-identically, and with one host wiped too."""
import json
import os
import random
import shutil
import signal
import time

import pytest

from conftest import HERE, SEED, TRIALS, step_log
from test_dist_checkpointer import cli, ranks, start

WORKER = os.path.join(HERE, "tiers_worker.py")


def logged(d, rank):
    return step_log(os.path.join(d, f"log-{rank}"))


def loaded(d, world):
    return [json.load(open(os.path.join(d, f"loaded-{r}.json"))) for r in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_restore_from_memory_from_a_peer_and_from_the_durable_tier(tmp_path, world):
    d = str(tmp_path)
    os.environ["TIERS_STEPS"] = "6"
    try:
        ranks("train", world, d, worker=WORKER)
    finally:
        os.environ.pop("TIERS_STEPS", None)
    saved = [logged(d, r) for r in range(world)]
    assert all(sorted(s) == list(range(1, 7)) for s in saved)
    assert cli("verify", f"{d}/durable").returncode == 0
    # a restart on the same hosts: from memory, nothing from the durable tier (a rank
    # whose host lacks rank 0's files, which hold the replicated tensors such as
    # AdamW's step counters, gets them from the host that keeps rank 0's replica)
    ranks("load", world, d, worker=WORKER)
    got = loaded(d, world)
    assert got[0]["tier"] == "memory" and got[1]["tier"] == "memory", got
    assert {g["tier"] for g in got} <= {"memory", "peer"} and got[0]["ranks_durable"] == 0
    assert [g["digest"] for g in got] == [saved[r][6] for r in range(world)]
    # host 1 lost (its memory wiped, its rank restarted): served by its peer's replica
    shutil.rmtree(f"{d}/host-1")
    ranks("load", world, d, worker=WORKER)
    got = loaded(d, world)
    assert got[1]["tier"] == "peer" and got[0]["tier"] == "memory", got
    assert [g["step"] for g in got] == [6] * world
    assert [g["digest"] for g in got] == [saved[r][6] for r in range(world)]
    # every memory lost: the durable tier's newest step
    for r in range(world):
        shutil.rmtree(f"{d}/host-{r}", ignore_errors=True)
    ranks("load", world, d, worker=WORKER)
    got = loaded(d, world)
    assert [g["tier"] for g in got] == ["durable"] * world
    assert [g["digest"] for g in got] == [saved[r][6] for r in range(world)]


def test_every_rank_sigkilled_at_random_moments_restores_bit_identical(tmp_path):
    world = 2
    for i in range(TRIALS):
        seed = SEED + i
        rng = random.Random(seed)
        d = str(tmp_path / f"t{i}")
        os.makedirs(d)
        os.environ["TIERS_SLEEP"], os.environ["TIERS_STEPS"] = "0.02", "400"
        try:
            procs = start("train", world, d, worker=WORKER)
        finally:
            os.environ.pop("TIERS_SLEEP")
            os.environ.pop("TIERS_STEPS")
        try:
            want = rng.randint(2, 12)
            deadline = time.time() + 90
            while min(len(logged(d, r)) for r in range(world)) < want and \
                    time.time() < deadline and all(p.poll() is None for p in procs):
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.1))
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        assert all(p.returncode == -9 for p in procs), \
            (seed, [(p.returncode, p.stdout.read()[-1500:]) for p in procs])
        saved = [logged(d, r) for r in range(world)]
        last = min(max(s) for s in saved)
        # the durable tier holds whole steps only
        if os.path.exists(f"{d}/durable/GLOBAL"):
            r = cli("verify", f"{d}/durable")
            assert r.returncode == 0, (seed, r.stdout, r.stderr)
        # restart: the newest committed step, bit-identical on every rank
        ranks("load", world, d, worker=WORKER)
        got = loaded(d, world)
        k = got[0]["step"]
        assert all(g["step"] == k for g in got), (seed, got)
        assert last - 1 <= k <= last + 1, (seed, k, last)
        assert [g["digest"] for g in got] == [saved[r][k] for r in range(world)], (seed, k)
        # and one host lost as well: its peer's replica serves the same step
        shutil.rmtree(f"{d}/host-1")
        ranks("load", world, d, worker=WORKER)
        got = loaded(d, world)
        assert [g["step"] for g in got] == [k] * world, (seed, got)
        assert got[1]["tier"] in ("peer", "durable"), (seed, got)
        assert [g["digest"] for g in got] == [saved[r][k] for r in range(world)], (seed, k)
