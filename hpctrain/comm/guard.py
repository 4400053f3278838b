"""Cheap agreement check before each collective, and the watched wait around it.

Every rank sends a small header (sequence number, operation, reduction op, dtype, element
count with a code of the shape folded in, algorithm) to group rank 0, which compares them
and answers every rank with one verdict. A mismatch becomes a CollectiveMismatchError on
every rank, naming the ranks and what each called (with every rank's shape when the shapes
differ: gathered only then, so a call that agrees costs no more bytes). Because rank 0
knows whose header has not arrived, the stall watchdog can name the ranks that never
entered the collective. On one node with shared-memory flags the same check is one flag
exchange (``shmsync.NodeFlags.agree``).

A small all-reduce checked through rank 0 needs no collective of its own: its data rides
on the header (``InbandCall``), rank 0 reduces the rows in rank order and its verdict
carries the result. One round trip instead of the check's and MPI_Allreduce's, and a
mismatch is still found before any data is reduced.

Switch off with HPCTRAIN_CHECK_COLLECTIVES=0 (or ``set_checks(False)``) for speed; the
watchdog still catches stalls then, but cannot name the missing ranks as precisely.
"""
from __future__ import annotations

import zlib
from typing import Dict, List, Optional, Sequence

import numpy as np

from .. import settings
from .buffers import DTYPE_CODES, OPS
from .errors import CollectiveMismatchError
from .plan import ALGORITHMS
from .watchdog import raise_translated

_TAG_HEADER, _TAG_VERDICT, _TAG_MESSAGE = 101, 102, 103
HEADER_LEN = 7
HEADER_BYTES = 8 * HEADER_LEN
_VERDICT_BYTES = 16  # [0 (agreed) or 1, rank 0's decision], int64
# The most bytes rank 0 gathers for one in-band all-reduce (group size x message): above it the
# reduction at rank 0 (linear in the ranks) costs more than the collective it saves.
INBAND_GATHER_BYTES = 1024 * 1024


class Checks:
    """Whether the agreement check runs (``on``), read by the collectives on every call: an
    attribute, not a function, because the smallest all-reduces cost about a microsecond.
    Change it with ``set_checks`` (or HPCTRAIN_CHECK_COLLECTIVES), never by assignment."""

    __slots__ = ("on", "chosen")

    def __init__(self) -> None:
        self.on = True
        self.chosen = False  # set_checks() decided: the setting no longer applies


# From HPCTRAIN_CHECK_COLLECTIVES at comm.init() (not at import: a bad value is an error at
# init, never at import), unless set_checks() chose first.
CHECKS = Checks()

_OP_NAMES = ["allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall", "barrier",
             "broadcast_object", "allgather_object", "grouped_allreduce", "adasum", "join", "invalid_call"]
_RED_NAMES = ["-", *OPS]
_ALGO_NAMES = ["-", *ALGORITHMS]
_DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}


def set_checks(enabled: bool) -> None:
    """Turn the per-collective agreement check on or off (on by default)."""
    CHECKS.on = bool(enabled)
    CHECKS.chosen = True


def load_setting() -> None:
    """HPCTRAIN_CHECK_COLLECTIVES, unless ``set_checks`` chose already (called by init)."""
    if not CHECKS.chosen:
        CHECKS.on = settings.rc.check_collectives


def checks_enabled() -> bool:
    """Whether the agreement check runs (``CHECKS.on``)."""
    return CHECKS.on


def agree_or_count(group, header_fn, dog) -> None:
    """``agree`` when checks are on (``header_fn()`` builds the header only then)."""
    if CHECKS.on:
        agree(group, header_fn(), dog)
    else:
        group.seq += 1


_OP_INDEX = {name: i for i, name in enumerate(_OP_NAMES)}
_RED_INDEX = {name: i for i, name in enumerate(_RED_NAMES)}
_ALGO_INDEX = {name: i for i, name in enumerate(_ALGO_NAMES)}


def operation_index(name: str) -> int:
    return _OP_INDEX[name]


def reduction_index(op: str) -> int:
    return _RED_INDEX[op]


def algorithm_index(algorithm: str) -> int:
    return _ALGO_INDEX[algorithm]


def shape_code(shape: Sequence[int]) -> int:
    return zlib.crc32(repr(tuple(shape)).encode())


# The header's count word: the element count in bits 0-39 (counts up to 2**40), a 23-bit code
# of the shape in bits 40-62. A 1-D shape has code 0, so 1-D calls carry the bare count and
# any other shape (N-D, 0-d, a grouped call's list of shapes) a non-zero code.
_COUNT_BITS = 40
_COUNT_MASK = (1 << _COUNT_BITS) - 1
_CODE_RANGE = (1 << 23) - 1
_SHAPE_WORDS: Dict[object, int] = {}  # shape -> its code, shifted into place


def _shape_bits(shape) -> int:
    bits = _SHAPE_WORDS.get(shape)
    if bits is None:
        key = repr(tuple(d if isinstance(d, (str, tuple)) else int(d) for d in shape))
        bits = (zlib.crc32(key.encode()) % _CODE_RANGE + 1) << _COUNT_BITS
        if len(_SHAPE_WORDS) > 4096:  # shapes a program uses are few; bound the cache anyway
            _SHAPE_WORDS.clear()
        _SHAPE_WORDS[shape] = bits
    return bits


def count_word(shape, count: int) -> int:
    """The header's count word for ``count`` elements of ``shape`` (a tuple of ints, or for a
    grouped call a tuple of such tuples, marked by ``grouped_shape``)."""
    if len(shape) == 1 and not isinstance(shape[0], (str, tuple)):
        return count
    return count | _shape_bits(shape)


def grouped_shape(shapes: Sequence[Sequence[int]]) -> tuple:
    """The shape a grouped all-reduce agrees on: every array's shape, in order."""
    return ("grouped",) + tuple(tuple(int(d) for d in s) for s in shapes)


def _shape_of_word(word: int) -> int:
    return word >> _COUNT_BITS if word >= 0 else 0


def named_shape(name: str, shape) -> tuple:
    """What the ranks agree on for a collective called ``name`` (Horovod matches by name):
    the name folded into the header's shape code with the shape."""
    return ("named", str(name), plain_shape(shape))


def _show_shape(shape) -> str:
    if shape and shape[0] == "named":
        return f"{_show_shape(shape[2])} named {shape[1]!r}"
    if shape and shape[0] == "grouped":
        return "shapes [" + ", ".join(str(s) for s in shape[1:]) + "]"
    return f"shape {tuple(shape)}"


def make_header(seq: int, op: str, reduction: str = "-", dtype: str = "", count: int = -1,
                algorithm: str = "-", extra: int = 0) -> np.ndarray:
    return np.array((seq, _OP_INDEX[op], _RED_INDEX[reduction], DTYPE_CODES.get(dtype, -1), count,
                     _ALGO_INDEX[algorithm], extra), dtype=np.int64)


def describe_header(h: Sequence[int], shape=None) -> str:
    """One call, as its header shows it; ``shape``: that rank's shape, when known."""
    seq, op, red, dt, word, algo, extra = (int(v) for v in h)
    if _OP_NAMES[op] == "invalid_call":
        return f"a call whose arguments it refused (its own error says why) [collective #{seq}]"
    parts = []
    if red > 0:
        parts.append(_RED_NAMES[red])
    if dt >= 0:
        parts.append(_DTYPE_NAMES.get(dt, f"dtype#{dt}"))
    if word >= 0:
        count = f"{word & _COUNT_MASK} elements"
        if shape is not None:
            count += f" of {_show_shape(shape)}"
        elif _shape_of_word(word):
            count += f" of shape #{_shape_of_word(word):06x}"
        parts.append(count)
    if algo > 0:
        parts.append(_ALGO_NAMES[algo])
    if extra:
        parts.append(f"shape/root #{extra}")
    return f"{_OP_NAMES[op]}({', '.join(parts)}) [collective #{seq}]"


def shapes_differ(headers: np.ndarray) -> bool:
    """Whether the ranks' headers differ in the shape code (then their shapes are worth gathering)."""
    return len({_shape_of_word(int(h[4])) for h in headers}) > 1


def mismatch_message(headers: np.ndarray, group, shapes: Optional[Sequence] = None) -> str:
    """Group ranks by what they called; ``shapes``: every rank's shape (None: not gathered).
    Pure so that it can be unit-tested."""
    by_call: Dict[str, List[int]] = {}
    for r, h in enumerate(headers):
        by_call.setdefault(describe_header(h, None if shapes is None else shapes[r]), []).append(r)
    lines = [f"  {group.describe_ranks(ranks)} called {call}" for call, ranks in by_call.items()]
    return (
        f"ranks of group '{group.name}' entered different collectives:\n" + "\n".join(lines) +
        "\nHINT: every rank must call the same collective with the same shape, dtype and op, "
        "in the same order."
    )


def agree(group, header: np.ndarray, dog, shape=None, decision: int = 0) -> int:
    """Check that every rank of ``group`` entered the same collective; raise on mismatch.
    ``shape``: this rank's shape (whose code the header's count word holds), named in the
    error when the ranks' shapes differ. Where the check goes through group rank 0 (across
    nodes, or without the shared-memory flags), rank 0's ``decision`` rides on its verdict and
    is returned on every rank (auto's run-time pick across nodes); elsewhere, and with the
    check off, 0 is returned."""
    group.seq += 1
    if not CHECKS.on or group.size == 1:
        return 0
    header[0] = group.seq
    what = lambda: describe_header(header) + f" on {group.name}"  # noqa: E731 - only for a stall report
    if group.small_shm:  # one node: one flag exchange in shared memory
        group.node_flags.agree(header, dog, lambda: what() + " (agreement check)", group.describe_ranks, group,
                               shape=shape)
        return 0
    if group.rank == 0:
        return _coordinate(group, header, dog, shape, decision, what)
    from mpi4py import MPI

    comm = group.ctl_comm
    comm.Send([header, MPI.BYTE], dest=0, tag=_TAG_HEADER)  # bytes: rank 0's rows take in-band data too
    verdict = np.empty(2, dtype=np.int64)  # [0 (agreed) or 1, rank 0's decision]
    _await_verdict(group, comm, [verdict, MPI.BYTE], verdict, dog, shape, what)
    return int(verdict[1])


def _await_verdict(group, comm, buf, verdict: np.ndarray, dog, shape, what, source: int = 0) -> None:
    """A rank other than 0: receive rank 0's verdict into ``buf`` (whose first 16 bytes are
    ``verdict``; ``source``: where it comes from, see ``plan.inband_fanout``); raise the
    mismatch it reports."""
    with _watch_verdict(group, dog, what):
        comm.Recv(buf, source=source, tag=_TAG_VERDICT)
    if verdict[0] != 0:
        _mismatched(group, None, dog, shape, what)


# numpy's reduction for each op; min and max propagate NaN as every other algorithm does
_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_INBAND_KINDS = "fiuc"


def inband_limit(setting: int, size: int) -> int:
    """The largest all-reduce (bytes) whose data rides on the agreement header for a group of
    ``size`` ranks checked through rank 0: ``setting`` (HPCTRAIN_CHECK_INBAND_BYTES), bounded
    so that rank 0 gathers at most INBAND_GATHER_BYTES, in whole 8-byte words (the rows' int64
    headers stay aligned); 0 for one rank."""
    if size < 2:
        return 0
    return min(setting, INBAND_GATHER_BYTES // size) // 8 * 8


def inband_reducible(dtype_name: str, dtype: np.dtype, op: str) -> bool:
    """Whether rank 0 reduces this dtype and op itself as MPI would (numbers; bfloat16, held
    as int16, and bool, whose sum is a logical or, go through MPI)."""
    return dtype.kind in _INBAND_KINDS and dtype_name != "bfloat16" and op in _UFUNCS


def reduce_rows(rows: np.ndarray, op: str, out: np.ndarray, size: int, dtype_name: str) -> None:
    """Rank 0's in-band reduction: ``rows`` (one row per rank, in rank order) reduced into
    ``out`` in rank order, so every rank gets the same bits; float16 adds and multiplies in
    float32 (as MPI without float16 reductions does here); ``avg`` divides by ``size``."""
    from .buffers import finish_average

    ufunc = _UFUNCS[op]
    with np.errstate(all="ignore"):  # overflow gives inf, as from MPI: no numpy warning
        if rows.dtype == np.float16 and op in ("sum", "avg", "prod"):
            np.copyto(out, ufunc.reduce(rows, axis=0, dtype=np.float32), casting="unsafe")
        else:
            ufunc.reduce(rows, axis=0, out=out)
    if op == "avg":
        finish_average(out, size, dtype_name)


class InbandCall:
    """``agree`` for small all-reduces of one kind (group, header, dtype, op) checked through
    rank 0, their data riding on the header: rank 0 checks the headers, reduces the rows in
    rank order and sends the result with its verdict. Made once per kind (the collectives
    cache it) and called with each array: ``call(x, shape)`` reduces ``x`` (contiguous,
    writable) in place. Use only where ``agree`` goes through rank 0 with the check on and
    ``x.nbytes <= group.inband`` (``inband_reducible``); a rank whose call differs sends a
    plain header, which rank 0 finds mismatched before anything is reduced.

    Where the C kernels take the dtype (``code``: ``mpiring.inband_code``), a call is one C
    call with its fixed arguments bound here; it times itself for the stall watchdog (a
    ``ClockedWait`` registered here), so no Python runs around it: across nodes with more
    ranks than cores each microsecond of Python costs several of the call's time. Otherwise
    (``code`` None), or while another thread holds the group's CheckIO, the same messages go
    through Python (rank 0 reduces with numpy).

    ``template``: the header with sequence 0 (not changed); ``packed``: its bytes."""

    __slots__ = ("group", "template", "op", "dtype_name", "dog", "io", "run", "wait")

    def __init__(self, group, template: np.ndarray, code: Optional[int], packed: bytes, op: str, dtype_name: str,
                 dog) -> None:
        self.group, self.template, self.op, self.dtype_name, self.dog = group, template, op, dtype_name, dog
        self.io = self.run = self.wait = None
        if code is None:
            return
        io = self.io = _io(group)
        io.busy = False
        if group.rank == 0:
            self.wait = dog.clocked(lambda: self.what() + " (agreement check)",
                                    lambda: _not_arrived(group, io.headers))
        else:
            self.wait = dog.clocked(lambda: self.what() + _WAITING_FOR_ROOT, _root_report(group), grace=_ROOT_GRACE)
        self.run = _mpiring().inband_call(group.ctl_comm, group.rank, group.size, io.rows, io.reply, packed, code,
                                          op, _TAGS, group.inband_forwarded, group.inband_fanout, self.wait.clock)

    def what(self) -> str:
        """The call in progress, for a stall report (its sequence number is the group's)."""
        return describe_header(_sequenced(self.template, self.group.seq)) + f" on {self.group.name}"

    def __call__(self, x: np.ndarray, shape=None) -> None:
        group, io = self.group, self.io
        if self.run is None or io.busy or group.check_io is not io:
            self._in_python(x, shape)
            return
        io.busy = True
        group.seq += 1
        try:
            err = self.run(x, group.seq)
        finally:
            io.busy = False
        if err:
            self._failed(err, shape)

    def _failed(self, err: int, shape) -> None:
        """After the C call returned ``err``: an MPI error (> 0) raised as such (a lost rank
        in an elastic job as RanksLostError), or a mismatch (-1) raised on every rank."""
        if err > 0:
            try:
                _mpiring()._failed(err, "the agreement check (with a small all-reduce's data)")
            except Exception as exc:
                raise_translated(exc)
        headers = self.io.headers.copy() if self.group.rank == 0 else None
        _mismatched(self.group, headers, self.dog, shape, self.what)

    def _in_python(self, x: np.ndarray, shape) -> None:
        """The call's messages through Python: rank 0 through ``_coordinate`` (numpy reduces
        the rows), the others through ``_send_row``."""
        group = self.group
        group.seq += 1
        header = _sequenced(self.template, group.seq)
        flat = x.reshape(-1)
        if group.rank == 0:
            _coordinate(group, header, self.dog, shape, 0, self.what, flat, self.op, self.dtype_name)
            return
        io = _io(group)
        try:
            io.headers[0] = header
            _send_row(group, io, flat, self.dog, shape, self.what)
        finally:
            io.busy = False


_TAGS = (_TAG_HEADER, _TAG_VERDICT)


def _sequenced(template: np.ndarray, seq: int) -> np.ndarray:
    header = template.copy()
    header[0] = seq
    return header


_MODULES: dict = {}


def _mpiring():
    """hpctrain.comm.mpiring, imported at the first in-band call (importing it loads MPI)."""
    module = _MODULES.get("mpiring")
    if module is None:
        from . import mpiring as module

        _MODULES["mpiring"] = module
    return module


def _send_row(group, io, flat: np.ndarray, dog, shape, what) -> None:
    """A rank other than 0, in Python: send the header (in ``io``'s row 0) and ``flat``'s data,
    receive the verdict and the result into ``flat`` (from rank 0, or where replies are passed
    on from any source), and pass an agreed reply on to ``group.inband_fanout``."""
    from mpi4py import MPI

    n = flat.nbytes
    io.rows[0, HEADER_BYTES:HEADER_BYTES + n] = flat.view(np.uint8)
    comm = group.ctl_comm
    reply = [io.reply, _VERDICT_BYTES + n, MPI.BYTE]
    comm.Send([io.rows[0], HEADER_BYTES + n, MPI.BYTE], dest=0, tag=_TAG_HEADER)
    source = MPI.ANY_SOURCE if group.inband_forwarded else 0
    _await_verdict(group, comm, reply, io.verdict, dog, shape, what, source)
    if group.inband_fanout:
        MPI.Request.Waitall([comm.Isend(reply, dest=r, tag=_TAG_VERDICT) for r in group.inband_fanout])
    flat.view(np.uint8)[:] = io.reply[_VERDICT_BYTES:_VERDICT_BYTES + n]


_WAITING_FOR_ROOT = " (waiting for rank 0's agreement check)"
_ROOT_GRACE = 2.0  # s: a rank waiting for rank 0's verdict lets rank 0 report a stall first


def _root_report(group):
    return lambda: f"{group.describe_ranks([0])}, which coordinates the check (see its report)"


def _watch_verdict(group, dog, what):
    return dog.watch(lambda: what() + _WAITING_FOR_ROOT, _root_report(group), grace=_ROOT_GRACE)


def _not_arrived(group, headers: np.ndarray) -> str:
    """The ranks whose header row rank 0 still waits for (read by the watchdog's thread while
    MPI fills the rows: a report only)."""
    return group.describe_ranks([r for r in range(1, group.size) if headers[r, 0] == _UNSET])


def _mismatched(group, headers: Optional[np.ndarray], dog, shape, what) -> None:
    """After a mismatch verdict: rank 0 sends every rank the ``headers`` (the others receive
    them: None here); every rank raises the same error."""
    comm = group.ctl_comm
    if group.rank == 0:
        for r in range(1, group.size):
            comm.send(headers, dest=r, tag=_TAG_MESSAGE)
    else:
        with _watch_verdict(group, dog, what):
            headers = comm.recv(source=0, tag=_TAG_MESSAGE)
    raise CollectiveMismatchError(mismatch_report(comm, headers, group, shape, dog, what), headers, group)


_UNSET = -1  # a header row's sequence word until that rank's header arrives (sequences start at 1)


class CheckIO:
    """One rank's buffers for the agreement check over MPI, made once per group. Group rank 0:
    a row per rank (header, then up to ``inband`` bytes of in-band data) with a persistent
    receive from each other rank, the reply (verdict, then an in-band result) with persistent
    sends of the verdict and, per in-band size, of verdict and result. Another rank: row 0 and
    the reply, to send and receive in-band calls. A small checked all-reduce across nodes
    waits for rank 0's Python between the headers and the verdict, on every rank: here that
    Python is a few calls. ``busy``: in use (a second thread's check on the same group gets a
    private one)."""

    __slots__ = ("comm", "rows", "headers", "reply", "verdict", "recvs", "sends", "replies", "busy", "fanout")

    _REPLY_SIZES = 64  # in-band sizes with persistent sends kept (a program uses few)

    def __init__(self, comm, size: int, inband: int, root: bool, fanout: Sequence[int] = ()) -> None:
        from mpi4py import MPI

        self.comm = comm
        self.fanout = tuple(fanout)  # where an agreed in-band reply goes (plan.inband_fanout)
        self.rows = np.empty((size if root else 1, HEADER_BYTES + inband), dtype=np.uint8)
        self.headers = self.rows[:, :HEADER_BYTES].view(np.int64)
        self.reply = np.zeros(_VERDICT_BYTES + inband, dtype=np.uint8)
        self.verdict = self.reply[:_VERDICT_BYTES].view(np.int64)
        self.recvs = [comm.Recv_init([self.rows[r], MPI.BYTE], source=r, tag=_TAG_HEADER)
                      for r in range(1, size)] if root else []
        self.sends = self._sends(_VERDICT_BYTES, range(1, size)) if root else []
        self.replies: Dict[int, list] = {}
        self.busy = False

    def _sends(self, nbytes: int, dests) -> list:
        from mpi4py import MPI

        return [self.comm.Send_init([self.reply, nbytes, MPI.BYTE], dest=r, tag=_TAG_VERDICT) for r in dests]

    def reply_sends(self, nbytes: int) -> list:
        """Persistent sends of the verdict and ``nbytes`` of result, to the fanout ranks."""
        sends = self.replies.get(nbytes)
        if sends is None:
            if len(self.replies) >= self._REPLY_SIZES:
                self._free(r for rs in self.replies.values() for r in rs)
                self.replies.clear()
            sends = self.replies[nbytes] = self._sends(_VERDICT_BYTES + nbytes, self.fanout)
        return sends

    def free(self) -> None:
        self._free(self.recvs + self.sends + [r for rs in self.replies.values() for r in rs])
        self.recvs, self.sends, self.replies = [], [], {}

    @staticmethod
    def _free(requests) -> None:
        for request in requests:
            try:
                request.Free()
            except Exception:  # its communicator already revoked (elastic jobs)
                pass


def _io(group) -> CheckIO:
    """The group's CheckIO, marked busy (a private one if another thread holds it)."""
    io = group.check_io
    if io is None or io.busy:
        io = CheckIO(group.ctl_comm, group.size, group.inband, group.rank == 0, group.inband_fanout)
        if group.check_io is None:
            group.check_io = io
    io.busy = True
    return io


def _coordinate(group, header: np.ndarray, dog, shape, decision: int, what, flat: Optional[np.ndarray] = None,
                op: str = "", dtype_name: str = "") -> int:
    """Rank 0's part of ``agree`` over MPI: every header in, one verdict out (with
    ``decision``); a mismatch also sends every rank the headers, then raises. With ``flat``
    (``InbandCall``): the rows' in-band data reduced into ``flat`` and sent with the verdict."""
    from mpi4py import MPI

    io = _io(group)
    try:
        headers = io.headers
        headers[0] = header
        headers[1:, 0] = _UNSET
        MPI.Prequest.Startall(io.recvs)
        with dog.watch(lambda: what() + " (agreement check)", lambda: _not_arrived(group, headers)):
            MPI.Request.Waitall(io.recvs)
        ok = not (headers != headers[0]).any()
        io.verdict[0], io.verdict[1] = (0, decision) if ok else (1, 0)
        sends = io.sends
        if ok and flat is not None:
            sends = io.reply_sends(_reduce_inband(io, flat, op, dtype_name, group.size))
        MPI.Prequest.Startall(sends)
        MPI.Request.Waitall(sends)
        if ok:
            return decision
        headers = headers.copy()
    finally:
        io.busy = False
    _mismatched(group, headers, dog, shape, what)


def _reduce_inband(io: CheckIO, flat: np.ndarray, op: str, dtype_name: str, size: int) -> int:
    """Rank 0: its own ``flat`` into row 0, every row's data reduced into the reply and back
    into ``flat``; returns the bytes of the result."""
    n = flat.nbytes
    data = io.rows[:, HEADER_BYTES:HEADER_BYTES + n]
    data[0] = flat.view(np.uint8)
    result = io.reply[_VERDICT_BYTES:_VERDICT_BYTES + n].view(flat.dtype)
    reduce_rows(data.view(flat.dtype), op, result, size, dtype_name)
    np.copyto(flat, result)
    return n


def plain_shape(shape):
    """``shape`` as plain Python (tuples of ints), to send to other ranks; None stays None."""
    if shape is None:
        return None
    return tuple(d if isinstance(d, (str, tuple)) else int(d) for d in shape)


def mismatch_report(comm, headers: np.ndarray, group, shape, dog, what) -> str:
    """The error every rank raises for a mismatch that every rank of ``comm`` has seen (the
    same ``headers`` everywhere): when the shapes differ, each rank's shape is gathered (one
    allgather, on this error path only) and named."""
    shapes = None
    if shapes_differ(headers):
        with dog.watch(lambda: (what() if callable(what) else what) + " (gathering the shapes of a mismatch)",
                       lambda: f"one or more of the {comm.Get_size()} ranks of group '{group.name}'"):
            shapes = comm.allgather(plain_shape(shape))
    return mismatch_message(headers, group, shapes)
