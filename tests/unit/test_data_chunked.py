"""Compressed keys read as stored chunks decoded by hpctrain (hpctrain.data.chunked): the
loader's batches equal those read through HDF5, for every filter combination it decodes,
every shuffle mode and partial chunks; a damaged chunk is an error naming file and key."""

import h5py
import hdf5plugin
import numpy as np
import pytest
import torch

from hpctrain.data import codecs
from hpctrain.data.chunked import ChunkedKey, chunked_dataset
from hpctrain.data.errors import CorruptFileError
from hpctrain.data.loader import HDF5Dataset
from hpctrain.data.mapped import open_map
from require import skip_or_fail

if codecs._codecs is None:
    skip_or_fail("codecs", "hpctrain.data._codecs not built (no C compiler or Python headers at install)",
                 module_level=True)

FILTERS = {
    "lzf": dict(compression="lzf"),
    "lzf+shuffle": dict(compression="lzf", shuffle=True),
    "gzip": dict(compression="gzip", compression_opts=4),
    "gzip+shuffle": dict(compression="gzip", shuffle=True),
    # hdf5plugin's filters, decoded by the plugins' own functions outside HDF5
    "blosc-lz4": dict(hdf5plugin.Blosc(cname="lz4", shuffle=hdf5plugin.Blosc.SHUFFLE)),
    "blosc-zstd-bitshuffle": dict(hdf5plugin.Blosc(cname="zstd", shuffle=hdf5plugin.Blosc.BITSHUFFLE)),
    "blosc2": dict(hdf5plugin.Blosc2(cname="lz4")),
    "bitshuffle-lz4": dict(hdf5plugin.Bitshuffle(cname="lz4")),
    "lz4": dict(hdf5plugin.LZ4()),
    "zstd": dict(hdf5plugin.Zstd()),
    "zstd+shuffle": dict(hdf5plugin.Zstd(), shuffle=True),
}


def write(path, n, filters, chunk=64, features=5, start=0):
    """x[i] = [i*10, i*10+1, ...] (float32, smooth: compressible), y[i] = i (int64)."""
    ids = np.arange(start, start + n, dtype=np.int64)
    x = (ids[:, None] * 10 + np.arange(features)).astype(np.float32)
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=x, chunks=(chunk, features), **filters)
        f.create_dataset("y", data=ids, chunks=(chunk,), **filters)
    return str(path)


@pytest.mark.parametrize("name", sorted(FILTERS))
def test_chunked_key_decodes_rows_like_hdf5(tmp_path, name):
    path = write(tmp_path / "d.h5", 1000, FILTERS[name], chunk=96)  # last chunk partial
    mf = open_map(path)
    with h5py.File(path, "r") as f:
        for key in ("x", "y"):
            ck, why = chunked_dataset(f[key], mf)
            assert isinstance(ck, ChunkedKey), why
            for lo, hi in ((0, 96), (0, 1000), (5, 7), (90, 200), (950, 1000), (999, 1000)):
                out = np.empty((hi - lo,) + f[key].shape[1:], f[key].dtype)
                for task in ck.fill_tasks(lo, hi, out):
                    task()
                np.testing.assert_array_equal(out, f[key][lo:hi])
    mf.close()


def test_unsupported_filters_are_read_through_hdf5(tmp_path):
    with h5py.File(tmp_path / "f.h5", "w") as f:
        f.create_dataset("x", data=np.ones((100, 3), np.float32), chunks=(10, 3), compression="lzf", fletcher32=True)
        f.create_dataset("y", data=np.ones((100, 3), np.float32), chunks=(10, 1), compression="lzf")
    mf = open_map(str(tmp_path / "f.h5"))
    with h5py.File(tmp_path / "f.h5", "r") as f:
        ck, why = chunked_dataset(f["x"], mf)
        assert ck is None and "fletcher32" in why
        ck, why = chunked_dataset(f["y"], mf)
        assert ck is None and "whole rows" in why
    mf.close()


@pytest.mark.parametrize("shuffle", [True, "block", False])
@pytest.mark.parametrize("name", ["lzf+shuffle", "gzip", "bitshuffle-lz4", "zstd+shuffle", "blosc-lz4"])
def test_loader_batches_equal_hdf5_reads(tmp_path, name, shuffle):
    paths = [write(tmp_path / "a.h5", 700, FILTERS[name], chunk=64),
             write(tmp_path / "b.h5", 333, FILTERS[name], chunk=50, start=700)]
    for policy in ("contiguous", "strided"):
        kw = dict(rank=1, world_size=2, seed=4, shuffle=shuffle, policy=policy, window_bytes=3000,
                  block_bytes=500, prefetch=1)
        fast = HDF5Dataset(paths, ["x", "y"], 16, **kw)
        slow = HDF5Dataset(paths, ["x", "y"], 16, through_hdf5=True, **kw)
        fast.set_epoch(1)
        slow.set_epoch(1)
        n = 0
        for a, b in zip(fast, slow):
            for k in ("x", "y", "index", "mask"):
                assert torch.equal(a[k], b[k]), (policy, k)
            assert torch.equal(a["y"], a["index"])
            n += 1
        assert n == len(fast) > 0
        assert all(isinstance(r, ChunkedKey) for m in fast._maps.values() for r in m.values())
        fast.close()
        slow.close()


@pytest.mark.parametrize("name", ["lzf", "bitshuffle-lz4", "blosc-lz4"])
def test_damaged_chunk_names_file_and_key(tmp_path, name):
    path = write(tmp_path / "bad.h5", 4096, FILTERS[name], chunk=256, features=64)
    with h5py.File(path, "r") as f:
        info = f["x"].id.get_chunk_info(3)
    ds = HDF5Dataset(path, ["x", "y"], 128, rank=0, world_size=1, seed=0)
    assert isinstance(ds._readers(0)["x"], ChunkedKey)  # mapped and checked before the damage
    with open(path, "r+b") as fh:  # overwrite the middle of chunk 3's stored bytes
        fh.seek(info.byte_offset + info.size // 3)
        fh.write(b"\xff" * (info.size // 3))
    with pytest.raises(CorruptFileError) as err:
        for _ in ds:
            pass
    assert "bad.h5" in str(err.value) and "'x'" in str(err.value) and "chunk 3" in str(err.value)
    ds.close()
