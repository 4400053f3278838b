"""Stratified splits: which rows go to which shard so that every shard holds the same class
proportions. Pure planning (numpy only, no I/O).

Invariants of :func:`stratified_split` for ``labels`` of n rows and S shards:

* every row is in exactly one shard, and each shard lists its rows in ascending order;
* for every class, the shards' counts of it differ by at most one;
* the shards' sizes differ by at most one (as the unstratified split's do).

Both balances come from one walk: the rows of each class (classes in sorted order, rows in
file order) are dealt round-robin to the shards, and the deal continues where the previous
class stopped, so the ``k``-th row dealt overall goes to shard ``k % S``.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

import numpy as np


def stratified_split(labels: Sequence, num_shards: int) -> List[np.ndarray]:
    """Row indices (int64, ascending) of each of ``num_shards`` shards."""
    y = np.asarray(labels)
    if y.ndim != 1:
        raise ValueError(f"labels must be one value per row (1-D), got shape {y.shape}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    order = np.argsort(y, kind="stable")  # by class, file order within a class
    shard_of = np.empty(len(y), np.int64)
    shard_of[order] = np.arange(len(y), dtype=np.int64) % num_shards
    return [np.flatnonzero(shard_of == s).astype(np.int64) for s in range(num_shards)]


def class_counts(labels: Sequence, rows: np.ndarray, classes: Sequence) -> np.ndarray:
    """How many of ``rows`` hold each of ``classes`` (for reports and checks)."""
    y = np.asarray(labels)[rows]
    return np.array([int(np.count_nonzero(y == c)) for c in classes], np.int64)


def runs_of(rows: np.ndarray) -> List[tuple]:
    """``rows`` (ascending) as maximal ``(start, stop)`` ranges of consecutive indices, for
    reading a stratified shard's rows with few slab reads."""
    rows = np.asarray(rows, np.int64)
    if rows.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(rows) != 1) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [rows.size]])
    return [(int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(starts, stops)]


def class_codes(values: np.ndarray, key: str = "?", path: Optional[str] = None) -> np.ndarray:
    """One small integer code per sample for the labels ``values`` (the classes in sorted order
    get codes 0, 1, ...), for the planner's ``stratified`` policy.

    ``values``: one label per sample (shape ``(n,)`` or ``(n, 1)``) of whole numbers; a float
    label is accepted when every value is whole. Raises :class:`DtypeError` otherwise."""
    from hpctrain.data.errors import DtypeError

    hint = "stratify by an integer class label (data.stratify: KEY; stratify=KEY), or use another policy"
    v = np.asarray(values)
    if v.ndim == 2 and v.shape[1] == 1:
        v = v[:, 0]
    if v.ndim != 1:
        raise DtypeError(f"labels of shape {v.shape} are not one class per sample; expected shape (N,)",
                         path=path, key=key, hint=hint)
    if v.dtype.kind == "f":
        bad = np.flatnonzero(~np.isfinite(v) | (v != np.round(v)))
        if bad.size:
            raise DtypeError(f"labels are not whole numbers ({bad.size} of {v.size}, e.g. {float(v[bad[0]])!r} at sample "
                             f"{int(bad[0])}); expected integer classes", path=path, key=key, hint=hint)
    elif v.dtype.kind not in "biu":
        raise DtypeError(f"labels of dtype {v.dtype} are not integer classes", path=path, key=key, hint=hint)
    classes, codes = np.unique(v, return_inverse=True)
    small = np.int16 if len(classes) < 2**15 else np.int64  # int16 sorts by radix: fastest
    return codes.reshape(-1).astype(small)
