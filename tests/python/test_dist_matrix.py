"""Every world size loads what every world size saved: 1, 2, 3 and 4 ranks save
(tests/python/matrix_worker.py: FSDP2 on CPU with gloo above 1 rank, a plain process
at 1), then fresh groups of 1, 2, 3 and 4 ranks each load all four stores, through
the Checkpointer and through dcp.load with amber.dcp.Reader (stores written by dcp.save
with amber.dcp.Writer), every tensor bit-exact. One spawn per world size and phase;
each bounded in time, its ranks killed with their group when it runs over.

The case an outside check reported (a 4-rank Checkpointer store that one process
could not load, "no committed checkpoint") is the load at world size 1: there the
process has no process group, and the Checkpointer on a multi-rank store loads it
(and saves into it: a global step of world size 1, checked too).
"""
import os
import signal
import subprocess

from conftest import HERE, PYTHON

WORKER = os.path.join(HERE, "matrix_worker.py")
TIMEOUT = 180


def ranks(phase, world, d):
    init = os.path.join(d, f"rdzv-{phase}-{world}")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in [HERE, os.environ.get("PYTHONPATH", "")] if p))
    procs = [subprocess.Popen([PYTHON, WORKER, phase, str(r), str(world), init, d],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env=env, start_new_session=True) for r in range(world)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=TIMEOUT)[0])
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
        raise AssertionError(f"{phase} at {world} ranks failed:\n{report}")


def test_every_world_size_loads_what_every_world_size_saved(tmp_path):
    d = str(tmp_path)
    for world in (1, 2, 3, 4):
        ranks("save", world, d)
    import amber
    assert not amber.is_global_store(f"{d}/ck1") and amber.is_global_store(f"{d}/ck4")
    assert [s.world_size for s in amber.global_steps(f"{d}/dcp3")] == [3, 3]
    for world in (1, 2, 3, 4):
        ranks("load", world, d)
    assert [(s.step, s.world_size) for s in amber.global_steps(f"{d}/ck4w1")] == \
        [(1, 4), (2, 4), (3, 1)]
