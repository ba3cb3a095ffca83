#!/bin/sh
# bench_ranks.sh AMBER - a tiny `amber bench --ranks` under mpirun at 2 ranks: it
# must run to the end and print each rank's save, the global commit's own cost and
# the single-rank save of the same bytes. Bounded by timeout; the bench removes
# its own directory.
set -u
# OpenMPI's shared-memory segments (a file per rank) go to a directory of this
# script's own, removed with it: a job killed on purpose leaves its segments behind.
shm=$(mktemp -d /dev/shm/amber-mpi-XXXXXX 2>/dev/null ||
      mktemp -d "${TMPDIR:-/tmp}/amber-mpi-shm-XXXXXX") || exit 1
export OMPI_MCA_btl_vader_backing_directory="$shm"
trap 'rm -rf "$shm"' EXIT
export OMPI_MCA_btl_vader_single_copy_mechanism=none
# OpenMPI's own allocations show as leaks under ASan (see run.sh).
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
out=$(timeout -k 10 120 mpirun --allow-run-as-root --oversubscribe -np 2 "$1" bench --ranks \
      --size-mb 4 --deltas 3) || { echo "$out"; echo "amber bench --ranks failed" >&2; exit 1; }
echo "$out"
for want in "2 ranks, 4.0 MB in all" "rank 0: its part" "rank 1: its part" \
            "global commit's own cost" "single rank, same total bytes" "target: the commit adds"; do
  echo "$out" | grep -qF "$want" || { echo "missing from the output: $want" >&2; exit 1; }
done
