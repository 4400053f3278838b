"""Label statistics of training files, read in slabs: what the runner needs to size a
built-in model's output (``num_classes``) without the user saying it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from hpctrain.data.h5files import expand_paths, get_dataset, open_h5, slabs

__all__ = ["LabelRange", "label_range"]


@dataclass(frozen=True)
class LabelRange:
    low: float
    high: float
    whole: bool          # every label is a whole number (class indices)
    count: int


def label_range(paths: Sequence[str], key: str) -> LabelRange:
    """Smallest and largest label over every file of ``paths`` (files, folders or globs)."""
    low, high, whole, count = np.inf, -np.inf, True, 0
    for path in expand_paths(list(paths)):
        with open_h5(path) as f:
            dset = get_dataset(f, key, path)
            row_bytes = max(1, int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize)
            for lo, hi in slabs(dset.shape[0], row_bytes):
                part = np.asarray(dset[lo:hi])
                if part.size == 0:
                    continue
                low, high = min(low, float(part.min())), max(high, float(part.max()))
                if whole and part.dtype.kind == "f":
                    whole = bool(np.all(part == np.round(part)))
                count += part.shape[0]
    return LabelRange(low, high, whole, count)
