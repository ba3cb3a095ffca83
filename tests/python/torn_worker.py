"""One rank of test_dist_torn_saves.py: dcp.async_save through amber.dcp at many ranks,
raced by training.

    python torn_worker.py SCENARIO RANK WORLD INIT_FILE DIR

An FSDP2-sharded linear layer of 4M weights and its AdamW state are saved with
dcp.async_save (on a gloo group of their own, as DCP's async planning needs under
FSDP2), and changed right after the call, before the staging completed: by the next
optimizer.step() (which amber fences: the step is the state at the call), or by an
in-place op on the DTensors (the step is the state at the call, or refused with
AMBER_ECHANGED on every rank). Then a correct save loads exactly.
"""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict
from torch.distributed.fsdp import fully_shard

import amber
from amber.dcp import Reader, Writer

W = 2048


def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(W, W, bias=False))
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3)


def grads(model, seed):
    torch.manual_seed(seed)
    model(torch.randn(4, W)).square().mean().backward()


def snapshot(model, opt):
    """Every parameter and AdamW state of this rank: its local shards, cloned."""
    msd, osd = get_state_dict(model, opt)
    out = {f"m/{k}": v.to_local().clone() for k, v in msd.items()}
    for p, st in osd["state"].items():
        for k, v in st.items():
            out[f"o/{p}/{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def load(cid):
    model, opt = build()
    grads(model, 99)
    opt.step()  # the moments exist, to be overwritten
    msd, osd = get_state_dict(model, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=Reader(), checkpoint_id=cid)
    out = {f"m/{k}": v.to_local().clone() for k, v in sd["model"].items()}
    for p, st in sd["optim"]["state"].items():
        for k, v in st.items():
            out[f"o/{p}/{k}"] = (v.to_local() if hasattr(v, "to_local") else v).clone()
    return out


def amber_error(e):
    if isinstance(e, amber.AmberError):
        return e
    for exc, _ in getattr(e, "failures", {}).values():
        if isinstance(exc, amber.AmberError):
            return exc
    raise AssertionError(f"not an amber error: {e!r}") from e


def check(resp, cid, pre):
    """The state at the call, or AMBER_ECHANGED; returns whether it committed."""
    try:
        resp.upload_completion.result()
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        err = amber_error(e)
        assert err.name in ("AMBER_ECHANGED", "AMBER_ECANCELED"), err
        assert "changed in place" in str(err), err
        return False
    got = load(cid)
    for k in pre:
        assert torch.equal(got[k], pre[k]), f"{cid}: {k} is not the state at the call"
    return True


def main():
    scenario, rank, world, init, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    assert scenario == "torn"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    pg = dist.new_group(backend="gloo")  # DCP's async planning apart from FSDP2's collectives
    model, opt = build()
    w = Writer(policy="exact")
    grads(model, 1)
    committed = refused = 0
    for step in range(1, 7):
        opt.step()
        opt.zero_grad()
        grads(model, step + 1)  # the next step's gradients, ready before the save
        msd, osd = get_state_dict(model, opt)
        pre = snapshot(model, opt)
        cid = f"{d}/x/step-{step}"
        r = dcp.async_save({"model": msd, "optim": osd}, storage_writer=w, checkpoint_id=cid,
                           process_group=pg)
        if step % 2:
            opt.step()  # no wait on staging_completion: amber fences before the step
            opt.zero_grad()
            grads(model, step + 1)
            assert check(r, cid, pre), f"step {step} after optimizer.step() was refused"
        else:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(1.0)  # a DTensor in-place op: its version counter moves
            ok = check(r, cid, pre)
            committed += ok
            refused += not ok
    # a correct save after everything loads exactly
    msd, osd = get_state_dict(model, opt)
    pre = snapshot(model, opt)
    dcp.save({"model": msd, "optim": osd}, storage_writer=w, checkpoint_id=f"{d}/x/step-9")
    got = load(f"{d}/x/step-9")
    for k in pre:
        assert torch.equal(got[k], pre[k]), f"step 9: {k} differs"
    w.close()
    print(f"rank {rank}: in-place races: {committed} committed, {refused} refused")
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
