"""HDF5Dataset.iter_from(step): the epoch's batches minus the first ``step``, and the windows
before it are not read."""
import h5py
import numpy as np
import pytest
import torch

from hpctrain.data import HDF5Dataset
from hpctrain.data.errors import ConfigError


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    p = tmp_path_factory.mktemp("iterfrom") / "d.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.arange(5000 * 8, dtype=np.float32).reshape(5000, 8), chunks=(100, 8))
        f.create_dataset("y", data=np.arange(5000, dtype=np.int64), chunks=(100,))
    return p


def batches(it):
    return [(b["x"].clone(), b["y"].clone()) for b in it]


@pytest.mark.parametrize("shuffle", ["window", "block", False])
@pytest.mark.parametrize("prefetch", [0, 1])
def test_iter_from_equals_the_tail_of_a_full_epoch(path, shuffle, prefetch):
    ds = HDF5Dataset(path, ["x", "y"], 32, rank=0, world_size=1, seed=3, shuffle=shuffle, prefetch=prefetch,
                     window_bytes=8 * 32 * 40 * 3)  # a few batches per window: starts land inside windows
    ds.set_epoch(2)
    full = batches(iter(ds))
    assert ds.window_steps < len(ds)
    for start in (0, 1, ds.window_steps, ds.window_steps + 1, len(ds) - 1, len(ds)):
        tail = batches(ds.iter_from(start))
        assert len(tail) == len(full) - start
        for (x, y), (fx, fy) in zip(tail, full[start:]):
            assert torch.equal(x, fx) and torch.equal(y, fy)


def test_iter_from_skips_reading_earlier_windows(path, monkeypatch):
    ds = HDF5Dataset(path, ["x", "y"], 32, rank=0, world_size=1, seed=0, prefetch=0, through_hdf5=True,
                     window_bytes=8 * 32 * 40 * 3)
    read = []
    original = ds._read_window
    monkeypatch.setattr(ds, "_read_window", lambda ids, *a: read.append(len(ids)) or original(ids, *a))
    batches(ds.iter_from(len(ds) - 1))
    assert read == [32]  # only the last batch's rows


def test_iter_from_out_of_range_is_a_clear_error(path):
    ds = HDF5Dataset(path, ["x", "y"], 32, rank=0, world_size=1)
    with pytest.raises(ConfigError, match="outside this epoch"):
        ds.iter_from(len(ds) + 1)
    with pytest.raises(ConfigError, match="outside"):
        ds.iter_from(-1)
