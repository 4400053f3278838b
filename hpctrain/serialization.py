"""Files hpctrain writes and reads back: tensors and plain Python types only.

``torch.save`` pickles, and an unrestricted ``torch.load`` runs whatever callable a planted
object's ``__reduce__`` names. So every file hpctrain reads back (data-parallel checkpoints,
pipeline stage files, ``meta.pt``) goes through :func:`load_plain`, which is
``torch.load(weights_only=True)``: tensors, dicts, lists, tuples, strings, numbers, booleans
and None, nothing else. What hpctrain writes goes through :func:`to_plain` first, so that it
always loads that way. A file that does not is refused with one line naming it, and nothing
in it runs.
"""
from __future__ import annotations

import dataclasses
import pickle
import re
import warnings
from collections import OrderedDict
from pathlib import Path
from typing import Any, NoReturn, Union

import numpy as np
import torch

_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
_PLAIN_SCALARS = (bool, int, float, str, bytes, type(None))


class NotPlainFile(ValueError):
    """A file that :func:`load_plain` refused; the message is one line naming the file."""


def to_plain(obj: Any, where: str = "state") -> Any:
    """``obj`` with numpy arrays turned into tensors, numpy scalars into Python numbers and
    dataclasses into dicts, recursively; TypeError naming the key for anything else that
    ``torch.load(weights_only=True)`` would refuse."""
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(obj))
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, _PLAIN_SCALARS):
        if type(obj) in _PLAIN_SCALARS:
            return obj
        # A subclass (an IntEnum, a str subclass) pickles by class name: store the plain value.
        return next(t(obj) for t in _PLAIN_SCALARS if isinstance(obj, t))
    if isinstance(obj, (torch.dtype, torch.device, torch.Size)):
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        out = OrderedDict() if isinstance(obj, OrderedDict) else {}
        for k, v in obj.items():
            out[to_plain(k, where)] = to_plain(v, f"{where}[{k!r}]")
        return out
    if isinstance(obj, (list, tuple)):
        items = [to_plain(v, f"{where}[{i}]") for i, v in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    raise TypeError(f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which a checkpoint cannot "
                    "hold (it would not load with weights_only=True); store tensors and plain Python types")


def load_plain(path: Union[str, Path], *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU. FileNotFoundError passes through;
    any other failure is a :class:`NotPlainFile` whose one-line message names the file and why.

    ``mmap``: map the tensors' bytes instead of reading them (for a cheap look at the
    metadata of a large file); only the pickled structure is read.
    """
    with warnings.catch_warnings():
        # torch warns about pickle protocols of foreign files; the refusal below says it all.
        warnings.simplefilter("ignore", UserWarning)
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True, mmap=mmap)
        except RuntimeError as exc:
            if not (mmap and "mmap can only be used" in str(exc)):
                _refuse(path, exc)
        except Exception as exc:
            _refuse(path, exc)
        # Not a zip-format torch file: read it whole (a legacy file, or garbage refused alike).
        try:
            return torch.load(str(path), map_location="cpu", weights_only=True)
        except Exception as exc:
            _refuse(path, exc)


def _refuse(path: Union[str, Path], exc: BaseException) -> NoReturn:
    """Raise the one-line NotPlainFile for a failed load (FileNotFoundError passes through)."""
    if isinstance(exc, FileNotFoundError):
        raise exc
    if isinstance(exc, (PermissionError, IsADirectoryError)):
        raise NotPlainFile(f"{path}: cannot be read: {exc.strerror or exc}") from None
    if isinstance(exc, pickle.UnpicklingError):
        m = _GLOBAL.search(str(exc))
        why = (f"it holds a pickled Python object ({m.group(1)}), not only tensors and plain types, and "
               "hpctrain never unpickles those" if m else
               "it is not a torch.save file of tensors and plain types")
        raise NotPlainFile(f"{path}: not a valid hpctrain checkpoint: {why}") from None
    # Truncated, corrupt, unreadable: the first sentence of torch's message is the fact.
    text = str(exc).strip()
    first = text.splitlines()[0].split(". ")[0] if text else ""
    raise NotPlainFile(f"{path}: not a valid hpctrain checkpoint: cannot be loaded, truncated or corrupt "
                       f"({type(exc).__name__}: {first})") from None
