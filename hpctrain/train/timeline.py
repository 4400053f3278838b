"""``timeline.json``: what every rank did, in Chrome trace format (Perfetto, chrome://tracing).

Each rank records complete events (``"ph": "X"``) in memory: ``data-wait``, ``forward``,
``backward``, ``comm-wait``, ``optimizer`` on the training thread (tid 1) and one
``allreduce bucket <b>`` per gradient bucket on the communication thread (tid 2), for the
first ``max_steps`` steps. At the end every rank sends its events to rank 0, which writes
one file: ``pid`` = rank (named "rank N"), timestamps in microseconds since a common start
(each rank's clock is started right after a barrier, so ranks line up within the barrier's
skew).
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

TRAIN_TID = 1
COMM_TID = 2


class Timeline:
    """Collects this rank's events; thread-safe (the comm thread records bucket events)."""

    def __init__(self, rank: int, enabled: bool = True, max_steps: int = 200) -> None:
        self.rank = rank
        self.enabled = enabled
        self.max_steps = max_steps
        self.t0 = time.perf_counter()
        self.events: List[Dict[str, Any]] = []
        self.step = 0
        self._lock = threading.Lock()

    def start_clock(self) -> None:
        """Call right after a barrier so ranks share time zero."""
        self.t0 = time.perf_counter()

    @property
    def recording(self) -> bool:
        return self.enabled and self.step < self.max_steps

    def add(self, name: str, start: float, end: float, tid: int = TRAIN_TID, step: Optional[int] = None,
            **args: Any) -> None:
        """Record ``name`` from ``start`` to ``end`` (``time.perf_counter()`` values)."""
        step = self.step if step is None else step
        if not (self.enabled and step < self.max_steps):
            return
        ev = {"name": name, "ph": "X", "pid": self.rank, "tid": tid,
              "ts": round((start - self.t0) * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3),
              "args": {"step": step, **args}}
        with self._lock:
            self.events.append(ev)

    def to_chrome(self, all_events: Sequence[Sequence[Dict[str, Any]]]) -> Dict[str, Any]:
        """One trace from every rank's events (index = rank)."""
        return chrome_trace(all_events)


def chrome_trace(per_rank: Sequence[Sequence[Dict[str, Any]]]) -> Dict[str, Any]:
    """Chrome trace JSON object: metadata naming each process ``rank N`` and its threads."""
    events: List[Dict[str, Any]] = []
    for rank, evs in enumerate(per_rank):
        events.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": TRAIN_TID, "args": {"name": "train"}})
        events.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": COMM_TID,
                       "args": {"name": "all-reduce"}})
        events.extend(evs)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_trace(path: Path, trace: Dict[str, Any]) -> None:
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(trace))
    tmp.replace(path)


class TracingBackend:
    """Wraps a DistributedOptimizer backend to time each bucket's all-reduce.

    For the ``mpi`` backend on CPU buffers the reduction runs on hpctrain.comm's
    background thread inside a closure that records when it actually starts and ends; for
    other backends (or device buffers) the event spans launch to completion as seen by
    ``wait()``.
    """

    def __init__(self, inner: Any, timeline: Timeline) -> None:
        self.inner = inner
        self.timeline = timeline
        self.name = getattr(inner, "name", "?")
        self._count = 0

    def allreduce_async(self, buf: torch.Tensor, op: str, name: str = "") -> Any:
        tl = self.timeline
        if not tl.recording:
            return self.inner.allreduce_async(buf, op, name=name)
        label = "allreduce " + (name.replace("hpctrain.", "") or "bucket")
        nbytes = buf.numel() * buf.element_size()
        if self.name == "mpi" and buf.device.type == "cpu" and buf.is_contiguous():
            from hpctrain import comm
            from hpctrain.comm import asyncq

            step = tl.step
            group = getattr(self.inner, "group", None)  # a process set's group (pipeline: data-parallel)

            def run() -> torch.Tensor:
                t0 = time.perf_counter()
                comm.allreduce_(buf, op=op, group=group)
                t1 = time.perf_counter()
                tl.add(label, t0, t1, tid=COMM_TID, step=step, bytes=nbytes)
                return buf

            return asyncq.submit(f"allreduce_async({op}) {name}", run)
        start, step = time.perf_counter(), tl.step
        return _TimedWork(self.inner.allreduce_async(buf, op, name=name), lambda end: tl.add(
            label, start, end, tid=COMM_TID, step=step, bytes=nbytes))

    def broadcast_(self, buf: torch.Tensor, root: int) -> torch.Tensor:
        return self.inner.broadcast_(buf, root)

    def barrier(self) -> None:
        self.inner.barrier()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


class _TimedWork:
    def __init__(self, work: Any, on_done: Callable[[float], None]) -> None:
        self.work, self.on_done, self.finished = work, on_done, False

    def wait(self) -> Any:
        out = self.work.wait()
        if not self.finished:
            self.finished = True
            self.on_done(time.perf_counter())
        return out

    def done(self) -> bool:
        return self.work.done()
