"""The Python binding of peer replicas and the restore from the tiers (amber.Replicas,
amber.tiers_restore, GlobalWriter(local=True)) with ranks as threads of one process,
each a host with its own memory directory: the communicator and the point-to-point
exchange are Python objects (as the torch.distributed ones are), every step is
replicated, a wiped host restores bit-identical from its peer, and an exception
inside sendrecv fails the step on every rank, raised with the exception named."""
import ctypes
import queue
import shutil
import threading

import amber
import pytest

ROWS, COLS, N = 8, 64, 2


class World:
    def __init__(self, n):
        self.n = n
        self.bar = threading.Barrier(n, timeout=60)
        self.slots = [None] * n
        self.boxes = {(a, b): queue.Queue() for a in range(n) for b in range(n)}
        # rank -> k: that rank's k-th next sendrecv raises, after its bytes went through
        # (the bytes of a step's one round: the sizes first, then the bytes)
        self.fail = {}


class Comm:
    def __init__(self, world, rank):
        self.w, self.rank, self.size = world, rank, world.n

    def allgather(self, data):
        self.w.slots[self.rank] = data
        self.w.bar.wait()
        out = b"".join(self.w.slots)
        self.w.bar.wait()
        return out

    def broadcast(self, data, root):
        if self.rank == root:
            self.w.slots[root] = data
        self.w.bar.wait()
        out = self.w.slots[root]
        self.w.bar.wait()
        return out

    def barrier(self):
        self.w.bar.wait()


class P2P:
    def __init__(self, world, rank):
        self.w, self.rank = world, rank

    def sendrecv(self, data, dest, rlen, src):
        if dest is not None:
            self.w.boxes[(self.rank, dest)].put(bytes(data))
        out = self.w.boxes[(src, self.rank)].get(timeout=60) if src is not None else b""
        if self.w.fail.get(self.rank):
            self.w.fail[self.rank] -= 1
            if not self.w.fail[self.rank]:
                raise ConnectionError("peer gone")
        return out


def value(i, j, step):
    k = i * COLS + j
    return float(k) + (0.5 * step if k % 13 == step % 13 else 0.0)


def run(n, fn):
    world, errors = World(n), []

    def main(r):
        try:
            fn(r, Comm(world, r), P2P(world, r), world)
        except BaseException as e:  # reported by the test thread
            errors.append((r, e))
            world.bar.abort()
    threads = [threading.Thread(target=main, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return errors


def save_steps(r, comm, p2p, dirs, steps, fail_step=None, world=None):
    rows = ROWS // N
    w = (ctypes.c_float * (rows * COLS))()
    b = (ctypes.c_float * 3)()
    results = []
    with amber.GlobalWriter(dirs[r], comm, local=True) as g:
        g.add("w", amber.F32, (ROWS, COLS), (r * rows, 0), (rows, COLS), ctypes.addressof(w))
        g.add("b", amber.F32, (3,), (0,), (3,), ctypes.addressof(b), replicated=True)
        with amber.Replicas(dirs[r], comm, p2p, replicas=1, host=f"host{r}") as rep:
            assert rep.peers() == [(r + 1) % N]
            for s in steps:
                for i in range(rows):
                    for j in range(COLS):
                        w[i * COLS + j] = value(r * rows + i, j, s)
                for i in range(3):
                    b[i] = float(s + i)
                g.save(s)
                if s == fail_step and r == 1:
                    world.fail[r] = 2
                try:
                    rep.step(s)
                    results.append((s, None, rep.stats()))
                except amber.AmberError as e:
                    results.append((s, e, None))
    return results


def check_read(path, step, r):
    rows = ROWS // N
    with amber.GlobalReader(path, step) as g:
        got = (ctypes.c_float * (rows * COLS))()
        g.read_into(g.find("w"), (r * rows, 0), (rows, COLS), ctypes.addressof(got),
                    ctypes.sizeof(got))
        assert list(got) == [value(r * rows + i, j, step) for i in range(rows)
                             for j in range(COLS)]
        bb = (ctypes.c_float * 3)()
        g.read_into(g.find("b"), (0,), (3,), ctypes.addressof(bb), ctypes.sizeof(bb))
        assert list(bb) == [float(step + i) for i in range(3)]


def test_a_wiped_host_restores_bit_identical_from_its_peer(tmp_path):
    dirs = [str(tmp_path / f"host{r}") for r in range(N)]
    out = {}

    def job(r, comm, p2p, _world):
        out[r] = save_steps(r, comm, p2p, dirs, range(1, 4))
    assert run(N, job) == []
    for r in range(N):
        assert [e for _, e, _ in out[r]] == [None] * 3
        assert out[r][2][2].sent_bytes < out[r][0][2].sent_bytes  # a delta after the full
    shutil.rmtree(dirs[1])
    res = {}

    def restore(r, comm, p2p, _world):
        res[r] = amber.tiers_restore(dirs[r], None, comm, p2p)
    assert run(N, restore) == []
    assert res[0].step == res[1].step == 3
    assert res[1].tier == "peer" and res[1].path == dirs[1] and res[1].fetched_bytes > 0
    for r in range(N):
        check_read(res[r].path, 3, r)


def test_an_exception_in_sendrecv_fails_the_step_on_every_rank(tmp_path):
    dirs = [str(tmp_path / f"host{r}") for r in range(N)]
    out = {}

    def job(r, comm, p2p, world):
        out[r] = save_steps(r, comm, p2p, dirs, range(1, 4), fail_step=2, world=world)
    assert run(N, job) == []
    for r in range(N):
        assert out[r][0][1] is None
        for s in (1, 2):  # step 2 failed, and step 3 meets the stopped replicator
            e = out[r][s][1]
            assert isinstance(e, amber.AmberError) and e.name == "AMBER_EIO"
            assert "rank 1: step 2" in e.message and "replication stopped" in e.message
    assert "ConnectionError: peer gone" in out[1][1][1].message
    assert isinstance(out[1][1][1].__cause__, ConnectionError)


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-v"]))
