"""The load path's damage handling (issue 23). Restores read every chunk of every
tensor in one parallel loop (large payloads with O_DIRECT where the file system
allows it; tests/test_read_boxes.c runs the same reads with it refused), decoding
straight into the live tensors. A damaged chunk still gives what it gave before:

- in a tensor that goes into a new tensor (optimizer state the live optimizer does
  not have yet): AMBER_ECORRUPT naming the file, nothing live changed (`partial` is
  not set);
- in a tensor that goes into a live tensor: AMBER_ECORRUPT naming the file, with
  `partial` set and the message saying that the state is partially loaded;
- in a full checkpoint or in a delta of the chain alike; load(fallback=True) then
  restores the newest intact step whole;
- and the same through the multi-rank store's reader (a store that many ranks
  write, here one process), whose errors name the rank.

The damaged byte is found through the file's own index (docs/FORMAT.md, parsed here
independently of the library): the middle byte of the payload of one chunk.
"""
import os
import struct

import pytest
import torch

import amber
from amber.torch import Checkpointer

N = 1 << 20  # 4 MiB of f32 per tensor: payloads large enough for O_DIRECT reads


def chunks(path):
    """{tensor name: [(payload offset, payload size, encoding)]} of a checkpoint file."""
    with open(path, "rb") as f:
        data = f.read()
    index_offset, index_size = struct.unpack_from("<QQ", data, len(data) - 56)
    ix = data[index_offset:index_offset + index_size]
    assert ix[:4] == b"AIDX"
    n_tensors, n_chunks = struct.unpack_from("<QQ", ix, 8)
    pos, tensors = 32, []
    for _ in range(n_tensors):
        name_len, _, ndim = struct.unpack_from("<HBB", ix, pos)
        first, count = struct.unpack_from("<QQ", ix, pos + 16)
        pos += 32 + 8 * ndim
        name = ix[pos:pos + name_len].decode()
        pos += name_len
        policy_len, = struct.unpack_from("<H", ix, pos)
        pos += 2 + policy_len
        tensors.append((name, first, count))
    out = {}
    for name, first, count in tensors:
        out[name] = [struct.unpack_from("<QQ8xB", ix, pos + 40 * j)
                     for j in range(first, first + count)]
    return out


def damage(store, step, tensor):
    """Flips the middle byte of the largest payload of `tensor` in step `step`'s file."""
    path = os.path.join(store, f"ckpt-{step:020d}.amber")
    off, size, _ = max(chunks(path)[tensor], key=lambda c: c[1])
    assert size > 0, (tensor, step)
    with open(path, "r+b") as f:
        f.seek(off + size // 2)
        b = f.read(1)
        f.seek(off + size // 2)
        f.write(bytes([b[0] ^ 0x20]))
    return os.path.basename(path)


def make(seed):
    torch.manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(N))
    v = torch.nn.Parameter(torch.randn(N))
    return w, v, torch.optim.Adam([w, v], lr=1e-3)


def train(w, v, opt):
    (w.square().sum() + v.sum()).backward()
    opt.step()
    opt.zero_grad()


def snap(w, v, opt):
    out = {"w": w.detach().clone(), "v": v.detach().clone()}
    for i, p in enumerate((w, v)):
        for k, t in opt.state.get(p, {}).items():
            out[f"{i}/{k}"] = t.clone()
    return out


def equal(a, b):
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    for k in a:
        assert torch.equal(a[k], b[k]), k


def saved(store, steps=4):
    """Steps 1 (full) .. `steps` (deltas: policy exact, every element moves) of a run;
    the state of each step."""
    w, v, opt = make(0)
    states = {}
    with Checkpointer(store, rng=False, full_share=-1) as ck:
        for step in range(1, steps + 1):
            train(w, v, opt)
            ck.save(step, {"w": w, "v": v, "optim": opt})
            ck.wait()
            states[step] = snap(w, v, opt)
    return states


@pytest.mark.parametrize("which", ["full", "delta"])
def test_damage_in_a_live_tensor_says_partially_loaded_and_fallback_restores_whole(
        tmp_path, which):
    store = str(tmp_path / "store")
    states = saved(store)
    # the latest step's chain: full 1 + deltas 2..4; the damage in the full's or
    # in the last delta's payload of "w"
    name = damage(store, 1 if which == "full" else 4, "w")
    w, v, opt = make(9)
    train(w, v, opt)  # the optimizer has state: every tensor is read in place
    with Checkpointer(store, rng=False) as ck:
        with pytest.raises(amber.AmberError) as e:
            ck.load({"w": w, "v": v, "optim": opt})
        assert e.value.code == amber.ECORRUPT and name in e.value.message
        assert getattr(e.value, "partial", False) and "partially loaded" in e.value.message
        if which == "full":  # every step needs the damaged full checkpoint
            with pytest.raises(amber.AmberError) as e:
                ck.load({"w": w, "v": v, "optim": opt}, fallback=True)
            assert e.value.code == amber.ECORRUPT and "no intact checkpoint" in e.value.message
            return
        assert ck.load({"w": w, "v": v, "optim": opt}, fallback=True) == 3
        assert ck.skipped == 1
    equal(snap(w, v, opt), states[3])


def test_damage_in_a_new_tensor_leaves_the_live_state_untouched(tmp_path):
    store = str(tmp_path / "store")
    saved(store, steps=2)
    name = damage(store, 2, "optim/param1/exp_avg")  # Adam's state of v, in the delta
    w, v, opt = make(9)  # no optimizer state yet: the load makes new tensors
    before = snap(w, v, opt)
    with Checkpointer(store, rng=False) as ck:
        with pytest.raises(amber.AmberError) as e:
            ck.load({"w": w, "v": v, "optim": opt})
    assert e.value.code == amber.ECORRUPT and name in e.value.message
    assert not getattr(e.value, "partial", False)
    equal(snap(w, v, opt), before)  # nothing live changed
    assert not opt.state


def test_damage_through_the_multi_rank_reader_names_the_rank_and_is_all_or_nothing(tmp_path):
    store = str(tmp_path / "g")
    amber.GlobalWriter(store).close()  # an empty multi-rank store: one process writes it
    states = saved(store, steps=3)
    assert [(s.step, s.world_size) for s in amber.global_steps(store)] == \
        [(1, 1), (2, 1), (3, 1)]
    name = damage(os.path.join(store, "rank-00000"), 3, "w")
    w, v, opt = make(9)
    train(w, v, opt)
    with Checkpointer(store, rng=False) as ck:
        with pytest.raises(amber.AmberError) as e:
            ck.load({"w": w, "v": v, "optim": opt})
        assert e.value.code == amber.ECORRUPT and name in e.value.message
        assert "rank 0" in e.value.message and "tensor 'w'" in e.value.message
        assert getattr(e.value, "partial", False) and "partially loaded" in e.value.message
        assert ck.load({"w": w, "v": v, "optim": opt}, fallback=True) == 2
    equal(snap(w, v, opt), states[2])
