#!/usr/bin/env bash
# On a machine with a CUDA GPU (tests/gpu/test_cuda_kernel.py is skipped elsewhere):
# builds libamber and libamber_cuda (nvcc), checks the fused kernel (indices, values,
# olds and the moved reference, every dtype and policy) against the portable path and
# the device path on CUDA tensors against the CPU path (selecting in line and on a
# thread), then runs bench/gpu_bench.py on GPT-2 small (torch operations, then
# kernel + thread) and on 0.5B parameters (kernel + thread). Output goes to
# ${OUT:-gpu-out}/ (a log per part).
#
# Needs: nvcc, CMake, a Python with torch (CUDA), numpy and pytest; zstd and xxHash
# headers and libraries where pkg-config finds them (on a machine without them,
# unpack Debian's libzstd-dev and libxxhash-dev with `dpkg -x` into a prefix and pass
# it as DEPS=/that/prefix).
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
  > "$OUT/cmake.log" 2>&1
cmake --build build-gpu -j "$(nproc)" >> "$OUT/cmake.log" 2>&1
export PYTHONPATH="$PWD/python${PYTHONPATH:+:$PYTHONPATH}" AMBER_LIBRARY="$PWD/build-gpu/libamber.so"
$PY -c 'import amber, amber.device as d; print("amber", amber.__file__, "cuda lib", d._cuda_lib())'
status=0
# (the glue tests over a model of the kernel need no GPU: they run everywhere)
$PY -m pytest -q -rs tests/gpu/test_cuda_kernel.py -k "not glue" 2>&1 \
  | tee "$OUT/test_cuda_kernel.log" || status=1
AMBER_DEVICE_ASYNC=1 $PY -m pytest -q -rs tests/gpu/test_cuda_kernel.py -k restore 2>&1 \
  | tee "$OUT/test_cuda_async.log" || status=1
AMBER_DEVICE_PATH=1 $PY -m pytest -q -rs tests/python/test_device_path.py 2>&1 \
  | tee "$OUT/test_device_path.log" || status=1
if [ "${BENCH:-1}" = 1 ]; then
  $PY bench/gpu_bench.py --size 124m --out "${TMPDIR:-/tmp}/gpu-bench" 2>&1 \
    | tee "$OUT/gpu_bench_124m_portable.log" || status=1
  for size in 124m 0.5b; do
    AMBER_CUDA_KERNEL=1 AMBER_DEVICE_ASYNC=1 $PY bench/gpu_bench.py --size "$size" \
      --out "${TMPDIR:-/tmp}/gpu-bench" 2>&1 | tee "$OUT/gpu_bench_$size.log" || status=1
  done
fi
exit $status
