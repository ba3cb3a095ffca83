/*
 * test_mpi_p2p.c - libamber_mpi's point-to-point exchange (amber_mpi_p2p_init) over
 * real MPI processes: a ring in both directions with messages of several lengths
 * (empty ones too), a round where only some ranks send (AMBER_P2P_NONE), and a
 * receiver that expects another length than was sent, which is AMBER_EIO and not
 * an abort. Run by run.sh under mpirun; exits non-zero on any failure.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "amber_mpi.h"

static int fails, me;
#define CHK(c)                                                                        \
  do {                                                                                \
    if (!(c)) {                                                                       \
      fprintf(stderr, "rank %d: %s:%d: %s\n", me, __FILE__, __LINE__, #c);            \
      fails++;                                                                        \
    }                                                                                 \
  } while (0)

static unsigned char byte(int from, size_t i) {
  return (unsigned char)(from * 31 + (int)(i % 251));
}

int main(int argc, char **argv) {
  MPI_Init(&argc, &argv);
  int n;
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  MPI_Comm_size(MPI_COMM_WORLD, &n);
  amber_comm comm;
  amber_p2p p2p;
  CHK(amber_mpi_comm_init(&comm, MPI_COMM_WORLD) == 0);
  CHK(amber_mpi_p2p_init(&p2p, &comm) == 0);
  amber_comm fake = comm;
  fake.allgather = NULL;
  amber_p2p other;
  CHK(amber_mpi_p2p_init(&other, &fake) == AMBER_EINVAL);
  size_t lens[] = {0, 1, 4096, 3u << 20};
  for (int dir = 1; dir >= -1; dir -= 2)
    for (size_t k = 0; k < sizeof lens / sizeof *lens; k++) {
      int to = (me + dir + n) % n, from = (me - dir + n) % n;
      size_t len = lens[k] + (size_t)me; /* each rank sends another length */
      size_t rlen = lens[k] + (size_t)from;
      unsigned char *s = malloc(len + 1), *r = malloc(rlen + 1);
      for (size_t i = 0; i < len; i++) s[i] = byte(me, i);
      CHK(p2p.sendrecv(p2p.ctx, s, len, to, r, rlen, from) == 0);
      int ok = 1;
      for (size_t i = 0; i < rlen; i++) ok &= r[i] == byte(from, i);
      CHK(ok);
      free(s), free(r);
    }
  /* only even ranks send, to the next rank; odd ranks only receive */
  unsigned char x = (unsigned char)me, y = 0xff;
  int sends = me % 2 == 0 && me + 1 < n, gets = me % 2 == 1;
  CHK(p2p.sendrecv(p2p.ctx, &x, sends ? 1 : 0, sends ? me + 1 : AMBER_P2P_NONE, &y,
                   gets ? 1 : 0, gets ? me - 1 : AMBER_P2P_NONE) == 0);
  CHK(!gets || y == (unsigned char)(me - 1));
  /* rank 1 expects 8 bytes where rank 0 sends 4, then 2 where rank 0 sends 4 */
  unsigned char four[4] = {1, 2, 3, 4}, got[8];
  if (me == 0) {
    CHK(p2p.sendrecv(p2p.ctx, four, 4, 1, NULL, 0, AMBER_P2P_NONE) == 0);
    CHK(p2p.sendrecv(p2p.ctx, four, 4, 1, NULL, 0, AMBER_P2P_NONE) == 0);
  } else if (me == 1) {
    CHK(p2p.sendrecv(p2p.ctx, NULL, 0, AMBER_P2P_NONE, got, 8, 0) == AMBER_EIO);
    CHK(p2p.sendrecv(p2p.ctx, NULL, 0, AMBER_P2P_NONE, got, 2, 0) == AMBER_EIO);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  amber_mpi_comm_free(&comm);
  int all = 0;
  MPI_Allreduce(&fails, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
  if (me == 0) printf("p2p: %s at %d ranks\n", all ? "FAILED" : "ok", n);
  MPI_Finalize();
  return all != 0;
}
