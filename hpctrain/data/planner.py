"""Partition planner: which samples each rank reads in one epoch (pure; no files, no MPI).

Samples of several files are numbered with one *global index*: file 0's rows first, then
file 1's, and so on (:func:`global_offsets`). Given the per-file sample counts, the world
size, a rank, a batch size, a seed, an epoch and a policy, :func:`plan_epoch` returns a
:class:`RankPlan`: this rank's global sample ids for the whole epoch, ``steps * batch_size``
of them, and a boolean ``mask`` that is False for padding.

Every rank gets the **same number of steps** (unequal step counts hang collectives):

- ``drop_last=True``: ``steps = N // global_batch``; the tail of the epoch's order (fewer
  than ``global_batch`` samples for ``contiguous``/``weighted``; fewer than
  ``world_size * (batch_size + 1)`` for ``strided``, as DistributedSampler + DataLoader do)
  is not used this epoch. With shuffling a different tail is dropped every epoch.
- ``drop_last=False`` (default): ``steps = ceil(N / global_batch)`` (``strided``: as
  DistributedSampler); missing slots are filled with repeats of real samples whose ``mask``
  is False, so every sample is seen exactly once with ``mask=True`` and evaluation can ignore
  the padding. A batch can hold zero real samples when N is just above a multiple of the
  global batch: weight losses and metrics by ``mask.sum()``, never by ``batch_size``.

Policies:

``contiguous`` (default)
    The global index is cut into blocks of ``block_rows`` rows per file (the loader passes
    the HDF5 chunk length, so blocks are chunk-aligned and never cross a file). The block
    order is shuffled per epoch from ``(seed, epoch)``; rank r takes the r-th contiguous
    stretch of that order. Each rank reads few, large, contiguous slabs.
``strided``
    Exactly the index lists of ``torch.utils.data.DistributedSampler(num_replicas=W,
    rank=r, shuffle, seed, drop_last)`` at ``set_epoch(epoch)``, cut into batches as a
    ``DataLoader(batch_size, drop_last)`` would (the last partial batch padded and masked).
    Reads are scattered: every rank touches every chunk.
``weighted``
    Like ``contiguous``, but rank r's share is proportional to ``weights[r]`` (e.g. measured
    samples/s on mixed nodes). Steps stay equal, so the per-rank batch size differs:
    ``RankPlan.batch_size`` is this rank's; the global batch stays ``world_size * batch_size``.
``stratified``
    Every rank's share holds the same class proportions: for every class, the ranks' counts
    of it differ by at most one (``labels``: one class per global sample). The samples of
    each class (shuffled per ``(seed, epoch)``, or in file order) are dealt round-robin to
    the ranks, classes one after another, the deal continuing where the previous class
    stopped (so the ranks' totals differ by at most one as well). With ``drop_last`` the
    samples left out are taken from every class in proportion to its size, and each rank
    gets exactly ``steps * batch_size``. A rank reads its samples in the ``contiguous``
    policy's shuffled block order (ascending within a block), so a window covers few blocks.

With ``window_steps > 0``, each rank's ids are also reordered inside windows of
``window_steps`` batches (the loader reads one window at a time): ``window_order="shuffle"``
splits each window into batches at random (seeded by ``(seed, epoch, rank)``; the
loader shuffles in memory) and keeps the window's order inside each batch (which samples
share a batch is random; their order inside it does not matter to training, and a batch is
then a few ascending runs that the loader copies with a few gathers),
``"sort"`` sorts them by position (the loader then reads a window with one HDF5 call per key
and hands out batches without copying). Sorting needs shuffling on: with ``shuffle=False``
ids are in file order already.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import List, Optional, Sequence, Tuple, Union

import numpy as np

from hpctrain.data.errors import ConfigError, TooFewSamplesError

POLICIES = ("contiguous", "strided", "weighted", "stratified")


def global_offsets(counts: Sequence[int]) -> np.ndarray:
    """Start of each file in the global index, plus the total at the end (length len+1)."""
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(np.asarray(counts, dtype=np.int64), out=out[1:])
    return out


def locate(global_ids: np.ndarray, offsets: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Map global sample ids to (file number, row within that file)."""
    ids = np.asarray(global_ids, dtype=np.int64)
    if len(offsets) == 2:  # one file (the common case: a window's bookkeeping runs this thrice)
        return np.zeros(len(ids), np.int64), ids - offsets[0]
    files = np.searchsorted(offsets, ids, side="right") - 1
    return files, ids - offsets[files]


def apportion(total: int, weights: Sequence[float], minimum: int = 0) -> List[int]:
    """Split the integer ``total`` in proportion to ``weights`` (largest remainder method).

    Ties go to the lower index, so the result is deterministic; every part is at least
    ``minimum`` (taken from the largest parts) when ``total >= minimum * len(weights)``.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.ndim != 1 or len(w) == 0 or not np.all(np.isfinite(w)) or np.any(w <= 0):
        raise ConfigError(f"weights must be positive finite numbers, got {list(weights)!r}",
                          hint="pass one weight per rank, e.g. measured samples/s")
    exact = total * w / w.sum()
    parts = np.floor(exact).astype(np.int64)
    rest = int(total - parts.sum())
    order = sorted(range(len(w)), key=lambda i: (-(exact[i] - parts[i]), i))
    for i in order[:rest]:
        parts[i] += 1
    for i in range(len(parts)):
        while parts[i] < minimum:
            j = int(np.argmax(parts))
            if parts[j] <= minimum:
                raise ConfigError(f"cannot give each of {len(w)} parts at least {minimum} of {total}",
                                  hint="use fewer ranks or more data")
            parts[j] -= 1
            parts[i] += 1
    return [int(p) for p in parts]


@dataclass(frozen=True)
class RankPlan:
    """One rank's epoch: ``indices`` (global sample ids) and ``mask`` (False = padding).

    ``indices`` has ``steps * batch_size`` entries; batch ``s`` is
    ``indices[s*batch_size:(s+1)*batch_size]``.
    """

    rank: int
    world_size: int
    epoch: int
    policy: str
    steps: int
    batch_size: int
    global_batch: int
    num_samples: int
    window_steps: int
    indices: np.ndarray = field(repr=False)
    mask: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        assert 0 <= self.rank < self.world_size
        assert self.indices.shape == (self.steps * self.batch_size,), (self.indices.shape, self.steps)
        assert self.mask.shape == self.indices.shape and self.mask.dtype == np.bool_
        assert self.indices.size == 0 or (self.indices.min() >= 0 and self.indices.max() < self.num_samples)

    @property
    def num_real(self) -> int:
        """Samples of this rank that are not padding."""
        return int(self.mask.sum())

    def batch(self, step: int) -> Tuple[np.ndarray, np.ndarray]:
        """Global ids and mask of batch ``step``."""
        if not 0 <= step < self.steps:
            raise IndexError(f"step {step} out of range 0..{self.steps - 1}")
        sl = slice(step * self.batch_size, (step + 1) * self.batch_size)
        return self.indices[sl], self.mask[sl]


def rank_batch_sizes(world_size: int, batch_size: int, policy: str,
                     weights: Optional[Sequence[float]] = None) -> List[int]:
    """Per-rank batch sizes: ``batch_size`` each, or the global batch split by ``weights``."""
    if policy == "weighted":
        if weights is None or len(weights) != world_size:
            raise ConfigError(
                f"policy 'weighted' needs one weight per rank ({world_size}), got {weights!r}",
                hint="pass weights=[samples/s of rank 0, of rank 1, ...]")
        return apportion(world_size * batch_size, weights, minimum=1)
    return [batch_size] * world_size


def _check_args(counts: Sequence[int], world_size: int, rank: int, batch_size: int,
                policy: str, weights: Optional[Sequence[float]], labels: Optional[np.ndarray]) -> None:
    if policy not in POLICIES:
        raise ConfigError(f"unknown policy {policy!r}; expected one of {', '.join(POLICIES)}",
                          hint="pick one of the policies listed")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ConfigError(f"rank {rank} is not in a world of {world_size}",
                          hint="rank must be between 0 and world_size - 1")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be at least 1, got {batch_size}", hint="use a batch size of 1 or more")
    if any(int(c) < 0 for c in counts):
        raise ConfigError(f"sample counts must be >= 0, got {list(counts)!r}",
                          hint="sample counts come from the files; check them with `hpctrain data inspect`")
    if weights is not None and policy != "weighted":
        raise ConfigError(f"weights are used only by policy 'weighted', not {policy!r}",
                          hint="pass policy='weighted' or drop the weights")
    if policy == "stratified":
        n = int(sum(int(c) for c in counts))
        if labels is None or np.ndim(labels) != 1 or len(labels) != n:
            got = "none" if labels is None else f"shape {np.shape(labels)}"
            raise ConfigError(f"policy 'stratified' needs one class label per sample ({n}), got {got}",
                              hint="pass labels= (one integer class per global sample)")
    elif labels is not None:
        raise ConfigError(f"labels are used only by policy 'stratified', not {policy!r}",
                          hint="pass policy='stratified' or drop the labels")


def _blocks(counts: Sequence[int], block_rows: Union[int, Sequence[int]]) -> np.ndarray:
    """Chunk-aligned blocks as a (n, 2) array of global [start, stop), in index order."""
    sizes = [block_rows] * len(counts) if isinstance(block_rows, (int, np.integer)) else list(block_rows)
    if len(sizes) != len(counts) or any(int(b) < 1 for b in sizes):
        raise ConfigError(f"block_rows must be >= 1, one per file; got {block_rows!r}",
                          hint="use block_rows >= 1 (one value, or one per file)")
    offsets = global_offsets(counts)
    starts: List[np.ndarray] = []
    for f, (count, b) in enumerate(zip(counts, sizes)):
        starts.append(offsets[f] + np.arange(0, int(count), int(b), dtype=np.int64))
    lo = np.concatenate(starts) if starts else np.zeros(0, np.int64)
    hi = np.empty_like(lo)
    hi[:-1] = lo[1:]
    if len(lo):
        hi[-1] = offsets[-1]
    # A block never crosses into the next file.
    files = np.searchsorted(offsets, lo, side="right") - 1
    hi = np.minimum(hi, offsets[files + 1])
    return np.stack([lo, hi], axis=1)


def _expand(blocks: np.ndarray) -> np.ndarray:
    lengths = blocks[:, 1] - blocks[:, 0]
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    starts = np.repeat(blocks[:, 0] - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths)
    return starts + np.arange(total, dtype=np.int64)


def _expand_slice(blocks: np.ndarray, start: int, stop: int) -> np.ndarray:
    """``_expand(blocks)[start:stop]``, expanding only the blocks that overlap it: a rank
    never holds the whole epoch's order (8 bytes per sample of the data set)."""
    ends = np.cumsum(blocks[:, 1] - blocks[:, 0])
    stop = min(int(stop), int(ends[-1]) if len(ends) else 0)
    if stop <= start:
        return np.zeros(0, np.int64)
    first = int(np.searchsorted(ends, start, side="right"))
    last = int(np.searchsorted(ends, stop, side="left")) + 1
    skip = start - (int(ends[first - 1]) if first else 0)
    return _expand(blocks[first:last])[skip:skip + stop - start]


def _contiguous(counts, world_size, rank, sizes, seed, epoch, drop_last, shuffle, block_rows):
    n = int(sum(counts))
    g = sum(sizes)
    blocks = _blocks(counts, block_rows)
    if shuffle:
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), 0xB10C])
        blocks = blocks[rng.permutation(len(blocks))]
    mine = sizes[rank]
    if drop_last:
        steps = n // g
        start = steps * sum(sizes[:rank])
        idx = _expand_slice(blocks, start, start + steps * mine)
        return steps, idx, np.ones(idx.shape, np.bool_)
    steps = -(-n // g)
    # Spread the padding: rank r gets real[r] real samples (proportional to its batch size)
    # and fills the rest of its steps*mine slots with repeats of its own first samples.
    real = apportion(n, sizes)
    start = sum(real[:rank])
    own = _expand_slice(blocks, start, start + real[rank])
    slots = steps * mine
    idx = own[np.arange(slots) % len(own)]
    mask = np.arange(slots) < len(own)
    return steps, idx, mask


def _keep_proportional(order: np.ndarray, sorted_labels: np.ndarray, keep: int) -> np.ndarray:
    """The first samples of each class of the class-sorted ``order``, ``keep`` in all, each
    class contributing in proportion to its size (largest remainders)."""
    starts = np.flatnonzero(np.concatenate(([True], sorted_labels[1:] != sorted_labels[:-1])))
    sizes = np.diff(np.append(starts, len(order)))
    take = apportion(keep, sizes)
    return np.concatenate([order[a:a + t] for a, t in zip(starts.tolist(), take)])


def _stratified(labels, counts, world_size, rank, batch_size, seed, epoch, drop_last, shuffle, block_rows):
    n = len(labels)
    g = world_size * batch_size
    labels = np.asarray(labels)
    if shuffle:
        order = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), 0x57A7]).permutation(n)
        by_class = np.argsort(labels[order], kind="stable")  # classes in turn, shuffled within each
        order = order[by_class]
    else:
        order = np.argsort(labels, kind="stable")  # classes in turn, file order within each
    if drop_last:
        steps = n // g
        # steps * g samples, so that the round-robin deal below gives every rank exactly
        # steps * batch_size of them.
        order = _keep_proportional(order, labels[order], steps * g)
    else:
        steps = -(-n // g)
    # Position p of the class-sorted order goes to rank p % world_size: per class, and in total,
    # the ranks' counts differ by at most one.
    own = order[rank::world_size]
    if shuffle:
        blocks = _blocks(counts, block_rows)
        rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), 0xB10C])
        place = np.empty(len(blocks), np.int64)
        place[rng.permutation(len(blocks))] = np.arange(len(blocks), dtype=np.int64)
        block_of = np.searchsorted(blocks[:, 0], own, side="right") - 1
        own = own[np.lexsort((own, place[block_of]))]
    else:
        own = np.sort(own)
    if drop_last:
        return steps, own, np.ones(own.shape, np.bool_)
    slots = steps * batch_size
    idx = own[np.arange(slots) % len(own)]
    return steps, idx, np.arange(slots) < len(own)


def _strided(n, world_size, rank, batch_size, seed, epoch, drop_last, shuffle):
    # Same arithmetic as torch.utils.data.DistributedSampler.
    if drop_last and n % world_size:
        per_rank = math.ceil((n - world_size) / world_size)
    else:
        per_rank = math.ceil(n / world_size)
    total = per_rank * world_size
    if shuffle:
        import torch  # only for torch.randperm, to reproduce DistributedSampler exactly

        gen = torch.Generator()
        gen.manual_seed(int(seed) + int(epoch))
        order = torch.randperm(n, generator=gen).numpy().astype(np.int64)
    else:
        order = np.arange(n, dtype=np.int64)
    positions = np.arange(total, dtype=np.int64)
    padded = order[positions % n]  # DistributedSampler repeats from the start
    real = positions < n
    idx = padded[rank:total:world_size]
    mask = real[rank:total:world_size]
    if drop_last:
        steps = per_rank // batch_size
        return steps, idx[:steps * batch_size], mask[:steps * batch_size]
    steps = -(-per_rank // batch_size)
    slots = steps * batch_size
    fill = np.arange(slots) % per_rank
    return steps, idx[fill], mask[fill] & (np.arange(slots) < per_rank)


def _random_split(rng: np.random.Generator, windows: int, rows: int, batch_size: int) -> np.ndarray:
    """For each of ``windows`` windows of ``rows`` positions, a uniformly random split into
    batches of ``batch_size``, each batch's positions ascending: ``(windows, rows)`` int64.

    A random order is a sort of ``random bits | position`` keys (numpy's vectorised sort of
    uint64 is several times faster than a shuffle, which draws one bounded integer at a time);
    its consecutive ``batch_size`` positions form the batches, then sorted. A key keeps
    64 - log2(rows) random bits (over 40 for windows under 2^24 rows): ties, broken by
    position, come about rows² / 2^(65 - log2(rows)) times per window: never in practice.
    """
    bits = max(1, (rows - 1).bit_length())
    keys = rng.bit_generator.random_raw((windows, rows))
    keys >>= np.uint64(bits)
    keys <<= np.uint64(bits)
    keys |= np.arange(rows, dtype=np.uint64)
    keys.sort(axis=1)
    keys &= np.uint64((1 << bits) - 1)
    small = np.uint16 if rows <= 1 << 16 else np.int64  # uint16 sorts with a radix sort
    pos = keys.astype(small).reshape(windows, rows // batch_size, batch_size)
    pos.sort(axis=2)
    return pos.reshape(windows, rows).astype(np.int64)


def _window_reorder(idx, mask, window_rows, batch_size, seed, epoch, rank, order):
    if order == "sort":
        parts = [start + np.argsort(idx[start:start + window_rows], kind="stable")
                 for start in range(0, len(idx), window_rows)]
        p = np.concatenate(parts) if parts else np.zeros(0, np.int64)
        return idx[p], mask[p]
    # A uniformly random split of each window into batches that keeps the window's order
    # inside each batch. Which samples share a batch is random; their order inside a batch
    # does not matter to training, and keeping it means a batch is a few ascending runs (one
    # per block of the window), which the loader copies with a few gathers instead of one
    # scatter per sample.
    rng = np.random.default_rng([int(seed) & 0xFFFFFFFF, int(epoch), int(rank), 0x5EED])
    full = len(idx) // window_rows
    p = np.empty(len(idx), np.int64)
    if full:
        local = _random_split(rng, full, window_rows, batch_size)
        p[:full * window_rows] = (local + (np.arange(full, dtype=np.int64) * window_rows)[:, None]).reshape(-1)
    rest = len(idx) - full * window_rows  # a whole number of batches
    if rest:
        p[full * window_rows:] = full * window_rows + _random_split(rng, 1, rest, batch_size).reshape(-1)
    return idx[p], mask[p]


def plan_epoch(
    counts: Sequence[int],
    world_size: int,
    rank: int,
    batch_size: int,
    *,
    seed: int = 0,
    epoch: int = 0,
    policy: str = "contiguous",
    drop_last: bool = False,
    shuffle: bool = True,
    weights: Optional[Sequence[float]] = None,
    block_rows: Union[int, Sequence[int]] = 1024,
    window_steps: int = 0,
    window_order: str = "shuffle",
    labels: Optional[np.ndarray] = None,
) -> RankPlan:
    """This rank's samples for one epoch. See the module docstring for the policies.

    ``counts``: samples per file (global index = files concatenated). ``block_rows``: block
    length for ``contiguous``/``weighted`` (one int, or one per file: use the HDF5 chunk
    length). ``labels``: for ``stratified`` only, one integer class per global sample (small
    codes such as ``int16`` sort fastest). Raises :class:`TooFewSamplesError` when
    ``sum(counts)`` is smaller than the global batch, and :class:`ConfigError` for bad arguments.
    """
    _check_args(counts, world_size, rank, batch_size, policy, weights, labels)
    n = int(sum(int(c) for c in counts))
    sizes = rank_batch_sizes(world_size, batch_size, policy, weights)
    g = sum(sizes)
    if n < g:
        raise TooFewSamplesError(
            f"{n} samples are fewer than {world_size} ranks x batch size {batch_size} = {g}; "
            "some rank would get no full step",
            hint=f"use batch_size <= {max(1, n // world_size)} or fewer ranks, or add data")
    if policy == "strided":
        steps, idx, mask = _strided(n, world_size, rank, batch_size, seed, epoch, drop_last, shuffle)
    elif policy == "stratified":
        steps, idx, mask = _stratified(labels, [int(c) for c in counts], world_size, rank, batch_size, seed,
                                       epoch, drop_last, shuffle, block_rows)
    else:
        steps, idx, mask = _contiguous([int(c) for c in counts], world_size, rank, sizes, seed,
                                       epoch, drop_last, shuffle, block_rows)
    if window_order not in ("shuffle", "sort"):
        raise ConfigError(f"window_order must be 'shuffle' or 'sort', got {window_order!r}",
                          hint="use window_order 'shuffle' or 'sort'")
    if window_steps > 0 and shuffle:
        idx, mask = _window_reorder(idx, mask, window_steps * sizes[rank], sizes[rank], seed, epoch, rank,
                                    window_order)
    return RankPlan(
        rank=rank, world_size=world_size, epoch=int(epoch), policy=policy, steps=int(steps),
        batch_size=sizes[rank], global_batch=g, num_samples=n, window_steps=int(window_steps),
        indices=np.ascontiguousarray(idx, dtype=np.int64), mask=np.ascontiguousarray(mask, dtype=np.bool_),
    )


def plan_all(counts: Sequence[int], world_size: int, batch_size: int, **kwargs) -> List[RankPlan]:
    """Every rank's plan (for tests and for tools that print the whole partition)."""
    return [plan_epoch(counts, world_size, r, batch_size, **kwargs) for r in range(world_size)]


def read_runs(global_ids: np.ndarray, offsets: np.ndarray, max_gap: int = 0, ascending: bool = False
              ) -> List[Tuple[int, int, int]]:
    """Cover a set of global ids with few contiguous reads: ``[(file, row_start, row_stop)]``.

    Ids are sorted (pass ``ascending=True`` when they already strictly ascend); neighbouring
    ids closer than ``max_gap`` rows in the same file share one read (reading a few unused
    rows beats one more HDF5 call). Reads never cross a file.
    """
    ids = np.asarray(global_ids, dtype=np.int64)
    if ids.size == 0:
        return []
    if not ascending:
        ids = np.sort(ids)  # repeated ids need no removing: a step of 0 never starts a new read
    files, rows = locate(ids, offsets)
    far = np.diff(ids) > max_gap + 1
    breaks = np.flatnonzero(far if len(offsets) == 2 else far | (np.diff(files) != 0)) + 1
    starts = np.concatenate([[0], breaks])
    stops = np.concatenate([breaks, [len(ids)]])
    return [(int(files[a]), int(rows[a]), int(rows[b - 1]) + 1) for a, b in zip(starts, stops)]


@dataclass
class WindowLayout:
    """How the loader reads one window's ids (in plan order): the runs it reads and where
    each row of them goes.

    ``runs`` (``[(file, row_start, row_stop)]``) are read one after another into a run
    buffer of ``total`` rows, run i at row ``where[i]``. ``direct``: the ids ascend and few
    runs cover them, so the runs are read straight into the window. Otherwise
    ``gather_rows[j]`` is the run-buffer row of window row j; ``sparse``: the runs hold
    more than twice the rows needed (e.g. strided ids), so rows are better gathered one
    by one. ``dest`` (only when scattering, neither direct nor sparse) maps each run-buffer
    row to its window row (-1: not needed); a row needed twice (padding repeats) is read to
    one place and copied from window row ``repeat_src[k]`` to ``repeats[k]``.
    """
    runs: List[Tuple[int, int, int]]
    where: np.ndarray
    total: int
    direct: bool
    sparse: bool = False
    gather_rows: Optional[np.ndarray] = None
    dest: Optional[np.ndarray] = None
    repeats: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    repeat_src: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))

    @property
    def scattered(self) -> bool:
        """Rows are read with scattering reads to their window places (``dest`` set)."""
        return self.dest is not None


def window_layout(ids: np.ndarray, offsets: np.ndarray, max_gap: int, scatter: bool) -> WindowLayout:
    """The :class:`WindowLayout` of a non-empty window: ``ids`` in plan order, runs merging
    rows closer than ``max_gap`` (as :func:`read_runs`), ``dest`` planned when ``scatter``."""
    ids = np.asarray(ids, dtype=np.int64)
    if np.all(ids[1:] > ids[:-1]):
        runs = read_runs(ids, offsets, max_gap=0, ascending=True)
        if len(runs) <= max(1, len(ids) // 16):  # not e.g. strided ids: one read per sample
            return _layout(runs, direct=True)
    layout = _layout(read_runs(ids, offsets, max_gap=max_gap), direct=False)
    starts = np.array([offsets[fi] + r0 for fi, r0, _ in layout.runs], np.int64)
    run = np.searchsorted(starts, ids, side="right") - 1
    layout.gather_rows = ids + (layout.where - starts)[run]
    layout.sparse = layout.total > 2 * len(ids)
    if scatter and not layout.sparse:
        _plan_scatter(layout, len(ids))
    return layout


def _layout(runs: List[Tuple[int, int, int]], direct: bool) -> WindowLayout:
    lengths = np.array([r1 - r0 for _, r0, r1 in runs], np.int64)
    where = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64)
    return WindowLayout(runs=runs, where=where, total=int(lengths.sum()), direct=direct)


def _plan_scatter(layout: WindowLayout, rows: int) -> None:
    """Fill ``dest`` (and the repeats) of a window of ``rows`` rows from its ``gather_rows``."""
    dest = np.full(layout.total, -1, np.int64)
    positions = np.arange(rows, dtype=np.int64)
    dest[layout.gather_rows] = positions
    if np.count_nonzero(dest >= 0) < rows:  # some id twice: one of its rows is read, the others copied
        first = dest[layout.gather_rows]
        layout.repeats = np.flatnonzero(first != positions)
        layout.repeat_src = first[layout.repeats]
    layout.dest = dest
