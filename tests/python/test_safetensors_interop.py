"""amber against the independent safetensors implementation (Hugging Face's).

Files written by `safetensors.torch.save_file`, holding every dtype that both carry
in several shapes (scalar, empty, odd, multi-chunk) with `__metadata__`, go through
`amber import` (a full step, then deltas under the exact policy and under a lossy
one for float tensors) and back out through `amber export`; safetensors' own
`safe_open` / `load_file` read each export: the tensors are bit-exact (exact steps;
under the lossy policy integers and bools still are and floats stay within the
bound), the metadata is kept. Dtypes that amber does not carry fail the import with
exit status 1 and a message naming the tensor and the dtype.

The CLI is $AMBER_CLI, default build/amber of this tree.
"""
import json
import os
import pathlib
import struct
import subprocess
import tempfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = os.environ.get("AMBER_CLI") or os.path.join(ROOT, "build", "amber")

# torch dtype -> safetensors name, for every dtype both sides carry
DTYPES = {
    torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.float64: "F64", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL", torch.uint16: "U16", torch.uint32: "U32",
    torch.uint64: "U64",
}
FLOATS = {torch.float32, torch.float16, torch.bfloat16, torch.float64,
          torch.float8_e4m3fn, torch.float8_e5m2}
SHAPES = {"scalar": (), "empty": (0,), "empty3": (3, 0, 2), "odd": (131,),
          "mat": (7, 33), "chunks": (40, 300)}
CHUNK = 256  # small chunks: "odd" spans one, "chunks" 47
LOSSY = "threshold:1e-2:1e-2"


def amber(*args, check=True):
    if not os.path.exists(CLI):
        pytest.fail(f"amber CLI not found at {CLI} (build it, or set AMBER_CLI)")
    p = subprocess.run([CLI, *args], capture_output=True, text=True, timeout=120)
    if check and p.returncode != 0:
        raise AssertionError(f"amber {' '.join(args)} exited {p.returncode}:\n{p.stderr}")
    return p


def raw(t):
    """The tensor's bytes, as safetensors stores them (little-endian, C order)."""
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def random_bits(dtype, shape, gen):
    """Any bit pattern (NaNs, infinities, subnormals for floats); 0/1 for bool."""
    n = 1
    for d in shape:
        n *= d
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    w = torch.empty((), dtype=dtype).element_size()
    b = torch.randint(0, 256, (n * w,), dtype=torch.uint8, generator=gen)
    return b.view(dtype).reshape(shape)


def finite(dtype, shape, gen):
    return (torch.randn(shape, generator=gen, dtype=torch.float64) * 4).to(dtype)


def some_bits(dtype, shape, gen):
    """Integers and bools: any bits. Floats: finite values, with one element in 16
    any bit pattern (NaN payloads, infinities, -0, subnormals)."""
    bits = random_bits(dtype, shape, gen)
    if dtype not in FLOATS:
        return bits
    mask = torch.rand(shape, generator=gen) < 1 / 16
    return torch.where(mask, bits, finite(dtype, shape, gen))


def state_for(prev, gen, lossy):
    """The first state, or the next one after `prev`: a few of the elements
    of each tensor change (one in 50); in a lossy step every float drifts a little"""
    out = {}
    for dtype in DTYPES:
        for sname, shape in SHAPES.items():
            name = f"{DTYPES[dtype].lower()}.{sname}"
            if prev is None:
                out[name] = some_bits(dtype, shape, gen)
                continue
            old = prev[name]
            if lossy and dtype in FLOATS:
                noise = torch.randn(shape, generator=gen, dtype=torch.float64)
                out[name] = (old.double().nan_to_num(0.0, 1.0, -1.0) + noise * 2e-3).to(dtype)
                continue
            mask = torch.rand(shape, generator=gen) < 0.02
            out[name] = torch.where(mask, some_bits(dtype, shape, gen), old)
    return out


def meta_for(step):
    return {"format": "pt", "step": str(step), "note": "caf\u00e9 \u6743\u91cd"}


def check_export(path, want, step, lossy):
    """Reads an export with safetensors and compares it with what was imported."""
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == meta_for(step)
        assert sorted(f.keys()) == sorted(want)
    got = load_file(path)
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and tuple(g.shape) == tuple(w.shape), name
        if not lossy or w.dtype not in FLOATS:
            assert raw(g) == raw(w), f"step {step}: {name} is not bit-exact"
            continue
        # threshold: an element not stored stays within ABS + REL * |restored|
        x, r = w.double(), g.double()
        same = raw(g) == raw(w)
        if not same:
            ok = (x - r).abs() <= 1e-2 + 1e-2 * r.abs() + 1e-12
            assert bool(ok.all()), f"step {step}: {name} is outside the threshold bound"


def test_every_dtype_survives_import_and_export_full_and_deltas(tmp_path):
    store = str(tmp_path / "store")
    gen = torch.Generator().manual_seed(1234)
    plan = [(1, False), (2, False), (3, True), (4, True), (5, False)]
    states, prev = {}, None
    for step, lossy in plan:
        states[step] = state_for(prev, gen, lossy)
        prev = states[step]
        src = str(tmp_path / f"in{step}.safetensors")
        save_file(states[step], src, metadata=meta_for(step))
        args = ["import", src, store, "--step", str(step), "--chunk-elems", str(CHUNK)]
        if lossy:
            args += ["--policy", LOSSY]
        amber(*args)
    ls = json.loads(amber("ls", store, "--json").stdout)
    assert [c["kind"] for c in ls] == ["full", "delta", "delta", "delta", "delta"]
    info = json.loads(amber("info", store, "--step", "3", "--json").stdout)
    assert len(info["tensors"]) == len(states[3])
    for t in info["tensors"]:  # stored as the dtype of the same name; lossy: floats only
        assert t["dtype"] == t["name"].split(".")[0], t["name"]
        is_float = t["dtype"] in ("f32", "f16", "bf16", "f64", "f8_e4m3", "f8_e5m2")
        assert t["policy"] == (LOSSY if is_float else "exact"), t["name"]
    for step, lossy in plan:
        out = str(tmp_path / f"out{step}.safetensors")
        amber("export", store, "-o", out, "--step", str(step))
        check_export(out, states[step], step, lossy)
    amber("verify", store)


def test_export_of_a_plain_import_is_bit_exact_for_save_file_output(tmp_path):
    """The common case: a model's state dict, one step, exact."""
    gen = torch.Generator().manual_seed(7)
    sd = {f"layer.{i}.{DTYPES[d].lower()}": random_bits(d, (5, 3), gen)
          for i, d in enumerate(DTYPES)}
    src, out = str(tmp_path / "model.safetensors"), str(tmp_path / "back.safetensors")
    save_file(sd, src, metadata={"format": "pt"})
    amber("import", src, str(tmp_path / "s"), "--step", "0")
    amber("export", str(tmp_path / "s"), "-o", out)
    got = load_file(out)
    assert set(got) == set(sd)
    for k in sd:
        assert got[k].dtype == sd[k].dtype and raw(got[k]) == raw(sd[k]), k
    with safe_open(out, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}


@st.composite
def tensors(draw):
    out = {}
    for i in range(draw(st.integers(1, 4))):
        dtype = draw(st.sampled_from(sorted(DTYPES, key=str)))
        shape = tuple(draw(st.lists(st.integers(0, 9), max_size=3)))
        n = 1
        for d in shape:
            n *= d
        if dtype == torch.bool:
            b = bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
        else:
            w = torch.empty((), dtype=dtype).element_size()
            b = draw(st.binary(min_size=n * w, max_size=n * w))
        t = torch.frombuffer(bytearray(b) or bytearray(1), dtype=torch.uint8)[:len(b)]
        out[f"t{i}.{DTYPES[dtype]}"] = t.view(dtype).reshape(shape).clone()
    return out


# A NUL in __metadata__ is valid safetensors that amber refuses (its JSON parser,
# jansson, keeps no NUL in keys, nor in values as amber calls it): see
# test_nul_in_metadata_is_refused_clearly.
# Text that a safetensors header can hold: any Unicode scalar value but NUL (lone
# surrogates, category Cs, are not encodable as UTF-8 and safetensors refuses them).
NO_NUL = st.characters(blacklist_characters="\x00", blacklist_categories=("Cs",))


@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sd=tensors(), metadata=st.dictionaries(st.text(NO_NUL, min_size=1, max_size=8),
                                              st.text(NO_NUL, max_size=8), max_size=3))
def test_any_shapes_and_bits_round_trip(tmp_path, sd, metadata):
    d = pathlib.Path(tempfile.mkdtemp(dir=tmp_path))  # tmp_path is shared by examples
    src, out, store = str(d / "in.safetensors"), str(d / "out.safetensors"), str(d / "s")
    save_file(sd, src, metadata=metadata or None)
    amber("import", src, store, "--step", "1", "--chunk-elems", "4")
    amber("export", store, "-o", out)
    got = load_file(out)
    assert set(got) == set(sd)
    for k in sd:
        assert got[k].dtype == sd[k].dtype and tuple(got[k].shape) == tuple(sd[k].shape)
        assert raw(got[k]) == raw(sd[k]), k
    with safe_open(out, framework="pt") as f:
        assert (f.metadata() or {}) == metadata


def handmade(path, name, dtype, nbytes):
    """A safetensors file with one tensor of a dtype that torch cannot write."""
    header = json.dumps({"ok": {"dtype": "U8", "shape": [2], "data_offsets": [0, 2]},
                         name: {"dtype": dtype, "shape": [8], "data_offsets": [2, 2 + nbytes]}})
    header += " " * (-(8 + len(header)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header.encode() + bytes(2 + nbytes))


UNSUPPORTED = [("float8_e8m0fnu", "F8_E8M0"), ("float4_e2m1fn_x2", "F4"),
               ("complex64", "C64"), ("float8_e4m3fnuz", "F8_E4M3FNUZ"),
               ("float8_e5m2fnuz", "F8_E5M2FNUZ")]


@pytest.mark.parametrize("torch_name,st_name", UNSUPPORTED)
def test_dtype_amber_does_not_carry_fails_import_by_name(tmp_path, torch_name, st_name):
    dtype = getattr(torch, torch_name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {torch_name}")
    src, store = str(tmp_path / "x.safetensors"), str(tmp_path / "store")
    t = torch.zeros(8, dtype=torch.uint8).view(dtype)
    save_file({"fine": torch.ones(3), "odd.one": t}, src, metadata={"format": "pt"})
    with safe_open(src, framework="pt") as f:  # what safetensors itself calls it
        assert f.get_slice("odd.one").get_dtype() == st_name
    p = amber("import", src, store, "--step", "1", check=False)
    assert p.returncode == 1, p.stderr
    assert "'odd.one'" in p.stderr and f"'{st_name}'" in p.stderr, p.stderr
    assert "not supported" in p.stderr
    assert not os.path.exists(store)  # refused before the store is touched


@pytest.mark.parametrize("st_name,nbytes", [("F6_E2M3", 6), ("F6_E3M2", 6),
                                            ("C128", 128), ("Q4_K", 8)])
def test_dtype_unknown_to_torch_fails_import_by_name(tmp_path, st_name, nbytes):
    src, store = str(tmp_path / "x.safetensors"), str(tmp_path / "store")
    handmade(src, "w.packed", st_name, nbytes)
    p = amber("import", src, store, "--step", "1", check=False)
    assert p.returncode == 1, p.stderr
    assert "'w.packed'" in p.stderr and f"'{st_name}'" in p.stderr, p.stderr
    assert not os.path.exists(store)


@pytest.mark.parametrize("metadata", [{"a\x00b": "v"}, {"k": "a\x00b"}])
def test_nul_in_metadata_is_refused_clearly(tmp_path, metadata):
    """A known limit: amber cannot keep a NUL in __metadata__. It refuses the file
    with exit status 1 and says why, before touching the store."""
    src, store = str(tmp_path / "x.safetensors"), str(tmp_path / "store")
    save_file({"w": torch.ones(2)}, src, metadata=metadata)
    p = amber("import", src, store, "--step", "1", check=False)
    assert p.returncode == 1 and "NUL" in p.stderr, p.stderr
    assert not os.path.exists(store)
