"""Shared-memory windows (``MPI_Win_allocate_shared``), without Open MPI's osc/ucx noise.

Open MPI's osc/ucx component prints "Error: OSC UCX component priority set inside component
query failed" at every window creation where UCX has no usable transport (workstations,
containers), although another component then serves the window. ``hpctrain.comm`` leaves
osc/ucx out (OMPI_MCA_osc=^ucx) before MPI starts. Where the user's script started MPI first
(``from mpi4py import MPI`` before hpctrain, as Horovod's own tests do), that setting comes too
late: then a window's creation runs with stderr (fd 2) through a pipe whose reader forwards
every line as it comes, except that message (and the blank line Open MPI prints after it).
Nothing is held back: a report written meanwhile (the stall watchdog's) still reaches stderr
at once, even if the process then aborts.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading
from typing import Iterator

NOISE = b"OSC UCX component priority set inside component query failed"

_lock = threading.Lock()
_filter_wanted = False


def note_mpi_state(osc_defaulted: bool) -> None:
    """Called as ``hpctrain.comm`` sets its Open MPI defaults: filter when MPI (Open MPI) had
    already started without them."""
    global _filter_wanted
    mpi = sys.modules.get("mpi4py.MPI")
    try:
        early = mpi is not None and mpi.Is_initialized() and "Open MPI" in mpi.Get_library_version()
    except Exception:  # noqa: BLE001 - an MPI that cannot say: no filter
        early = False
    _filter_wanted = bool(osc_defaulted and early)


def allocate_shared(nbytes: int, comm):
    """``MPI.Win.Allocate_shared(nbytes, 1, comm=comm)`` (collective over ``comm``)."""
    from mpi4py import MPI

    with _without_osc_noise():
        return MPI.Win.Allocate_shared(nbytes, 1, comm=comm)


@contextlib.contextmanager
def _without_osc_noise() -> Iterator[None]:
    if not _filter_wanted or not _lock.acquire(blocking=False):
        yield
        return
    try:
        sys.stderr.flush()
        saved = os.dup(2)
        read_end, write_end = os.pipe()
        os.dup2(write_end, 2)
        os.close(write_end)
        reader = threading.Thread(target=forward, args=(read_end, saved), name="hpctrain-stderr", daemon=True)
        reader.start()
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)  # closes the pipe's last write end: the reader sees its end
            reader.join(timeout=5)
            os.close(saved)
    finally:
        _lock.release()


def forward(read_end: int, out: int) -> None:
    """Copy lines from ``read_end`` to ``out`` as they come, dropping Open MPI's osc/ucx
    message and the blank line after it; closes ``read_end`` at its end."""
    pending = b""
    dropped = False
    with os.fdopen(read_end, "rb", buffering=0) as source:
        while True:
            chunk = source.read(65536)
            if not chunk:
                break
            *lines, pending = (pending + chunk).split(b"\n")
            kept = []
            for line in lines:
                if NOISE in line or (dropped and not line.strip()):
                    dropped = NOISE in line
                    continue
                dropped = False
                kept.append(line + b"\n")
            if kept:
                os.write(out, b"".join(kept))
    if pending and NOISE not in pending:
        os.write(out, pending)
