/*
 * amber_mpi.h - the MPI communicator for amber's many-rank saves (libamber_mpi).
 * Kept apart from amber.h so that programs without MPI never need its headers.
 *
 *   amber_comm comm;
 *   amber_mpi_comm_init(&comm, MPI_COMM_WORLD);
 *   amber_p2p p2p;                        // peer replicas, restore from the tiers
 *   amber_mpi_p2p_init(&p2p, &comm);
 *   amber_global_writer_open(&gw, "runs/x", &comm, NULL);
 *   ...
 *   amber_global_writer_close(gw);
 *   amber_mpi_comm_free(&comm);
 */
#ifndef AMBER_MPI_H
#define AMBER_MPI_H

#include <mpi.h>

#include "amber.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fills *out with an amber_comm over a duplicate of `comm` (MPI_Comm_dup: amber's
 * collectives never match the job's own messages). Collective over `comm`; MPI
 * must be initialized. Returns 0, or AMBER_EIO when MPI fails, AMBER_ENOMEM.
 * Thread safety: when MPI was initialized with MPI_THREAD_MULTIPLE, the
 * communicator is flagged AMBER_COMM_ANY_THREAD and a split save's commit runs on
 * a thread of amber's, beside the job's own MPI calls. Otherwise amber calls the
 * collectives from the thread that calls the amber_global_* functions (for split
 * saves, amber_global_writer_wait), so MPI_THREAD_FUNNELED or above suffices when
 * that is the thread that initialized MPI, MPI_THREAD_SERIALIZED otherwise. */
AMBER_API int amber_mpi_comm_init(amber_comm *out, MPI_Comm comm);
/* Frees the duplicate communicator (collective, as MPI_Comm_free). Accepts a
 * zeroed or already freed amber_comm. */
AMBER_API void amber_mpi_comm_free(amber_comm *c);

/* Fills *out with an amber_p2p over the duplicate communicator of `comm` (made by
 * amber_mpi_comm_init): MPI_Sendrecv, messages above 1 GiB in pieces; an MPI error,
 * or a message of another length than the receiver expects, is AMBER_EIO. It
 * shares the communicator, its rank numbering and its AMBER_COMM_ANY_THREAD flag,
 * and is valid until amber_mpi_comm_free(comm); nothing to free. Give each user
 * that runs on a thread of its own (a replicator) a communicator of its own
 * (another amber_mpi_comm_init) and its p2p. Not collective. Returns 0, or
 * AMBER_EINVAL for a communicator not made by amber_mpi_comm_init. */
AMBER_API int amber_mpi_p2p_init(amber_p2p *out, const amber_comm *comm);

#ifdef __cplusplus
}
#endif

#endif /* AMBER_MPI_H */
