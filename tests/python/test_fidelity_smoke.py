"""bench/fidelity.py runs (a few steps, two seeds, SIGKILLs) and reports a sound JSON:
the exact policy's resumed runs end bit-identical to the uninterrupted ones, a lossy
policy's deltas are smaller than exact's, and every kill was resumed."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_fidelity_quick_run_reports_resumes_sizes_and_exact_bit_identity(tmp_path):
    out = tmp_path / "fid"
    p = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "fidelity.py"),
                        "--steps", "6", "--seeds", "2", "--ks", "2", "--policies",
                        "exact,lossy-compact", "--eval-seqs", "16", "--threads", "1",
                        "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    res = json.loads((out / "fidelity.json").read_text())
    u = res["uninterrupted"]
    assert len(u["final_eval"]) == 2 and u["sd"] > 0  # the seeds change the run
    pol = res["policies"]
    assert set(pol) == {"exact", "lossy-compact"}
    for name, p_ in pol.items():
        runs = p_["runs"]["2"]
        assert [r["seed"] for r in runs] == [0, 1]
        assert all(r["resumes"] == 2 for r in runs), runs  # killed after steps 2 and 4
    # exact: every resume restores the state bit-exactly (RNG included)
    assert all(r["bit_identical"] for r in pol["exact"]["runs"]["2"])
    assert pol["exact"]["K"]["2"]["error"] == {"W_rms_lr": 0.0, "M_rms_update": 0.0,
                                               "V_log_mean": 0.0, "V_log_rms": 0.0}
    assert pol["lossy-compact"]["delta_pct"] < pol["exact"]["delta_pct"]
    assert pol["lossy-compact"]["K"]["2"]["error"]["W_rms_lr"] > 0
    # every delta over 3% of a full checkpoint is broken down by class (exact's deltas
    # all are: a few steps change most of the state)
    runs = [json.loads(f.read_text()) for f in (out / "runs").glob("exact-*.json")]
    assert len(runs) == 2
    for r in runs:
        assert r["over_3pct"] and set(r["over_3pct_detail"]) == set(r["over_3pct"])
        for step, d in r["over_3pct_detail"].items():
            parts = sum(c["pct_of_full"] for c in d["classes"].values())
            # the tensors' payloads, without the file's header and index
            assert 0 < parts <= r["over_3pct"][step] + 1e-3
            assert all(0 <= c["elems_share"] <= 1 for c in d["classes"].values())
            assert 1 <= len(d["top"]) <= 3
            assert d["top"][0]["pct_of_full"] >= d["top"][-1]["pct_of_full"]
    assert (out / "fidelity.png").stat().st_size > 0
    assert not list(out.glob("store*"))  # the scratch stores are removed
