"""The package as users install it: `pip wheel .` builds a wheel through the project's
CMake (scikit-build-core), the wheel installs into a throwaway virtual environment, and
from another directory, with no sys.path edits and no AMBER_LIBRARY, that environment's
`amber` (its library found as package data) saves and loads a model, and its `amber`
CLI lists the store."""
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(os.environ.get("AMBER_SKIP_WHEEL") == "1",
                                reason="AMBER_SKIP_WHEEL=1")


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def test_wheel_installs_and_saves_and_loads_from_another_directory(tmp_path):
    wheels = tmp_path / "wheels"
    # --no-build-isolation: the backend is in this environment (requirements-dev.txt), so
    # the build needs no network; the CMake build directory is the editable install's.
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), ROOT])
    (whl,) = list(wheels.glob("amber_ckpt-*.whl"))
    names = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(whl)], capture_output=True,
                           text=True, check=True).stdout
    assert "amber/libamber.so" in names and "amber/torch.py" in names, names

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = str(venv / "bin" / "python")
    run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q",
         str(whl)] if _pip_has_python_option() else
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--prefix", str(venv), str(whl)])
    # torch and numpy come from the test environment, after the venv's own site-packages,
    # so `amber` can only be the wheel's.
    site = run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    with open(os.path.join(site, "zz_test_deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")

    work = tmp_path / "elsewhere"
    work.mkdir()
    script = textwrap.dedent("""
        import os, sys, torch, amber
        from amber.torch import Checkpointer
        venv = sys.argv[1]
        assert amber.__file__.startswith(venv), amber.__file__
        assert amber.library_path().startswith(venv), amber.library_path()
        torch.manual_seed(0)
        m = torch.nn.Linear(5, 3)
        opt = torch.optim.AdamW(m.parameters())
        m(torch.randn(4, 5)).sum().backward(); opt.step()
        with Checkpointer("store") as ck:
            ck.save(1, {"model": m, "optim": opt})
        m2 = torch.nn.Linear(5, 3)
        opt2 = torch.optim.AdamW(m2.parameters())
        with Checkpointer("store") as ck:
            assert ck.load({"model": m2, "optim": opt2}) == 1
        assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
        print("ok", amber.version())
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("AMBER_LIBRARY", "PYTHONPATH")}
    p = run([py, "-c", script, str(venv)], cwd=work, env=env)
    assert p.stdout.startswith("ok"), p.stdout
    p = run([str(venv / "bin" / "amber"), "ls", "store"], cwd=work, env=env)
    assert "1" in p.stdout, p.stdout


def _pip_has_python_option():
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                         text=True).stdout.split()
    major, minor = (int(x) for x in out[1].split(".")[:2])
    return (major, minor) >= (22, 3)
