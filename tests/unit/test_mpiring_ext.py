"""The C ring (extension ``_mpiring``) in one process: binding to the MPI library mpi4py
loaded, the size-1 and empty cases, and the arguments it refuses. The ring itself runs
under mpiexec (tests/mpi/test_comm_collectives.py, both rings, 1–4 ranks)."""

import array

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm import mpiring
from hpctrain.comm.buffers import DTYPE_CODES
from require import skip_or_fail

try:
    from hpctrain.comm import _mpiring
except ImportError as exc:  # optional extension: pip install succeeds without a compiler
    skip_or_fail("mpiring", f"hpctrain.comm._mpiring not built (no C compiler or Python headers at install): {exc}",
                 module_level=True)

F32 = DTYPE_CODES["float32"]


@pytest.fixture(autouse=True, scope="module")
def bound():
    """Every test calls the extension directly: bind it first, whichever test runs first (or
    alone, on an xdist worker)."""
    assert mpiring.available()


def call(buf, scratch, dtype=F32, op=0, rank=0, size=1, seg=1024):
    return _mpiring.allreduce(MPI.COMM_SELF.handle, MPI.BYTE.handle, rank, size, buf, scratch, dtype, op, size, seg)


def test_binds_to_the_mpi_library_mpi4py_loaded():
    assert mpiring.available()
    assert mpiring.usable(MPI.COMM_SELF) and mpiring.usable(MPI.COMM_SELF)  # agreed once, then cached


def test_one_rank_and_empty_buffers_are_left_alone():
    x = np.arange(10, dtype=np.float32)
    assert call(x, np.empty(64, np.uint8)) == 0
    np.testing.assert_array_equal(x, np.arange(10, dtype=np.float32))
    assert call(np.empty(0, np.float32), np.empty(64, np.uint8), size=2, rank=1) == 0


@pytest.mark.parametrize("kwargs, match", [
    ({"dtype": DTYPE_CODES["float16"]}, "unsupported dtype"),
    ({"dtype": DTYPE_CODES["bfloat16"]}, "unsupported dtype"),
    ({"op": 7}, "unsupported dtype"),
    ({"rank": 2, "size": 2}, "rank 2 of 2"),
    ({"size": 0}, "rank 0 of 0"),
    ({"seg": 2}, "segments of 2 bytes"),
])
def test_refuses_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        call(np.zeros(8, np.float32), np.empty(64, np.uint8), **kwargs)


def test_refuses_a_scratch_without_room_for_one_segment():
    with pytest.raises(ValueError, match="holds no"):
        call(np.zeros(1000, np.float32), np.empty(16, np.uint8), size=2, seg=256)


def test_refuses_read_only_buffers():
    x = np.zeros(8, np.float32)
    x.flags.writeable = False
    with pytest.raises((TypeError, BufferError, ValueError)):
        call(x, np.empty(64, np.uint8))


def test_scratch_holds_the_slots_of_one_chunk_at_most():
    seg = mpiring.SEGMENT_BYTES // 4
    assert mpiring.scratch_elements(10, 2, 4) == mpiring.SLOTS * 5
    assert mpiring.scratch_elements(10 * seg, 2, 4) == mpiring.SLOTS * seg
    assert mpiring.scratch_elements(0, 2, 4) == mpiring.SLOTS
    assert mpiring.kernel_dtype_code("float16") is None and mpiring.kernel_dtype_code("int64") is not None


def test_known_after_the_agreement_only():
    comm = MPI.COMM_SELF.Dup()
    try:
        assert mpiring.known(comm) is None  # not agreed yet: the ring must ask (a collective)
        assert mpiring.usable(comm) is True and mpiring.known(comm) is True
    finally:
        comm.Free()


def test_an_mpi_error_names_the_way_out(monkeypatch):
    monkeypatch.setattr(_mpiring, "allreduce", lambda *args: MPI.ERR_TRUNCATE)
    from hpctrain.comm.errors import CommError

    with pytest.raises(CommError, match="HPCTRAIN_RING_C=0"):
        mpiring.allreduce_(MPI.COMM_SELF, np.zeros(4, np.float32), F32, "sum", 1, np.empty(64, np.uint8))


# --------------------------------------------------------------------------- with fake MPI functions
class FakeMPI:
    """MPI_Isend/Irecv/Wait/Cancel as ctypes callbacks bound into the extension: each request
    is a number; a receive is filled at once from ``incoming`` (what the left neighbour sends);
    the ``fail_recv``-th receive fails with ``error``. Records what is posted and cancelled."""

    def __init__(self, incoming=None, fail_recv=None, error=15):
        import ctypes

        self.ctypes = ctypes
        self.incoming = incoming
        self.fail_recv, self.error = fail_recv, error
        self.posted, self.cancelled, self.recvs, self.next = {}, [], 0, 1
        # receives take the messages of ``incoming`` (an array: one message; a list: several) in turn
        self.messages = [] if incoming is None else list(incoming) if isinstance(incoming, list) else [incoming]
        self.sent = []  # the bytes of every send
        self.peers = []  # ("send" or "recv", the other rank) of every posted message, in order
        self.received = []  # the bytes each receive took
        self.on_wait = lambda: None  # called in every wait (the C call has released the GIL)
        post = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_int,
                                ctypes.c_int, ctypes.c_size_t, ctypes.c_void_p)
        self._fns = [post(self.isend), post(self.irecv),
                     ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)(self.wait),
                     ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(self.cancel)]

    def addresses(self):
        return [self.ctypes.cast(f, self.ctypes.c_void_p).value for f in self._fns]

    def _post(self, kind, req):
        self.ctypes.c_uint64.from_address(req).value = self.next
        self.posted[self.next] = kind
        self.next += 1
        return 0

    def isend(self, buf, nbytes, dtype, dest, tag, comm, req):
        self.sent.append(self.ctypes.string_at(buf, nbytes))
        self.peers.append(("send", dest))
        return self._post("send", req)

    def irecv(self, buf, nbytes, dtype, source, tag, comm, req):
        self.recvs += 1
        self.peers.append(("recv", source))
        if self.recvs == self.fail_recv:
            return self.error
        if self.messages:
            message = np.ascontiguousarray(self.messages.pop(0))
            assert message.nbytes <= nbytes, "a message larger than its receive (MPI: truncation)"
            self.ctypes.memmove(buf, message.ctypes.data, message.nbytes)
            self.received.append(message.nbytes)
        return self._post("recv", req)

    def wait(self, req, status):
        slot = self.ctypes.c_uint64.from_address(req)
        assert slot.value in self.posted, f"wait on request {slot.value}, which is not posted"
        del self.posted[slot.value]
        self.on_wait()
        slot.value = 0xDEAD  # as an MPI's non-zero MPI_REQUEST_NULL
        return 0

    def cancel(self, req):
        self.cancelled.append(self.ctypes.c_uint64.from_address(req).value)
        return 0


@pytest.fixture
def fake_mpi():
    """Bind fakes; bind the real MPI functions again afterwards (the binding is global)."""
    fakes = []

    def bind(**kwargs):
        fake = FakeMPI(**kwargs)
        _mpiring.bind(*fake.addresses())
        fakes.append(fake)
        return fake

    yield bind
    mpiring._bound.clear()
    assert mpiring._bind()


def test_an_mpi_error_cancels_and_completes_every_posted_request(fake_mpi):
    fake = fake_mpi(fail_recv=6)
    x = np.zeros(3000, np.float32)
    err = _mpiring.allreduce(1, 1, 0, 3, x, np.empty(4096, np.uint8), F32, 0, 3, 1024)
    assert err == 15
    assert fake.recvs == 6 and fake.cancelled  # it failed with requests in flight ...
    assert fake.posted == {}  # ... and none is left posted (each cancelled, then waited)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("op", ["min", "max"])
def test_min_and_max_propagate_nan_whichever_operand_holds_it(fake_mpi, dtype, op):
    # 2 ranks, rank 0: it reduces chunk 1 (the second half) from its own data and what the
    # left neighbour sends; NaN on either side must give NaN, as np.minimum / np.maximum
    mine = np.array([0, 0, 0, 0, np.nan, 1, np.nan, 2], dtype=dtype)
    theirs = np.array([1, np.nan, np.nan, 3], dtype=dtype)
    fake_mpi(incoming=theirs)
    x = mine.copy()
    code, kernel = shmsync_op(op)
    assert _mpiring.allreduce(1, 1, 0, 2, x, np.empty(4096, np.uint8), DTYPE_CODES[dtype], code, 2, 1024) == 0
    np.testing.assert_array_equal(x[4:], kernel(mine[4:], theirs))


def shmsync_op(op):
    from hpctrain.comm.shmsync import OP_CODES

    return OP_CODES[op], {"min": np.minimum, "max": np.maximum}[op]


def part(header: bytes, seq: int, state, data: np.ndarray) -> np.ndarray:
    """A part of the check as it travels: header (its first int64 the sequence), state
    [flag, decision] with the data's bytes appended, data."""
    words = np.frombuffer(header, np.int64).copy()
    words[0] = seq
    state = list(state) + [data.nbytes]
    return np.concatenate([words.view(np.uint8), np.array(state, np.int64).view(np.uint8), data.view(np.uint8)])


def check_args(x, clock, where=None, rows=80 + 32, header=bytes(range(56)), mine=None, decision=5, piece=4096):
    where = np.zeros(2, np.int32) if where is None else where
    mine = np.zeros(rows, np.uint8) if mine is None else mine
    return (1, 1, 1, schedule_words(1, 2), mine, np.zeros(rows, np.uint8), F32, 0, 2, 101, piece, where, clock,
            header, x, 7, decision)


def schedule_words(rank, size, node_of=None):
    from hpctrain.comm.plan import check_schedule

    return np.frombuffer(check_schedule(rank, size, node_of).encoded(), np.int32).copy()


def test_the_check_swaps_parts_and_reduces_with_the_lower_ranks_part_first(fake_mpi):
    """Rank 1 of 2: its part (header with the sequence put in, state [0, its decision], its
    data) goes to rank 0, rank 0's part comes in; the sum is rank 0's data + rank 1's, and the
    decision rank 0's. While it waits,
    the clock holds the monotonic time it began (what the stall watchdog reads, with no
    Python around the call) and ``where`` the rank and stage it waits for; after, 0."""
    import time

    header = bytes(range(56))
    fake = fake_mpi(incoming=part(header, 7, [0, 42], np.array([10, 20, 30, 40], np.float32)))
    clock = array.array("d", [0.0])
    where = np.zeros(2, np.int32)
    seen = []
    fake.on_wait = lambda: seen.append((clock[0], tuple(where)))
    x = np.arange(4, dtype=np.float32)
    mine = np.zeros(80 + 32, np.uint8)
    before = time.monotonic()
    err = _mpiring.check(*check_args(x, clock, where, mine=mine))
    after = time.monotonic()
    assert err == 0 and x.tolist() == [10, 21, 32, 43]
    assert fake.sent == [part(header, 7, [0, 5], np.arange(4, dtype=np.float32)).tobytes()]  # its decision: 5
    assert mine[56:80].view(np.int64).tolist() == [0, 42, 16]  # agreed; rank 0's decision; its data bytes
    assert seen and all(before <= t <= after and w == (0, 1) for t, w in seen), (before, seen, after)
    assert clock[0] == 0.0


def test_the_check_finds_a_header_that_differs_and_leaves_the_data(fake_mpi):
    header = bytes(range(56))
    other = bytearray(header)
    other[40] ^= 1  # another algorithm word
    fake_mpi(incoming=part(bytes(other), 7, [0, 0], np.ones(4, np.float32)))
    x = np.arange(4, dtype=np.float32)
    assert _mpiring.check(*check_args(x, array.array("d", [0.0]))) == -1
    assert x.tolist() == [0, 1, 2, 3]
    fake_mpi(incoming=part(header, 7, [1, 0], np.ones(4, np.float32)))  # the same header, a mismatch found before
    assert _mpiring.check(*check_args(x, array.array("d", [0.0]))) == -1


def test_a_node_leader_takes_its_nodes_part_first_swaps_across_and_sends_the_result_back(fake_mpi):
    """Rank 0 of 2 x 2 nodes: rank 1's part comes in (merged, rank 0's data on the left),
    then it swaps with leader 2 (its part now holds ranks 0 and 1) and sends the sum to rank 1;
    its data-bytes word stays its own."""
    header = bytes(range(56))
    fake = fake_mpi(incoming=[part(header, 7, [0, 9], np.full(4, 1, np.float32)),
                              part(header, 7, [0, 8], np.full(4, 100, np.float32))])
    x = np.arange(4, dtype=np.float32)
    mine = np.zeros(80 + 32, np.uint8)
    args = list(check_args(x, array.array("d", [0.0]), mine=mine))
    args[2], args[3] = 0, schedule_words(0, 4, (0, 0, 1, 1))
    assert _mpiring.check(*args) == 0
    assert x.tolist() == [101, 102, 103, 104]
    assert fake.peers == [("recv", 1), ("recv", 2), ("send", 2), ("send", 1)]
    assert fake.sent[0] == part(header, 7, [0, 5], np.arange(4, dtype=np.float32) + 1).tobytes()
    assert fake.sent[1] == part(header, 7, [0, 5], x).tobytes()  # the result, rank 0's decision


@pytest.mark.parametrize("mismatch", [False, True])
def test_a_rank_with_a_home_and_extras_forwards_the_homes_verdict_and_data(fake_mpi, mismatch):
    """Rank 5 of 7 on nodes (0,0,0,1,1,2,2): a leader folded into rank 0. It takes rank 6's
    part, sends the merged part home, and forwards what home sends (the verdict, rank 0's
    decision and, when agreed, the data) to rank 6; its own data becomes the result only when
    agreed."""
    header = bytes(range(56))
    result = part(header, 7, [int(mismatch), 3], np.full(4, 50, np.float32))
    fake = fake_mpi(incoming=[part(header, 7, [0, 0], np.full(4, 2, np.float32)), result])
    x = np.arange(4, dtype=np.float32)
    args = list(check_args(x, array.array("d", [0.0])))
    args[2], args[3] = 5, schedule_words(5, 7, (0, 0, 0, 1, 1, 2, 2))
    assert _mpiring.check(*args) == (-1 if mismatch else 0)
    assert fake.peers == [("recv", 6), ("recv", 0), ("send", 0), ("send", 6)]
    assert fake.sent[0] == part(header, 7, [0, 5], np.arange(4, dtype=np.float32) + 2).tobytes()
    forwarded = np.frombuffer(fake.sent[1], np.uint8)
    assert forwarded[56:80].view(np.int64).tolist() == [int(mismatch), 3, 16]
    assert x.tolist() == ([0, 1, 2, 3] if mismatch else [50] * 4)  # a mismatch leaves the caller's data


def test_the_check_refuses_a_schedule_that_is_not_one():
    x = np.zeros(4, np.float32)
    # (rank 1) itself as home, itself as partner, cut short, a home and partners, a negative rank
    for words in ([1, 0, 0], [-1, 0, 1, 1], [-1, 2, 3], [2, 0, 1, 0], [-1, 0, 1, -4], [-2, 0, 0]):
        args = list(check_args(x, array.array("d", [0.0])))
        args[3] = np.array(words, np.int32)
        with pytest.raises(ValueError, match="schedule"):
            _mpiring.check(*args)


def test_the_check_refuses_a_clock_or_where_it_cannot_write_or_rows_too_small():
    x = np.zeros(4, np.float32)
    with pytest.raises(ValueError, match="clock"):
        _mpiring.check(*check_args(x, bytearray(4)))
    with pytest.raises(ValueError, match="where"):
        _mpiring.check(*check_args(x, array.array("d", [0.0]), where=np.zeros(1, np.int32)))
    with pytest.raises(ValueError, match="rows"):
        _mpiring.check(*check_args(x, array.array("d", [0.0]), rows=80 + 8))
    with pytest.raises(ValueError, match="pieces"):
        _mpiring.check(*check_args(x, array.array("d", [0.0]), piece=72))


@pytest.mark.parametrize("piece,messages", [(256, [256, 224]), (200, [480]), (480, [480])])
def test_a_part_up_to_two_pieces_travels_in_two_messages_and_theirs_is_read_as_its_state_says(fake_mpi, piece,
                                                                                                messages):
    """A part of 80 + 400 bytes: as 256 + 224 bytes with pieces of 256 (more than one piece,
    at most two), whole with pieces of 200 (more than two) or 480 (one); rank 0's part comes
    the same way, its second message received as the first one's state says."""
    header = bytes(range(56))
    theirs = np.arange(100, dtype=np.float32) * 10
    incoming = part(header, 7, [0, 42], theirs)
    cuts = np.cumsum(messages)[:-1]
    fake = fake_mpi(incoming=np.split(incoming, cuts))
    x = np.arange(100, dtype=np.float32)
    rows = 80 + 400
    err = _mpiring.check(*check_args(x, array.array("d", [0.0]), rows=rows, mine=np.zeros(rows, np.uint8),
                                     piece=piece))
    assert err == 0 and x.tolist() == (theirs + np.arange(100, dtype=np.float32)).tolist()
    assert [len(m) for m in fake.sent] == messages
    assert b"".join(fake.sent) == part(header, 7, [0, 5], np.arange(100, dtype=np.float32)).tobytes()
    assert fake.received == messages and fake.posted == {}


def test_a_partner_with_less_data_is_received_whole_and_is_a_mismatch(fake_mpi):
    """The partner (in another call) sends a plain check's part, 80 bytes: one receive, no
    receive left waiting for pieces it never sends, and the headers differ."""
    header = bytes(range(56))
    other = bytearray(header)
    other[40] ^= 1
    fake = fake_mpi(incoming=part(bytes(other), 7, [0, 0], np.zeros(0, np.float32)))
    x = np.arange(100, dtype=np.float32)
    rows = 80 + 400
    err = _mpiring.check(*check_args(x, array.array("d", [0.0]), rows=rows, mine=np.zeros(rows, np.uint8), piece=256))
    assert err == -1 and fake.received == [80] and fake.posted == {}
    assert x.tolist() == list(range(100))
