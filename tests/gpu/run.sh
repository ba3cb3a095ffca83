#!/usr/bin/env bash
# On a machine with a CUDA GPU (tests/gpu/test_cuda_kernel.py is skipped elsewhere):
# builds libamber and libamber_cuda (nvcc), checks the fused kernel (indices, values,
# olds and the moved reference, every dtype and policy) and its quantizer (codes,
# escapes, steps, restored values) against the portable path and
# the device path on CUDA tensors against the CPU path (selecting in line and on a
# thread), then runs bench/gpu_bench.py on GPT-2 small (torch operations, then
# kernel + thread) and on 0.5B parameters (kernel + thread). Output goes to
# ${OUT:-gpu-out}/ (a log per part).
#
# Needs: nvcc, CMake, a Python with torch (CUDA), numpy and pytest; zstd, xxHash and
# jansson headers and libraries (pkg-config is not needed). On a machine without them
# run scripts/gpu-prep here first: it unpacks Debian's packages into .gpu-deps/root,
# which the device tool carries (carry=[".gpu-deps"]) and DEPS names there:
#   DEPS=$PWD/.gpu-deps/root OUT=$OUT tests/gpu/run.sh
#   tests/gpu/run.sh                 # everything
#   BENCH=0 tests/gpu/run.sh         # the tests only
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
if [ -n "${DEPS:-}" ]; then
  ml=$(ls -d "$DEPS"/usr/lib/*-linux-gnu 2>/dev/null | head -1)
  export PKG_CONFIG_PATH="$ml/pkgconfig:$DEPS/usr/share/pkgconfig:${PKG_CONFIG_PATH:-}"
  export CPATH="$DEPS/usr/include:${CPATH:-}" LIBRARY_PATH="$ml:${LIBRARY_PATH:-}"
  export LD_LIBRARY_PATH="$ml:${LD_LIBRARY_PATH:-}"
fi
arch=$($PY -c 'import torch; c = torch.cuda.get_device_capability(); print(f"{c[0]}{c[1]}")')
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DAMBER_TESTS=OFF -DAMBER_CUDA_ARCHS="$arch" \
  ${DEPS:+-DCMAKE_PREFIX_PATH="$DEPS/usr"} \
  > "$OUT/cmake.log" 2>&1
cmake --build build-gpu -j "$(nproc)" >> "$OUT/cmake.log" 2>&1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" AMBER_LIBRARY="$PWD/build-gpu/libamber.so"
$PY -c 'import amber, amber.device as d; print("amber", amber.__file__, "cuda lib", d._cuda_lib())'
status=0
# (the tests over a model of the kernel need no GPU: make test runs them)
$PY -m pytest -q -rs tests/gpu/test_cuda_kernel.py -k "not glue and not fused_select" 2>&1 \
  | tee "$OUT/test_cuda_kernel.log" || status=1
AMBER_DEVICE_ASYNC=1 $PY -m pytest -q -rs tests/gpu/test_cuda_kernel.py \
  -k "restore and not glue and not fused_select" 2>&1 \
  | tee "$OUT/test_cuda_async.log" || status=1
AMBER_DEVICE_PATH=1 $PY -m pytest -q -rs tests/python/test_device_path.py 2>&1 \
  | tee "$OUT/test_device_path.log" || status=1
# one selection of 2^28 elements with 3% changed: the fused kernel against the
# portable path (time per selection, the count's sync included; GB/s of live and
# reference read)
$PY - <<'EOF' 2>&1 | tee "$OUT/kernel_speed.log" || status=1
import time
import torch
import amber
from amber import _cuda, _quant, _select, device


def timed(f, reps=5):
    f()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


n = 1 << 28
for dt, code in [(torch.float32, amber.F32), (torch.bfloat16, amber.BF16)]:
    r = torch.randn(n, device="cuda").to(dt)
    d = torch.randn(n, device="cuda") * 1e-2
    d[torch.rand(n, device="cuda") > 0.03] = 0
    x = (r.float() + d).to(dt)
    del d
    a = _select.f32_down(1e-3)
    tk = timed(lambda: _cuda.indices(x, r, "threshold", code, a, 0.0))
    tp = timed(lambda: _select.candidates(x, r, a, 0.0, float("inf"), False)[0])
    tb = timed(lambda: _cuda.indices(x, r, "budget", code, 0.01, float("inf"), 1 << 20, n >> 20))
    ts = timed(lambda: _cuda.select(x, r.clone(), "threshold:1e-3", code, 1 << 20, n >> 20))
    idx, vals, olds = _cuda.select(x, r.clone(), "threshold:1e-3", code, 1 << 20, n >> 20)
    rl = _quant.rule("threshold", 1e-3, 0.0, "threshold:1e-3@q8", dt)
    tq = timed(lambda: _cuda.quantize(rl, code, vals, olds, idx, 1 << 20, n >> 20))
    tt = timed(lambda: _quant.quantize(rl, vals.view(dt), olds.view(dt), idx >> 20, n >> 20))
    gb = 2 * n * x.element_size() / 1e9
    print(f"{dt} n=2^28: kernel threshold {tk * 1e3:.2f} ms ({gb / tk:.0f} GB/s), portable "
          f"{tp * 1e3:.2f} ms ({gb / tp:.0f} GB/s), kernel budget:0.01 {tb * 1e3:.2f} ms, "
          f"select with the reference moved (and a clone) {ts * 1e3:.2f} ms; "
          f"@q8 of its {idx.numel()} selected: kernel {tq * 1e3:.2f} ms, torch "
          f"{tt * 1e3:.2f} ms")
    del x, r
EOF
if [ "${BENCH:-1}" = 1 ]; then
  $PY bench/gpu_bench.py --size 124m --out "${TMPDIR:-/tmp}/gpu-bench" 2>&1 \
    | tee "$OUT/gpu_bench_124m_portable.log" || status=1
  for size in 124m 0.5b; do
    AMBER_CUDA_KERNEL=1 AMBER_DEVICE_ASYNC=1 $PY bench/gpu_bench.py --size "$size" \
      --out "${TMPDIR:-/tmp}/gpu-bench" 2>&1 | tee "$OUT/gpu_bench_$size.log" || status=1
  done
fi
exit $status
