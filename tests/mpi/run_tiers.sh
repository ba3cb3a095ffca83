#!/bin/sh
# run_tiers.sh EXE - the peer replicas and the restore from the tiers over MPI, at 2
# and 4 ranks, each in a fresh directory under a private temporary directory
# (removed afterwards): the scenario of test_mpi_tiers.c's "run" mode, then three
# times a job ("loop") SIGKILLed whole at a random moment, checked and restored
# ("check"; every other time with rank 1's host wiped). Every mpirun is bounded by
# timeout, and a killed job's processes are killed by their session.
set -u
exe=$1
dir=$(mktemp -d "${TMPDIR:-/tmp}/amber-mpi-tiers-XXXXXX") || exit 1
trap 'rm -rf "$dir"' EXIT
# OpenMPI's shared-memory segments (a file per rank) go to a directory of this
# script's own, removed with it: a job killed on purpose leaves its segments behind.
shm=$(mktemp -d /dev/shm/amber-mpi-XXXXXX 2>/dev/null ||
      mktemp -d "${TMPDIR:-/tmp}/amber-mpi-shm-XXXXXX") || exit 1
export OMPI_MCA_btl_vader_backing_directory="$shm"
trap 'rm -rf "$dir" "$shm"' EXIT
export OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1
export ASAN_OPTIONS="${ASAN_OPTIONS:+$ASAN_OPTIONS:}detect_leaks=0" # as run.sh says
mpi() { # N ARGS...: one bounded mpirun
  n=$1
  shift
  timeout -k 10 120 mpirun --allow-run-as-root --oversubscribe -np "$n" "$exe" "$@"
}
rc=0
for n in 2 4; do
  mpi "$n" "$dir/r$n" run || rc=1
  for i in 1 2 3; do
    setsid timeout -k 5 60 mpirun --allow-run-as-root --oversubscribe -np "$n" "$exe" \
      "$dir/k$n" loop >/dev/null 2>&1 &
    pid=$!
    sleep "$(awk -v s="$$$i$n" 'BEGIN { srand(s); printf "%.2f", 1 + 2 * rand() }')"
    # every process of the job's session (mpirun gives each rank a process group of
    # its own, so the group of setsid's process is not enough)
    ps -o pid= -s "$pid" | xargs -r kill -KILL 2>/dev/null
    wait "$pid" 2>/dev/null
    while [ -n "$(ps -o pid= -s "$pid")" ]; do sleep 0.1; done
    if [ $((i % 2)) -eq 0 ]; then mpi "$n" "$dir/k$n" check wipe || rc=1
    else mpi "$n" "$dir/k$n" check || rc=1; fi
  done
done
exit $rc
