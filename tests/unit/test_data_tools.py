"""pack / shard / merge / inspect / verify as library calls; round trips are bit-identical."""
from __future__ import annotations

import json
import os

import h5py
import numpy as np
import pytest

from hpctrain.data.errors import ChecksumError, ConfigError, DataError, LengthMismatchError, TooFewSamplesError
from hpctrain.data.h5files import array_checksum, atomic_output
from hpctrain.data.pack import pack
from hpctrain.data.shard import merge, shard, shard_ranges
from hpctrain.data.verify import inspect_paths, render_inspect, render_verify, verify_paths


def datasets(path):
    with h5py.File(path, "r") as f:
        out = {}
        for k in f:
            d = f[k]
            out[k] = dict(data=d[()], dtype=d.dtype, chunks=d.chunks, compression=d.compression,
                          opts=d.compression_opts, shuffle=d.shuffle, fletcher32=d.fletcher32,
                          attrs=dict(d.attrs))
        return out, dict(f.attrs)


def test_pack_npy_npz_csv(tmp_path):
    x = np.random.default_rng(0).normal(size=(300, 5, 2)).astype(np.float32)
    y = np.arange(300, dtype=np.int16)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "labels.npy", y)
    r = pack([str(tmp_path / "x.npy"), str(tmp_path / "labels.npy")], str(tmp_path / "a.h5"),
             compression="gzip", compression_opts=4, shuffle_filter=True, fletcher32=True, chunk_rows=64)
    assert r.num_samples == 300 and r.keys == ("x", "labels")
    ds, attrs = datasets(r.path)
    assert np.array_equal(ds["x"]["data"], x) and ds["x"]["dtype"] == np.float32
    assert ds["labels"]["dtype"] == np.int16
    assert ds["x"]["chunks"] == (64, 5, 2) and ds["x"]["compression"] == "gzip" and ds["x"]["opts"] == 4
    assert ds["x"]["shuffle"] and ds["x"]["fletcher32"]
    assert ds["x"]["attrs"]["sha256"] == array_checksum(x)
    assert attrs["num_samples"] == 300 and json.loads(attrs["keys"]) == ["x", "labels"]
    schema = json.loads(attrs["schema"])
    assert schema["x"]["shape"] == [5, 2] and schema["x"]["dtype"] == "<f4"

    np.savez(tmp_path / "z.npz", feats=x[:, :, 0], target=y)
    r = pack([str(tmp_path / "z.npz")], str(tmp_path / "z.h5"), compression="lzf")
    ds, _ = datasets(r.path)
    assert set(ds) == {"feats", "target"} and ds["feats"]["compression"] == "lzf"

    (tmp_path / "t.csv").write_text("a,b,label\n1,2,0\n3.5,4,1\n5,6,1\n")
    r = pack([str(tmp_path / "t.csv")], str(tmp_path / "t.h5"), label_column="label")
    ds, _ = datasets(r.path)
    assert ds["x"]["data"].tolist() == [[1, 2], [3.5, 4], [5, 6]] and ds["y"]["data"].tolist() == [0, 1, 1]


def test_pack_digits(tmp_path):
    from sklearn.datasets import load_digits

    r = pack(["digits"], str(tmp_path / "d.h5"), compression="lzf")
    d = load_digits()
    ds, attrs = datasets(r.path)
    assert r.num_samples == 1797 == attrs["num_samples"]
    assert np.array_equal(ds["x"]["data"], d.data.astype(np.float32))
    assert np.array_equal(ds["y"]["data"], d.target)
    assert "load_digits" in attrs["source"]


@pytest.mark.parametrize("compression", [None, "lzf", "gzip"])
@pytest.mark.parametrize("num_shards", [1, 3, 7])
def test_pack_shard_merge_bit_identical(tmp_path, compression, num_shards):
    rng = np.random.default_rng(1)
    np.savez(tmp_path / "in.npz", x=rng.normal(size=(1000, 6)).astype(np.float32),
             y=rng.integers(0, 9, size=1000), w=rng.random(1000))
    packed = str(tmp_path / "packed.h5")
    pack([str(tmp_path / "in.npz")], packed, compression=compression, shuffle_filter=True,
         fletcher32=True, chunk_rows=128, quiet=True)
    out = tmp_path / "shards"
    paths = shard(packed, num_shards, str(out), quiet=True)
    assert len(paths) == num_shards
    counts = []
    for i, p in enumerate(sorted(paths)):
        ds, attrs = datasets(p)
        counts.append(ds["x"]["data"].shape[0])
        assert attrs["shard_index"] == i and attrs["num_shards"] == num_shards
        assert ds["x"]["dtype"] == np.float32 and ds["y"]["dtype"] == np.int64
        assert ds["x"]["compression"] == compression and ds["x"]["fletcher32"] and ds["x"]["shuffle"]
        assert ds["x"]["chunks"] == (min(128, counts[-1]), 6)
        assert ds["x"]["attrs"]["sha256"] == array_checksum(ds["x"]["data"])
    assert max(counts) - min(counts) <= 1 and sum(counts) == 1000
    assert verify_paths(paths, quiet=True)["ok"]

    merged = str(tmp_path / "merged.h5")
    merge(list(reversed(paths)), merged, quiet=True)  # order comes from the shards' attributes
    a, attrs_a = datasets(packed)
    b, attrs_b = datasets(merged)
    assert attrs_a == attrs_b
    assert a.keys() == b.keys()
    for k in a:
        assert a[k]["data"].tobytes() == b[k]["data"].tobytes()
        for prop in ("dtype", "chunks", "compression", "opts", "shuffle", "fletcher32", "attrs"):
            assert a[k][prop] == b[k][prop], (k, prop)


def test_shard_keeps_extra_datasets_and_attrs(tmp_path):
    src = tmp_path / "raw.h5"
    with h5py.File(src, "w") as f:
        f.create_dataset("x", data=np.arange(20.0), chunks=(4,))
        f.create_dataset("y", data=np.arange(20))
        f.create_dataset("meta/classes", data=np.arange(3))
        f["x"].attrs["units"] = "m"
        f.attrs["author"] = "me"
    paths = shard(str(src), 4, str(tmp_path / "s"), keys=["x", "y"], quiet=True)
    with h5py.File(paths[2]) as f:
        assert f["x"][()].tolist() == [10.0, 11.0, 12.0, 13.0, 14.0]
        assert f["meta/classes"][()].tolist() == [0, 1, 2]
        assert f["x"].attrs["units"] == "m" and f.attrs["author"] == "me"
    merged = tmp_path / "m.h5"
    merge(paths, str(merged), quiet=True)
    with h5py.File(merged) as f:
        assert f["x"][()].tolist() == list(np.arange(20.0)) and f["x"].chunks == (4,)


def test_shard_ranges_balanced():
    assert shard_ranges(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert shard_ranges(3, 3) == [(0, 1), (1, 2), (2, 3)]


def test_shard_by_ranks_writes_disjoint_sets(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(50.0))
    pack([str(tmp_path / "x.npy")], str(tmp_path / "p.h5"), quiet=True)
    written = [shard(str(tmp_path / "p.h5"), 5, str(tmp_path / "s"), rank=r, size=2, quiet=True) for r in range(2)]
    names = [[os.path.basename(p) for p in w] for w in written]
    assert names == [["p-00000-of-00005.h5", "p-00002-of-00005.h5", "p-00004-of-00005.h5"],
                     ["p-00001-of-00005.h5", "p-00003-of-00005.h5"]]


def test_shard_only_some_indices_then_merge_the_whole_set(tmp_path):
    """--only (one SLURM array task per shard): each call writes just its shards; together
    they are the complete set, which merges back bit-identical."""
    np.save(tmp_path / "x.npy", np.arange(50.0))
    pack([str(tmp_path / "x.npy")], str(tmp_path / "p.h5"), quiet=True)
    written = [shard(str(tmp_path / "p.h5"), 4, str(tmp_path / "s"), only=[i], quiet=True) for i in (2, 0, 3, 1)]
    assert [os.path.basename(w[0]) for w in written] == [f"p-0000{i}-of-00004.h5" for i in (2, 0, 3, 1)]
    assert shard(str(tmp_path / "p.h5"), 4, str(tmp_path / "t"), only=[1, 3], rank=1, size=2, quiet=True) == \
        [str(tmp_path / "t" / "p-00003-of-00004.h5")]
    merged = merge([w[0] for w in written], str(tmp_path / "m.h5"), quiet=True)
    with h5py.File(merged) as f:
        np.testing.assert_array_equal(f["x"][:], np.arange(50.0))
    with pytest.raises(ConfigError, match="--only 4: shard indices run from 0 to 3"):
        shard(str(tmp_path / "p.h5"), 4, str(tmp_path / "u"), only=[4], quiet=True)


def test_parse_shard_indices():
    from hpctrain.cli.data import parse_indices

    assert parse_indices("3") == [3]
    assert parse_indices("0-3, 7") == [0, 1, 2, 3, 7]
    with pytest.raises(SystemExit, match="expected indices"):
        parse_indices("x")


def test_shard_too_many_shards(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(3.0))
    pack([str(tmp_path / "x.npy")], str(tmp_path / "p.h5"), quiet=True)
    with pytest.raises(TooFewSamplesError, match="3 samples cannot fill 4 shards"):
        shard(str(tmp_path / "p.h5"), 4, str(tmp_path / "s"), quiet=True)


def test_merge_rejects_incomplete_or_damaged_sets(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(40.0))
    pack([str(tmp_path / "x.npy")], str(tmp_path / "p.h5"), quiet=True)
    paths = shard(str(tmp_path / "p.h5"), 4, str(tmp_path / "s"), quiet=True)
    with pytest.raises(DataError, match=r"missing \[2\]"):
        merge(paths[:2] + paths[3:], str(tmp_path / "m.h5"))
    with h5py.File(paths[1], "r+") as f:  # change data, and its own checksum to match
        f["x"][0] = 99.0
        f["x"].attrs["sha256"] = array_checksum(f["x"][()])
    with pytest.raises(ChecksumError, match="sha256"):
        merge(paths, str(tmp_path / "m.h5"))
    assert not os.path.exists(tmp_path / "m.h5")
    assert not [n for n in os.listdir(tmp_path) if ".tmp-" in n]  # no half-written file left


def test_inspect_reports_layout(tmp_path):
    np.save(tmp_path / "x.npy", np.zeros((10, 4), np.float32))
    pack([str(tmp_path / "x.npy")], str(tmp_path / "p.h5"), compression="lzf", quiet=True)
    paths = shard(str(tmp_path / "p.h5"), 2, str(tmp_path / "s"), quiet=True)
    report = inspect_paths(paths)
    assert report["num_samples"] == 10 and report["num_files"] == 2 and report["errors"] == 0
    d = report["files"][0]["datasets"]["x"]
    assert d["shape"] == [5, 4] and d["dtype"] == "float32" and d["compression"] == "lzf"
    text = render_inspect(report)
    assert "shard 0 of 2" in text and "total" in text
    json.dumps(report)
    bad = inspect_paths([str(tmp_path / "nope.h5")])
    assert bad["errors"] == 1 and "no such file" in bad["files"][0]["error"]


def test_verify_finds_problems(tmp_path):
    p = tmp_path / "v.h5"
    x = np.ones((20, 3), np.float32)
    x[4, 1] = np.nan
    x[7, 0] = np.inf
    with h5py.File(p, "w") as f:
        f.create_dataset("x", data=x)
        f.create_dataset("y", data=np.arange(19))
        f["x"].attrs["sha256"] = "0" * 64
    report = verify_paths([str(p)], quiet=True)
    assert not report["ok"]
    problems = " ".join(report["files"][0]["problems"])
    assert "checksum mismatch" in problems
    assert "1 NaN and 1 Inf values (first in sample 4)" in problems
    assert "different numbers of samples" in problems
    assert "verification FAILED" in render_verify(report)
    ok = verify_paths([str(p)], keys=["y"], quiet=True)
    assert ok["ok"] and "no checksum recorded" in ok["files"][0]["notes"][0]


def test_atomic_output_leaves_nothing_on_failure(tmp_path):
    target = tmp_path / "out.h5"
    with pytest.raises(RuntimeError):
        with atomic_output(target) as tmp:
            with h5py.File(tmp, "w") as f:
                f.create_dataset("x", data=np.arange(10))
            raise RuntimeError("interrupted")
    assert os.listdir(tmp_path) == []


def test_pack_interrupted_keeps_old_file(tmp_path, monkeypatch):
    np.save(tmp_path / "x.npy", np.arange(10.0))
    out = tmp_path / "p.h5"
    pack([str(tmp_path / "x.npy")], str(out), quiet=True)
    before = out.read_bytes()
    import hpctrain.data.pack as packmod

    def boom(arr):
        raise KeyboardInterrupt

    monkeypatch.setattr(packmod, "array_checksum", boom)
    with pytest.raises(KeyboardInterrupt):
        pack([str(tmp_path / "x.npy")], str(out), quiet=True)
    assert out.read_bytes() == before
    assert sorted(os.listdir(tmp_path)) == ["p.h5", "x.npy"]


def test_pack_rejects_bad_inputs(tmp_path):
    np.save(tmp_path / "a.npy", np.zeros(5))
    np.save(tmp_path / "b.npy", np.zeros(6))
    with pytest.raises(LengthMismatchError, match="different numbers of samples"):
        pack([str(tmp_path / "a.npy"), str(tmp_path / "b.npy")], str(tmp_path / "o.h5"))
    np.save(tmp_path / "s.npy", np.array(["a", "b"]))
    with pytest.raises(DataError, match="not numeric"):
        pack([str(tmp_path / "s.npy")], str(tmp_path / "o.h5"))
    np.save(tmp_path / "e.npy", np.zeros((0, 3)))
    with pytest.raises(DataError, match="zero samples"):
        pack([str(tmp_path / "e.npy")], str(tmp_path / "o.h5"))
    (tmp_path / "bad.csv").write_text("1,2\n3,x\n")
    with pytest.raises(DataError, match="line 2"):
        pack([str(tmp_path / "bad.csv")], str(tmp_path / "o.h5"))
    with pytest.raises(DataError, match="no such file"):
        pack([str(tmp_path / "missing.npy")], str(tmp_path / "o.h5"))
    assert not os.path.exists(tmp_path / "o.h5")


def _drop_source(paths):
    """Shards as written before the parent's name and fingerprint were recorded."""
    for p in paths:
        with h5py.File(p, "r+") as f:
            del f.attrs["parent_name"], f.attrs["parent_fingerprint"]


def _attrs(path):
    with h5py.File(path, "r") as f:
        return dict(f.attrs)


def test_shards_record_their_parent(tmp_path):
    np.save(tmp_path / "x.npy", np.arange(1000, dtype=np.float32).reshape(100, 10))
    pack([str(tmp_path / "x.npy")], str(tmp_path / "p.h5"))
    paths = shard(str(tmp_path / "p.h5"), 3, str(tmp_path / "s"), quiet=True)
    # written in separate runs (one shard each), the shards still name one parent
    again = shard(str(tmp_path / "p.h5"), 3, str(tmp_path / "t"), only=[1], quiet=True)
    attrs = [_attrs(p) for p in paths + again]
    assert {a["parent_name"] for a in attrs} == {"p.h5"}
    assert len({a["parent_fingerprint"] for a in attrs}) == 1
    assert [(a["shard_start"], a["shard_stop"]) for a in attrs[:3]] == [(0, 34), (34, 67), (67, 100)]
    # same shapes and size, different content: a different fingerprint
    np.save(tmp_path / "x.npy", np.arange(1000, dtype=np.float32).reshape(100, 10) + 1)
    (tmp_path / "q").mkdir()
    pack([str(tmp_path / "x.npy")], str(tmp_path / "q" / "p.h5"))
    other = shard(str(tmp_path / "q" / "p.h5"), 3, str(tmp_path / "u"), quiet=True)
    assert _attrs(other[0])["parent_fingerprint"] != attrs[0]["parent_fingerprint"]
    mixed = [paths[0], other[1], paths[2]]
    report = verify_paths(mixed, quiet=True)
    assert not report["ok"] and any("2 different parent files" in p for p in report["problems"])
    with pytest.raises(DataError, match="come from 2 different parent files"):
        merge(mixed, str(tmp_path / "m.h5"), quiet=True)


def test_shards_without_a_recorded_source_still_verify(tmp_path):
    for name, rows in (("a", 90), ("b", 60)):
        (tmp_path / name).mkdir()
        np.save(tmp_path / name / "x.npy", np.ones((rows, 4), np.float32))
        pack([str(tmp_path / name / "x.npy")], str(tmp_path / f"{name}.h5"))
    a = shard(str(tmp_path / "a.h5"), 3, str(tmp_path / "sa"), quiet=True)
    b = shard(str(tmp_path / "b.h5"), 3, str(tmp_path / "sb"), quiet=True)
    _drop_source(a + b)
    report = verify_paths(a, quiet=True)
    assert report["ok"], render_verify(report)
    assert all(any("source not recorded" in n for n in f["notes"]) for f in report["files"])
    assert all(f["keys"]["x"]["checksum"] == "ok" for f in report["files"])
    # what is recorded (the parent's size) still tells the two parents apart
    report = verify_paths([a[0], b[1], a[2]], quiet=True)
    assert not report["ok"] and "2 different parent files" in report["problems"][0]
    assert "an unrecorded parent of 90 samples" in report["problems"][0]
    with pytest.raises(DataError, match="come from 2 different parent files"):
        merge([a[0], b[1], a[2]], str(tmp_path / "m.h5"), quiet=True)
    merge(a, str(tmp_path / "m.h5"), quiet=True)
    with h5py.File(tmp_path / "m.h5") as m, h5py.File(tmp_path / "a.h5") as p:
        assert m["x"][()].tobytes() == p["x"][()].tobytes()


def test_verify_checks_a_shards_recorded_rows(tmp_path):
    np.save(tmp_path / "x.npy", np.ones((10, 2), np.float32))
    pack([str(tmp_path / "x.npy")], str(tmp_path / "p.h5"))
    paths = shard(str(tmp_path / "p.h5"), 2, str(tmp_path / "s"), quiet=True)
    with h5py.File(paths[1], "r+") as f:
        f.attrs["shard_start"] = 4
    report = verify_paths(paths, quiet=True)
    assert not report["ok"]
    assert "shard 1 of 2 records rows 4..10 of 10; the split of 10 samples gives rows 5..10" in \
        report["files"][1]["problems"][0]
