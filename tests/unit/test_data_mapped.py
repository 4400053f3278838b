"""Uncompressed keys read from a memory map of the file: the same bytes as HDF5 reads, for
every layout the mapper accepts, and a clean fall-back to HDF5 for the ones it refuses."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch

from hpctrain.data import HDF5Dataset
from hpctrain.data.errors import CorruptFileError
from hpctrain.data import codecs
from hpctrain.data.chunked import ChunkedKey
from hpctrain.data.mapped import MappedKey, gather, map_dataset, open_map, segments_of


def rows(n, start=0, features=3, dtype=np.float32):
    g = np.arange(start, start + n, dtype=np.int64)
    return (g[:, None] * 10 + np.arange(features)).astype(dtype), g


def interleaved(path, n=20000, chunk=256, slab=2560, userblock=0, features=7, start=0):
    """x and y written slab by slab, as incremental writers do: each key's chunks then lie
    in several separate stretches of the file (several segments; the chunk index's nodes
    sit between them)."""
    x, y = rows(n, start, features)
    kw = {"userblock_size": userblock} if userblock else {}
    with h5py.File(path, "w", **kw) as f:
        dx = f.create_dataset("x", shape=x.shape, dtype=x.dtype, chunks=(chunk, x.shape[1]))
        dy = f.create_dataset("y", shape=y.shape, dtype=y.dtype, chunks=(chunk,))
        for lo in range(0, n, slab):
            dx[lo:lo + slab] = x[lo:lo + slab]
            dy[lo:lo + slab] = y[lo:lo + slab]
    return str(path)


def check_mapping(path, key):
    with h5py.File(path, "r") as f:
        d = f[key]
        mm = open_map(path)
        mk, why = map_dataset(d, mm)
        assert mk is not None, why
        ids = np.random.default_rng(0).permutation(d.shape[0])
        out = np.empty((len(ids),) + d.shape[1:], d.dtype)
        gather([mk], np.zeros(len(ids), np.int64), ids, out)
        assert np.array_equal(out, d[...][ids])
        segs = segments_of(d)[0]
        mk.release()
        return segs


def test_layouts_that_map(tmp_path):
    p = str(tmp_path / "a.h5")
    x, y = rows(300)
    with h5py.File(p, "w") as f:
        f.create_dataset("contig", data=x)  # contiguous layout
        f.create_dataset("chunked", data=x, chunks=(7, 3))  # last chunk partial
        f.create_dataset("big_endian", data=x.astype(">f8"), chunks=(50, 3))
        f.create_dataset("labels", data=y, chunks=(64,))
        f.create_dataset("images", data=np.arange(300 * 2 * 4 * 4, dtype=np.uint8).reshape(300, 2, 4, 4),
                         chunks=(9, 2, 4, 4))
    for key in ("contig", "chunked", "big_endian", "labels", "images"):
        assert len(check_mapping(p, key)) == 1  # written in one go: one stretch of the file
    q = interleaved(tmp_path / "i.h5")
    assert len(check_mapping(q, "x")) == 2 and len(check_mapping(q, "y")) == 2
    u = interleaved(tmp_path / "u.h5", userblock=512)  # offsets count the user block
    check_mapping(u, "x")
    c = str(tmp_path / "uc.h5")
    with h5py.File(c, "w", userblock_size=1024) as f:
        f.create_dataset("x", data=rows(50)[0])
    check_mapping(c, "x")


def test_gather_reads_long_runs_with_preadv_and_gathers_the_rest(tmp_path):
    """Block order over interleaved chunks: every label chunk (2 KiB) is a run of its own
    (the view's rows jump between chunks), read with preadv; isolated rows are gathered."""
    from hpctrain.data import mapped

    q = interleaved(tmp_path / "i.h5", n=8192, chunk=512, slab=1024)
    with h5py.File(q, "r") as f:
        y = f["y"][...]
        mk, why = map_dataset(f["y"], open_map(q))
        assert mk is not None, why
        blocks = np.concatenate([np.arange(4096, 6144), np.arange(0, 1024)])  # a block order
        strided = np.arange(3, 8192, 7)  # sparse: no run long enough
        mixed = np.concatenate([np.arange(1000, 1600), strided[300:350]])
        for ids, want in ((blocks, {mapped.pread_into}), (strided, {np.take}), (mixed, {mapped.pread_into, np.take})):
            out = np.empty(len(ids), y.dtype)
            tasks = mapped.gather_tasks([mk], np.zeros(len(ids), np.int64), ids, out)
            assert {fn for task in tasks for fn, _ in task.args[0]} == want
            for task in tasks:
                task()
            assert np.array_equal(out, y[ids])
        mk.release()


def test_layouts_that_do_not_map(tmp_path):
    p = str(tmp_path / "b.h5")
    x, _ = rows(100)
    with h5py.File(p, "w") as f:
        f.create_dataset("lzf", data=x, chunks=(10, 3), compression="lzf")
        f.create_dataset("checksummed", data=x, chunks=(10, 3), fletcher32=True)
        f.create_dataset("split_rows", data=x, chunks=(10, 1))
        f.create_dataset("partial", shape=(100, 3), dtype=np.float32, chunks=(10, 3))[:20] = x[:20]
        f.create_dataset("unwritten", shape=(100, 3), dtype=np.float32)
    with h5py.File(p, "r") as f:
        mm = open_map(p)
        for key, why in [("lzf", "filtered"), ("checksummed", "filtered"), ("split_rows", "whole rows"),
                         ("partial", "allocated"), ("unwritten", "allocated")]:
            mk, reason = map_dataset(f[key], mm)
            assert mk is None and why in reason, (key, reason)


@pytest.mark.parametrize("memory_map", [True, False])
@pytest.mark.parametrize("shuffle", [True, "block", False])
@pytest.mark.parametrize("policy", ["contiguous", "strided"])
def test_loader_same_batches_around_hdf5_or_through_it(tmp_path, shuffle, policy, memory_map):
    """Read around HDF5 (with a file map or without one) or through it: the same batches."""
    paths = [interleaved(tmp_path / "p0.h5")]  # 2 segments in 2 views per key
    x, y = rows(130, start=20000, features=7)
    with h5py.File(tmp_path / "p1.h5", "w") as f:  # one key mapped, one compressed
        f.create_dataset("x", data=x, chunks=(16, 7))
        f.create_dataset("y", data=y, chunks=(16,), compression="lzf")
    paths.append(str(tmp_path / "p1.h5"))
    paths.append(interleaved(tmp_path / "p2.h5", 3000, chunk=128, slab=1000, start=20130))
    for rank in range(2):
        kw = dict(rank=rank, world_size=2, seed=3, shuffle=shuffle, policy=policy, window_bytes=20000,
                  block_bytes=4000, drop_last=False, prefetch=1)
        mapped = HDF5Dataset(paths, ["x", "y"], 12, memory_map=memory_map, **kw)
        plain = HDF5Dataset(paths, ["x", "y"], 12, through_hdf5=True, **kw)
        mapped.set_epoch(2)
        plain.set_epoch(2)
        n = 0
        for a, b in zip(mapped, plain):
            for k in ("x", "y", "index", "mask"):
                assert torch.equal(a[k], b[k]), k
            assert torch.equal(a["y"], a["index"])
            assert torch.equal(a["x"][:, 0], (a["index"] * 10).float())
            n += 1
        assert n == len(mapped) == len(plain)
        for i, m in mapped._maps.items():  # the files this rank touched
            assert isinstance(m["x"], MappedKey)
            lzf = ChunkedKey if codecs._codecs is not None else type(None)  # decoded here, or through HDF5
            assert isinstance(m["y"], lzf if i == 1 else MappedKey), (i, m["y"])
            assert m["x"].mapped == memory_map
        assert all((mf.mm is not None) == memory_map for mf in mapped._mmaps.values())
        if 0 in mapped._maps:
            assert len(mapped._maps[0]["x"].view_offset) == 2
            assert len(mapped._maps[0]["x"].views) == (2 if memory_map else 0)
        assert all(m[k] is None for m in plain._maps.values() for k in m)
        mapped.close()
        plain.close()


def test_batches_outlive_close(tmp_path):
    p = interleaved(tmp_path / "c.h5", 3000, chunk=128, slab=1000)
    ds = HDF5Dataset(p, ["x", "y"], 10, rank=0, world_size=1)
    kept = list(ds)
    ds.close()  # unmaps the file: the batches hold copies, never views of the map
    assert ds._mmaps == {}
    for b in kept:
        assert torch.equal(b["x"][:, 0], (b["index"] * 10).float())
    assert len(list(ds)) == len(ds)  # reopens and maps again


def test_copy_job_shared_by_two_threads_and_errors():
    import threading

    from hpctrain.data.mapped import CopyJob

    done = []
    job = CopyJob([lambda i=i: done.append(i) for i in range(200)])
    helper = threading.Thread(target=job.work)
    helper.start()
    job.wait()
    helper.join()
    assert sorted(done) == list(range(200))  # every task exactly once

    def boom():
        raise OSError("disk gone")

    bad = CopyJob([lambda: None, boom, lambda: None])
    with pytest.raises(OSError, match="disk gone"):
        bad.wait()
    CopyJob([]).wait()  # nothing to copy: done at once


def test_packed_joins_small_calls_into_tasks_of_about_task_bytes():
    from hpctrain.data.mapped import TASK_BYTES, packed

    done = []
    small = [(8192, lambda i=i: done.append(i)) for i in range(300)]  # a label key's chunks
    tasks = packed(small)
    per = TASK_BYTES // 8192
    assert len(tasks) == -(-300 // per)
    for task in tasks:
        task()
    assert done == list(range(300))  # each call once, in order
    done.clear()
    big = [(2 * TASK_BYTES, lambda i=i: done.append(i)) for i in range(3)]
    assert len(packed(big)) == 3  # a call of a task's size or more stays a task of its own
    assert packed([]) == []


def test_read_error_of_a_mapped_key_reaches_the_consumer(tmp_path, monkeypatch):
    import hpctrain.data.mapped as M

    p = interleaved(tmp_path / "e.h5", 3000, chunk=128, slab=1000)

    def failing(*args):
        raise OSError("injected read failure")

    monkeypatch.setattr(M, "pread_into", failing)
    ds = HDF5Dataset(p, ["x", "y"], 10, rank=0, world_size=1, shuffle="block", prefetch=1)
    with pytest.raises(CorruptFileError, match="injected") as info:
        list(ds)
    assert p in str(info.value) and "'x'" in str(info.value)


def test_copy_job_runs_phases_in_order_across_threads():
    """A later phase starts only when every task of the one before has finished, whichever
    thread ran them; a failed task skips the later phases and wait() raises it."""
    import threading
    import time

    from hpctrain.data.mapped import CopyJob

    log = []
    lock = threading.Lock()

    def task(name, delay):
        def run():
            time.sleep(delay)
            with lock:
                log.append(name)
        return run

    job = CopyJob([task("a1", 0.05), task("a2", 0.0), task("a3", 0.02)], [task("b1", 0.0), task("b2", 0.0)])
    helper = threading.Thread(target=job.work)
    helper.start()
    job.wait()
    helper.join()
    assert sorted(log[:3]) == ["a1", "a2", "a3"] and sorted(log[3:]) == ["b1", "b2"], log

    def boom():
        raise OSError("disk gone")

    ran = []
    failing = CopyJob([boom, task("a", 0.0)], [lambda: ran.append("b")])
    with pytest.raises(OSError, match="disk gone"):
        failing.wait()
    assert ran == []
    CopyJob([]).wait()  # nothing to do: returns at once
    CopyJob([], [task("only-later", 0.0)]).wait()
    assert log[-1] == "only-later"


def test_without_a_map_a_truncated_file_is_a_read_error_naming_it(tmp_path):
    """memory_map=False: no page of the file is mapped, so a file cut short while a loader
    reads it raises an error naming the file and key (a mapped page would be SIGBUS)."""
    import os

    for k, (shuffle, policy) in enumerate((("window", "contiguous"), ("block", "contiguous"), ("window", "strided"))):
        p = interleaved(tmp_path / f"t{k}.h5", 6000, chunk=128, slab=1000)
        ds = HDF5Dataset(p, ["x", "y"], 10, rank=0, world_size=2, shuffle=shuffle, policy=policy, prefetch=1,
                         memory_map=False, window_bytes=16384, block_bytes=4096)
        it = iter(ds)
        next(it)
        assert ds._mmaps and all(mf.mm is None for mf in ds._mmaps.values())
        with open(p, "r+b") as f:
            f.truncate(os.path.getsize(p) // 3)
        with pytest.raises(CorruptFileError) as info:
            for _ in it:
                pass
        assert p in str(info.value), (shuffle, policy)
        ds.close()


def test_map_dataset_without_a_map_reads_rows_with_preadv(tmp_path):
    import os

    from hpctrain.data.mapped import gather_tasks

    p = interleaved(tmp_path / "n.h5", 3000, chunk=128, slab=1000)
    mf = open_map(p, memory_map=False)
    assert mf.mm is None and len(mf) == os.path.getsize(p)
    with h5py.File(p, "r") as f:
        mk, why = map_dataset(f["x"], mf)
        assert mk is not None and not mk.mapped, why
        for r in (0, 1234, 2999):
            assert np.array_equal(mk.read_row(r), np.ascontiguousarray(f["x"][r]).view(np.uint8))
        with pytest.raises(ValueError, match="memory_map"):
            gather_tasks([mk], np.zeros(2, np.int64), np.array([0, 5]), np.empty((2, 7), np.float32))
    mf.close()
