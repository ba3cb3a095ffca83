"""dcp.async_save through amber.dcp at 2 ranks, raced by training before its staging
completed (tests/python/torn_worker.py): after an optimizer.step() the committed step
is the state at the call (amber fences before the step); after an in-place op on the
DTensors it is that state or refused with AMBER_ECHANGED on every rank; a correct save
afterwards loads exactly. Bounded in time like every multi-rank test."""
import os

from conftest import HERE
from test_dist_checkpointer import cli, ranks

WORKER = os.path.join(HERE, "torn_worker.py")


def test_dcp_async_save_raced_at_two_ranks_is_the_state_at_the_call_or_refused(tmp_path):
    outs = ranks("torn", 2, str(tmp_path), worker=WORKER)
    assert all("in-place races:" in o for o in outs), outs
    assert cli("verify", f"{tmp_path}/x").returncode == 0
