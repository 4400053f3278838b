"""`hpctrain train` on files written by other tools: shards of a netCDF-4 file (coordinate
variables beside the sample keys) and of a NeXus-like file with nested keys and hdf5plugin
filters (bitshuffle+LZ4, Blosc, Zstd), under mpiexec -n 2."""
from pathlib import Path

import h5py
import hdf5plugin
import netCDF4
import numpy as np
import pytest

from mpirun import python_argv, run_mpi

pytestmark = pytest.mark.mpi

HPCTRAIN = python_argv("-m", "hpctrain.cli.main")
N = 400


def digits_like():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 4, N).astype(np.int64)
    x = (rng.normal(size=(N, 4, 8)) + y[:, None, None]).astype(np.float32)
    return x, y


def write_netcdf(path: Path) -> None:
    x, y = digits_like()
    with netCDF4.Dataset(path, "w") as nc:
        nc.createDimension("sample", None)
        nc.createDimension("lat", 4)
        nc.createDimension("lon", 8)
        nc.createVariable("lat", "f4", ("lat",))[:] = np.arange(4)
        nc.createVariable("lon", "f4", ("lon",))[:] = np.arange(8)
        nc.createVariable("x", "f4", ("sample", "lat", "lon"), zlib=True)[0:N] = x
        nc.createVariable("y", "i8", ("sample",))[0:N] = y


def write_nexus(path: Path) -> None:
    x, y = digits_like()
    with h5py.File(path, "w") as f:
        f.create_dataset("entry/data/data", data=x, chunks=(32, 4, 8), **hdf5plugin.Bitshuffle(cname="lz4"))
        f.create_dataset("entry/data/label", data=y, chunks=(64,), **hdf5plugin.Blosc(cname="zstd"))
        f.create_dataset("entry/data/index", data=np.arange(N), chunks=(64,), **hdf5plugin.Zstd())
        f["entry/instrument/name"] = "detector"


@pytest.mark.parametrize("kind", ["netcdf", "nexus"])
def test_train_on_foreign_shards(kind, tmp_path):
    from hpctrain.data.shard import shard

    src = tmp_path / ("d.nc" if kind == "netcdf" else "d.nxs")
    (write_netcdf if kind == "netcdf" else write_nexus)(src)
    shards = shard(str(src), 3, str(tmp_path / "sh"), quiet=True)
    keys = "{x: x, y: y}" if kind == "netcdf" else "{x: entry/data/data, y: entry/data/label}"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"""
model: {{factory: "hpctrain.train.models:mlp", kwargs: {{in_features: 32, hidden: [16], num_classes: 4}}}}
data: {{train: {[str(p) for p in shards[:2]]}, test: ["{shards[2]}"], keys: {keys}}}
optimizer: {{name: adam, lr: 0.01}}
batch_size: 16
steps: 20
run_dir: "{tmp_path / 'run'}"
quiet: true
threads: 1
""")
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg)], timeout=180)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "test accuracy:" in r.stdout
