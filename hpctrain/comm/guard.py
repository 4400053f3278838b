"""Cheap agreement check before each collective, and the watched wait around it.

Every rank sends a small header (sequence number, operation, reduction op, dtype, element
count with a code of the shape folded in, algorithm) to group rank 0, which compares them
and answers every rank with one verdict. A mismatch becomes a CollectiveMismatchError on
every rank, naming the ranks and what each called (with every rank's shape when the shapes
differ: gathered only then, so a call that agrees costs no more bytes). Because rank 0
knows whose header has not arrived, the stall watchdog can name the ranks that never
entered the collective. On one node with shared-memory flags the same check is one flag
exchange (``shmsync.NodeFlags.agree``).

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

_TAG_HEADER, _TAG_VERDICT, _TAG_MESSAGE = 101, 102, 103
HEADER_LEN = 7


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
    comm = group.ctl_comm
    comm.Send(header, dest=0, tag=_TAG_HEADER)
    verdict = np.empty(2, dtype=np.int64)  # [0 (agreed) or 1, rank 0's decision]
    with dog.watch(lambda: what() + " (waiting for rank 0's agreement check)",
                   lambda: f"{group.describe_ranks([0])}, which coordinates the check (see its report)", grace=2.0):
        comm.Recv(verdict, source=0, tag=_TAG_VERDICT)
        if verdict[0] != 0:
            headers = comm.recv(source=0, tag=_TAG_MESSAGE)
    if verdict[0] != 0:
        raise CollectiveMismatchError(mismatch_report(comm, headers, group, shape, dog, what), headers, group)
    return int(verdict[1])


_UNSET = -1  # a header row's sequence word until that rank's header arrives (sequences start at 1)


class CheckIO:
    """Group rank 0's side of the agreement check over MPI, made once per group: the headers'
    rows and persistent receives (one per other rank), the verdict and persistent sends. A
    small checked all-reduce across nodes waits for rank 0's Python between the headers and
    the verdict, on every rank: here that Python is a few calls. ``busy``: in use (a second
    thread's check on the same group gets a private one)."""

    __slots__ = ("headers", "verdict", "recvs", "sends", "busy")

    def __init__(self, comm, size: int) -> None:
        self.headers = np.empty((size, HEADER_LEN), dtype=np.int64)
        self.verdict = np.zeros(2, dtype=np.int64)
        self.recvs = [comm.Recv_init(self.headers[r], source=r, tag=_TAG_HEADER) for r in range(1, size)]
        self.sends = [comm.Send_init(self.verdict, dest=r, tag=_TAG_VERDICT) for r in range(1, size)]
        self.busy = False

    def free(self) -> None:
        for request in self.recvs + self.sends:
            try:
                request.Free()
            except Exception:  # its communicator already revoked (elastic jobs)
                pass
        self.recvs, self.sends = [], []


def _coordinate(group, header: np.ndarray, dog, shape, decision: int, what) -> int:
    """Rank 0's part of ``agree`` over MPI: every header in, one verdict out (with
    ``decision``); a mismatch also sends every rank the headers, then raises."""
    from mpi4py import MPI

    io = group.check_io
    if io is None or io.busy:
        io = CheckIO(group.ctl_comm, group.size)
        if group.check_io is None:
            group.check_io = io
    io.busy = True
    try:
        headers = io.headers
        headers[0] = header
        headers[1:, 0] = _UNSET

        def missing() -> str:  # read by the watchdog's thread while MPI fills the rows: a report only
            return group.describe_ranks([r for r in range(1, group.size) if headers[r, 0] == _UNSET])

        MPI.Prequest.Startall(io.recvs)
        with dog.watch(lambda: what() + " (agreement check)", missing):
            MPI.Request.Waitall(io.recvs)
        ok = not (headers != headers[0]).any()
        io.verdict[0], io.verdict[1] = (0, decision) if ok else (1, 0)
        MPI.Prequest.Startall(io.sends)
        MPI.Request.Waitall(io.sends)
        if ok:
            return decision
        headers = headers.copy()
    finally:
        io.busy = False
    comm = group.ctl_comm
    for r in range(1, group.size):
        comm.send(headers, dest=r, tag=_TAG_MESSAGE)
    raise CollectiveMismatchError(mismatch_report(comm, headers, group, shape, dog, what), headers, group)


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
