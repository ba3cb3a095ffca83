"""Reads safetensors files with the reference implementation (Hugging Face's
safetensors) and prints what it sees, for the C tests' cross-check
(tu_st_reference_check in tests/testutil.c): every file that amber exports in the
test suite must be readable by the reader everyone else uses, with the tensors and
metadata that amber meant to write.

    python tests/safetensors_read.py FILE...

prints one JSON object per file and line: {"metadata": {...} or null, "tensors":
[{"name", "dtype", "shape", "crc32"}, ...] in data-offset order}. The file is read
twice: by `safe_open` (the header: keys, dtypes, shapes, metadata) and by
`deserialize` (the whole file, which the Rust crate validates strictly: offsets back
to back, no gap, sizes matching). Exit status 0; 1 when safetensors refuses a file
(its message on stderr); 3 when safetensors cannot be imported.
"""
import json
import sys
import zlib

try:
    from safetensors import deserialize, safe_open
except ImportError as e:  # a misconfigured Python, not a failed check
    print(f"safetensors_read.py: cannot import safetensors with {sys.executable}: {e}",
          file=sys.stderr)
    sys.exit(3)


def describe(path):
    with safe_open(path, framework="np") as f:
        meta = f.metadata()
        keys = f.offset_keys()
        header = {k: (f.get_slice(k).get_dtype(), f.get_slice(k).get_shape()) for k in keys}
    with open(path, "rb") as fh:
        data = {name: v for name, v in deserialize(fh.read())}
    if sorted(data) != sorted(keys):
        raise ValueError(f"safe_open lists {sorted(keys)}, deserialize {sorted(data)}")
    tensors = []
    for k in keys:
        v = data[k]
        if (v["dtype"], list(v["shape"])) != (header[k][0], list(header[k][1])):
            raise ValueError(f"tensor {k!r}: safe_open and deserialize disagree")
        tensors.append({"name": k, "dtype": v["dtype"], "shape": list(v["shape"]),
                        "crc32": zlib.crc32(bytes(v["data"]))})
    return {"metadata": meta, "tensors": tensors}


def main(paths):
    for p in paths:
        try:
            d = describe(p)
        except Exception as e:  # safetensors raises its own error types
            print(f"safetensors refuses {p}: {type(e).__name__}: {e}", file=sys.stderr)
            return 1
        print(json.dumps(d, ensure_ascii=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
