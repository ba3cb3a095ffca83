"""Resume in a fresh process: a run SIGKILLed right after a save resumes from the
store, bit-exactly (the next steps' losses and the final state are identical to an
uninterrupted run's, with dropout and data noise so every RNG matters), and a
fresh process loading an earlier step gets exactly that step's state."""
import json
import os
import random

from conftest import HERE, run_python

WORKER = os.path.join(HERE, "train_worker.py")


def worker(*args, check=True):
    p = run_python(WORKER, *args, check=check)
    return p, (json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else None)


def test_resume_after_sigkill_is_bit_exact_with_exact_policy(tmp_path, trials):
    """SIGKILL right after the save of a random step (AMBER_TRIALS trials, seeded)."""
    _, ref = worker(str(tmp_path / "ref"), "--steps", "10")
    for seed in trials:
        kill_at = random.Random(seed).randint(2, 9)
        run = str(tmp_path / f"run-{seed}")
        killed, _ = worker(run, "--steps", "10", "--kill-at", str(kill_at), check=False)
        assert killed.returncode == -9, killed.stderr
        _, rest = worker(run, "--steps", "10", "--resume")
        start = rest["start"]
        # the save of the killed step may or may not have committed
        assert kill_at - 1 <= start <= kill_at, (seed, kill_at, start)
        assert rest["losses"] and list(rest["losses"]) == [str(s) for s in range(start + 1, 11)]
        for s, loss in rest["losses"].items():
            assert loss == ref["losses"][s], \
                f"seed {seed}, killed at {kill_at}: step {s}: resumed loss {loss!r} != {ref['losses'][s]!r}"
        assert rest["digests"]["10"] == ref["digests"]["10"], (seed, kill_at)


def test_fresh_process_loads_exactly_an_earlier_step(tmp_path):
    store = str(tmp_path / "ref")
    _, ref = worker(store, "--steps", "8")
    for step in ("3", "8"):
        _, got = worker(store, "--load-only", step)
        assert got["start"] == int(step)
        assert got["digests"][step] == ref["digests"][step]
        assert got["extra"] == {"data_pos": int(step)}


def test_lossy_resume_stays_close(tmp_path):
    _, ref = worker(str(tmp_path / "ref"), "--steps", "10", "--policy", "lossy")
    worker(str(tmp_path / "run"), "--steps", "6", "--policy", "lossy")
    _, rest = worker(str(tmp_path / "run"), "--steps", "10", "--resume", "--policy", "lossy")
    assert rest["start"] == 6
    for s, loss in rest["losses"].items():
        assert abs(loss - ref["losses"][s]) <= 0.05 * abs(ref["losses"][s])
