"""Cheap agreement check before each collective, and the watched wait around it.

Every rank sends a small header (sequence number, operation, reduction op, dtype, element
count, algorithm) to group rank 0, which compares them and answers every rank with one
verdict. A mismatch becomes the same CollectiveMismatchError on every rank, naming the
ranks and what each called. Because rank 0 knows whose header has not arrived, the stall
watchdog can name the ranks that never entered the collective.

Switch off with HPCTRAIN_CHECK_COLLECTIVES=0 (or ``set_checks(False)``) for speed; the
watchdog still catches stalls then, but cannot name the missing ranks as precisely.
"""
from __future__ import annotations

import zlib
from typing import Dict, List, Sequence

import numpy as np

from .. import settings
from .buffers import DTYPE_CODES, OPS
from .errors import CollectiveMismatchError
from .plan import ALGORITHMS

_TAG_HEADER, _TAG_VERDICT, _TAG_MESSAGE = 101, 102, 103
HEADER_LEN = 7
# From HPCTRAIN_CHECK_COLLECTIVES at comm.init() (not at import: a bad value is an error at
# init, never at import), unless set_checks() chose first.
_enabled = {"on": True, "chosen": False}

_OP_NAMES = ["allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall", "barrier",
             "broadcast_object", "allgather_object", "grouped_allreduce"]
_RED_NAMES = ["-", *OPS]
_ALGO_NAMES = ["-", *ALGORITHMS]
_DTYPE_NAMES = {v: k for k, v in DTYPE_CODES.items()}


def set_checks(enabled: bool) -> None:
    """Turn the per-collective agreement check on or off (on by default)."""
    _enabled["on"] = bool(enabled)
    _enabled["chosen"] = True


def load_setting() -> None:
    """HPCTRAIN_CHECK_COLLECTIVES, unless ``set_checks`` chose already (called by init)."""
    if not _enabled["chosen"]:
        _enabled["on"] = settings.rc.check_collectives


def checks_enabled() -> bool:
    return _enabled["on"]


def agree_or_count(group, header_fn, dog) -> None:
    """``agree`` when checks are on (``header_fn()`` builds the header only then)."""
    if _enabled["on"]:
        agree(group, header_fn(), dog)
    else:
        group.seq += 1


_OP_INDEX = {name: i for i, name in enumerate(_OP_NAMES)}
_RED_INDEX = {name: i for i, name in enumerate(_RED_NAMES)}
_ALGO_INDEX = {name: i for i, name in enumerate(_ALGO_NAMES)}


def reduction_index(op: str) -> int:
    return _RED_INDEX[op]


def algorithm_index(algorithm: str) -> int:
    return _ALGO_INDEX[algorithm]


def shape_code(shape: Sequence[int]) -> int:
    return zlib.crc32(repr(tuple(shape)).encode())


def make_header(seq: int, op: str, reduction: str = "-", dtype: str = "", count: int = -1,
                algorithm: str = "-", extra: int = 0) -> np.ndarray:
    return np.array((seq, _OP_INDEX[op], _RED_INDEX[reduction], DTYPE_CODES.get(dtype, -1), count,
                     _ALGO_INDEX[algorithm], extra), dtype=np.int64)


def describe_header(h: Sequence[int]) -> str:
    seq, op, red, dt, count, algo, extra = (int(v) for v in h)
    parts = []
    if red > 0:
        parts.append(_RED_NAMES[red])
    if dt >= 0:
        parts.append(_DTYPE_NAMES.get(dt, f"dtype#{dt}"))
    if count >= 0:
        parts.append(f"{count} elements")
    if algo > 0:
        parts.append(_ALGO_NAMES[algo])
    if extra:
        parts.append(f"shape/root #{extra}")
    return f"{_OP_NAMES[op]}({', '.join(parts)}) [collective #{seq}]"


def mismatch_message(headers: np.ndarray, group) -> str:
    """Group ranks by what they called; pure so that it can be unit-tested."""
    by_call: Dict[str, List[int]] = {}
    for r, h in enumerate(headers):
        by_call.setdefault(describe_header(h), []).append(r)
    lines = [f"  {group.describe_ranks(ranks)} called {call}" for call, ranks in by_call.items()]
    return (
        f"ranks of group '{group.name}' entered different collectives:\n" + "\n".join(lines) +
        "\nHINT: every rank must call the same collective with the same shape, dtype and op, "
        "in the same order."
    )


def agree(group, header: np.ndarray, dog) -> None:
    """Check that every rank of ``group`` entered the same collective; raise on mismatch."""
    group.seq += 1
    if not _enabled["on"] or group.size == 1:
        return
    header[0] = group.seq
    what = lambda: describe_header(header) + f" on {group.name}"  # noqa: E731 - only for a stall report
    if group.small_shm:  # one node: one flag exchange in shared memory
        group.node_flags.agree(header, dog, lambda: what() + " (agreement check)", group.describe_ranks, group)
        return
    comm = group.ctl_comm
    if group.rank == 0:
        headers = np.empty((group.size, HEADER_LEN), dtype=np.int64)
        headers[0] = header
        from mpi4py import MPI

        requests = [comm.Irecv(headers[r], source=r, tag=_TAG_HEADER) for r in range(1, group.size)]
        pending = set(range(1, group.size))

        def missing() -> str:
            return group.describe_ranks(sorted(pending))

        with dog.watch(lambda: what() + " (agreement check)", missing):
            while pending:
                done = MPI.Request.Waitsome(requests)
                for i in done or ():
                    pending.discard(i + 1)
        ok = bool((headers == headers[0]).all())
        verdict = np.array([0 if ok else 1], dtype=np.int64)
        message = "" if ok else mismatch_message(headers, group)
        sends = [comm.Isend(verdict, dest=r, tag=_TAG_VERDICT) for r in range(1, group.size)]
        MPI.Request.Waitall(sends)
        if not ok:
            for r in range(1, group.size):
                comm.send(message, dest=r, tag=_TAG_MESSAGE)
            raise CollectiveMismatchError(message)
    else:
        comm.Send(header, dest=0, tag=_TAG_HEADER)
        verdict = np.empty(1, dtype=np.int64)
        coordinator = group.describe_ranks([0])
        with dog.watch(lambda: what() + " (waiting for rank 0's agreement check)",
                       lambda: f"{coordinator}, which coordinates the check (see its report)", grace=2.0):
            comm.Recv(verdict, source=0, tag=_TAG_VERDICT)
            if verdict[0] != 0:
                raise CollectiveMismatchError(comm.recv(source=0, tag=_TAG_MESSAGE))
