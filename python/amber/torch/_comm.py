"""The communicator of a save or load: the collectives amber needs (allgather of
equal-length blobs, broadcast, barrier; and a gather of small objects for votes)
over the job's own torch.distributed group (TorchComm, on a CPU backend), or the
local stand-in for a job of one process (SoloComm), so that one save and one load
algorithm serve every world size, as DCP's _DistWrapper does."""

import os
import socket
import time
from typing import Optional

import torch
import torch.distributed as dist


class RankLostError(RuntimeError):
    """A collective of the Checkpointer failed because rank(s) `ranks` of its group
    are gone (their process no longer exists); the message names them and carries
    torch.distributed's own error, which is chained."""

    def __init__(self, ranks, message):
        super().__init__(message)
        self.ranks = ranks


def _dead(pid):
    """Whether process `pid` of this host has ended (gone, or a zombie: a SIGKILLed
    rank whose parent has not reaped it yet)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return False
        except ProcessLookupError:
            return True
        except OSError:
            return False


class TorchComm:
    """amber's collectives (see amber.GlobalWriter) over a torch.distributed group,
    which must have a CPU backend (gloo): allgather of equal-length blobs, broadcast
    from a group rank, barrier.

    A collective that fails because a rank died gives only the transport's words
    (gloo: "Connection reset by peer", with an address); so the first collective
    also gathers every rank's host and process id, and a failure then names the
    ranks of this host whose process has ended (RankLostError). Ranks on other hosts
    cannot be checked that way: the error then says so, with torch's message."""

    def __init__(self, group=None):
        self.group = group
        self.rank = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        self._peers = None  # [(host, pid)] by group rank, from the first collective

    def _call(self, what, fn):
        try:
            if self._peers is None:
                out = [None] * self.size
                dist.all_gather_object(out, (socket.gethostname(), os.getpid()),
                                       group=self.group)
                self._peers = out
            return fn()
        except RuntimeError as e:  # torch.distributed's errors (DistBackendError, ...)
            raise self._lost(what, e) from e

    def _lost(self, what, err):
        if not self._peers:
            return err
        host = socket.gethostname()
        time.sleep(0.2)  # the peer's death reaches the socket before its process table entry
        gone = [r for r, (h, pid) in enumerate(self._peers)
                if r != self.rank and h == host and _dead(pid)]
        if not gone:
            return err
        remote = sum(h != host for h, _ in self._peers)
        which = ", ".join(f"rank {r} (pid {self._peers[r][1]})" for r in gone)
        return RankLostError(gone, f"{which} of the group ended during a collective ({what}) "
                             f"on rank {self.rank}" +
                             (f"; {remote} rank(s) on other hosts not checked" if remote else "") +
                             f": torch.distributed: {str(err).strip()[:300]}")

    def allgather(self, data):
        if not data:
            return b""
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty_like(t) for _ in range(self.size)]
        self._call("all_gather", lambda: dist.all_gather(out, t, group=self.group))
        return b"".join(o.numpy().tobytes() for o in out)

    def broadcast(self, data, root):
        if not data:
            return b""
        t = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        self._call("broadcast", lambda: dist.broadcast(t, group=self.group, group_src=root))
        return t.numpy().tobytes()

    def barrier(self):
        self._call("barrier", lambda: dist.barrier(group=self.group))

    def gather_objects(self, obj):
        """Every rank's `obj` (small, JSON-able), in rank order."""
        out = [None] * self.size
        self._call("all_gather_object",
                   lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def sendrecv(self, data, dest, rlen, src):
        """Sends `data` to group rank `dest` and returns `rlen` bytes received from
        group rank `src`, both posted before either is waited for (so that a ring of
        exchanges cannot deadlock); nothing is sent or received for an empty side or a
        peer of None (amber_p2p's AMBER_P2P_NONE)."""
        out = bytearray(rlen if src is not None else 0)
        self.sendrecv_into(memoryview(bytearray(data)), dest, memoryview(out), src)
        return bytes(out)

    def sendrecv_into(self, send, dest, recv, src):
        """sendrecv over buffers: sends memoryview `send` to group rank `dest` and
        fills memoryview `recv` from group rank `src`, in place (the tensors are views
        of the buffers: nothing is copied on this side of gloo)."""
        ops = []
        if len(send) and dest is not None:
            t = torch.frombuffer(send, dtype=torch.uint8)
            ops.append(lambda: dist.isend(t, group=self.group, group_dst=dest))
        if len(recv) and src is not None:
            r = torch.frombuffer(recv, dtype=torch.uint8)
            ops.append(lambda: dist.irecv(r, group=self.group, group_src=src))

        def run():
            for w in [op() for op in ops]:
                w.wait()
        self._call("send/recv", run)


class SoloComm:
    """amber's collectives for a job of one process without a process group (a
    Checkpointer or amber.dcp.Writer at world size 1 on a multi-rank store): every
    collective is this process's own data."""
    rank, size = 0, 1

    def allgather(self, data):
        return bytes(data)

    def broadcast(self, data, root):
        return bytes(data)

    def barrier(self):
        pass

    def gather_objects(self, obj):
        return [obj]


def cpu_group(process_group, own=False):
    """A group with a CPU backend over the ranks of `process_group` (None: the world):
    the group itself when it has gloo (unless `own`), else a new gloo group, made by
    the group's ranks alone (collective over them)."""
    if not own and "gloo" in str(dist.get_backend(process_group)):
        return process_group
    if process_group is None:
        return dist.new_group(backend="gloo")
    return dist.new_group(ranks=dist.get_process_group_ranks(process_group), backend="gloo",
                          use_local_synchronization=True)


def distributed(process_group) -> bool:
    """Whether a Checkpointer of `process_group` is one of many ranks: torch.distributed
    is initialized and the group is given, or the world has more than one rank."""
    initialized = dist.is_available() and dist.is_initialized()
    if process_group is not None and not initialized:
        raise ValueError("process_group= given, but torch.distributed is not initialized")
    return initialized and (process_group is not None or dist.get_world_size() > 1)


def comm_for(process_group, own: bool = False):
    """The communicator of a Checkpointer or Writer of `process_group`: TorchComm over a
    gloo group of its ranks (its own one with `own`), or SoloComm for one process."""
    if not distributed(process_group):
        return SoloComm()
    return TorchComm(cpu_group(process_group, own=own))


def vote(comm, err: Optional[str], flags: int):
    """Every rank's `flags` (a byte each), and the first rank whose `err` is set with
    its message (or None): one all_gather of a byte per rank, and a second exchange
    only when some rank failed."""
    mine = flags | (0x80 if err is not None else 0)
    got = comm.allgather(bytes([mine])) if comm.size > 1 else bytes([mine])
    bad = next((r for r, f in enumerate(got) if f & 0x80), None)
    failure = None
    if bad is not None:
        msgs = comm.gather_objects(err) if comm.size > 1 else [err]
        failure = (bad, msgs[bad])
    return [f & 0x7F for f in got], failure
