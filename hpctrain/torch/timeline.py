"""Horovod's timeline: a Chrome trace (chrome://tracing, Perfetto) of the collectives a rank
ran, in Horovod's layout: one trace "process" per tensor name, one begin/end pair per
operation, named after the operation (ALLREDUCE, BROADCAST, ...). As in Horovod, rank 0
writes the file, and the file is valid JSON after every event."""
from __future__ import annotations

import json
import threading
import time
from typing import IO, Dict, Optional

__all__ = ["start", "stop", "active", "record"]

_lock = threading.Lock()
_state: Dict[str, object] = {"file": None, "pids": {}, "new": True, "mark_cycles": False}


def active() -> bool:
    return _state["file"] is not None


def start(path: str, mark_cycles: bool = False) -> None:
    """Start writing to ``path`` (replacing a timeline already being written)."""
    stop()
    with _lock:
        _state.update(file=open(path, "w"), pids={}, new=True, mark_cycles=bool(mark_cycles))


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
        f.write("[\n")
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
        _emit(f, {"ph": "B", "name": op_name, "ts": int(t0 * 1e6), "pid": pid})
        _emit(f, {"ph": "E", "ts": int(t1 * 1e6), "pid": pid})
        f.flush()


def now() -> float:
    return time.time()
