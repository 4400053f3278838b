"""Asynchronous collectives: one background thread runs them in submission order.

Every rank must submit the same collectives in the same order (as for blocking ones); a
blocking collective first waits for the queue to drain, so the two never interleave.

Fusion (Horovod's tensor fusion for ``hvd.allreduce_async``): a job submitted with a
:class:`Fusable` may run as one collective together with the fusable jobs of the same key
queued right behind it. How many is agreed by the ranks (``Fusable.negotiate``: the smallest
count queued on any rank), so every rank fuses the same jobs, in the same order, whatever
its own queue held when its background thread got there. As in Horovod's cycle
(``HOROVOD_CYCLE_TIME``, default 1 ms), the thread holds a fusable job until that long after
its submission, so that the calls issued right behind it can join it, unless a caller is
already waiting for the thread (``synchronize``, a blocking collective): then it runs at once.
"""
from __future__ import annotations

import collections
import os
import threading
import time
from typing import Any, Callable, Deque, Hashable, List, Optional, Sequence, Tuple


class Handle:
    """Result of an ``*_async`` call: ``wait()`` returns the result (or raises the error the
    operation raised), ``done()`` tells without blocking."""

    __slots__ = ("_event", "_result", "_error", "name", "seq")

    def __init__(self, name: str, seq: int = 0) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self.name = name
        self.seq = seq  # its place in submission order (1, 2, …): jobs finish in that order

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._event.is_set():
            with _waiting():
                finished = self._event.wait(timeout)
            if not finished:
                raise TimeoutError(f"{self.name} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._event.set()


class Fusable:
    """What makes a queued job fusable with its neighbours.

    ``key``: jobs fuse only with consecutive jobs of an equal key (same group, op, dtype);
    ``nbytes``: the job's payload, counted against the fusion threshold; ``item``: what
    ``run_many`` receives for this job; ``run_many(items)``: run the fused collective, return
    one result per item; ``negotiate(count)``: a collective every rank of the group calls at
    the same point of its queue, returning the count all ranks can fuse (1 ≤ result ≤ count)."""

    __slots__ = ("key", "nbytes", "item", "run_many", "negotiate", "since")

    def __init__(self, key: Hashable, nbytes: int, item: Any,
                 run_many: Callable[[List[Any]], Sequence[Any]], negotiate: Callable[[int], int]) -> None:
        self.key, self.nbytes, self.item, self.run_many, self.negotiate = key, nbytes, item, run_many, negotiate
        self.since = time.monotonic()  # submission: the cycle is counted from here


_Job = Tuple[Handle, Callable[[], Any], Optional[Fusable]]

_WAITERS = [0]  # threads waiting now for the background thread's work (a result, or the drain)
_waiters_lock = threading.Lock()


class _waiting:
    """Counts a thread in ``_WAITERS`` while it waits for the background thread."""

    def __enter__(self) -> None:
        with _waiters_lock:
            _WAITERS[0] += 1
        w = _worker["w"]
        # A job held for its cycle runs now: nothing more joins it while we wait. Only a holding
        # worker needs the wake-up: one that starts holding later sees _WAITERS, raised above.
        if w is not None and w.holding:
            with w._cond:
                w._cond.notify_all()

    def __exit__(self, *exc: Any) -> None:
        with _waiters_lock:
            _WAITERS[0] -= 1


def foreground_blocked() -> bool:
    """Whether a collective of this process may hold up a caller now: the background thread
    is idle (a stuck collective is then a caller's own), or some thread waits for its work.
    False while only the background thread is stuck and no caller waits for it (e.g. the
    program is ending with an unsynchronized operation left)."""
    w = _worker["w"]
    return w is None or not w._pending or _WAITERS[0] > 0


class _Worker:
    def __init__(self) -> None:
        self._jobs: Deque[_Job] = collections.deque()
        self._pending = 0
        self._cond = threading.Condition()
        self.fused_calls = 0  # collectives that ran several fused jobs (fused_calls(); the tests read it)
        self.submitted = 0  # jobs submitted so far
        self.drained_through = 0  # every job up to this number had finished when a drain() returned
        self.holding = False  # the thread holds a fusable job for its cycle
        self._thread = threading.Thread(target=self._run, name="hpctrain-collectives", daemon=True)
        self._thread.start()

    def submit(self, name: str, fn: Callable[[], Any], fuse: Optional[Fusable] = None) -> Handle:
        with self._cond:
            self.submitted += 1
            handle = Handle(name, self.submitted)
            self._pending += 1
            self._jobs.append((handle, fn, fuse))
            self._cond.notify_all()
        return handle

    def drain(self) -> None:
        with self._cond:
            if self._pending:
                with _waiting():
                    while self._pending:
                        self._cond.wait()
            self.drained_through = self.submitted

    def _next(self) -> _Job:
        with self._cond:
            while not self._jobs:
                self._cond.wait()
            return self._jobs.popleft()

    def _hold_for_cycle(self, fuse: Fusable) -> None:
        """Wait until the cycle time has passed since ``fuse``'s submission, or a caller waits."""
        deadline = fuse.since + cycle_seconds()
        with self._cond:
            self.holding = True
            try:
                while _WAITERS[0] == 0:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    self._cond.wait(left)
            finally:
                self.holding = False

    def _fusable_behind(self, first: Fusable) -> int:
        """How many jobs queued right now, counting ``first``, could fuse with it."""
        limit = fusion_threshold()
        count, total = 1, first.nbytes
        with self._cond:
            for _, _, fuse in self._jobs:
                if fuse is None or fuse.key != first.key or total + fuse.nbytes > limit:
                    break
                count, total = count + 1, total + fuse.nbytes
        return count

    def _run(self) -> None:
        while True:
            handle, fn, fuse = self._next()
            done = 1
            if fuse is None:
                self._run_one(handle, fn)
            else:
                self._hold_for_cycle(fuse)
                done = self._run_fused(handle, fn, fuse)
            with self._cond:
                self._pending -= done
                self._cond.notify_all()

    @staticmethod
    def _run_one(handle: Handle, fn: Callable[[], Any]) -> None:
        try:
            handle._finish(fn())
        except BaseException as exc:  # delivered to whoever waits on the handle
            handle._finish(error=exc)

    def _run_fused(self, handle: Handle, fn: Callable[[], Any], fuse: Fusable) -> int:
        """Agree with the other ranks how many of the jobs queued behind this one to fuse, run
        them as one collective; returns the number of jobs done."""
        try:
            count = fuse.negotiate(self._fusable_behind(fuse))
        except BaseException as exc:
            handle._finish(error=exc)
            return 1
        if count <= 1:
            self._run_one(handle, fn)
            return 1
        with self._cond:  # only this thread takes jobs, and ``count`` of them are queued
            jobs = [(handle, fn, fuse)] + [self._jobs.popleft() for _ in range(count - 1)]
        try:
            results = fuse.run_many([job[2].item for job in jobs])
        except BaseException as exc:
            for h, _, _ in jobs:
                h._finish(error=exc)
        else:
            for (h, _, _), result in zip(jobs, results):
                h._finish(result)
            self.fused_calls += 1
        return count


DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024  # Horovod's default (HOROVOD_FUSION_THRESHOLD)
DEFAULT_CYCLE_MS = 1.0  # Horovod's default (HOROVOD_CYCLE_TIME, milliseconds)


def cycle_seconds() -> float:
    """How long a fusable job waits for company: ``HOROVOD_CYCLE_TIME`` milliseconds as under
    Horovod (0: not at all), else 1 ms."""
    value = os.environ.get("HOROVOD_CYCLE_TIME", "").strip()
    if not value:
        return DEFAULT_CYCLE_MS / 1000
    try:
        return max(0.0, float(value)) / 1000
    except ValueError:
        raise ValueError(f"HOROVOD_CYCLE_TIME={value!r} is not a number of milliseconds.\n"
                         "HINT: e.g. HOROVOD_CYCLE_TIME=1, or 0 to run each call as soon as the thread gets to it") from None


def fusion_threshold() -> int:
    """Bytes one fused collective may carry: ``HOROVOD_FUSION_THRESHOLD`` as under Horovod
    (0 turns fusion off), else 128 MiB, Horovod's default."""
    value = os.environ.get("HOROVOD_FUSION_THRESHOLD", "").strip()
    if not value:
        return DEFAULT_FUSION_THRESHOLD
    try:
        return max(0, int(value))
    except ValueError:
        raise ValueError(f"HOROVOD_FUSION_THRESHOLD={value!r} is not a number of bytes.\n"
                         "HINT: e.g. HOROVOD_FUSION_THRESHOLD=67108864 (64 MiB), or 0 to turn fusion off") from None


class State:
    """``started``: an async collective was submitted in this process (the background thread
    exists). Read by the blocking collectives on every call, hence an attribute: while it is
    False there is nothing to ``drain``."""

    __slots__ = ("started",)

    def __init__(self) -> None:
        self.started = False


STATE = State()
_worker: dict = {"w": None}
_lock = threading.Lock()


def submit(name: str, fn: Callable[[], Any], fuse: Optional[Fusable] = None) -> Handle:
    """Queue ``fn`` for the background thread. With ``fuse``, the thread may run it together
    with the equal-keyed fusable jobs queued behind it (``fuse.run_many``) instead."""
    with _lock:
        if _worker["w"] is None:
            _worker["w"] = _Worker()
            STATE.started = True
    return _worker["w"].submit(name, fn, fuse)


def run_now(name: str, fn: Callable[[], Any]) -> "Finished":
    """Run ``fn`` in the caller's thread, after every queued async collective (the order every
    rank keeps), and return its finished handle: a blocking call submitted as an async one
    would wait for the background thread to wake (on a busy 2-core machine ~100 µs, more than
    a small all-reduce itself). Its error is raised by ``wait()``, as an async job's is."""
    drain()
    try:
        return Finished(name, fn())
    except BaseException as exc:  # delivered to whoever waits on the handle, as for async jobs
        return Finished(name, error=exc)


class Finished:
    """A ``Handle`` whose operation has already run (``run_now``): no event to wait on."""

    __slots__ = ("_result", "_error", "name")

    def __init__(self, name: str, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error, self.name = result, error, name

    def done(self) -> bool:
        return True

    def wait(self, timeout: Optional[float] = None) -> Any:
        if self._error is not None:
            raise self._error
        return self._result


def drain() -> None:
    """Wait until every submitted async collective has finished."""
    w = _worker["w"]
    if w is not None and threading.current_thread() is not w._thread:
        w.drain()


def drained_through() -> int:
    """The number of the last job known finished at the last ``drain()`` (0: none yet). A drain
    runs at the same point of the program on every rank (a blocking collective), so this
    number, unlike a job's completion, is the same on every rank at the same call."""
    w = _worker["w"]
    return 0 if w is None else w.drained_through


def fused_calls() -> int:
    """How many collectives so far ran several fused async jobs (0 before any async call)."""
    w = _worker["w"]
    return 0 if w is None else w.fused_calls


def on_worker_thread() -> bool:
    w = _worker["w"]
    return w is not None and threading.current_thread() is w._thread
