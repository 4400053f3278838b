"""`hpctrain data ...`, the data_tools scripts and `hpctrain bench data`, run as users run them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mpirun import ROOT, run_mpi

pytestmark = pytest.mark.mpi

HPCTRAIN = [sys.executable, "-m", "hpctrain.cli.main"]


def run(argv, cwd, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)


def test_pack_shard_inspect_verify_merge(tmp_path):
    r = run(HPCTRAIN + ["data", "pack", "digits", "--out", "d.h5", "--compression", "gzip", "--shuffle",
                        "--fletcher32", "--chunk-rows", "100"], tmp_path)
    assert r.returncode == 0, r.stderr
    assert "1797 samples" in r.stdout
    assert r.stderr == ""  # no progress bar when stderr is not a terminal

    # The scripts: inspect.py must not shadow the standard library's inspect module.
    r = run([sys.executable, str(ROOT / "data_tools" / "shard.py"), "d.h5", "--num-shards", "4", "--out", "sh"],
            tmp_path)
    assert r.returncode == 0, r.stderr
    r = run([sys.executable, str(ROOT / "data_tools" / "inspect.py"), "sh", "--json"], tmp_path)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["num_samples"] == 1797 and report["num_files"] == 4
    assert [f["num_samples"] for f in report["files"]] == [450, 449, 449, 449]
    assert report["files"][0]["datasets"]["x"]["compression"] == "gzip"

    r = run([sys.executable, str(ROOT / "data_tools" / "verify.py"), "sh", "d.h5"], tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "all files OK" in r.stdout

    r = run([sys.executable, str(ROOT / "data_tools" / "merge.py"), "sh", "--out", "m.h5"], tmp_path)
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "d.h5") as a, h5py.File(tmp_path / "m.h5") as b:
        for k in ("x", "y"):
            assert a[k][()].tobytes() == b[k][()].tobytes() and a[k].chunks == b[k].chunks
        assert dict(a.attrs) == dict(b.attrs)

    # verify exits non-zero on a problem (a changed value under an intact chunk checksum).
    with h5py.File(tmp_path / "m.h5", "r+") as f:
        f["x"][3, 3] = np.nan
    r = run([sys.executable, str(ROOT / "data_tools" / "verify.py"), "m.h5", "--json"], tmp_path)
    assert r.returncode == 1
    problems = json.loads(r.stdout)["files"][0]["problems"]
    assert any("checksum mismatch" in p for p in problems) and any("1 NaN" in p for p in problems)


def test_bad_input_is_one_clear_error(tmp_path):
    (tmp_path / "notes.h5").write_text("not hdf5")
    r = run([sys.executable, str(ROOT / "data_tools" / "shard.py"), "notes.h5", "-n", "2", "-o", "out"], tmp_path)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr
    assert "notes.h5: not an HDF5 file" in r.stderr and "HINT:" in r.stderr
    assert not (tmp_path / "out").exists() or os.listdir(tmp_path / "out") == []
    r = run(HPCTRAIN + ["data", "pack", "missing.npy", "--out", "o.h5"], tmp_path)
    assert r.returncode == 2 and "missing.npy: no such file" in r.stderr
    assert not (tmp_path / "o.h5").exists()
    r = run(HPCTRAIN + ["data", "inspect", "missing.h5"], tmp_path)
    assert r.returncode == 1 and "no such file" in r.stdout
    r = run(HPCTRAIN + ["data", "--help"], tmp_path)
    assert r.returncode == 0 and "hpctrain data shard train.h5 --num-shards 8" in r.stdout


def test_shard_under_mpiexec(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(1000, dtype=np.float32).reshape(100, 10))
    r = run(HPCTRAIN + ["data", "pack", "x.npy", "--out", "p.h5"], tmp_path)
    assert r.returncode == 0, r.stderr
    res = run_mpi(2, HPCTRAIN + ["data", "shard", str(tmp_path / "p.h5"), "-n", "5", "-o", str(tmp_path / "s")],
                  timeout=240)
    assert res.returncode == 0, res.stdout
    assert "wrote 5 shards" in res.stdout and "(2 ranks)" in res.stdout
    assert sorted(os.listdir(tmp_path / "s")) == [f"p-{i:05d}-of-00005.h5" for i in range(5)]


def test_bench_data_runs(tmp_path):
    out = tmp_path / "bench.json"
    r = run(HPCTRAIN + ["bench", "data", "--size", "8MiB", "--repeats", "1", "--naive-seconds", "0.2",
                        "--dir", str(tmp_path), "--features", "64", "--chunk-rows", "256", "--batch-size", "128",
                        "--json", str(out)], tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "| none | loader, shuffle=window |" in r.stdout and "| lzf | naive dset[i] |" in r.stdout
    records = json.loads(out.read_text())["records"]
    assert {(x["compression"], x["method"]) for x in records} == {
        (c, m) for c in ("none", "lzf")
        for m in ("raw 64 MiB slabs", "loader, shuffle=window", "loader, shuffle=block", "naive dset[i]",
                  "loader, shuffle=window, memory_map=False", "loader, shuffle=window, through_hdf5")
    }
    assert all(x["samples_per_s"] > 0 and x["cpu_s_per_GB"] > 0 for x in records)
    assert "| CPU s/GB |" in r.stdout
    loaders = [x for x in records if x["method"].startswith("loader")]
    assert all(x["first_epoch_s"] > 0 and x["epoch_s"] > 0 for x in loaders)  # a loader's first epoch, apart
    assert all(x["first_epoch_s"] is None for x in records if not x["method"].startswith("loader"))
    assert "none, loader, shuffle=window: first epoch of a new loader" in r.stdout
    # A second run reuses the generated files.
    files = sorted(p.name for p in Path(tmp_path).glob("bench-*.h5"))
    assert len(files) == 2


def test_bench_data_plugin_filters_and_pack(tmp_path):
    out = tmp_path / "bench.json"
    r = run(HPCTRAIN + ["bench", "data", "--size", "2MiB", "--compressions", "bitshuffle-lz4", "--pack-bytes",
                        "1MiB", "--repeats", "1", "--naive-seconds", "0.1", "--dir", str(tmp_path), "--features",
                        "64", "--chunk-rows", "256", "--batch-size", "64", "--json", str(out)], tmp_path, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "bitshuffle-lz4, loader, shuffle=window: at " in r.stdout and "of raw slabs" in r.stdout
    assert "pack: 1 MiB of .npy inputs" in r.stdout and " MB/s" in r.stdout
    data = json.loads(out.read_text())
    assert {x["compression"] for x in data["records"]} == {"bitshuffle-lz4"}
    assert data["pack"]["MB_per_s"] > 0 and data["pack"]["input_bytes"] > (1 << 20) - (64 * 4 + 8)
    with h5py.File(next(Path(tmp_path).glob("bench-*-bitshuffle-lz4.h5"))) as f:
        assert f["x"].id.get_create_plist().get_filter(0)[0] == 32008
    assert not list(Path(tmp_path).glob("pack-*"))  # the pack inputs and output are removed
    r = run(HPCTRAIN + ["bench", "data", "--compressions", "snappy"], tmp_path)
    assert r.returncode == 2 and "unknown compression 'snappy'" in r.stderr


def test_progress_bar_only_on_a_terminal(tmp_path):
    import fcntl
    import pty
    import select
    import struct
    import termios

    np.save(tmp_path / "x.npy", np.zeros((1000, 100), np.float32))
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a 100-column terminal
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = HPCTRAIN + ["data", "pack", "x.npy", "--out", "p.h5"]
    proc = subprocess.run(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=slave, timeout=300, env=env)
    seen = b""
    while select.select([master], [], [], 0.5)[0]:  # the slave stays open: buffered output stays readable
        seen += os.read(master, 65536)
    os.close(slave)
    os.close(master)
    assert proc.returncode == 0
    assert b"pack p.h5" in seen  # tqdm drew a bar on the terminal
    r = run(argv + ["--quiet"], tmp_path)
    assert r.returncode == 0 and r.stderr == ""


def test_shards_of_two_parents_are_named_by_verify_and_refused_by_merge(tmp_path):
    """A shard set mixed from two parents of different sizes: verify fails naming each
    parent and its files, merge refuses with one error line and a HINT (no traceback);
    the shards of one parent still verify and merge back bit-identical."""
    rng = np.random.default_rng(1)
    for name, rows in (("a", 400), ("b", 150)):
        (tmp_path / name).mkdir()
        np.save(tmp_path / name / "x.npy", rng.normal(size=(rows, 10)).astype(np.float32))
        r = run(HPCTRAIN + ["data", "pack", f"{name}/x.npy", "--out", f"{name}.h5", "--chunk-rows", "300"], tmp_path)
        assert r.returncode == 0, r.stderr
        r = run(HPCTRAIN + ["data", "shard", f"{name}.h5", "-n", "2", "-o", f"sh_{name}"], tmp_path)
        assert r.returncode == 0, r.stderr
    (tmp_path / "mixed").mkdir()
    for src in ("sh_a/a-00000-of-00002.h5", "sh_b/b-00001-of-00002.h5"):
        os.link(tmp_path / src, tmp_path / "mixed" / Path(src).name)

    r = run(HPCTRAIN + ["data", "verify", "mixed"], tmp_path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "all files OK" not in r.stdout and "verification FAILED" in r.stdout
    line = next(x for x in r.stdout.splitlines() if "different parent files" in x)
    assert "'a.h5'" in line and "400 samples): a-00000-of-00002.h5" in line
    assert "'b.h5'" in line and "150 samples): b-00001-of-00002.h5" in line

    r = run([sys.executable, str(ROOT / "data_tools" / "merge.py"), "mixed", "--out", "m.h5"], tmp_path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[1].startswith("HINT: ") and "hpctrain data verify" in lines[1]
    assert "come from 2 different parent files" in lines[0] and "'a.h5'" in lines[0] and "'b.h5'" in lines[0]
    assert not (tmp_path / "m.h5").exists()

    r = run(HPCTRAIN + ["data", "verify", "sh_a"], tmp_path)
    assert r.returncode == 0 and "all files OK" in r.stdout, r.stdout
    assert "shard 1 of 2 of 'a.h5'" in r.stdout and "source not recorded" not in r.stdout
    r = run(HPCTRAIN + ["data", "merge", "sh_a", "--out", "m.h5"], tmp_path)
    assert r.returncode == 0, r.stderr
    with h5py.File(tmp_path / "a.h5") as a, h5py.File(tmp_path / "m.h5") as b:
        assert a["x"][()].tobytes() == b["x"][()].tobytes() and a["x"].chunks == b["x"].chunks
        assert dict(a.attrs) == dict(b.attrs)
