"""bench/torch_bench.py runs (small model, one round) and reports every figure."""
import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_torch_bench_quick_reports_every_figure(tmp_path):
    out = tmp_path / "res.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "torch_bench.py"), "--quick",
                        "--repeat", "1", "--deltas", "2", "--out", str(tmp_path / "scratch"),
                        "--json", str(out), "--markdown"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    want = {"torch_save", "st_save", "dcp_save_t1", "dcp_save_t2", "dcp_async_stall",
            "dcp_async_durable", "amber_full", "amber_full_stall", "amber_delta",
            "amber_delta_stall", "first_after_load", "first_after_load_stall", "torch_load",
            "st_load", "dcp_load", "amber_load", "amber_load_ro", "delta_floor", "load_floor",
            "amber_full_bytes", "amber_delta_bytes", "amber_delta_call", "plain_stall",
            "load_bytes"}
    assert want <= set(res["figures"]), want - set(res["figures"])
    for k in want:
        v = res["figures"][k]["median"]
        assert math.isfinite(v) and v > 0, (k, v)
    # a lossy delta of a few steps is far smaller than a full checkpoint
    assert res["figures"]["amber_delta_bytes"]["median"] < 0.2 * res["figures"]["amber_full_bytes"]["median"]
    assert len(res["targets"]) == 11 and all(isinstance(t["met"], bool) for t in res["targets"])
    # targets with a floor print the floor's own ratio next to them (the same-run bound)
    bounds = {t["ratio"]: t.get("bound") for t in res["targets"]}
    assert bounds["load_vs_dcp_load"] > 0 and bounds["delta_vs_dcp_save"] > 0
    assert res["ratios"]["load_over_floor"]["median"] > 0
    assert "| target |" in p.stdout and "dcp.load" in p.stdout
    assert res["ratios"]["load_floor_vs_dcp_load"]["median"] > 0
    assert "no cold load" in p.stdout
    assert not (tmp_path / "scratch").exists()  # the scratch directory is removed


def test_delta_speed_quick_compares_policies_in_one_run(tmp_path):
    out = tmp_path / "speed.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "delta_speed.py"), "--quick",
                        "--rounds", "1", "--deltas", "3", "--policies",
                        "v1-lossy-compact,lossy-capped,floor", "--out", str(tmp_path),
                        "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(out.read_text())
    res = doc["policies"]
    assert set(res) == {"v1-lossy-compact", "lossy-capped", "floor"}
    assert res["v1-lossy-compact"]["x_time"] == 1.0
    for n in ("v1-lossy-compact", "lossy-capped"):
        r = res[n]
        assert r["s"] > 0 and r["bytes"] > 0 and r["x_per_mb"] > 0
        # every stored element is counted (the quantized preset stores more per byte)
        assert 0 < r["elems"] < r["bytes"]
    # the floor stores no element of the state, only what is stored whole whatever the
    # rule (AdamW's step counters, which change at every step)
    assert res["floor"]["elems"] < 0.01 * res["lossy-capped"]["elems"]
    assert doc["floor_s"] == res["floor"]["s"] > 0
    assert 0 < res["floor"]["fastest_s"] <= res["floor"]["s"]
    cap = res["lossy-capped"]
    assert cap["parity_s"] > 0 and cap["parity_above_floor"] == (cap["parity_s"] >= doc["floor_s"])
    # the figures are consistent with their definitions (not a timing claim: on this
    # tiny model a delta may come out under the floor's median)
    v1 = res["v1-lossy-compact"]
    above = (cap["s"] - doc["floor_s"]) / cap["elems"]
    above0 = (v1["s"] - doc["floor_s"]) / v1["elems"]
    assert cap["above_floor_s_per_elem"] == pytest.approx(above)
    if above0 > 0:
        assert cap["x_above_floor_per_elem"] == pytest.approx(above / above0)
    else:
        assert cap["x_above_floor_per_elem"] is None
    assert "x per MB" in p.stdout and "floor: a delta that stores nothing" in p.stdout
    assert not list(tmp_path.glob("amber-delta-speed-*"))  # its store is removed


def test_tiers_bench_quick_reports_every_figure_and_target(tmp_path):
    """bench/tiers_bench.py (small model, one process and 2 ranks): every figure, the
    three targets with their bounds, and the many-rank restarts from each tier."""
    out = tmp_path / "tiers.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "tiers_bench.py"), "--quick",
                        "--deltas", "2", "--ranks", "2", "--timeout", "240",
                        "--out", str(tmp_path / "scratch"), "--json", str(out)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(out.read_text())
    F = res["figures"]
    for k in ("stall_disk", "stall_tiers", "stall_tc", "restore_memory", "dcp_load_cold",
              "copy_floor"):
        assert k in F and math.isfinite(F[k]["median"]) and F[k]["median"] > 0, k
    assert len(res["targets"]) == 3 and all(isinstance(t["met"], bool) for t in res["targets"])
    two = res["ranks"]["2"]
    for k in ("stall", "restore_memory", "restore_peer", "restore_durable_cold",
              "dcp_load_cold", "replica_pct_of_shard"):
        assert two[k]["median"] > 0, k
    assert two["replica_pct_of_shard"]["median"] < 100  # one delta, not the whole shard


def test_s3_bench_quick_compares_amber_with_its_peers_on_one_server(tmp_path):
    """bench/s3_bench.py (small model) against its local S3 server: amber's full, delta
    and load beside DCP's fsspec writer and s3torchconnector's, and the floors."""
    pytest.importorskip("moto")
    out = tmp_path / "s3.json"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "s3_bench.py"), "--quick",
                        "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    F = json.loads(out.read_text())["figures"]
    for s in ("amber_lossy", "dcp_fsspec", "s3torchconnector"):
        for what in ("full", "delta", "load"):
            assert F[f"{s}_{what}"]["median"] > 0 and F[f"{s}_{what}_requests"]["median"] > 0
    for k in ("floor_put", "floor_get", "floor_get_whole"):
        assert F[k]["median"] > 0, k
    # a delta uploads a small part of what a full does; the peers upload the whole state
    assert F["amber_lossy_delta_up"]["median"] < 0.2 * F["amber_lossy_full_up"]["median"]
    assert F["dcp_fsspec_delta_up"]["median"] > 0.9 * F["dcp_fsspec_full_up"]["median"]
