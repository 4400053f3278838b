"""The batch-size search, as a pure state machine: it proposes a batch size, is told how
the trial went, and proposes the next one. No torch, no MPI, no clock.

A trial at batch ``b`` *fits* when it ran without running out of memory and its measured
peak memory is at most ``limit`` bytes (the budget less the safety margin). Feasibility is
assumed monotone in ``b``. The search keeps ``lo`` (largest batch seen to fit) and ``hi``
(smallest batch seen not to fit) and stops when

* ``hi == lo + 1`` (exact), or
* ``lo >= (1 - tolerance) * (hi - 1)`` — the true largest feasible batch ``B*`` lies in
  ``[lo, hi - 1]``, so ``lo`` is within ``tolerance`` of it, or
* ``lo`` reached ``max_batch``.

How it chooses the next batch:

1. **Grow exponentially** from ``start``, doubling, until a trial does not fit. Once the
   last two fitting trials differ in measured memory by a clear amount (at least
   ``trust_fraction`` of the limit, so measurement noise is small beside it), a straight
   line through them predicts where memory reaches the limit and the search jumps there
   (at least doubling, at most ``max_jump`` ×) instead of doubling step by step.
2. **Binary search** inside the bracket ``(lo, hi)``. With measured peaks on both sides the
   line through the two bracketing points (regula falsi, in batch units) proposes a point
   just below the predicted maximum; a point that would finish the search when it fits is
   preferred. If model-guided steps stop shrinking the bracket (curved memory, noisy
   measurements, out-of-memory without a measurement), a plain bisection step follows — a
   geometric one (``sqrt(lo * hi)``) because the tolerance is relative.

With measured peaks and memory roughly linear in the batch this finishes within
``ceil(log2(B*)) + 3`` trials (unit-tested, and tested against exhaustive search); with no
measurements at all (only "fits"/"out of memory") it is plain exponential growth plus
geometric bisection.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

# Trial outcomes.
FITS = "fits"
OVER = "over budget"  # ran, but its measured peak is above the limit
OOM = "out of memory"  # the allocator failed (CUDA OOM, CPU allocation failure)


@dataclass(frozen=True)
class SearchConfig:
    """Knobs of the search. ``tolerance`` is relative: the answer is at least
    ``(1 - tolerance)`` × the true largest feasible batch."""

    start: int = 1
    max_batch: int = 1 << 20
    tolerance: float = 0.05
    trust_fraction: float = 0.125
    max_jump: int = 64
    max_trials: int = 64
    noise_floor: int = 0

    def __post_init__(self) -> None:
        if self.start < 1:
            raise ValueError(f"start batch must be ≥ 1, got {self.start}")
        if self.max_batch < self.start:
            raise ValueError(f"max_batch ({self.max_batch}) must be ≥ start ({self.start})")
        if not 0.0 <= self.tolerance < 0.5:
            raise ValueError(f"tolerance must be in [0, 0.5), got {self.tolerance}")
        if not 0.0 < self.trust_fraction <= 1.0:
            raise ValueError(f"trust_fraction must be in (0, 1], got {self.trust_fraction}")
        if self.max_jump < 2:
            raise ValueError(f"max_jump must be ≥ 2, got {self.max_jump}")
        if self.noise_floor < 0:
            raise ValueError(f"noise_floor must be ≥ 0 bytes, got {self.noise_floor}")
        if self.max_trials < 1:
            raise ValueError(f"max_trials must be ≥ 1, got {self.max_trials}")


@dataclass(frozen=True)
class Trial:
    """One measured trial. ``peak`` is the measured peak memory in bytes (None when the
    trial died of out-of-memory before it could be measured)."""

    batch: int
    outcome: str
    peak: Optional[int] = None
    detail: str = ""

    @property
    def fits(self) -> bool:
        return self.outcome == FITS

    def __post_init__(self) -> None:
        if self.outcome not in (FITS, OVER, OOM):
            raise ValueError(f"trial outcome must be one of {FITS!r}, {OVER!r}, {OOM!r}; got {self.outcome!r}")
        if self.batch < 1:
            raise ValueError(f"trial batch must be ≥ 1, got {self.batch}")


@dataclass(frozen=True)
class SearchResult:
    """Where the search ended. ``batch`` is 0 when not even ``start`` fit (and ``start``
    was 1)."""

    batch: int
    trials: Tuple[Trial, ...]
    lo: int
    hi: Optional[int]
    stopped: str  # why the search stopped, in words
    limit: int

    @property
    def peak(self) -> Optional[int]:
        for t in self.trials:
            if t.batch == self.batch and t.fits:
                return t.peak
        return None


def classify(batch: int, peak: Optional[int], limit: int, oom: bool, detail: str = "") -> Trial:
    """Turn a measurement into a Trial: out of memory, over the limit, or fits."""
    if oom:
        return Trial(batch, OOM, peak, detail)
    if peak is not None and peak > limit:
        return Trial(batch, OVER, peak, detail)
    return Trial(batch, FITS, peak, detail)


class BatchSearch:
    """Ask/tell search: ``next_batch()`` proposes (None when done), ``record(trial)``
    reports. ``result()`` summarizes."""

    def __init__(self, limit: int, config: SearchConfig = SearchConfig()) -> None:
        if limit <= 0:
            raise ValueError(f"memory limit must be positive, got {limit} bytes")
        self.limit = int(limit)
        self.config = config
        self.trials: List[Trial] = []
        self._stopped: Optional[str] = None
        self._model_steps_without_halving = 0
        self._last_width: Optional[float] = None

    # ------------------------------------------------------------------ state
    @property
    def lo(self) -> int:
        return max((t.batch for t in self.trials if t.fits), default=0)

    @property
    def hi(self) -> Optional[int]:
        lo = self.lo
        above = [t.batch for t in self.trials if not t.fits and t.batch > lo]
        return min(above) if above else None

    def record(self, trial: Trial) -> None:
        if any(t.batch == trial.batch for t in self.trials):
            raise ValueError(f"batch {trial.batch} was already tried")
        self.trials.append(trial)

    def result(self) -> SearchResult:
        return SearchResult(self.lo, tuple(self.trials), self.lo, self.hi, self._stopped or "not finished", self.limit)

    # ------------------------------------------------------------------ deciding
    def _done(self) -> Optional[str]:
        cfg = self.config
        lo, hi = self.lo, self.hi
        if len(self.trials) >= cfg.max_trials:
            return f"reached the trial limit ({cfg.max_trials})"
        if lo >= cfg.max_batch:
            return f"reached max_batch={cfg.max_batch}"
        if hi is not None:
            if hi <= lo + 1:
                if lo == 0:
                    return f"batch {hi} does not fit"
                return f"exact: {lo} fits, {hi} does not"
            if lo > 0 and lo >= (1.0 - cfg.tolerance) * (hi - 1):
                return f"{lo} fits, {hi} does not: within {cfg.tolerance:.0%} of the largest"
        return None

    def _points(self) -> List[Tuple[int, int]]:
        """(batch, peak) of measured trials, fitting ones and measured over-budget ones."""
        return sorted((t.batch, t.peak) for t in self.trials if t.peak is not None and t.outcome != OOM)

    def _predict(self) -> Optional[float]:
        """Batch at which memory reaches the limit, from measured trials: a line through
        the largest fitting trial and, if measured, the smallest over-budget one above it
        (interpolation), else the fitting trial below it (extrapolation). When a third
        measured point shows memory growing faster than linearly (activations that grow
        with the square of the batch, say), the smaller root of the parabola through the
        three points is used if it is smaller. None when no trustworthy line exists."""
        lo, hi = self.lo, self.hi
        fits = sorted((t.batch, t.peak) for t in self.trials if t.fits and t.peak is not None)
        if not fits or fits[-1][0] != lo:
            return None
        over = sorted((t.batch, t.peak) for t in self.trials
                      if t.outcome == OVER and t.peak is not None and t.batch > lo)
        # Points far enough apart that their difference is signal, not noise: each one at
        # most half the batch of the next when such a trial exists.
        spread = [fits[-1]]
        for b, m in reversed(fits[:-1]):
            if len(spread) == 3:
                break
            if b <= spread[0][0] / 2 or b == fits[0][0]:
                spread.insert(0, (b, m))
        if len(spread) < 3 and len(fits) >= 2 and fits[-2] not in spread:
            spread.insert(-1, fits[-2])
            spread = sorted(set(spread))[-3:]
        if hi is not None and over:
            points = spread[-2:] + over[:1]
        else:
            if len(spread) < 2:
                return None
            (_, m0), (_, m1) = spread[-2], spread[-1]
            if m1 - m0 <= max(self.config.noise_floor, self.config.trust_fraction * (self.limit - m1)):
                return None  # too little signal beside measurement noise
            points = spread
        (b1, m1), (b2, m2) = points[-2], points[-1]
        if m2 <= m1:
            return None
        linear = b1 + (self.limit - m1) * (b2 - b1) / (m2 - m1)
        if len(points) == 3:
            curved = _parabola_crossing(points, self.limit)
            if curved is not None and points[1][0] < curved < linear:
                return curved
        return linear

    def next_batch(self) -> Optional[int]:
        """The next batch size to try, or None when the search is over."""
        if self._stopped is not None:
            return None
        cfg = self.config
        if not self.trials:
            return cfg.start
        reason = self._done()
        if reason is not None:
            self._stopped = reason
            return None
        lo, hi = self.lo, self.hi
        pred = self._predict()
        if hi is None:
            candidate = self._grow(lo, pred)
        else:
            candidate = self._narrow(lo, hi, pred)
        candidate = min(candidate, cfg.max_batch)
        tried = {t.batch for t in self.trials}
        if candidate in tried or candidate <= lo or (hi is not None and candidate >= hi):
            # Cannot happen with a consistent state; fall back to bisection.
            candidate = self._bisect(lo, hi if hi is not None else 2 * max(lo, 1))
            if candidate in tried:
                self._stopped = "no untried batch left between the bounds"
                return None
        return candidate

    def _straddle(self, pred: float) -> Tuple[int, int]:
        """Two batches around the prediction, close enough that "the lower fits and the
        upper does not" finishes the search."""
        third = self.config.tolerance / 3.0
        return math.floor(pred * (1.0 - third)), math.ceil(pred * (1.0 + third))

    def _grow(self, lo: int, pred: Optional[float]) -> int:
        cfg = self.config
        if lo == 0:  # cannot happen: start either fits (lo > 0) or gives hi
            return cfg.start
        if pred is None or pred <= lo:
            return 2 * lo
        # Aim just above the prediction: if the line is right this does not fit, and the
        # next (interpolated) trial, just below it, closes the bracket.
        _, high = self._straddle(pred)
        return int(min(max(high, lo + 1), cfg.max_jump * lo))

    def _bisect(self, lo: int, hi: int) -> int:
        mid = int(round(math.sqrt(max(lo, 1) * hi)))
        return min(max(mid, lo + 1), hi - 1)

    def _narrow(self, lo: int, hi: int, pred: Optional[float]) -> int:
        cfg = self.config
        width = math.log(hi / max(lo, 1))
        if self._last_width is not None and width > 0.5 * self._last_width:
            self._model_steps_without_halving += 1
        else:
            self._model_steps_without_halving = 0
        self._last_width = width
        if pred is not None and pred >= hi > lo + 1:
            # The line overshoots a measured failure (noise, or memory growing faster near the
            # limit): the crossing most likely lies just below that failure, so probe there; if
            # the line is far off, the no-halving rule below turns to bisection within two steps.
            pred = hi * (1.0 - cfg.tolerance / 3.0)
        if pred is None or lo == 0 or not lo < pred < hi or self._model_steps_without_halving >= 2:
            # No line, or one that contradicts what was measured, or one that stopped
            # helping: bisect.
            self._model_steps_without_halving = 0
            return self._bisect(lo, hi)
        low, high = self._straddle(pred)
        low = min(max(low, lo + 1), hi - 1)
        high = min(max(high, lo + 1), hi - 1)
        if low >= (1.0 - cfg.tolerance) * (hi - 1):
            return low  # fitting here finishes
        if lo >= (1.0 - cfg.tolerance) * (high - 1):
            return high  # failing here finishes
        # Otherwise probe on the side where the bracket is wider (in log space).
        return low if math.log(pred / lo) >= math.log(hi / pred) else high


def _parabola_crossing(points: List[Tuple[int, int]], limit: int) -> Optional[float]:
    """Smallest x beyond the middle point where the parabola through three (x, y) points
    with positive curvature reaches ``limit``; None if it is not convex or never does."""
    (x0, y0), (x1, y1), (x2, y2) = points
    if not x0 < x1 < x2:
        return None
    s01 = (y1 - y0) / (x1 - x0)
    s12 = (y2 - y1) / (x2 - x1)
    c = (s12 - s01) / (x2 - x0)
    if c <= 0:
        return None
    b = s12 - c * (x1 + x2)
    a = y2 - b * x2 - c * x2 * x2
    disc = b * b - 4 * c * (a - limit)
    if disc < 0:
        return None
    root = (-b + math.sqrt(disc)) / (2 * c)
    return root if root > x1 else None


def run_search(trial: Callable[[int], Trial], limit: int, config: SearchConfig = SearchConfig()) -> SearchResult:
    """Drive a BatchSearch with a trial function (real or simulated)."""
    search = BatchSearch(limit, config)
    while True:
        batch = search.next_batch()
        if batch is None:
            return search.result()
        result = trial(batch)
        if result.batch != batch:
            raise ValueError(f"trial function answered for batch {result.batch}, asked {batch}")
        search.record(result)


def exhaustive_max(fits: Callable[[int], bool], max_batch: int) -> int:
    """The largest b ≤ max_batch with fits(b), scanning upward until the first failure
    (feasibility is monotone). For tests."""
    best = 0
    for b in range(1, max_batch + 1):
        if not fits(b):
            break
        best = b
    return best


@dataclass
class SimulatedMemory:
    """A memory model for tests and docs: peak(b) = fixed + per_sample*b + quadratic*b^2
    (+ deterministic noise); the device holds ``capacity`` bytes (allocations beyond it
    fail without a measurement)."""

    fixed: int
    per_sample: float
    quadratic: float = 0.0
    noise: int = 0
    capacity: Optional[int] = None
    calls: List[int] = field(default_factory=list)

    def peak(self, b: int) -> int:
        jitter = 0
        if self.noise:
            jitter = ((b * 2654435761) % 1000) / 999.0 * 2 * self.noise - self.noise
        return int(self.fixed + self.per_sample * b + self.quadratic * b * b + jitter)

    def trial(self, limit: int) -> Callable[[int], Trial]:
        def run(b: int) -> Trial:
            self.calls.append(b)
            p = self.peak(b)
            if self.capacity is not None and p > self.capacity:
                return Trial(b, OOM, None, "simulated OOM")
            return classify(b, p, limit, oom=False)

        return run

    def fits(self, limit: int) -> Callable[[int], bool]:
        return lambda b: (self.capacity is None or self.peak(b) <= self.capacity) and self.peak(b) <= limit
