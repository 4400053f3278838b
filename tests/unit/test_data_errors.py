"""Every bad input gives one DataError (a ValueError) that names the file and the key."""
from __future__ import annotations

import os
import pwd
import subprocess
import sys
import tempfile

import h5py
import numpy as np
import pytest

from hpctrain.data import HDF5Dataset
from hpctrain.data import errors as E


def good(path, n=100, **extra):
    with h5py.File(path, "w") as f:
        f.create_dataset("x", data=np.zeros((n, 4), np.float32), chunks=(min(n, 10), 4) if n else None)
        f.create_dataset("y", data=np.arange(n))
        for k, v in extra.items():
            f.create_dataset(k, data=v)
    return str(path)


def load(paths, keys=("x", "y"), batch=4, world=1):
    return HDF5Dataset(paths, list(keys), batch, rank=0, world_size=world)


def check(exc_info, kind, path, key=None, words=()):
    err = exc_info.value
    assert isinstance(err, kind) and isinstance(err, E.DataError) and isinstance(err, ValueError)
    text = str(err)
    assert str(path) in text, text
    if key is not None:
        assert f"key {key!r}" in text, text
    for w in words:
        assert w in text, text


def test_missing_file(tmp_path):
    with pytest.raises(E.MissingFileError) as info:
        load(str(tmp_path / "nope.h5"))
    check(info, E.MissingFileError, tmp_path / "nope.h5", words=["no such file", "HINT:"])


def test_not_hdf5(tmp_path):
    p = tmp_path / "text.h5"
    p.write_text("hello, not HDF5\n" * 100)
    with pytest.raises(E.NotHDF5Error) as info:
        load(str(p))
    check(info, E.NotHDF5Error, p, words=["not an HDF5 file"])


def test_truncated(tmp_path):
    p = good(tmp_path / "t.h5", n=5000)
    size = os.path.getsize(p)
    with open(p, "r+b") as fh:
        fh.truncate(size // 2)
    with pytest.raises(E.CorruptFileError) as info:
        load(p)
    check(info, E.CorruptFileError, p, words=["truncated or damaged"])


def test_damaged_chunk_found_when_read(tmp_path):
    p = tmp_path / "c.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.ones((100, 4), np.float32), chunks=(10, 4), compression="lzf")
        f.create_dataset("y", data=np.arange(100))
        info = f["x"].id.get_chunk_info(3)
    with open(p, "r+b") as fh:
        fh.seek(info.byte_offset)
        fh.write(b"\xff" * info.size)
    ds = load(str(p))
    with pytest.raises(E.CorruptFileError) as exc:
        list(ds)
    check(exc, E.CorruptFileError, p, key="x", words=["reading failed"])


def test_missing_key(tmp_path):
    p = good(tmp_path / "k.h5")
    with pytest.raises(E.MissingKeyError) as info:
        load(p, keys=("x", "labels"))
    check(info, E.MissingKeyError, p, key="labels", words=["datasets in the file: x, y"])


def test_group_is_not_a_key(tmp_path):
    p = good(tmp_path / "g.h5")
    with h5py.File(p, "a") as f:
        f.create_group("grp")
    with pytest.raises(E.MissingKeyError) as info:
        load(p, keys=("x", "grp"))
    check(info, E.MissingKeyError, p, key="grp", words=["is a group"])


def test_keys_of_different_lengths(tmp_path):
    p = tmp_path / "l.h5"
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=np.zeros((100, 4), np.float32))
        f.create_dataset("y", data=np.arange(99))
    with pytest.raises(E.LengthMismatchError) as info:
        load(str(p))
    check(info, E.LengthMismatchError, p, key="x", words=["'x': 100", "'y': 99"])


def test_files_with_different_sample_shapes(tmp_path):
    a = good(tmp_path / "a.h5")
    b = tmp_path / "b.h5"
    with h5py.File(b, "w") as f:
        f.create_dataset("x", data=np.zeros((100, 5), np.float32))
        f.create_dataset("y", data=np.arange(100))
    with pytest.raises(E.LengthMismatchError) as info:
        load([a, str(b)])
    check(info, E.LengthMismatchError, b, key="x", words=["(5,)", "(4,)"])


def test_zero_samples(tmp_path):
    p = good(tmp_path / "z.h5", n=0)
    with pytest.raises(E.EmptyDataError) as info:
        load(p)
    check(info, E.EmptyDataError, p, key="x", words=["zero samples"])


def test_fewer_samples_than_ranks_times_batch(tmp_path):
    p = good(tmp_path / "f.h5", n=30)
    with pytest.raises(E.TooFewSamplesError) as info:
        load(p, batch=8, world=4)
    check(info, E.TooFewSamplesError, p, key="x", words=["30 samples are fewer than 4 ranks x batch size 8 = 32",
                                                         "HINT: use batch_size <= 7"])


def test_non_numeric_dtype(tmp_path):
    p = good(tmp_path / "s.h5", names=np.array([b"a"] * 100))
    with pytest.raises(E.DtypeError) as info:
        load(p, keys=("x", "names"))
    check(info, E.DtypeError, p, key="names", words=["not numeric"])


def test_unreadable_permissions(tmp_path):
    """As root every file is readable, so the check runs as the user 'nobody' in a subprocess."""
    if os.geteuid() != 0:
        p = good(tmp_path / "p.h5")
        os.chmod(p, 0)
        with pytest.raises(E.PermissionDeniedError) as info:
            load(p)
        check(info, E.PermissionDeniedError, p, words=["permission denied"])
        return
    nobody = pwd.getpwnam("nobody")
    d = tempfile.mkdtemp(prefix="hpctrain-perm-", dir="/tmp")
    try:
        os.chmod(d, 0o755)  # nobody may look into the directory, but not read the file
        p = good(os.path.join(d, "secret.h5"))
        os.chmod(p, 0o600)
        code = (
            "import os, sys\n"
            "from hpctrain.data import HDF5Dataset, PermissionDeniedError\n"
            "import hpctrain.data.loader\n"
            # Drop root only now: nobody may not read this venv's base Python installation.
            f"os.setgid({nobody.pw_gid}); os.setuid({nobody.pw_uid})\n"
            "try:\n"
            "    HDF5Dataset(sys.argv[1], ['x', 'y'], 4, rank=0, world_size=1)\n"
            "except PermissionDeniedError as e:\n"
            "    print('CAUGHT', e); sys.exit(0)\n"
            "sys.exit(3)\n"
        )
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", HOME="/tmp")
        out = subprocess.run([sys.executable, "-c", code, p], capture_output=True, text=True, timeout=120,
                             env=env, cwd="/tmp")
        assert out.returncode == 0, out.stdout + out.stderr
        assert "CAUGHT" in out.stdout and p in out.stdout and "permission denied" in out.stdout
    finally:
        for name in os.listdir(d):
            os.unlink(os.path.join(d, name))
        os.rmdir(d)


def test_directory_without_files_and_empty_glob(tmp_path):
    with pytest.raises(E.DataError, match="holds no HDF5 files"):
        load(str(tmp_path))
    with pytest.raises(E.DataError, match="matches no file"):
        load(str(tmp_path / "*.h5"))


def test_bad_config():
    with pytest.raises(E.ConfigError, match="keys is empty"):
        HDF5Dataset("x.h5", [], 4, rank=0, world_size=1)
    with pytest.raises(E.ConfigError, match="unknown policy"):
        HDF5Dataset("x.h5", ["x"], 4, rank=0, world_size=1, policy="random")
