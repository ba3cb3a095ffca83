"""Several boxes of one global tensor on one rank, through the binding (docs/DESIGN.md,
"Many ranks"): as a ShardedTensor's ChunkShardingSpec or DCP's planner gives a rank
several shards of a tensor, GlobalWriter.add is called once per box, each box is its
own declaration index, and box(), info(), set_data(), set_selection() and
amber.device's pre-selected declarations work per index. GlobalReader reads any
region back from the boxes. A communicator of one (amber.GlobalWriter(path)) holds
all the boxes, so they tile the tensor."""
import ctypes

import pytest
import torch

import amber
from amber import device

ROWS, COLS = 18, 6
# row blocks, declared out of order: the third lies between the first two
BOXES = [((0, 0), (5, COLS)), ((10, 0), (8, COLS)), ((5, 0), (5, COLS))]


def _whole(step):
    return (torch.arange(ROWS * COLS, dtype=torch.float32) * 0.25 + step).reshape(ROWS, COLS)


def _parts(whole):
    return [whole[o[0]:o[0] + s[0], o[1]:o[1] + s[1]].contiguous() for o, s in BOXES]


def _read(path, step, offsets, shape):
    with amber.GlobalReader(path, step) as r:
        out = torch.empty(shape, dtype=torch.float32)
        r.read_into(r.find("w"), offsets, shape, out.data_ptr(), out.numel() * 4)
        return out


REGIONS = [((0, 0), (ROWS, COLS)), ((3, 1), (9, 4)), ((9, 0), (2, COLS)), ((17, 5), (1, 1)),
           ((4, 2), (0, 3))]


def _check_regions(path, step, whole):
    for (r, c), (h, w) in REGIONS:
        got = _read(path, step, (r, c), (h, w))
        assert torch.equal(got, whole[r:r + h, c:c + w]), (step, (r, c), (h, w))


def test_boxes_of_one_tensor_declared_per_index_round_trip(tmp_path):
    path = str(tmp_path / "store")
    w1, w2 = _whole(1), _whole(2)
    w2[12, 3] += 100.0  # step 2 changes one element of the second box: a delta
    p1, p2 = _parts(w1), _parts(w2)
    with amber.GlobalWriter(path, chunk_elems=8) as g:
        idx = [g.add("w", amber.F32, (ROWS, COLS), o, s, p.data_ptr())
               for (o, s), p in zip(BOXES, p1)]
        assert idx == [0, 1, 2]
        assert [g.box(i) for i in idx] == BOXES
        with pytest.raises(amber.AmberError) as e:  # overlaps the first box
            g.add("w", amber.F32, (ROWS, COLS), (3, 0), (4, COLS), p1[0].data_ptr())
        assert e.value.name == "AMBER_EEXIST" and "overlaps" in e.value.message
        with pytest.raises(amber.AmberError) as e:  # another dtype
            g.add("w", amber.F16, (ROWS, COLS), (0, 0), (0, COLS), p1[0].data_ptr())
        assert e.value.name == "AMBER_EINVAL"
        assert g.count == 3
        g.save(1)
        infos = [g.info(i) for i in idx]
        assert [i.shape for i in infos] == [s for _, s in BOXES]
        # the names the rank's file gives them (FORMAT.md, "Many ranks")
        assert [i.name for i in infos] == ["w", "amber.boxes/1/w", "amber.boxes/2/w"]
        for i, p in zip(idx, p2):
            g.set_data(i, p.data_ptr())
        g.save(2)
    assert [(s.step, s.kind) for s in amber.global_steps(path)] == [(1, "full"), (2, "delta")]
    _check_regions(path, 1, w1)
    _check_regions(path, 2, w2)


def _whole_sels(t, chunk_elems, nchunks):
    sels = (device._ChunkSel * nchunks)()
    for j in range(nchunks):
        sels[j] = device._ChunkSel(device.SELECT_WHOLE, None, t.data_ptr() + 4 * j * chunk_elems,
                                   None)
    return sels


def test_preselected_boxes_of_one_tensor_take_their_selections_per_index(tmp_path):
    path = str(tmp_path / "store")
    w1 = _whole(1)
    p1 = _parts(w1)
    with amber.GlobalWriter(path, chunk_elems=8) as g:
        idx = [device.add_preselected(g, "w", amber.F32, s, global_shape=(ROWS, COLS), offsets=o)
               for o, s in BOXES]
        assert idx == [0, 1, 2] and [g.box(i) for i in idx] == BOXES
        assert device.plan(g, 1, 0) == device.KIND_FULL
        keep = []
        for i, p in zip(idx, p1):
            ce, nc, _ = device.chunking(g, i)
            assert nc == (p.numel() + ce - 1) // ce
            keep.append(_whole_sels(p, ce, nc))
            device.set_selection(g, i, keep[-1], nc)
        g.begin(1)
        g.fence()
        g.wait()
        # step 2: only element (12, 3), in the second box's rows 10.., changes
        assert device.plan(g, 2, 0) == device.KIND_DELTA
        w2 = w1.clone()
        w2[12, 3] = -7.5
        ce, _, _ = device.chunking(g, 1)
        k = (12 - 10) * COLS + 3
        hit = ctypes.c_uint32(k % ce)
        val = ctypes.c_float(-7.5)
        for i in idx:
            _, nc, _ = device.chunking(g, i)
            sels = (device._ChunkSel * nc)()
            if i == 1:
                sels[k // ce] = device._ChunkSel(1, ctypes.addressof(hit), ctypes.addressof(val),
                                                 None)
            keep.append(sels)
            device.set_selection(g, i, sels, nc)
        g.begin(2)
        g.fence()
        g.wait()
    _check_regions(path, 1, w1)
    _check_regions(path, 2, w2)
