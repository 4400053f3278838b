"""HDF5 chunk decoding without h5py (hpctrain.data.codecs and its C extension _codecs).

Every chunk of small files written by h5py (lzf, gzip, shuffle, their combinations, several
dtypes, edge chunks, incompressible data) is read as stored and decoded by ChunkCodec; the
result must be exactly the bytes h5py returns for that chunk. Corrupt input must raise, never
crash or touch memory outside the buffers.
"""
import os
import threading

import h5py
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from hpctrain.data import codecs
from hpctrain.data.codecs import ChunkCodec, Filter, codec_for
from hpctrain.data.errors import DataError
from require import skip_or_fail

try:
    from hpctrain.data import _codecs
except ImportError as exc:  # optional extension: pip install succeeds without a compiler
    skip_or_fail("codecs", f"hpctrain.data._codecs not built (no C compiler or Python headers at install): {exc}",
                 module_level=True)


# ------------------------------------------------------------------ helpers

def sample_data(dtype, shape, rng):
    """Compressible data of `dtype` (a random walk / small integers / repeated strings)."""
    dt = np.dtype(dtype)
    n = int(np.prod(shape))
    if dt.kind == "f":
        return np.cumsum(rng.normal(size=n)).astype(dt).reshape(shape)
    if dt.kind in "iu":
        return (rng.integers(0, 20, size=n)).astype(dt).reshape(shape)
    if dt.kind == "S":
        words = np.array([b"abc", b"abd", b"xyz", b"a", b""], dtype=dt)
        return words[rng.integers(0, len(words), size=n)].reshape(shape)
    if dt.kind == "V":  # compound
        arr = np.zeros(n, dtype=dt)
        for name in dt.names:
            arr[name] = rng.integers(0, 7, size=n)
        return arr.reshape(shape)
    raise AssertionError(dt)


def chunk_slices(offset, chunks, shape):
    """The part of the dataset a chunk at `offset` covers (smaller at the edges)."""
    return tuple(slice(o, min(o + c, s)) for o, c, s in zip(offset, chunks, shape))


def stored_chunks(path, dset):
    """(offset, filter_mask, stored bytes) of every chunk, read with os.pread at the byte
    offsets HDF5 reports (as the loader does), checked against read_direct_chunk."""
    out = []
    fd = os.open(path, os.O_RDONLY)
    try:
        for i in range(dset.id.get_num_chunks()):
            info = dset.id.get_chunk_info(i)
            raw = os.pread(fd, info.size, info.byte_offset)
            mask, direct = dset.id.read_direct_chunk(info.chunk_offset)
            assert mask == info.filter_mask
            assert bytes(direct) == raw
            out.append((info.chunk_offset, info.filter_mask, raw))
    finally:
        os.close(fd)
    assert out, "dataset has no stored chunks"
    return out


def check_all_chunks(path, key):
    """Decode every stored chunk of `key` and compare with h5py's own read."""
    with h5py.File(path, "r") as f:
        dset = f[key]
        codec, why = codec_for(dset)
        assert codec is not None, why
        assert why == ""
        assert codec.chunk_bytes == int(np.prod(dset.chunks)) * dset.dtype.itemsize
        masks = []
        for offset, mask, raw in stored_chunks(path, dset):
            out = np.full(codec.chunk_bytes, 0xAA, dtype=np.uint8)
            codec.decode(raw, mask, out)
            sel = chunk_slices(offset, dset.chunks, dset.shape)
            decoded = out.view(dset.dtype).reshape(dset.chunks)[tuple(slice(0, s.stop - s.start) for s in sel)]
            expect = dset[sel]
            assert decoded.tobytes() == np.ascontiguousarray(expect).tobytes(), (key, offset, mask)
            masks.append(mask)
        return codec, masks


def write(path, key, data, **kwargs):
    with h5py.File(path, "a") as f:
        f.create_dataset(key, data=data, **kwargs)


DTYPES = ["float32", "int64", "float16", "uint8", ">f4", "S3", [("a", "<i2"), ("b", "u1")]]


# ------------------------------------------------------------------ whole files

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(np.dtype(d)))
@pytest.mark.parametrize("compression,shuffle", [("lzf", False), ("lzf", True), ("gzip", False),
                                                 ("gzip", True), (None, True)])
def test_every_chunk_decodes_to_what_h5py_reads(tmp_path, dtype, compression, shuffle):
    rng = np.random.default_rng(3)
    shape = (37, 11)  # chunks (8, 5): edge chunks in both dimensions
    data = sample_data(dtype, shape, rng)
    path = str(tmp_path / "d.h5")
    write(path, "x", data, chunks=(8, 5), compression=compression, shuffle=shuffle)
    codec, masks = check_all_chunks(path, "x")
    assert len(masks) == 5 * 3
    codes = [f.code for f in codec.filters]
    assert codes == ([2] if shuffle else []) + ({"lzf": [32000], "gzip": [1], None: []}[compression])
    if np.dtype(dtype).itemsize == 3 and shuffle:
        assert codec._shuffle_sizes[0] == 3


def test_one_dimensional_and_three_dimensional_chunks(tmp_path):
    rng = np.random.default_rng(4)
    path = str(tmp_path / "d.h5")
    write(path, "v", sample_data("float64", (1001,), rng), chunks=(128,), compression="lzf", shuffle=True)
    write(path, "c", sample_data("int32", (9, 7, 5), rng), chunks=(4, 3, 5), compression="gzip",
          compression_opts=9, shuffle=True)
    check_all_chunks(path, "v")
    check_all_chunks(path, "c")


@pytest.mark.parametrize("shuffle", [False, True])
def test_incompressible_lzf_chunk_is_stored_raw_with_the_mask_bit_set(tmp_path, shuffle):
    rng = np.random.default_rng(5)
    path = str(tmp_path / "d.h5")
    write(path, "r", rng.integers(0, 256, size=(4, 4096), dtype=np.uint8).view(np.float32),
          chunks=(1, 1024), compression="lzf", shuffle=shuffle)
    codec, masks = check_all_chunks(path, "r")
    lzf_bit = 1 << (len(codec.filters) - 1)
    assert all(m & lzf_bit for m in masks), masks   # lzf failed on every chunk: stored as is
    assert not any(m & 1 for m in masks) or not shuffle


def test_mixed_chunks_some_raw_some_compressed(tmp_path):
    rng = np.random.default_rng(6)
    data = np.zeros((8, 1024), dtype=np.uint8)
    data[::2] = rng.integers(0, 256, size=(4, 1024), dtype=np.uint8)  # even rows incompressible
    path = str(tmp_path / "d.h5")
    write(path, "m", data, chunks=(1, 1024), compression="lzf")
    _, masks = check_all_chunks(path, "m")
    assert sorted(set(masks)) == [0, 1]


def test_decode_in_two_threads_at_once(tmp_path):
    rng = np.random.default_rng(7)
    path = str(tmp_path / "d.h5")
    write(path, "a", sample_data("float32", (64, 512), rng), chunks=(4, 512), compression="lzf", shuffle=True)
    write(path, "b", sample_data("int64", (64, 256), rng), chunks=(4, 256), compression="gzip", shuffle=True)
    jobs = []
    with h5py.File(path, "r") as f:
        for key in ("a", "b"):
            codec, why = codec_for(f[key])
            assert codec is not None, why
            for offset, mask, raw in stored_chunks(path, f[key]):
                sel = chunk_slices(offset, f[key].chunks, f[key].shape)
                jobs.append((codec, mask, raw, np.ascontiguousarray(f[key][sel]).tobytes()))
    errors = []
    start = threading.Barrier(2)

    def work(order):
        start.wait()
        try:
            for _ in range(5):
                for codec, mask, raw, expect in order:
                    out = np.empty(codec.chunk_bytes, dtype=np.uint8)
                    codec.decode(raw, mask, out)
                    if out.tobytes() != expect:
                        errors.append("wrong bytes")
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(o,)) for o in (jobs, jobs[::-1])]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    assert errors == []


# ------------------------------------------------------------------ codec_for

def test_codec_for_unsupported_pipelines(tmp_path):
    path = str(tmp_path / "d.h5")
    data = np.arange(100, dtype=np.float32)
    write(path, "fl", data, chunks=(10,), compression="gzip", fletcher32=True)
    write(path, "plain", data, chunks=(10,))
    write(path, "contig", data)
    write(path, "so", data, chunks=(10,), scaleoffset=2)
    with h5py.File(path, "r") as f:
        assert codec_for(f["fl"]) == (None, "filter fletcher32 (3) is not supported")
        assert codec_for(f["plain"]) == (None, "no filters")
        assert codec_for(f["contig"]) == (None, "not chunked")
        codec, why = codec_for(f["so"])
        assert codec is None and why == "filter scaleoffset (6) is not supported"


def test_codec_for_without_the_extension(tmp_path, monkeypatch):
    path = str(tmp_path / "d.h5")
    data = np.arange(100, dtype=np.float32)
    write(path, "lzf", data, chunks=(10,), compression="lzf")
    write(path, "shuf", data, chunks=(10,), compression="gzip", shuffle=True)
    write(path, "gz", data, chunks=(10,), compression="gzip")
    monkeypatch.setattr(codecs, "_codecs", None)
    with h5py.File(path, "r") as f:
        assert codec_for(f["lzf"]) == (None, "hpctrain.data._codecs not built")
        assert codec_for(f["shuf"]) == (None, "hpctrain.data._codecs not built")
        codec, why = codec_for(f["gz"])  # zlib alone needs no extension
        assert codec is not None and why == ""
    check_all_chunks(path, "gz")


def test_pipeline_rules():
    assert codecs.unsupported_reason([Filter(2, (4,)), Filter(1, (4,))], True) == ""
    assert "more than one compression" in codecs.unsupported_reason([Filter(32000), Filter(1)], True)
    assert "after the compressor" in codecs.unsupported_reason([Filter(1), Filter(2, (4,))], True)
    assert codecs.unsupported_reason([Filter(32001, (), "blosc")], True) == "filter blosc (32001) is not supported"
    assert codecs.unsupported_reason([Filter(307)], True) == "filter unknown filter (307) is not supported"
    with pytest.raises(ValueError, match="fletcher32"):
        ChunkCodec([Filter(3)], (4,), 4)
    with pytest.raises(ValueError, match="chunk_shape"):
        ChunkCodec([Filter(1)], (0, 4), 4)


# ------------------------------------------------------------------ decode errors

def lzf_file_chunk(tmp_path):
    path = str(tmp_path / "d.h5")
    write(path, "x", sample_data("float32", (16, 256), np.random.default_rng(8)), chunks=(16, 256),
          compression="lzf", shuffle=True)
    with h5py.File(path, "r") as f:
        codec, _ = codec_for(f["x"])
        [(_, mask, raw)] = stored_chunks(path, f["x"])
    assert mask == 0
    return codec, raw


def test_decode_corrupt_lzf_chunk_raises_data_error(tmp_path):
    codec, raw = lzf_file_chunk(tmp_path)
    out = np.empty(codec.chunk_bytes, dtype=np.uint8)
    for cut in (1, 2, 17, len(raw) // 2, len(raw) - 1):
        with pytest.raises(DataError, match="lzf"):
            codec.decode(raw[:cut], 0, out)
    bad = bytearray(raw)
    bad[0] = 0xFF  # first instruction a back-reference: nothing decoded to refer to
    with pytest.raises(DataError, match="before the start of the output"):
        codec.decode(bytes(bad), 0, out)
    with pytest.raises(DataError, match="expected"):
        codec.decode(raw + raw, 0, out)  # decodes to twice the chunk: output too small


def test_decode_corrupt_deflate_chunk_raises_data_error(tmp_path):
    path = str(tmp_path / "d.h5")
    write(path, "x", sample_data("int64", (512,), np.random.default_rng(9)), chunks=(512,), compression="gzip")
    with h5py.File(path, "r") as f:
        codec, _ = codec_for(f["x"])
        [(_, mask, raw)] = stored_chunks(path, f["x"])
    out = np.empty(codec.chunk_bytes, dtype=np.uint8)
    with pytest.raises(DataError, match="deflate"):
        codec.decode(raw[: len(raw) // 2], mask, out)
    with pytest.raises(DataError, match="deflate"):
        codec.decode(b"\x00" * 40, mask, out)
    big = ChunkCodec([Filter(1, (4,))], (256,), 8)  # half the size the stream decodes to
    with pytest.raises(DataError, match="more than the expected 2048"):
        big.decode(raw, mask, np.empty(2048, dtype=np.uint8))
    small = ChunkCodec([Filter(1, (4,))], (1024,), 8)
    with pytest.raises(DataError, match="expected 8192"):
        small.decode(raw, mask, np.empty(8192, dtype=np.uint8))


def test_decode_argument_errors():
    codec = ChunkCodec([Filter(2, (4,)), Filter(32000)], (10,), 4)
    raw = bytes(range(40))
    with pytest.raises(ValueError, match="out has 39 bytes, expected chunk_bytes = 40"):
        codec.decode(raw, 2, np.empty(39, dtype=np.uint8))
    with pytest.raises(ValueError, match="uint8"):
        codec.decode(raw, 2, np.empty(10, dtype=np.float32))
    with pytest.raises(DataError, match="filter mask 0x4"):
        codec.decode(raw, 4, np.empty(40, dtype=np.uint8))
    with pytest.raises(DataError, match="stored chunk has 39 bytes, expected 40"):
        codec.decode(raw[:39], 2, np.empty(40, dtype=np.uint8))
    out = np.empty(40, dtype=np.uint8)
    codec.decode(raw, 3, out)  # both filters skipped: stored as is
    assert out.tobytes() == raw
    codec.decode(np.frombuffer(raw, dtype=np.float32), 2, out)  # any buffer as input
    ref = np.empty(40, dtype=np.uint8)
    _codecs.unshuffle_into(raw, ref, 4)
    assert out.tobytes() == ref.tobytes()


# ------------------------------------------------------------------ unshuffle_into

def shuffle_ref(data: bytes, itemsize: int) -> bytes:
    """HDF5's shuffle (forward), from its definition: byte b of element i goes to b*n + i;
    the len % itemsize leftover bytes stay at the end."""
    n = len(data) // itemsize
    head = np.frombuffer(data[: n * itemsize], dtype=np.uint8).reshape(n, itemsize)
    return head.T.tobytes() + data[n * itemsize:]


@pytest.mark.parametrize("itemsize", [1, 2, 3, 4, 5, 8, 16])
@pytest.mark.parametrize("extra", [0, 1, 2])
def test_unshuffle_inverts_shuffle(itemsize, extra):
    rng = np.random.default_rng(itemsize * 10 + extra)
    for n in (0, 1, 2, 7, 100):
        data = rng.integers(0, 256, size=n * itemsize + (extra % itemsize if itemsize > 1 else 0),
                            dtype=np.uint8).tobytes()
        out = bytearray(len(data))
        _codecs.unshuffle_into(shuffle_ref(data, itemsize), out, itemsize)
        assert bytes(out) == data, (itemsize, n)


def test_unshuffle_leftover_bytes_stay_at_the_end():
    shuffled = bytes([0, 3, 6, 1, 4, 7, 2, 5, 8, 90, 91])  # 3 elements of 3 bytes + 2 leftover
    out = np.empty(len(shuffled), dtype=np.uint8)
    _codecs.unshuffle_into(shuffled, out, 3)
    assert out.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 90, 91]


@settings(max_examples=200, deadline=None)
@given(data=st.binary(max_size=300), itemsize=st.integers(1, 20))
def test_unshuffle_property(data, itemsize):
    out = bytearray(len(data))
    _codecs.unshuffle_into(shuffle_ref(data, itemsize), out, itemsize)
    assert bytes(out) == data


def test_unshuffle_argument_errors():
    with pytest.raises(ValueError, match="dst has 7 bytes but src has 8"):
        _codecs.unshuffle_into(b"\0" * 8, bytearray(7), 4)
    with pytest.raises(ValueError, match="itemsize must be >= 1"):
        _codecs.unshuffle_into(b"\0" * 8, bytearray(8), 0)
    with pytest.raises(TypeError, match="read-only bytes"):
        _codecs.unshuffle_into(b"\0" * 8, b"\0" * 8, 4)
    with pytest.raises(TypeError, match="src must be a C-contiguous buffer"):
        _codecs.unshuffle_into(8, bytearray(8), 4)
    with pytest.raises(TypeError, match="dst must be a writable C-contiguous buffer"):
        _codecs.unshuffle_into(b"\0" * 8, np.zeros(16, dtype=np.uint8)[::2], 4)
    buf = bytearray(16)
    with pytest.raises(ValueError, match="overlap"):
        _codecs.unshuffle_into(memoryview(buf)[:8], memoryview(buf)[4:12], 4)


# ------------------------------------------------------------------ lzf_decompress_into

def lzf_ref_compress(data: bytes) -> bytes:
    """A small LZF encoder (greedy, 3-byte hash) producing every instruction kind: literal
    runs up to 32, short and long (len byte) back-references, overlapping ones."""
    out = bytearray()
    lit = bytearray()
    table: dict = {}
    i, n = 0, len(data)

    def flush():
        for k in range(0, len(lit), 32):
            part = lit[k:k + 32]
            out.append(len(part) - 1)
            out.extend(part)
        lit.clear()

    while i < n:
        key = data[i:i + 3]
        ref = table.get(key) if len(key) == 3 else None
        table[key] = i
        if ref is not None and 0 < i - ref <= 8192:
            length = 0
            while i + length < n and length < 264 and data[ref + length] == data[i + length]:
                length += 1
            if length >= 3:
                flush()
                dist = i - ref - 1
                ln = length - 2
                if ln < 7:
                    out.append((ln << 5) | (dist >> 8))
                else:
                    out.append((7 << 5) | (dist >> 8))
                    out.append(ln - 7)
                out.append(dist & 0xFF)
                i += length
                continue
        lit.append(data[i])
        i += 1
    flush()
    return bytes(out)


def test_lzf_hand_made_streams():
    out = bytearray(64)
    assert _codecs.lzf_decompress_into(b"", out) == 0
    assert _codecs.lzf_decompress_into(b"\x02abc", out) == 3 and out[:3] == b"abc"
    # "a" then a back-reference at distance 1, length 2+5 = 7: overlapping run of "a"
    assert _codecs.lzf_decompress_into(b"\x00a" + bytes([5 << 5, 0]), out) == 8
    assert out[:8] == b"a" * 8
    # "ab" then distance 2, length 7 + 3 + 2 = 12 (len byte): "ab" repeated
    assert _codecs.lzf_decompress_into(b"\x01ab" + bytes([7 << 5, 3, 1]), out) == 14
    assert out[:14] == b"ab" * 7


@pytest.mark.parametrize("stream,match", [
    (b"\x05abc", "literal run of 6 bytes at input byte 0 runs past the end"),
    (b"\x00a\x20", "truncated input: the back-reference at input byte 2"),
    (b"\x00a\xe0", "truncated input: the back-reference at input byte 2"),
    (b"\x00a\xe0\x01", "truncated input: the back-reference at input byte 2"),
    (b"\x20\x00", "points 1 bytes back but only 0 bytes were decoded"),
    (b"\x01ab\x20\x02", "points 3 bytes back but only 2 bytes were decoded"),
    (b"\x1f" + b"x" * 32 + b"\xff\xff\x00", "points 7937 bytes back"),
])
def test_lzf_corrupt_streams_raise(stream, match):
    with pytest.raises(ValueError, match=match):
        _codecs.lzf_decompress_into(stream, bytearray(1000))


def test_lzf_output_too_small():
    with pytest.raises(ValueError, match="literal run of 3 bytes at input byte 0 would write past the end of the 2-byte output"):
        _codecs.lzf_decompress_into(b"\x02abc", bytearray(2))
    with pytest.raises(ValueError, match="back-reference of 7 bytes at input byte 2 would write past"):
        _codecs.lzf_decompress_into(b"\x00a" + bytes([5 << 5, 0]), bytearray(5))


def test_lzf_argument_errors():
    with pytest.raises(TypeError, match="read-only bytes"):
        _codecs.lzf_decompress_into(b"\x00a", b"\0")
    with pytest.raises(TypeError, match="src must be"):
        _codecs.lzf_decompress_into("text", bytearray(4))
    with pytest.raises(TypeError):
        _codecs.lzf_decompress_into(b"\x00a")
    buf = bytearray(8)
    buf[0] = 0
    with pytest.raises(ValueError, match="overlap"):
        _codecs.lzf_decompress_into(memoryview(buf)[:2], memoryview(buf)[1:])


@settings(max_examples=200, deadline=None)
@given(data=st.one_of(st.binary(max_size=2000),
                      st.lists(st.sampled_from([b"a", b"ab", b"abc", b"xyzw" * 3, b"\0" * 50]),
                               max_size=200).map(b"".join)))
def test_lzf_roundtrip_property(data):
    stream = lzf_ref_compress(data)
    out = np.empty(len(data) + 5, dtype=np.uint8)
    assert _codecs.lzf_decompress_into(stream, out) == len(data)
    assert out[: len(data)].tobytes() == data


@settings(max_examples=300, deadline=None)
@given(stream=st.binary(max_size=200), out_len=st.integers(0, 300))
def test_lzf_random_input_never_crashes(stream, out_len):
    out = bytearray(out_len + 16)
    guard = bytes(out[out_len:])
    view = memoryview(out)[:out_len]
    try:
        n = _codecs.lzf_decompress_into(stream, view)
        assert 0 <= n <= out_len
    except ValueError as e:
        assert str(e).startswith("lzf: ")
    view.release()
    assert bytes(out[out_len:]) == guard  # nothing written past the end of dst


def test_lzf_every_truncation_of_a_real_chunk(tmp_path):
    codec, raw = lzf_file_chunk(tmp_path)
    full = np.empty(codec.chunk_bytes, dtype=np.uint8)
    assert _codecs.lzf_decompress_into(raw, full) == codec.chunk_bytes
    out = np.empty(codec.chunk_bytes, dtype=np.uint8)
    for cut in range(0, len(raw), max(1, len(raw) // 300)):
        try:
            n = _codecs.lzf_decompress_into(raw[:cut], out)
        except ValueError:
            continue
        assert n < codec.chunk_bytes  # a cut at an instruction boundary decodes a prefix
        assert out[:n].tobytes() == full[:n].tobytes()


@pytest.mark.parametrize("rows, width", [
    (3000, 300),   # an iovec per row: more rows than one preadv takes (IOV_MAX = 1024)
    (12000, 12),   # narrow rows, read 64 KiB at a time and copied: more than two stretches
])
def test_pread_rows_scatters_file_rows_to_their_places(tmp_path, rows, width):
    """Row r of a file range lands at row index[r] of dst (negative: skipped, not copied), over
    more rows than one read takes, merged stretches, and a short file."""
    data = np.arange(rows * width, dtype=np.uint8).reshape(rows, width)  # wraps: fine, still distinct per row
    data[:, 0] = np.arange(rows) % 251
    data[:, 1] = np.arange(rows) // 251
    path = tmp_path / "rows.bin"
    path.write_bytes(b"HEAD" + data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    try:
        rng = np.random.default_rng(0)
        stretch = (np.arange(rows) >= 100) & (np.arange(rows) < 300)
        dst_index = np.full(rows, -1, np.int64)
        dst_index[stretch] = np.arange(1000, 1200)  # consecutive in file and dst: one iovec
        others = np.flatnonzero(~stretch & (rng.random(rows) > 0.1))  # ~10% not needed
        others = others[others < rows - 3]  # the last rows not needed either
        free = np.setdiff1d(np.arange(rows), np.arange(1000, 1200))
        dst_index[others] = rng.permutation(free)[:len(others)]
        keep = dst_index >= 0
        dst = np.zeros((rows, width), np.uint8)
        _codecs.pread_rows(fd, 4, width, dst_index, dst)  # 4: after the header
        np.testing.assert_array_equal(dst[dst_index[keep]], data[keep])
        untouched = np.setdiff1d(np.arange(rows), dst_index[keep])
        assert not dst[untouched].any()
        with pytest.raises(OSError, match="file ended"):
            _codecs.pread_rows(fd, 4 + (rows - 2) * width, width, np.arange(5, dtype=np.int64), dst)
        with pytest.raises(ValueError, match="past the"):
            _codecs.pread_rows(fd, 4, width, np.array([0, rows], np.int64), dst)
        with pytest.raises(TypeError):
            _codecs.pread_rows(fd, 4, width, np.arange(3, dtype=np.int64), b"read-only")
    finally:
        os.close(fd)
