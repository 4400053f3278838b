"""The ring all-reduce in C (the extension ``_mpiring``), over the MPI library mpi4py uses.

The C ring does what :func:`hpctrain.comm.algorithms.ring_` does in Python, without ~10 µs
of Python per step and with the all-gather's first step overlapping the last reduction.
It needs no MPI headers at build time: ``bind`` looks
up ``MPI_Isend``, ``MPI_Irecv``, ``MPI_Wait`` and ``MPI_Cancel`` in the MPI library that
mpi4py loaded and hands their addresses to the extension, which calls them with mpi4py's
integer handles.

Every rank of a communicator must take the same path (the C and Python rings exchange
different messages): :func:`usable` agrees on it once per communicator, with one MIN
all-reduce the first time the ring runs on it. Where the extension is not built (no C
compiler at install time), the MPI library lacks the symbols, or ``HPCTRAIN_RING_C=0``,
the Python ring runs.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from typing import Callable, Dict, Tuple

import numpy as np
from mpi4py import MPI

from .. import settings
from .buffers import DTYPE_CODES
from . import faults
from .errors import CommError
from .shmsync import FAST_DTYPES, OP_CODES  # the same kernels' codes (_kernels.h)

try:
    from . import _mpiring
except ImportError:  # built with optional=True: no compiler, no extension
    _mpiring = None

log = logging.getLogger("hpctrain.comm")

# Segments of the C ring, and how many are in flight into the scratch slots: 512 KiB x 4
# slots keeps the scratch (2 MiB) in L2/L3, which is what makes the large ring beat
# MPI_Allreduce; segment sizes from 128 KiB to 1 MiB were within a few percent of each other
# on the 2-core machine this was tuned on (re-tune with HPCTRAIN_RING_SEGMENT_BYTES and
# `hpctrain bench allreduce`).
SEGMENT_BYTES = 512 * 1024
SLOTS = 4
# HPCTRAIN_RING_C=0 on any rank keeps the whole communicator on the Python ring (it enters
# the agreement); ENABLED is the same switch at run time, to be flipped on every rank alike.
ENABLED = True
_bound: Dict[str, bool] = {}
_agreed: Dict[int, Tuple[object, bool]] = {}  # id(comm) -> (comm, usable); holds comm, so ids stay unique


def segment_bytes() -> int:
    """HPCTRAIN_RING_SEGMENT_BYTES, default SEGMENT_BYTES: the C ring's segment."""
    return settings.rc.ring_segment_bytes or SEGMENT_BYTES


def _bind() -> bool:
    """Hand the MPI functions to the extension (once). False when they cannot be found."""
    if "ok" not in _bound:
        ok = False
        if _mpiring is not None and not hasattr(MPI.BYTE, "handle"):  # an older mpi4py: no integer handles
            log.debug("C ring unavailable: this mpi4py gives no integer MPI handles (Datatype.handle)")
        elif _mpiring is not None:
            try:
                lib = ctypes.CDLL(MPI.__file__)  # already loaded; its lookups reach libmpi
                address = [ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                           for name in ("MPI_Isend", "MPI_Irecv", "MPI_Wait", "MPI_Cancel")]
                _mpiring.bind(*address)
                ok = True
            except (OSError, AttributeError, ValueError) as exc:
                log.debug("C ring unavailable: cannot find the MPI functions (%s)", exc)
        _bound["ok"] = ok
    return _bound["ok"]


def available() -> bool:
    """This process can run the C ring (extension built, MPI functions found, not disabled)."""
    return ENABLED and _can_run()


def _can_run() -> bool:
    return settings.rc.ring_c and _mpiring is not None and _bind()


def known(comm):
    """``usable(comm)`` when the ranks of ``comm`` have agreed already, else None (no MPI)."""
    hit = _agreed.get(id(comm))
    return ENABLED and hit[1] if hit is not None and hit[0] is comm else None


def usable(comm) -> bool:
    """Whether every rank of ``comm`` runs the C ring. Every rank of ``comm`` must ask (the
    ring does, for every dtype with kernels): the first time for ``comm`` it is a collective,
    a MIN all-reduce of what each rank can run, so that ranks where the extension is missing
    or HPCTRAIN_RING_C=0 keep all on the Python ring."""
    hit = _agreed.get(id(comm))
    if hit is None or hit[0] is not comm:
        hit = _agreed[id(comm)] = (comm, bool(comm.allreduce(int(_can_run()), op=MPI.MIN)))
    return ENABLED and hit[1]


def kernel_dtype_code(dtype_name: str):
    """The C kernels' code for ``dtype_name``, or None (float16/bfloat16/bool: Python ring)."""
    code = DTYPE_CODES.get(dtype_name)
    return code if code in FAST_DTYPES else None


def allreduce_(comm, arr: np.ndarray, dtype_code: int, op: str, divisor: int, scratch: np.ndarray) -> None:
    """Ring all-reduce of ``arr`` in place (C); ``scratch`` holds ``SLOTS`` segments."""
    err = _mpiring.allreduce(comm.handle, MPI.BYTE.handle, comm.Get_rank(), comm.Get_size(), arr, scratch,
                             dtype_code, OP_CODES[op], divisor, segment_bytes())
    if err:
        _failed(err, "the C ring all-reduce")


def inband_code(dtype_name: str, op: str):
    """The kernels' dtype code when ``check_call`` can reduce ``dtype_name`` with ``op`` here, else
    None (the agreement check's Python then carries the data; the messages are the same)."""
    code = kernel_dtype_code(dtype_name)
    return code if code is not None and op in OP_CODES and available() else None


def check_call(comm, rank: int, size: int, schedule, mine: np.ndarray, theirs: np.ndarray, dtype_code: int, op: str,
               tag: int, where: np.ndarray, clock) -> Callable[..., int]:
    """The agreement check over MPI in C (``guard``), with the arguments that stay the same
    bound once: ``call(header, data, seq, decision)`` puts ``header`` (its sequence word set to
    ``seq``) and the state [0, ``decision``] at the head of ``mine``, reduces ``data``
    (C-contiguous, of ``dtype_code``; empty for a plain check) in place and returns 0 (agreed:
    rank 0's decision is in ``mine``'s state), -1 (the headers differ, on every rank) or an MPI
    error code (raise it with ``_failed``). ``schedule``: this rank's ``plan.CheckSchedule``
    in the group of ``size`` ranks; ``mine``, ``theirs``: the check's rows
    (``guard.CheckIO``); ``where``: two int32 the call keeps the rank and stage it waits for
    in; ``clock``: the double it keeps its start time in while it waits (``ClockedWait``)."""
    from .guard import CHECK_PIECE_BYTES

    words = np.frombuffer(schedule.encoded(), dtype=np.int32).copy()  # int32-aligned, as C reads it
    return functools.partial(_mpiring.check, comm.handle, MPI.BYTE.handle, rank, words, mine, theirs, dtype_code,
                             OP_CODES[op], size, tag, CHECK_PIECE_BYTES, where, clock)


def _failed(err: int, what: str) -> None:
    """Raise for MPI error ``err`` of a C call (``what``)."""
    if MPI.Get_error_class(err) in faults.failure_classes():  # elastic jobs: a lost peer, not a bug
        raise MPI.Exception(err)  # the caller's watched wait (or watchdog.raise_translated) makes it RanksLostError
    raise CommError(f"{what} failed in MPI: {MPI.Get_error_string(err)} (error {err}).\n"
                    "HINT: if it works with HPCTRAIN_RING_C=0 (Python instead of C), report it")


def scratch_elements(length: int, size: int, itemsize: int) -> int:
    """Scratch the C ring needs for ``length`` elements over ``size`` ranks: ``SLOTS``
    segments, each at most one chunk."""
    chunk = -(-length // max(size, 1))
    return SLOTS * max(1, min(segment_bytes() // itemsize, chunk))
