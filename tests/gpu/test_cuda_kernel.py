"""The accelerator path on a CUDA GPU (run by tests/gpu/run.sh; skipped without one).

- libamber_cuda's kernels select exactly what the portable path selects (which
  tests/python/test_device_path.py holds to the C scan), for exact and threshold over
  f32, f16, bf16, f64 and integers, with NaN, Inf, subnormals, changes on the bound
  and sizes that are not a multiple of a tile.
- A trajectory of CUDA tensors saved through the device path (kernels on and off)
  restores at every step exactly what the same trajectory of CPU tensors saved through
  the CPU path restores."""
import pytest
import torch

import amber
from amber import device
from amber.torch import Checkpointer

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
lib = pytest.mark.skipif(device._cuda_lib() is None, reason="libamber_cuda was not built")
CODES = {torch.float32: amber.F32, torch.float16: amber.F16, torch.bfloat16: amber.BF16,
         torch.float64: amber.F64, torch.int32: amber.I32, torch.uint8: amber.U8}


def pair(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if not dtype.is_floating_point:
        r = torch.randint(0, 100, (n,), generator=g).to(dtype)
        x = r.clone()
        x[torch.rand(n, generator=g) < 0.1] += 1
        return x, r
    r = torch.randn(n, generator=g, dtype=torch.float64)
    d = torch.randn(n, generator=g, dtype=torch.float64) * 1e-3
    d[torch.rand(n, generator=g) < 0.05] *= 100
    x, r = (r + d).to(dtype), r.to(dtype)
    special = [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, 1e-40, 5e-45]
    for k, v in enumerate(special):
        if n > 2 * k + 1:
            x[2 * k] = v
            r[2 * k + 1] = v
    if n > 20:
        r[20], x[20] = 1.0, 1.0 + 1e-3  # on the bound of threshold:1e-3
    return x, r


def portable(x, r, kind, a, b):
    if kind == "exact" or not x.dtype.is_floating_point:
        return (device._bits(x) != device._bits(r)).nonzero().squeeze(1)
    if x.dtype != torch.float64:
        a, b = device._f32_down(a), device._f32_down(b)
    return device._candidates(x, r, a, b, float("inf"), False)[0]


@cuda
@lib
@pytest.mark.parametrize("dtype", list(CODES))
@pytest.mark.parametrize("n", [0, 1, 2047, 2048, 2049, 100_003, 3 << 20])
@pytest.mark.parametrize("policy", [("exact", 0, 0), ("threshold", 1e-3, 0),
                                    ("threshold", 1e-4, 1e-2)])
def test_kernels_select_what_the_portable_path_selects(dtype, n, policy):
    kind, a, b = policy
    x, r = pair(n, dtype, n)
    want = portable(x, r, kind, a, b)
    if kind == "threshold" and dtype != torch.float64:
        a, b = device._f32_down(a), device._f32_down(b)
    k = "exact" if not dtype.is_floating_point else kind
    got = device._kernel_indices(x.cuda(), r.cuda(), k, CODES[dtype], a, b)
    torch.cuda.synchronize()
    assert got is not None
    assert torch.equal(got.cpu(), want), f"{dtype} n={n} {policy}"


def run(path, dev, policy, monkeypatch, kernel):
    monkeypatch.setenv("AMBER_CUDA_KERNEL", "1" if kernel else "0")
    g = torch.Generator().manual_seed(1)
    ts = {"a": torch.randn(300_000, generator=g), "b": torch.randn(5000, generator=g).half(),
          "c": torch.randn(7000, generator=g).double(), "d": torch.zeros(999, dtype=torch.int32)}
    live = {k: v.to(dev) for k, v in ts.items()}
    out = []
    with Checkpointer(path, policy=policy, chunk_elems=65536, rng=False, full_every=100) as ck:
        for step in range(1, 10):
            for k, v in ts.items():
                if v.dtype.is_floating_point:
                    v += (torch.randn(v.shape, generator=g) * 1e-3).to(v.dtype)
                else:
                    v[step * 7] += step
                live[k].copy_(v)
            ck.save(step, {"s": live})
            ck.wait()
            with amber.Store(path, readonly=True) as st, st.reader() as r:
                out.append({t.name: bytes(r.read(t.index)) for t in r.tensors()})
    return out


@cuda
@pytest.mark.parametrize("kernel", [False, True])
@pytest.mark.parametrize("policy", ["exact", "threshold:1e-3:1e-2", "budget:0.05:1e-2", "lossy"])
def test_cuda_tensors_restore_what_the_cpu_path_restores(tmp_path, monkeypatch, kernel, policy):
    if kernel and device._cuda_lib() is None:
        pytest.skip("libamber_cuda was not built")
    monkeypatch.setenv("AMBER_DEVICE_PATH", "0")
    want = run(str(tmp_path / "cpu"), "cpu", policy, monkeypatch, False)
    got = run(str(tmp_path / "gpu"), "cuda", policy, monkeypatch, kernel)
    for step, (a, b) in enumerate(zip(want, got), 1):
        for name in a:
            assert a[name] == b[name], f"step {step}: {name} differs"
