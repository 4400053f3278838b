"""Ranks that have ended: a rank whose program ends (``shutdown()``, ``hvd.shutdown()`` or a
normal exit) tells every other rank how many collectives it made on the world. A rank that
waits in a collective while a rank that ended made fewer world collectives than this one has
started cannot finish: its watchdog says so within a second or two and aborts the job, instead of
waiting out the stall timeout (``HPCTRAIN_STALL_TIMEOUT``, 300 s by default). Horovod fails
the same way ("Horovod has been shut down ... after one of the ranks finished execution").

Every rank counts the world's collectives alike (the agreement check compares those counts),
so a rank that ended with fewer never started the collective the other is in, or one before
it: the program ran different collectives on different ranks (a loop that ended earlier on
one rank, a branch that differs, an exception caught on one rank).

The notices travel on a communicator of their own (a duplicate of the world made at
``init``): rank R sends (R, count) to every other rank when it ends; the watchdog's thread
collects them with ``MPI_Iprobe`` (which needs ``MPI_THREAD_MULTIPLE``, what hpctrain asks
for) while the rank waits.
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Mapping, Tuple

import numpy as np

TAG = 29  # the notices' communicator carries nothing else
SEND_SECONDS = 1.0  # how long an ending rank waits for its notices to leave (they are 16 bytes: at once)
# How long a rank must have been seen to have ended early before this rank reports it.
GRACE_SECONDS = 0.5


def never_started(finished: Mapping[int, int], started: int) -> List[Tuple[int, int]]:
    """``(rank, collectives)`` of the ranks in ``finished`` (rank → world collectives it made
    before it ended) that ended before the world collective number ``started`` (the count
    this rank has started), sorted by rank."""
    return sorted((rank, count) for rank, count in finished.items() if count < started)


def describe(early: List[Tuple[int, int]], started: int, what: str) -> str:
    """The report of a rank that waits in ``what`` while the ranks of ``early`` have ended."""
    ranks = ", ".join(str(rank) for rank, _ in early)
    counts = ", ".join(str(count) for _, count in early)
    one = len(early) == 1
    return (f"{what} cannot finish: rank{'' if one else 's'} {ranks} ha{'s' if one else 've'} ended "
            f"(shutdown() or a normal exit) after {counts} collective(s) on the world, where this rank has "
            f"started {started}.\nHINT: every rank must make the same collective calls; the rank{'' if one else 's'} "
            "that ended made fewer (a loop that ends earlier there, a branch that differs between ranks, an "
            "exception caught on one rank). Aborting the job.")


class Notices:
    """The notices of one world: ``announce`` when this rank ends, ``poll`` (the watchdog's
    thread) for the ranks that have."""

    def __init__(self, comm: Any, rank: int, size: int) -> None:
        self.comm, self.rank, self.size = comm, rank, size
        self.finished: Dict[int, int] = {}
        self.sent = False
        self._buf = np.empty(2, np.int64)

    def announce(self, collectives: int) -> None:
        """Tell every other rank that this one has ended after ``collectives`` world
        collectives (once; errors ignored: a peer may be gone already)."""
        if self.sent or self.size < 2:
            return
        self.sent = True
        from mpi4py import MPI

        message = np.array([self.rank, collectives], np.int64)
        requests = []
        try:
            for peer in range(self.size):
                if peer != self.rank:
                    requests.append(self.comm.Isend(message, dest=peer, tag=TAG))
            deadline = time.monotonic() + SEND_SECONDS
            while not MPI.Request.Testall(requests) and time.monotonic() < deadline:
                time.sleep(0.001)
        except Exception:  # noqa: BLE001 - ending must not fail on a notice
            pass

    def poll(self) -> Dict[int, int]:
        """The ranks that have ended so far: rank → world collectives it made."""
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.Iprobe(source=MPI.ANY_SOURCE, tag=TAG, status=status):
            self.comm.Recv(self._buf, source=status.Get_source(), tag=TAG)
            self.finished[int(self._buf[0])] = int(self._buf[1])
        return self.finished
