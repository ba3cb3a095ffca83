"""Plain values in a checkpoint's JSON metadata, both ways: numbers, strings, None,
lists, tuples, dicts, torch dtypes and small numpy arrays, kept exactly (no pickle);
a tensor inside a value is a reference {"$t": name} to a tensor of the checkpoint.

    {"$f": "nan"}          a float that JSON has no literal for
    {"$tuple": [...]}      a tuple
    {"$d": [[k, v], ...]}  a dict whose keys are not all plain strings
    {"$dtype": "float32"}  a torch dtype
    {"$np": {"dtype", "shape", "data"}}  a numpy array of booleans, integers or floats
    {"$pickled": name}     (amber.dcp) bytes that DCP's planner made of a value that is not
                           plain data, stored exactly as u8 tensor `name`; never unpickled
"""

import amber as _amber
from amber import AmberError

from . import _dtypes

try:
    import numpy as _np
except ImportError:  # NumPy is optional
    _np = None

import torch

NP_KINDS = set("biuf")
SKIP = object()  # an encoded value that is left out (code in a state_dict)


def format_error(step, path, message) -> AmberError:
    return AmberError(_amber.EFORMAT, f"step {step}: metadata at '{path}': {message}",
                      name="AMBER_EFORMAT")


class Encoder:
    """Values to JSON. A tensor goes to tensor(), which refuses it here (a value of
    DCP's, which has no tensors inside); amber.torch's _Flat names and keeps it."""

    def tensor(self, name, t):
        raise TypeError(f"{name}: a tensor inside a non-tensor value")

    def enc(self, x, path, code_ok=False):
        """JSON for `x`; tensors become {"$t": name} references. `code_ok`:
        functions (code in a state_dict) are left out instead of refused."""
        if isinstance(x, torch.Tensor):
            return self.tensor(path, x)
        if x is None or isinstance(x, (bool, int, str)):
            return x
        if isinstance(x, float):
            return x if x == x and abs(x) != float("inf") else {"$f": repr(x)}
        if isinstance(x, dict):
            if all(isinstance(k, str) and not k.startswith("$") for k in x):
                out = {}
                for k, v in x.items():
                    e = self.enc(v, f"{path}/{k}", code_ok)
                    if e is not SKIP:
                        out[k] = e
                return out
            items = []
            for k, v in x.items():
                e = self.enc(v, f"{path}/{k}", code_ok)
                if e is not SKIP:
                    items.append([self.enc(k, f"{path}/<key>"), e])
            return {"$d": items}
        if isinstance(x, (list, tuple)):
            out = [self.enc(v, f"{path}/{i}", code_ok) for i, v in enumerate(x)]
            out = [None if e is SKIP else e for e in out]
            return out if type(x) is list else {"$tuple": out}
        if isinstance(x, torch.dtype):
            return {"$dtype": str(x).replace("torch.", "")}
        if _np is not None and isinstance(x, _np.generic):
            return self.enc(x.item(), path, code_ok)
        if _np is not None and isinstance(x, _np.ndarray):
            if x.dtype.kind not in NP_KINDS:
                raise TypeError(f"{path}: numpy arrays of dtype {x.dtype} are not supported")
            return {"$np": {"dtype": x.dtype.str, "shape": list(x.shape), "data": x.ravel().tolist()}}
        if code_ok and callable(x):
            return SKIP
        raise TypeError(f"{path}: cannot checkpoint a value of type {type(x).__name__} "
                        "(not a tensor, a state_dict holder or JSON-able data)")


class Decoder:
    """JSON to values, everything checked: anything amber does not write raises
    AMBER_EFORMAT naming the step and the place. A tensor reference goes to
    tensor(), which the loader overrides."""

    def __init__(self, step):
        self.step = step

    def bad(self, path, msg):
        raise format_error(self.step, path, msg)

    def tensor(self, name, target=None, device=None):
        self.bad(name, "a tensor where a plain value was expected")

    def dec(self, e, path, target=None, device=None):
        """The value that JSON `e` describes; tensors are planned into the tensor at
        the same place of `target` when there is one. Values nested beyond Python's
        recursion limit (hostile metadata) are a format error naming the step."""
        try:
            return self._dec(e, path, target, device)
        except RecursionError:
            raise format_error(self.step, path, "values nested too deeply (beyond Python's "
                               "recursion limit): not metadata that amber writes") from None

    def _dec(self, e, path, target=None, device=None):
        if isinstance(e, list):
            tl = target if isinstance(target, (list, tuple)) else ()
            return [self._dec(v, f"{path}/{i}", tl[i] if i < len(tl) else None, device)
                    for i, v in enumerate(e)]
        if e is None or isinstance(e, (bool, int, float, str)):
            return e
        if not isinstance(e, dict):
            self.bad(path, f"a value of type {type(e).__name__}")
        if len(e) == 1:
            (tag, v), = e.items()
            if tag == "$t":
                return self.tensor(v, target, device)
            if tag == "$f":
                if not isinstance(v, str):
                    self.bad(path, "a float that is not a string")
                try:
                    return float(v)
                except ValueError:
                    self.bad(path, f"'{v}' is not a float")
            if tag == "$tuple":
                if not isinstance(v, list):
                    self.bad(path, "a tuple that is not a list")
                tl = target if isinstance(target, (list, tuple)) else ()
                return tuple(self._dec(x, f"{path}/{i}", tl[i] if i < len(tl) else None, device)
                             for i, x in enumerate(v))
            if tag == "$dtype":
                dt = _dtypes.NAMES.get(v) if isinstance(v, str) else None
                if dt is None:
                    self.bad(path, f"{v!r} is not a torch dtype")
                return dt
            if tag == "$np":
                return self.numpy(v, path)
            if tag == "$pickled":
                self.bad(path, "a value that DCP's planner pickled (bytes, or an object that is "
                         "not plain data), which amber.torch does not unpickle: load it with "
                         "dcp.load and amber.dcp.Reader")
            if tag == "$d":
                if not isinstance(v, list) or not all(isinstance(i, list) and len(i) == 2 for i in v):
                    self.bad(path, "a dict that is not a list of pairs")
                td = target if isinstance(target, dict) else {}
                out = {}
                for k, x in v:
                    k = self._dec(k, path)
                    try:
                        hash(k)
                    except TypeError:
                        self.bad(path, f"a dict key of type {type(k).__name__}")
                    out[k] = self._dec(x, f"{path}/{k}", td.get(k), device)
                return out
        if any(k.startswith("$") for k in e):
            self.bad(path, f"unknown tag among {sorted(e)[:3]}")
        td = target if isinstance(target, dict) else {}
        return {k: self._dec(v, f"{path}/{k}", td.get(k), device) for k, v in e.items()}

    def numpy(self, a, path):
        if _np is None:
            self.bad(path, "a numpy array, and numpy is not installed")
        if not isinstance(a, dict) or set(a) != {"dtype", "shape", "data"}:
            self.bad(path, "a numpy array without dtype, shape and data")
        try:
            dt = _np.dtype(a["dtype"]) if isinstance(a["dtype"], str) else None
        except TypeError:
            dt = None
        if dt is None or dt.kind not in NP_KINDS:
            self.bad(path, f"numpy dtype {a['dtype']!r} is not one amber writes")
        if not isinstance(a["shape"], list) or not all(isinstance(d, int) and d >= 0 for d in a["shape"]):
            self.bad(path, "a numpy shape that is not a list of sizes")
        if not isinstance(a["data"], list):
            self.bad(path, "numpy data that is not a list")
        try:
            return _np.array(a["data"], dtype=dt).reshape(a["shape"])
        except (ValueError, TypeError, OverflowError) as err:
            self.bad(path, f"numpy data does not decode: {err}")
