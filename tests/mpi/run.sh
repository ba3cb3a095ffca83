#!/bin/sh
# run.sh EXE - runs the MPI test at 2 and 4 ranks under mpirun, each in a fresh
# store under a private temporary directory (removed afterwards), each bounded by
# timeout so that a stuck collective cannot hang the suite.
set -u
exe=$1
dir=$(mktemp -d "${TMPDIR:-/tmp}/amber-mpi-XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1
rc=0
for n in 2 4; do
  timeout -k 10 120 mpirun --allow-run-as-root --oversubscribe -np "$n" "$exe" "$dir/s$n" || rc=1
done
exit $rc
