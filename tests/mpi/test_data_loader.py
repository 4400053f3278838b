"""The HDF5 loader under a real mpiexec: every rank's sample ids gathered and checked."""
import os
import shutil
import tempfile

import h5py
import numpy as np
import pytest

from hpctrain import comm
from hpctrain.data import HDF5Dataset, plan_epoch
from hpctrain.data.shard import shard

RANKS = (1, 3)
TIMEOUT = 300

comm.init()
N, R = comm.size(), comm.rank()
SIZES = [101, 37, 250]
TOTAL = sum(SIZES)


def class_of(g):
    """Skewed classes in runs (a file written class by class), with a rare class spread out."""
    return np.where(g % 13 == 0, 7, np.where(g < 230, 0, 1))


@pytest.fixture(scope="module")
def files():
    """Rank 0 writes three files (y = global id) in a shared directory; all ranks use them."""
    d = tempfile.mkdtemp(prefix="hpctrain-mpi-data-") if R == 0 else None
    d = comm.broadcast_object(d)
    paths = [os.path.join(d, f"part{i}.h5") for i in range(len(SIZES))]
    if R == 0:
        start = 0
        for p, n in zip(paths, SIZES):
            g = np.arange(start, start + n)
            with h5py.File(p, "w") as f:
                f.create_dataset("x", data=(g[:, None] * 10 + np.arange(3)).astype(np.float32), chunks=(16, 3))
                f.create_dataset("y", data=g, chunks=(16,))
                f.create_dataset("c", data=class_of(g), chunks=(16,))
            start += n
    comm.barrier()
    yield paths
    comm.barrier()
    if R == 0:
        shutil.rmtree(d, ignore_errors=True)


def run_epoch(ds):
    ids, mask, steps = [], [], 0
    for b in ds:
        assert np.array_equal(b["y"].numpy(), b["index"].numpy())
        assert np.array_equal(b["x"][:, 0].numpy(), b["index"].numpy() * 10.0)
        ids.append(b["index"].numpy())
        mask.append(b["mask"].numpy())
        steps += 1
    return np.concatenate(ids), np.concatenate(mask), steps


@pytest.mark.parametrize("policy", ["contiguous", "strided", "weighted"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_union_and_equal_steps(files, policy, drop_last):
    batch = 8
    weights = [1.0 + r for r in range(N)] if policy == "weighted" else None
    ds = HDF5Dataset(files, ["x", "y"], batch, policy=policy, seed=11, drop_last=drop_last, weights=weights,
                     window_bytes=1024)
    assert (ds.rank, ds.world_size) == (R, N)  # from hpctrain.comm
    ds.set_epoch(2)
    ids, mask, steps = run_epoch(ds)
    assert steps == len(ds)
    everyone = comm.allgather_object((ids.tolist(), mask.tolist(), steps, ds.batch_size_here))
    step_counts = {s for _, _, s, _ in everyone}
    assert len(step_counts) == 1, f"unequal steps across ranks: {[s for _, _, s, _ in everyone]}"
    assert sum(b for _, _, _, b in everyone) == N * batch
    real = [i for ids_r, m_r, _, _ in everyone for i, m in zip(ids_r, m_r) if m]
    assert len(real) == len(set(real)), "a sample is real on two ranks"
    if drop_last:
        limit = N * (batch + 1) if policy == "strided" else N * batch
        assert 0 <= TOTAL - len(real) < limit
        assert all(all(m_r) for _, m_r, _, _ in everyone)
    else:
        assert sorted(real) == list(range(TOTAL))
    # This rank's ids are exactly the pure planner's.
    plan = ds.plan()
    assert plan.steps == steps and np.array_equal(plan.indices, ids)


@pytest.mark.parametrize("shuffle", [True, "block"])
@pytest.mark.parametrize("drop_last", [False, True])
def test_stratified_same_class_proportions_on_every_rank(files, shuffle, drop_last):
    ds = HDF5Dataset(files, ["x", "y"], 6, policy="stratified", stratify="c", seed=4, shuffle=shuffle,
                     drop_last=drop_last, window_bytes=1024)
    ds.set_epoch(3)
    ids, mask, steps = run_epoch(ds)
    everyone = comm.allgather_object((ids[mask].tolist(), steps))
    assert len({s for _, s in everyone}) == 1, f"unequal steps across ranks: {[s for _, s in everyone]}"
    real = [i for r, _ in everyone for i in r]
    assert len(real) == len(set(real)), "a sample is real on two ranks"
    if drop_last:
        assert all(len(r) == steps * 6 for r, _ in everyone)
    else:
        assert sorted(real) == list(range(TOTAL)), "a sample is lost"
    counts = np.array([[np.count_nonzero(class_of(np.array(r, np.int64)) == c) for c in (0, 1, 7)]
                       for r, _ in everyone])
    assert np.all(counts.max(axis=0) - counts.min(axis=0) <= 1), f"class counts per rank: {counts.tolist()}"
    assert np.array_equal(ds.plan().indices, ids)


def test_epochs_differ_everywhere(files):
    ds = HDF5Dataset(files, ["x", "y"], 4, seed=5, block_bytes=1)
    a, _, _ = run_epoch(ds)
    ds.set_epoch(1)
    b, _, _ = run_epoch(ds)
    assert not np.array_equal(a, b)
    # Same plan as computed for this rank in a single process.
    counts = SIZES
    p = plan_epoch(counts, N, R, 4, seed=5, epoch=1, block_rows=ds.block_rows, window_steps=ds.window_steps)
    assert np.array_equal(p.indices, b)


def test_shard_each_rank_writes_its_own(files):
    out = os.path.join(os.path.dirname(files[0]), "shards")
    mine = shard(files[2], 5, out, rank=R, size=N, quiet=True)
    names = sorted(comm.allgather_object([os.path.basename(p) for p in mine]), key=len)
    flat = sorted(n for names_r in names for n in names_r)
    assert flat == [f"part2-{i:05d}-of-00005.h5" for i in range(5)]
    comm.barrier()
    ds = HDF5Dataset(out, ["x", "y"], 2, seed=1)
    offset = SIZES[0] + SIZES[1]  # y holds the ids of the original three-file index
    ys = [b["y"][b["mask"]] for b in ds]
    for b in ds:
        assert np.array_equal(b["y"].numpy(), b["index"].numpy() + offset)
    real = sorted(i for r in comm.allgather_object(np.concatenate(ys).tolist()) for i in r)
    assert real == list(range(offset, TOTAL))
