#!/usr/bin/env bash
# Builds src/cuda/select.cu for the CPU emulator in this folder (cuda_runtime.h: each
# block on an OS thread, each CUDA thread a ucontext coroutine, warp intrinsics and
# __syncthreads as cooperative barriers) into ${1:-build/emu}/libamber_cuda_emu.so.
# The tests run the kernel's real source this way (AMBER_CUDA_EMU=that library, see
# tests/gpu/test_cuda_kernel.py) where no GPU is: its selection, compaction, look-back
# and reference update, though not the GPU's memory model or speed.
set -euo pipefail
cd "$(dirname "$0")/../../.."
out=${1:-build/emu}
mkdir -p "$out"
${CXX:-g++} -x c++ -std=c++17 -O2 -ffp-contract=off -fPIC -shared -pthread -DAMBER_CUDA_EMULATOR \
  -Itests/gpu/emu -include tests/gpu/emu/cuda_runtime.h src/cuda/select.cu \
  -o "$out/libamber_cuda_emu.so"
echo "$out/libamber_cuda_emu.so"
