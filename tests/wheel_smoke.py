"""A smoke test of an installed amber, as a release build runs it on each wheel
(cibuildwheel's test-command in pyproject.toml; tests/python/test_wheel.py runs it on
the wheel it builds). Needs only the package, not torch: two saves of a float32 tensor
through the binding (a full, then a delta: zstd and xxHash at work), a restore of the
latest, and the wheel's `amber` CLI listing the store as JSON (Jansson at work). Run it
with the Python of the environment under test, from any directory; it leaves nothing
behind.

    python tests/wheel_smoke.py
"""
import array
import json
import os
import subprocess
import sysconfig
import tempfile

import amber


def main():
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "store")
        data = array.array("f", (i * 0.25 for i in range(4096)))
        address, n = data.buffer_info()
        with amber.Store(path) as store:
            with store.writer() as w:
                w.add("w", amber.F32, (n,), address)
                w.save(1)
                data[7] = 3.5
                w.save(2)
            with store.reader() as r:
                assert r.step == 2 and r.checkpoint().kind == "delta", r.checkpoint()
                assert r.read(r.find("w")) == data.tobytes()
        cli = os.path.join(sysconfig.get_path("scripts"), "amber")
        out = subprocess.run([cli, "ls", path, "--json"], check=True, capture_output=True,
                             text=True).stdout
        steps = [(c["step"], c["kind"]) for c in json.loads(out)]
        assert steps == [(1, "full"), (2, "delta")], out
    print(f"amber {amber.__version__} ({amber.library_path()}): save, delta, restore, CLI ok")


if __name__ == "__main__":
    main()
