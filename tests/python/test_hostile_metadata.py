"""Hostile metadata JSON in a checkpoint: nested beyond Python's recursion limit, as
text ("[" * 200000, which the JSON parser refuses) and as a value that parses but
nests too deep to decode. Every loader (the Checkpointer on one- and multi-rank
stores, the DCP Reader) raises AmberError AMBER_EFORMAT naming the store and the
step, never a bare RecursionError, and changes nothing in the state."""

import json

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import amber  # noqa: E402
from amber.dcp import Reader  # noqa: E402
from amber.torch import Checkpointer  # noqa: E402

DEEP_TEXT = b"[" * 200_000


def deep_value(depth, fmt="amber.torch/1"):
    """amber.torch metadata (of one process, or of rank 0 of world size 1) whose one
    value nests `depth` lists: it parses when depth is below the parser's limit, and
    is too deep to decode under Python's recursion limit."""
    inner = "[" * depth + "]" * depth
    dist = ',"rank":0,"world_size":1' if fmt.endswith("dist/1") else ""
    return (f'{{"format":"{fmt}","entries":{{"w":{{"type":"tensor","value":{{"$t":"w"}}}},'
            f'"extra":{{"type":"value","value":{inner}}}}},"step":1{dist}}}').encode()


def one_rank_store(path, meta):
    w_data = torch.arange(4, dtype=torch.float32)
    with amber.Store(path) as st, st.writer() as w:
        w.add("w", amber.F32, (4,), w_data.data_ptr())
        w.set_meta(meta)
        w.save(1)


def multi_rank_store(path, meta):
    w_data = torch.arange(4, dtype=torch.float32)
    with amber.GlobalWriter(path) as g:
        g.add("w", amber.F32, (4,), (0,), (4,), w_data.data_ptr())
        g.set_meta(meta)
        g.save(1)


def refused(fn):
    """fn() raises AMBER_EFORMAT naming step 1 and why; returns its message. (DCP
    wraps what read_metadata raises in its own error, keeping amber's message.)"""
    with pytest.raises(BaseException) as ei:
        fn()
    e = ei.value
    msg = str(e) if isinstance(e, amber.AmberError) else \
        " ".join(str(x) for x, _ in getattr(e, "failures", {}).values()) or str(e)
    assert isinstance(e, amber.AmberError) or "AMBER_EFORMAT" in msg, repr(e)
    assert not isinstance(e, amber.AmberError) or e.name == "AMBER_EFORMAT", e
    assert "step 1" in msg and "recursion limit" in msg, msg
    return msg


@pytest.mark.parametrize("depth", [None, 5000, 900], ids=["unparsable", "deep-5000", "deep-900"])
@pytest.mark.parametrize("kind", ["one-rank", "multi-rank"])
def test_deeply_nested_metadata_is_a_format_error_naming_store_and_step(tmp_path, depth, kind):
    path = str(tmp_path / "s")
    if kind == "one-rank":
        one_rank_store(path, DEEP_TEXT if depth is None else deep_value(depth))
    else:
        multi_rank_store(path, DEEP_TEXT if depth is None else
                         deep_value(depth, "amber.torch.dist/1"))
    w = torch.full((4,), 7.0)
    with Checkpointer(path, readonly=True) as ck:
        msg = refused(lambda: ck.load({"w": w, "extra": None}))
    # the parser's refusal names the store; a decode's names the value's place
    assert path in msg if depth != 900 else "metadata at 'extra'" in msg, msg
    assert torch.equal(w, torch.full((4,), 7.0))  # nothing restored
    if depth != 900:  # DCP's Reader does not decode values it is not asked for
        msg = refused(lambda: dcp.load({"w": w}, storage_reader=Reader(), checkpoint_id=path))
        assert path in msg or "metadata at" in msg, msg
    assert torch.equal(w, torch.full((4,), 7.0))


def test_metadata_nested_within_the_limit_still_loads(tmp_path):
    """The guard is no stricter than it must be: 50 levels load as saved."""
    path = str(tmp_path / "s")
    value = json.loads("[" * 50 + "]" * 50)
    with Checkpointer(path) as ck:
        ck.save(1, {"w": torch.ones(2), "extra": value})
    got = {"w": torch.zeros(2), "extra": None}
    with Checkpointer(path, readonly=True) as ck:
        assert ck.load(got) == 1
    assert got["extra"] == value
