#!/usr/bin/env bash
# `make install` works for consumers: installs into a temporary prefix, then builds
# and runs a program against it through pkg-config and through find_package(amber);
# where libamber_mpi was built (MPI found), builds examples/train_mpi.c against it
# through `pkg-config amber_mpi` and, where mpirun is there, runs it at 2 ranks.
set -euo pipefail
build=$1
src=$(cd "$(dirname "$0")/.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
cmake --install "$build" --prefix "$tmp/prefix" >/dev/null
for f in include/amber.h lib/libamber.a lib/libamber.so lib/pkgconfig/amber.pc bin/amber \
         lib/cmake/amber/amberConfig.cmake; do
  [ -e "$tmp/prefix/$f" ] || { echo "missing after install: $f"; exit 1; }
done
readlink "$tmp/prefix/lib/libamber.so" | grep -q '^libamber.so.0' || { echo "no versioned soname"; exit 1; }
# The library's boundary: it needs no JSON library (the CLI's safetensors code and
# --json output use jansson, on the CLI's side), and installs one header (besides
# amber_mpi.h of the optional libamber_mpi, which alone needs MPI).
if readelf -d "$tmp/prefix/lib/libamber.so" | grep -qi jansson; then
  echo "libamber.so needs jansson"; exit 1
fi
if grep -qi jansson "$tmp/prefix/lib/pkgconfig/amber.pc" "$tmp/prefix/lib/cmake/amber/"*.cmake; then
  echo "amber.pc or the CMake package asks for jansson"; exit 1
fi
headers=$(ls "$tmp/prefix/include" | tr '\n' ' ')
case "$headers" in
  "amber.h " | "amber.h amber_mpi.h ") ;;
  *) echo "headers other than amber.h (and amber_mpi.h) installed: $headers"; exit 1 ;;
esac
if readelf -d "$tmp/prefix/lib/libamber.so" | grep -qi mpi; then
  echo "libamber.so needs MPI"; exit 1
fi
cat > "$tmp/use.c" <<'C'
#include <amber.h>
#include <stdio.h>
#include <string.h>
int main(void) {
  if (strcmp(amber_version_string(), AMBER_VERSION_STRING) != 0) return 1;
  printf("linked amber %s\n", amber_version_string());
  return 0;
}
C
export PKG_CONFIG_PATH="$tmp/prefix/lib/pkgconfig"
cc "$tmp/use.c" $(pkg-config --cflags --libs amber) -Wl,-rpath,"$tmp/prefix/lib" -o "$tmp/use"
"$tmp/use"
mkdir "$tmp/cm"
cat > "$tmp/cm/CMakeLists.txt" <<'C'
cmake_minimum_required(VERSION 3.18)
project(use C)
find_package(amber REQUIRED)
add_executable(use ../use.c)
target_link_libraries(use amber::amber)
C
cmake -S "$tmp/cm" -B "$tmp/cm/b" -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/cm/b" >/dev/null
"$tmp/cm/b/use"
if [ -e "$tmp/prefix/lib/libamber_mpi.so" ]; then
  [ -e "$tmp/prefix/lib/pkgconfig/amber_mpi.pc" ] || { echo "missing after install: lib/pkgconfig/amber_mpi.pc"; exit 1; }
  cc -D_GNU_SOURCE "$src/examples/train_mpi.c" $(pkg-config --cflags --libs amber_mpi) -lm \
     -Wl,-rpath,"$tmp/prefix/lib" -o "$tmp/train_mpi"
  if command -v mpirun >/dev/null; then
    OMPI_MCA_btl_vader_single_copy_mechanism=none timeout -k 10 120 \
      mpirun --allow-run-as-root --oversubscribe -np 2 "$tmp/train_mpi" "$tmp/mpi-store" --steps 3 \
      >"$tmp/mpi.log" 2>&1 || { cat "$tmp/mpi.log"; echo "train_mpi failed"; exit 1; }
    echo "train_mpi built with pkg-config amber_mpi, ran at 2 ranks"
  else
    echo "train_mpi built with pkg-config amber_mpi (no mpirun: not run)"
  fi
else
  echo "no libamber_mpi (MPI not found at configure): amber_mpi.pc part skipped"
fi
echo "1 passed, 0 failed"
