"""Cheap agreement check before each collective, and the watched wait around it.

Every rank's small header (sequence number, operation, reduction op, dtype, element count
with a code of the shape folded in, algorithm) is compared with every other rank's, and a
mismatch becomes a CollectiveMismatchError on every rank, naming the ranks and what each
called (with every rank's shape when the shapes differ: gathered only then, so a call that
agrees costs no more bytes). On one node with shared-memory flags the check is one flag
exchange (``shmsync.NodeFlags.agree``).

Over MPI (across nodes, or without the flags) the ranks swap their parts along
``plan.check_schedule``: across nodes each node's ranks fold into its leader (a binomial tree
on the node), the leaders swap by recursive doubling, and the result goes back down the
trees; on one node every rank takes part in the recursive doubling. A part is the header, a
state [mismatch flag, rank 0's decision, the part's data bytes] and, for a small all-reduce
(``InbandCall``), its data, reduced as the parts merge. Every checked call sends its part the
same way whatever it is (one message, or two for 60-120 KiB: ``CHECK_PIECE_BYTES``; the first
says what follows), so ranks in different collectives never wait on a message that is not
sent; after the last step every rank knows the verdict (and rank 0's decision: auto's
run-time pick across nodes) in the same call, and only then, on a mismatch, the headers are
gathered for the error. One message per step per node crosses the network, as in a
hierarchical MPI all-reduce: a checked small all-reduce costs about what the unchecked one
does.

Switch off with HPCTRAIN_CHECK_COLLECTIVES=0 (or ``set_checks(False)``) for speed; the
watchdog still catches stalls then, but cannot name the missing ranks as precisely. Small
``auto`` all-reduces over MPI still travel in the check's messages then (faster than
MPI_Allreduce across nodes), so a mismatch among them is still found.
"""
from __future__ import annotations

import functools
import zlib
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from .. import settings
from .buffers import DTYPE_CODES, OPS
from .errors import CollectiveMismatchError
from .plan import ALGORITHMS, check_transfers
from .watchdog import raise_translated

_TAG_CHECK = 101
HEADER_LEN = 7
HEADER_BYTES = 8 * HEADER_LEN
# after the header: [0 (agreed so far) or 1, rank 0's decision, the part's data bytes], int64
_STATE_BYTES = 24
_PART_BYTES = HEADER_BYTES + _STATE_BYTES
# A part of the check over MPI of more than this and at most twice this travels as two
# messages, this many bytes (header and state included) and the rest; any other part as one.
# Below TCP's 64 KiB eager limit (Open MPI's btl_tcp_eager_limit, header included): above it
# a message waits for a rendezvous round trip before its bulk leaves (a 64 KiB in-band
# all-reduce across 2 x 2 nodes took 1-15% less time in two messages). The same on every rank.
CHECK_PIECE_BYTES = 60 << 10
# The most in-band bytes one rank receives in one check (data x the parts it takes:
# plan.check_transfers): every step and every level of a node's tree moves the whole message,
# where the ring sends twice the message in all, so with more ranks the data that rides on
# the check shrinks (256 KiB at 4 ranks, 128 KiB at 16 on one node or 2 x 8).
INBAND_SWAP_BYTES = 512 * 1024


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
    error when the ranks' shapes differ. Where the check runs over MPI (across nodes, or
    without the shared-memory flags), rank 0's ``decision`` rides on it and is returned on
    every rank (auto's run-time pick across nodes); elsewhere, and with the check off, 0 is
    returned."""
    group.seq += 1
    if not CHECKS.on or group.size == 1:
        return 0
    header[0] = group.seq
    what = lambda: describe_header(header) + f" on {group.name}"  # noqa: E731 - only for a stall report
    if group.small_shm:  # one node: one flag exchange in shared memory
        group.node_flags.agree(header, dog, lambda: what() + " (agreement check)", group.describe_ranks, group,
                               shape=shape)
        return 0
    io = _io(group)
    try:
        run = _plain_call(group, io, dog)
        if run is None:
            return _exchange(group, io, header, dog, shape, what, decision)
        io.what = what
        err = run(header, _NO_DATA, group.seq, decision)
        decision = int(io.words[HEADER_LEN + 1])
    finally:
        io.busy = False
    if err:
        _check_failed(group, err, header, dog, shape, what)
    return decision


_NO_DATA = np.zeros(0, dtype=np.float32)


def _plain_call(group, io: "CheckIO", dog):
    """The C check for plain headers bound to the group's CheckIO (made at its first use),
    or None: the check in Python (no C extension, or ``io`` is a second thread's)."""
    if io is not group.check_io:
        return None
    if io.plain is None:
        mpiring = _mpiring()
        io.plain = False
        if mpiring.available():
            io.wait = dog.clocked(lambda: io.what() + _CHECKING, _waited_for(group, io.where),
                                  _stage_grace(group.check_schedule, io.where))
            io.plain = mpiring.check_call(group.ctl_comm, group.rank, group.size, group.check_schedule, io.mine,
                                          io.theirs, mpiring.kernel_dtype_code("float32"), "sum", _TAG_CHECK,
                                          io.where, io.wait.clock)
    return io.plain or None


def _check_failed(group, err: int, header: np.ndarray, dog, shape, what) -> None:
    """After the C check returned ``err``: an MPI error (> 0) raised as such (a lost rank in
    an elastic job as RanksLostError), or a mismatch (-1) raised on every rank."""
    if err > 0:
        try:
            _mpiring()._failed(err, "the agreement check")
        except Exception as exc:
            raise_translated(exc)
    _mismatched(group, header, dog, shape, what)


# numpy's reduction for each op; min and max propagate NaN as every other algorithm does
_UFUNCS = {"sum": np.add, "avg": np.add, "prod": np.multiply, "min": np.minimum, "max": np.maximum}
_INBAND_KINDS = "fiuc"


def inband_limit(setting: int, size: int, node_of: Optional[Sequence[int]] = None) -> int:
    """The largest all-reduce (bytes) whose data rides on the agreement check over MPI for a
    group of ``size`` ranks (on nodes ``node_of``: ``plan.check_schedule``): ``setting``
    (HPCTRAIN_CHECK_INBAND_BYTES), bounded so that no rank receives more than
    INBAND_SWAP_BYTES of data in one check, in whole 8-byte words (the parts' int64 words stay
    aligned); 0 for one rank."""
    if size < 2:
        return 0
    return min(setting, INBAND_SWAP_BYTES // check_transfers(size, node_of)) // 8 * 8


def inband_reducible(dtype_name: str, dtype: np.dtype, op: str) -> bool:
    """Whether the check reduces this dtype and op itself as MPI would (numbers; bfloat16,
    held as int16, and bool, whose sum is a logical or, go through MPI)."""
    return dtype.kind in _INBAND_KINDS and dtype_name != "bfloat16" and op in _UFUNCS


def inband_dtype(dtype_name: str) -> bool:
    """``inband_reducible`` for every op the all-reduce takes: whether the dtype can ride on
    the check (what an all-reduce's route, decided per dtype, needs to know)."""
    return dtype_name not in ("bfloat16", "bool") and np.dtype(dtype_name).kind in _INBAND_KINDS


def combine_parts(left: np.ndarray, right: np.ndarray, op: str, out: np.ndarray) -> None:
    """One merge of the check's in-band data: ``out = left op right`` (the lower ranks' part on
    the left, so both partners compute the same bits)."""
    with np.errstate(all="ignore"):  # overflow gives inf, as from MPI: no numpy warning
        _UFUNCS[op](left, right, out=out)


def part_dtype(dtype: np.dtype, op: str) -> np.dtype:
    """The dtype in-band data travels in: float16 sums and products in float32, rounded once at
    the end (as MPI without float16 reductions does here), everything else as it is."""
    return np.dtype(np.float32) if dtype == np.float16 and op in ("sum", "avg", "prod") else dtype


def finish_part(data: np.ndarray, dtype: np.dtype, op: str, size: int, dtype_name: str) -> None:
    """After the last merge, on a core rank: ``data`` (in ``part_dtype``) rounded to ``dtype``
    and, for ``avg``, divided by ``size`` in ``dtype``, in place (a float16 result is exact in
    float32), so that every rank, and an extra rank given the part, has the same bits."""
    from .buffers import finish_average

    if data.dtype == dtype:
        if op == "avg":
            finish_average(data, size, dtype_name)
        return
    result = data.astype(dtype)
    if op == "avg":
        finish_average(result, size, dtype_name)
    data[:] = result


class InbandCall:
    """``agree`` for small all-reduces of one kind (group, header, dtype, op) over MPI, their
    data riding on the check: the data is reduced as the ranks' parts merge, and every rank
    has the result with the verdict. Made once per kind (the collectives cache it) and called
    with each array: ``call(x, shape)`` reduces ``x`` (contiguous, writable) in place. Use
    only where ``agree`` runs over MPI with the check on and ``x.nbytes <= group.inband``
    (``inband_reducible``); a rank whose call differs sends its own header, and the mismatch
    is found before any data is used.

    Where the C kernels take the dtype (``code``: ``mpiring.inband_code``), a call is one C
    call with its fixed arguments bound here; it times itself for the stall watchdog (a
    ``ClockedWait`` registered here), so no Python runs around it: across nodes with more
    ranks than cores each microsecond of Python costs several of the call's. Otherwise
    (``code`` None), or while another thread holds the group's CheckIO, the same messages go
    through Python (numpy reduces).

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
        self.wait = dog.clocked(lambda: self.what() + _CHECKING, _waited_for(group, io.where),
                                _stage_grace(group.check_schedule, io.where))
        call = _mpiring().check_call(group.ctl_comm, group.rank, group.size, group.check_schedule, io.mine, io.theirs,
                                     code, op, _TAG_CHECK, io.where, self.wait.clock)
        self.run = functools.partial(call, packed)

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
            err = self.run(x, group.seq, 0)
        finally:
            io.busy = False
        if err:
            _check_failed(group, err, _sequenced(self.template, group.seq), self.dog, shape, self.what)

    def _in_python(self, x: np.ndarray, shape) -> None:
        """The call's messages through Python (``_exchange``; numpy reduces)."""
        group = self.group
        group.seq += 1
        io = _io(group)
        try:
            _exchange(group, io, _sequenced(self.template, group.seq), self.dog, shape, self.what, 0, x.reshape(-1),
                      self.op, self.dtype_name)
        finally:
            io.busy = False


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


_CHECKING = " (agreement check)"
# s per level: a rank waiting in a later stage of the check (or for an extra that itself
# gathers parts first) lets the ranks waiting in earlier ones, which name the rank that never
# came, report a stall first
_STAGE_GRACE = 2.0


def _stage_grace(schedule, where: np.ndarray):
    """The grace of a wait in the check (``where``: [rank, stage]): for an extra's part, the
    levels that extra itself waits for; at a step or for the result, more than any such wait
    (``CheckSchedule.levels``), plus the stage."""
    heights = dict(zip(schedule.extras, schedule.extra_heights))

    def grace() -> float:
        stage = int(where[1])
        if stage == 0:
            return _STAGE_GRACE * heights.get(int(where[0]), 0)
        if schedule.home >= 0:
            # Any later wait of a rank with a home is for the result, after every step of the
            # core; the C check counts steps from the rank's own (empty) partner list and
            # writes stage 1 there, which would let it report as early as a core rank at step 1.
            stage = schedule.steps + 1
        return _STAGE_GRACE * (schedule.levels + stage)

    return grace


def _waited_for(group, where: np.ndarray):
    """The stall report's "not arrived" for a wait in the check (``where``: [rank, stage],
    written as the wait begins; read from the watchdog's thread: a report only). A rank
    waiting for an extra that gathers no parts itself, or at the first step where no rank
    gathers parts first, waits for a rank that never sent its part; otherwise the rank waited
    for may itself wait for another rank."""

    def report() -> str:
        partner, stage = int(where[0]), int(where[1])
        who = group.describe_ranks([partner])
        schedule = group.check_schedule
        maybe = "; it may itself wait for another rank, named in an earlier report)"
        if stage == 0:
            heights = dict(zip(schedule.extras, schedule.extra_heights))
            return f"{who} (which gathers its own ranks' parts of the check first{maybe}" \
                if heights.get(partner, 0) else who
        if schedule.home >= 0:
            return f"{who}, which gathers this rank's part of the check (see its report)"
        if stage == 1 and not schedule.levels:
            return who
        return f"{who} (its part of step {stage} of {schedule.steps} of the check{maybe}"

    return report


def _exchange(group, io: "CheckIO", header: np.ndarray, dog, shape, what, decision: int = 0,
              flat: Optional[np.ndarray] = None, op: str = "", dtype_name: str = "") -> int:
    """This rank's part of the check over MPI, in Python (the C check's messages), in ``io``
    (busy: the caller frees it): swap parts along ``group.check_schedule``, merging each;
    returns rank 0's ``decision``, raises a mismatch on every rank. With ``flat``
    (``InbandCall``): its data reduced in place."""
    words = io.words
    words[:HEADER_LEN] = header
    words[HEADER_LEN], words[HEADER_LEN + 1], words[HEADER_LEN + 2] = 0, decision, 0
    data = None
    if flat is not None and flat.nbytes:
        wide = part_dtype(flat.dtype, op)
        data = io.mine[_PART_BYTES:_PART_BYTES + flat.size * wide.itemsize].view(wide)
        data[:] = flat
        words[HEADER_LEN + 2] = data.nbytes
    with dog.watch(lambda: what() + _CHECKING, _waited_for(group, io.where),
                   _stage_grace(group.check_schedule, io.where)):
        _swap_parts(group, io, data, op, lambda: finish_part(data, flat.dtype, op, group.size, dtype_name))
    if words[HEADER_LEN]:
        _mismatched(group, header, dog, shape, what)
    if data is not None:
        flat[:] = data
    return int(words[HEADER_LEN + 1])


def _swap_parts(group, io: "CheckIO", data: Optional[np.ndarray], op: str, finish) -> None:
    """The messages of ``_exchange`` (``plan.check_schedule``); ``data``: this rank's in-band
    data, a view into ``io.mine`` (None: a plain check). First the extras' parts come in and
    merge; then a rank with a home swaps its part for the result, a core rank runs its steps
    and finishes agreed data (``finish()``: ``finish_part``) after the last merge; last the
    result goes to the extras, whatever the verdict."""
    schedule, comm, where = group.check_schedule, group.ctl_comm, io.where
    n = 0 if data is None else data.nbytes
    for extra in schedule.extras:
        where[0], where[1] = extra, 0
        _swap(comm, io, n, extra, send=False)
        _merge(io, False, data, op)
    if schedule.home >= 0:
        where[0], where[1] = schedule.home, schedule.steps + 1
        _swap(comm, io, n, schedule.home)
        _take_result(io, n)
    else:
        for step, partner in enumerate(schedule.partners):
            where[0], where[1] = partner, step + 1
            _swap(comm, io, n, partner)
            _merge(io, partner < group.rank, data, op)
        if data is not None and not io.words[HEADER_LEN]:
            finish()
    for extra in schedule.extras:
        where[0], where[1] = extra, schedule.steps + 1
        _swap(comm, io, n, extra, recv=False)


def _take_result(io: "CheckIO", n: int) -> None:
    """The result from home (in ``io.theirs``) made this rank's part: its verdict and decision
    and, when agreed, its data. The part's data-bytes word stays this rank's own: it says
    how this rank's part travels to its extras (the C check keeps it the same way)."""
    io.words[HEADER_LEN:HEADER_LEN + 2] = io.their_words[HEADER_LEN:HEADER_LEN + 2]
    if not io.words[HEADER_LEN] and n:
        io.mine[_PART_BYTES:_PART_BYTES + n] = io.theirs[_PART_BYTES:_PART_BYTES + n]


def _pieces(part: int) -> List[Tuple[int, int]]:
    """The messages a part of ``part`` bytes travels in, [start, end): two when it is more than
    ``CHECK_PIECE_BYTES`` and at most twice that, else one."""
    if CHECK_PIECE_BYTES < part <= 2 * CHECK_PIECE_BYTES:
        return [(0, CHECK_PIECE_BYTES), (CHECK_PIECE_BYTES, part)]
    return [(0, part)]


def _swap(comm, io: "CheckIO", n: int, partner: int, send: bool = True, recv: bool = True) -> None:
    """Send this rank's part (``n`` bytes of data) to ``partner`` and/or receive its part, in
    the C check's messages: the first received one's state says whether a second follows."""
    from mpi4py import MPI

    first = comm.Irecv([io.theirs, MPI.BYTE], partner, _TAG_CHECK) if recv else None
    requests = [comm.Isend([io.mine[a:b], MPI.BYTE], partner, _TAG_CHECK)
                for a, b in (_pieces(_PART_BYTES + n) if send else [])]
    if recv:
        first.Wait()
        theirs = min(_PART_BYTES + max(int(io.their_words[HEADER_LEN + 2]), 0), io.theirs.nbytes)
        requests += [comm.Irecv([io.theirs[a:b], MPI.BYTE], partner, _TAG_CHECK) for a, b in _pieces(theirs)[1:]]
    for request in requests:
        request.Wait()


def _merge(io: "CheckIO", lower: bool, data: Optional[np.ndarray], op: str) -> None:
    """Merge the partner's part (in ``io.theirs``) into this rank's; ``lower``: it comes from
    the lower rank (its decision wins; its data is the left operand)."""
    mine, theirs = io.words, io.their_words
    differ = bool((mine[:HEADER_LEN] != theirs[:HEADER_LEN]).any())
    mine[HEADER_LEN] = int(bool(mine[HEADER_LEN]) or bool(theirs[HEADER_LEN]) or differ)
    if lower:
        mine[HEADER_LEN + 1] = theirs[HEADER_LEN + 1]
    if mine[HEADER_LEN] or data is None:
        return
    other = io.theirs[_PART_BYTES:_PART_BYTES + data.nbytes].view(data.dtype)
    combine_parts(other, data, op, data) if lower else combine_parts(data, other, op, data)


def _mismatched(group, header: np.ndarray, dog, shape, what) -> None:
    """After a mismatch, which every rank of the call has found: every rank's header gathered
    (one allgather, on this error path only); every rank raises the same error."""
    comm = group.ctl_comm
    with dog.watch(lambda: what() + " (gathering the headers of a mismatch)",
                   lambda: f"one or more of the {group.size} ranks of group '{group.name}'"):
        headers = np.array(comm.allgather(np.asarray(header, dtype=np.int64)), dtype=np.int64)
    raise CollectiveMismatchError(mismatch_report(comm, headers, group, shape, dog, what), headers, group)


class CheckIO:
    """One rank's buffers for the agreement check over MPI, made once per group: its part
    (``mine``: header, state, up to ``inband`` bytes of data, twice that where ``part_dtype``
    widens float16), the partner's (``theirs``), int64 views of their header and state words,
    and ``where`` (the rank and stage the check waits for, read by stall reports). ``busy``: in
    use (a second thread's check on the same group gets a private one, which runs in Python)."""

    __slots__ = ("mine", "theirs", "words", "their_words", "where", "busy", "plain", "wait", "what")

    def __init__(self, inband: int) -> None:
        self.mine = np.zeros(_PART_BYTES + 2 * inband, dtype=np.uint8)  # room for float16 data in float32
        self.theirs = np.zeros_like(self.mine)
        self.words = self.mine[:_PART_BYTES].view(np.int64)
        self.their_words = self.theirs[:_PART_BYTES].view(np.int64)
        self.where = np.zeros(2, dtype=np.int32)
        self.busy = False
        self.plain = None  # the C check of plain headers (guard._plain_call), False: none
        self.wait = None  # its ClockedWait
        self.what = None  # the call it checks now, for a stall report


def _io(group) -> CheckIO:
    """The group's CheckIO, marked busy (a private one if another thread holds it)."""
    io = group.check_io
    if io is None or io.busy:
        io = CheckIO(group.inband)
        if group.check_io is None:
            group.check_io = io
    io.busy = True
    return io


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
