"""pack from what people have: role-tagged .npy pairs, concatenated parts, image folders,
Parquet/Feather tables, HDF5/netCDF inputs; the roles recorded and read back."""
from __future__ import annotations

import os
import subprocess
import sys

import h5py
import numpy as np
import pytest

from hpctrain.data import roles
from hpctrain.data.errors import ConfigError, LengthMismatchError
from hpctrain.data.pack import pack
from hpctrain.data.verify import verify_paths

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RNG = np.random.default_rng(3)


def read(path):
    with h5py.File(path, "r") as f:
        return {k: f[k][()] for k in ("x", "y") if k in f}


def test_npy_pairs_with_roles_concatenated(tmp_path):
    xa, xb = RNG.normal(size=(30, 4)).astype(np.float32), RNG.normal(size=(20, 4)).astype(np.float32)
    ya, yb = np.arange(30), np.arange(20) + 100
    for name, arr in (("X_train", xa), ("X_more", xb), ("y_train", ya), ("y_more", yb)):
        np.save(tmp_path / f"{name}.npy", arr)
    out = str(tmp_path / "t.h5")
    r = pack([], out, x=[str(tmp_path / "X_train.npy"), str(tmp_path / "X_more.npy")],
             y=[str(tmp_path / "y_train.npy"), str(tmp_path / "y_more.npy")], quiet=True)
    assert r.num_samples == 50 and set(r.keys) == {"x", "y"}
    got = read(out)
    np.testing.assert_array_equal(got["x"], np.concatenate([xa, xb]))
    np.testing.assert_array_equal(got["y"], np.concatenate([ya, yb]))
    assert roles(out) == {"x": "x", "y": "y"}
    assert verify_paths([out], quiet=True)["ok"]
    with pytest.raises(LengthMismatchError, match="HINT"):
        pack([], str(tmp_path / "bad.h5"), x=[str(tmp_path / "X_train.npy")], y=[str(tmp_path / "y_more.npy")])


def test_npz_parts_concatenate_and_cli(tmp_path):
    x = RNG.normal(size=(40, 3)).astype(np.float32)
    y = RNG.integers(0, 3, 40)
    np.savez(tmp_path / "p1.npz", x=x[:25], y=y[:25])
    np.savez(tmp_path / "p2.npz", x=x[25:], y=y[25:])
    np.save(tmp_path / "X_train.npy", x)
    np.save(tmp_path / "y_train.npy", y)
    out = str(tmp_path / "c.h5")
    pack([str(tmp_path / "p1.npz"), str(tmp_path / "p2.npz")], out, quiet=True)
    np.testing.assert_array_equal(read(out)["x"], x)
    np.testing.assert_array_equal(read(out)["y"], y)
    r = subprocess.run([sys.executable, "-m", "hpctrain.cli.main", "data", "pack", "--x", "X_train.npy", "--y",
                        "y_train.npy", "--out", "cli.h5"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert roles(str(tmp_path / "cli.h5")) == {"x": "x", "y": "y"}
    np.testing.assert_array_equal(read(tmp_path / "cli.h5")["x"], x)


def test_image_folder(tmp_path):
    from PIL import Image

    images = {}
    for c in ("cat", "dog"):
        os.makedirs(tmp_path / "img" / c)
        for i in range(3):
            arr = RNG.integers(0, 255, size=(6, 5, 3), dtype=np.uint8)
            Image.fromarray(arr).save(tmp_path / "img" / c / f"{i}.png")
            images[(c, i)] = arr
    out = str(tmp_path / "img.h5")
    pack([str(tmp_path / "img")], out, quiet=True)
    got = read(out)
    assert got["x"].shape == (6, 6, 5, 3) and got["x"].dtype == np.uint8
    np.testing.assert_array_equal(got["y"], [0, 0, 0, 1, 1, 1])
    np.testing.assert_array_equal(got["x"][4], images[("dog", 1)])
    with h5py.File(out, "r") as f:
        assert f.attrs["classes"] == '["cat", "dog"]'
    assert roles(out) == {"x": "x", "y": "y"}


def test_parquet_and_feather(tmp_path):
    import pyarrow as pa
    import pyarrow.feather as feather
    import pyarrow.parquet as pq

    a, b, label = RNG.normal(size=12), RNG.normal(size=12), RNG.integers(0, 4, 12)
    table = pa.table({"a": a, "b": b, "label": label})
    pq.write_table(table, tmp_path / "t.parquet")
    feather.write_feather(table, tmp_path / "t.feather")
    for name in ("t.parquet", "t.feather"):
        out = str(tmp_path / f"{name}.h5")
        pack([str(tmp_path / name)], out, label_column="label", quiet=True)
        got = read(out)
        np.testing.assert_allclose(got["x"], np.stack([a, b], axis=1).astype(np.float32))
        np.testing.assert_array_equal(got["y"], label)
    with pytest.raises(ConfigError, match="label column 'nope'"):
        pack([str(tmp_path / "t.parquet")], str(tmp_path / "o.h5"), label_column="nope")


def test_hdf5_and_netcdf_inputs_with_keys(tmp_path):
    import netCDF4

    src = tmp_path / "scan.h5"
    x = RNG.normal(size=(15, 2, 2))
    with h5py.File(src, "w") as f:
        f["entry/data/data"] = x
        f["entry/data/label"] = np.arange(15)
        f["entry/other"] = np.zeros(15)
    out = str(tmp_path / "o.h5")
    pack([str(src)], out, keys=["entry/data/data", "entry/data/label"], quiet=True)
    with h5py.File(out, "r") as f:
        np.testing.assert_array_equal(f["entry/data/data"][()], x)
        assert "entry/other" not in f
    nc = tmp_path / "c.nc"
    with netCDF4.Dataset(nc, "w") as d:
        d.createDimension("t", None)
        d.createDimension("lat", 3)
        d.createVariable("lat", "f4", ("lat",))[:] = [1, 2, 3]
        d.createVariable("tas", "f4", ("t", "lat"))[0:7] = np.ones((7, 3))
        d.createVariable("label", "i4", ("t",))[0:7] = np.arange(7)
    out2 = str(tmp_path / "nc.h5")
    r = pack([str(nc)], out2, quiet=True)
    assert sorted(r.keys) == ["label", "tas"] and r.num_samples == 7
    r = subprocess.run([sys.executable, "-m", "hpctrain.cli.main", "data", "pack", "--x", "c.nc", "--keys", "tas",
                        "--out", "r.h5"], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    assert roles(str(tmp_path / "r.h5")) == {"x": "x"}


def test_roles_of_kept_names(tmp_path):
    src = tmp_path / "scan.h5"
    with h5py.File(src, "w") as f:
        f["entry/data/data"] = RNG.normal(size=(9, 2))
        f["entry/data/label"] = np.arange(9)
    out = str(tmp_path / "o.h5")
    pack([str(src)], out, role_keys={"x": "entry/data/data", "y": "entry/data/label"}, quiet=True)
    assert roles(out) == {"x": "entry/data/data", "y": "entry/data/label"}
    with pytest.raises(ConfigError, match=r"y='label' names no packed key; keys: entry/data/data, entry/data/label"
                                          r"\nHINT:"):
        pack([str(src)], out, role_keys={"y": "label"})
    with pytest.raises(ConfigError, match="unknown role 'z'"):
        pack([str(src)], out, role_keys={"z": "entry/data/data"})
