"""bench/dist_bench.py runs (small model, 2 ranks, one round) and reports every figure."""
import json
import math
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_dist_bench_quick_reports_every_figure(tmp_path):
    out = tmp_path / "res.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "dist_bench.py"), "--quick",
                        "--ranks", "2", "--repeat", "1", "--deltas", "1", "--timeout", "120",
                        "--out", str(tmp_path / "scratch"), "--json", str(out), "--markdown"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads(out.read_text())
    fig = res["worlds"]["2"]["figures"]
    want = {"dcp_save", "dcp_bytes", "dcp_async_stall", "dcp_async_durable", "amber_full",
            "amber_full_bytes", "amber_delta", "amber_delta_stall", "amber_delta_bytes",
            "amber_dcp_full", "amber_dcp_delta", "amber_dcp_delta_bytes_max", "dcp_load",
            "amber_load", "amber_dcp_load", "read_floor", "delta_floor", "load_floor",
            "load_bytes"}
    assert want <= set(fig), want - set(fig)
    for k in want:
        v = fig[k]["median"]
        assert math.isfinite(v) and v > 0, (k, v)
    for k, s in res["worlds"]["2"]["ratios"].items():
        assert math.isfinite(s["median"]) and s["median"] > 0, (k, s)
    # a lossy delta of a step is far smaller than DCP's full checkpoint
    assert fig["amber_delta_bytes"]["median"] < 0.2 * fig["dcp_bytes"]["median"]
    assert len(res["targets"]) == 7 and all(isinstance(t["met"], bool) for t in res["targets"])
    assert "| target |" in p.stdout and "dcp.load" in p.stdout and "Bound:" in p.stdout
    assert not (tmp_path / "scratch").exists()  # the scratch directory is removed
