"""amber.dcp under a gloo process group of 2 ranks (tests/python/dist_worker.py):
dcp.save and dcp.async_save of FSDP2 (DTensor) state through amber.dcp.Writer, dcp.load
through amber.dcp.Reader at the same world size and at 3 ranks, and the CLI on the
store; the same under torchrun. Bounded in time like test_dist_checkpointer's runs."""
import json
import os
import signal
import subprocess

import pytest

from conftest import HERE, PYTHON
from test_dist_checkpointer import TIMEOUT, WORKER, cli, ranks


def test_dcp_save_async_save_and_load_at_two_and_three_ranks(tmp_path):
    """2 ranks save through amber.dcp (dcp.save, then dcp.async_save) and load; 3 ranks
    load that store, and stores written by one process (amber.dcp's and amber.torch's:
    dcp.load and the distributed Checkpointer load both, rank 0 gets the RNG states of
    the Checkpointer's, the others keep theirs with a warning; many ranks refuse to
    save into a single-process store)."""
    d = str(tmp_path)
    saved_by_two(d)
    import dist_worker
    dist_worker.save_one_process(d)  # stores of one process, loaded at 3 ranks too
    ranks("dcpload", 3, d)


def test_dcp_rules_in_units_of_the_learning_rate_at_two_ranks(tmp_path):
    """A rule in units ("threshold:1u") through amber.dcp at 2 ranks: each rank's
    shards are bounded by their param group's lr, lossy and within it after a load
    (dist_worker's "dcpunits")."""
    ranks("dcpunits", 2, str(tmp_path))
    assert open(f"{tmp_path}/dcpunits.ok").read() == "2"


def test_dcp_writer_and_reader_with_a_memory_tier_at_two_ranks(tmp_path):
    """amber.dcp's memory tier at 2 ranks (dist_worker's "dcpmemory"): saves drain to
    the store; a load reads the memory tier of one host alone (the store moved away),
    and with a memory tier per host each rank's files from its own and the rest from
    the store; bit-exact."""
    ranks("dcpmemory", 2, str(tmp_path))
    assert open(f"{tmp_path}/dcpmemory.ok").read() == "2"


def test_dcp_through_the_device_path_at_two_ranks(tmp_path, monkeypatch):
    """With AMBER_DEVICE_PATH=1 each rank's shards are selected on their device
    (amber.device over the global writer's pre-selected tensors): the same steps,
    kinds and exported state."""
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1")
    saved_by_two(str(tmp_path))


def saved_by_two(d):
    """2 ranks save through amber.dcp (dist_worker's "dcp"): its steps, their kinds,
    verify and the exported model against what the ranks saved."""
    ranks("dcp", 2, d)
    ls = cli("ls", f"{d}/x", "--json")
    assert ls.returncode == 0, ls.stderr
    steps = json.loads(ls.stdout)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    # the long-lived Writer keeps its reference: saves after the first are deltas, the
    # async one (step 4) too
    assert [s["kind"] for s in steps] == ["full", "delta", "delta", "delta"]
    assert cli("verify", f"{d}/x").returncode == 0
    ex = cli("export", f"{d}/x", "-o", f"{d}/x.safetensors")
    assert ex.returncode == 0, ex.stderr
    import torch
    from safetensors.torch import load_file
    got, want = load_file(f"{d}/x.safetensors"), torch.load(f"{d}/x.pt")
    model = {k: v for k, v in want.items() if k.startswith("model/")}
    assert model and all(torch.equal(got[k], v) for k, v in model.items())


def test_dcp_save_and_load_under_torchrun(tmp_path):
    d = str(tmp_path)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        p for p in [HERE, os.environ.get("PYTHONPATH", "")] if p))
    p = subprocess.Popen([PYTHON, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "2", WORKER, "dcptiny", "-", "-", "env", d],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    try:
        out, _ = p.communicate(timeout=TIMEOUT)
    finally:
        if p.poll() is None:  # torchrun and its ranks share the session
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    assert p.returncode == 0, out
    assert open(f"{d}/dcptiny.ok").read() == "2"
    assert cli("verify", f"{d}/t").returncode == 0


@pytest.mark.parametrize("world", [2, 4])
def test_dcp_contract_at_many_ranks(tmp_path, world):
    """DCP's contract at 2 and 4 ranks (tests/python/dcp_contract_worker.py):
    ShardedTensors through a Writer given its path and no checkpoint_id, a nested state
    dict through DCP's empty-state-dict loader (planner_data), dcp.async_save of a
    DTensor and a BytesIO value waited on as an AsyncSaveResponse; and the CLI verifies
    the stores."""
    ranks("contract", world, str(tmp_path), worker=os.path.join(HERE, "dcp_contract_worker.py"))
    assert open(f"{tmp_path}/contract.ok").read() == str(world)
    for store in ("st0", "nested", "async"):
        assert cli("verify", f"{tmp_path}/{store}").returncode == 0, store
