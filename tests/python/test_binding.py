"""The ctypes binding (python/amber/__init__.py): struct layouts identical to the C
header's, round trips through Store/Writer/Reader, errors that carry the C code,
name and message, handle lifetimes, and how the library is found."""
import array
import ctypes
import os
import shutil
import subprocess

import pytest

import amber
from amber import device
from conftest import ROOT, run_python

STRUCTS = {
    "amber_store_opts": amber._StoreOpts,
    "amber_writer_opts": amber._WriterOpts,
    "amber_reader_opts": amber._ReaderOpts,
    "amber_ckpt_info": amber._CkptInfo,
    "amber_tensor_info": amber._TensorInfo,
    "amber_comm": amber._Comm,
    "amber_global_step_info": amber._GlobalStepInfo,
    "amber_global_tensor": amber._GlobalTensor,
    "amber_chunk_sel": device._ChunkSel,  # the accelerator path's pre-selected chunks
    "amber_chunk_qsel": device._ChunkQSel,  # and their quantized form
}


@pytest.mark.skipif(not shutil.which("cc"), reason="needs a C compiler")
def test_structs_have_the_c_headers_layout(tmp_path):
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "amber.h"', "int main(void) {"]
    for cname, py in STRUCTS.items():
        lines.append(f'printf("{cname} sizeof %zu\\n", sizeof({cname}));')
        for field, _ in py._fields_:
            lines.append(f'printf("{cname} {field} %zu\\n", offsetof({cname}, {field}));')
    lines.append("return 0; }")
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines))
    exe = tmp_path / "layout"
    subprocess.run(["cc", "-std=c11", "-I", os.path.join(ROOT, "include"), str(src), "-o", str(exe)],
                   check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    for line in out.splitlines():
        cname, field, value = line.split()
        py = STRUCTS[cname]
        got = ctypes.sizeof(py) if field == "sizeof" else getattr(py, field).offset
        assert got == int(value), f"{cname}.{field}: ctypes {got}, C {value}"


def _buf(values, typecode="f"):
    a = array.array(typecode, values)
    return a, a.buffer_info()[0], a.itemsize * len(a)


def test_round_trip_of_bytes_metadata_and_listing(store):
    a, addr, n = _buf(range(1000))
    with amber.Store(store) as st:
        w = st.writer(chunk_elems=256)
        assert w.add("x", amber.F32, (10, 100), addr) == 0
        assert w.add("empty", amber.I64, (0,), 0) == 1
        w.add_policy("exact")
        w.set_meta('{"k": "v"}')
        w.save(1)
        a[7] = -1.5
        w.begin(2)
        w.fence()
        w.wait()
        w.close()
        infos = st.list()
        assert [(c.step, c.kind, c.parent) for c in infos] == [(1, "full", None), (2, "delta", 1)]
        assert st.latest() == 2
        with st.reader() as r:
            assert r.step == 2 and len(r) == 2
            t = r.tensors()[0]
            assert (t.name, t.dtype, t.shape, t.nbytes, t.policy) == ("x", amber.F32, (10, 100), 4000, "exact")
            assert t.stored_elems < t.nelems  # a delta stores only what changed
            assert bytes(r.read(0)) == a.tobytes()
            assert r.find("empty") == 1 and r.find("nope") is None
            assert r.meta() == b'{"k": "v"}'
            r.verify()
        with st.reader(1) as r:
            b, baddr, bn = _buf([0.0] * 1000)
            r.read_into(0, baddr, bn)
            assert b[7] == 7.0


def test_errors_carry_code_name_and_message(store):
    with amber.Store(store) as st:
        with pytest.raises(amber.AmberError) as e:
            st.reader(5)
        assert e.value.code == -5 and e.value.name == "AMBER_ENOENT"
        assert "no committed checkpoint" in e.value.message
        w = st.writer()
        with pytest.raises(amber.AmberError) as e:
            w.add_policy("threshold:x")
        assert e.value.name == "AMBER_EINVAL" and "threshold:x" in str(e.value)
        with pytest.raises(amber.AmberError) as e:
            st.writer()  # one writer per store
        assert e.value.name == "AMBER_EBUSY"
        a, addr, n = _buf([1, 2])
        w.add("x", amber.F32, (2,), addr)
        w.save(3)
        with pytest.raises(amber.AmberError) as e:
            w.save(3)
        assert e.value.name == "AMBER_EEXIST" and "3" in e.value.message
    assert st.closed


def test_a_second_writable_open_is_refused_with_elocked(store):
    with amber.Store(store):
        p = run_python("-c", f"import amber; amber.Store({store!r})", check=False)
        assert p.returncode != 0 and "AMBER_ELOCKED" in p.stderr
        with amber.Store(store, readonly=True) as ro:  # readers need no lock
            assert ro.latest() is None


def test_closing_the_store_closes_its_writers_and_readers(store):
    st = amber.Store(store)
    a, addr, n = _buf([1, 2, 3])
    w = st.writer()
    w.add("x", amber.F32, (3,), addr)
    w.save(1)
    r = st.reader()
    st.close()
    assert w.closed and r.closed and st.closed
    with pytest.raises(ValueError):
        w.save(2)
    st.close()  # twice is fine


def test_missing_store_with_create_false_is_enoent(tmp_path):
    with pytest.raises(amber.AmberError) as e:
        amber.Store(str(tmp_path / "absent"), create=False)
    assert e.value.name == "AMBER_ENOENT"


def test_library_is_found_through_amber_library(tmp_path):
    bogus = str(tmp_path / "libnothing.so")
    env_cmd = f"import os; os.environ['AMBER_LIBRARY'] = {bogus!r}; import amber"
    p = run_python("-c", env_cmd, check=False)
    assert p.returncode != 0 and "libnothing.so" in p.stderr and "AMBER_LIBRARY" in p.stderr
    p = run_python("-c", "import amber; print(amber.library_path(), amber.version())")
    assert p.stdout.split()[1] == amber.version()


def test_dtype_helpers():
    assert amber.dtype_size(amber.BF16) == 2 and amber.dtype_name(amber.F8_E4M3) == "f8_e4m3"
    assert amber.dtype_from_name("i64") == amber.I64 and amber.dtype_name(99) is None


def test_listing_flags_a_damaged_checkpoint(store):
    a, addr, n = _buf(range(1000))
    with amber.Store(store) as st:
        w = st.writer()
        w.add("x", amber.F32, (1000,), addr)
        w.save(1)
        w.save(2, full=True)
        w.close()
        with open(os.path.join(st.path, "ckpt-%020d.amber" % 1), "r+b") as f:
            f.seek(12)
            b = f.read(1)
            f.seek(12)
            f.write(bytes([b[0] ^ 0x20]))  # inside the header
        infos = st.list()
        assert [(c.step, c.damaged) for c in infos] == [(1, True), (2, False)]
        assert "damaged" in repr(infos[0]) and "damaged" not in repr(infos[1])


def test_error_codes_and_constants_mirror_the_c_header():
    """Every AMBER_E* of the header's X-macro table has a Python constant of the same
    value and name, and so do the dtypes and flags the binding uses."""
    import re
    header = open(os.path.join(ROOT, "include", "amber.h")).read()
    codes = dict(re.findall(r"XX\((E[A-Z]+), (-\d+),", header))
    assert len(codes) >= 16
    for name, value in codes.items():
        assert getattr(amber, name, None) == int(value), f"amber.{name} != AMBER_{name} ({value})"
        assert amber._err_name(int(value)).decode() == f"AMBER_{name}"
    enum = dict(re.findall(r"\bAMBER_((?:F|BF|I|U)\d+(?:_E\dM\d)?|BOOL) = (\d+)", header))
    assert enum
    for name, value in enum.items():
        assert getattr(amber, name) == int(value), f"amber.{name} != AMBER_{name}"
    flags = dict(re.findall(r"#define AMBER_((?:OPEN|SAVE|READER|WRITER|CKPT)_[A-Z_]+) \(1u << (\d+)\)", header))
    assert flags
    for name, bit in flags.items():
        assert getattr(amber, name) == 1 << int(bit), f"amber.{name} != AMBER_{name}"
