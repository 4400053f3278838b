"""Per-step metrics (``metrics.jsonl``), straggler detection and data-share re-weighting.

``metrics.jsonl`` holds one JSON object per line, written by rank 0:

- ``{"kind": "train", "step", "epoch", "loss", "lr", "samples", "samples_per_s", "step_time",
  "data_wait", "forward", "backward", "compute", "comm", "optimizer", "rss_mb", "time",
  "rank_step_time": [...], "rank_compute": [...], "rank_comm": [...], "rank_data_wait": [...],
  "rank_rss_mb": [...], "rank_cpu_percent": [...], "rank_gpu_util": [...], "rank_gpu_mem_mb": [...]}``
  — one per optimizer step (CPU/GPU utilisation and memory from a background sampler; -1 where
  not measured); times in seconds; ``rank_*`` lists are
  indexed by rank; ``loss`` is the mean over every rank's real (non-padding) samples.
- ``{"kind": "eval", "step", "epoch", "test_loss", "test_accuracy", "test_samples"}``
- ``{"kind": "event", "step", "what", ...}`` — stragglers, re-balancing, NaN, resume, stop.

The detector and the re-weighting are pure functions of measured times (unit-tested).
"""
from __future__ import annotations

import json
import logging
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

log = logging.getLogger("hpctrain.train")

#: Fields each rank contributes to the per-step gather, in order.
RANK_FIELDS = ("step_time", "data_wait", "forward", "backward", "comm", "optimizer", "rss_mb", "cpu_percent",
               "gpu_util", "gpu_mem_mb")


def rss_mb() -> float:
    """Resident set size of this process in MiB (psutil; 0 when unavailable)."""
    try:
        import psutil

        return psutil.Process(os.getpid()).memory_info().rss / 2**20
    except Exception:  # noqa: BLE001 - monitoring must never break training
        return 0.0


class MetricsWriter:
    """Appends JSON lines to ``path`` (rank 0); on other ranks every call is a no-op."""

    def __init__(self, path: Optional[Path], append: bool = False) -> None:
        self.path = Path(path) if path is not None else None
        self._f = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.path, "a" if append else "w", buffering=1)

    def write(self, record: Dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, allow_nan=True) + "\n")

    def flush(self) -> None:
        if self._f is not None:
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def read_metrics(path: Path) -> List[Dict[str, Any]]:
    """Records of a ``metrics.jsonl``; a torn last line (a killed run) is ignored. When a run was
    resumed, records of steps that were redone replace the earlier ones."""
    records: List[Dict[str, Any]] = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    # Keep the last record per (kind, step) for train/eval, preserving order of last writes.
    last: Dict[Any, int] = {}
    for i, r in enumerate(records):
        if r.get("kind") in ("train", "eval"):
            last[(r["kind"], r.get("step"))] = i
    return [r for i, r in enumerate(records)
            if r.get("kind") not in ("train", "eval") or last[(r["kind"], r.get("step"))] == i]


# ---------------------------------------------------------------------------- stragglers
@dataclass
class StragglerDetector:
    """Warn when a rank is persistently slower than the median.

    Feed it, every log interval, each rank's mean *busy* time per step (step time minus the
    time spent waiting for communication: a slow rank makes the others wait in the
    all-reduce, so their total step times look alike while their busy times do not). A rank
    whose busy time exceeds the median by more than ``threshold`` (0.2 = 20 %) for
    ``patience`` consecutive intervals is reported once, until it recovers.
    """

    threshold: float = 0.2
    patience: int = 3
    streak: Dict[int, int] = field(default_factory=dict)
    reported: set = field(default_factory=set)

    def update(self, busy: Sequence[float]) -> List[Dict[str, Any]]:
        """New straggler reports: ``[{"rank", "busy", "median", "slower_by"}]``."""
        if len(busy) < 2:
            return []
        med = statistics.median(busy)
        out: List[Dict[str, Any]] = []
        for r, t in enumerate(busy):
            slow = med > 0 and t > med * (1.0 + self.threshold)
            if slow:
                self.streak[r] = self.streak.get(r, 0) + 1
                if self.streak[r] >= self.patience and r not in self.reported:
                    self.reported.add(r)
                    out.append({"rank": r, "busy": float(t), "median": float(med),
                                "slower_by": float(t / med - 1.0)})
            else:
                self.streak[r] = 0
                self.reported.discard(r)
        return out


def rebalance_weights(samples_per_s: Sequence[float], previous: Optional[Sequence[float]] = None,
                      min_change: float = 0.05, floor: float = 0.05) -> Optional[List[float]]:
    """Weights for the planner's ``weighted`` policy from each rank's measured throughput.

    A rank's share becomes proportional to the samples per second of busy time it achieved.
    Returns None when the new shares differ from ``previous`` by less than ``min_change``
    (relative, per rank) — re-planning for noise only churns the data order. Each share is at
    least ``floor`` of the mean, so a momentarily stalled rank is not starved.
    """
    rates = [max(float(r), 0.0) for r in samples_per_s]
    if len(rates) < 2 or not all(r > 0 for r in rates):
        return None
    mean = sum(rates) / len(rates)
    rates = [max(r, floor * mean) for r in rates]
    total = sum(rates)
    new = [r / total * len(rates) for r in rates]  # mean 1.0
    if previous is not None:
        prev_total = sum(previous)
        prev = [p / prev_total * len(previous) for p in previous]
        if len(prev) == len(new) and all(abs(a - b) <= min_change * b for a, b in zip(new, prev)):
            return None
    elif all(abs(w - 1.0) <= min_change for w in new):
        return None
    return [round(w, 4) for w in new]


def summarize_ranks(rows: Sequence[Sequence[float]]) -> Dict[str, List[float]]:
    """Turn gathered per-rank rows (``RANK_FIELDS`` order) into ``{"rank_<field>": [...]}``."""
    out: Dict[str, List[float]] = {}
    for j, name in enumerate(RANK_FIELDS):
        out["rank_" + name] = [float(row[j]) for row in rows]
    out["rank_compute"] = [float(row[2] + row[3]) for row in rows]
    return out
