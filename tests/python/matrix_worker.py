"""One rank of the world-size matrix (tests/python/test_dist_matrix.py).

    python matrix_worker.py save|load RANK WORLD INIT_FILE DIR

At world size 1 the process is a plain one: no process group, the model unsharded
(what a user loading a checkpoint on a laptop runs). Above 1 the ranks join a gloo
group through the file:// rendezvous and shard dist_worker.GPT with FSDP2.

save: trains two steps and saves each through the Checkpointer (DIR/ckW) and
through dcp.save with amber.dcp.Writer (DIR/dcpW/step-N): a full checkpoint and a
delta; rank 0 writes every unsharded tensor of the final state to DIR/wantW.pt.
load: for every world size S that saved, loads DIR/ckS with the Checkpointer and
DIR/dcpS with dcp.load and amber.dcp.Reader into a fresh model, and checks every
tensor bit-exact against DIR/wantS.pt. At world size 1 it also saves a step into a
copy of the 4-rank stores (a global step of world size 1, through each API) and
loads it back.
"""
import datetime
import os
import shutil
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import amber
from amber.dcp import Reader, Writer
from amber.torch import Checkpointer

import dist_worker as W


def model_for(world, seed):
    if world > 1:
        return W.build(seed)
    torch.manual_seed(seed)
    model = W.GPT()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def unsharded(model, opt):
    """Every parameter and optimizer state as one whole tensor, by name."""
    def whole(t):
        return t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t.detach()
    out = {}
    for n, p in model.named_parameters():
        out[f"model/{n}"] = whole(p).clone()
        for k, v in opt.state.get(p, {}).items():
            out[f"optim/{n}/{k}"] = whole(v).clone()
    return out


def dcp_state(model, opt):
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": {"note": "plain"}}


def check(got, want, what):
    assert set(got) == set(want), f"{what}: {sorted(set(got) ^ set(want))[:4]}"
    for k in want:
        assert torch.equal(got[k], want[k]), f"{what}: {k} differs"


def save(rank, world, d):
    model, opt = model_for(world, 0)
    with Checkpointer(f"{d}/ck{world}", policy="exact", full_share=-1) as ck, \
            Writer(policy="exact", full_share=-1) as w:
        for step in (1, 2):
            W.train_step(model, opt)
            ck.save(step, {"model": model, "optim": opt, "extra": {"step": step}})
            dcp.save(dcp_state(model, opt), storage_writer=w,
                     checkpoint_id=f"{d}/dcp{world}/step-{step}")
    want = unsharded(model, opt)
    if rank == 0:
        torch.save(want, f"{d}/want{world}.pt")


def load_both(world, d, ck_path, dcp_id, want, step):
    model, opt = model_for(world, 7)
    W.train_step(model, opt)  # optimizer state to load into (DCP loads into what exists)
    extra = {}
    with Checkpointer(ck_path) as ck:
        state = {"model": model, "optim": opt, "extra": extra}
        got = ck.load(state)
        assert got == step, (ck_path, got, step)
    assert state["extra"] == {"step": step}, state["extra"]
    check(unsharded(model, opt), want, f"Checkpointer.load of {ck_path} at {world}")
    model, opt = model_for(world, 8)
    W.train_step(model, opt)
    sd = dcp_state(model, opt)
    sd["extra"] = {"note": ""}
    dcp.load(sd, storage_reader=Reader(), checkpoint_id=dcp_id)
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    assert sd["extra"] == {"note": "plain"}, sd["extra"]
    check(unsharded(model, opt), want, f"dcp.load of {dcp_id} at {world}")


def load(rank, world, d):
    for saved in (1, 2, 3, 4):
        want = torch.load(f"{d}/want{saved}.pt")
        load_both(world, d, f"{d}/ck{saved}", f"{d}/dcp{saved}", want, 2)
    if world > 1:
        return
    # one process continues the 4-rank stores: a global step of world size 1
    for src in ("ck4", "dcp4"):
        shutil.copytree(f"{d}/{src}", f"{d}/{src}w1")
    model, opt = model_for(1, 9)
    with Checkpointer(f"{d}/ck4w1") as ck:
        state = {"model": model, "optim": opt, "extra": {}}
        assert ck.load(state) == 2
        W.train_step(model, opt)
        state["extra"]["step"] = 3
        ck.save(3, state)
    with Writer() as w:
        dcp.save(dcp_state(model, opt), storage_writer=w, checkpoint_id=f"{d}/dcp4w1/step-3")
    assert [(s.step, s.world_size) for s in amber.global_steps(f"{d}/ck4w1")][-2:] == \
        [(2, 4), (3, 1)], amber.global_steps(f"{d}/ck4w1")
    assert amber.global_steps(f"{d}/dcp4w1")[-1].world_size == 1
    load_both(1, d, f"{d}/ck4w1", f"{d}/dcp4w1", unsharded(model, opt), 3)


def main():
    phase, rank, world, init, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        {"save": save, "load": load}[phase](rank, world, d)
        if world > 1:
            dist.barrier()
    except BaseException:
        if world > 1:
            dist.destroy_process_group()
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as dist_worker.py: no gloo teardown at interpreter exit


if __name__ == "__main__":
    main()
