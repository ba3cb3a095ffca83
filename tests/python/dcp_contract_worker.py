"""One rank of test_dist_dcp.py's DCP-contract scenarios at many ranks.

    python dcp_contract_worker.py SCENARIO RANK WORLD INIT_FILE DIR

"contract": ShardedTensors (one shard per rank, and several per rank) saved by a
Writer given its path and no checkpoint_id (the next step each time), loaded back
shard for shard; a nested state dict loaded by DCP's empty-state-dict loader (what
dcp_to_torch_save runs) through the Reader's planner_data; dcp.async_save of a
DTensor and a BytesIO value (the bytes DCP's planner makes, stored by rank 0),
waited on as torch 2.13's AsyncSaveResponse, on a gloo group of its own.
"""
import datetime
import io
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

warnings.filterwarnings("ignore")

from amber.dcp import Reader, Writer  # noqa: E402


def sharded(spec, fill=None):
    from torch.distributed._shard import sharded_tensor
    # rows: 5 per placement of the finer spec (2 per rank), so that no shard is empty
    # (DCP's own plan validation refuses an empty shard past the end)
    st = sharded_tensor.zeros(spec, 10 * dist.get_world_size(), 20, init_rrefs=False)
    if fill is not None:
        for sh in st.local_shards():
            off = sh.metadata.shard_offsets
            rows = torch.arange(off[0], off[0] + sh.tensor.shape[0]).unsqueeze(1)
            sh.tensor.copy_(rows * 100.0 + torch.arange(20) + fill)
    return st


def same_shards(a, b):
    for x, y in zip(a.local_shards(), b.local_shards()):
        assert x.metadata.shard_offsets == y.metadata.shard_offsets
        assert torch.equal(x.tensor, y.tensor), x.metadata


def scenario_contract(rank, world, d):
    from torch.distributed._shard.sharding_spec import ChunkShardingSpec
    specs = [ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in range(world)])]
    # several shards of one tensor on each rank (a box each in the store)
    specs.append(ChunkShardingSpec(dim=0, placements=[f"rank:{r}/cpu" for r in
                                                      list(range(world)) * 2]))
    for k, spec in enumerate(specs):
        path = f"{d}/st{k}"
        w = Writer(path)
        for step in range(2):
            st = sharded(spec, fill=step)
            dcp.save({"st": st}, storage_writer=w)  # no checkpoint_id: Writer's path
        w.close()
        back = sharded(spec)
        dcp.load({"st": back}, storage_reader=Reader(path))
        same_shards(back, sharded(spec, fill=1))
        back = sharded(spec)
        dcp.load({"st": back}, storage_reader=Reader(f"{path}/step-0"))
        same_shards(back, sharded(spec, fill=0))

    # a nested state dict through DCP's empty-state-dict loader (planner_data)
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    nested = {"model": m.state_dict(), "cfg": {"lr": 0.5, "betas": [0.9, 0.99]}}
    with Writer(f"{d}/nested") as w:
        dcp.save(nested, storage_writer=w)
    got = {}
    _load_state_dict(got, storage_reader=Reader(f"{d}/nested"),
                     planner=_EmptyStateDictLoadPlanner())
    assert got["cfg"] == {"lr": 0.5, "betas": [0.9, 0.99]}, got["cfg"]
    for k, v in m.state_dict().items():
        assert torch.equal(got["model"][k], v), k

    # dcp.async_save of a DTensor and a BytesIO value, on a group of its own
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh
    mesh = init_device_mesh("cpu", (world,))
    x = distribute_tensor(torch.arange(4000.0).reshape(40, 100), mesh, [Shard(0)])
    pg = dist.new_group(backend="gloo")
    with Writer() as w:
        resp = dcp.async_save({"x": x, "blob": io.BytesIO(b"amber blob")}, storage_writer=w,
                              checkpoint_id=f"{d}/async/step-3", process_group=pg)
        resp.staging_completion.result()
        resp.upload_completion.result()
    y = distribute_tensor(torch.zeros(40, 100), mesh, [Shard(0)])
    back = {"x": y, "blob": io.BytesIO()}
    dcp.load(back, storage_reader=Reader(f"{d}/async"))
    assert torch.equal(back["x"].full_tensor(), torch.arange(4000.0).reshape(40, 100))
    assert back["blob"].getvalue() == b"amber blob", back["blob"]
    if rank == 0:
        open(f"{d}/contract.ok", "w").write(str(world))


def main():
    scenario, rank, world, init, d = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4], sys.argv[5]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    globals()[f"scenario_{scenario}"](rank, world, d)
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
