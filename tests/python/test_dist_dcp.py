"""amber.dcp under a gloo process group of 2 ranks (tests/python/dist_worker.py):
dcp.save and dcp.async_save of FSDP2 (DTensor) state through amber.dcp.Writer, dcp.load
through amber.dcp.Reader at the same world size and at 3 ranks, and the CLI on the
store. Bounded in time like test_dist_checkpointer's runs."""
import json

from test_dist_checkpointer import cli, ranks


def test_dcp_save_async_save_and_load_at_two_and_three_ranks(tmp_path):
    d = str(tmp_path)
    ranks("dcp", 2, d)
    ls = cli("ls", f"{d}/x", "--json")
    assert ls.returncode == 0, ls.stderr
    steps = json.loads(ls.stdout)
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    # the long-lived Writer keeps its reference: saves after the first are deltas, the
    # async one (step 4) too
    assert [s["kind"] for s in steps] == ["full", "delta", "delta", "delta"]
    assert cli("verify", f"{d}/x").returncode == 0
    ranks("dcpload", 3, d)
