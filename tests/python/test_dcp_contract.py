"""amber.dcp keeps DCP's contract, in one process (the 2-rank cases are in
test_dist_dcp.py): a Writer given its path saves without a checkpoint_id (to the next
step each time, also through DCP's own _save_state_dict); the Reader's Metadata carries
DCP's planner_data, so DCP's empty-state-dict loader (what dcp_to_torch_save runs)
rebuilds the nested state dict and loads part of it; what a planner resolves is what
amber writes; overwrite=False refuses an existing step; values that are not plain data
(bytes, BytesIO, objects) are stored as the bytes DCP's planner makes of them and come
back through dcp.load; PROCESS-based async saves are refused with what to use instead."""

import io
import json
import os
import warnings

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner  # noqa: E402
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict  # noqa: E402
from torch.distributed.checkpoint.state_dict_saver import _save_state_dict  # noqa: E402

import amber  # noqa: E402
from amber.dcp import Reader, Writer  # noqa: E402

warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")


def failure(fn, *args, **kw):
    """What fn raised: the exception, or the one DCP's CheckpointException carries."""
    with pytest.raises(BaseException) as ei:
        fn(*args, **kw)
    e = ei.value
    for exc, _ in getattr(e, "failures", {}).values():
        return exc
    return e


def model_state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(5, 10), torch.nn.ReLU(), torch.nn.Linear(10, 3))
    return m


def test_writer_given_its_path_saves_without_a_checkpoint_id(tmp_path):
    """Writer(P): dcp.save without checkpoint_id= saves into P, at the next step each
    time (also through DCP's internal _save_state_dict); dcp.load of P is the latest."""
    store = str(tmp_path / "run")
    w = Writer(store)
    x = torch.arange(12.0)
    dcp.save({"x": x}, storage_writer=w)
    x += 1
    dcp.save({"x": x}, storage_writer=w)
    x += 1
    _save_state_dict({"x": x}, storage_writer=w, planner=DefaultSavePlanner(), no_dist=True)
    w.close()
    assert [s.step for s in amber.Store(store, readonly=True, create=False).list()] == [0, 1, 2]
    back = {"x": torch.zeros(12)}
    dcp.load(back, storage_reader=Reader(store))
    assert torch.equal(back["x"], x)
    back = {"x": torch.zeros(12)}
    dcp.load(back, storage_reader=Reader(f"{store}/step-0"))
    assert torch.equal(back["x"], torch.arange(12.0))


def _empty_load(store, keys=None):
    """DCP's loader of a checkpoint into an empty state dict (dcp_to_torch_save's), from
    amber's Reader."""
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    sd = {}
    _load_state_dict(sd, storage_reader=Reader(store),
                     planner=_EmptyStateDictLoadPlanner(keys=keys), no_dist=True)
    return sd


@pytest.mark.parametrize("writer", ["dcp", "checkpointer"])
def test_reader_metadata_has_planner_data_for_nested_and_partial_loads(tmp_path, writer):
    m = model_state()
    opt = torch.optim.AdamW(m.parameters())
    m(torch.randn(2, 5)).sum().backward()
    opt.step()
    store = str(tmp_path / "run")
    if writer == "dcp":
        from torch.distributed.checkpoint.state_dict import get_state_dict
        msd, osd = get_state_dict(m, opt)
        with Writer(store) as w:
            dcp.save({"model": msd, "optim": osd, "extra": {"epoch": 3}}, storage_writer=w)
    else:
        from amber.torch import Checkpointer
        with Checkpointer(store, rng=False) as ck:
            ck.save(1, {"model": m, "extra": {"epoch": 3}})
    sd = _empty_load(store)
    assert set(sd) >= {"model", "extra"}, list(sd)
    assert sd["extra"] == {"epoch": 3}
    assert sd["model"].keys() == m.state_dict().keys()
    for k, v in m.state_dict().items():
        assert torch.equal(sd["model"][k], v), k
    part = _empty_load(store, keys={"model"})
    assert set(part) == {"model"} and part["model"].keys() == m.state_dict().keys()


def test_what_the_planner_resolves_is_what_amber_writes(tmp_path):
    """A planner that transforms what it resolves (here: every tensor doubled) has its
    data written, not the state dict's."""
    class Doubling(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            out = super().transform_object(write_item, object)
            return out * 2 if isinstance(out, torch.Tensor) else out
    store = str(tmp_path / "run")
    x = torch.arange(6.0)
    with Writer(store) as w:
        dcp.save({"x": x}, storage_writer=w, planner=Doubling())
    back = {"x": torch.zeros(6)}
    dcp.load(back, storage_reader=Reader(store))
    assert torch.equal(back["x"], 2 * x)


def test_async_save_refuses_a_planner_whose_resolution_it_would_ignore(tmp_path):
    """dcp.async_save stages before DCP plans: a planner that transforms what it
    resolves is refused with a message that says why, nothing is committed, and the
    Writer saves again (a planner that resolves as the default one is fine)."""
    class Doubling(DefaultSavePlanner):
        def transform_object(self, write_item, object):
            out = super().transform_object(write_item, object)
            return out * 2 if isinstance(out, torch.Tensor) else out

    class Planning(DefaultSavePlanner):  # changes no data: accepted
        pass
    store = str(tmp_path / "run")
    x = torch.arange(6.0)
    with Writer() as w:
        e = failure(lambda: dcp.async_save({"x": x}, storage_writer=w, planner=Doubling(),
                                           checkpoint_id=f"{store}/step-1")
                    .upload_completion.result())
        assert isinstance(e, NotImplementedError) and "transform_object" in str(e) and \
            "dcp.save" in str(e), e
        if os.path.isdir(store):
            with amber.Store(store, readonly=True) as st:
                assert st.list() == []
        dcp.async_save({"x": x}, storage_writer=w, planner=Planning(),
                       checkpoint_id=f"{store}/step-1").upload_completion.result()
    back = {"x": torch.zeros(6)}
    dcp.load(back, storage_reader=Reader(store))
    assert torch.equal(back["x"], x)


def test_local_shards_of_one_tensor_in_one_process_are_saved_whole(tmp_path):
    """A tensor that exists only through DCP's checkpointable protocol (a wrapper of
    local shards, as LocalShardsWrapper) is written as its write items say."""
    pytest.importorskip("torch.distributed.tensor._shards_wrapper")
    from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper
    a, b = torch.arange(8.0).reshape(2, 4), torch.arange(8.0, 16.0).reshape(2, 4)
    wrapped = LocalShardsWrapper([a, b], [(0, 0), (0, 4)])  # columns 0-3 and 4-7
    store = str(tmp_path / "run")
    with Writer(store) as w:
        dcp.save({"t": wrapped}, storage_writer=w)
    back = {"t": torch.zeros(2, 8)}
    dcp.load(back, storage_reader=Reader(store))
    assert torch.equal(back["t"], torch.cat([a, b], dim=1))


def test_overwrite_false_refuses_an_existing_step_and_true_explains(tmp_path):
    store = str(tmp_path / "run")
    with Writer(overwrite=False) as w:
        dcp.save({"x": torch.ones(3)}, storage_writer=w, checkpoint_id=f"{store}/step-4")
        e = failure(dcp.save, {"x": torch.ones(3)}, storage_writer=w,
                    checkpoint_id=f"{store}/step-4")
        assert isinstance(e, FileExistsError) and "overwrite=False" in str(e), e
        dcp.save({"x": torch.ones(3)}, storage_writer=w, checkpoint_id=f"{store}/step-5")
    with Writer() as w:
        e = failure(dcp.save, {"x": torch.ones(3)}, storage_writer=w,
                    checkpoint_id=f"{store}/step-4")
        assert isinstance(e, FileExistsError) and "immutable" in str(e), e
    assert [s.step for s in amber.Store(store, readonly=True, create=False).list()] == [4, 5]


class Blob:
    def __init__(self, v):
        self.v = v

    def __eq__(self, other):
        return isinstance(other, Blob) and self.v == other.v


def test_values_that_are_not_plain_data_are_stored_as_dcps_bytes(tmp_path):
    """BytesIO, bytes and objects: stored exactly (the bytes DCP's planner makes of
    them, checksummed like any tensor) and handed back to DCP's loader; plain data
    stays JSON; amber.torch's Checkpointer refuses to unpickle such a value."""
    store = str(tmp_path / "run")
    sd = {"x": torch.arange(4.0), "raw": b"\x00\x01amber", "buf": io.BytesIO(b"some blob"),
          "obj": Blob([1, 2]), "cfg": {"lr": 0.1}}
    with Writer(store) as w:
        dcp.save(sd, storage_writer=w)
    with amber.Store(store, readonly=True, create=False) as st, st.reader() as r:
        meta = json.loads(r.meta())
        names = {t.name for t in r.tensors()}
    assert sorted(meta["bytes"]) == ["buf", "obj", "raw"] and meta["objects"] == {"cfg/lr": 0.1}
    assert {"buf", "obj", "raw"} <= names
    back = {"x": torch.zeros(4), "raw": b"", "buf": io.BytesIO(), "obj": None, "cfg": {"lr": 0.0}}
    dcp.load(back, storage_reader=Reader(store))
    assert torch.equal(back["x"], sd["x"]) and back["raw"] == b"\x00\x01amber"
    assert back["buf"].getvalue() == b"some blob" and back["obj"] == Blob([1, 2])
    assert back["cfg"] == {"lr": 0.1}
    from amber.torch import Checkpointer
    with Checkpointer(store, readonly=True, rng=False) as ck:
        e = failure(ck.load, {"obj": None})
        assert isinstance(e, amber.AmberError) and e.name == "AMBER_EFORMAT"
        assert "does not unpickle" in str(e), e
        got = {"x": torch.zeros(4), "cfg": {}}
        assert ck.load(got) == 0 and got["cfg"] == {"lr": 0.1}


def test_process_based_async_save_is_refused_naming_thread(tmp_path):
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    with Writer(str(tmp_path / "run")) as w:
        e = failure(dcp.async_save, {"x": torch.ones(2)}, storage_writer=w,
                    async_checkpointer_type=AsyncCheckpointerType.PROCESS)
        assert "PROCESS" in str(e) and "THREAD" in str(e), e
