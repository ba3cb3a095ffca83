"""amber.integrations.accelerate with the real Accelerate, under `accelerate launch`
with 2 processes (DDP on CPU over gloo), no mocks.

Two launches start together (tests/python/hf_accelerate_worker.py): an uninterrupted
run, and one that pauses at the end of step 7 and is SIGKILLed there, every rank;
then the killed one is launched again and resumes from the amber store, while
examples/accelerate_loop.py runs as written (one process, a few steps). Every
process is bounded in time and killed if the test leaves early.
"""
import os
import socket
import time

import pytest
import torch
from safetensors.torch import load_file

import amber
from hf_procs import HERE, PYTHON, Proc, procs

WORKER = os.path.join(HERE, "hf_accelerate_worker.py")
EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "accelerate_loop.py")
TIMEOUT = 180
STEPS = 16
PER_EPOCH = 6  # 48 samples, batches of 4, 2 ranks


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gone(pid, timeout=10):
    """Whether process `pid` ended (or is a zombie) within `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def launch(*args):
    accelerate = os.path.join(os.path.dirname(PYTHON), "accelerate")
    return Proc([accelerate, "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
                 "--mixed_precision", "no", "--dynamo_backend", "no",
                 "--main_process_ip", "127.0.0.1", "--main_process_port", _port(),
                 WORKER, *args])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("accelerate")
    ref_dir, run_dir = str(d / "ref"), str(d / "run")
    with procs() as ps:
        ps.append(launch(ref_dir))
        ps.append(launch(run_dir, "--pause-at", "7"))
        ref, killed = ps
        killed.wait_line("step 7", TIMEOUT)
        killed.kill()
        assert len(killed.pids) == 2 and f"step {STEPS}" not in killed.lines, killed.report()
        assert all(_gone(pid) for pid in killed.pids), "a rank survived the SIGKILL"
        resumed = launch(run_dir, "--resume")
        example = Proc([PYTHON, EXAMPLE, "--out", d / "example", "--steps", "8", "--save-every", "3"])
        ps += [resumed, example]
        ref.finish(TIMEOUT)
        resumed.finish(TIMEOUT)
        example.finish(TIMEOUT)
    return (ref_dir, ref.result()), (run_dir, resumed.result()), (str(d / "example"), example.lines)


def test_two_ranks_sigkilled_and_relaunched_resume_bit_identical_under_exact(runs):
    (ref_dir, ref), (run_dir, got), _ = runs
    assert ref["world"] == got["world"] == 2 and got["distributed"] == "DistributedType.MULTI_CPU"
    start = got["start"]
    assert 1 <= start <= 6, start  # killed at the end of step 7, before its save
    assert got["extra"] == {"epoch": (start - 1) // PER_EPOCH}
    assert list(got["losses"]) == [str(s) for s in range(start + 1, STEPS + 1)]
    for s, loss in got["losses"].items():
        assert loss == ref["losses"][s], f"step {s}: {loss!r} != {ref['losses'][s]!r}"
    want = load_file(os.path.join(ref_dir, "final-0.safetensors"))
    assert any(k.endswith("/exp_avg_sq") for k in want)
    for rank in (0, 1):  # rank 1 restored the replicated state rank 0 wrote
        have = load_file(os.path.join(run_dir, f"final-{rank}.safetensors"))
        assert sorted(have) == sorted(want)
        diff = [k for k in want if not torch.equal(have[k], want[k])]
        assert not diff, f"rank {rank}: {len(diff)} tensors differ, e.g. {diff[:3]}"


def test_the_store_is_one_amber_store_of_two_ranks_and_nothing_else_is_written(runs):
    for run_dir, _ in runs[:2]:
        assert sorted(os.listdir(run_dir)) == ["amber", "final-0.safetensors", "final-1.safetensors"]
        store = os.path.join(run_dir, "amber")
        assert amber.is_global_store(store)
        steps = amber.global_steps(store)
        assert steps[-1].step == STEPS and {s.world_size for s in steps} == {2}
        with amber.GlobalReader(store) as g:
            names = {t.name for t in g.tensors()}
        assert "model/embed.weight" in names and "model/mask" in names
        assert "optimizer/embed.weight/exp_avg" in names


def test_the_example_runs_as_written(runs):
    out, lines = runs[2]
    assert f"done at step 8; the store: {os.path.join(out, 'amber')}" in lines, lines
    with amber.Store(os.path.join(out, "amber"), readonly=True) as st:
        steps = [c.step for c in st.list()]
    # saves at 3, 6 and 8; keep_last=2 (and the chain those need)
    assert steps[-2:] == [6, 8] and set(steps) <= {3, 6, 8}, steps
    assert sorted(os.listdir(out)) == ["amber"]
