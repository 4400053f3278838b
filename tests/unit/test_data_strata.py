"""Stratified shard plans: every row once, per-class counts and shard sizes within one."""
from __future__ import annotations

import h5py
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hpctrain.data.errors import ConfigError, DataError
from hpctrain.data.shard import merge, shard
from hpctrain.data.strata import class_counts, runs_of, stratified_split
from hpctrain.data.verify import verify_paths


@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 60), min_size=1, max_size=8), shards=st.integers(1, 12),
       seed=st.integers(0, 2**16))
def test_stratified_split_balances_classes_and_sizes(counts, shards, seed):
    labels = np.repeat(np.arange(len(counts)), counts)
    np.random.default_rng(seed).shuffle(labels)
    parts = stratified_split(labels, shards)
    assert len(parts) == shards
    together = np.sort(np.concatenate(parts))
    np.testing.assert_array_equal(together, np.arange(len(labels)))
    for p in parts:
        assert np.all(np.diff(p) > 0)
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    per_class = np.stack([class_counts(labels, p, range(len(counts))) for p in parts])
    assert np.all(per_class.max(axis=0) - per_class.min(axis=0) <= 1)
    assert np.array_equal(per_class.sum(axis=0), counts)


@given(rows=st.lists(st.integers(0, 200), unique=True).map(sorted))
def test_runs_cover_exactly_the_rows(rows):
    rows = np.array(rows, np.int64)
    runs = runs_of(rows)
    got = np.concatenate([np.arange(a, b) for a, b in runs]) if runs else np.array([], np.int64)
    np.testing.assert_array_equal(got, rows)
    assert all(runs[i][1] < runs[i + 1][0] for i in range(len(runs) - 1))


def test_split_rejects_bad_arguments():
    with pytest.raises(ValueError):
        stratified_split(np.zeros((3, 2)), 2)
    with pytest.raises(ValueError):
        stratified_split(np.zeros(3), 0)


def test_shard_stratify_writes_equal_class_proportions(tmp_path):
    rng = np.random.default_rng(0)
    y = np.repeat(np.arange(3), [700, 200, 100])
    rng.shuffle(y)
    x = rng.normal(size=(1000, 3)).astype(np.float32)
    src = tmp_path / "d.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("x", data=x, chunks=(64, 3))
        f.create_dataset("y", data=y)
    written = shard(str(src), 4, str(tmp_path / "sh"), stratify="y", quiet=True)
    seen = []
    for p in written:
        with h5py.File(p, "r") as f:
            counts = np.bincount(f["y"][()], minlength=3)
            assert counts.tolist() == [175, 50, 25]
            assert f.attrs["stratified_by"] == "y"
            rows = [int(np.flatnonzero((x == r).all(axis=1))[0]) for r in f["x"][()]]
            assert rows == sorted(rows)  # parent order kept within a shard
            np.testing.assert_array_equal(f["y"][()], y[rows])
            seen += rows
    assert sorted(seen) == list(range(1000))
    report = verify_paths(written, quiet=True)
    assert report["ok"], report
    with pytest.raises(DataError, match="stratified shard"):
        merge(written, str(tmp_path / "m.h5"))
    with pytest.raises(ConfigError, match="--stratify 'x'"):
        shard(str(src), 4, str(tmp_path / "sh2"), stratify="x", quiet=True)


def test_cli_shard_stratify(tmp_path):
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    y = np.repeat(np.arange(2), [90, 10])
    with h5py.File(tmp_path / "d.h5", "w") as f:
        f["x"] = np.arange(100.0)
        f["y"] = y
    r = subprocess.run([sys.executable, "-m", "hpctrain.cli.main", "data", "shard", "d.h5", "-n", "5", "--out", "sh",
                        "--stratify", "y"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=root))
    assert r.returncode == 0, r.stderr
    for i in range(5):
        with h5py.File(tmp_path / "sh" / f"d-{i:05d}-of-00005.h5", "r") as f:
            assert np.bincount(f["y"][()]).tolist() == [18, 2]


def test_class_codes_of_labels():
    from hpctrain.data.errors import DtypeError
    from hpctrain.data.strata import class_codes

    codes = class_codes(np.array([[7], [-1], [7], [3]]))
    assert codes.dtype == np.int16 and codes.tolist() == [2, 0, 2, 1]
    assert class_codes(np.array([1.0, 0.0, 1.0])).tolist() == [1, 0, 1]
    assert class_codes(np.array([True, False])).tolist() == [1, 0]
    with pytest.raises(DtypeError, match=r"shape \(3, 2\) are not one class per sample.*\nHINT:"):
        class_codes(np.zeros((3, 2)))
    with pytest.raises(DtypeError, match=r"not whole numbers \(1 of 2, e.g. nan at sample 1\)"):
        class_codes(np.array([1.0, np.nan]), "y")
    with pytest.raises(DtypeError, match="dtype complex128 are not integer classes"):
        class_codes(np.array([1j]))
