"""The distributed Checkpointer (amber._dist) over spawned gloo process groups.

Each test starts its ranks as processes (tests/python/dist_worker.py), which meet
through torch.distributed's file:// rendezvous, train a tiny transformer sharded
with FSDP2 on CPU and check what they can check themselves; the test then checks the
store with the CLI and the dumps the ranks wrote. Every run is bounded in time: a
rank that hangs (a collective that never completes) is killed with its group and
the test fails with every rank's output.
"""
import json
import os
import random
import shutil
import signal
import subprocess
import time

import torch

from conftest import HERE, PYTHON, SEED, TRIALS

WORKER = os.path.join(HERE, "dist_worker.py")
TIMEOUT = 120


def start(scenario, world, d, worker=None):
    init = os.path.join(d, f"rdzv-{scenario}-{world}")
    if os.path.exists(init):
        os.unlink(init)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in [HERE, os.environ.get("PYTHONPATH", "")] if p))
    return [subprocess.Popen([PYTHON, worker or WORKER, scenario, str(r), str(world), init, d],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True) for r in range(world)]


def ranks(scenario, world, d, timeout=TIMEOUT, worker=None):
    """Runs `scenario` of `worker` on `world` ranks; fails with their output if any
    fails; returns their output."""
    procs = start(scenario, world, d, worker)
    outs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            outs.append(out)
    except subprocess.TimeoutExpired:
        pass
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    codes = [p.returncode for p in procs]
    if any(codes) or len(outs) < world:
        report = "\n".join(f"--- rank {r} (exit {c}):\n{outs[r] if r < len(outs) else '(timed out)'}"
                           for r, c in enumerate(codes))
        raise AssertionError(f"{scenario} at {world} ranks failed:\n{report}")
    return outs


def cli(*args):
    exe = shutil.which("amber", path=os.path.dirname(PYTHON)) or shutil.which("amber")
    lib = os.environ.get("AMBER_LIBRARY")
    if lib:  # a build tree's library: its CLI sits next to it
        exe = os.path.join(os.path.dirname(lib), "amber")
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=60)


def test_resume_at_the_same_world_size_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    d = str(tmp_path)
    ranks("resume", 2, d)
    kinds = json.load(open(f"{d}/resume.json"))["kinds"]
    assert kinds[0] == "full" and len(kinds) == 3
    ls = cli("ls", f"{d}/b", "--json")
    assert ls.returncode == 0, ls.stderr
    assert [s["step"] for s in json.loads(ls.stdout)] == [1, 2, 3, 4, 5, 6]
    assert cli("verify", f"{d}/b").returncode == 0


def test_a_failing_rank_fails_the_step_on_every_rank_and_the_store_keeps_its_last_step(tmp_path):
    d = str(tmp_path)
    ranks("failures", 2, d)
    ls = json.loads(cli("ls", f"{d}/f", "--json").stdout)
    assert [s["step"] for s in ls] == [1, 2, 5, 7]
    assert cli("verify", f"{d}/f").returncode == 0


def test_keep_last_prunes_each_step_and_fallback_agrees_on_a_step_that_verifies(tmp_path):
    d = str(tmp_path)
    ranks("retention", 2, d)
    assert [s["step"] for s in json.loads(cli("ls", f"{d}/r", "--json").stdout)] == [5, 6]


def test_ddp_replicated_state_is_written_once_and_loads_on_every_rank(tmp_path):
    d = str(tmp_path)
    ranks("ddp", 2, d)
    # rank 1's files hold only its own metadata (RNG states, counters), no tensor
    import amber
    held = {}
    for r in (0, 1):
        with amber.Store(f"{d}/ddp/rank-0000{r}", readonly=True) as st, st.reader() as rd:
            held[r] = len(rd)
            assert rd.meta()
    assert held[0] > 0 and held[1] == 0, held


def test_load_at_other_world_sizes_hsdp_and_export(tmp_path):
    """2 ranks save (exact, threshold, budget), 4 load them (2->4) and save, then 3 and 2
    load the 4 ranks' step (4->3 uneven, 4->2); amber export of the 4 ranks' step
    equals the unsharded state, read back with safetensors. The 4 ranks also save HSDP
    state (a 2x2 mesh) and load it into HSDP and FSDP (scenario_hsdp): each shard is
    written once, by the replica at coordinate 0; and two groups of 2 of them save and
    load their own stores with process_group= (scenario_subgroups)."""
    d = str(tmp_path)
    thr, bud = "threshold:1e-3", "budget:0.1:2e-3"
    json.dump({"load": [], "saved_world": {},
               "save": [["s2", "exact"], ["t2", thr], ["b2", bud]]},
              open(f"{d}/reshard.json", "w"))
    ranks("reshard", 2, d)
    json.dump({"load": [["s2", 0], ["t2", 1e-3], ["b2", 2e-3]],
               "saved_world": {"s2": 2, "t2": 2, "b2": 2},
               "save": [["s4", "exact"]], "hsdp": True}, open(f"{d}/reshard.json", "w"))
    ranks("reshard", 4, d)
    # ranks 2 and 3 hold replicas of ranks 0 and 1's shards: their files hold no tensor
    import amber
    for r in range(4):
        with amber.Store(f"{d}/h/rank-0000{r}", readonly=True) as st, st.reader() as rd:
            assert (len(rd) > 0) == (r < 2), (r, len(rd))
    json.dump({"load": [["s4", 0]], "saved_world": {"s4": 4}}, open(f"{d}/reshard.json", "w"))
    ranks("reshard", 3, d)
    ranks("reshard", 2, d)
    out = f"{d}/s4.safetensors"
    ex = cli("export", f"{d}/s4", "-o", out)
    assert ex.returncode == 0, ex.stderr
    from safetensors.torch import load_file
    got = load_file(out)
    want = torch.load(f"{d}/s4-model.pt")  # get_model_state_dict(full_state_dict=True)
    assert want and all(torch.equal(got[f"model/{k}"], v) for k, v in want.items())
    optim = {k: v for k, v in torch.load(f"{d}/s4.pt").items() if k.startswith("optim/")}
    assert optim and all(torch.equal(got[k], v) for k, v in optim.items())


def _kill_trials(tmp_path, name, victims):
    """Kills ranks of a 2-rank job that saves every step, at a random moment after a
    random step (TRIALS // 2 times, at least once: each trial starts two jobs), then
    verifies the store and loads its latest global step in a new job."""
    n = max(1, TRIALS // 2)
    print(f"{name}: {n} trials, AMBER_SEED={SEED} (seeds {SEED}..{SEED + n - 1})")
    for seed in range(SEED, SEED + n):
        rng = random.Random(seed)
        d = str(tmp_path / f"kill-{seed}")
        os.makedirs(d)
        procs = start("killrun", 2, d)
        try:
            target = rng.randint(2, 8)
            deadline = time.monotonic() + TIMEOUT
            while time.monotonic() < deadline and all(p.poll() is None for p in procs):
                try:
                    if int(open(f"{d}/progress-0").read() or 0) >= target:
                        break
                except (OSError, ValueError):
                    pass
                time.sleep(0.01)
            time.sleep(rng.uniform(0, 0.05))  # somewhere in a save, a step or a commit
            assert all(p.poll() is None for p in procs), "a rank ended before the kill"
            killed = victims(rng)
            for r in killed:
                os.killpg(procs[r].pid, signal.SIGKILL)
            print(f"  seed {seed}: ranks {killed} killed after step {target}")
            for p in procs:  # survivors fail (peer gone) or time out in a collective
                try:
                    p.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    pass
            hung = [r for r, p in enumerate(procs) if p.poll() is None]
            assert not hung, f"ranks {hung} still running 60 s after the kill"
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait()
                p.stdout.close()
        if os.path.exists(f"{d}/k/GLOBAL"):
            v = cli("verify", f"{d}/k")
            assert v.returncode == 0, v.stdout + v.stderr
        ranks("killcheck", 2, d)
        if os.path.exists(f"{d}/killcheck.json"):
            print(f"  seed {seed}: restored step {json.load(open(f'{d}/killcheck.json'))['step']}")


def test_sigkill_of_one_rank_leaves_the_last_global_step_restorable(tmp_path):
    _kill_trials(tmp_path, "sigkill_one_rank", lambda rng: [rng.randint(0, 1)])


def test_sigkill_of_all_ranks_leaves_the_last_global_step_restorable(tmp_path):
    _kill_trials(tmp_path, "sigkill_all_ranks", lambda rng: [0, 1])


def test_a_rank_killed_during_saves_is_named_by_the_survivor(tmp_path):
    """SIGKILL of rank 1 while both ranks save every step: rank 0's save fails within
    a bounded time with an error naming rank 1 (not only gloo's "connection reset")."""
    d = str(tmp_path)
    procs = start("killsave", 2, d)
    try:
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline and all(p.poll() is None for p in procs):
            try:
                if int(open(f"{d}/progress-1").read() or 0) >= 3:
                    break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        assert all(p.poll() is None for p in procs), "a rank ended before the kill"
        t0 = time.monotonic()
        os.killpg(procs[1].pid, signal.SIGKILL)
        out, _ = procs[0].communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            p.stdout.close()
    assert procs[0].returncode == 3, out
    msg = open(f"{d}/killsave-0.txt").read()
    print(f"rank 0 after {took:.1f} s: {msg}")
    assert "rank 1 (pid" in msg, msg
    assert took < 30, took
    v = cli("verify", f"{d}/ks")
    assert v.returncode == 0, v.stdout + v.stderr


def test_a_damaged_multi_rank_store_is_refused_or_falls_back_and_the_cli_says_why(tmp_path):
    """Issue 30, at 2 ranks (dist_worker's "damage": the Checkpointer and dcp.load
    with amber.dcp.Reader on copies of a store damaged one way each), then here: the
    Checkpointer of one process (no process group) falls back past the damaged
    latest manifest, and the CLI lists the damaged step, verify fails naming it
    (and the swapped shards) while step 5 verifies and exports, and a store without
    GLOBAL is refused by ls, verify and export."""
    d = str(tmp_path)
    ranks("damage", 2, d)
    import warnings

    import dist_worker
    from amber.torch import Checkpointer
    model = dist_worker.GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dist_worker.train_step(model, opt)
    with Checkpointer(f"{d}/flipped") as ck, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ck.load({"model": model, "optim": opt, "extra": {}}, fallback=True) == 5
        assert ck.skipped == 1
    want = torch.load(f"{d}/damage-5.pt")
    assert all(torch.equal(p, want[f"model/{n}"]) for n, p in model.named_parameters())

    assert cli("verify", f"{d}/s").returncode == 0
    for args in (("ls",), ("verify",), ("export", "-o", f"{d}/x.safetensors")):
        r = cli(*args, f"{d}/noglobal")
        assert r.returncode != 0 and "GLOBAL is missing" in r.stdout + r.stderr, (args, r)
    for case, says in (("flipped", "checksum"), ("truncated", "manifest"),
                       ("nomanifest", "GLOBAL names step 6"), ("swapped", "moved or swapped")):
        ls = cli("ls", f"{d}/{case}", "--json")
        assert ls.returncode == 0, (case, ls.stderr)
        steps = json.loads(ls.stdout)
        assert [s["step"] for s in steps] == [1, 2, 3, 4, 5, 6], case
        # a manifest that decodes but lies about the shards is found by verify
        assert [s["damaged"] for s in steps] == [False] * 5 + [case != "swapped"], case
        v = cli("verify", f"{d}/{case}")
        assert v.returncode == 1 and "step 6: FAILED" in v.stdout and says in v.stdout, (case, v)
        assert "step 5: ok" in v.stdout, (case, v.stdout)
        assert cli("export", f"{d}/{case}", "-o", f"{d}/{case}.st").returncode != 0, case
        ex = cli("export", f"{d}/{case}", "--step", "5", "-o", f"{d}/{case}-5.st")
        assert ex.returncode == 0, (case, ex.stderr)
    assert cli("verify", f"{d}/ranklatest").returncode == 0
    assert [s["step"] for s in json.loads(cli("ls", f"{d}/ranklatest", "--json").stdout)] == \
        list(range(1, 8))
