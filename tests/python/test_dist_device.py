"""The distributed Checkpointer through the device path (amber.device over
amber_global_writer's pre-selected tensors): 2 gloo ranks on CPU, run with
AMBER_DEVICE_PATH=1, as tests/python/dist_device_worker.py describes. Bounded in
time and cleaned up as test_dist_checkpointer.py's ranks are."""
import os

import test_dist_checkpointer as tdc
from conftest import HERE


def test_device_path_restores_as_the_cpu_path_resumes_and_loads_at_one_rank(tmp_path,
                                                                          monkeypatch):
    """Exact: the device path's trajectory restores bit-identical to the live state
    and to the same trajectory saved through the CPU path, at a delta and at a step
    inside the chain; a restart's load seeds the references (its first step is a
    delta that reads nothing back), a reopen without a load reads them back; a write
    or a selection that fails on one rank fails the step everywhere; threshold stays
    within its bound (and equals the CPU path); 1 rank loads the 2 ranks' store and
    saves on."""
    monkeypatch.setenv("AMBER_DEVICE_PATH", "1")
    monkeypatch.setattr(tdc, "WORKER", os.path.join(HERE, "dist_device_worker.py"))
    d = str(tmp_path)
    tdc.ranks("device", 2, d)
    tdc.ranks("device1", 1, d)
