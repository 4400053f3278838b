"""Views of user data as flat numpy arrays, and the local reduction kernels.

Numpy arrays and contiguous CPU torch tensors are viewed without copying. bfloat16 (which
numpy lacks) travels as its 16-bit pattern and is reduced with torch.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional

import numpy as np

OPS = ("sum", "avg", "min", "max", "prod")


class Flat:
    """A flat, contiguous numpy view of the user's data and how to rebuild its type.

    A plain class with slots (not a frozen dataclass): one is built per collective call."""

    __slots__ = ("array", "shape", "dtype_name", "is_torch")

    def __init__(self, array: np.ndarray, shape: tuple, dtype_name: str, is_torch: bool) -> None:
        self.array = array  # 1-D, C-contiguous; bfloat16 as uint16 bit patterns
        self.shape = shape
        self.dtype_name = dtype_name  # 'float32', 'bfloat16', …
        self.is_torch = is_torch

    @property
    def bf16(self) -> bool:
        return self.dtype_name == "bfloat16"


_NAMES: Dict[Any, str] = {}  # numpy dtype → name, for the numeric dtypes seen so far


def _dtype_name(dtype: np.dtype) -> str:
    name = _NAMES.get(dtype)  # str(dtype) costs ~15 µs; collectives run per bucket
    if name is None:
        name = _NAMES[dtype] = str(dtype)
    return name


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


def flatten(x: Any, *, writable: bool = False, what: str = "collective") -> Flat:
    """View ``x`` (numpy array or CPU torch tensor) as a flat array, without a copy.

    Raises a ValueError naming the problem for non-contiguous, non-CPU or unsupported input.
    """
    if type(x) is np.ndarray:
        return _flatten_numpy(x, writable, what)
    if is_torch_tensor(x):
        return _flatten_torch(x, what)
    if isinstance(x, np.ndarray):
        return _flatten_numpy(x, writable, what)
    if np.isscalar(x):
        return flatten(np.asarray(x), writable=writable, what=what)
    raise TypeError(f"{what}: expected a numpy array or a CPU torch tensor, got {type(x).__name__}")


def _flatten_numpy(x: np.ndarray, writable: bool, what: str) -> Flat:
    if not x.flags.c_contiguous:
        if writable:
            raise ValueError(f"{what}: array is not C-contiguous. HINT: pass np.ascontiguousarray(x)")
        x = np.ascontiguousarray(x)
    if writable and not x.flags.writeable:
        raise ValueError(f"{what}: array is read-only, so it cannot take the result in place. "
                         "HINT: pass a writable copy (x.copy()), or call the out-of-place form")
    name = _NAMES.get(x.dtype)
    if name is None:
        if x.dtype.kind not in "biufc":
            raise ValueError(f"{what}: dtype {x.dtype} is not numeric")
        name = _dtype_name(x.dtype)
    arr = x.view(np.uint8) if name == "bool" else x
    return Flat(arr if arr.ndim == 1 else arr.reshape(-1), x.shape, name, False)


_TORCH_NAMES: Dict[Any, str] = {}  # torch dtype → name


def _flatten_torch(x: Any, what: str) -> Flat:
    import torch

    if not x.is_cpu:
        raise ValueError(
            f"{what}: hpctrain.comm takes CPU tensors, got one on {x.device}. "
            "HINT: use hpctrain.torch, which stages GPU tensors, or call .cpu() first."
        )
    if x.is_sparse:
        raise ValueError(f"{what}: sparse tensors are not supported. HINT: pass x.to_dense()")
    if not x.is_contiguous():
        raise ValueError(f"{what}: tensor is not contiguous. HINT: pass x.contiguous()")
    t = x.detach()
    dtype = t.dtype
    if dtype == torch.bfloat16:
        arr = t.view(torch.int16).numpy().view(np.uint16)
        name = "bfloat16"
    elif dtype == torch.bool:
        arr = t.numpy().view(np.uint8)
        name = "bool"
    else:
        arr = t.numpy()
        name = _dtype_name(arr.dtype)
    return Flat(arr if arr.ndim == 1 else arr.reshape(-1), tuple(x.shape), name, True)


def empty_like_flat(flat: Flat, length: Optional[int] = None) -> np.ndarray:
    return np.empty(flat.array.size if length is None else length, dtype=flat.array.dtype)


def rebuild(flat: Flat, array: np.ndarray, shape: Optional[tuple] = None) -> Any:
    """Turn a flat result back into the caller's type (numpy array or torch tensor)."""
    shape = flat.shape if shape is None else shape
    if flat.is_torch:
        import torch

        if flat.bf16:
            return torch.from_numpy(array.view(np.int16)).view(torch.bfloat16).reshape(shape)
        if flat.dtype_name == "bool":
            return torch.from_numpy(array.view(np.bool_)).reshape(shape)
        return torch.from_numpy(array).reshape(shape)
    if flat.dtype_name == "bool":
        return array.view(np.bool_).reshape(shape)
    return array.reshape(shape)


# --------------------------------------------------------------------------- reductions
_NP_KERNELS = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}


def _np_kernel(op: str) -> Callable:
    return _NP_KERNELS[op]


def _bool_kernel(op: str) -> Callable:
    # bools travel as uint8 0/1: sum/max = logical or, min/prod = logical and
    return {"sum": np.bitwise_or, "avg": np.bitwise_or, "max": np.bitwise_or,
            "min": np.bitwise_and, "prod": np.bitwise_and}[op]


def reduce_into(acc: np.ndarray, other: np.ndarray, op: str, dtype_name: str) -> None:
    """acc ← op(acc, other), elementwise, in place."""
    if dtype_name == "bfloat16":
        import torch

        ta = torch.from_numpy(acc.view(np.int16)).view(torch.bfloat16)
        tb = torch.from_numpy(other.view(np.int16)).view(torch.bfloat16)
        fn = {"sum": torch.add, "avg": torch.add, "min": torch.minimum,
              "max": torch.maximum, "prod": torch.mul}[op]
        fn(ta, tb, out=ta)
    elif dtype_name == "bool":
        _bool_kernel(op)(acc, other, out=acc)
    else:
        _np_kernel(op)(acc, other, out=acc)


def finish_average(acc: np.ndarray, count: int, dtype_name: str) -> None:
    """Divide a sum by ``count`` in place. Integer averages truncate toward zero (as C)."""
    if count == 1 or acc.size == 0:
        return
    if dtype_name == "bfloat16":
        import torch

        t = torch.from_numpy(acc.view(np.int16)).view(torch.bfloat16)
        t.div_(count)
    elif dtype_name == "bool":
        return
    elif acc.dtype.kind in "iu":
        np.copyto(acc, np.trunc(acc / count).astype(acc.dtype))
    else:
        np.divide(acc, acc.dtype.type(count), out=acc)


def check_op(op: str) -> str:
    if op not in OPS:
        raise ValueError(f"unknown reduction op {op!r}; valid: {', '.join(OPS)}")
    return op


DTYPE_CODES: Dict[str, int] = {name: i for i, name in enumerate(
    ["bool", "int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64",
     "float16", "bfloat16", "float32", "float64", "complex64", "complex128"])}
