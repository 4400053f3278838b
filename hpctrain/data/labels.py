"""What a label key holds: smallest and largest value, and whether every value is a whole
number (a classification loss truncates fractional labels to class indices).

One pass over a slice of every file's label key, slab by slab, vectorised; the slices of
several readers (``part`` of ``parts``) are combined with :func:`merge`. The checks that
turn a summary into an error live in ``hpctrain.train.checks``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Tuple

import numpy as np

from hpctrain.data.h5files import get_dataset, open_h5, read_error, slabs


@dataclass(frozen=True)
class LabelSummary:
    """Range and integrality of the labels read. ``fractional``: count of non-whole (or
    non-finite) values; ``example``: the first such value as (file, row, value)."""

    count: int = 0
    low: Optional[float] = None
    high: Optional[float] = None
    low_at: Optional[Tuple[str, int]] = None
    high_at: Optional[Tuple[str, int]] = None
    is_float: bool = False
    fractional: int = 0
    example: Optional[Tuple[str, int, float]] = None


def merge(parts: Iterable[LabelSummary]) -> LabelSummary:
    """One summary of several slices (in order: the first example found wins)."""
    out = LabelSummary()
    for s in parts:
        if s.count == 0:
            out = LabelSummary(out.count, out.low, out.high, out.low_at, out.high_at, out.is_float or s.is_float,
                               out.fractional, out.example)
            continue
        low, low_at = (s.low, s.low_at) if out.low is None or s.low < out.low else (out.low, out.low_at)
        high, high_at = (s.high, s.high_at) if out.high is None or s.high > out.high else (out.high, out.high_at)
        out = LabelSummary(out.count + s.count, low, high, low_at, high_at, out.is_float or s.is_float,
                           out.fractional + s.fractional, out.example or s.example)
    return out


def summarize_array(values: np.ndarray, path: str = "?", first_row: int = 0) -> LabelSummary:
    """Summary of one in-memory block of labels (rows from ``first_row`` of ``path``)."""
    values = np.asarray(values)
    is_float = values.dtype.kind in "fc"
    if values.size == 0:
        return LabelSummary(is_float=is_float)
    flat = values.reshape(values.shape[0] if values.ndim else 1, -1)
    fractional, example = 0, None
    if is_float:
        bad = ~np.isfinite(flat) | (flat != np.round(flat))
        fractional = int(bad.sum())
        if fractional:
            row, col = np.argwhere(bad)[0]
            example = (path, first_row + int(row), float(flat[row, col]))
    if is_float:
        flat = np.where(np.isfinite(flat), flat, np.nan)
        if np.isnan(flat).all():
            return LabelSummary(count=int(flat.shape[0]), is_float=True, fractional=fractional, example=example)
        lo_i = np.unravel_index(np.nanargmin(flat), flat.shape)
        hi_i = np.unravel_index(np.nanargmax(flat), flat.shape)
    else:
        lo_i, hi_i = np.unravel_index(flat.argmin(), flat.shape), np.unravel_index(flat.argmax(), flat.shape)
    return LabelSummary(count=int(flat.shape[0]), low=float(flat[lo_i]), high=float(flat[hi_i]),
                        low_at=(path, first_row + int(lo_i[0])), high_at=(path, first_row + int(hi_i[0])),
                        is_float=is_float, fractional=fractional, example=example)


def label_summary(paths: Sequence[str], key: str, part: int = 0, parts: int = 1) -> LabelSummary:
    """Summary of rows ``[part*n/parts, (part+1)*n/parts)`` of ``key`` in every file."""
    found = []
    for p in paths:
        with open_h5(p) as f:
            dset = get_dataset(f, key, p)
            n = int(dset.shape[0])
            lo, hi = n * part // parts, n * (part + 1) // parts
            row_bytes = max(1, int(np.prod(dset.shape[1:], dtype=np.int64)) * dset.dtype.itemsize)
            for a, b in slabs(hi - lo, row_bytes, slab_bytes=8 << 20):
                try:
                    block = dset[lo + a:lo + b]
                except Exception as exc:
                    raise read_error(exc, p, key) from exc
                found.append(summarize_array(block, p, lo + a))
            if hi == lo:
                found.append(LabelSummary(is_float=dset.dtype.kind in "fc"))
    return merge(found)


def read_labels(paths: Sequence[str], key: str, counts: Sequence[int]) -> np.ndarray:
    """The class codes (:func:`hpctrain.data.strata.class_codes`) of ``key`` over every file,
    in global-index order; ``counts``: each file's sample count, which ``key`` must match."""
    from hpctrain.data.errors import LengthMismatchError
    from hpctrain.data.strata import class_codes

    parts = []
    for p, n in zip(paths, counts):
        with open_h5(p) as f:
            dset = get_dataset(f, key, p)
            if int(dset.shape[0]) != int(n):
                raise LengthMismatchError(f"has {dset.shape[0]} rows, the other keys {n} samples; expected one "
                                          "label per sample", path=p, key=key,
                                          hint="stratify by a per-sample label key (data.stratify)")
            try:
                parts.append(dset[()])
            except Exception as exc:
                raise read_error(exc, p, key, dset) from exc
    values = np.concatenate(parts) if len(parts) > 1 else parts[0]
    shown = paths[0] if len(paths) == 1 else f"{paths[0]} (+{len(paths) - 1} files)"
    return class_codes(values, key, shown)
