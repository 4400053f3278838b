"""HDF5 written by other tools, read as it is: netCDF-4 (netCDF4-python, xarray), PyTables
with Blosc, hdf5plugin filters, NeXus-like nested groups, virtual datasets and external
links. Each file is inspected, verified, sharded, merged and loaded; every result is checked
against the arrays written."""
from __future__ import annotations

import os
import subprocess
import sys

import h5py
import hdf5plugin
import numpy as np
import pytest

from hpctrain.data.h5files import expand_paths, layout_of
from hpctrain.data.loader import HDF5Dataset
from hpctrain.data.shard import merge, shard
from hpctrain.data.verify import inspect_paths, render_inspect, render_verify, verify_paths

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
N = 503
RNG = np.random.default_rng(7)
X = RNG.normal(size=(N, 4, 8)).astype(np.float32)
Y = RNG.integers(0, 5, size=N).astype(np.int64)
IDS = np.arange(N, dtype=np.int32) * 3


def load_all(paths, keys, **kw):
    """Every sample the loader yields in one epoch (one rank, in file order), by key."""
    ds = HDF5Dataset(paths, keys, 64, rank=0, world_size=1, shuffle=False, seed=0, **kw)
    out = {k: [] for k in keys}
    for batch in ds:
        real = batch["mask"].numpy().astype(bool)
        for k in keys:
            out[k].append(batch[k].numpy()[real])
    return {k: np.concatenate(v) for k, v in out.items()}


def check_round_trip(path, keys, expected, tmp_path, num_shards=3):
    """inspect, verify, shard, verify the shards, load them, merge them back: all equal."""
    report = inspect_paths([path])
    entry = report["files"][0]
    assert "error" not in entry, entry.get("error")
    assert sorted(entry["sample_keys"]) == sorted(keys) and entry["num_samples"] == N
    assert verify_paths([path], quiet=True)["ok"]
    out = tmp_path / f"shards-{os.path.basename(path)}"
    written = shard(path, num_shards, str(out), quiet=True)
    assert len(written) == num_shards
    checked = verify_paths(written, quiet=True)
    assert checked["ok"], render_verify(checked)
    got = load_all(written, list(keys))
    for k in keys:
        np.testing.assert_array_equal(got[k], expected[k])
    merged = merge(written, str(tmp_path / f"merged-{os.path.basename(path)}"), quiet=True)
    with h5py.File(merged, "r") as f:
        for k in keys:
            np.testing.assert_array_equal(f[k][()], expected[k])
    return entry


def write_netcdf(path):
    import netCDF4

    with netCDF4.Dataset(path, "w") as nc:
        nc.createDimension("sample", None)  # unlimited: HDF5 resizable, chunked
        nc.createDimension("lat", 4)
        nc.createDimension("lon", 8)
        lat = nc.createVariable("lat", "f4", ("lat",))
        lon = nc.createVariable("lon", "f4", ("lon",))
        lat[:] = np.linspace(-30, 30, 4)
        lon[:] = np.linspace(0, 350, 8)
        x = nc.createVariable("x", "f4", ("sample", "lat", "lon"), zlib=True)
        y = nc.createVariable("y", "i8", ("sample",))
        ids = nc.createVariable("id", "i4", ("sample",))
        x[0:N] = X
        y[0:N] = Y
        ids[0:N] = IDS
        x.units = "K"


def test_netcdf4_coordinates_are_not_sample_keys(tmp_path):
    path = str(tmp_path / "climate.nc")
    write_netcdf(path)
    entry = check_round_trip(path, ["id", "x", "y"], {"x": X, "y": Y, "id": IDS}, tmp_path)
    roles = {k: d["role"] for k, d in entry["datasets"].items()}
    assert roles == {"id": "sample", "x": "sample", "y": "sample", "lat": "coordinate", "lon": "coordinate",
                     "sample": "coordinate"}
    text = render_inspect(inspect_paths([path]))
    assert "samples: 503" in text and "coordinate" in text and "ERROR" not in text
    named = inspect_paths([path], keys=["x"])["files"][0]
    assert named["sample_keys"] == ["x"] and named["num_samples"] == N and named["datasets"]["y"]["role"] == "metadata"
    assert "no such dataset" in inspect_paths([path], keys=["nope"])["files"][0]["error"]
    # A directory of netCDF files is a list of inputs.
    found = [os.path.basename(p) for p in expand_paths(str(tmp_path))]
    assert found == ["climate.nc", "merged-climate.nc"]  # not the directory shards-climate.nc
    # The shards keep the coordinate variables whole (dimension bookkeeping references are
    # not copied: they would point into the parent).
    with h5py.File(tmp_path / "shards-climate.nc" / "climate-00001-of-00003.h5", "r") as f:
        np.testing.assert_array_equal(f["lat"][()], np.linspace(-30, 30, 4).astype(np.float32))
        assert f["x"].attrs["units"] in (b"K", "K")


def test_xarray_netcdf(tmp_path):
    import xarray as xr

    path = str(tmp_path / "xr.nc")
    ds = xr.Dataset({"x": (("sample", "lat", "lon"), X), "y": (("sample",), Y)},
                    coords={"lat": np.linspace(-30, 30, 4), "lon": np.linspace(0, 350, 8),
                            "station": (("lat",), np.arange(4))})
    ds.to_netcdf(path, engine="netcdf4")
    entry = check_round_trip(path, ["x", "y"], {"x": X, "y": Y}, tmp_path)
    assert entry["datasets"]["station"]["role"] == "metadata"


def test_pytables_blosc_lz4(tmp_path):
    import tables

    path = str(tmp_path / "pt.h5")
    filters = tables.Filters(complib="blosc:lz4", complevel=5, shuffle=True)
    with tables.open_file(path, "w") as f:
        f.create_carray("/", "x", obj=X, filters=filters, chunkshape=(50, 4, 8))
        f.create_carray("/", "y", obj=Y, filters=filters, chunkshape=(100,))
        f.create_array("/", "classes", obj=np.arange(5, dtype=np.int16))
    entry = check_round_trip(path, ["x", "y"], {"x": X, "y": Y}, tmp_path)
    assert entry["datasets"]["x"]["filters"][0].startswith("blosc (32001)")
    assert "blosc" in render_inspect(inspect_paths([path]))
    assert entry["datasets"]["classes"]["role"] == "metadata"


def write_nexus(path, n=N):
    with h5py.File(path, "w") as f:
        entry = f.create_group("entry")
        entry.attrs["NX_class"] = "NXentry"
        data = entry.create_group("data")
        data.create_dataset("data", data=X[:n], chunks=(16, 4, 8), maxshape=(None, 4, 8),
                            **hdf5plugin.Bitshuffle(cname="lz4"))
        data.create_dataset("label", data=Y[:n], chunks=(64,), **hdf5plugin.Blosc(cname="zstd"))
        data.create_dataset("index", data=IDS[:n], chunks=(64,), **hdf5plugin.Zstd())
        entry.create_dataset("instrument/name", data="detector 1")
        entry.create_dataset("instrument/pixel_size", data=np.float64(75e-6))


NEXUS_KEYS = ["entry/data/data", "entry/data/index", "entry/data/label"]


def test_nexus_nested_groups_with_plugin_filters(tmp_path):
    path = str(tmp_path / "scan.nxs")
    write_nexus(path)
    expected = {"entry/data/data": X, "entry/data/label": Y, "entry/data/index": IDS}
    entry = check_round_trip(path, NEXUS_KEYS, expected, tmp_path)
    assert entry["datasets"]["entry/instrument/name"]["role"] == "metadata"
    filters = {k: entry["datasets"][k]["filters"][0].split(" ")[0] for k in NEXUS_KEYS}
    assert filters == {"entry/data/data": "bitshuffle", "entry/data/label": "blosc", "entry/data/index": "zstd"}
    # The shards keep the nested layout and the metadata.
    with h5py.File(tmp_path / "shards-scan.nxs" / "scan-00000-of-00003.h5", "r") as f:
        assert f["entry/instrument/name"][()] == b"detector 1"
        assert f["entry/data/data"].shape == (168, 4, 8)


def test_nexus_soft_linked_key(tmp_path):
    """NeXus links NXdata's signal to the detector's data: the link's name is a key; its
    target is not copied whole into every shard beside it."""
    path = str(tmp_path / "linked.nxs")
    with h5py.File(path, "w") as f:
        f.create_dataset("entry/instrument/detector/data", data=X, chunks=(16, 4, 8), **hdf5plugin.Zstd())
        f["entry/data/data"] = h5py.SoftLink("/entry/instrument/detector/data")
        f["entry/data/y"] = Y
    keys = ["entry/data/data", "entry/data/y"]
    assert verify_paths([path], keys=keys, quiet=True)["ok"]
    written = shard(path, 2, str(tmp_path / "sh"), keys=keys, quiet=True)
    with h5py.File(written[1], "r") as f:
        assert "entry/instrument/detector/data" not in f
        np.testing.assert_array_equal(f["entry/data/data"][()], X[252:])
    got = load_all(written, keys)
    np.testing.assert_array_equal(got["entry/data/data"], X)
    np.testing.assert_array_equal(got["entry/data/y"], Y)


def test_virtual_dataset_and_external_links(tmp_path):
    parts = [(0, 200), (200, 350), (350, N)]
    layout_x = h5py.VirtualLayout(shape=(N, 4, 8), dtype=np.float32)
    layout_y = h5py.VirtualLayout(shape=(N,), dtype=np.int64)
    for i, (lo, hi) in enumerate(parts):
        name = str(tmp_path / f"part{i}.h5")
        with h5py.File(name, "w") as f:
            f["x"] = X[lo:hi]
            f["y"] = Y[lo:hi]
        layout_x[lo:hi] = h5py.VirtualSource(name, "x", shape=(hi - lo, 4, 8))
        layout_y[lo:hi] = h5py.VirtualSource(name, "y", shape=(hi - lo,))
    vds = str(tmp_path / "all.h5")
    with h5py.File(vds, "w") as f:
        f.create_virtual_dataset("x", layout_x)
        f.create_virtual_dataset("y", layout_y)
    entry = check_round_trip(vds, ["x", "y"], {"x": X, "y": Y}, tmp_path)
    assert entry["datasets"]["x"]["virtual"] and "virtual" in render_inspect(inspect_paths([vds]))

    # External links: the datasets live in other files; the loader must read them there,
    # not at their offsets in the linking file.
    linked = str(tmp_path / "linked.h5")
    with h5py.File(linked, "w") as f:
        f["pad"] = np.ones(1 << 20, np.uint8)  # bigger than the linked file: its offsets fall in here
        f["data/x"] = h5py.ExternalLink(str(tmp_path / "part0.h5"), "x")
        f["data/y"] = h5py.ExternalLink(str(tmp_path / "part0.h5"), "y")
    with h5py.File(linked, "r") as f:
        assert layout_of(f).sample_keys == ["data/x", "data/y"]
    got = load_all([linked], ["data/x", "data/y"])
    np.testing.assert_array_equal(got["data/x"], X[:200])
    np.testing.assert_array_equal(got["data/y"], Y[:200])


def test_length_tie_is_reported_not_guessed(tmp_path):
    path = str(tmp_path / "tie.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.zeros((10, 2))
        f["y"] = np.zeros(9)
    entry = inspect_paths([path])["files"][0]
    assert "different numbers of samples" in entry["error"] and "HINT" in entry["error"]


MISSING_PLUGIN = r"""
import sys
sys.modules["hdf5plugin"] = None  # as if hdf5plugin were not installed
import json
from hpctrain.data.verify import inspect_paths, render_inspect, verify_paths
from hpctrain.data.shard import shard
from hpctrain.data.errors import FilterUnavailableError
path, out = sys.argv[1], sys.argv[2]
print(render_inspect(inspect_paths([path])))
print(json.dumps(verify_paths([path], quiet=True)["files"][0]["problems"]))
try:
    shard(path, 2, out, quiet=True)
except FilterUnavailableError as exc:
    print("SHARD:", exc)
"""


def test_missing_filter_plugin_is_named_not_called_damage(tmp_path):
    path = str(tmp_path / "scan.nxs")
    write_nexus(path)
    env = dict(os.environ, PYTHONPATH=ROOT, HDF5_PLUGIN_PATH=str(tmp_path / "no-plugins"))
    r = subprocess.run([sys.executable, "-c", MISSING_PLUGIN, path, str(tmp_path / "sh")], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "filter 32008 (bitshuffle) not available" in r.stdout
    assert "HINT: pip install hdf5plugin" in r.stdout
    assert "damaged" not in r.stdout and "re-create" not in r.stdout
    assert "SHARD:" in r.stdout and "not available" in r.stdout.split("SHARD:")[1]
