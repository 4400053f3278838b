"""Stall watchdog: a collective that waits longer than HPCTRAIN_STALL_TIMEOUT seconds is
reported (operation, group, ranks not arrived) and the whole job is aborted.

Every blocking wait in hpctrain.comm runs inside ``watch(...)``. A daemon thread checks the
waits of all threads; mpi4py releases the GIL while blocked in MPI, so the thread runs.

The same thread watches the process that started this rank, when it is an MPI launcher or
daemon (``LAUNCHER_PARENTS``): once it is gone the job cannot finish, and the rank exits.
Open MPI 5's ``prterun`` killed with SIGKILL (a user's ``kill -9``, a scheduler that tracks
processes by parentage) leaves its ranks running, a rank whose peer died spinning in a
collective until the stall timeout.
"""
from __future__ import annotations

import array
import os
import sys
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional, Tuple, Union

from .. import settings

Text = Union[str, Callable[[], str]]  # messages are built only when a stall is reported
Grace = Union[float, Callable[[], float]]  # read when the watchdog looks at the wait
# Elastic jobs: faults.translate, which turns an MPI error of a lost peer leaving a watched
# wait into RanksLostError (and revokes this rank's communicators); None elsewhere.
TRANSLATE: dict = {"fn": None}
# Elastic jobs: faults.stall_is_a_lost_rank(what, waited, missing) -> True when a stalled wait
# is explained by a failed process (it revokes, and the wait ends with RanksLostError);
# the job is then not aborted. None elsewhere.
ON_STALL: dict = {"fn": None}


def text(what: Text) -> str:
    return what() if callable(what) else what


def suffixed(what: Text, suffix: str) -> Callable[[], str]:
    return lambda: text(what) + suffix


def stall_timeout() -> float:
    """Seconds from HPCTRAIN_STALL_TIMEOUT (default 300; 0 disables the watchdog)."""
    return settings.rc.stall_timeout


class Wait:
    """One blocking wait of one thread; also the context manager that registers it (a plain
    class, not @contextmanager: it runs around every collective and must cost ~nothing)."""

    __slots__ = ("what", "waiting_for", "since", "grace", "_dog", "_key", "_previous")

    def __init__(self, dog: "Watchdog", what: Text, waiting_for: Callable[[], str], grace: Grace) -> None:
        self.what = what  # e.g. "allreduce(sum, float32, 1000 elements, ring) on world"
        self.waiting_for = waiting_for  # describes the ranks not arrived yet
        # extra seconds (ranks that wait on a rank which itself waits give that one time to report):
        # a number, or a function of the wait's progress
        self.grace = grace
        self._dog = dog

    def __enter__(self) -> "Wait":
        self.since = time.monotonic()
        self._key = threading.get_ident()
        waits = self._dog._waits
        self._previous = waits.get(self._key)
        waits[self._key] = self
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._previous is None:
            self._dog._waits.pop(self._key, None)
        else:
            self._dog._waits[self._key] = self._previous
        if exc is not None:
            lost = translated(exc)
            if lost is not exc:
                raise lost from exc


def grace_of(wait) -> float:
    """A wait's grace now (``Grace``)."""
    grace = wait.grace
    return grace() if callable(grace) else grace


def translated(exc: BaseException) -> BaseException:
    """``exc``, or the RanksLostError an elastic job makes of it (TRANSLATE) when it is an MPI
    error of a lost peer; for blocking calls that are not in a ``watch`` (``ClockedWait``)."""
    if TRANSLATE["fn"] is None:
        return exc
    lost = TRANSLATE["fn"](exc)
    return exc if lost is None else lost


def raise_translated(exc: BaseException) -> None:
    """Raise ``exc`` (caught around a blocking call outside a ``watch``) as the watched wait
    would have: the RanksLostError ``translated`` makes of it, else ``exc`` itself."""
    lost = translated(exc)
    if lost is exc:
        raise exc
    raise lost from exc


class ClockedWait:
    """A standing wait for a blocking call in C that times itself: while it waits,
    ``clock[0]`` holds the monotonic time (``time.monotonic``) it began, 0.0 otherwise. Made
    once (``Watchdog.clocked``) for calls made many times: they cost no Python for the
    watchdog (``Wait`` costs about a microsecond per call). The watchdog reads the clock from
    its thread while the call, having released the GIL, waits."""

    __slots__ = ("what", "waiting_for", "grace", "clock", "_from", "_restarted", "__weakref__")

    def __init__(self, what: Text, waiting_for: Callable[[], str], grace: Grace) -> None:
        self.what, self.waiting_for, self.grace = what, waiting_for, grace
        self.clock = array.array("d", [0.0])
        self._from, self._restarted = 0.0, 0.0

    @property
    def since(self) -> Optional[float]:
        """When the call now waiting began (None: none waits), or when the watchdog restarted
        its count (the elastic hook diverted it) if that is the same call."""
        began = self.clock[0]
        if not began:
            return None
        return self._restarted if began == self._from else began

    @since.setter
    def since(self, value: float) -> None:  # the watchdog restarts the count of the call now waiting
        self._from, self._restarted = self.clock[0], value


# Names (as /proc/PID/comm gives them) of the processes that start MPI ranks: Open MPI's
# launchers and daemons, MPICH's and Intel MPI's Hydra, SLURM's step daemon.
LAUNCHER_PARENTS = frozenset({"prterun", "prted", "orted", "orterun", "mpirun", "mpiexec", "mpiexec.hydra",
                              "hydra_pmi_proxy", "pmi_proxy", "slurmstepd"})


def launcher_parent(ppid: Optional[int] = None, proc: str = "/proc") -> Optional[Tuple[int, str]]:
    """``(pid, name)`` of this process's parent (or of ``ppid``) when it is an MPI launcher or
    daemon; None otherwise (a shell, a container's starter, a system without ``/proc``)."""
    ppid = os.getppid() if ppid is None else ppid
    try:
        with open(f"{proc}/{ppid}/comm") as fh:
            name = fh.read().strip()
    except OSError:
        return None
    return (ppid, name) if name in LAUNCHER_PARENTS else None


class Watchdog:
    def __init__(self, rank: int, abort: Callable[[int], None], timeout: float,
                 parent: Optional[Tuple[int, str]] = None, getppid: Callable[[], int] = os.getppid) -> None:
        self.rank = rank
        self.timeout = timeout
        self._abort = abort
        self.parent = parent  # (pid, name) of the launcher that started this rank, if one did
        self._getppid = getppid
        self._waits: Dict[int, Wait] = {}
        self._clocked: Dict[int, weakref.ref] = {}  # id -> ClockedWait
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self.fired: List[str] = []
        # waits the elastic hook turned into a lost rank: id -> their restarted ``since``. Such
        # a wait still stalled a timeout later was not ended by the revoke: it aborts the job
        # (asking again would revoke every timeout, for ever).
        self._diverted: Dict[int, float] = {}
        # the world's notices of ranks that ended (finished.Notices) and the count of world
        # collectives this rank has started; None: not listened for
        self.notices = None
        self.started: Optional[Callable[[], int]] = None
        self.blocked: Callable[[], bool] = lambda: True
        self._early_since: Optional[float] = None  # when a rank was first seen to have ended early

    def listen(self, notices, started: Callable[[], int], blocked: Callable[[], bool] = lambda: True) -> None:
        """Watch for ranks that end while this one waits (``finished.Notices``; ``started()``:
        the world collectives this rank has started; ``blocked()``: whether a stuck
        collective would hold up the program, asyncq.foreground_blocked)."""
        self.notices, self.started, self.blocked = notices, started, blocked

    def start(self) -> None:
        if self.timeout <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name="hpctrain-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def watch(self, what: Text, waiting_for: Callable[[], str], grace: Grace = 0.0) -> Wait:
        """``with dog.watch(what, waiting_for): <blocking MPI call>``."""
        return Wait(self, what, waiting_for, grace)

    def clocked(self, what: Text, waiting_for: Callable[[], str], grace: Grace = 0.0) -> ClockedWait:
        """A ``ClockedWait`` watched for as long as the caller keeps it."""
        wait = ClockedWait(what, waiting_for, grace)
        key = id(wait)
        self._clocked[key] = weakref.ref(wait, lambda _, clocked=self._clocked: clocked.pop(key, None))
        return wait

    def _watched(self) -> List[Union[Wait, ClockedWait]]:
        """Every wait in progress (list() of a dict's values: one step, safe against other threads)."""
        waits: List[Union[Wait, ClockedWait]] = list(self._waits.values())
        for ref in list(self._clocked.values()):
            wait = ref()
            if wait is not None and wait.clock[0]:
                waits.append(wait)
        return waits

    def launcher_gone(self) -> bool:
        """Whether the launcher that started this rank has exited (this rank was re-parented)."""
        return self.parent is not None and self._getppid() != self.parent[0]

    def orphaned(self) -> None:
        """The launcher is gone: say so (its pipes may be gone too) and end this process; no
        MPI call, since MPI_Abort would wait for the launcher."""
        pid, name = self.parent
        message = (f"hpctrain: rank {self.rank}: the MPI launcher that started it ({name}, pid {pid}) is gone, "
                   "so the job cannot finish; this rank exits.\nHINT: stop a job with SIGTERM to its launcher "
                   "(or scancel), which ends every rank; SIGKILL to the launcher alone leaves its ranks running.")
        self.fired.append(message)
        try:
            print(message, file=sys.stderr, flush=True)
        except (OSError, ValueError):
            pass
        os._exit(1)

    def _run(self) -> None:
        interval = min(1.0, max(self.timeout / 10, 0.05))
        while not self._stop.wait(interval):
            if self.launcher_gone():
                self.orphaned()
                return
            now = time.monotonic()
            if self.notices is not None and self._rank_ended(now):
                return
            for wait in self._watched():
                since = wait.since
                if since is not None and now - since > self.timeout + grace_of(wait):
                    if self._lost_rank(wait, now - since) and self._diverted.get(id(wait)) != since:
                        wait.since = self._diverted[id(wait)] = now  # it now ends with RanksLostError; watch it anew
                        continue
                    self._fire(wait, now - since)
                    return

    def _rank_ended(self, now: float) -> bool:
        """Whether a rank that ended made fewer world collectives than this rank has started,
        for ``finished.GRACE_SECONDS``: then report it and abort. Not only from a watched wait:
        the shared-memory flag waits time themselves in C, out of the watchdog's sight, and
        this rank cannot get past a collective that the ended rank never started anyway."""
        from . import finished

        try:
            ended = self.notices.poll()
        except Exception:  # noqa: BLE001 - the probe must never stop the stall watch
            self.notices = None
            return False
        started = self.started() if ended else 0
        early = finished.never_started(ended, started) if ended and self.blocked() else []
        if not early:
            self._early_since = None
            return False
        if self._early_since is None:
            self._early_since = now
        if now - self._early_since < finished.GRACE_SECONDS:
            return False
        waits = [w for w in self._watched() if w.since is not None]
        what = (text(min(waits, key=lambda w: w.since).what) if waits
                else f"collective #{started} on world")
        self.report(f"hpctrain: rank {self.rank}: " + finished.describe(early, started, what))
        return True

    def report(self, message: str, code: int = 3) -> None:
        """Print ``message`` and abort the job with ``code``."""
        self.fired.append(message)
        print(message, file=sys.stderr, flush=True)
        self._abort(code)

    def _lost_rank(self, wait: Union[Wait, ClockedWait], waited: float) -> bool:
        hook = ON_STALL["fn"]
        return hook is not None and hook(text(wait.what), waited, wait.waiting_for)

    def _fire(self, wait: Union[Wait, ClockedWait], waited: float) -> None:
        try:
            missing = wait.waiting_for()
        except Exception as exc:  # never let the report itself hide the stall
            missing = f"(could not tell: {exc})"
        self.stalled(wait.what, waited, missing)

    def stalled(self, what: Text, waited: float, missing: str) -> None:
        """Report a stall (``what`` waited ``waited`` s for ``missing``) and abort the job.
        Also called by waits that time out by themselves (shared-memory flags)."""
        message = (
            f"hpctrain: STALL on rank {self.rank}: {text(what)} has waited {waited:.1f} s "
            f"(HPCTRAIN_STALL_TIMEOUT={self.timeout:g}). Not arrived: {missing}.\n"
            "HINT: every rank must call the same collectives in the same order; a rank that "
            "crashed, skipped a step or has fewer batches stalls the others. Aborting the job."
        )
        self.report(message)
