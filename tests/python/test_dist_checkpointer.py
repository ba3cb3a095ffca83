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
import shutil
import signal
import subprocess
import sys

import pytest
import torch

from conftest import HERE, PYTHON

WORKER = os.path.join(HERE, "dist_worker.py")
TIMEOUT = 120


def ranks(scenario, world, d, timeout=TIMEOUT):
    """Runs `scenario` on `world` ranks; fails with their output if any fails."""
    init = os.path.join(d, f"rdzv-{scenario}-{world}")
    if os.path.exists(init):
        os.unlink(init)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in [HERE, os.environ.get("PYTHONPATH", "")] if p))
    procs = [subprocess.Popen([PYTHON, WORKER, scenario, str(r), str(world), init, d],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, start_new_session=True) for r in range(world)]
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
    assert [s["step"] for s in ls] == [1, 2, 5]
    assert cli("verify", f"{d}/f").returncode == 0


def test_load_at_other_world_sizes_and_export(tmp_path):
    """2 ranks save (exact and threshold), 4 load them (2->4) and save, then 3 and 2
    load the 4 ranks' step (4->3 uneven, 4->2); amber export of the 4 ranks' step
    equals the unsharded state, read back with safetensors."""
    d = str(tmp_path)
    thr = "threshold:1e-3"
    json.dump({"load": [], "saved_world": {}, "save": [["s2", "exact"], ["t2", thr]]},
              open(f"{d}/reshard.json", "w"))
    ranks("reshard", 2, d)
    json.dump({"load": [["s2", 0], ["t2", 1e-3]], "saved_world": {"s2": 2, "t2": 2},
               "save": [["s4", "exact"]]}, open(f"{d}/reshard.json", "w"))
    ranks("reshard", 4, d)
    json.dump({"load": [["s4", 0]], "saved_world": {"s4": 4}}, open(f"{d}/reshard.json", "w"))
    ranks("reshard", 3, d)
    ranks("reshard", 2, d)
    out = f"{d}/s4.safetensors"
    ex = cli("export", f"{d}/s4", "-o", out)
    assert ex.returncode == 0, ex.stderr
    from safetensors.torch import load_file
    got = load_file(out)
    want = torch.load(f"{d}/s4.pt")
    model = {k: v for k, v in want.items() if k.startswith("model/")}
    assert model and all(torch.equal(got[k], v) for k, v in model.items())
