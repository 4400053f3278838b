"""Pure partition planner: which contiguous run of layers each pipeline stage gets.

Input is a list of per-layer costs (parameter counts, or measured seconds) and a stage count,
or explicit split points. Output is a frozen :class:`PartitionPlan` that validates itself. No
torch, no MPI: the same plan is computed on every rank from the same numbers.

Balancing minimises the cost of the most expensive stage (the pipeline runs at the pace of its
slowest stage) by dynamic programming over contiguous splits; among equally good splits it
prefers the one whose largest stage has the fewest layers, then the earliest boundaries, so
the plan is deterministic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from hpctrain.comm.plan import chunk_bounds

BALANCE_MODES = ("params", "time")


class PartitionError(ValueError):
    """A model that cannot be split as asked."""


@dataclass(frozen=True)
class PartitionPlan:
    """Stage s owns layers ``bounds[s][0] … bounds[s][1]−1`` of the original sequence."""

    num_layers: int
    bounds: Tuple[Tuple[int, int], ...]
    costs: Tuple[float, ...] = ()  # per stage, in the units the plan was balanced on

    def __post_init__(self) -> None:
        if not self.bounds:
            raise PartitionError("a partition needs at least one stage")
        expect = 0
        for s, (lo, hi) in enumerate(self.bounds):
            if lo != expect or hi <= lo:
                raise PartitionError(f"stage {s} has layers [{lo}, {hi}); stages must be non-empty, contiguous and "
                                     f"in order (expected to start at layer {expect})")
            expect = hi
        if expect != self.num_layers:
            raise PartitionError(f"the stages cover layers [0, {expect}) of {self.num_layers}")
        if self.costs and len(self.costs) != len(self.bounds):
            raise PartitionError(f"{len(self.costs)} stage costs for {len(self.bounds)} stages")

    @property
    def stages(self) -> int:
        return len(self.bounds)

    @property
    def split_points(self) -> Tuple[int, ...]:
        """Index of the first layer of stages 1…S−1."""
        return tuple(lo for lo, _ in self.bounds[1:])

    @property
    def sizes(self) -> Tuple[int, ...]:
        """Layers per stage."""
        return tuple(hi - lo for lo, hi in self.bounds)

    def layers(self, stage: int) -> range:
        lo, hi = self.bounds[stage]
        return range(lo, hi)

    def stage_of_layer(self, layer: int) -> int:
        for s, (lo, hi) in enumerate(self.bounds):
            if lo <= layer < hi:
                return s
        raise IndexError(f"layer {layer} is not in [0, {self.num_layers})")

    @property
    def imbalance(self) -> float:
        """Largest stage cost over the mean stage cost (1.0 = perfect); 1.0 without costs."""
        if not self.costs or sum(self.costs) == 0:
            return 1.0
        return max(self.costs) / (sum(self.costs) / len(self.costs))

    def describe(self) -> str:
        parts = []
        for s, (lo, hi) in enumerate(self.bounds):
            cost = f", cost {self.costs[s]:g}" if self.costs else ""
            parts.append(f"stage {s}: layers {lo}-{hi - 1}{cost}")
        return "; ".join(parts)


def _check_stages(num_layers: int, stages: int) -> None:
    if not isinstance(stages, int) or isinstance(stages, bool) or stages < 1:
        raise PartitionError(f"stages must be an integer ≥ 1, got {stages!r}")
    if num_layers < stages:
        raise PartitionError(
            f"cannot split a model of {num_layers} layer(s) into {stages} pipeline stages: every stage needs at "
            f"least one layer.\nHINT: use at most {num_layers} stages, or pass the model as a longer nn.Sequential "
            "(e.g. unpack blocks into their layers)")


def _stage_costs(costs: Sequence[float], bounds: Sequence[Tuple[int, int]]) -> Tuple[float, ...]:
    return tuple(float(sum(costs[lo:hi])) for lo, hi in bounds)


def plan_from_split_points(num_layers: int, split_points: Sequence[int],
                           costs: Optional[Sequence[float]] = None) -> PartitionPlan:
    """A plan from explicit boundaries: stage s+1 starts at layer ``split_points[s]``."""
    points = list(split_points)
    bad = [p for p in points if not isinstance(p, int) or isinstance(p, bool)]
    if bad:
        raise PartitionError(f"split points must be integers (layer indices), got {points!r}")
    if any(not 0 < p < num_layers for p in points):
        raise PartitionError(
            f"split points {points} out of range for a model of {num_layers} layers: each must be in "
            f"[1, {num_layers - 1}] (the index of the first layer of the next stage)")
    if any(b <= a for a, b in zip(points, points[1:])):
        raise PartitionError(f"split points must be strictly increasing, got {points}")
    edges = [0] + points + [num_layers]
    bounds = tuple(zip(edges[:-1], edges[1:]))
    return PartitionPlan(num_layers, bounds, _stage_costs(costs, bounds) if costs is not None else ())


def plan_from_sizes(sizes: Sequence[int], costs: Optional[Sequence[float]] = None) -> PartitionPlan:
    """A plan from layer counts per stage (torchgpipe's ``balance=[…]``)."""
    sizes = list(sizes)
    if not sizes or any(not isinstance(n, int) or isinstance(n, bool) or n < 1 for n in sizes):
        raise PartitionError(f"stage sizes must be positive layer counts, got {sizes!r}")
    total = sum(sizes)
    if costs is not None and len(costs) != total:
        raise PartitionError(f"stage sizes {sizes} sum to {total} layers but the model has {len(costs)}")
    edges = [0]
    for n in sizes:
        edges.append(edges[-1] + n)
    bounds = tuple(zip(edges[:-1], edges[1:]))
    return PartitionPlan(total, bounds, _stage_costs(costs, bounds) if costs is not None else ())


def balance(costs: Sequence[float], stages: int) -> PartitionPlan:
    """Split layers with ``costs`` into ``stages`` contiguous non-empty runs, minimising the
    largest run's cost (ties: fewest layers in the largest stage, then earliest split)."""
    costs = [float(c) for c in costs]
    if any(c < 0 or c != c for c in costs):
        raise PartitionError(f"layer costs must be non-negative numbers, got {costs}")
    L = len(costs)
    _check_stages(L, stages)
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    INF = (float("inf"), float("inf"))
    # best[k][i]: (max cost, max layers) splitting the first i layers into k stages
    best = [[INF] * (L + 1) for _ in range(stages + 1)]
    choice = [[-1] * (L + 1) for _ in range(stages + 1)]
    best[0][0] = (0.0, 0)
    for k in range(1, stages + 1):
        for i in range(k, L - (stages - k) + 1):
            for j in range(k - 1, i):
                prev = best[k - 1][j]
                if prev == INF:
                    continue
                cand = (max(prev[0], prefix[i] - prefix[j]), max(prev[1], i - j))
                if _less(cand, best[k][i]):
                    best[k][i], choice[k][i] = cand, j
    edges = [L]
    i = L
    for k in range(stages, 0, -1):
        i = choice[k][i]
        edges.append(i)
    edges.reverse()
    bounds = tuple(zip(edges[:-1], edges[1:]))
    return PartitionPlan(L, bounds, _stage_costs(costs, bounds))


def _less(a: Tuple[float, float], b: Tuple[float, float]) -> bool:
    # costs compare with a relative tolerance so float noise in measured times does not flip ties
    if abs(a[0] - b[0]) > 1e-9 * max(abs(a[0]), abs(b[0]), 1.0):
        return a[0] < b[0]
    return a[1] < b[1]


def plan_partition(costs: Sequence[float], stages: int, split_points: Optional[Sequence[int]] = None,
                   sizes: Optional[Sequence[int]] = None) -> PartitionPlan:
    """The one entry point: explicit ``split_points`` or ``sizes`` win over balancing ``costs``."""
    L = len(costs)
    _check_stages(L, stages)
    if split_points is not None and sizes is not None:
        raise PartitionError("pass either split_points or sizes, not both")
    if split_points is not None:
        if len(list(split_points)) != stages - 1:
            raise PartitionError(f"{stages} stages need {stages - 1} split point(s), got {list(split_points)}")
        return plan_from_split_points(L, split_points, costs)
    if sizes is not None:
        if len(list(sizes)) != stages:
            raise PartitionError(f"{stages} stages need {stages} stage sizes, got {list(sizes)}")
        plan = plan_from_sizes(sizes, costs)
        if plan.num_layers != L:
            raise PartitionError(f"stage sizes {list(sizes)} sum to {plan.num_layers} layers but the model has {L}")
        return plan
    return balance(costs, stages)


def brute_force_best(costs: Sequence[float], stages: int) -> float:
    """The optimal largest-stage cost by enumeration (for tests on small inputs)."""
    from itertools import combinations

    L = len(costs)
    _check_stages(L, stages)
    best = float("inf")
    for cut in combinations(range(1, L), stages - 1):
        edges = [0, *cut, L]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges[:-1], edges[1:])))
    return float(best)


def split_rows(rows: int, parts: int) -> List[Tuple[int, int]]:
    """Row ranges of ``parts`` micro-batches, as even as possible (the first ones one larger),
    like ``torch.tensor_split``. Every part is non-empty."""
    if parts < 1:
        raise ValueError(f"micro_batches must be ≥ 1, got {parts}")
    if rows < parts:
        raise ValueError(f"a batch of {rows} row(s) cannot be split into {parts} micro-batches.\n"
                         f"HINT: use a batch of at least {parts} rows, or fewer micro_batches")
    return chunk_bounds(rows, parts)
