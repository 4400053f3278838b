"""`hpctrain train` on a file made by `hpctrain data pack` with the keys' roles recorded: the
config names no data.keys; with data.policy: stratified every rank sees every class in the
same proportion, and a label key that holds no classes is one error with a HINT."""
import json
import subprocess
from pathlib import Path

import h5py
import hdf5plugin
import numpy as np
import pytest
import yaml

from mpirun import ROOT, mpi_env, python_argv, run_mpi

pytestmark = pytest.mark.mpi

HPCTRAIN = python_argv("-m", "hpctrain.cli.main")
N = 420


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    """A NeXus-like detector file packed with its nested keys kept and their roles recorded."""
    base = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    y = np.sort(rng.choice(4, N, p=[0.55, 0.25, 0.15, 0.05]))  # written class by class
    x = (rng.normal(size=(N, 4, 8)) + y[:, None, None]).astype(np.float32)
    with h5py.File(base / "scan.nxs", "w") as f:
        f.create_dataset("entry/data/data", data=x, chunks=(32, 4, 8), **hdf5plugin.Bitshuffle(cname="lz4"))
        f.create_dataset("entry/data/label", data=y, chunks=(64,), **hdf5plugin.Zstd())
        f.create_dataset("entry/data/dose", data=rng.normal(size=N), chunks=(64,))
    r = subprocess.run([*HPCTRAIN, "data", "pack", "scan.nxs", "--keys",
                        "entry/data/data,entry/data/label,entry/data/dose",
                        "--roles", "x=entry/data/data,y=entry/data/label", "--out", "packed.h5", "-q"],
                       cwd=base, capture_output=True, text=True, timeout=120, env=mpi_env())
    assert r.returncode == 0, r.stderr
    return base, y


def write_config(path: Path, train: Path, run_dir: Path, extra: str = "") -> Path:
    path.write_text(f"""
model: {{factory: "hpctrain.train.models:mlp", kwargs: {{in_features: 32, hidden: [16], num_classes: 4}}}}
data: {{train: ["{train}"], policy: stratified{extra}}}
optimizer: {{name: adam, lr: 0.01}}
batch_size: 16
epochs: 2
run_dir: "{run_dir}"
quiet: true
threads: 1
""")
    return path


def test_train_on_packed_file_without_keys_stratified(packed, tmp_path):
    base, y = packed
    cfg = write_config(tmp_path / "c.yaml", base / "packed.h5", tmp_path / "run")
    r = run_mpi(2, [*HPCTRAIN, "train", str(cfg)], timeout=180)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "final training loss:" in r.stdout
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["data"]["keys"] == {"x": "entry/data/data", "y": "entry/data/label"}
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["policy"] == "stratified"


def test_stratify_by_a_key_without_classes_is_one_error(packed, tmp_path):
    base, _ = packed
    cfg = write_config(tmp_path / "c.yaml", base / "packed.h5", tmp_path / "run", ", stratify: entry/data/dose")
    r = subprocess.run([*HPCTRAIN, "train", str(cfg)], capture_output=True, text=True, timeout=120,
                       env=mpi_env(), cwd=str(ROOT))
    assert r.returncode == 2, (r.stdout[-2000:], r.stderr[-3000:])
    assert "[key 'entry/data/dose']: labels are not whole numbers" in r.stderr, r.stderr[-3000:]
    assert "\nHINT: stratify by an integer class label" in r.stderr and "Traceback" not in r.stderr
