"""Shared set-up of the Python tests: the package from python/ of this tree, the
library from AMBER_LIBRARY (scripts/run-tests points it at build/libamber.so),
two torch threads, and a helper that runs a script in a fresh interpreter."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PYDIR = os.path.join(ROOT, "python")
if PYDIR not in sys.path:
    sys.path.insert(0, PYDIR)

import torch  # noqa: E402

torch.set_num_threads(2)
PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
HERE = os.path.dirname(os.path.abspath(__file__))


def run_python(*args, check=True, timeout=120):
    """Runs `python3 ARGS...` in a fresh process with this tree's package."""
    env = dict(os.environ)
    env["PYTHONPATH"] = PYDIR + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([PYTHON, *args], env=env, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{args} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p


@pytest.fixture
def store(tmp_path):
    return str(tmp_path / "store")
