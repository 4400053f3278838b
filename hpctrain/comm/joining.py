"""Horovod's join: a rank out of work calls ``join`` and, until every rank has joined, stands
in for zeros in the other ranks' all-reduces (uneven data without a hang).

The other ranks learn of it without any message on the path of ordinary collectives: a
joined rank enters the agreement check (``guard.py``) with a ``join`` header, so the others'
next collective fails its check, on every rank with the same headers. They name the joined
ranks and the call the others made; every rank then acts on them alike:

- an all-reduce is redone by every rank of the group with ``MPI_Allreduce`` (``native_``),
  the joined ranks adding zeros: Sum gives the others' sum, Average divides by the whole
  group's size (Horovod's postscale factor 1/size), Min/Max/Product take the zeros in;
- any other collective raises ``JoinedRanksError`` on the ranks that called it (Horovod
  refuses them with join); the joined ranks go on waiting;
- when every rank presents ``join``, ``join`` returns on every rank the rank that joined
  last (the highest of those that joined in the same check).

While ranks are joined (``group.joined``: the same list on every rank) the others skip the
fast paths: each all-reduce is one agreement check, failing in the known way, then the redo.
With the agreement check off (HPCTRAIN_CHECK_COLLECTIVES=0) nothing carries the ``join``
header: ``join`` is then a collective every rank calls (returning the last rank to arrive).
"""
from __future__ import annotations

import time
from typing import List, Optional, Tuple

import numpy as np

from . import algorithms, guard
from .buffers import DTYPE_CODES
from .errors import CollectiveMismatchError, JoinedRanksError

_JOIN = guard._OP_INDEX["join"]
_ALLREDUCES = (guard._OP_INDEX["allreduce"], guard._OP_INDEX["grouped_allreduce"])
_DTYPE_NAMES = {code: name for name, code in DTYPE_CODES.items()}


def classify(headers: np.ndarray) -> Tuple[List[int], Optional[np.ndarray]]:
    """From the headers of a failed agreement check: the ranks that presented ``join``, and
    the header all the other ranks sent (None when there are no others, or when they
    disagree among themselves: a mismatch of their own). Pure."""
    ops = headers[:, 1]
    joins = [r for r in range(len(headers)) if ops[r] == _JOIN]
    others = [r for r in range(len(headers)) if ops[r] != _JOIN]
    if not joins or not others:
        return joins, None
    first = headers[others[0]]
    if any((headers[r][1:] != first[1:]).any() for r in others[1:]):
        return joins, None
    return joins, first


def _note(g, joins: List[int]) -> None:
    g.joined.extend(r for r in joins if r not in g.joined)


def ranks_joined(g, error: CollectiveMismatchError) -> bool:
    """Whether ``error`` (a failed agreement check on ``g``) means that ranks have joined
    while the others agree on their call; records the joined ranks either way."""
    headers = error.headers
    if headers is None or isinstance(error, JoinedRanksError) or len(headers) != g.size:
        return False
    joins, common = classify(headers)
    _note(g, joins)
    return common is not None


def refusal(error: CollectiveMismatchError, what: str) -> CollectiveMismatchError:
    """The error a collective other than an all-reduce raises for ``error``: a
    JoinedRanksError when the check failed because ranks had joined, else ``error``."""
    g = error.group
    if g is None or not ranks_joined(g, error):
        return error
    return JoinedRanksError(
        f"{what} on group '{g.name}' while {g.describe_ranks(g.joined)} had called join(): joined ranks "
        "take part in all-reduces only (as in Horovod, which refuses allgather, broadcast and alltoall "
        "with join).\nHINT: run the other collectives before the first rank joins, or after join() returns",
        error.headers, g)


def allreduce_(g, arr: np.ndarray, op: str, dtype_name: str, shape, dog, agreed: bool) -> None:
    """All-reduce the contiguous array ``arr`` in place while ranks of ``g`` are joined (they
    add zeros). ``agreed``: the failed check of this very call already happened."""
    if not agreed:
        header = guard.make_header(0, "allreduce", op, dtype_name, guard.count_word(tuple(shape), arr.size))
        try:
            guard.agree(g, header, dog, shape)
        except CollectiveMismatchError as e:
            if not ranks_joined(g, e):
                raise
    _native(g, arr, op, dtype_name, dog)


def _native(g, arr: np.ndarray, op: str, dtype_name: str, dog) -> None:
    with dog.watch(lambda: f"allreduce({op}, {dtype_name}, {arr.size} elements) with joined "
                           f"{g.describe_ranks(g.joined)} on {g.name}",
                   lambda: f"one or more of the {g.size} ranks of group '{g.name}'"):
        algorithms.native_(g.comm, arr, op, dtype_name)


def _serve(g, header: np.ndarray, dog) -> None:
    """The joined rank's part in the others' all-reduce described by ``header``: zeros."""
    op = guard._RED_NAMES[int(header[2])]
    dtype_name = _DTYPE_NAMES[int(header[3])]
    count = int(header[4]) & guard._COUNT_MASK
    zeros = np.zeros(count, dtype=np.uint16 if dtype_name == "bfloat16" else dtype_name)
    _native(g, zeros, op, dtype_name, dog)


def join(g, dog) -> int:
    """Take part in the others' all-reduces (with zeros) until every rank of ``g`` has
    joined; return the group rank that joined last."""
    if g.size == 1:
        return 0
    if not guard.checks_enabled():
        arrived = g.comm.allgather(time.time())
        return max(range(g.size), key=lambda r: (arrived[r], r))
    while True:
        try:
            guard.agree(g, guard.make_header(0, "join"), dog)
            joins = list(range(g.size))  # every rank presented join in this check
        except CollectiveMismatchError as e:
            if e.headers is None:
                raise
            joins, common = classify(e.headers)
            if len(joins) < g.size:
                _note(g, joins)
                if common is not None and int(common[1]) in _ALLREDUCES:
                    _serve(g, common, dog)
                continue
            g.seq = int(e.headers[:, 0].max())  # all joined, after different numbers of calls
        _note(g, joins)
        last = g.joined[-1]
        g.joined.clear()
        # the joined ranks skipped calls that counted down the auto all-reduce's runs
        g.tuned_runs.clear()
        return last
