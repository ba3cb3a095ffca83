"""The shared parts of the save and load pipelines, in this process (the multi-process
scenarios stay in test_dist_*.py): the Saver over either sink with the communicator of
one process, the vote, the capture rule, the sources, the metadata conversions, and
the save plan at a multi-rank store. Every front end runs these parts: the
Checkpointer at any world size and amber.dcp's Writer."""

import os

import pytest

torch = pytest.importorskip("torch")

import amber  # noqa: E402
from amber.torch import Checkpointer  # noqa: E402
from amber.torch import _comm, _meta  # noqa: E402
from amber.torch._capture import CAPTURE_BYTES, Versions  # noqa: E402
from amber.torch._encode import flatten  # noqa: E402
from amber.torch._load import Load  # noqa: E402
from amber.torch._options import Options  # noqa: E402
from amber.torch._save import Saver, in_place_names  # noqa: E402
from amber.torch._sink import GlobalSink, StoreSink  # noqa: E402
from amber.torch._source import GlobalSource, StoreSource, TieredStep, source_for  # noqa: E402


def save(sv, step, tensors, state=None, touch=None):
    """One save through the Saver as the front ends run it; `touch` changes a tensor
    between begin and the fence (a torn save)."""
    items = [it for it in sv.items(tensors, state) if it is not None]
    sv.declare(step, items, None)
    sv.sink.set_meta(_meta.dumps({"format": sv.sink.meta_format, "entries": {}}))
    names, ts = in_place_names(items)
    sv.begin(step, False, Versions(names, ts), [it.source for it in items if it.source is not None],
             any(it.in_place for it in items), {}, state)
    if touch is not None:
        touch()
    sv.fence()
    sv.wait()


def restored(source, step, like):
    """Every tensor of `like` ({name: tensor}) as `source` restores step `step`."""
    out = {n: torch.zeros_like(t) for n, t in like.items()}
    with source.open(step, False, _comm.SoloComm(), {}, 0) as s:
        infos = {i.name: i for i in s.reader.tensors()}
        ld = Load(s.reader, True, s.step, boxes=s.boxes)
        ld.fresh = []
        ld.inplace = [(infos[n].index, t, n, None) for n, t in out.items()]
        ld.apply()
    return out


@pytest.mark.parametrize("kind", ["store", "global"])
def test_saver_writes_full_then_delta_and_refuses_a_torn_save(tmp_path, kind):
    """The same Saver steps over a store of one process and a multi-rank store (with
    the communicator of one process): a full save, a delta, a save torn by an
    in-place change before the fence (AMBER_ECHANGED, nothing committed), then a
    correct save again."""
    opts = Options.make()
    path = str(tmp_path / "s")
    comm = _comm.SoloComm()
    sink = StoreSink(path, opts.writer, opts.rules) if kind == "store" else \
        GlobalSink(path, opts.writer, opts.rules, comm)
    sv = Saver(sink, comm, opts)
    w = torch.randn(100_000)
    small = torch.randn(10)
    tensors = [("w", w), ("small", small)]
    save(sv, 1, tensors)
    w[::7] += 1
    save(sv, 2, tensors)
    want = {"w": w.clone(), "small": small.clone()}
    with pytest.raises(amber.AmberError) as ei:
        save(sv, 3, tensors, touch=lambda: w.add_(1))
    assert ei.value.name == "AMBER_ECHANGED" and "'w' changed in place" in str(ei.value)
    w[::5] += 2
    save(sv, 4, tensors)
    steps = sink.steps()
    assert [s.step for s in steps] == [1, 2, 4]
    assert [s.kind for s in steps][:2] == ["full", "delta"]
    source = StoreSource(path, sink.store) if kind == "store" else GlobalSource(path)
    got2 = restored(source, 2, want)
    assert all(torch.equal(got2[n], want[n]) for n in want)
    got4 = restored(source, 4, want)
    assert torch.equal(got4["w"], w) and torch.equal(got4["small"], small)
    sv.close()


def test_capture_rule_reads_large_and_owned_tensors_in_place_and_copies_the_rest(tmp_path):
    opts = Options.make()
    sv = Saver(StoreSink(str(tmp_path / "s"), opts.writer, opts.rules), _comm.SoloComm(), opts)
    lin = torch.nn.Linear(4, 4)
    bn = torch.nn.BatchNorm1d(4)
    model = torch.nn.Sequential(lin, bn)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    big = torch.randn(CAPTURE_BYTES // 4 + 1)
    with torch.inference_mode():
        inf = torch.randn(CAPTURE_BYTES // 4 + 1)
    state = {"model": model, "opt": opt}
    tensors = [("weight", lin.weight), ("running_mean", bn.running_mean), ("big", big),
               ("small", torch.randn(3)), ("inference", inf), ("strided", big[::2])]
    got = {it.decl.name: it for it in sv.items(tensors, state)}
    assert got["weight"].in_place and got["weight"].source is lin.weight  # an optimizer's: any size
    assert got["big"].in_place                                            # above capture_bytes
    for name in ("running_mean", "small", "inference", "strided"):       # copied now
        it = got[name]
        assert not it.in_place and it.source is not None
        assert it.source.data_ptr() != it.local.data_ptr() and torch.equal(it.source, it.local)
    # the staging buffers are reused from save to save
    again = {it.decl.name: it for it in sv.items(tensors, state)}
    assert again["small"].source is got["small"].source
    sv.close()


class _TwoRanks:
    """A communicator of two ranks in this process: the other rank's vote is given."""
    rank, size = 0, 2

    def __init__(self, other_flags, other_err):
        self.other_flags, self.other_err = other_flags, other_err

    def allgather(self, data):
        return bytes(data) + bytes([self.other_flags])

    def gather_objects(self, obj):
        return [obj, self.other_err]


def test_vote_names_the_rank_that_failed_and_agrees_on_a_reopen():
    flags, failure = _comm.vote(_TwoRanks(0x80, "TypeError: boom"), None, 0)
    assert failure == (1, "TypeError: boom")
    flags, failure = _comm.vote(_TwoRanks(1, None), None, 2)
    assert failure is None and flags == [2, 1]
    opts = Options.make()
    sv = Saver(type("S", (), {"dist": True, "writer": None})(), _TwoRanks(0x80, "ValueError: x"),
               opts)
    with pytest.raises(amber.AmberError) as ei:
        sv.vote(7, None, False, False)
    assert ei.value.name == "AMBER_ECANCELED" and ei.value.rank == 1
    assert "step 7 not committed: rank 1 failed: ValueError: x" in str(ei.value)
    with pytest.raises(TypeError, match="mine"):  # one process: its own error, as it is
        Saver(sv.sink, _comm.SoloComm(), opts).vote(7, TypeError("mine"), False, False)


def _model_state():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    m(torch.randn(2, 3)).sum().backward()
    opt.step()
    return {"model": m, "optim": opt, "extra": {"epoch": 3, "t": (1, 2.5)}}


def test_metadata_conversions_between_the_checkpointer_and_dcp_formats():
    """The Checkpointer's entries as amber.dcp's keys and objects (what the DCP Reader
    offers: every tensor under its own name, values decoded), and amber.dcp's keys
    and objects as the Checkpointer's entries (what a Checkpointer load of a
    DCP-written step plans): the same tensors under the same names, the same values."""
    state = _model_state()
    flat, meta = flatten(state, False)
    meta["format"] = _meta.TORCH
    keys, objects, _ = _meta.dcp_view(meta, 1)
    tensors = {n for n, _ in flat.tensors}
    assert {v for v in keys.values() if v not in objects} == tensors
    assert objects[keys["extra.epoch"]] == 3
    # a state dict as DCP users save it, named as amber.dcp's Writer names its items
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(state["model"], state["optim"])
    dflat, mappings = flatten_state_dict({"model": msd, "optim": osd, "extra": state["extra"]})
    names = {k: "/".join(str(p) for p in mappings[k]) for k in dflat}
    dcp_objects = {names[k]: v for k, v in dflat.items() if not torch.is_tensor(v)}
    back = _meta.dcp_entries(names, dcp_objects, state, 1)
    assert set(back) == {"model", "optim", "extra"}
    assert set(back["model"]["state"]) == set(meta["entries"]["model"]["state"])
    assert back["optim"]["state"].keys() == meta["entries"]["optim"]["state"].keys()
    assert back["extra"]["value"]["epoch"] == 3


@pytest.mark.parametrize("kind", ["store", "global"])
def test_step_view_is_what_every_reader_reads(tmp_path, kind):
    """The Step both sources open (what the Checkpointer's load, the DCP Reader and
    hf.export read through): tensors by name, rank 0's metadata, a box out of a tensor
    and whole tensors, each in one call; hf.export's reader gets the same values."""
    from amber.integrations import hf
    opts, comm = Options.make(), _comm.SoloComm()
    path = str(tmp_path / "s")
    sink = StoreSink(path, opts.writer, opts.rules) if kind == "store" else \
        GlobalSink(path, opts.writer, opts.rules, comm)
    sv = Saver(sink, comm, opts)
    w, b = torch.randn(40, 30), torch.randn(7)
    save(sv, 1, [("model/w", w), ("model/b", b)])
    w[3] += 1
    save(sv, 2, [("model/w", w), ("model/b", b)])
    sv.close()
    source = source_for(path)
    assert type(source) is (StoreSource if kind == "store" else GlobalSource)
    with source.step() as s:
        assert (s.step, s.many, s.world) == (2, kind == "global", 1)
        assert _meta.parse(s.meta(0), s.where)["format"] == sink.meta_format
        if kind == "store":
            assert s.meta(1) is None  # one process: rank 0's metadata alone
        i = s.find("model/w")
        assert tuple(s.info(i).shape) == (40, 30) and s.find("nothing") is None
        box = torch.empty(10, 5)
        s.read_boxes([(i, (2, 10), (10, 5), box.data_ptr(), box.numel() * 4)])
        assert torch.equal(box, w[2:12, 10:15])
        whole = torch.empty(7)
        s.read_whole([(s.find("model/b"), whole)])
        assert torch.equal(whole, b)
    with source.step(1) as s:
        old = torch.empty(40, 30)
        s.read_whole([(s.find("model/w"), old)])
        assert s.step == 1 and torch.equal(old[4:], w[4:]) and not torch.equal(old[3], w[3])
    step, tensors, raw = hf._read_model(path, None, "model/")
    assert step == 2 and set(tensors) == {"w", "b"} and raw == _meta.dumps(
        {"format": sink.meta_format, "entries": {}}).encode()
    assert torch.equal(tensors["w"], w) and torch.equal(tensors["b"], b)
    with pytest.raises(FileNotFoundError, match="is not an amber store"):
        source_for(str(tmp_path))


def test_a_tiered_step_reads_the_fastest_tier_and_falls_back_where_a_file_is_missing(tmp_path):
    """TieredStep (what the DCP Reader reads a multi-rank memory tier through): reads
    come from the first tier while it holds the files, from the next where a file is
    missing there (`used` names both), and with no tier left the error says which
    tier lacked it and that the durable tier does not hold the step."""
    opts, comm = Options.make(), _comm.SoloComm()
    paths = [str(tmp_path / "memory"), str(tmp_path / "durable")]
    w = torch.randn(64)
    for path in paths:  # the same step in both tiers, as the drain leaves them
        sv = Saver(GlobalSink(path, opts.writer, opts.rules, comm), comm, opts)
        save(sv, 1, [("w", w)])
        sv.close()
    with GlobalSource(paths[0]).step() as m, GlobalSource(paths[1]).step() as d:
        used = []
        s = TieredStep([m, d], ["memory", "durable"], used)
        got = torch.empty(64)
        s.read_whole([(s.find("w"), got)])
        assert torch.equal(got, w) and used == ["memory"]
    os.remove(os.path.join(paths[0], "rank-00000", f"ckpt-{1:020d}.amber"))
    with GlobalSource(paths[0]).step() as m, GlobalSource(paths[1]).step() as d:
        used = []
        s = TieredStep([m, d], ["memory", "durable"], used)
        got = torch.empty(64)
        s.read_whole([(s.find("w"), got)])
        # the tensor table is the memory tier's manifest; the data came from durable
        assert torch.equal(got, w) and used == ["memory", "durable"]
    with GlobalSource(paths[0]).step() as m:
        s = TieredStep([m], ["memory"], [])
        with pytest.raises(amber.AmberError, match="durable tier does not hold global step 1"):
            s.read_whole([(s.find("w"), torch.empty(64))])


def _loads_as(path, step, model):
    """A fresh state loaded from `path` is at `step` with `model`'s parameters."""
    want = {n: p.detach().clone() for n, p in model.named_parameters()}
    fresh = _model_state()
    with Checkpointer(path, readonly=True) as ck:
        assert ck.load(fresh) == step
    for n, p in fresh["model"].named_parameters():
        assert torch.equal(p, want[n]), n


def test_checkpointer_on_a_multi_rank_store_in_one_process_plans_its_saves(tmp_path):
    """One process on a multi-rank store (a GlobalSink with the communicator of one):
    the same save plan as on one store (the second save does not walk the structure
    again), deltas, and a load through the GlobalSource."""
    path = str(tmp_path / "g")
    state = _model_state()
    with amber.GlobalWriter(path) as g:  # make it a multi-rank store (world size 1)
        t = torch.zeros(1)
        g.add("seed", amber.F32, (1,), (0,), (1,), t.data_ptr())
        g.save(0)
    with Checkpointer(path, full_share=-1) as ck:
        assert isinstance(ck._sink, GlobalSink)
        for step in (1, 2, 3):
            state["optim"].step()
            ck.save(step, state)
            if step == 2:
                assert ck._saveplan is not None  # made by step 1
            ck.wait()
        assert [s.kind for s in ck.steps()][-2:] == ["delta", "delta"]
    _loads_as(path, 3, state["model"])


def test_a_load_of_a_multi_rank_store_seeds_the_rank_writer(tmp_path):
    """After a load of the latest global step, the rank's writer (opened by the load,
    as the first save would) takes the live tensors as its reference on a thread: the
    next save is a delta that reads nothing back (the rank's file of the loaded step
    is moved away while it runs) and restores exactly. A load of an older step seeds
    nothing."""
    path = str(tmp_path / "g")
    with amber.GlobalWriter(path) as g:  # make it a multi-rank store (world size 1)
        t = torch.zeros(1)
        g.add("seed", amber.F32, (1,), (0,), (1,), t.data_ptr())
        g.save(0)
    state = _model_state()
    with Checkpointer(path, full_share=-1) as ck:
        for step in (1, 2):
            state["optim"].step()
            ck.save(step, state)
            ck.wait()
    fresh = _model_state()
    with Checkpointer(path, full_share=-1) as ck:
        assert ck.load(fresh, step=1) == 1 and not ck.seeded
        assert ck.load(fresh) == 2 and ck.seeded and ck._sink.writer is not None
        ck.fence()  # the seed settled, nothing changed meanwhile: kept
        assert ck.seeded
        rank_file = os.path.join(path, "rank-00000", f"ckpt-{2:020d}.amber")
        assert os.path.exists(rank_file)
        os.rename(rank_file, rank_file + ".away")
        try:
            fresh["model"](torch.randn(2, 3)).sum().backward()
            fresh["optim"].step()
            ck.save(3, fresh)
            ck.wait()
        finally:
            os.rename(rank_file + ".away", rank_file)
        assert {s.step: s.kind for s in ck.steps()}[3] == "delta"
    _loads_as(path, 3, fresh["model"])


def test_dcp_writer_runs_the_shared_saver(tmp_path):
    import torch.distributed.checkpoint as dcp
    from amber.dcp import Writer
    w = Writer()
    dcp.save({"x": torch.randn(10)}, storage_writer=w, checkpoint_id=f"{tmp_path}/d/step-1")
    assert isinstance(w._saver, Saver) and isinstance(w._saver.sink, StoreSink)
    w.close()
