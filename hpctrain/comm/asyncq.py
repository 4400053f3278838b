"""Asynchronous collectives: one background thread runs them in submission order.

Every rank must submit the same collectives in the same order (as for blocking ones); a
blocking collective first waits for the queue to drain, so the two never interleave.
"""
from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Optional


class Handle:
    """Result of an ``*_async`` call: ``wait()`` returns the result (or raises the error the
    operation raised), ``done()`` tells without blocking."""

    __slots__ = ("_event", "_result", "_error", "name")

    def __init__(self, name: str) -> None:
        self._event = threading.Event()
        self._result: Any = None
        self._error: Optional[BaseException] = None
        self.name = name

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: Optional[float] = None) -> Any:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.name} did not finish within {timeout} s")
        if self._error is not None:
            raise self._error
        return self._result

    def _finish(self, result: Any = None, error: Optional[BaseException] = None) -> None:
        self._result, self._error = result, error
        self._event.set()


class _Worker:
    def __init__(self) -> None:
        self._queue: "queue.Queue" = queue.Queue()
        self._pending = 0
        self._idle = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hpctrain-collectives", daemon=True)
        self._thread.start()

    def submit(self, name: str, fn: Callable[[], Any]) -> Handle:
        handle = Handle(name)
        with self._idle:
            self._pending += 1
        self._queue.put((handle, fn))
        return handle

    def drain(self) -> None:
        with self._idle:
            while self._pending:
                self._idle.wait()

    def _run(self) -> None:
        while True:
            handle, fn = self._queue.get()
            try:
                handle._finish(fn())
            except BaseException as exc:  # delivered to whoever waits on the handle
                handle._finish(error=exc)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()


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


def submit(name: str, fn: Callable[[], Any]) -> Handle:
    with _lock:
        if _worker["w"] is None:
            _worker["w"] = _Worker()
            STATE.started = True
    return _worker["w"].submit(name, fn)


def drain() -> None:
    """Wait until every submitted async collective has finished."""
    w = _worker["w"]
    if w is not None and threading.current_thread() is not w._thread:
        w.drain()


def on_worker_thread() -> bool:
    w = _worker["w"]
    return w is not None and threading.current_thread() is w._thread
