"""Property tests of the partition planner: every rank's plan built in one process."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from hpctrain.data.errors import ConfigError, DataError, TooFewSamplesError
from hpctrain.data.planner import (
    POLICIES, apportion, global_offsets, locate, plan_all, plan_epoch, read_runs, window_layout,
)


@st.composite
def setups(draw):
    world = draw(st.integers(1, 6))
    batch = draw(st.integers(1, 9))
    policy = draw(st.sampled_from(POLICIES))
    nfiles = draw(st.integers(1, 4))
    counts = draw(st.lists(st.integers(0, 60), min_size=nfiles, max_size=nfiles))
    extra = draw(st.integers(0, 80))
    counts[0] += max(0, world * batch * 2 - sum(counts)) + extra  # enough for the global batch
    weights = (draw(st.lists(st.floats(0.2, 5.0), min_size=world, max_size=world))
               if policy == "weighted" else None)
    kwargs = dict(
        seed=draw(st.integers(0, 2**31)),
        epoch=draw(st.integers(0, 50)),
        policy=policy,
        drop_last=draw(st.booleans()),
        shuffle=draw(st.booleans()),
        weights=weights,
        block_rows=draw(st.sampled_from([1, 3, 7, 16, [5] * nfiles])),
        window_steps=draw(st.sampled_from([0, 1, 3])),
        window_order=draw(st.sampled_from(["shuffle", "sort"])),
    )
    if policy == "stratified":
        classes = draw(st.integers(1, 7))
        kwargs["labels"] = np.random.default_rng(kwargs["seed"]).integers(0, classes, sum(counts)).astype(np.int16)
    return counts, world, batch, kwargs


@settings(max_examples=300, deadline=None)
@given(setups())
def test_partition_properties(setup):
    counts, world, batch, kw = setup
    n = sum(counts)
    plans = plan_all(counts, world, batch, **kw)

    # Equal number of steps on every rank, full batches, global batch = world * batch.
    steps = {p.steps for p in plans}
    assert len(steps) == 1 and plans[0].steps >= 1
    assert sum(p.batch_size for p in plans) == world * batch == plans[0].global_batch
    for p in plans:
        assert len(p.indices) == p.steps * p.batch_size
        assert p.indices.min() >= 0 and p.indices.max() < n

    real = np.concatenate([p.indices[p.mask] for p in plans])
    # Disjoint: no sample is real on two ranks (or twice on one).
    assert len(np.unique(real)) == len(real)
    dropped = n - len(real)
    if kw["drop_last"]:
        assert all(p.mask.all() for p in plans)
        limit = world * (batch + 1) if kw["policy"] == "strided" else world * batch
        assert 0 <= dropped < limit
    else:
        # Complete: every sample exactly once with mask True; padding is flagged.
        assert dropped == 0
        assert sorted(real.tolist()) == list(range(n))
        padding = sum(int((~p.mask).sum()) for p in plans)
        assert padding < world * batch

    # Deterministic.
    again = plan_all(counts, world, batch, **kw)
    for a, b in zip(plans, again):
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.mask, b.mask)


@settings(max_examples=100, deadline=None)
@given(setups())
def test_order_differs_across_epochs(setup):
    counts, world, batch, kw = setup
    kw.update(shuffle=True, block_rows=1 if kw["policy"] != "strided" else kw["block_rows"],
              window_order="shuffle")
    assume(sum(counts) >= 8)  # fewer rows can repeat an order by chance
    a = plan_all(counts, world, batch, **kw)
    b = plan_all(counts, world, batch, **{**kw, "epoch": kw["epoch"] + 1})
    assert [p.steps for p in a] == [p.steps for p in b]
    order_a = np.concatenate([p.indices for p in a])
    order_b = np.concatenate([p.indices for p in b])
    assert not np.array_equal(order_a, order_b)


def test_epoch_order_differs_with_chunk_blocks():
    # 100 blocks of 64 rows: the block order is reshuffled each epoch.
    a = plan_epoch([6400], 2, 0, 32, seed=1, epoch=0, block_rows=64)
    b = plan_epoch([6400], 2, 0, 32, seed=1, epoch=1, block_rows=64)
    assert not np.array_equal(a.indices, b.indices)
    # Without in-window shuffle each rank's ids are whole chunk-aligned blocks.
    runs = read_runs(a.indices, global_offsets([6400]))
    assert all(lo % 64 == 0 for _, lo, _ in runs[1:])


def test_strided_matches_distributed_sampler():
    import torch
    from torch.utils.data import DistributedSampler

    for n, world, batch, drop, shuffle in [(103, 3, 4, False, True), (103, 3, 4, True, True),
                                           (64, 4, 8, False, False), (17, 2, 3, True, False)]:
        for rank in range(world):
            ds = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=shuffle,
                                    seed=7, drop_last=drop)
            ds.set_epoch(5)
            expected = list(ds)
            loader_steps = len(torch.utils.data.DataLoader(expected, batch_size=batch, drop_last=drop))
            plan = plan_epoch([n], world, rank, batch, seed=7, epoch=5, policy="strided",
                              drop_last=drop, shuffle=shuffle)
            assert plan.steps == loader_steps
            used = expected[: plan.steps * batch]
            assert plan.indices[: len(used)].tolist() == used


def test_weighted_shares_follow_weights():
    plans = plan_all([10000], 3, 100, policy="weighted", weights=[1.0, 2.0, 1.0], drop_last=True)
    assert [p.batch_size for p in plans] == [75, 150, 75]
    assert len({p.steps for p in plans}) == 1
    assert [p.num_real for p in plans] == [p.steps * p.batch_size for p in plans]


def test_padding_spread_over_ranks():
    plans = plan_all([101], 4, 5, drop_last=False)
    assert all(p.steps == 6 for p in plans)  # ceil(101 / 20)
    pads = [int((~p.mask).sum()) for p in plans]
    assert sum(pads) == 4 * 5 * 6 - 101 and max(pads) - min(pads) <= 1


def test_global_index_across_files():
    offsets = global_offsets([3, 0, 5])
    assert offsets.tolist() == [0, 3, 3, 8]
    files, rows = locate(np.array([0, 2, 3, 7]), offsets)
    assert files.tolist() == [0, 0, 2, 2] and rows.tolist() == [0, 2, 0, 4]
    assert read_runs(np.array([7, 0, 1, 2, 3, 5]), offsets) == [(0, 0, 3), (2, 0, 1), (2, 2, 3), (2, 4, 5)]
    assert read_runs(np.array([3, 5, 7]), offsets, max_gap=1) == [(2, 0, 5)]
    # repeated ids (padding) read once; one file takes the shortcut, same answers
    assert read_runs(np.array([7, 7, 0, 1, 1, 2, 3, 5, 0]), offsets) == [(0, 0, 3), (2, 0, 1), (2, 2, 3), (2, 4, 5)]
    one = global_offsets([10])
    assert read_runs(np.array([9, 1, 1, 2, 2, 6, 0]), one) == [(0, 0, 3), (0, 6, 7), (0, 9, 10)]
    assert read_runs(np.array([9, 1, 1, 2, 2, 6, 0]), one, max_gap=2) == [(0, 0, 3), (0, 6, 10)]
    files, rows = locate(np.array([0, 4, 9]), one)
    assert files.tolist() == [0, 0, 0] and rows.tolist() == [0, 4, 9]


def test_apportion():
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(4, [100, 1, 1], minimum=1) == [2, 1, 1]
    with pytest.raises(ConfigError):
        apportion(3, [1, -1])


@pytest.mark.parametrize("kwargs,exc,words", [
    (dict(counts=[10], world_size=4, rank=0, batch_size=3), TooFewSamplesError, "fewer than 4 ranks x batch size 3"),
    (dict(counts=[0, 0], world_size=1, rank=0, batch_size=1), TooFewSamplesError, "0 samples"),
    (dict(counts=[100], world_size=2, rank=2, batch_size=1), ConfigError, "rank 2"),
    (dict(counts=[100], world_size=2, rank=0, batch_size=1, policy="random"), ConfigError, "unknown policy"),
    (dict(counts=[100], world_size=2, rank=0, batch_size=1, policy="weighted"), ConfigError, "one weight per rank"),
    (dict(counts=[100], world_size=2, rank=0, batch_size=1, weights=[1, 2]), ConfigError, "only by policy"),
    (dict(counts=[100], world_size=2, rank=0, batch_size=0), ConfigError, "batch_size"),
    (dict(counts=[100], world_size=2, rank=0, batch_size=1, policy="stratified"), ConfigError, "one class label"),
    (dict(counts=[100], world_size=2, rank=0, batch_size=1, policy="stratified", labels=np.zeros(99)),
     ConfigError, r"\(100\), got shape \(99,\)"),
    (dict(counts=[100], world_size=2, rank=0, batch_size=1, labels=np.zeros(100)), ConfigError, "only by policy"),
])
def test_bad_arguments(kwargs, exc, words):
    with pytest.raises(exc, match=words) as info:
        plan_epoch(**kwargs)
    assert isinstance(info.value, DataError) and isinstance(info.value, ValueError)


def test_window_sort_orders_each_window():
    p = plan_epoch([1000], 2, 1, 10, seed=4, epoch=3, block_rows=7, window_steps=5, window_order="sort")
    q = plan_epoch([1000], 2, 1, 10, seed=4, epoch=3, block_rows=7)
    assert sorted(p.indices.tolist()) == sorted(q.indices.tolist())
    for w in range(0, len(p.indices), 50):
        assert np.all(np.diff(p.indices[w:w + 50]) > 0)
    with pytest.raises(ConfigError, match="window_order"):
        plan_epoch([1000], 2, 1, 10, window_order="random")


def test_window_shuffle_splits_each_window_into_ascending_batches():
    p = plan_epoch([1000], 2, 1, 10, seed=4, epoch=3, block_rows=7, window_steps=5)
    q = plan_epoch([1000], 2, 1, 10, seed=4, epoch=3, block_rows=7)
    for w in range(0, len(p.indices), 50):
        assert sorted(p.indices[w:w + 50].tolist()) == sorted(q.indices[w:w + 50].tolist())
        place = {int(i): k for k, i in enumerate(q.indices[w:w + 50])}  # the window's order
        for b in range(w, w + 50, 10):
            assert np.all(np.diff([place[int(i)] for i in p.indices[b:b + 10]]) > 0)
    assert not np.array_equal(p.indices, q.indices)
    again = plan_epoch([1000], 2, 1, 10, seed=4, epoch=3, block_rows=7, window_steps=5)
    assert np.array_equal(p.indices, again.indices)  # reproducible from (seed, epoch, rank)


@pytest.mark.parametrize("rows, batch", [(12, 3), (70_000, 7)])  # uint16 and int64 positions
def test_random_split_is_a_uniform_split_into_sorted_batches(rows, batch):
    from hpctrain.data.planner import _random_split

    windows = 6000 if rows < 100 else 2
    split = _random_split(np.random.default_rng(1), windows, rows, batch)
    assert split.shape == (windows, rows) and split.dtype == np.int64
    assert np.array_equal(np.sort(split, axis=1), np.broadcast_to(np.arange(rows), split.shape))
    assert np.all(np.diff(split.reshape(windows, -1, batch), axis=2) > 0)
    if rows < 100:
        # Position 0 is in each batch equally often, and shares its batch with position 1
        # with probability (batch - 1) / (rows - 1); 6000 draws: a few % of noise.
        where0 = np.argmax(split == 0, axis=1) // batch
        where1 = np.argmax(split == 1, axis=1) // batch
        share = np.bincount(where0, minlength=rows // batch) / windows
        assert np.all(np.abs(share - batch / rows) < 0.03), share
        together = np.mean(where0 == where1)
        assert abs(together - (batch - 1) / (rows - 1)) < 0.03, together


@st.composite
def stratified_setups(draw):
    world = draw(st.integers(1, 5))
    batch = draw(st.integers(1, 8))
    nfiles = draw(st.integers(1, 3))
    counts = draw(st.lists(st.integers(0, 80), min_size=nfiles, max_size=nfiles))
    counts[0] += max(0, world * batch - sum(counts)) + draw(st.integers(0, 90))
    # Skewed class sizes (a rare class, a common one), labels in file order or in runs.
    weights = np.array(draw(st.lists(st.floats(0.05, 1.0), min_size=1, max_size=6)))
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    labels = rng.choice(np.arange(len(weights)) * 3 - 2, size=sum(counts), p=weights / weights.sum())
    if draw(st.booleans()):
        labels = np.sort(labels)  # a file written class by class
    kwargs = dict(seed=draw(st.integers(0, 2**31)), epoch=draw(st.integers(0, 20)), policy="stratified",
                  drop_last=draw(st.booleans()), shuffle=draw(st.booleans()), labels=labels,
                  block_rows=draw(st.sampled_from([1, 4, 16])), window_steps=draw(st.sampled_from([0, 2])))
    return counts, world, batch, kwargs


@settings(max_examples=300, deadline=None)
@given(stratified_setups())
def test_stratified_class_proportions_equal_on_every_rank(setup):
    counts, world, batch, kw = setup
    labels = kw["labels"]
    n = len(labels)
    plans = plan_all(counts, world, batch, **kw)
    assert len({p.steps for p in plans}) == 1 and plans[0].steps >= 1
    real = [p.indices[p.mask] for p in plans]
    together = np.concatenate(real)
    assert len(np.unique(together)) == len(together)  # nothing twice
    classes = np.unique(labels)
    per_rank = np.array([[np.count_nonzero(labels[r] == c) for c in classes] for r in real])
    # Every class: the ranks' counts differ by at most one.
    assert np.all(per_rank.max(axis=0) - per_rank.min(axis=0) <= 1)
    if kw["drop_last"]:
        assert all(len(r) == plans[0].steps * batch for r in real)
        # What is left out is taken from every class in proportion (within one per class).
        kept = per_rank.sum(axis=0)
        expect = np.array([np.count_nonzero(labels == c) for c in classes]) * len(together) / n
        assert np.all(np.abs(kept - expect) < 1)
    else:
        assert sorted(together.tolist()) == list(range(n))  # every sample once
    again = plan_all(counts, world, batch, **kw)
    for a, b in zip(plans, again):
        assert np.array_equal(a.indices, b.indices) and np.array_equal(a.mask, b.mask)
    # The same steps and real samples per rank as 'contiguous' (the runner plans with those).
    contiguous = plan_all(counts, world, batch, **{**kw, "policy": "contiguous", "labels": None})
    assert [(p.steps, p.num_real) for p in contiguous] == [(p.steps, p.num_real) for p in plans]


def test_stratified_shuffles_per_epoch_and_reads_blocks():
    labels = np.repeat(np.arange(4), [500, 300, 150, 50])  # written class by class
    kw = dict(policy="stratified", labels=labels, block_rows=64, seed=3)
    a = plan_all([1000], 3, 16, epoch=0, **kw)
    b = plan_all([1000], 3, 16, epoch=1, **kw)
    assert not np.array_equal(a[0].indices, b[0].indices)
    assert {p.steps for p in a} == {p.steps for p in b} == {-(-1000 // 48)}
    # Which samples a rank gets changes too, not only their order.
    assert set(a[0].indices[a[0].mask].tolist()) != set(b[0].indices[b[0].mask].tolist())
    # A rank's ids come block by block (chunk-aligned blocks of 64 rows in shuffled order).
    blocks = a[1].indices[a[1].mask] // 64
    assert np.count_nonzero(np.diff(blocks)) == len(np.unique(blocks)) - 1
    # Without shuffling: file order, the deal fixed.
    c = plan_all([1000], 3, 16, shuffle=False, **kw)
    assert all(np.all(np.diff(p.indices[p.mask]) > 0) for p in c)


def test_a_rank_expands_only_the_blocks_of_its_share():
    """_expand_slice(blocks, a, b) equals the slice of the whole expanded order, for every
    cut (inside a block, on a block edge, past the end, empty), and expands no block that
    lies outside the share."""
    from hpctrain.data import planner as P

    rng = np.random.default_rng(1)
    blocks = P._blocks([700, 333, 1, 90], [64, 17, 5, 9])
    blocks = blocks[rng.permutation(len(blocks))]
    whole = P._expand(blocks)
    cuts = [0, 1, 63, 64, 65, 500, len(whole) - 1, len(whole), len(whole) + 5]
    for a in cuts:
        for b in cuts:
            assert np.array_equal(P._expand_slice(blocks, a, b), whole[a:b]), (a, b)
    expanded = []
    real = P._expand
    try:
        P._expand = lambda part: expanded.append(int((part[:, 1] - part[:, 0]).sum())) or real(part)
        P._expand_slice(blocks, 100, 164)
    finally:
        P._expand = real
    assert expanded and expanded[0] <= 64 + 2 * 64  # the share's blocks, not all 1124 samples


def _run_buffer(layout, offsets):
    """The global id held by each row of a layout's run buffer."""
    rows = np.concatenate([np.arange(offsets[fi] + r0, offsets[fi] + r1) for fi, r0, r1 in layout.runs])
    assert len(rows) == layout.total
    return rows


def test_window_layout_reads_ascending_ids_straight_into_the_window():
    offsets = global_offsets([40, 40])
    ids = np.concatenate([np.arange(0, 20), np.arange(50, 70)])
    layout = window_layout(ids, offsets, max_gap=4, scatter=True)
    assert layout.direct and not layout.scattered
    assert layout.runs == [(0, 0, 20), (1, 10, 30)]
    assert np.array_equal(_run_buffer(layout, offsets), ids)


@given(st.lists(st.integers(0, 99), min_size=1, max_size=60), st.integers(0, 8), st.booleans())
@settings(max_examples=200, deadline=None)
def test_window_layout_puts_every_window_row_where_its_id_is_read(ids, gap, scatter):
    offsets = global_offsets([30, 45, 25])
    ids = np.array(ids, np.int64)
    layout = window_layout(ids, offsets, max_gap=gap, scatter=scatter)
    held = _run_buffer(layout, offsets)
    if layout.direct:
        assert np.array_equal(held, ids)
        return
    assert np.array_equal(held[layout.gather_rows], ids)
    assert layout.sparse == (layout.total > 2 * len(ids))
    assert layout.scattered == (scatter and not layout.sparse)
    if layout.scattered:  # scatter each needed row, then copy the repeats: the window in plan order
        window = np.full(len(ids), -1, np.int64)
        needed = layout.dest >= 0
        window[layout.dest[needed]] = held[needed]
        window[layout.repeats] = window[layout.repeat_src]
        assert np.array_equal(window, ids)


def test_window_layout_gathers_sparse_strided_ids():
    ids = np.arange(0, 400, 8)[::-1].copy()  # every 8th row, descending: runs mostly unused
    layout = window_layout(ids, global_offsets([400]), max_gap=16, scatter=True)
    assert not layout.direct and layout.sparse and not layout.scattered
