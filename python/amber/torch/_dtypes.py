"""The dtypes amber.torch saves, as amber's dtype codes and back, and the torch dtypes
that a "$dtype" value of the metadata may name."""

import torch

import amber as _amber

DTYPES: dict[torch.dtype, int] = {
    torch.float32: _amber.F32, torch.float16: _amber.F16, torch.bfloat16: _amber.BF16,
    torch.float64: _amber.F64, torch.float8_e4m3fn: _amber.F8_E4M3,
    torch.float8_e5m2: _amber.F8_E5M2, torch.int64: _amber.I64, torch.int32: _amber.I32,
    torch.int16: _amber.I16, torch.int8: _amber.I8, torch.uint8: _amber.U8,
    torch.bool: _amber.BOOL, torch.uint16: _amber.U16, torch.uint32: _amber.U32,
    torch.uint64: _amber.U64,
}
TORCH: dict[int, torch.dtype] = {v: k for k, v in DTYPES.items()}
# by the name save() writes for them (str(dtype) without "torch."); nothing else is looked up
NAMES: dict[str, torch.dtype] = {str(v).replace("torch.", ""): v for v in vars(torch).values()
                                 if isinstance(v, torch.dtype)}


def code(t: torch.Tensor, name: str) -> int:
    """amber's dtype code of tensor `t` (named `name` in errors)."""
    c = DTYPES.get(t.dtype)
    if c is None:
        raise TypeError(f"{name}: dtype {t.dtype} is not supported by amber")
    return c
