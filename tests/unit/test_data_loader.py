"""The HDF5 loader in one process: contents, partition, epochs, prefetch, workers, drivers."""
from __future__ import annotations

import threading

import h5py
import numpy as np
import pytest
import torch

from hpctrain.data import HDF5Dataset
from hpctrain.data.errors import ConfigError, CorruptFileError, DtypeError, LengthMismatchError, MissingKeyError
from hpctrain.data.loader import choose_driver


def make_file(path, n, start=0, chunk=16, features=3, compression=None, fletcher32=False):
    """x[i] = [g*10, g*10+1, ...] and y[i] = g for the global id g = start + i."""
    g = np.arange(start, start + n, dtype=np.int64)
    x = (g[:, None] * 10 + np.arange(features)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(min(chunk, n), features), compression=compression,
                         fletcher32=fletcher32)
        f.create_dataset("y", data=g, chunks=(min(chunk, n),), compression=compression, fletcher32=fletcher32)
    return str(path)


@pytest.fixture
def three_files(tmp_path):
    sizes = [50, 7, 80]
    paths, start = [], 0
    for i, n in enumerate(sizes):
        paths.append(make_file(tmp_path / f"part{i}.h5", n, start))
        start += n
    return paths, sum(sizes)


def collect(ds):
    ids, masks, steps = [], [], 0
    for b in ds:
        g = b["index"]
        assert torch.equal(b["y"], g), "y must be the global id"
        assert torch.equal(b["x"][:, 0], (g * 10).float())
        assert b["mask"].dtype == torch.bool and b["x"].shape[0] == ds.batch_size_here
        ids.append(g.numpy())
        masks.append(b["mask"].numpy())
        steps += 1
    assert steps == len(ds)
    return np.concatenate(ids), np.concatenate(masks)


@pytest.mark.parametrize("policy", ["contiguous", "strided", "weighted"])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_every_rank_in_one_process(three_files, policy, prefetch):
    paths, n = three_files
    world = 3
    weights = [1.0, 2.0, 3.0] if policy == "weighted" else None
    real = []
    lengths = set()
    for rank in range(world):
        ds = HDF5Dataset(paths, ["x", "y"], 4, rank=rank, world_size=world, policy=policy, seed=3,
                         weights=weights, prefetch=prefetch, window_bytes=200, block_bytes=1)
        ds.set_epoch(1)
        ids, mask = collect(ds)
        real.append(ids[mask])
        lengths.add(len(ds))
    assert len(lengths) == 1
    allreal = np.concatenate(real)
    assert sorted(allreal.tolist()) == list(range(n))  # pad mode: complete, each once


@pytest.mark.parametrize("policy", ["contiguous", "strided"])
def test_scatter_reads_and_read_then_gather_give_the_same_batches(three_files, monkeypatch, policy):
    """Without the scattering extension the loader reads runs and gathers them: same batches."""
    import hpctrain.data.loader as loader
    paths, _ = three_files

    def epoch():
        ds = HDF5Dataset(paths, ["x", "y"], 4, rank=1, world_size=2, policy=policy, seed=5,
                         prefetch=0, window_bytes=200, block_bytes=1)
        ds.set_epoch(2)
        return collect(ds)

    scattered = epoch()
    monkeypatch.setattr(loader, "SCATTER", False)
    gathered = epoch()
    assert np.array_equal(scattered[0], gathered[0]) and np.array_equal(scattered[1], gathered[1])


def test_epochs_reshuffle_and_repeat(three_files):
    paths, _ = three_files
    ds = HDF5Dataset(paths, ["x", "y"], 5, rank=0, world_size=1, seed=1, block_bytes=1)
    a, ma = collect(ds)
    again, _ = collect(ds)
    ds.set_epoch(1)
    b, mb = collect(ds)
    assert np.array_equal(a, again)
    assert not np.array_equal(a, b)
    assert sorted(a[ma].tolist()) == sorted(b[mb].tolist())


def test_prefetch_matches_synchronous(three_files):
    paths, _ = three_files
    kw = dict(rank=1, world_size=2, seed=9, window_bytes=300, block_bytes=1)
    a, ma = collect(HDF5Dataset(paths, ["x", "y"], 6, prefetch=0, **kw))
    b, mb = collect(HDF5Dataset(paths, ["x", "y"], 6, prefetch=3, **kw))
    assert np.array_equal(a, b) and np.array_equal(ma, mb)


def test_drop_last_has_no_padding(three_files):
    paths, n = three_files
    ds = HDF5Dataset(paths, ["x", "y"], 8, rank=0, world_size=2, drop_last=True)
    ids, mask = collect(ds)
    assert mask.all() and len(ds) == n // 16


def test_dtypes_and_transforms(three_files):
    paths, _ = three_files
    ds = HDF5Dataset(paths, ["x", "y"], 4, rank=0, world_size=1, dtypes={"x": torch.float64, "y": "int32"},
                     transforms={"x": lambda t: t * 2}, transform=lambda b: {**b, "extra": b["y"] + 1})
    b = next(iter(ds))
    assert b["x"].dtype == torch.float64 and b["y"].dtype == torch.int32
    assert torch.equal(b["x"][:, 0], b["index"].double() * 20)
    assert torch.equal(b["extra"], b["y"] + 1)


def test_early_break_stops_the_prefetch_thread(three_files):
    paths, _ = three_files
    before = threading.active_count()
    ds = HDF5Dataset(paths, ["x", "y"], 2, rank=0, world_size=1, prefetch=2, window_bytes=64)
    for i, _ in enumerate(ds):
        if i == 3:
            break
    assert threading.active_count() == before


def test_dataloader_workers_fork_safe(three_files):
    paths, n = three_files
    ds = HDF5Dataset(paths, ["x", "y"], 4, rank=0, world_size=1, window_bytes=200, block_bytes=1, seed=2)
    first, _ = collect(ds)  # the parent has now opened the files: workers must not reuse them
    assert ds._handles
    loader = ds.dataloader(num_workers=2, multiprocessing_context="fork")
    assert len(loader) == len(ds)
    ids = []
    for b in loader:
        assert torch.equal(b["y"], b["index"])
        ids.append(b["index"][b["mask"]].numpy())
    got = np.concatenate(ids)
    assert sorted(got.tolist()) == list(range(n)) == sorted(set(first.tolist()))


def test_pickles_without_handles(three_files):
    import pickle

    paths, _ = three_files
    ds = HDF5Dataset(paths, ["x", "y"], 4, rank=0, world_size=1)
    next(iter(ds))
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._handles == {}
    assert len(list(clone)) == len(ds)


def test_directory_and_glob(three_files, tmp_path):
    paths, n = three_files
    for source in (str(tmp_path), str(tmp_path / "part*.h5")):
        ds = HDF5Dataset(source, ["x", "y"], 4, rank=0, world_size=1)
        assert ds.paths == sorted(paths) and ds.num_samples == n


def test_lzf_and_reserved_names(tmp_path):
    p = make_file(tmp_path / "c.h5", 100, compression="lzf")
    ids, mask = collect(HDF5Dataset(p, ["x", "y"], 8, rank=0, world_size=1))
    assert sorted(ids[mask].tolist()) == list(range(100))
    with pytest.raises(ConfigError, match="clashes"):
        HDF5Dataset(p, ["x", "y"], 8, rank=0, world_size=1, mask_key="y")


def test_corrupt_chunk_raises_naming_file_and_key(tmp_path):
    p = make_file(tmp_path / "bad.h5", 400, chunk=100, fletcher32=True, features=8)
    with h5py.File(p, "r") as f:
        offset = f["x"].id.get_chunk_info(1).byte_offset
    with open(p, "r+b") as fh:
        fh.seek(offset + 10)
        fh.write(b"\xff\xfe\xfd\xfc")
    ds = HDF5Dataset(p, ["x", "y"], 10, rank=0, world_size=1, prefetch=1, shuffle=False)
    with pytest.raises(CorruptFileError) as info:
        list(ds)
    assert p in str(info.value) and "'x'" in str(info.value)


def test_default_rank_and_size_come_from_comm(three_files):
    # In a subprocess: comm.init() starts MPI, which this pytest process should not do.
    import subprocess
    import sys

    paths, _ = three_files
    code = ("from hpctrain.data import HDF5Dataset; import sys; "
            "ds = HDF5Dataset(sys.argv[1:], ['x', 'y'], 4); print(ds.rank, ds.world_size)")
    out = subprocess.run([sys.executable, "-c", code, *paths], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"]


def test_choose_driver():
    assert choose_driver("auto", False, 4, False) is None
    assert choose_driver("auto", True, 4, False) == "mpio"
    assert choose_driver("auto", True, 1, False) is None
    assert choose_driver("auto", True, 4, True) is None  # DataLoader workers are not MPI ranks
    assert choose_driver("serial", True, 4, False) is None
    with pytest.raises(ConfigError, match="parallel HDF5"):
        choose_driver("mpio", False, 2, False)
    with pytest.raises(ConfigError, match="worker"):
        choose_driver("mpio", True, 2, True)
    with pytest.raises(ConfigError, match="unknown driver"):
        choose_driver("posix", True, 2, False)


def test_mpio_driver_reads(three_files):
    """The parallel-HDF5 path in one process, where h5py was built with MPI. PyPI's h5py is
    serial: tests/test_data_mpio.py runs this test inside the environment built by
    tests/mpio/setup-env.sh (and fails there when HPCTRAIN_REQUIRE_MPIO=1)."""
    if not h5py.get_config().mpi:
        pytest.skip("this h5py is serial (h5py.get_config().mpi is False); tests/test_data_mpio.py runs "
                    "this test in the parallel-HDF5 environment of tests/mpio/setup-env.sh")
    paths, n = three_files
    ds = HDF5Dataset(paths, ["x", "y"], 4, rank=0, world_size=1, driver="mpio")
    ids, mask = collect(ds)
    assert sorted(ids[mask].tolist()) == list(range(n))


@pytest.mark.parametrize("shuffle", [True, "block", False])
@pytest.mark.parametrize("prefetch", [0, 2])
def test_held_batches_are_never_overwritten(three_files, shuffle, prefetch):
    """Window arrays are recycled only when no batch refers to them: keep every batch."""
    paths, n = three_files
    ds = HDF5Dataset(paths, ["x", "y"], 4, rank=0, world_size=1, shuffle=shuffle, prefetch=prefetch,
                     window_bytes=100, block_bytes=1)
    kept = list(ds)
    kept_x = [b["x"][:1] for b in ds]  # only a slice of each batch kept alive
    assert len(kept) == len(ds) == len(kept_x)
    for b in kept:
        assert torch.equal(b["y"], b["index"]) and torch.equal(b["x"][:, 0], (b["index"] * 10).float())
    again = list(ds)
    for x, b in zip(kept_x, again):
        assert torch.equal(x[:, 0], (b["index"][:1] * 10).float())
    real = np.concatenate([b["index"][b["mask"]].numpy() for b in kept])
    assert sorted(real.tolist()) == list(range(n))
    if shuffle is False:
        assert np.array_equal(real, np.arange(n))


@pytest.mark.parametrize("prefetch", [0, 1])
def test_window_arrays_are_kept_from_one_epoch_to_the_next(three_files, prefetch):
    """A later epoch reads into the window arrays of the first (no fresh memory to fault
    in); a pickled copy (a DataLoader worker) and close() start without them."""
    import pickle

    paths, n = three_files
    ds = HDF5Dataset(paths, ["x", "y"], 4, rank=0, world_size=1, prefetch=prefetch, window_bytes=100, block_bytes=1)
    collect(ds)
    arrays = [a for sets in ds._window_pool[1].sets for a in sets.values()]
    assert arrays
    ds.set_epoch(1)
    ids, masks = collect(ds)
    assert sorted(ids[masks].tolist()) == list(range(n))
    again = [a for sets in ds._window_pool[1].sets for a in sets.values()]
    assert all(any(a is b for b in again) for a in arrays)  # the first epoch's arrays, reused
    assert len(ds._window_pool[1].sets) <= prefetch + 3
    assert pickle.loads(pickle.dumps(ds))._window_pool is None
    ds.close()
    assert ds._window_pool is None


def test_block_shuffle_batches_are_contiguous_runs(tmp_path):
    p = make_file(tmp_path / "b.h5", 4096, chunk=256)
    ds = HDF5Dataset(p, ["x", "y"], 64, rank=0, world_size=1, shuffle="block", block_bytes=1)
    for b in ds:
        assert torch.all(torch.diff(b["index"]) == 1)  # one chunk-aligned block per batch here
    with pytest.raises(ConfigError, match="shuffle must be"):
        HDF5Dataset(p, ["x", "y"], 64, rank=0, world_size=1, shuffle="random")


def test_set_weights_rebalances_with_equal_steps(three_files):
    paths, n = three_files
    dss = [HDF5Dataset(paths, ["x", "y"], 6, rank=r, world_size=2, policy="weighted", weights=[1, 1])
           for r in range(2)]
    assert [d.batch_size_here for d in dss] == [6, 6]
    steps = len(dss[0])
    for d in dss:
        d.set_weights([1.0, 3.0])
    assert [d.batch_size_here for d in dss] == [3, 9] and [len(d) for d in dss] == [steps, steps]
    real = np.concatenate([collect(d)[0][collect(d)[1]] for d in dss])
    assert sorted(real.tolist()) == list(range(n))
    with pytest.raises(ConfigError):
        dss[0].set_weights([1.0])
    assert dss[0].batch_size_here == 3


def test_strided_block_mode_reads_few_slabs(three_files, monkeypatch):
    import hpctrain.data.loader as L

    calls = []
    real = L._read_union
    monkeypatch.setattr(L, "_read_union", lambda d, runs, out: (calls.append(len(runs)), real(d, runs, out)))
    paths, n = three_files
    ds = HDF5Dataset(paths, ["x", "y"], 4, rank=1, world_size=3, policy="strided", shuffle="block",
                     through_hdf5=True)  # the HDF5 read path (uncompressed keys are read around it otherwise)
    ids, mask = collect(ds)
    assert calls and sum(calls) < len(ids) / 4  # covering slabs, not one read per sample


def test_dataloader_workers_decode_compressed_chunks(tmp_path):
    """lzf keys read as stored chunks inside fork workers: every sample once, values intact."""
    sizes = [50, 7, 80]
    paths, start = [], 0
    for i, n in enumerate(sizes):
        paths.append(make_file(tmp_path / f"lzf{i}.h5", n, start, compression="lzf"))
        start += n
    ds = HDF5Dataset(paths, ["x", "y"], 4, rank=0, world_size=1, window_bytes=200, block_bytes=1, seed=3)
    collect(ds)  # the parent maps the files first: workers must open their own
    from hpctrain.data import codecs
    from hpctrain.data.chunked import ChunkedKey

    if codecs._codecs is not None:  # built (CI requires it): the chunk decoder is in use
        assert isinstance(ds._readers(0)["x"], ChunkedKey)
    ids = []
    for b in ds.dataloader(num_workers=2, multiprocessing_context="fork"):
        assert torch.equal(b["y"], b["index"])
        assert torch.equal(b["x"][:, 0], b["index"].float() * 10)
        ids.append(b["index"][b["mask"]].numpy())
    assert sorted(np.concatenate(ids).tolist()) == list(range(sum(sizes)))


def make_labelled(path, n, start, classes, chunk=16):
    """y = global id (checked by collect), c = class of each sample, written class by class."""
    g = np.arange(start, start + n, dtype=np.int64)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=(g[:, None] * 10 + np.arange(3)).astype(np.float32), chunks=(chunk, 3))
        f.create_dataset("y", data=g, chunks=(chunk,))
        f.create_dataset("c", data=classes.astype(np.float64), chunks=(chunk,))  # whole floats are classes
    return str(path)


@pytest.mark.parametrize("shuffle", [True, "block", False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_stratified_every_rank_same_class_proportions(tmp_path, shuffle, drop_last):
    classes = np.repeat([0, 1, 2, 5], [90, 45, 20, 6])  # skewed, sorted: contiguous shares would not mix
    paths = [make_labelled(tmp_path / "a.h5", 100, 0, classes[:100]),
             make_labelled(tmp_path / "b.h5", 61, 100, classes[100:])]
    world, per_rank, lengths = 3, [], set()
    for rank in range(world):
        ds = HDF5Dataset(paths, ["x", "y"], 5, rank=rank, world_size=world, policy="stratified", stratify="c",
                         seed=2, shuffle=shuffle, drop_last=drop_last, prefetch=1)
        ds.set_epoch(1)
        ids, mask = collect(ds)
        lengths.add(len(ds))
        per_rank.append(ids[mask])
        ds.close()
    assert len(lengths) == 1
    together = np.concatenate(per_rank)
    assert len(np.unique(together)) == len(together)
    if not drop_last:
        assert sorted(together.tolist()) == list(range(161))
    counts = np.array([[np.count_nonzero(classes[r] == c) for c in (0, 1, 2, 5)] for r in per_rank])
    assert np.all(counts.max(axis=0) - counts.min(axis=0) <= 1), counts


def test_stratified_label_errors(tmp_path):
    path = make_labelled(tmp_path / "a.h5", 40, 0, np.arange(40) % 4)
    with h5py.File(path, "a") as f:
        f["half"] = np.arange(40) / 2
        f["short"] = np.arange(39)
    with pytest.raises(DtypeError, match=r"not whole numbers .*0\.5 at sample 1.*\nHINT: stratify by an integer"):
        HDF5Dataset(path, ["x", "y"], 4, rank=0, world_size=2, policy="stratified", stratify="half")
    with pytest.raises(MissingKeyError, match=r"'nope'.*no such key; datasets in the file: c, half, short, x, y"
                                              r"\nHINT:"):
        HDF5Dataset(path, ["x", "y"], 4, rank=0, world_size=2, policy="stratified", stratify="nope")
    with pytest.raises(LengthMismatchError, match="39 rows.*40 samples"):
        HDF5Dataset(path, ["x", "y"], 4, rank=0, world_size=2, policy="stratified", stratify="short")
    with pytest.raises(ConfigError, match="have no 'y'.*\nHINT: pass stratify="):
        HDF5Dataset(path, ["x"], 4, rank=0, world_size=2, policy="stratified")
    with pytest.raises(ConfigError, match="only by policy 'stratified'"):
        HDF5Dataset(path, ["x", "y"], 4, rank=0, world_size=2, stratify="c")
    # The default label key is y (here every sample its own class: still one each).
    ds = HDF5Dataset(path, ["x", "y"], 4, rank=1, world_size=2, policy="stratified")
    assert ds.stratify == "y" and len(ds) == 5
