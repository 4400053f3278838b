"""Horovod's timeline: a Chrome trace (chrome://tracing, Perfetto) of the collectives a rank
ran, in Horovod's layout: a first metadata event (pid 0) holding the start time since the
epoch; one trace "process" per tensor, named ``<op>.<name>`` (``allreduce.grads``); per
operation a ``NEGOTIATE_<OP>`` span, then an ``<OP>`` span (ALLREDUCE, BROADCAST, ...) holding
the transfer's ``MPI_<OP>`` span. Timestamps are microseconds since the start. As in Horovod,
rank 0 writes the file, and the file is valid JSON after every event.

hpctrain agrees on a collective inside the collective itself, so its ``NEGOTIATE_<OP>`` span
is an instant at submission (Horovod's spans the wait for the other ranks) and it writes no
per-rank readiness (``X``) events. With ``mark_cycles`` a ``CYCLE_START`` marker (Horovod's
global instant event) opens each operation, not each round of the background thread."""
from __future__ import annotations

import json
import threading
import time
from typing import IO, Dict, Optional

__all__ = ["start", "stop", "active", "record"]

_lock = threading.Lock()
_state: Dict[str, object] = {"file": None, "pids": {}, "new": True, "mark_cycles": False, "start": 0.0}
# The transfer inside each operation, by Horovod's activity names (a barrier has none).
_ACTIVITY = {"ALLREDUCE": "MPI_ALLREDUCE", "ALLGATHER": "MPI_ALLGATHER", "BROADCAST": "MPI_BCAST",
             "ALLTOALL": "MPI_ALLTOALL", "REDUCESCATTER": "MPI_REDUCESCATTER"}


def active() -> bool:
    return _state["file"] is not None


def start(path: str, mark_cycles: bool = False) -> None:
    """Start writing to ``path`` (replacing a timeline already being written)."""
    stop()
    with _lock:
        _state.update(file=open(path, "w"), pids={}, new=True, mark_cycles=bool(mark_cycles), start=time.time())


def stop() -> None:
    with _lock:
        f: Optional[IO[str]] = _state["file"]  # type: ignore[assignment]
        if f is not None:
            if _state["new"]:
                f.write("[]")
            f.close()
        _state["file"] = None


def _emit(f: IO[str], event: dict) -> None:
    if _state["new"]:
        start = int(_state["start"] * 1e6)  # type: ignore[operator]
        f.write("[\n" + json.dumps({"name": "process_name", "ph": "M", "pid": 0,
                                     "args": {"start_time_since_epoch_in_micros": start}}) + ",\n")
        f.write(json.dumps({"name": "process_sort_index", "ph": "M", "pid": 0, "args": {"sort_index": 0}}) + ",\n")
        _state["new"] = False
    else:
        f.seek(f.tell() - 1)  # replace the closing bracket
        f.write(",\n")
    f.write(json.dumps(event) + "]")


def record(tensor_name: str, op_name: str, t0: float, t1: float) -> None:
    """One operation on ``tensor_name`` that ran from ``t0`` to ``t1`` (time.time() seconds)."""
    with _lock:
        f: Optional[IO[str]] = _state["file"]  # type: ignore[assignment]
        if f is None:
            return
        pids: Dict[str, int] = _state["pids"]  # type: ignore[assignment]
        pid = pids.get(tensor_name)
        if pid is None:
            pid = pids[tensor_name] = len(pids) + 1
            _emit(f, {"name": "process_name", "ph": "M", "pid": pid, "args": {"name": tensor_name}})
            _emit(f, {"name": "process_sort_index", "ph": "M", "pid": pid, "args": {"sort_index": pid}})
        start: float = _state["start"]  # type: ignore[assignment]
        ts0, ts1 = (max(0, int((t - start) * 1e6)) for t in (t0, t1))
        if _state["mark_cycles"]:
            _emit(f, {"ph": "i", "name": "CYCLE_START", "ts": ts0, "s": "g"})
        _emit(f, {"ph": "B", "name": f"NEGOTIATE_{op_name}", "ts": ts0, "pid": pid})
        _emit(f, {"ph": "E", "ts": ts0, "pid": pid})
        _emit(f, {"ph": "B", "name": op_name, "ts": ts0, "pid": pid})
        if op_name in _ACTIVITY:
            _emit(f, {"ph": "B", "name": _ACTIVITY[op_name], "ts": ts0, "pid": pid})
            _emit(f, {"ph": "E", "ts": ts1, "pid": pid})
        _emit(f, {"ph": "E", "ts": ts1, "pid": pid})
        f.flush()


def now() -> float:
    return time.time()
