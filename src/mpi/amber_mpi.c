/*
 * amber_mpi.c - libamber_mpi: amber_comm over an MPI communicator. Each
 * collective maps to its MPI namesake on a duplicate of the job's communicator;
 * an MPI error becomes AMBER_EIO (the library's message then names the step).
 */
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "amber_mpi.h"

static int mpi_allgather(void *ctx, const void *send, size_t len, void *recv) {
  if (len > INT_MAX) return AMBER_ERANGE;
  return MPI_Allgather(send, (int)len, MPI_BYTE, recv, (int)len, MPI_BYTE,
                       *(MPI_Comm *)ctx) == MPI_SUCCESS ? 0 : AMBER_EIO;
}

static int mpi_broadcast(void *ctx, void *buf, size_t len, int root) {
  if (len > INT_MAX) return AMBER_ERANGE;
  return MPI_Bcast(buf, (int)len, MPI_BYTE, root, *(MPI_Comm *)ctx) == MPI_SUCCESS
             ? 0 : AMBER_EIO;
}

static int mpi_barrier(void *ctx) {
  return MPI_Barrier(*(MPI_Comm *)ctx) == MPI_SUCCESS ? 0 : AMBER_EIO;
}

int amber_mpi_comm_init(amber_comm *out, MPI_Comm comm) {
  memset(out, 0, sizeof *out);
  MPI_Comm *dup = malloc(sizeof *dup);
  if (!dup) return AMBER_ENOMEM;
  if (MPI_Comm_dup(comm, dup) != MPI_SUCCESS) {
    free(dup);
    return AMBER_EIO;
  }
  MPI_Comm_rank(*dup, &out->rank);
  MPI_Comm_size(*dup, &out->size);
  out->allgather = mpi_allgather;
  out->broadcast = mpi_broadcast;
  out->barrier = mpi_barrier;
  out->ctx = dup;
  /* Under MPI_THREAD_MULTIPLE amber may run a split save's commit on its own thread
   * over the duplicate, while the job goes on with its own communicators. */
  int level = MPI_THREAD_SINGLE;
  if (MPI_Query_thread(&level) == MPI_SUCCESS && level == MPI_THREAD_MULTIPLE)
    out->flags = AMBER_COMM_ANY_THREAD;
  return 0;
}

void amber_mpi_comm_free(amber_comm *c) {
  if (!c || !c->ctx) return;
  MPI_Comm_free((MPI_Comm *)c->ctx);
  free(c->ctx);
  c->ctx = NULL;
}
