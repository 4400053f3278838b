"""The shared-memory flag exchange (C extension) in one process: the peers' regions are plain
memory that the test fills in as a peer would, so every outcome is checked without mpiexec."""
import struct
import time

import numpy as np
import pytest

from hpctrain.comm import plan, shmsync
from hpctrain.comm.buffers import DTYPE_CODES
from require import skip_or_fail

try:
    from hpctrain.comm import _shmsync
except ImportError as exc:  # optional extension: pip install succeeds without a compiler
    skip_or_fail("shmsync", f"hpctrain.comm._shmsync not built (no C compiler or Python headers at install): {exc}",
                 module_level=True)
SLOT = 4096


def regions(n):
    mem = [np.zeros(_shmsync.REGION_HEADER_BYTES + 2 * SLOT, dtype=np.uint8) for _ in range(n)]
    return mem, mem  # the regions are handed over as buffers


def peer_posts(mem, seq, data=None, header=None):
    """What a peer's exchange number ``seq`` writes: header, data slot, then its flag."""
    parity = seq & 1
    if header is not None:
        mem[128 + 64 * parity:128 + 64 * (parity + 1)] = np.frombuffer(header, dtype=np.uint8)
    if data is not None:
        raw = np.ascontiguousarray(data).view(np.uint8)
        start = _shmsync.REGION_HEADER_BYTES + parity * SLOT
        mem[start:start + raw.size] = raw
    mem[:8] = np.frombuffer(struct.pack("<Q", seq), dtype=np.uint8)


@pytest.mark.parametrize("dtype", ["int8", "uint16", "int32", "int64", "uint64", "float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg", "min", "max", "prod"])
def test_small_allreduce_matches_numpy_in_rank_order(dtype, op):
    rng = np.random.default_rng(7)
    n = 3
    mem, addrs = regions(n)
    ctx = _shmsync.Ctx(addrs, 1, SLOT, 0)
    data = [rng.integers(1, 5, size=37).astype(dtype) for _ in range(n)]
    for q in (0, 2):
        peer_posts(mem[q], 1, data[q])
    mine = data[1].copy()
    assert ctx.exchange(None, mine, DTYPE_CODES[dtype], shmsync.OP_CODES[op], 1.0) == shmsync.ST_OK
    kernel = {"sum": np.add, "avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}[op]
    expected = data[0].copy()
    for q in (1, 2):
        kernel(expected, data[q], out=expected)
    if op == "avg":
        expected = (np.trunc(expected / n) if np.dtype(dtype).kind in "iu" else expected / np.dtype(dtype).type(n))
    np.testing.assert_array_equal(mine, expected.astype(dtype))
    assert ctx.seq == 1


def test_second_exchange_uses_the_other_parity_and_waits_for_every_flag():
    mem, addrs = regions(2)
    ctx = _shmsync.Ctx(addrs, 0, SLOT, 0)
    for seq, value in ((1, 10.0), (2, 20.0)):
        peer_posts(mem[1], seq, np.full(4, value, dtype=np.float32))
        x = np.ones(4, dtype=np.float32)
        assert ctx.exchange(None, x, DTYPE_CODES["float32"], shmsync.OP_CODES["sum"], 1.0) == 0
        np.testing.assert_array_equal(x, np.full(4, value + 1))


def test_timeout_names_the_missing_rank():
    mem, addrs = regions(3)
    ctx = _shmsync.Ctx(addrs, 0, SLOT, 0)
    peer_posts(mem[2], 1)
    t0 = time.monotonic()
    assert ctx.exchange(None, None, 0, 0, 0.2) == shmsync.ST_TIMEOUT
    assert 0.2 <= time.monotonic() - t0 < 5
    assert ctx.missing() == [1]


def test_header_mismatch_is_reported_and_headers_readable():
    mem, addrs = regions(2)
    ctx = _shmsync.Ctx(addrs, 1, SLOT, 0)
    theirs = shmsync.HEADER.pack(1, 0, 1, 11, 10, 3, 0, 0)
    mine = shmsync.HEADER.pack(1, 0, 1, 11, 12, 3, 0, 0)
    peer_posts(mem[0], 1, header=theirs)
    x = np.ones(12, dtype=np.float32)
    assert ctx.exchange(mine, x, DTYPE_CODES["float32"], 0, 1.0) == shmsync.ST_MISMATCH
    np.testing.assert_array_equal(x, np.ones(12))  # nothing reduced
    headers = np.empty((2, 8), dtype=np.int64)
    ctx.headers(headers)
    assert headers[0, 4] == 10 and headers[1, 4] == 12


def test_a_header_sent_with_its_sequence_number_apart_is_written_and_compared_with_it():
    """exchange(..., header_seq): one packed header per call site, this call's number put in."""
    template = shmsync.HEADER.pack(0, 0, 1, 11, 12, 3, 0, 0)
    for theirs_seq, want in ((7, shmsync.ST_OK), (6, shmsync.ST_MISMATCH)):
        mem, addrs = regions(2)
        ctx = _shmsync.Ctx(addrs, 1, SLOT, 0)
        peer_posts(mem[0], 1, np.full(12, 2, dtype=np.float32), header=shmsync.HEADER.pack(theirs_seq, 0, 1, 11, 12,
                                                                                            3, 0, 0))
        x = np.ones(12, dtype=np.float32)
        assert ctx.exchange(template, x, DTYPE_CODES["float32"], 0, 1.0, 7) == want
        headers = np.empty((2, 8), dtype=np.int64)
        ctx.headers(headers)
        assert headers[1].tolist() == [7, 0, 1, 11, 12, 3, 0, 0]  # what this rank wrote
        np.testing.assert_array_equal(x, np.full(12, 3.0) if want == shmsync.ST_OK else np.ones(12))
    assert template == shmsync.HEADER.pack(0, 0, 1, 11, 12, 3, 0, 0)  # the caller's bytes untouched


def test_rejects_oversized_and_unsupported_input():
    _, addrs = regions(1)
    ctx = _shmsync.Ctx(addrs, 0, SLOT, 0)
    with pytest.raises(ValueError, match="bytes > slot"):
        ctx.exchange(None, np.ones(SLOT, dtype=np.float32), DTYPE_CODES["float32"], 0, 1.0)
    with pytest.raises(ValueError, match="unsupported dtype"):
        ctx.exchange(None, np.ones(4, dtype=np.float16), DTYPE_CODES["float16"], 0, 1.0)
    with pytest.raises(ValueError, match="rank"):
        _shmsync.Ctx(addrs, 1, SLOT, 0)
    assert ctx.seq == 0  # a refused call publishes nothing


def test_choose_algorithm_routes_small_messages_to_the_flag_exchange():
    one_node = plan.topology_from_keys([0, 0])
    two_nodes = plan.topology_from_keys([0, 0, 2, 2])
    assert plan.choose_algorithm(4096, one_node, small_shm=256 << 10) == "shm"
    assert plan.choose_algorithm(256 << 10, one_node, small_shm=256 << 10) == "shm"
    assert plan.choose_algorithm((256 << 10) + 1, one_node, small_shm=256 << 10) == "shm"  # piped
    assert plan.choose_algorithm((32 << 20) - 4, one_node, small_shm=256 << 10) == "shm"
    assert plan.choose_algorithm(32 << 20, one_node, small_shm=256 << 10) == "ring"  # large: the ring
    assert plan.choose_algorithm(16 << 20, one_node, small_shm=16 << 10) == "shm"
    assert plan.choose_algorithm(64 << 20, one_node, small_shm=0) == "ring"  # no flags: messages
    assert plan.choose_algorithm(4096, one_node, small_shm=0) == "native"
    assert plan.choose_algorithm(0, one_node, small_shm=256 << 10) == "native"
    assert plan.choose_algorithm(4096, two_nodes, small_shm=256 << 10) == "native"
    assert plan.choose_algorithm(4096, one_node, "ring", small_shm=256 << 10) == "ring"


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("dtype", ["int16", "int64", "float32", "float64"])
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_reduce_to_all_writes_the_rank_order_reduction_into_every_slot(dtype, op, streaming):
    rng = np.random.default_rng(3)
    count = 70001  # several 8 KiB blocks and a ragged tail; odd offsets test unaligned stores
    slots = [rng.integers(-50, 50, size=count + 3).astype(dtype) for _ in range(3)]
    part = [s[3:] for s in slots]
    kernel = {"sum": np.add, "avg": np.add, "max": np.maximum}[op]
    expected = part[0].copy()
    for p in part[1:]:
        kernel(expected, p, out=expected)
    if op == "avg":
        expected = (np.trunc(expected / 3) if np.dtype(dtype).kind == "i" else expected / np.dtype(dtype).type(3))
    heads = [s[:3].copy() for s in slots]
    where = part
    shmsync.reduce_to_all(where, where, count, DTYPE_CODES[dtype], op, 3, streaming)
    for s, head in zip(slots, heads):
        np.testing.assert_array_equal(s[3:], expected.astype(dtype))
        np.testing.assert_array_equal(s[:3], head)  # nothing written outside the slice


# --------------------------------------------------------------------------- piped all-reduce
def run_ranks(n, slot, body):
    """``body(ctx, rank)`` on n threads, each with its own Ctx over the same regions (the
    C calls release the GIL, so the ranks really run side by side); returns their results."""
    import threading

    mem = [np.zeros(_shmsync.REGION_HEADER_BYTES + 2 * slot, dtype=np.uint8) for _ in range(n)]
    addrs = mem
    ctxs = [_shmsync.Ctx(addrs, q, slot, 1 << 10) for q in range(n)]
    results, errors = [None] * n, []

    def run(q):
        try:
            results[q] = body(ctxs[q], q)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(q,)) for q in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "piped all-reduce hung"
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("count", [0, 1, 3, 1023, 1024, 5000, 20011])
def test_piped_allreduce_is_the_rank_order_reduction_on_every_rank(n, count):
    rng = np.random.default_rng(count + n)
    data = [rng.standard_normal(count).astype(np.float32) for _ in range(n)]
    expected = data[0].copy()
    for q in range(1, n):
        expected += data[q]

    def body(ctx, q):
        mine = data[q].copy()
        assert ctx.allreduce_piped(mine, DTYPE_CODES["float32"], shmsync.OP_CODES["sum"], n, None, 10.0,
                                   1024) == shmsync.ST_OK
        return mine, ctx.seq

    results = run_ranks(n, SLOT, body)
    for mine, seq in results:
        np.testing.assert_array_equal(mine, expected)  # bitwise: one owner reduces each element
        assert seq % 2 == 0 and seq >= 4  # an even number (≥ 2) of segments, two flags each


@pytest.mark.parametrize("dtype", ["int16", "int64", "float64"])
@pytest.mark.parametrize("op", ["avg", "min", "max", "prod"])
def test_piped_allreduce_ops_and_dtypes(dtype, op):
    n, count = 3, 3001
    rng = np.random.default_rng(5)
    data = [rng.integers(1, 4, size=count).astype(dtype) for _ in range(n)]
    kernel = {"avg": np.add, "min": np.minimum, "max": np.maximum, "prod": np.multiply}[op]
    expected = data[0].copy()
    for q in range(1, n):
        kernel(expected, data[q], out=expected)
    if op == "avg":
        expected = np.trunc(expected / n) if np.dtype(dtype).kind in "iu" else expected / n
    results = run_ranks(n, SLOT, lambda ctx, q: (
        lambda mine: (ctx.allreduce_piped(mine, DTYPE_CODES[dtype], shmsync.OP_CODES[op], n, None, 10.0, SLOT),
                      mine)[1])(data[q].copy()))
    for mine in results:
        np.testing.assert_array_equal(mine, expected.astype(dtype))


def test_piped_and_flag_exchanges_interleave_without_overwriting_a_slot_in_use():
    """Many piped all-reduces (odd and even segment counts asked for) mixed with small
    exchanges: every result exact, so no rank ever wrote a slot a peer was still reading."""
    n = 3
    sizes = [5000, 1500, 9000, 1024, 700]

    def body(ctx, q):
        for it in range(40):
            count = sizes[it % len(sizes)]
            big = np.full(count, q + it, dtype=np.float64)
            assert ctx.allreduce_piped(big, DTYPE_CODES["float64"], shmsync.OP_CODES["sum"], n, None, 10.0,
                                       1024 * (1 + it % 3)) == shmsync.ST_OK
            assert (big == sum(p + it for p in range(n))).all(), (it, q)
            small = np.full(100, q * it, dtype=np.int64)
            assert ctx.exchange(None, small, DTYPE_CODES["int64"], shmsync.OP_CODES["sum"], 10.0) == shmsync.ST_OK
            assert (small == sum(p * it for p in range(n))).all()
        return True

    assert all(run_ranks(n, SLOT, body))


def test_piped_allreduce_header_mismatch_and_timeout():
    n = 2
    header = [struct.pack("8q", 1, 0, 0, 11, 5000, 3, 0, 0), struct.pack("8q", 1, 0, 0, 11, 4000, 3, 0, 0)]

    def body(ctx, q):
        return ctx.allreduce_piped(np.ones(5000, np.float32), DTYPE_CODES["float32"], 0, n, header[q], 10.0, 1024)

    assert run_ranks(n, SLOT, body) == [shmsync.ST_MISMATCH] * 2
    mem, addrs = regions(2)
    ctx = _shmsync.Ctx(addrs, 0, SLOT, 0)
    start = time.monotonic()
    assert ctx.allreduce_piped(np.ones(5000, np.float32), DTYPE_CODES["float32"], 0, 2, None, 0.2,
                               1024) == shmsync.ST_TIMEOUT
    assert time.monotonic() - start < 5
    assert ctx.missing() == [1]


def test_piped_allreduce_refuses_bad_arguments():
    mem, addrs = regions(2)
    ctx = _shmsync.Ctx(addrs, 0, SLOT, 0)
    with pytest.raises(ValueError, match="unsupported dtype"):
        ctx.allreduce_piped(np.ones(10, np.float16), DTYPE_CODES["float16"], 0, 2, None, 1.0, 1024)
    with pytest.raises(ValueError, match="too small"):
        ctx.allreduce_piped(np.ones(10, np.float32), DTYPE_CODES["float32"], 0, 2, None, 1.0, 4)
    with pytest.raises(ValueError, match="contiguous"):
        ctx.allreduce_piped(np.ones(10, np.float32)[::2], DTYPE_CODES["float32"], 0, 2, None, 1.0, 1024)
    assert ctx.seq == 0


@pytest.mark.parametrize("n", [2, 3])
def test_piped_allreduce_of_a_list_reduces_the_concatenation_in_place(n):
    """Several buffers (empty ones, ones shorter than a segment, ones spanning many) reduced as
    their concatenation: gradient fusion with no bucket to copy into."""
    rng = np.random.default_rng(n)
    sizes = [0, 7, 1500, 0, 3, 2049, 1, 600]
    data = [[rng.standard_normal(k).astype(np.float32) for k in sizes] for _ in range(n)]
    expected = [data[0][i].copy() for i in range(len(sizes))]
    for i in range(len(sizes)):
        for q in range(1, n):
            expected[i] += data[q][i]

    def body(ctx, q):
        mine = [a.copy() for a in data[q]]
        assert ctx.allreduce_piped(mine, DTYPE_CODES["float32"], shmsync.OP_CODES["sum"], n, None, 10.0,
                                   1024) == shmsync.ST_OK
        empty = []
        assert ctx.allreduce_piped(empty, DTYPE_CODES["float32"], 0, n, None, 10.0, 1024) == shmsync.ST_OK
        return mine

    for mine in run_ranks(n, SLOT, body):
        for got, want in zip(mine, expected):
            np.testing.assert_array_equal(got, want)


def test_piped_allreduce_of_a_list_refuses_a_read_only_or_ragged_buffer():
    mem, addrs = regions(2)
    ctx = _shmsync.Ctx(addrs, 0, SLOT, 0)
    frozen = np.ones(10, np.float32)
    frozen.flags.writeable = False
    with pytest.raises((ValueError, BufferError), match="writable|read-only"):
        ctx.allreduce_piped([np.ones(10, np.float32), frozen], DTYPE_CODES["float32"], 0, 2, None, 1.0, 1024)
    with pytest.raises(ValueError, match="whole number"):
        ctx.allreduce_piped([np.ones(5, np.uint8)], DTYPE_CODES["float32"], 0, 2, None, 1.0, 1024)
    assert ctx.seq == 0


# --------------------------------------------------------------------------- buffers, bounds, NaN
def test_an_uninitialised_context_raises_instead_of_reading_null():
    ctx = _shmsync.Ctx.__new__(_shmsync.Ctx)
    calls = [lambda: ctx.exchange(None, None, 0, 0, 1.0),
             lambda: ctx.allreduce_piped(np.ones(4, np.float32), DTYPE_CODES["float32"], 0, 1, None, 1.0, 1024),
             lambda: ctx.headers(np.empty((1, 8), np.int64)), ctx.missing, lambda: ctx.seq]
    for call in calls:
        with pytest.raises(RuntimeError, match="not initialised"):
            call()
    with pytest.raises(ValueError, match="holds 16 bytes"):  # a failed __init__ leaves it unusable too
        ctx.__init__([np.zeros(16, np.uint8)], 0, SLOT, 0)
    with pytest.raises(RuntimeError, match="not initialised"):
        ctx.missing()


def test_regions_are_buffers_checked_against_the_slot_size():
    mem, _ = regions(2)
    with pytest.raises(TypeError):  # raw integer addresses are no longer taken
        _shmsync.Ctx([m.ctypes.data for m in mem], 0, SLOT, 0)
    with pytest.raises(ValueError, match="buffer 1 holds"):
        _shmsync.Ctx([mem[0], mem[1][:-1]], 0, SLOT, 0)
    frozen = mem[1].copy()
    frozen.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        _shmsync.Ctx([mem[0], frozen], 0, SLOT, 0)
    assert _shmsync.Ctx(mem, 1, SLOT, 0).seq == 0


def test_reduce_to_all_checks_every_bound_and_overlap():
    a, b = np.zeros(64, np.float32), np.zeros(64, np.float32)
    f32, total = DTYPE_CODES["float32"], shmsync.OP_CODES["sum"]
    with pytest.raises(ValueError, match="buffer 1 holds 252 bytes, 256 needed"):
        _shmsync.reduce_to_all([a], [a, b[1:]], 64, f32, total, 2, False)
    with pytest.raises(TypeError):
        _shmsync.reduce_to_all([a.ctypes.data], [a], 64, f32, total, 2, False)
    with pytest.raises(ValueError, match="destinations overlap"):
        _shmsync.reduce_to_all([a[:32], a[16:48]], [b], 32, f32, total, 1, False)
    with pytest.raises(ValueError, match="partly overlaps a source"):
        _shmsync.reduce_to_all([a[:32]], [a[8:40]], 32, f32, total, 1, False)
    with pytest.raises(ValueError, match="at least one source"):
        _shmsync.reduce_to_all([a], [], 64, f32, total, 1, False)
    ro = b.copy()
    ro.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        _shmsync.reduce_to_all([ro], [a], 64, f32, total, 1, False)
    a[:], b[:] = 1, 2
    _shmsync.reduce_to_all([a, b], [a, b], 64, f32, total, 2, False)  # in place: every slot its own source
    np.testing.assert_array_equal(a, np.full(64, 3))
    np.testing.assert_array_equal(b, np.full(64, 3))


NAN_CASES = [np.array(v, dtype=np.float64) for v in (
    [np.nan, 1.0, np.nan, 2.0, 0.0], [1.0, np.nan, np.nan, 3.0, -0.5], [0.5, 0.5, 7.0, np.nan, 9.0])]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_max_propagate_nan_on_every_kernel_as_numpy(dtype, op):
    """A NaN on any rank, in any operand position, gives NaN: the flag exchange, the one-pass
    slice kernel and the piped all-reduce agree with np.minimum / np.maximum."""
    kernel = {"min": np.minimum, "max": np.maximum}[op]
    data = [c.astype(dtype) for c in NAN_CASES]
    expected = kernel(kernel(data[0], data[1]), data[2])
    code, opc = DTYPE_CODES[dtype], shmsync.OP_CODES[op]
    mem, addrs = regions(3)
    ctx = _shmsync.Ctx(addrs, 1, SLOT, 0)
    for q in (0, 2):
        peer_posts(mem[q], 1, data[q])
    mine = data[1].copy()
    assert ctx.exchange(None, mine, code, opc, 1.0) == shmsync.ST_OK
    np.testing.assert_array_equal(mine, expected)
    slots = [d.copy() for d in data]
    shmsync.reduce_to_all(slots, slots, len(expected), code, op, 3, False)
    for s in slots:
        np.testing.assert_array_equal(s, expected)

    def body(c, q):
        x = np.tile(data[q], 300)
        assert c.allreduce_piped(x, code, opc, 3, None, 10.0, 1024) == shmsync.ST_OK
        return x

    for x in run_ranks(3, SLOT, body):
        np.testing.assert_array_equal(x, np.tile(expected, 300))


def test_every_extension_is_built_with_wrapping_signed_overflow():
    import re
    from pathlib import Path

    setup = (Path(__file__).resolve().parents[2] / "setup.py").read_text()
    flags = re.search(r"^C11 = (\[.*\])$", setup, re.M)
    extensions = re.findall(r"Extension\((.*?)optional=True\)", setup, re.S)
    assert flags and '"-fwrapv"' in flags.group(1)
    assert len(extensions) >= 3 and all("extra_compile_args=C11" in e for e in extensions)


def test_the_extension_loads_whichever_module_is_imported_first():
    """shmsync imported before the collectives (as comm.init() does in a script that imports
    nothing else) still finds its extension: without it every group runs without flags."""
    import subprocess
    import sys

    code = "import hpctrain.comm.shmsync as s, hpctrain.comm.mpiring as m; print(s._shmsync is not None, m._mpiring is not None)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True"]


@pytest.mark.parametrize("dtype,ranks", [("int8", 200), ("uint8", 256), ("int16", 40000)])
def test_an_average_over_more_ranks_than_the_dtype_holds(dtype, ranks):
    """The divisor is the rank count, not a value of the dtype: 200 ranks averaging int8 (or
    256 averaging uint8, where the count as the dtype would be 0) still divide by the count."""
    info = np.iinfo(dtype)
    data = np.array([info.max, info.min, -7 if info.min < 0 else 7, 0], dtype=dtype)
    out = data.copy()
    shmsync.reduce_to_all([out], [data], data.size, DTYPE_CODES[dtype], "avg", ranks, False)
    np.testing.assert_array_equal(out, np.trunc(data.astype(np.float64) / ranks).astype(dtype))
