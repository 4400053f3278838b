"""Adasum, the pure part: the pairwise combination and the vector-halving, distance-doubling
schedule (Maleki et al. 2021, "Scaling Distributed Training with Adaptive Summation").

Adasum(a, b) = (1 - a·b / (2|a|²)) a + (1 - a·b / (2|b|²)) b: parallel vectors are averaged,
orthogonal ones summed. Over ``size`` ranks (a power of two) the vectors are combined as a
binary tree over contiguous halves of the ranks: (0, 1) and (2, 3) first, then their results.
Several tensors reduced together (a fused buffer) each get their own coefficients, from dot
products and norms over that tensor only.

The MPI execution (``adasum.py``) walks ``schedule``: at each level a rank keeps half of the
range it owns, swaps the other half with its neighbour, computes partial dot products and
norms on what it kept (``segment_sums``), sums them over the ranks that hold the rest of the
vectors being combined (the block of ``2 * distance`` ranks), and combines (``scaled_add_``).
The levels are then undone in reverse order, each rank sending what it owns to its neighbour.
Everything here is numpy, so every rank's view can be built in one process and tested.
"""
from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import List, Sequence, Tuple

import numpy as np

# A squared norm below this leaves its vector's coefficient at 1, so that a zero vector (a
# parameter without a gradient on some rank) adds nothing and divides nothing by zero. It is
# Horovod's threshold, sqrt(DBL_MIN): the norms are float64, so tiny float32 gradients
# (|x|² ~ 1e-73) are still combined, not summed as if they were zero.
ZERO_NORM = math.sqrt(sys.float_info.min)

DTYPES = ("float16", "float32", "float64")


def is_power_of_two(n: int) -> bool:
    """Whether ``n`` ranks can run the schedule (1, 2, 4, 8 …)."""
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class Level:
    """One level of the schedule, as one rank sees it.

    ``keep`` and ``give`` are [start, stop) element ranges of the fused buffer: after the
    level this rank owns ``keep``, its neighbour owns ``give``; before it both owned their
    union. ``left``: this rank holds the left operand of the tree's combination (the lower
    ranks' vectors)."""

    distance: int
    neighbor: int
    left: bool
    keep: Tuple[int, int]
    give: Tuple[int, int]

    def __post_init__(self) -> None:
        lo, hi = sorted((self.keep, self.give))
        if lo[1] != hi[0] or lo[0] > lo[1] or hi[0] > hi[1]:
            raise ValueError(f"Level: keep {self.keep} and give {self.give} must be adjacent ranges")


def schedule(rank: int, size: int, count: int) -> Tuple[Level, ...]:
    """The levels ``rank`` of ``size`` walks to reduce ``count`` elements: distances 1, 2, 4 …
    size/2; at each one the owned range is halved (the first half, rounded down, goes to the
    rank whose ``distance`` bit is 0)."""
    if not is_power_of_two(size):
        raise ValueError(f"Adasum needs a power-of-two number of ranks, got {size}")
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside 0..{size - 1}")
    levels: List[Level] = []
    lo, hi = 0, int(count)
    distance = 1
    while distance < size:
        mid = lo + (hi - lo) // 2
        left = rank & distance == 0
        keep, give = ((lo, mid), (mid, hi)) if left else ((mid, hi), (lo, mid))
        levels.append(Level(distance, rank ^ distance, left, keep, give))
        lo, hi = keep
        distance <<= 1
    return tuple(levels)


def block_partners(rank: int, distance: int) -> List[int]:
    """The ranks ``rank`` swaps partial sums with (recursive doubling) so that it holds the
    sum over its block of ``2 * distance`` ranks: rank ^ 1, rank ^ 2, … rank ^ distance."""
    partners = []
    d = 1
    while d <= distance:
        partners.append(rank ^ d)
        d <<= 1
    return partners


def offsets(sizes: Sequence[int]) -> np.ndarray:
    """Tensor boundaries in the fused buffer: tensor i is [bounds[i], bounds[i + 1])."""
    return np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))]).astype(np.int64)


def _pieces(lo: int, hi: int, bounds: np.ndarray):
    """(tensor index, start, stop relative to ``lo``) of each tensor's part inside [lo, hi)."""
    first = int(np.searchsorted(bounds, lo, side="right")) - 1
    for i in range(max(first, 0), len(bounds) - 1):
        start, stop = max(int(bounds[i]), lo), min(int(bounds[i + 1]), hi)
        if start >= hi:
            break
        if stop > start:
            yield i, start - lo, stop - lo


def segment_sums(a: np.ndarray, b: np.ndarray, lo: int, bounds: np.ndarray, left: bool) -> np.ndarray:
    """Per tensor: [a·b, |left operand|², |right operand|²] over the part of the buffer in
    ``a`` (this rank's data) and ``b`` (the neighbour's), which start at element ``lo``.
    Summed in float64; tensors outside the segment get zeros, so that the rows of every rank
    line up when summed over the block."""
    out = np.zeros((len(bounds) - 1, 3), dtype=np.float64)
    for i, s, e in _pieces(lo, lo + a.size, bounds):
        x = a[s:e].astype(np.float64)
        y = b[s:e].astype(np.float64)
        xx, yy = float(x @ x), float(y @ y)
        out[i] = (float(x @ y), xx, yy) if left else (float(x @ y), yy, xx)
    return out


def coefficients(dot: np.ndarray, left_norm: np.ndarray, right_norm: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Adasum's coefficients of the left and right operands (1 where a norm² is below ZERO_NORM)."""
    dot, left_norm, right_norm = (np.asarray(v, dtype=np.float64) for v in (dot, left_norm, right_norm))
    with np.errstate(divide="ignore", invalid="ignore"):
        cl = np.where(left_norm >= ZERO_NORM, 1.0 - dot / left_norm * 0.5, 1.0)
        cr = np.where(right_norm >= ZERO_NORM, 1.0 - dot / right_norm * 0.5, 1.0)
    return cl, cr


def scaled_add_(a: np.ndarray, b: np.ndarray, lo: int, bounds: np.ndarray, sums: np.ndarray, left: bool) -> None:
    """a ← c_a·a + c_b·b per tensor, in place, from the block's summed ``sums``. float16 is
    combined in float32, the others in float64."""
    cl, cr = coefficients(sums[:, 0], sums[:, 1], sums[:, 2])
    ca, cb = (cl, cr) if left else (cr, cl)
    wide = np.float32 if a.dtype == np.float16 else np.float64
    for i, s, e in _pieces(lo, lo + a.size, bounds):
        mixed = wide(ca[i]) * a[s:e].astype(wide) + wide(cb[i]) * b[s:e].astype(wide)
        np.copyto(a[s:e], mixed, casting="unsafe")


def combine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two vectors, directly from the formula (float64)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    cl, cr = coefficients(a @ b, a @ a, b @ b)
    return float(cl) * a + float(cr) * b


def reference(vectors: Sequence[np.ndarray], sizes: Sequence[int] = ()) -> np.ndarray:
    """What the schedule computes, by the tree directly: ``vectors`` (one per rank, a power
    of two of them) combined pairwise over contiguous halves, each tensor of ``sizes`` (the
    whole vector when empty) on its own. float64."""
    n = len(vectors)
    if not is_power_of_two(n):
        raise ValueError(f"reference: a power-of-two number of vectors, got {n}")
    total = np.asarray(vectors[0]).size
    bounds = offsets(sizes or [total])
    out = np.empty(total, dtype=np.float64)
    for i in range(len(bounds) - 1):
        s, e = int(bounds[i]), int(bounds[i + 1])
        level = [np.asarray(v, dtype=np.float64).reshape(-1)[s:e] for v in vectors]
        while len(level) > 1:
            level = [combine(level[k], level[k + 1]) for k in range(0, len(level), 2)]
        out[s:e] = level[0]
    return out
