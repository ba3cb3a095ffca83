"""The RNG states a checkpoint carries (rng=True): the torch CPU generator, CUDA's
when in use, Python's `random` and NumPy's global generator. Two forms, one per
store kind: a store of one process keeps the generators' state arrays as tensors
("rng/torch", "rng/cuda<i>", "rng/python", "rng/numpy") with the small fields in
the metadata; a multi-rank store keeps each rank's states in that rank's metadata
(base64 and JSON), so that every rank gets its own back."""

import base64
import random

import torch

from ._values import format_error

try:
    import numpy as _np
except ImportError:  # NumPy is optional: its RNG is then not saved
    _np = None


def tensor_form():
    """(metadata, [(name, new tensor)]) of the RNG states."""
    out, tensors = {}, [("rng/torch", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.device_count()
        tensors += [(f"rng/cuda{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    version, mt, gauss = random.getstate()
    tensors.append(("rng/python", torch.from_numpy(_np.array(mt, dtype=_np.int64))
                    if _np is not None else torch.tensor(mt, dtype=torch.int64)))
    out["python"] = {"version": version, "gauss_next": gauss}
    if _np is not None:
        name, keys, pos, has_gauss, cached = _np.random.get_state()
        tensors.append(("rng/numpy", torch.from_numpy(keys.astype(_np.int64))))
        out["numpy"] = {"name": name, "pos": int(pos), "has_gauss": int(has_gauss),
                        "cached_gaussian": float(cached)}
    return out, tensors


def plan_tensor_form(meta, tensor, bad):
    """A function that restores the tensor form: `tensor(name)` plans the read of an
    RNG tensor (returned, filled before the function runs), `bad(path, msg)` raises;
    every field is checked here."""
    if not isinstance(meta, dict):
        bad("rng", "RNG states that are not a dict")
    t = tensor("rng/torch")
    n = meta.get("cuda", 0)
    if not isinstance(n, int) or n < 0:
        bad("rng/cuda", "a CUDA device count that is not a count")
    cuda = [tensor(f"rng/cuda{i}") for i in range(n)] if n else []
    py = meta.get("python")
    if not isinstance(py, dict) or not isinstance(py.get("version"), int) or \
            not (py.get("gauss_next") is None or isinstance(py.get("gauss_next"), (int, float))):
        bad("rng/python", "Python RNG state without version and gauss_next")
    mt = tensor("rng/python")
    npm = meta.get("numpy") if _np is not None else None
    keys = None
    if npm is not None:
        ok = isinstance(npm, dict) and isinstance(npm.get("name"), str) and \
            all(isinstance(npm.get(f), int) for f in ("pos", "has_gauss")) and \
            isinstance(npm.get("cached_gaussian"), (int, float))
        if not ok:
            bad("rng/numpy", "NumPy RNG state without name, pos, has_gauss, cached_gaussian")
        keys = tensor("rng/numpy")

    def put():
        torch.set_rng_state(t)
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        random.setstate((py["version"], tuple(mt.tolist()), py["gauss_next"]))
        if npm is not None:
            _np.random.set_state((npm["name"], keys.numpy().astype(_np.uint32), npm["pos"],
                                  npm["has_gauss"], npm["cached_gaussian"]))
    return put


def _b64(t):
    return base64.b64encode(t.contiguous().numpy().tobytes()).decode()


def json_form():
    """This rank's RNG states as JSON."""
    out = {"torch": _b64(torch.get_rng_state())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    version, mt, gauss = random.getstate()
    out["python"] = {"version": version, "state": list(mt), "gauss_next": gauss}
    if _np is not None:
        name, keys, pos, has_gauss, cached = _np.random.get_state()
        out["numpy"] = {"name": name, "keys": [int(k) for k in keys], "pos": int(pos),
                        "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return out


def plan_json_form(meta, step):
    """A function that restores the JSON form `meta`, every field checked first."""
    def bad(what):
        raise format_error(step, f"rng/{what}", "not an RNG state amber.torch writes")
    if not isinstance(meta, dict):
        bad("")
    try:
        t = torch.frombuffer(bytearray(base64.b64decode(meta["torch"], validate=True)),
                             dtype=torch.uint8)
        cuda = [torch.frombuffer(bytearray(base64.b64decode(s, validate=True)), dtype=torch.uint8)
                for s in meta.get("cuda", [])]
    except (KeyError, TypeError, ValueError):
        bad("torch")
    py = meta.get("python")
    if not isinstance(py, dict) or not isinstance(py.get("version"), int) or \
            not isinstance(py.get("state"), list) or \
            not all(isinstance(x, int) for x in py["state"]) or \
            not (py.get("gauss_next") is None or isinstance(py.get("gauss_next"), (int, float))):
        bad("python")
    npm = meta.get("numpy") if _np is not None else None
    if npm is not None and not (isinstance(npm, dict) and isinstance(npm.get("name"), str) and
                                isinstance(npm.get("keys"), list) and
                                all(isinstance(npm.get(f), int) for f in ("pos", "has_gauss")) and
                                isinstance(npm.get("cached_gaussian"), (int, float))):
        bad("numpy")

    def put():
        torch.set_rng_state(t)
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        if npm is not None:
            _np.random.set_state((npm["name"], _np.array(npm["keys"], dtype=_np.uint32),
                                  npm["pos"], npm["has_gauss"], npm["cached_gaussian"]))
    return put
