"""One rank of the distributed Checkpointer's tests (tests/python/test_dist_checkpointer.py).

    python dist_worker.py SCENARIO RANK WORLD INIT_FILE DIR

Joins a gloo process group through torch.distributed's own file:// rendezvous,
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

    def forward(self, x):
        h = self.emb(x)
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
    with Checkpointer(f"{d}/b") as ck:
        run(model, opt, ck, 1, 3)
        kinds = [s.kind for s in ck.steps()]
    del model, opt
    torch.manual_seed(999)  # the restart's own RNG and weights, which the load replaces
    model, opt = build(7)
    with Checkpointer(f"{d}/b") as ck:
        state = {"model": model, "optim": opt, "extra": {}}
        assert ck.load(state) == 3
        assert state["extra"] == {"step": 3}, state["extra"]
        losses_c = run(model, opt, ck, 4, 6)
    got = full_state(model, opt)
    assert losses_c == losses_a[3:], (losses_a, losses_c)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after the resume"
    assert kinds[0] == "full", kinds
    if rank == 0:
        torch.save(want, f"{d}/a.pt")
        json.dump({"kinds": kinds}, open(f"{d}/resume.json", "w"))


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
    for name, policy in cfg.get("save", []):
        torch.manual_seed(100 + rank)
        model, opt = build(0)
        with Checkpointer(f"{d}/{name}", policy=policy) as ck:
            run(model, opt, ck, 1, 3)
        want = full_state(model, opt)
        if rank == 0:
            torch.save(want, f"{d}/{name}.pt")


def _dcp_state(model, opt):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"note": "plain"}}


def _dcp_load(model, opt, cid):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from amber.dcp import Reader
    state = _dcp_state(model, opt)
    dcp.load(state, storage_reader=Reader(), checkpoint_id=cid)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["extra"] == {"note": "plain"}, state["extra"]


def scenario_dcp(rank, world, d):
    """dcp.save and dcp.async_save through amber.dcp.Writer at every step, then
    dcp.load of the latest step into a fresh model: bit-exact."""
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Writer
    torch.manual_seed(100 + rank)
    model, opt = build(0)
    with Writer(policy="exact") as w:
        for step in range(1, 5):
            train_step(model, opt)
            cid = f"{d}/x/step-{step}"
            if step < 4:
                dcp.save(_dcp_state(model, opt), storage_writer=w, checkpoint_id=cid)
            else:
                f = dcp.async_save(_dcp_state(model, opt), storage_writer=w, checkpoint_id=cid)
                (f.upload_completion if hasattr(f, "upload_completion") else f).result()
        # a value rank 1 cannot store without pickle: the step fails on every rank,
        # naming rank 1, and the store stays at step 4
        bad = _dcp_state(model, opt)
        bad["extra"] = {"note": object() if rank == 1 else "plain"}
        try:
            dcp.save(bad, storage_writer=w, checkpoint_id=f"{d}/x/step-5")
            raise AssertionError("a save that rank 1 cannot store succeeded")
        except AssertionError:
            raise
        except BaseException as e:  # DCP's CheckpointException (a BaseException): per rank
            errs = [str(x) for x in getattr(e, "failures", {}).values()] or [str(e)]
            assert errs and all("rank 1 failed" in x for x in errs), errs
        assert [s.step for s in amber.global_steps(f"{d}/x")] == [1, 2, 3, 4]
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


def scenario_dcpload(rank, world, d):
    """dcp.load, at this world size, of the store the dcp scenario wrote at another."""
    want = torch.load(f"{d}/x.pt")
    torch.manual_seed(5 + rank)
    model, opt = build(11)
    train_step(model, opt)
    _dcp_load(model, opt, f"{d}/x")
    got = full_state(model, opt)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), f"{k} differs after dcp.load at {world} ranks"


def main():
    scenario, rank, world, init, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    if scenario in ("resume", "failures"):
        # the tiny model's tensors are below the size that save() copies: read them in
        # place, as a real model's are, so the fence and its version check are exercised
        amber.torch.CAPTURE_BYTES = 0
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        globals()[f"scenario_{scenario}"](rank, world, d)
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
