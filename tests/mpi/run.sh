#!/bin/sh
# run.sh EXE - runs the MPI test at 2 and 4 ranks under mpirun, each in a fresh
# store under a private temporary directory (removed afterwards), each bounded by
# timeout so that a stuck collective cannot hang the suite.
set -u
exe=$1
dir=$(mktemp -d "${TMPDIR:-/tmp}/amber-mpi-XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
# OpenMPI's shared-memory segments (a file per rank) go to a directory of this
# script's own, removed with it: a job killed on purpose leaves its segments behind.
shm=$(mktemp -d /dev/shm/amber-mpi-XXXXXX 2>/dev/null ||
      mktemp -d "${TMPDIR:-/tmp}/amber-mpi-shm-XXXXXX") || exit 1
export OMPI_MCA_btl_vader_backing_directory="$shm"
trap 'rm -rf "$dir" "$shm"' EXIT
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1
# Under ASan, OpenMPI's own allocations show as leaks, mostly from its plugins,
# which it unloads before the leak check can name them, so no suppression can be
# narrower than the whole process: leak checking is off here only (amber's code
# is leak-checked with the threads communicator in test_global).
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0"
rc=0
for n in 2 4; do
  timeout -k 10 120 mpirun --allow-run-as-root --oversubscribe -np "$n" "$exe" "$dir/s$n" || rc=1
done
exit $rc
