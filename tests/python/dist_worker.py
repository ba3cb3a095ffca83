"""One rank of the distributed Checkpointer's tests (tests/python/test_dist_checkpointer.py).

    python dist_worker.py SCENARIO RANK WORLD INIT_FILE DIR
    torchrun --nproc-per-node N dist_worker.py SCENARIO - - env DIR

Joins a gloo process group through torch.distributed's own file:// rendezvous (or
torchrun's),
trains a tiny transformer sharded with FSDP2 (fully_shard, on CPU) and AdamW, and
runs SCENARIO against stores under DIR. Results that the test checks are written
under DIR by rank 0 (torch.save of plain tensors: test output, not a store); an
AssertionError fails the rank (exit 1), which the test reports with its output.
"""
import datetime
import json
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard

import amber
from amber.torch import Checkpointer

V, D, T = 32, 16, 8


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.up = nn.Linear(D, 2 * D + 6)  # 38 rows: uneven over 3 and 4 ranks
        self.down = nn.Linear(2 * D + 6, D)

    def forward(self, x):
        q, k, v = self.qkv(self.ln(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(x)))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(D, V)
        self.gain = nn.Parameter(torch.ones(3))  # 3 rows: the 4th rank's shard is empty

    def forward(self, x):
        h = self.emb(x) * self.gain.mean()
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def build(seed):
    torch.manual_seed(seed)  # the same initial weights on every rank, as FSDP2 expects
    model = GPT()
    for b in model.blocks:
        fully_shard(b)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return model, opt


def train_step(model, opt):
    x = torch.randint(0, V, (2, T))  # the global RNG: its state is part of the checkpoint
    loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, V), x[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss.item()


def full_state(model, opt):
    """Every parameter and optimizer state as one unsharded tensor, by name."""
    out = {}
    for n, p in model.named_parameters():
        out[f"model/{n}"] = p.full_tensor().clone()
        for k, v in opt.state.get(p, {}).items():
            full = v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v
            out[f"optim/{n}/{k}"] = full.clone()
    return out


def run(model, opt, ck, first, last):
    losses = []
    for step in range(first, last + 1):
        losses.append(train_step(model, opt))
        ck.save(step, {"model": model, "optim": opt, "extra": {"step": step}})
    ck.wait()
    return losses


def scenario_resume(rank, world, d):
    """Uninterrupted 1..6 against 1..3, a restart from step 3 and 4..6 (exact)."""
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    with Checkpointer(f"{d}/a") as ck:
        losses_a = run(model, opt, ck, 1, 6)
    want = full_state(model, opt)
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    # the tiny model's AdamW deltas are dense: full_share would make some steps full
    with Checkpointer(f"{d}/b", full_share=-1) as ck:
        run(model, opt, ck, 1, 3)
        kinds = [s.kind for s in ck.steps()]
    del model, opt
    torch.manual_seed(999)  # the restart's own RNG and weights, which the load replaces
    model, opt = build(7)
    with Checkpointer(f"{d}/b", full_share=-1) as ck:
        state = {"model": model, "optim": opt, "extra": {}}
        assert ck.load(state) == 3
        assert state["extra"] == {"step": 3}, state["extra"]
        # each rank's writer took its reference from the live tensors (the load's
        # seed): the first save reads nothing back, shown with the rank's file of
        # step 3 moved away while it runs (after the seed settled: it reads the
        # file's index)
        ck.fence()
        assert ck.seeded
        mine = f"{d}/b/rank-{rank:05d}/ckpt-{3:020d}.amber"
        os.rename(mine, mine + ".away")
        try:
            losses_c = run(model, opt, ck, 4, 4)
        finally:
            os.rename(mine + ".away", mine)
        assert ck.seeded
        losses_c += run(model, opt, ck, 5, 6)
        resumed = [s.kind for s in ck.steps()][3:]
    # the first save after the restart is a delta
    assert resumed == ["delta"] * 3, resumed
    got = full_state(model, opt)
    assert losses_c == losses_a[3:], (losses_a, losses_c)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after the resume"
    assert kinds[0] == "full", kinds
    # amber.dcp.Reader loads the Checkpointer's store into DTensor state (dcp.load)
    model, opt = build(8)
    train_step(model, opt)
    _dcp_load(model, opt, f"{d}/a", extra=False)
    got = full_state(model, opt)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after dcp.load of a Checkpointer store"
    if rank == 0:
        torch.save(want, f"{d}/a.pt")
        json.dump({"kinds": kinds}, open(f"{d}/resume.json", "w"))


def scenario_s3resume(rank, world, d):
    """An exact run 1..6 into a directory against 1..3 into an s3:// store
    ($AMBER_TEST_S3; with AMBER_TEST_S3_HOSTS=1 each rank on a "host" of its own, its
    own staging directory), its staging directories removed, a restart that loads step 3
    from the objects and runs 4..6: bit-identical."""
    import shutil
    url = os.environ["AMBER_TEST_S3"]
    hosts = os.environ.get("AMBER_TEST_S3_HOSTS") == "1"
    if hosts:  # each rank a host of its own: a staging directory each
        os.environ["AMBER_STAGING"] = os.path.join(os.environ["AMBER_STAGING"], f"host-{rank}")
        os.makedirs(os.environ["AMBER_STAGING"], exist_ok=True)
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    with Checkpointer(f"{d}/a") as ck:
        losses_a = run(model, opt, ck, 1, 6)
    want = full_state(model, opt)
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    with Checkpointer(url, full_share=-1) as ck:
        run(model, opt, ck, 1, 3)
        assert [s.step for s in ck.steps()] == [1, 2, 3]  # durable in the bucket already
    dist.barrier()
    if rank == 0 or hosts:  # a restart on other hosts: nothing local, only the objects
        shutil.rmtree(amber.tier_staging(url), ignore_errors=True)
    dist.barrier()
    del model, opt
    torch.manual_seed(999)
    model, opt = build(7)
    with Checkpointer(url, full_share=-1) as ck:
        state = {"model": model, "optim": opt, "extra": {}}
        assert ck.load(state) == 3
        assert state["extra"] == {"step": 3}, state["extra"]
        losses_c = run(model, opt, ck, 4, 6)
    got = full_state(model, opt)
    assert losses_c == losses_a[3:], (losses_a, losses_c)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after the resume from S3"


def scenario_failures(rank, world, d):
    """A rank whose state cannot be saved, and a tensor changed before the fence:
    the step fails on every rank naming the rank, the store keeps its last step."""
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    with Checkpointer(f"{d}/f") as ck:
        run(model, opt, ck, 1, 2)
        train_step(model, opt)
        extra = {"ok": 1} if rank != 1 else {"bad": object()}
        try:
            ck.save(3, {"model": model, "optim": opt, "extra": extra})
            raise AssertionError("save of a state that rank 1 cannot save succeeded")
        except amber.AmberError as e:
            assert "step 3 not committed: rank 1 failed" in e.message, e.message
            assert "object" in e.message, e.message
        assert ck.latest() == 2
        ck.save(4, {"model": model, "optim": opt, "extra": {"ok": 1}})
        if rank == world - 1:  # changes a parameter that save() reads in place
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
        try:
            ck.wait()
            raise AssertionError("a save whose tensors changed before the fence committed")
        except amber.AmberError as e:
            assert e.code == amber.ECHANGED and f"rank {world - 1} failed" in e.message, e.message
        assert ck.latest() == 2
        run(model, opt, ck, 5, 5)
        assert ck.latest() == 5
        # a write that fails on rank 1 (its file's name is taken, as a full disk would
        # fail it): the step fails on every rank naming rank 1, and training goes on
        blocker = f"{d}/f/rank-00001/ckpt-{6:020d}.amber"
        if rank == 1:
            os.mkdir(blocker)
        dist.barrier()
        train_step(model, opt)
        ck.save(6, {"model": model, "optim": opt, "extra": {"ok": 1}})
        try:
            ck.wait()
            raise AssertionError("a step whose write failed on rank 1 committed")
        except amber.AmberError as e:
            assert "step 6 not committed: rank 1 failed" in e.message, e.message
        if rank == 1:
            os.rmdir(blocker)
        assert ck.latest() == 5
        run(model, opt, ck, 7, 7)
        assert ck.latest() == 7
    want = full_state(model, opt)
    if rank == 0:
        torch.save(want, f"{d}/f.pt")


def scenario_reshard(rank, world, d):
    """Loads every store named in DIR/reshard.json and checks it against its dump:
    bit-exact for exact stores, within the bound for threshold ones."""
    cfg = json.load(open(f"{d}/reshard.json"))
    for name, tol in cfg["load"]:
        want = torch.load(f"{d}/{name}.pt")
        torch.manual_seed(5 + rank)
        model, opt = build(11)
        train_step(model, opt)  # optimizer state exists: loads into live DTensors
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with Checkpointer(f"{d}/{name}") as ck:
                step = ck.load({"model": model, "optim": opt, "extra": {}})
        if rank >= cfg["saved_world"][name]:
            assert any("keeps its own RNG" in str(x.message) for x in w), [str(x.message) for x in w]
        got = full_state(model, opt)
        assert set(got) == set(want), (sorted(set(got) ^ set(want)))
        for k in want:
            if tol == 0:
                assert torch.equal(got[k], want[k]), f"{name}: {k} differs (step {step})"
            else:
                err = (got[k].double() - want[k].double()).abs().max().item()
                assert err <= tol, f"{name}: {k} off by {err} > {tol}"
        # fresh optimizer state (none yet): created as DTensors sharded like the params
        model, opt = build(12)
        with Checkpointer(f"{d}/{name}") as ck:
            ck.load({"model": model, "optim": opt, "extra": {}})
        got = full_state(model, opt)
        for k in want:
            if tol == 0:
                assert torch.equal(got[k], want[k]), f"{name} (fresh optimizer): {k} differs"
    if cfg.get("hsdp"):
        scenario_hsdp(rank, world, d)
        scenario_subgroups(rank, world, d)
    for name, policy in cfg.get("save", []):
        torch.manual_seed(100 + rank)
        model, opt = build(0)
        with Checkpointer(f"{d}/{name}", policy=policy) as ck:
            run(model, opt, ck, 1, 3)
        want = full_state(model, opt)
        from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                             get_model_state_dict)
        unsharded = get_model_state_dict(model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True))  # what `amber export` must equal
        if rank == 0:
            torch.save(want, f"{d}/{name}.pt")
            torch.save(unsharded, f"{d}/{name}-model.pt")


def scenario_subgroups(rank, world, d):
    """process_group=: ranks {0, 1} and {2, 3} each checkpoint their own model into
    their own store, through the Checkpointer and through amber.dcp, and load it back."""
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Writer
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes both
    pair = rank // 2
    pg = groups[pair]
    torch.manual_seed(pair)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_step(model, opt)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    with Checkpointer(f"{d}/sub{pair}", process_group=pg) as ck:
        ck.save(1, {"model": model, "optim": opt})
    with Writer(process_group=pg) as w:
        dcp.save(_dcp_state(model, opt), storage_writer=w, checkpoint_id=f"{d}/subdcp{pair}/step-1",
                 process_group=pg)
    for load in ("ck", "dcp"):
        torch.manual_seed(9)
        model = GPT()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        train_step(model, opt)
        if load == "ck":
            with Checkpointer(f"{d}/sub{pair}", process_group=pg) as ck:
                assert ck.load({"model": model, "optim": opt}) == 1
        else:
            _dcp_load(model, opt, f"{d}/subdcp{pair}", process_group=pg)
        for k, v in model.state_dict().items():
            assert torch.equal(v, want[k]), f"group {pair} ({load}): {k} differs"
    assert [s.world_size for s in amber.global_steps(f"{d}/sub{pair}")] == [2]


def scenario_hsdp(rank, world, d):
    """HSDP on 4 ranks (a 2x2 mesh: shards replicated over the first dimension): each
    shard is written once, by the replica at coordinate 0; the step loads into HSDP
    and into plain FSDP over the 4 ranks, bit-exact."""
    from torch.distributed.device_mesh import init_device_mesh
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def hsdp(seed):
        torch.manual_seed(seed)
        model = GPT()
        for b in model.blocks:
            fully_shard(b, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = hsdp(0)
    with Checkpointer(f"{d}/h") as ck:
        run(model, opt, ck, 1, 3)
    want = full_state(model, opt)
    for make in (lambda: hsdp(4), lambda: build(4)):
        model, opt = make()
        train_step(model, opt)
        with Checkpointer(f"{d}/h") as ck:
            assert ck.load({"model": model, "optim": opt, "extra": {}}) == 3
        got = full_state(model, opt)
        for k in want:
            assert torch.equal(got[k], want[k]), f"{k} differs after the HSDP load"


def scenario_ddp(rank, world, d):
    """DDP: replicated parameters and optimizer state, written once (by rank 0); a
    restart loads them on every rank, bit-exact."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(GPT())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(f"{d}/ddp") as ck:
        run(model, opt, ck, 1, 3)
    want = {k: v.clone() for k, v in model.module.state_dict().items()}
    want_opt = [s["exp_avg"].clone() for s in opt.state.values()]
    torch.manual_seed(1)
    model = DDP(GPT())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    with Checkpointer(f"{d}/ddp") as ck:
        assert ck.load({"model": model, "optim": opt, "extra": {}}) == 3
    for k, v in model.module.state_dict().items():
        assert torch.equal(v, want[k]), f"{k} differs after the DDP load"
    got_opt = [s["exp_avg"] for s in opt.state.values()]
    assert len(got_opt) == len(want_opt) and all(map(torch.equal, got_opt, want_opt))


def scenario_killrun(rank, world, d):
    """Trains and saves every step until it is killed (by the test); each rank notes
    in DIR/progress-RANK the last step whose save() returned."""
    model, opt = build(0)
    with Checkpointer(f"{d}/k") as ck:
        for step in range(1, 10000):
            train_step(model, opt)
            ck.save(step, {"model": model, "optim": opt, "extra": {"step": step}})
            with open(f"{d}/progress-{rank}", "w") as f:
                f.write(str(step))


def scenario_killsave(rank, world, d):
    """Saves every step (only the Checkpointer's collectives: no FSDP here) until the
    test kills rank 1; the survivor's error must name rank 1: written to
    DIR/killsave-RANK.txt, and the rank ends."""
    w = torch.zeros(1 << 16)
    with Checkpointer(f"{d}/ks") as ck:
        try:
            for step in range(1, 100000):
                w[step % w.numel()] += 1
                ck.save(step, {"w": w})
                with open(f"{d}/progress-{rank}", "w") as f:
                    f.write(str(step))
        except Exception as e:
            with open(f"{d}/killsave-{rank}.txt", "w") as f:
                f.write(f"{type(e).__name__}: {e}")
            os._exit(3)


def scenario_killcheck(rank, world, d):
    """After the kill: the store's latest global step loads, and holds exactly what
    an uninterrupted run has at that step."""
    model, opt = build(5)
    train_step(model, opt)
    state = {"model": model, "optim": opt, "extra": {}}
    with Checkpointer(f"{d}/k") as ck:
        step = ck.load(state)
    if step is None:
        assert not amber.global_steps(f"{d}/k")
        return
    assert state["extra"] == {"step": step}, (state["extra"], step)
    got = full_state(model, opt)
    model, opt = build(0)
    for _ in range(step):
        train_step(model, opt)
    want = full_state(model, opt)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs from the uninterrupted run at step {step}"
    if rank == 0:
        json.dump({"step": step}, open(f"{d}/killcheck.json", "w"))


def scenario_retention(rank, world, d):
    """keep_last=2 with a full every 3rd step: after each step the store holds the
    newest 2 global steps and each rank's store their files back to their full step;
    then load(fallback=True) passes over a step damaged on one rank's file (every
    rank agrees on the older step) and fails, naming the rank, when none verifies."""
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    saved = {}
    with Checkpointer(f"{d}/r", keep_last=2, full_every=2, full_share=-1) as ck:
        for step in range(1, 7):
            train_step(model, opt)
            ck.save(step, {"model": model, "optim": opt, "extra": {"step": step}})
            ck.wait()
            saved[step] = full_state(model, opt)
            steps = [s.step for s in ck.steps()]
            assert steps == list(range(max(1, step - 1), step + 1)), (step, steps)
            full = max(f for f in (1, 4) if f <= steps[0])  # 1 F, 2-3 D, 4 F, 5-6 D
            files = sorted(int(f[5:25]) for f in os.listdir(f"{d}/r/rank-0000{rank}")
                           if f.startswith("ckpt-") and f.endswith(".amber"))
            assert files == list(range(full, step + 1)), (step, files)
    model, opt = build(3)
    train_step(model, opt)
    state = {"model": model, "optim": opt, "extra": {}}
    with Checkpointer(f"{d}/r") as ck:
        assert ck.load(state) == 6
        got = full_state(model, opt)
        for k in saved[6]:
            assert torch.equal(got[k], saved[6][k]), f"{k} differs at step 6"
        dist.barrier()
        if rank == 0:  # damages rank 1's file of step 6 (a delta)
            f = f"{d}/r/rank-00001/ckpt-{6:020d}.amber"
            b = bytearray(open(f, "rb").read())
            b[len(b) // 2] ^= 0xFF
            open(f, "wb").write(bytes(b))
        dist.barrier()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            assert ck.load(state, fallback=True) == 5
        assert ck.skipped == 1, ck.skipped
        assert any("step 6: rank" in str(x.message) for x in w), [str(x.message) for x in w]
        got = full_state(model, opt)
        for k in saved[5]:
            assert torch.equal(got[k], saved[5][k]), f"{k} differs at step 5 (fallback)"
        assert state["extra"] == {"step": 5}, state["extra"]
        dist.barrier()
        if rank == 0:  # and the full step 4, which step 5 needs
            f = f"{d}/r/rank-00000/ckpt-{4:020d}.amber"
            b = bytearray(open(f, "rb").read())
            b[len(b) // 2] ^= 0xFF
            open(f, "wb").write(bytes(b))
        dist.barrier()
        try:
            ck.load(state, fallback=True)
            raise AssertionError("load(fallback=True) with no step that verifies succeeded")
        except amber.AmberError as e:
            assert e.name == "AMBER_ECORRUPT", e
            assert "no global step verifies on every rank" in e.message, e.message
            assert "step 6: rank" in e.message and "step 5: rank" in e.message, e.message


# ---- issue 30: a damaged multi-rank store, at 2 ranks ----

DAMAGES = ("noglobal", "flipped", "truncated", "nomanifest", "swapped", "ranklatest")


def _manifest(store, step):
    return f"{store}/step-{step:020d}.manifest"


def _swap_shards(path):
    """Swaps the ranks of the two shards of the first tensor that two equal shards
    hold, in the manifest at `path`, and reseals it (its checksum recomputed, as a
    tool would): parsed by docs/FORMAT.md's tables, hashed with the system's xxHash."""
    import ctypes
    import ctypes.util
    import struct
    b = bytearray(open(path, "rb").read())
    world, _, ntensors = struct.unpack_from("<III", b, 32)
    pos = 56 + 32 * world
    for _ in range(ntensors):
        name_len, _, ndim, _, nshards = struct.unpack_from("<HBBII", b, pos)
        pos += 16 + name_len + 8 * ndim
        shards = [pos + i * (8 + 16 * ndim) for i in range(nshards)]
        shapes = [b[s + 8 + 8 * ndim:s + 8 + 16 * ndim] for s in shards]
        if nshards == 2 and shapes[0] == shapes[1]:
            r0, r1 = (struct.unpack_from("<I", b, s)[0] for s in shards)
            struct.pack_into("<I", b, shards[0], r1)
            struct.pack_into("<I", b, shards[1], r0)
            break
        pos += nshards * (8 + 16 * ndim)
    else:
        raise AssertionError("no tensor held by two equal shards")
    xxh = ctypes.CDLL(ctypes.util.find_library("xxhash"))
    xxh.XXH3_64bits.restype = ctypes.c_uint64
    xxh.XXH3_64bits.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    struct.pack_into("<Q", b, len(b) - 8, xxh.XXH3_64bits(bytes(b[:-8]), len(b) - 8))
    open(path, "wb").write(bytes(b))


def _damage(d, case):
    """A copy of DIR/s damaged as `case` says (rank 0; the test's CLI reads them too)."""
    import shutil
    p = f"{d}/{case}"
    shutil.copytree(f"{d}/s", p)
    if case == "noglobal":
        os.unlink(f"{p}/GLOBAL")
    elif case == "flipped":
        b = bytearray(open(_manifest(p, 6), "rb").read())
        b[len(b) // 2] ^= 0x10
        open(_manifest(p, 6), "wb").write(bytes(b))
    elif case == "truncated":
        os.truncate(_manifest(p, 6), 100)
    elif case == "nomanifest":  # GLOBAL names step 6, which has no manifest
        os.unlink(_manifest(p, 6))
    elif case == "swapped":
        _swap_shards(_manifest(p, 6))
    elif case == "ranklatest":
        os.unlink(f"{p}/rank-00001/LATEST")


def _fails(fn, *words):
    """fn() raises, with every word in its message (DCP's CheckpointException, a
    BaseException, carries each rank's failure)."""
    try:
        fn()
    except BaseException as e:
        text = f"{e} " + " ".join(str(x) for x in getattr(e, "failures", {}).values())
        assert all(w in text for w in words), (words, text)
        return text
    raise AssertionError(f"no failure, expected one saying {words}")


def _same(got, want, what):
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs ({what})"


def scenario_damage(rank, world, d):
    """2 ranks save steps 1-6, then load copies of the store damaged one way each
    (issue 30): without GLOBAL every load, fallback or not, and the next save are
    refused and every rank file stays; with the latest manifest flipped, truncated,
    removed (GLOBAL names it) or with two shards swapped between the ranks, a load
    of it fails, load(fallback=True) loads step 5 and dcp.load of it fails while
    dcp.load of step 5 loads; without rank 1's LATEST the latest step loads and
    the next save (step 7) commits. Also two ranks that declare the same rows
    through the global writer fail the step on both, naming both shards."""
    import torch.distributed.checkpoint as dcp  # noqa: F401  (dcp.load in _dcp_load)
    from amber.torch._comm import TorchComm
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    saved = {}
    with Checkpointer(f"{d}/s", full_share=-1) as ck:
        for step in range(1, 7):
            train_step(model, opt)
            ck.save(step, {"model": model, "optim": opt, "extra": {"step": step}})
            ck.wait()
            if step >= 5:
                saved[step] = full_state(model, opt)
    if rank == 0:
        torch.save(saved[5], f"{d}/damage-5.pt")
        for case in DAMAGES:
            _damage(d, case)
    dist.barrier()
    model, opt = build(3)
    train_step(model, opt)
    state = {"model": model, "optim": opt, "extra": {}}

    def files(p, r):
        return sorted(f for f in os.listdir(f"{p}/rank-0000{r}") if f.endswith(".amber"))

    p = f"{d}/noglobal"
    before = [files(p, r) for r in range(world)]
    with Checkpointer(p) as ck:
        _fails(lambda: ck.load(state), "GLOBAL is missing")
        _fails(lambda: ck.load(state, fallback=True), "GLOBAL is missing")
        _fails(lambda: ck.save(7, state), "GLOBAL is missing")
    _fails(lambda: _dcp_load(model, opt, p, extra=False), "GLOBAL is missing")
    assert [files(p, r) for r in range(world)] == before and len(before[0]) == 6, before

    for case, says in (("flipped", "checksum"), ("truncated", "manifest"),
                       ("nomanifest", "GLOBAL names step 6"), ("swapped", "moved or swapped")):
        p = f"{d}/{case}"
        with Checkpointer(p) as ck:
            assert [s.step for s in ck.steps()] == [1, 2, 3, 4, 5, 6], case
            # (a manifest that decodes but lies about its shards lists as intact)
            assert ck.steps()[-1].damaged == (case != "swapped"), case
            assert not ck.steps()[-2].damaged, case
            _fails(lambda: ck.load(state), says)
            with warnings.catch_warnings(record=True):
                warnings.simplefilter("always")
                assert ck.load(state, fallback=True) == 5, case
            assert ck.skipped == 1, (case, ck.skipped)
            assert state["extra"] == {"step": 5}, (case, state["extra"])
        _same(full_state(model, opt), saved[5], f"{case}: fallback")
        _fails(lambda: _dcp_load(model, opt, p, extra=False), says)
        model, opt = build(4)
        train_step(model, opt)
        _dcp_load(model, opt, f"{p}/step-5", extra=False)
        _same(full_state(model, opt), saved[5], f"{case}: dcp.load of step 5")
        state = {"model": model, "optim": opt, "extra": {}}

    p = f"{d}/ranklatest"
    with Checkpointer(p) as ck:
        assert ck.load(state) == 6
        _same(full_state(model, opt), saved[6], "without rank 1's LATEST")
        ck.save(7, state)  # the writer puts rank 1's LATEST back from the manifests
    assert os.path.exists(f"{p}/rank-00001/LATEST")
    assert [s.step for s in amber.global_steps(p)] == list(range(1, 8))

    # the same rows of a (256, 8) tensor declared by both ranks: the step fails on both
    w = torch.full((128, 8), float(rank))
    gw = amber.GlobalWriter(f"{d}/overlap", TorchComm(None))
    try:
        gw.add("w", amber.F32, (256, 8), (0, 0), (128, 8), w.data_ptr())
        _fails(lambda: gw.save(1), "tensor 'w'", "overlap", "rank 0", "rank 1")
    finally:
        gw.close()
    assert not amber.global_steps(f"{d}/overlap")


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"note": "plain"}}


def _dcp_load(model, opt, cid, extra=True, process_group=None):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from amber.dcp import Reader
    state = _dcp_state(model, opt)
    if not extra:
        del state["extra"]
    dcp.load(state, storage_reader=Reader(), checkpoint_id=cid, process_group=process_group)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert not extra or state["extra"] == {"note": "plain"}, state["extra"]


def scenario_dcp(rank, world, d):
    """dcp.save and dcp.async_save through amber.dcp.Writer at every step, then
    dcp.load of the latest step into a fresh model: bit-exact."""
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Writer
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    with Writer(policy="exact", full_share=-1) as w:  # deltas, however dense
        for step in range(1, 5):
            train_step(model, opt)
            cid = f"{d}/x/step-{step}"
            if step < 4:
                dcp.save(_dcp_state(model, opt), storage_writer=w, checkpoint_id=cid)
            else:
                f = dcp.async_save(_dcp_state(model, opt), storage_writer=w, checkpoint_id=cid)
                (f.upload_completion if hasattr(f, "upload_completion") else f).result()
        # a tensor rank 1 cannot store (a dtype amber does not write): the step fails on
        # every rank, naming rank 1, and the store stays at step 4
        bad = _dcp_state(model, opt)
        bad["extra"] = {"note": torch.zeros(2, dtype=torch.complex64 if rank == 1 else torch.float32)}
        try:
            dcp.save(bad, storage_writer=w, checkpoint_id=f"{d}/x/step-5")
            raise AssertionError("a save that rank 1 cannot store succeeded")
        except AssertionError:
            raise
        except BaseException as e:  # DCP's CheckpointException (a BaseException): per rank
            errs = [str(x) for x in getattr(e, "failures", {}).values()] or [str(e)]
            assert errs and all("rank 1 failed" in x for x in errs), errs
        assert [s.step for s in amber.global_steps(f"{d}/x")] == [1, 2, 3, 4]
        if os.environ.get("AMBER_DEVICE_PATH") == "1":  # the shards went through amber.device
            assert w._saver.dev is not None and w._saver.dev.tensors and w._saver.dev.copied > 0
    want = full_state(model, opt)
    if rank == 0:
        torch.save(want, f"{d}/x.pt")
    model, opt = build(3)
    train_step(model, opt)
    _dcp_load(model, opt, f"{d}/x")
    got = full_state(model, opt)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after dcp.load"
    _dcp_load(model, opt, f"{d}/x/step-2")  # an older step loads too (no check of values)
    # the distributed Checkpointer loads the store written through DCP, at 2 ranks here
    # and at 3 in scenario_dcpload
    _checkpointer_load(model, opt, f"{d}/x", want)


def _checkpointer_load(model, opt, path, want):
    model, opt = build(13)
    extra = {"note": ""}
    with Checkpointer(path) as ck:
        state = {"model": model, "optim": opt, "extra": extra}
        assert ck.load(state) == 4
    assert state["extra"] == {"note": "plain"}, state["extra"]
    got = full_state(model, opt)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after the Checkpointer's load"


def scenario_dcpmemory(rank, world, d):
    """amber.dcp.Writer(memory=...) at many ranks: each rank's part in its host's
    memory tier, drained to the store (close() waits for it). Reader(memory=...) then
    reads the newest step: on one host (one memory directory for both ranks) from the
    memory tier alone, with the store moved away; with a memory tier per host (one
    directory per rank) each rank's own files from its memory and the other's from
    the store. Bit-exact both ways."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from amber.dcp import Reader, Writer
    for layout in ("one host", "a host per rank"):
        torch.manual_seed(100 + rank)
        model, opt = build(0)
        mem = f"{d}/mem-one" if layout == "one host" else f"{d}/mem-{rank}"
        store = f"{d}/dm-{'one' if layout == 'one host' else 'per'}"
        with Writer(memory=mem, policy="exact", full_share=-1) as w:
            for step in (1, 2, 3):
                train_step(model, opt)
                dcp.save(_dcp_state(model, opt), storage_writer=w,
                         checkpoint_id=f"{store}/step-{step}")
        # each rank's close() waits for its own files; rank 0 moves the manifests and
        # GLOBAL last, so the store names step 3 once rank 0's close() has returned
        dist.barrier()
        assert [s.step for s in amber.global_steps(store)] == [1, 2, 3]
        assert [s.step for s in amber.global_steps(mem)][-1] == 3
        want = full_state(model, opt)
        if layout == "one host":
            dist.barrier()
            if rank == 0:
                os.rename(store, store + ".away")
            dist.barrier()
        model, opt = build(3)
        train_step(model, opt)
        state = _dcp_state(model, opt)
        reader = Reader(memory=mem)
        dcp.load(state, storage_reader=reader, checkpoint_id=store)
        set_state_dict(model, opt, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        assert state["extra"] == {"note": "plain"}, state["extra"]
        got = full_state(model, opt)
        for k in want:
            assert torch.equal(got[k], want[k]), f"{layout}: {k} differs after dcp.load"
        served = "memory" if layout == "one host" else "memory+durable"
        assert reader.served_by == served, (layout, reader.served_by)
        if layout == "one host":
            dist.barrier()
            if rank == 0:
                os.rename(store + ".away", store)
            dist.barrier()
    if rank == 0:
        open(f"{d}/dcpmemory.ok", "w").write(str(world))


def scenario_dcptiny(rank, world, d):
    """dcp.save twice and dcp.load through amber.dcp (what test_dist_dcp runs under
    torchrun)."""
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Writer
    model, opt = build(0)
    with Writer() as w:
        for step in (1, 2):
            train_step(model, opt)
            dcp.save(_dcp_state(model, opt), storage_writer=w, checkpoint_id=f"{d}/t/step-{step}")
    want = full_state(model, opt)
    model, opt = build(3)
    train_step(model, opt)
    _dcp_load(model, opt, f"{d}/t")
    got = full_state(model, opt)
    assert all(torch.equal(got[k], want[k]) for k in want)
    if rank == 0:
        open(f"{d}/dcptiny.ok", "w").write(str(world))


def scenario_dcpunits(rank, world, d):
    """amber.dcp with a rule in units of the learning rate at many ranks: each rank's
    shards get their param group's lr (the global writer's units), so the weights are
    lossy within 1 lr (and not exact), the moments within the same bound, the step
    counters exact."""
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Writer
    model, opt = build(0)
    lr = opt.param_groups[0]["lr"]
    with Writer(policy="threshold:1u", full_share=-1) as w:
        for step in (1, 2, 3):
            train_step(model, opt)
            dcp.save(_dcp_state(model, opt), storage_writer=w, checkpoint_id=f"{d}/u/step-{step}")
    want = full_state(model, opt)
    model, opt = build(3)
    train_step(model, opt)
    _dcp_load(model, opt, f"{d}/u")
    got = full_state(model, opt)
    lossy = False
    for k, v in want.items():
        err = (got[k].double() - v.double()).abs()
        if k.endswith("/step"):
            assert torch.equal(got[k], v), k
            continue
        assert bool((err <= lr * (1 + 1e-6)).all()), (k, float(err.max()))
        lossy |= k.startswith("model/") and bool((err > 0).any())
    assert lossy, "every weight exact: the units did not reach the global writer"
    if rank == 0:
        open(f"{d}/dcpunits.ok", "w").write(str(world))


def scenario_dcpload(rank, world, d):
    """dcp.load, at this world size, of the store the dcp scenario wrote at another
    (DIR/x), and of those written by a single process (DIR/one, DIR/ck1)."""
    for name in ("x", "one"):
        if os.path.exists(f"{d}/{name}"):
            _dcpload(rank, world, d, name)


def _dcpload(rank, world, d, name):
    want = torch.load(f"{d}/{name}.pt")
    torch.manual_seed(5 + rank)
    model, opt = build(11)
    train_step(model, opt)
    _dcp_load(model, opt, f"{d}/{name}")
    got = full_state(model, opt)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after dcp.load at {world} ranks"
    _checkpointer_load(model, opt, f"{d}/{name}", want)
    if name == "one":  # and amber.torch's single-process store of the same state
        model, opt = build(14)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            with Checkpointer(f"{d}/ck1") as ck:
                state = {"model": model, "optim": opt, "extra": {}}
                assert ck.load(state) == 4
                assert state["extra"] == {"note": "plain"}
                try:  # many ranks do not save into a single-process store
                    ck.save(5, state)
                    raise AssertionError("a save into a single-process store succeeded")
                except amber.AmberError as e:
                    assert "written by one process" in e.message, e.message
        assert (rank > 0) == any("keeps its own RNG" in str(x.message) for x in w)
        got = full_state(model, opt)
        for k in want:
            assert torch.equal(got[k], want[k]), f"{k} differs after loading ck1"


def save_one_process(d):
    """The dcp scenario's model trained and saved through amber.dcp by one process
    (no process group): DIR/one/step-4 and DIR/one.pt, for scenario_dcpload."""
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Writer
    torch.manual_seed(0)
    model = GPT()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(2):
        train_step(model, opt)
    with Writer() as w:
        dcp.save(_dcp_state(model, opt), storage_writer=w, checkpoint_id=f"{d}/one/step-4")
    want = {}
    for n, p in model.named_parameters():
        want[f"model/{n}"] = p.detach().clone()
        for k, v in opt.state[p].items():
            want[f"optim/{n}/{k}"] = v.clone()
    torch.save(want, f"{d}/one.pt")
    with Checkpointer(f"{d}/ck1") as ck:
        ck.save(4, {"model": model, "optim": opt, "extra": {"note": "plain"}})


def main():
    scenario, rank, world, init, d = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], \
        sys.argv[5]
    if init == "env":  # started by torchrun, which sets RANK, WORLD_SIZE, MASTER_*
        rank, world, init_method = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), \
            "env://"
    else:
        rank, world, init_method = int(rank), int(world), f"file://{init}"
    torch.set_num_threads(1)
    if scenario in ("resume", "failures"):
        # the tiny model's tensors are below the size that save() copies: read them in
        # place, as a real model's are, so the fence and its version check are exercised
        os.environ["AMBER_CAPTURE_BYTES"] = "0"  # (the default of capture_bytes)
    # a rank killed by the test must not leave the others waiting long
    timeout = 15 if scenario in ("killrun", "killsave") else 60
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout))
    try:
        globals()[f"scenario_{scenario}"](rank, world, d)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Every rank is done and its stores are closed. Leave without tearing the gloo
    # group down: its teardown at interpreter exit aborted a rank now and then on this
    # loaded machine ("terminate called without an active exception", after all work),
    # which is torch's, not the test's, business.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
