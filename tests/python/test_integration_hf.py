"""amber.integrations.hf with the real transformers Trainer (no mocks).

A tiny GPT-2 built from a config (tests/python/hf_worker.py) trains 20 steps with
AmberTrainer, saving every step. Four runs start together: an uninterrupted one
(which also snapshots what each save holds and exports its last step), two under
"exact" SIGKILLed mid-run (one mid-epoch, one right after the save that ends the
first epoch) and one under the "lossy" preset SIGKILLed mid-run; the killed ones are
then resumed with resume_from_checkpoint=True, while examples/hf_trainer.py runs as
written with a few steps. Every process is bounded in time and killed if the test
leaves early.
"""
import os

import pytest
import torch
from safetensors.torch import load_file

import amber
from amber.torch import LOSSY
from conftest import rules_bound, spec_bound
from hf_procs import HERE, PYTHON, Proc, procs

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(HERE)), "examples", "hf_trainer.py")

WORKER = os.path.join(HERE, "hf_worker.py")
TIMEOUT = 180
STEPS = 20


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    out = {k: str(d / k) for k in ("ref", "mid", "edge", "lossy")}
    with procs() as ps:
        ps.append(Proc([PYTHON, WORKER, out["ref"], "--snapshots", "--errors",
                        "--export", os.path.join(out["ref"], "export")]))
        # each pauses at the end of step 7 (13), before its save, and is killed there
        ps.append(Proc([PYTHON, WORKER, out["mid"], "--pause-at", "7"]))
        ps.append(Proc([PYTHON, WORKER, out["edge"], "--pause-at", "13", "--sync"]))
        # every save after the first a delta, whatever its size: the tiny model's
        # updates are large against the preset's caps, and deltas that big would make
        # the cadence write full checkpoints instead (full_share)
        ps.append(Proc([PYTHON, WORKER, out["lossy"], "--pause-at", "7", "--policy", "lossy",
                        "--deltas"]))
        ref, mid, edge, lossy = ps
        for p, line in ((mid, "step 7"), (edge, "step 13"), (lossy, "step 7")):
            p.wait_line(line, TIMEOUT)
            p.kill()
            assert p.p.returncode == -9 and f"step {STEPS}" not in p.lines, p.report()
        resumed = [Proc([PYTHON, WORKER, out[k], "--resume", *more,
                         "--restored", os.path.join(out[k], "restored.safetensors")])
                   for k, more in (("mid", []), ("edge", []),
                                   ("lossy", ["--policy", "lossy", "--deltas"]))]
        ps.extend(resumed)
        example = Proc([PYTHON, EXAMPLE, "--out", d / "example", "--steps", "12"])
        ps.append(example)
        res = {"ref": ref}
        ref.finish(TIMEOUT)
        for k, p in zip(("mid", "edge", "lossy"), resumed):
            p.finish(TIMEOUT)
            res[k] = p
        example.finish(TIMEOUT)
    runs = {k: (out[k], p.result()) for k, p in res.items()}
    runs["example"] = (str(d / "example"), example.lines)
    return runs


def _same_state(a_dir, b_dir):
    a = load_file(os.path.join(a_dir, "final.safetensors"))
    b = load_file(os.path.join(b_dir, "final.safetensors"))
    assert sorted(a) == sorted(b)
    assert any(k.endswith("/exp_avg_sq") for k in a), "the optimizer state is compared too"
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    assert not diff, f"{len(diff)} tensors differ, e.g. {diff[:3]}"


def _resumed_bit_identical(runs, name, first, last):
    ref_dir, ref = runs["ref"]
    run_dir, got = runs[name]
    assert first <= got["start"] <= last, got["start"]
    assert got["global_step"] == STEPS
    # the log history comes back with the TrainerState: every step's loss, bit for bit
    assert got["losses"] == ref["losses"] and len(ref["losses"]) == STEPS
    assert got["lr"] == ref["lr"]
    _same_state(ref_dir, run_dir)
    # the load of the latest step seeded the writer's reference: the next delta
    # reads nothing back from the store
    assert got["seeded"] is True


def test_sigkill_mid_epoch_then_resume_is_bit_identical_under_exact(runs):
    # killed at the end of step 7, before its save: the last commit is at most step 6
    # (or before, while the save of 6 was still being written); the resume skips the
    # epoch's seen batches and restores the RNG after them
    _resumed_bit_identical(runs, "mid", 1, 6)


def test_sigkill_after_the_epochs_last_save_then_resume_is_bit_identical(runs):
    # 12 steps per epoch, and save 12 was durable before the kill (--sync): the resume
    # starts the next epoch, the Trainer's other RNG path
    _resumed_bit_identical(runs, "edge", 12, 12)


def _recorded_bounds(store, step):
    """{tensor name: (ABS, REL)} as the delta of `step` records them (units written
    out: the weight rule's "1u" is the learning rate of that step), after checking each
    against the preset's rules: units only where the preset has them, one unit for
    every parameter under each of its names (one param group; a tied weight's second
    name too; buffers have none: exact), optimizer step counters exact."""
    with amber.Store(store, readonly=True) as st, st.reader(step) as r:
        recorded = {t.name: spec_bound(t.policy) for t in r.tensors()}
    units = set()
    for name, got in recorded.items():
        if name.startswith("optim/") and name.endswith("/step"):
            assert got == (0.0, 0.0), (name, got)
            continue
        rule = rules_bound(LOSSY, name, unit=1.0)
        if rules_bound(LOSSY, name, unit=2.0) != rule:  # a rule in units of the LR
            if got == (0.0, 0.0):  # no unit: a buffer (exact)
                continue
            assert got[0] > 0 and got[1] == rule[1], (name, got)
            units.add(got[0] / rule[0])
        else:
            assert got == pytest.approx(rule, rel=1e-12), (name, got)
    assert len(units) == 1 and 0 < units.pop() <= 3e-3, "one unit: the step's LR"
    assert recorded["model/lm_head.weight"][0] > 0, "the tied weight's second name has a unit"
    return recorded


def test_lossy_resume_restores_every_element_within_the_presets_bound(runs):
    ref_dir, _ = runs["ref"]
    run_dir, got = runs["lossy"]
    step = got["start"]
    assert 2 <= step <= 6, step
    with amber.Store(os.path.join(run_dir, "amber"), readonly=True) as st:
        assert {c.step: c.kind for c in st.list()}[step] == "delta"
    bounds = _recorded_bounds(os.path.join(run_dir, "amber"), step)
    saved = load_file(os.path.join(ref_dir, f"snap-{step}.safetensors"))
    restored = load_file(os.path.join(run_dir, "restored.safetensors"))
    assert sorted(saved) == sorted(restored)
    off = 0
    for name, true in saved.items():
        r = restored[name].double()
        err = (true.double() - r).abs()
        abs_, rel = bounds[name]
        bound = abs_ + rel * r.abs()
        worst = (err - bound * (1 + 1e-6)).max().item()
        assert worst <= 1e-12, f"{name}: {worst} past the bound {bounds[name]}"
        off += int((err > 0).sum())
    assert off > 0, "nothing was left out: the lossy preset was not in effect"
    assert got["global_step"] == STEPS


def test_the_example_runs_as_written(runs):
    out, lines = runs["example"]
    assert "exported step 12 to " + os.path.join(out, "final") in " ".join(filter(None, lines)), lines
    assert sorted(os.listdir(out)) == ["amber", "final"]  # no checkpoint-N/
    assert sorted(os.listdir(os.path.join(out, "final"))) == ["config.json", "model.safetensors"]
    with amber.Store(os.path.join(out, "amber"), readonly=True) as st:
        steps = [c.step for c in st.list()]
    # save_steps=5 and the last step; save_total_limit=2 (and the chain those need)
    assert steps[-2:] == [10, 12] and set(steps) <= {5, 10, 12}, steps


def test_the_trainer_writes_no_checkpoint_files_of_its_own(runs):
    ours = {"amber", "final.safetensors", "restored.safetensors", "export"}
    for name, (run_dir, _) in runs.items():
        if name == "example":
            continue
        top = set(os.listdir(run_dir))
        extra = {f for f in top - ours if not (f.startswith("snap-") and f.endswith(".safetensors"))}
        assert not extra, f"{name}: {sorted(extra)}"  # no checkpoint-N/, trainer_state.json, ...
        for _, dirs, files in os.walk(os.path.join(run_dir, "amber")):
            assert not dirs, dirs
            assert all(f == "LATEST" or f.startswith("ckpt-") or f.startswith(".") for f in files), files
        with amber.Store(os.path.join(run_dir, "amber"), readonly=True) as st:
            assert st.latest() == STEPS


def test_export_is_a_folder_that_from_pretrained_loads_with_the_trained_weights(runs):
    ref_dir, ref = runs["ref"]
    assert ref["exported_step"] == STEPS
    assert ref["export_class"] == "GPT2LMHeadModel"
    assert ref["export_same"] is True
    assert sorted(os.listdir(os.path.join(ref_dir, "export"))) == ["config.json", "model.safetensors"]


def test_misuse_is_refused_with_a_clear_error_before_anything_is_written(runs):
    _, ref = runs["ref"]
    errors = ref["errors"]
    assert "already holds steps up to 20" in errors["fresh_into_used_store"]
    assert "latest step is 20" in errors["resume_older_step"]
    assert "has no step 99" in errors["resume_missing_step"]
    assert "load_best_model_at_end" in errors["load_best_model_at_end"]
    assert "unknown ['keep_last']" in errors["bad_option"]
    assert "is an amber store" in errors["store_as_folder"]
    assert errors["latest_after"] == STEPS  # nothing of those reached the store
