"""Shared set-up of the Python tests.

The tests import the *installed* package `amber` (scripts/setup --python installs it
into .venv in editable mode, with libamber built by its CMake), so they check what a
user gets from `pip install`: no sys.path edits, no AMBER_LIBRARY. amber is imported
before torch so that a broken install fails here with amber's own message.

Randomized race and kill tests run `trials` times: AMBER_TRIALS (default 3 in
`make test`, more in `make test-long`), seeded from AMBER_SEED (default: from the
clock); the seeds are printed, so a failure can be replayed with AMBER_SEED.
"""
import os
import subprocess
import sys
import time

import amber  # noqa: F401  (first: a broken install must fail with amber's message)
import pytest
import torch

torch.set_num_threads(2)
PYTHON = sys.executable
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TRIALS = int(os.environ.get("AMBER_TRIALS", "3"))
SEED = int(os.environ.get("AMBER_SEED", str(int(time.time()) % 100000)))


def spec_bound(spec, unit=0.0):
    """(ABS, REL) of the bound a policy SPEC keeps, as the library reads it: a value
    code ("@q8+lead") does not change it; "Nu" is N * unit, and a rule with units on
    a tensor without one (unit 0) is exact; a budget's bound is its CAP; a
    threshold's share cap ("/SHARE:MULT") makes it MULT times the threshold's."""
    import math
    spec, _, share = spec.partition("@")[0].partition("/")
    mult = float(share.partition(":")[2]) if share else 1.0
    kind, *args = spec.split(":")
    has_units = any(a.endswith("u") for a in args)
    if kind == "exact" or (has_units and not unit):
        return 0.0, 0.0

    def num(a):
        return float(a[:-1]) * unit if a.endswith("u") else float(a)
    if kind == "threshold":
        return mult * num(args[0]), mult * (float(args[1]) if len(args) > 1 else 0.0)
    if kind == "budget":
        return (num(args[1]) if len(args) > 1 else math.inf), 0.0
    raise ValueError(f"unknown policy {spec!r}")


def rules_bound(rules, name, unit=0.0):
    """The (ABS, REL) bound of tensor `name` under a list of rules: the last one whose
    pattern matches."""
    import fnmatch
    bound = (0.0, 0.0)
    for rule in rules:
        pattern, _, spec = rule.rpartition("=")
        if not pattern or fnmatch.fnmatchcase(name, pattern):
            bound = spec_bound(spec, unit)
    return bound


def run_python(*args, check=True, timeout=120, env=None):
    """Runs this interpreter on ARGS in a fresh process (same installed amber)."""
    p = subprocess.run([PYTHON, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


def step_log(path):
    """{step: digest} from a worker's --log file (one "STEP DIGEST" line per committed
    save; a line cut by a kill is ignored)."""
    out = {}
    if os.path.exists(path):
        for line in open(path):
            parts = line.split()
            if len(parts) == 2:
                out[int(parts[0])] = parts[1]
    return out


def trial_seeds(name):
    """The seeds of a randomized test's trials, printed so that a failure can be replayed."""
    seeds = [SEED + i for i in range(TRIALS)]
    print(f"{name}: {TRIALS} trials, AMBER_SEED={SEED} (seeds {seeds[0]}..{seeds[-1]})")
    return seeds


@pytest.fixture
def trials(request):
    return trial_seeds(request.node.name)


@pytest.fixture
def store(tmp_path):
    return str(tmp_path / "store")
