/*
 * amber_mpi.c - libamber_mpi: amber_comm over an MPI communicator. Each
 * collective maps to its MPI namesake on a duplicate of the job's communicator;
 * an MPI error becomes AMBER_EIO (the library's message then names the step).
 * amber_p2p's sendrecv is MPI_Sendrecv on the same duplicate.
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

/* A message travels as pieces of at most PIECE bytes (MPI counts are int), so that
 * both sides cut it alike from its length alone: one piece up to PIECE (and for an
 * empty message), ceil(len / PIECE) above. */
#define PIECE ((size_t)1 << 30)
#define TAG 0x616d /* any tag would do: the duplicate carries amber's messages alone */

static size_t pieces(size_t len) {
  return len ? (len + PIECE - 1) / PIECE : 1;
}

static int got_all(const MPI_Status *st, size_t want) {
  int n = 0;
  return MPI_Get_count(st, MPI_BYTE, &n) == MPI_SUCCESS && (size_t)n == want;
}

static int mpi_sendrecv(void *ctx, const void *send, size_t slen, int dest, void *recv,
                        size_t rlen, int src) {
  MPI_Comm c = *(MPI_Comm *)ctx;
  if (dest < 0) slen = 0;
  if (src < 0) rlen = 0;
  if (slen <= PIECE && rlen <= PIECE) {
    MPI_Status st;
    if (MPI_Sendrecv(send, (int)slen, MPI_BYTE, dest < 0 ? MPI_PROC_NULL : dest, TAG, recv,
                     (int)rlen, MPI_BYTE, src < 0 ? MPI_PROC_NULL : src, TAG, c,
                     &st) != MPI_SUCCESS)
      return AMBER_EIO;
    return src < 0 || got_all(&st, rlen) ? 0 : AMBER_EIO;
  }
  size_t ns = dest < 0 ? 0 : pieces(slen), nr = src < 0 ? 0 : pieces(rlen), n = ns + nr;
  MPI_Request *rq = malloc(n * sizeof *rq);
  MPI_Status *st = malloc(n * sizeof *st);
  if (!rq || !st) {
    free(rq), free(st);
    return AMBER_ENOMEM;
  }
  int rc = MPI_SUCCESS;
  for (size_t i = 0; i < nr; i++) {
    size_t at = i * PIECE, k = rlen - at < PIECE ? rlen - at : PIECE;
    if (rc == MPI_SUCCESS)
      rc = MPI_Irecv((char *)recv + at, (int)k, MPI_BYTE, src, TAG, c, &rq[i]);
    else rq[i] = MPI_REQUEST_NULL;
  }
  for (size_t i = 0; i < ns; i++) {
    size_t at = i * PIECE, k = slen - at < PIECE ? slen - at : PIECE;
    if (rc == MPI_SUCCESS)
      rc = MPI_Isend((const char *)send + at, (int)k, MPI_BYTE, dest, TAG, c, &rq[nr + i]);
    else rq[nr + i] = MPI_REQUEST_NULL;
  }
  if (MPI_Waitall((int)n, rq, st) != MPI_SUCCESS) rc = !MPI_SUCCESS;
  for (size_t i = 0; rc == MPI_SUCCESS && i < nr; i++)
    if (!got_all(&st[i], rlen - i * PIECE < PIECE ? rlen - i * PIECE : PIECE)) rc = !MPI_SUCCESS;
  free(rq), free(st);
  return rc == MPI_SUCCESS ? 0 : AMBER_EIO;
}

int amber_mpi_p2p_init(amber_p2p *out, const amber_comm *comm) {
  memset(out, 0, sizeof *out);
  if (!comm || !comm->ctx || comm->allgather != mpi_allgather) return AMBER_EINVAL;
  out->sendrecv = mpi_sendrecv;
  out->ctx = comm->ctx;
  out->flags = comm->flags;
  return 0;
}

int amber_mpi_comm_init(amber_comm *out, MPI_Comm comm) {
  memset(out, 0, sizeof *out);
  MPI_Comm *dup = malloc(sizeof *dup);
  if (!dup) return AMBER_ENOMEM;
  if (MPI_Comm_dup(comm, dup) != MPI_SUCCESS) {
    free(dup);
    return AMBER_EIO;
  }
  /* errors come back as codes (AMBER_EIO), as amber_mpi.h says, rather than abort
   * the job from inside amber */
  MPI_Comm_set_errhandler(*dup, MPI_ERRORS_RETURN);
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
